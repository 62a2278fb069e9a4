//! What a run yields (R25).

use serde_json::json;

use crate::checkpoint::Checkpoint;
use crate::failure::RunFailure;
use crate::metrics::Metrics;
use crate::record::ReportRecord;

/// The outcome of [`crate::Trainer::fit`].
///
/// A run that started always yields a result, also when it failed: check
/// [`TrainResult::error`].
///
/// ```no_run
/// let result = trainhost::Trainer::builder("loop.wasm").build()?.fit()?;
/// if let Some(e) = &result.error {
///     eprintln!("failed after {} failures: {e}", result.failures);
/// }
/// std::fs::write("result.json", result.to_json().to_string())?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
#[must_use = "a run may have failed: check `error`"]
pub struct TrainResult {
    /// The run's name.
    pub run_name: String,
    /// The run's storage path (directory or URL).
    pub path: String,
    /// The latest committed checkpoint.
    pub checkpoint: Option<Checkpoint>,
    /// The retained checkpoints, best first (by the score attribute, ties
    /// and unscored runs newest first), with their metrics.
    pub best_checkpoints: Vec<(Checkpoint, Metrics)>,
    /// The last reported metrics (rank 0's).
    pub metrics: Option<Metrics>,
    /// Every report of the run, oldest first, across resumed runs.
    pub metrics_history: Vec<ReportRecord>,
    /// How many times the run failed, restarts included, across resumed
    /// runs.
    pub failures: u32,
    /// Every failure of the run, oldest first.
    pub failure_history: Vec<RunFailure>,
    /// Why the run failed, if it did (after using up its restarts).
    pub error: Option<RunFailure>,
    /// Whether the run stopped early on request (preemption): a rank was
    /// told, or the grace period ran out. Run it again under the same name
    /// to resume. A request no rank heard of before finishing leaves this
    /// false: the work is done.
    pub preempted: bool,
    /// In a run over several hosts, this process's node, of how many:
    /// node 0 holds the run's record, and its result lists the history and
    /// the checkpoints; another node's result carries only the run's name,
    /// path, failure count, error and preemption. `(0, 1)` on one host.
    pub node: (u32, u32),
}

impl TrainResult {
    /// The result as JSON, as the CLI's `--result-json` writes it.
    pub fn to_json(&self) -> serde_json::Value {
        let checkpoint = |c: &Checkpoint| {
            json!({
                "index": c.index(),
                "path": c.location(),
                "metrics": c.metrics(),
                "files": c.manifest().files.len(),
                "bytes": c.manifest().total_bytes(),
                "committed_at": c.manifest().committed_at,
            })
        };
        json!({
            "run_name": self.run_name,
            "path": self.path,
            "checkpoint": self.checkpoint.as_ref().map(checkpoint),
            "best_checkpoints": self.best_checkpoints.iter().map(|(c, _)| checkpoint(c)).collect::<Vec<_>>(),
            "metrics": self.metrics,
            "metrics_history": self.metrics_history,
            "failures": self.failures,
            "failure_history": self.failure_history.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "preempted": self.preempted,
            "node": self.node.0,
            "nodes": self.node.1,
            "error": self.error.as_ref().map(|e| json!({
                "rank": e.rank,
                "kind": format!("{:?}", e.kind),
                "message": e.to_string(),
            })),
        })
    }
}
