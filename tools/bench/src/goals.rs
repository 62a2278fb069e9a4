//! The project's performance goals, the one place the table's goal column
//! and its "met" come from. A row whose baseline is not the one a goal is
//! stated against is a comparison: it says so and claims nothing.

/// `report` without a checkpoint, per round, for 1 to 16 ranks, quiet or
/// with every core busy.
pub const REPORT_NS: f64 = 20e3;
/// Persisting a checkpoint against `cp -r` + `sync` of the same files.
pub const PERSIST_VS_CP_SYNC: f64 = 1.2;
/// A guest blocked in `report` with a 64 MiB checkpoint.
pub const BLOCKED_64MIB_NS: f64 = 5e6;
/// Restart after a failure: the next attempt's first rank running again.
pub const RESTART_NS: f64 = 50e6;
/// A whole CLI run of the example with 2 ranks, guest compiled already.
pub const CLI_WARM_NS: f64 = 0.5e9;
/// The guest's SGD step against the same Rust code run natively.
pub const SGD_VS_NATIVE: f64 = 1.3;
/// S3 upload: at least this many times faster than `aws s3 cp`...
pub const S3_SPEEDUP: f64 = 1.5;
/// ...using at most this share of its CPU time.
pub const S3_CPU_SHARE: f64 = 0.3;
/// Host memory per rank, up to 64 ranks.
pub const RANK_MIB: f64 = 10.0;
/// An all-reduce of 64 MiB f32 against a copy of the same bytes (every
/// rank's buffer read, a result written to every rank).
pub const ALL_REDUCE_VS_COPY: f64 = 2.0;
/// A small all-reduce against `report` without a checkpoint: the same
/// order of magnitude.
pub const SMALL_ALL_REDUCE_VS_REPORT: f64 = 10.0;
/// Data-parallel samples per second with 2 ranks against 1 on 2 cores.
pub const SCALING_2_RANKS: f64 = 1.8;

/// A training step on host kernels in the default (interruptible) mode
/// against the same kernel calls made natively.
pub const KERNEL_STEP_VS_NATIVE: f64 = 1.1;
/// A GEMM through `tensors.gemm` against the gemm crate called natively.
pub const GEMM_VS_CRATE: f64 = 1.05;

/// The Python digits example's training step on host kernels against the
/// Rust example's same step: Python only orchestrates.
pub const PYTHON_STEP_VS_RUST: f64 = 1.5;

/// An all-reduce across 2 nodes against a bare `MPI_Allreduce` of the
/// same bytes between the same processes: at least 0.8 × its bandwidth.
pub const NODES_VS_MPI: f64 = 1.25;
/// The all-reduce of 4 ranks in one trainhost against `MPI_Allreduce`
/// among 4 processes on the same machine.
pub const IN_PROCESS_VS_MPI: f64 = 0.5;

/// The goal column of a row that compares without a goal of its own.
pub fn comparison(what: &str) -> String {
    format!("comparison, no project goal ({what})")
}

/// The goals as BENCHMARKS.md's header states them.
pub fn describe() -> String {
    format!(
        "The **goal** column states the project's goals (`tools/bench/src/goals.rs`): \
         `report` ≤ {} µs a round for 1–16 ranks, quiet or with every core busy; \
         persist ≤ {} × `cp -r` + `sync`; a guest blocked in `report` ≤ {} ms with a \
         64 MiB checkpoint; restart ≤ {} ms; a warm CLI run with 2 ranks ≤ {} s; \
         the guest's SGD ≤ {} × native; S3 upload ≥ {} × faster than `aws s3 cp` \
         with ≤ {} × its CPU; ≤ {} MiB per rank up to 64 ranks; an all-reduce of 64 MiB \
         ≤ {} × a copy of the same bytes, a small one the same order as `report` \
         (< {} ×), data-parallel training ≥ {} × the samples/s with 2 ranks on 2 cores; \
         an all-reduce across 2 nodes ≥ {} × the bandwidth of a bare `MPI_Allreduce` \
         between the same processes, and 4 ranks in one trainhost ≤ {} × the time of \
         `MPI_Allreduce` among 4 processes; a training step on host kernels ≤ {} × \
         the same kernel calls made natively, a GEMM through them ≤ {} × the gemm crate \
         called natively; the Python example's step on host kernels ≤ {} × the Rust \
         example's same step. \
         **met** is computed \
         against them; a row whose baseline is not the one a goal is stated against \
         is marked as a comparison and claims nothing.\n",
        REPORT_NS / 1e3,
        PERSIST_VS_CP_SYNC,
        BLOCKED_64MIB_NS / 1e6,
        RESTART_NS / 1e6,
        CLI_WARM_NS / 1e9,
        SGD_VS_NATIVE,
        S3_SPEEDUP,
        S3_CPU_SHARE,
        RANK_MIB,
        ALL_REDUCE_VS_COPY,
        SMALL_ALL_REDUCE_VS_REPORT,
        SCALING_2_RANKS,
        1.0 / NODES_VS_MPI,
        IN_PROCESS_VS_MPI,
        KERNEL_STEP_VS_NATIVE,
        GEMM_VS_CRATE,
        PYTHON_STEP_VS_RUST,
    )
}
