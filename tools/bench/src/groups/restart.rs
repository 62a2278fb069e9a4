//! Failure to the loop running again with its checkpoint restored.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Result, bail};
use serde_json::json;
use trainhost::{FailureConfig, MaxFailures, RunConfig, Trainer};
use trainhost_test_artifacts::BENCH_GUEST;

use crate::common::{Lines, Paired, Row, Sampling, local_run, sync};
use crate::goals;
use crate::load::Load;

pub(crate) fn restart(quick: bool, cache: &Path) -> Result<Vec<Row>> {
    // Warm the compile cache: the baseline is a warm start.
    trainhost::bench::compile(&std::fs::read(BENCH_GUEST)?, Some(cache))?;
    let mut rows = Vec::new();
    // Quiet; another process writing files (a restart flushes only its own
    // files, so others' writes must not slow it); every core busy.
    let loads = [
        ("", false, false),
        (", another process writing files", false, true),
        (", a busy thread on every core", true, false),
        (
            ", a busy thread on every core and another process writing files",
            true,
            true,
        ),
    ];
    for (under, cpu, writer) in loads {
        let loaded = cpu || writer;
        let mut pairs = Paired::default();
        // Each load starts on a settled disk: the groups before this one
        // leave gigabytes written and deleted, whose write-back would
        // otherwise land in the first loads' samples as an unstated load.
        sync();
        let load = loaded.then(|| Load::start(cpu, writer)).transpose()?;
        // A restart takes tens of milliseconds: more samples are cheap.
        for _ in 0..Sampling::Standard.per_pass(quick) {
            let (first, again) = restart_once(cache)?;
            pairs.push(first, again);
        }
        drop(load);
        rows.push(pairs.row(
            "restart",
            format!("failure → loop running again with its 4 MiB checkpoint restored{under}"),
            format!(
                "the run's first start (open storage, load compiled guest, start rank){}",
                if loaded { ", same load" } else { "" }
            ),
            format!(
                "≤ {} ms (Ray: 3.8 s default, 2.0 s tuned)",
                goals::RESTART_NS / 1e6
            ),
            |_, o| Some(o <= goals::RESTART_NS),
        ));
    }
    Ok(rows)
}

/// One run that commits a checkpoint, fails and restarts: nanoseconds to
/// its first start and from the failure to running again.
fn restart_once(cache: &Path) -> Result<(f64, f64)> {
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
    Ok((started, restarted))
}
