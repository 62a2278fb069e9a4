//! Failure to the loop running again with its checkpoint restored.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Result, bail};
use serde_json::json;
use trainhost::{FailureConfig, MaxFailures, RunConfig, Trainer};
use trainhost_test_artifacts::BENCH_GUEST;

use crate::common::{Lines, Row, Unit, local_run, median};
use crate::goals;

pub(crate) fn restart(reps: usize, cache: &Path) -> Result<Vec<Row>> {
    let (mut first, mut again) = (Vec::new(), Vec::new());
    // Warm the compile cache: the baseline is a warm start.
    trainhost::bench::compile(&std::fs::read(BENCH_GUEST)?, Some(cache))?;
    for _ in 0..reps {
        let storage = tempfile::tempdir()?;
        let lines = Arc::new(Lines::default());
        let t0 = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?;
        let result = Trainer::builder(BENCH_GUEST)
            .train_loop_config(json!({"mode": "restart", "bytes": 4 << 20}))
            .run_config(RunConfig {
                failure_config: FailureConfig {
                    max_failures: MaxFailures::Limited(1),
                },
                ..local_run(storage.path())
            })
            .compile_cache(cache)
            .output(lines.clone())
            .build()?
            .fit()?;
        if let Some(e) = result.error {
            bail!("the restart run failed: {e}");
        }
        let started = lines.value("started_at_us")? as f64 * 1e3 - t0.as_nanos() as f64;
        let restarted =
            (lines.value("running_again_at_us")? - lines.value("failing_at_us")?) as f64 * 1e3;
        first.push(started);
        again.push(restarted);
    }
    let (first, again) = (median(first), median(again));
    Ok(vec![Row {
        group: "restart",
        measure: "failure → loop running again with its 4 MiB checkpoint restored".into(),
        baseline_name: "the run's first start (open storage, load compiled guest, start rank)"
            .into(),
        baseline: first,
        ours: again,
        unit: Unit::Nanos,
        goal: format!(
            "≤ {} ms (Ray: 3.8 s default, 2.0 s tuned)",
            goals::RESTART_NS / 1e6
        ),
        met: Some(again <= goals::RESTART_NS),
        spread: None,
    }])
}
