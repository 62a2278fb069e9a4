//! The burn example's training step in the guest against the same burn
//! code compiled natively: the number host-side tensor kernels must beat.

use std::sync::Arc;

use anyhow::{Result, bail};
use serde_json::json;
use trainhost::{Interruption, MetricValue, RunConfig, ScalingConfig, Trainer};
use trainhost_test_artifacts::DIGITS_BURN;

use crate::common::{Lines, Paired, Row, Sampling, local_run};
use crate::goals;

/// The example's own model and batch, and a larger one where the matrix
/// products dominate.
const SHAPES: [(usize, usize, &str); 2] = [
    (64, 32, "the example's step: MLP 64→64→10, batch 32"),
    (512, 512, "a larger step: MLP 64→512→10, batch 512"),
];

pub(crate) fn burn(quick: bool) -> Result<Vec<Row>> {
    let (train_set, _) = digits_burn::load(0, 200).map_err(anyhow::Error::msg)?;
    let storage = tempfile::tempdir()?;
    let mut rows = Vec::new();
    // About 10 s a sample of both shapes.
    let reps = Sampling::Standard.per_pass(quick);
    for (hidden, batch, what) in SHAPES {
        // About 1 s of native work per sample.
        let steps = match (quick, hidden) {
            (true, _) => 50,
            (false, 64) => 4000,
            (false, _) => 250,
        };
        let native = || digits_burn::time_steps(&train_set, hidden, batch, 0.005, steps);
        let guest = |interruption: Interruption| -> Result<f64> {
            let result = Trainer::builder(DIGITS_BURN)
                .train_loop_config(json!({
                    "bench_steps": steps, "hidden": hidden, "batch_size": batch
                }))
                .scaling_config(ScalingConfig { num_workers: 1 })
                .run_config(RunConfig {
                    interruption,
                    ..local_run(storage.path())
                })
                .output(Arc::new(Lines::default()))
                .build()?
                .fit()?;
            if let Some(e) = &result.error {
                bail!("the burn example failed: {e}");
            }
            let seconds = result
                .metrics
                .as_ref()
                .and_then(|m| m.get("step_seconds"))
                .and_then(MetricValue::as_f64);
            match seconds {
                Some(s) => Ok(s * 1e9),
                None => bail!("the burn example reported no step_seconds"),
            }
        };
        let (mut anywhere, mut at_calls) = (Paired::default(), Paired::default());
        for _ in 0..reps {
            let n = native()? * 1e9;
            anywhere.push(n, guest(Interruption::Anywhere)?);
            at_calls.push(n, guest(Interruption::AtHostCalls)?);
        }
        let baseline =
            "the same burn code compiled natively (release, ndarray backend, one thread)";
        let goal = || goals::comparison("the ratio host-side tensor kernels must beat");
        rows.push(anywhere.row(
            "burn",
            format!("burn training step, {what} (guest: release, simd128; {steps} steps a sample)"),
            baseline.into(),
            goal(),
            |_, _| None,
        ));
        rows.push(at_calls.row(
            "burn",
            "the same, `--interrupt host-calls`".into(),
            baseline.into(),
            goal(),
            |_, _| None,
        ));
    }
    Ok(rows)
}
