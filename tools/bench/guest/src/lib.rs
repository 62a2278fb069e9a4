//! The guest the benchmarks run. The config's `mode` picks what it does;
//! timings are taken inside the guest with the WASI monotonic clock and
//! reported as metrics of the last report (or printed, across a restart).

use std::fs;
use std::hint::black_box;
use std::path::Path;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::Deserialize;
use trainhost_bench_kernel::Loops;
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
    /// of `batch` rows; with `blocked`, its loops written in blocks of 16.
    Sgd {
        steps: u32,
        dim: usize,
        batch: usize,
        #[serde(default)]
        blocked: bool,
    },
    /// First attempt: commit a checkpoint of `bytes`, print the time and
    /// trap. Second: restore it, print the time, return.
    Restart { bytes: u64 },
    /// One report, then return.
    Start,
    /// `calls` all-reduces (f32, sum) of `floats` values, then as many
    /// reports without a checkpoint.
    AllReduce { floats: usize, calls: u32 },
    /// `calls` host GEMMs of `n × n × n` (`c = a · b`).
    Gemm { n: u32, calls: u32 },
    /// `calls` kernel calls on a one-value tensor (`scale`), then as many
    /// calls of a trivial import (`world-rank`).
    KernelCall { calls: u32 },
    /// `calls` all-reduces (f32, sum) of `floats` values as a list, then as
    /// many of a host tensor of as many values.
    TensorAllReduce { floats: usize, calls: u32 },
}

fn train(bench: Bench) -> Result<(), String> {
    match bench {
        Bench::Report { reports } => report_loop(reports),
        Bench::Checkpoint {
            files,
            reports,
            hand_over,
        } => checkpoints(&files, reports, hand_over),
        Bench::Sgd {
            steps,
            dim,
            batch,
            blocked,
        } => sgd(steps, dim, batch, blocked),
        Bench::Restart { bytes } => restart(bytes),
        Bench::Start => report(Metrics::new().with("started", true), None),
        Bench::AllReduce { floats, calls } => all_reduce(floats, calls),
        Bench::Gemm { n, calls } => gemm(n, calls),
        Bench::KernelCall { calls } => kernel_call(calls),
        Bench::TensorAllReduce { floats, calls } => tensor_all_reduce(floats, calls),
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
    use trainhost_guest::tensor::Tensor;
    let mut data = vec![1.0f32; floats];
    // The untimed first call grows the guest's memory for the result.
    let all_reduce_ns = median_ns(calls, || {
        collective::all_reduce(&mut data, Op::Sum).map_err(|e| e.to_string())
    })?;
    drop(data);
    // The same values in a host tensor: combined in place, without
    // crossing into the guest.
    let mut t = Tensor::zeros(&[floats as u32]).map_err(|e| e.to_string())?;
    let tensor_ns = median_ns(calls, || t.all_reduce(Op::Sum).map_err(|e| e.to_string()))?;
    drop(t);
    let started = Instant::now();
    for i in 0..calls {
        report(Metrics::new().with("i", i), None)?;
    }
    let report_ns = per_call(started.elapsed(), calls);
    report(
        Metrics::new()
            .with("all_reduce_ns", all_reduce_ns)
            .with("tensor_all_reduce_ns", tensor_ns)
            .with("report_ns", report_ns),
        None,
    )
}

/// The median of `calls` timings of `f`, after one untimed call.
fn median_ns(calls: u32, mut f: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
    f()?;
    let mut times = Vec::with_capacity(calls as usize);
    for _ in 0..calls.max(1) {
        let started = Instant::now();
        f()?;
        times.push(started.elapsed().as_nanos() as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn gemm(n: u32, calls: u32) -> Result<(), String> {
    use trainhost_guest::tensor::Tensor;
    let e = |e: trainhost_guest::tensor::TensorError| e.to_string();
    let a = Tensor::uniform(&[n, n], -1.0, 1.0, 1).map_err(e)?;
    let b = Tensor::uniform(&[n, n], -1.0, 1.0, 2).map_err(e)?;
    let mut c = Tensor::zeros(&[n, n]).map_err(e)?;
    let gemm_ns = median_ns(calls, || c.gemm(1.0, &a, false, &b, false, 0.0).map_err(e))?;
    report(Metrics::new().with("gemm_ns", gemm_ns), None)
}

fn kernel_call(calls: u32) -> Result<(), String> {
    use trainhost_guest::tensor::Tensor;
    let mut t = Tensor::zeros(&[1]).map_err(|e| e.to_string())?;
    let started = Instant::now();
    for _ in 0..calls {
        t.scale(black_box(1.0));
    }
    let kernel_ns = per_call(started.elapsed(), calls);
    let started = Instant::now();
    for _ in 0..calls {
        black_box(trainhost_guest::world_rank());
    }
    let call_ns = per_call(started.elapsed(), calls);
    report(
        Metrics::new()
            .with("kernel_ns", kernel_ns)
            .with("call_ns", call_ns),
        None,
    )
}

fn tensor_all_reduce(floats: usize, calls: u32) -> Result<(), String> {
    use trainhost_guest::collective::{self, Op};
    use trainhost_guest::tensor::Tensor;
    let mut data = vec![1.0f32; floats];
    let list_ns = median_ns(calls, || {
        collective::all_reduce(&mut data, Op::Sum).map_err(|e| e.to_string())
    })?;
    let mut t = Tensor::from_slice(&[floats as u32], &data).map_err(|e| e.to_string())?;
    let tensor_ns = median_ns(calls, || t.all_reduce(Op::Sum).map_err(|e| e.to_string()))?;
    report(
        Metrics::new()
            .with("list_ns", list_ns)
            .with("tensor_ns", tensor_ns),
        None,
    )
}

fn write_files(dir: &Path, files: &[(u32, u64)], seed: u64) -> Result<(), String> {
    trainhost_bench_kernel::write_layout(dir, files, seed).map_err(|e| e.to_string())
}

fn checkpoints(files: &[(u32, u64)], reports: u32, hand_over: bool) -> Result<(), String> {
    let dir = Path::new("ck");
    let mut first_ns = 0.0;
    // Rewriting the files right after the first report: in the default
    // mode this waits for the host to finish linking them (R51).
    let mut rewrite_ns = 0.0;
    let mut changed = std::time::Duration::ZERO;
    for r in 0..reports {
        let started = Instant::now();
        write_files(dir, files, u64::from(r) + 1)?;
        if r == 1 {
            rewrite_ns = started.elapsed().as_nanos() as f64;
        }
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
            .with("rewrite_ns", rewrite_ns)
            .with("changed_ns", per_call(changed, reports - 1))
            .with("unchanged_ns", unchanged_ns),
        None,
    )
}

fn sgd(steps: u32, dim: usize, batch: usize, blocked: bool) -> Result<(), String> {
    let loops = match blocked {
        true => Loops::Blocked,
        false => Loops::Plain,
    };
    let (step_ns, loss) = trainhost_bench_kernel::time_sgd(steps, dim, batch, loops);
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
