//! The measures, one module per group of BENCHMARKS.md.

pub(crate) mod blocked;
pub(crate) mod burn;
pub(crate) mod cli;
pub(crate) mod collective;
pub(crate) mod nodes;
pub(crate) mod persist;
pub(crate) mod python;
pub(crate) mod ranks;
pub(crate) mod report;
pub(crate) mod restart;
pub(crate) mod s3;
pub(crate) mod sgd;
pub(crate) mod tensors;
