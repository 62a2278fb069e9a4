//! A recorded program (`tensors.program`): the kernel calls, their
//! tensors by slot in the rank's table, and its runs so far. Recording is
//! in `program.rs` and running in `program_run.rs`; this file holds only
//! the record, in the host's own types, so that the bindings can name it
//! as the resource's type.

use std::sync::Arc;

use crate::collective::Op;
use crate::tensor::{Activation, AdamStep};

/// The most kernels one program holds: a step's worth many times over,
/// and a bound on what a guest can make the host keep.
pub(super) const MAX_KERNELS: usize = 4096;

/// A recorded program: the kernels, the tensors they name, and how many
/// runs got past their checks.
#[derive(Debug, Default)]
pub struct Program {
    /// Shared with a run in progress, which calls back into the rank.
    pub(super) kernels: Arc<Vec<Kernel>>,
    /// Every tensor the kernels name, with its slot's drop count when
    /// recorded.
    pub(super) names: Vec<Named>,
    /// The bytes counted against the memory limit for this program.
    pub(super) bytes: u64,
    /// Runs that got past their checks: Adam's step counts on with them.
    pub(super) runs: u32,
}

/// A tensor a kernel names: its slot, and the slot's drop count then.
#[derive(Debug, Clone, Copy)]
pub(super) struct Named {
    pub rep: u32,
    pub drops: u32,
    /// The kernel that names it, for the message.
    pub kernel: u32,
}

/// One recorded kernel call, tensors by their slots in the rank's table.
#[derive(Debug, Clone)]
pub(super) enum Kernel {
    GatherRows {
        out: u32,
        source: u32,
        /// `out`'s rows: how many rows a run must give.
        rows: usize,
        /// `source`'s rows: every row given must be below.
        bound: usize,
    },
    Gemm {
        c: u32,
        alpha: f32,
        a: u32,
        trans_a: bool,
        b: u32,
        trans_b: bool,
        beta: f32,
    },
    Axpy {
        y: u32,
        alpha: f32,
        x: u32,
    },
    Scale {
        x: u32,
        alpha: f32,
    },
    AddRow {
        x: u32,
        row: u32,
    },
    SumRows {
        out: u32,
        x: u32,
        beta: f32,
    },
    Activate {
        x: u32,
        f: Activation,
    },
    ActivateBackward {
        grad: u32,
        output: u32,
        f: Activation,
    },
    Dense {
        out: u32,
        x: u32,
        w: u32,
        bias: Option<u32>,
        f: Option<Activation>,
    },
    DenseBackward {
        grad: u32,
        x: u32,
        w: u32,
        beta: f32,
        grad_w: u32,
        grad_bias: Option<u32>,
        grad_x: Option<u32>,
        x_f: Option<Activation>,
    },
    SoftmaxCrossEntropy {
        logits: u32,
        /// A label per row of the data set the run's rows index.
        labels: Vec<u32>,
        grad: u32,
        grad_scale: f32,
        /// `logits`' rows: how many rows a run must give.
        rows: usize,
    },
    SgdMomentumList {
        params: Vec<u32>,
        velocity: Vec<u32>,
        grads: Vec<u32>,
        grad_scale: f32,
        lr: f32,
        momentum: f32,
    },
    Adam {
        param: u32,
        m: u32,
        v: u32,
        grad: u32,
        hyper: AdamStep,
    },
    AllReduceList {
        ts: Vec<u32>,
        op: Op,
    },
}

impl Kernel {
    /// Its name in the interface.
    pub fn name(&self) -> &'static str {
        match self {
            Kernel::GatherRows { .. } => "gather-rows",
            Kernel::Gemm { .. } => "gemm",
            Kernel::Axpy { .. } => "axpy",
            Kernel::Scale { .. } => "scale",
            Kernel::AddRow { .. } => "add-row",
            Kernel::SumRows { .. } => "sum-rows",
            Kernel::Activate { .. } => "activate",
            Kernel::ActivateBackward { .. } => "activate-backward",
            Kernel::Dense { .. } => "dense",
            Kernel::DenseBackward { .. } => "dense-backward",
            Kernel::SoftmaxCrossEntropy { .. } => "softmax-cross-entropy",
            Kernel::SgdMomentumList { .. } => "sgd-momentum-list",
            Kernel::Adam { .. } => "adam",
            Kernel::AllReduceList { .. } => "all-reduce-list",
        }
    }

    /// The host memory it keeps, counted against the memory limit (the
    /// [`Named`] entries of its tensors, kept beside it, are counted apart).
    pub fn bytes(&self) -> u64 {
        let lists = match self {
            Kernel::SoftmaxCrossEntropy { labels, .. } => labels.len(),
            Kernel::SgdMomentumList {
                params,
                velocity,
                grads,
                ..
            } => params.len() + velocity.len() + grads.len(),
            Kernel::AllReduceList { ts, .. } => ts.len(),
            _ => 0,
        };
        (size_of::<Kernel>() + lists * size_of::<u32>()) as u64
    }
}
