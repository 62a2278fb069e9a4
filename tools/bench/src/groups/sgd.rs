//! The guest's maths against the same code run natively.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, bail};
use serde_json::json;
use trainhost::{Interruption, ResourceLimits, RunConfig};
use trainhost_bench_kernel::Loops;

use crate::common::{Paired, Row, Sampling, local_run, metric, run_guest};
use crate::goals;

pub(crate) fn sgd(quick: bool) -> Result<Vec<Row>> {
    // About 1 s of native work per sample (3.3 µs a step here): shorter
    // samples moved the ratios by a third between re-runs.
    let (steps, dim, batch) = (if quick { 30_000 } else { 300_000 }, 256, 64);
    // Samples of a second each: as many as any row are cheap.
    let reps = Sampling::Standard.per_pass(quick);
    let native = |loops| trainhost_bench_kernel::time_sgd(steps, dim, batch, loops);
    let storage = tempfile::tempdir()?;
    let config = |loops| json!({"mode": "sgd", "steps": steps, "dim": dim, "batch": batch, "blocked": loops == Loops::Blocked});
    let guest =
        |limits: &ResourceLimits, interruption: Interruption, loops: Loops| -> Result<(f64, f64)> {
            let result = run_guest(
                config(loops),
                1,
                RunConfig {
                    limits: limits.clone(),
                    interruption,
                    ..local_run(storage.path())
                },
                Arc::default(),
            )?;
            Ok((metric(&result, "step_ns")?, metric(&result, "loss")?))
        };
    let limited = ResourceLimits {
        max_memory: Some(1 << 30),
        stall_timeout: Some(Duration::from_secs(600)),
        attempt_timeout: Some(Duration::from_secs(3600)),
        max_output_rate: Some(1 << 20),
        max_checkpoint_bytes: Some(1 << 30),
        ..ResourceLimits::default()
    };
    let unlimited = ResourceLimits {
        max_memory: None,
        stall_timeout: None,
        attempt_timeout: None,
        max_output_rate: None,
        max_checkpoint_bytes: None,
        ..ResourceLimits::default()
    };
    let (mut guest_vs_native, mut calls_vs_native, mut limits_cost, mut blocked_vs_native) = (
        Paired::default(),
        Paired::default(),
        Paired::default(),
        Paired::default(),
    );
    let agree = |native_loss: f32, losses: &[f64]| -> Result<()> {
        for &loss in losses {
            if (f64::from(native_loss) - loss).abs() > 1e-3 * loss.abs().max(1e-6) {
                bail!("native and guest SGD disagree: loss {native_loss} vs {loss}");
            }
        }
        Ok(())
    };
    for _ in 0..reps {
        let (native_ns, native_loss) = native(Loops::Plain);
        let (guest_ns, guest_loss) = guest(&unlimited, Interruption::Anywhere, Loops::Plain)?;
        let (calls_ns, calls_loss) = guest(&unlimited, Interruption::AtHostCalls, Loops::Plain)?;
        let (limited_ns, _) = guest(&limited, Interruption::Anywhere, Loops::Plain)?;
        agree(native_loss, &[guest_loss, calls_loss])?;
        let (native_blocked_ns, native_blocked_loss) = native(Loops::Blocked);
        let (blocked_ns, blocked_loss) = guest(&unlimited, Interruption::Anywhere, Loops::Blocked)?;
        agree(native_blocked_loss, &[blocked_loss])?;
        guest_vs_native.push(native_ns, guest_ns);
        calls_vs_native.push(native_ns, calls_ns);
        limits_cost.push(guest_ns, limited_ns);
        blocked_vs_native.push(native_blocked_ns, blocked_ns);
    }
    let native_goal = |b: f64, o: f64| Some(o <= goals::SGD_VS_NATIVE * b);
    Ok(vec![
        guest_vs_native.row(
            "sgd",
            format!(
                "SGD step, linear model, {dim} features × {batch} rows (guest: release, simd128; samples of {steps} steps)"
            ),
            "the same Rust code compiled natively (release)".into(),
            format!("≤ {} × native", goals::SGD_VS_NATIVE),
            native_goal,
        ),
        calls_vs_native.row(
            "sgd",
            "SGD step as above, `--interrupt host-calls` (no epoch checks in the guest's loops)".into(),
            "the same Rust code compiled natively (release)".into(),
            format!("≤ {} × native", goals::SGD_VS_NATIVE),
            native_goal,
        ),
        blocked_vs_native.row(
            "sgd",
            "SGD step as above with its loops written in blocks of 16 (`sgd_step_blocked`, default interruption)".into(),
            "the same blocked code compiled natively (release)".into(),
            goals::comparison(
                "what a guest's loops written in blocks recover of the epoch checks' cost",
            ),
            |_, _| None,
        ),
        limits_cost.row(
            "sgd",
            "SGD step in the guest with every limit set (memory, stall, wall clock, output, checkpoint size)".into(),
            "the same guest without limits".into(),
            goals::comparison("what the limits cost"),
            |_, _| None,
        ),
    ])
}
