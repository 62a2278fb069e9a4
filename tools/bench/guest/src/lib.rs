//! The guest the benchmarks run. The config's `mode` picks what it does;
//! timings are taken inside the guest with the WASI monotonic clock and
//! reported as metrics of the last report (or printed, across a restart).

use std::fs;
use std::hint::black_box;
use std::path::Path;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::Deserialize;
use trainhost_guest::{Checkpoint, Metrics};

#[derive(Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
enum Bench {
    /// `reports` reports without a checkpoint, then as many calls of a
    /// trivial import (`world-rank`) for the floor of a host call.
    Report { reports: u32 },
    /// A checkpoint of `files` (count, size in bytes each) reported
    /// `reports` times with new bytes each time, then once unchanged
    /// (rewritten with the same bytes when handed over). With `hand_over`
    /// the directory is handed over to the host instead of copied.
    Checkpoint {
        files: Vec<(u32, u64)>,
        reports: u32,
        #[serde(default)]
        hand_over: bool,
    },
    /// `steps` SGD steps of a linear model with `dim` features on batches
    /// of `batch` rows.
    Sgd {
        steps: u32,
        dim: usize,
        batch: usize,
    },
    /// First attempt: commit a checkpoint of `bytes`, print the time and
    /// trap. Second: restore it, print the time, return.
    Restart { bytes: u64 },
    /// One report, then return.
    Start,
    /// `calls` all-reduces (f32, sum) of `floats` values, then as many
    /// reports without a checkpoint.
    AllReduce { floats: usize, calls: u32 },
}

fn train(bench: Bench) -> Result<(), String> {
    match bench {
        Bench::Report { reports } => report_loop(reports),
        Bench::Checkpoint {
            files,
            reports,
            hand_over,
        } => checkpoints(&files, reports, hand_over),
        Bench::Sgd { steps, dim, batch } => sgd(steps, dim, batch),
        Bench::Restart { bytes } => restart(bytes),
        Bench::Start => report(Metrics::new().with("started", true), None),
        Bench::AllReduce { floats, calls } => all_reduce(floats, calls),
    }
}

trainhost_guest::entry!(train);

fn report(metrics: Metrics, checkpoint: Option<&str>) -> Result<(), String> {
    trainhost_guest::report(metrics, checkpoint.map(Checkpoint::from_directory))
        .map_err(|e| e.to_string())
}

fn report_checkpoint(metrics: Metrics, dir: &str, hand_over: bool) -> Result<(), String> {
    let checkpoint = Checkpoint::from_directory(dir);
    let checkpoint = if hand_over {
        checkpoint.hand_over()
    } else {
        checkpoint
    };
    trainhost_guest::report(metrics, Some(checkpoint)).map_err(|e| e.to_string())
}

fn per_call(elapsed: std::time::Duration, n: u32) -> f64 {
    elapsed.as_nanos() as f64 / f64::from(n.max(1))
}

fn report_loop(reports: u32) -> Result<(), String> {
    let started = Instant::now();
    for i in 0..reports {
        report(Metrics::new().with("i", i), None)?;
    }
    let report_ns = per_call(started.elapsed(), reports);
    let started = Instant::now();
    for _ in 0..reports {
        black_box(trainhost_guest::world_rank());
    }
    let call_ns = per_call(started.elapsed(), reports);
    report(
        Metrics::new()
            .with("report_ns", report_ns)
            .with("call_ns", call_ns),
        None,
    )
}

fn all_reduce(floats: usize, calls: u32) -> Result<(), String> {
    use trainhost_guest::collective::{self, Op};
    let mut data = vec![1.0f32; floats];
    // Warm up: the first call grows the guest's memory for the result.
    collective::all_reduce(&mut data, Op::Sum).map_err(|e| e.to_string())?;
    let mut times = Vec::with_capacity(calls as usize);
    for _ in 0..calls {
        let started = Instant::now();
        collective::all_reduce(&mut data, Op::Sum).map_err(|e| e.to_string())?;
        times.push(started.elapsed().as_nanos() as f64);
    }
    times.sort_by(f64::total_cmp);
    let all_reduce_ns = times[times.len() / 2];
    let started = Instant::now();
    for i in 0..calls {
        report(Metrics::new().with("i", i), None)?;
    }
    let report_ns = per_call(started.elapsed(), calls);
    report(
        Metrics::new()
            .with("all_reduce_ns", all_reduce_ns)
            .with("report_ns", report_ns),
        None,
    )
}

fn write_files(dir: &Path, files: &[(u32, u64)], seed: u64) -> Result<(), String> {
    trainhost_bench_kernel::write_layout(dir, files, seed).map_err(|e| e.to_string())
}

fn checkpoints(files: &[(u32, u64)], reports: u32, hand_over: bool) -> Result<(), String> {
    let dir = Path::new("ck");
    let mut first_ns = 0.0;
    let mut changed = std::time::Duration::ZERO;
    for r in 0..reports {
        write_files(dir, files, u64::from(r) + 1)?;
        let started = Instant::now();
        report_checkpoint(Metrics::new().with("r", r), "ck", hand_over)?;
        if r == 0 {
            first_ns = started.elapsed().as_nanos() as f64;
        } else {
            changed += started.elapsed();
        }
    }
    if hand_over {
        write_files(dir, files, u64::from(reports))?;
    }
    let started = Instant::now();
    report_checkpoint(Metrics::new().with("r", reports), "ck", hand_over)?;
    let unchanged_ns = started.elapsed().as_nanos() as f64;
    report(
        Metrics::new()
            .with("first_ns", first_ns)
            .with("changed_ns", per_call(changed, reports - 1))
            .with("unchanged_ns", unchanged_ns),
        None,
    )
}

fn sgd(steps: u32, dim: usize, batch: usize) -> Result<(), String> {
    let (step_ns, loss) = trainhost_bench_kernel::time_sgd(steps, dim, batch);
    report(
        Metrics::new()
            .with("step_ns", step_ns)
            .with("loss", f64::from(loss)),
        None,
    )
}

fn wall_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros())
        .unwrap_or_default()
}

fn restart(bytes: u64) -> Result<(), String> {
    match trainhost_guest::get_checkpoint() {
        None => {
            println!("started_at_us {}", wall_us());
            write_files(Path::new("ck"), &[(1, bytes)], 1)?;
            report(Metrics::new().with("attempt", 0), Some("ck"))?;
            println!("failing_at_us {}", wall_us());
            panic!("planned failure");
        }
        Some(checkpoint) => {
            let mut read = 0;
            for entry in
                fs::read_dir(checkpoint.path().join("group-0")).map_err(|e| e.to_string())?
            {
                read += fs::read(entry.map_err(|e| e.to_string())?.path())
                    .map_err(|e| e.to_string())?
                    .len() as u64;
            }
            if read != bytes {
                return Err(format!("restored {read} bytes, expected {bytes}"));
            }
            println!("running_again_at_us {}", wall_us());
            report(Metrics::new().with("attempt", 1), None)
        }
    }
}
