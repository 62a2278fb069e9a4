//! trainhost's benchmark suite. Every measure runs with its baseline in the
//! same invocation, and the ratio between the two is what counts: absolute
//! times on a shared machine move from run to run, ratios much less.
//!
//! Run it with `scripts/bench.sh` (which installs the S3 server and the AWS
//! CLI and builds in release mode); `--write BENCHMARKS.md` regenerates the
//! results file.

mod goals;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use serde_json::{Value, json};
use trainhost::{
    CheckpointConfig, FailureConfig, Interruption, MaxFailures, MetricValue, OutputSink,
    ResourceLimits, RunConfig, ScalingConfig, StorageOptions, Stream, TrainResult, Trainer,
};
use trainhost_test_artifacts::{BENCH_GUEST, LINEAR_REGRESSION};

#[derive(Parser, Debug)]
#[command(about = "Run trainhost's benchmarks, each against a baseline in the same run")]
struct Args {
    /// Smaller sizes and fewer repetitions (a smoke run; the figures are
    /// noisier).
    #[arg(long)]
    quick: bool,
    /// Write the results as Markdown to this file (e.g. BENCHMARKS.md).
    #[arg(long, value_name = "FILE")]
    write: Option<PathBuf>,
    /// Run only the groups whose names contain one of these words
    /// (report, persist, blocked, restart, cli, sgd, s3, ranks).
    #[arg(long, value_name = "GROUP")]
    only: Vec<String>,
    /// The `trainhost` binary for the CLI measures. Default: next to this
    /// program.
    #[arg(long, value_name = "FILE")]
    trainhost: Option<PathBuf>,
    /// Internal: run N ranks once and print wall time and peak memory.
    #[arg(long, hide = true, value_name = "N")]
    child_ranks: Option<u32>,
    /// Internal: the compile cache for --child-ranks.
    #[arg(long, hide = true)]
    child_cache: Option<PathBuf>,
}

/// One line of the results: a measure, its baseline and the goal.
struct Row {
    group: &'static str,
    measure: String,
    baseline_name: String,
    baseline: f64,
    ours: f64,
    unit: Unit,
    goal: String,
    /// Whether the goal is met, when it is a number.
    met: Option<bool>,
}

#[derive(Clone, Copy)]
enum Unit {
    Nanos,
    Bytes,
}

impl Unit {
    fn show(self, v: f64) -> String {
        match self {
            Unit::Nanos if v >= 1e9 => format!("{:.2} s", v / 1e9),
            Unit::Nanos if v >= 1e6 => format!("{:.1} ms", v / 1e6),
            Unit::Nanos if v >= 1e3 => format!("{:.1} µs", v / 1e3),
            Unit::Nanos => format!("{v:.0} ns"),
            Unit::Bytes => format!("{:.1} MiB", v / (1024.0 * 1024.0)),
        }
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(n) = args.child_ranks {
        return child_ranks(n, args.child_cache.as_deref());
    }
    let want = |group: &str| args.only.is_empty() || args.only.iter().any(|o| group.contains(o));
    let reps = if args.quick { 1 } else { 3 };
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    let started = Instant::now();
    let cache = tempfile::tempdir()?;
    if want("report") {
        rows.extend(report(args.quick)?);
    }
    if want("persist") {
        rows.extend(persist_local(args.quick, reps)?);
    }
    if want("blocked") {
        rows.extend(blocked(args.quick, reps)?);
    }
    if want("restart") {
        rows.extend(restart(reps, cache.path())?);
    }
    if want("cli") {
        let bin = match &args.trainhost {
            Some(b) => b.clone(),
            None => std::env::current_exe()?.with_file_name("trainhost"),
        };
        if bin.exists() {
            rows.extend(cli(&bin, if args.quick { 2 } else { 7 })?);
        } else {
            skipped.push(format!(
                "cli: no trainhost binary at {} (build it with `cargo build --release -p trainhost`)",
                bin.display()
            ));
        }
    }
    if want("sgd") {
        rows.extend(sgd(args.quick, reps)?);
    }
    if want("s3") {
        match s3(args.quick, reps) {
            Ok(r) => rows.extend(r),
            Err(e) => skipped.push(format!("s3: {e:#}")),
        }
    }
    if want("ranks") {
        rows.extend(ranks(args.quick, cache.path())?);
    }
    let table = markdown(&rows);
    println!("{table}");
    for s in &skipped {
        println!("skipped {s}");
    }
    if let Some(path) = &args.write {
        let command = std::env::args().skip(1).collect::<Vec<_>>().join(" ");
        write_results(path, &table, &skipped, &command, started.elapsed())?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Collects the ranks' output lines.
#[derive(Default)]
struct Lines(Mutex<Vec<String>>);

impl OutputSink for Lines {
    fn line(&self, _rank: u32, _stream: Stream, line: &str) {
        self.0.lock().unwrap().push(line.to_owned());
    }
}

impl Lines {
    /// The number after `key ` in the first line that starts with it.
    fn value(&self, key: &str) -> Result<u128> {
        let lines = self.0.lock().unwrap();
        let line = lines
            .iter()
            .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix(' ')))
            .with_context(|| format!("the guest printed no {key}: {lines:?}"))?;
        Ok(line.trim().parse()?)
    }
}

/// Run the bench guest with `config` and return the result.
fn run_guest(
    config: Value,
    workers: u32,
    run: RunConfig,
    lines: Arc<Lines>,
) -> Result<TrainResult> {
    let result = Trainer::builder(BENCH_GUEST)
        .train_loop_config(config)
        .scaling_config(ScalingConfig {
            num_workers: workers,
        })
        .run_config(run)
        .output(lines)
        .build()?
        .fit()?;
    if let Some(e) = &result.error {
        bail!("the bench guest failed: {e}");
    }
    Ok(result)
}

fn local_run(storage: &Path) -> RunConfig {
    RunConfig {
        name: Some("bench".into()),
        storage_path: storage.display().to_string(),
        fresh: true,
        ..RunConfig::default()
    }
}

/// A float metric of the last report.
fn metric(result: &TrainResult, name: &str) -> Result<f64> {
    let metrics = result.metrics.as_ref().context("no report")?;
    match metrics.get(name) {
        Some(MetricValue::Float(v)) => Ok(*v),
        Some(MetricValue::Integer(v)) => Ok(*v as f64),
        other => bail!("metric {name} is {other:?}"),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

// ---------------------------------------------------------------- report

fn report(quick: bool) -> Result<Vec<Row>> {
    let reports = if quick { 2_000 } else { 20_000 };
    let mut rows = Vec::new();
    let storage = tempfile::tempdir()?;
    let mut blocking_ns = 0.0;
    for (workers, background) in [(1, false), (1, true), (2, true), (4, true), (16, true)] {
        let result = run_guest(
            json!({"mode": "report", "reports": reports}),
            workers,
            RunConfig {
                persist_in_background: background,
                ..local_run(storage.path())
            },
            Arc::default(),
        )?;
        let (report_ns, call_ns) = (metric(&result, "report_ns")?, metric(&result, "call_ns")?);
        if !background {
            blocking_ns = report_ns;
            continue;
        }
        rows.push(Row {
            group: "report",
            measure: format!("`report` without checkpoint, {workers} rank(s)"),
            baseline_name: "a trivial host call (`world-rank`)".into(),
            baseline: call_ns,
            ours: report_ns,
            unit: Unit::Nanos,
            goal: format!(
                "≤ {} µs a round (Ray: 2 s default, 4 ms tuned)",
                goals::REPORT_NS / 1e3
            ),
            met: Some(report_ns <= goals::REPORT_NS),
        });
        if workers > 1 {
            // The same with every core busy with other work, as on a shared
            // training machine: a waiting rank must not take the core the
            // rank it waits for needs.
            let load = Load::start();
            let result = run_guest(
                json!({"mode": "report", "reports": reports}),
                workers,
                local_run(storage.path()),
                Arc::default(),
            )?;
            drop(load);
            let (loaded_ns, call_ns) = (metric(&result, "report_ns")?, metric(&result, "call_ns")?);
            rows.push(Row {
                group: "report",
                measure: format!(
                    "`report` without checkpoint, {workers} rank(s), a busy thread on every core"
                ),
                baseline_name: "a trivial host call (`world-rank`), same load".into(),
                baseline: call_ns,
                ours: loaded_ns,
                unit: Unit::Nanos,
                goal: format!("≤ {} µs a round", goals::REPORT_NS / 1e3),
                met: Some(loaded_ns <= goals::REPORT_NS),
            });
        }
        if workers == 1 {
            rows.push(Row {
                group: "report",
                measure: "`report` without checkpoint, 1 rank: background vs --wait-for-upload"
                    .into(),
                baseline_name: "--wait-for-upload (history stored per report)".into(),
                baseline: blocking_ns,
                ours: report_ns,
                unit: Unit::Nanos,
                goal: goals::comparison("what waiting for storage costs"),
                met: None,
            });
        }
    }
    Ok(rows)
}

/// One CPU-bound thread per core, competing with the ranks until dropped.
struct Load {
    stop: Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start() -> Self {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let threads = (0..cores)
            .map(|_| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    let mut x = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        x = std::hint::black_box(
                            x.wrapping_mul(6364136223846793005).wrapping_add(1),
                        );
                    }
                })
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

// --------------------------------------------------------------- persist

/// A checkpoint of `total` bytes: half in small files, half in four large
/// ones. (count, size) per group, as the bench guest takes them.
fn layout(total: u64) -> Vec<(u32, u64)> {
    let small = if total >= 1 << 30 {
        256 << 10
    } else {
        64 << 10
    };
    vec![((total / 2 / small) as u32, small), (4, total / 8)]
}

fn size_name(total: u64) -> String {
    if total >= 1 << 30 {
        format!("{} GiB", total >> 30)
    } else {
        format!("{} MiB", total >> 20)
    }
}

fn describe(layout: &[(u32, u64)]) -> String {
    layout
        .iter()
        .map(|(n, s)| format!("{n} × {}", Unit::Bytes.show(*s as f64)))
        .collect::<Vec<_>>()
        .join(" + ")
}

/// Wall time of a command, and the CPU time it used (user + system).
fn time_command(cmd: &mut Command) -> Result<(Duration, Duration)> {
    let cpu = children_cpu();
    let started = Instant::now();
    let out = cmd
        .output()
        .with_context(|| format!("cannot run {cmd:?}"))?;
    let wall = started.elapsed();
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok((wall, children_cpu().saturating_sub(cpu)))
}

/// Write every dirty page back to disk.
fn sync() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
}

fn rusage(who: libc::c_int) -> Duration {
    // SAFETY: getrusage writes one struct rusage, which we provide zeroed.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(who, &mut usage);
        usage
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

fn self_cpu() -> Duration {
    rusage(libc::RUSAGE_SELF)
}

fn children_cpu() -> Duration {
    rusage(libc::RUSAGE_CHILDREN)
}

/// The checkpoint sizes the persist and blocked groups measure.
fn checkpoint_sizes(quick: bool) -> &'static [u64] {
    if quick {
        &[64 << 20]
    } else {
        &[64 << 20, 1 << 30]
    }
}

fn persist_local(quick: bool, reps: usize) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &total in checkpoint_sizes(quick) {
        let layout = layout(total);
        let work = tempfile::tempdir()?;
        let src = work.path().join("src");
        trainhost_bench_kernel::write_layout(&src, &layout, 1)?;
        let (mut cp, mut cp_sync, mut cp_hash, mut ours) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        // A small checkpoint is written in tens of milliseconds, where
        // scheduling noise is large: take more samples.
        let reps = if total <= 64 << 20 { reps * 3 } else { reps };
        for i in 0..reps {
            let dst = work.path().join(format!("cp-{i}"));
            // Start both from a clean page cache state: the previous
            // repetition's dirty pages would otherwise be written back
            // during the next measure.
            sync();
            let (wall, _) = time_command(Command::new("cp").arg("-r").arg(&src).arg(&dst))?;
            cp.push(wall.as_nanos() as f64);
            // A committed checkpoint is on disk (R11); a copy is not until
            // its dirty pages are written back.
            let started = Instant::now();
            sync();
            cp_sync.push((wall + started.elapsed()).as_nanos() as f64);
            // The same work by two tools: copy, then checksum every copy.
            let hash = format!(
                "find {0} -type f -exec sha256sum {{}} + > /dev/null",
                dst.display()
            );
            let (hashed, _) = time_command(Command::new("sh").arg("-c").arg(&hash))?;
            cp_hash.push((wall + hashed).as_nanos() as f64);
            std::fs::remove_dir_all(&dst)?;
            let storage = work.path().join("storage");
            sync();
            let started = Instant::now();
            trainhost::bench::persist_directory(
                &src,
                storage.to_str().unwrap(),
                &format!("ours-{i}"),
                &StorageOptions::default(),
            )?;
            ours.push(started.elapsed().as_nanos() as f64);
            std::fs::remove_dir_all(&storage)?;
        }
        let (cp, cp_sync, cp_hash, ours) =
            (median(cp), median(cp_sync), median(cp_hash), median(ours));
        rows.push(Row {
            group: "persist",
            measure: format!(
                "persist a {} checkpoint to local storage ({}), with SHA-256 of every file",
                size_name(total),
                describe(&layout)
            ),
            baseline_name: "`cp -r` of the same files, left in the page cache".into(),
            baseline: cp,
            ours,
            unit: Unit::Nanos,
            goal: goals::comparison("the goal is against `cp -r` + `sync`, below"),
            met: None,
        });
        rows.push(Row {
            group: "persist",
            measure: format!(
                "persist a {} checkpoint to local storage, as above",
                size_name(total)
            ),
            baseline_name: "`cp -r`, then `sync` (the copy on disk, as a commit is)".into(),
            baseline: cp_sync,
            ours,
            unit: Unit::Nanos,
            goal: format!("≤ {} × `cp -r` + `sync`", goals::PERSIST_VS_CP_SYNC),
            met: Some(ours <= goals::PERSIST_VS_CP_SYNC * cp_sync),
        });
        rows.push(Row {
            group: "persist",
            measure: format!(
                "persist a {} checkpoint to local storage, as above",
                size_name(total)
            ),
            baseline_name: "`cp -r`, then `sha256sum` of every copy (the same work, two tools)"
                .into(),
            baseline: cp_hash,
            ours,
            unit: Unit::Nanos,
            goal: goals::comparison("the cost of hashing"),
            met: None,
        });
    }
    Ok(rows)
}

// --------------------------------------------------------------- blocked

fn blocked(quick: bool, reps: usize) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &total in checkpoint_sizes(quick) {
        let config = json!({"mode": "checkpoint", "files": layout(total), "reports": 3});
        // Per mode (blocking, background): first, changed, unchanged.
        let mut samples = [[vec![], vec![], vec![]], [vec![], vec![], vec![]]];
        // Small checkpoints are at the mercy of the disk's state: more samples.
        let reps = if total <= 64 << 20 {
            reps * 2 + 1
        } else {
            reps
        };
        for (mode, background) in (0..reps).flat_map(|_| [(0, false), (1, true)]) {
            let storage = tempfile::tempdir()?;
            sync();
            let result = run_guest(
                config.clone(),
                1,
                RunConfig {
                    persist_in_background: background,
                    checkpoint_config: CheckpointConfig {
                        num_to_keep: Some(1),
                        ..Default::default()
                    },
                    ..local_run(storage.path())
                },
                Arc::default(),
            )?;
            for (i, name) in ["first_ns", "changed_ns", "unchanged_ns"]
                .iter()
                .enumerate()
            {
                samples[mode][i].push(metric(&result, name)?);
            }
        }
        let [blocking, background] = samples.map(|m| {
            let [a, b, c] = m.map(median);
            (a, b, c)
        });
        let name = size_name(total);
        rows.push(Row {
            group: "blocked",
            measure: format!("guest blocked in `report` with a new {name} checkpoint"),
            baseline_name: "--wait-for-upload".into(),
            baseline: blocking.0,
            ours: background.0,
            unit: Unit::Nanos,
            goal: blocked_goal(total),
            met: (total == 64 << 20).then_some(background.0 <= goals::BLOCKED_64MIB_NS),
        });
        rows.push(Row {
            group: "blocked",
            measure: format!("guest blocked in `report`, {name} checkpoint, every file changed"),
            baseline_name: "--wait-for-upload".into(),
            baseline: blocking.1,
            ours: background.1,
            unit: Unit::Nanos,
            goal: blocked_goal(total),
            met: (total == 64 << 20).then_some(background.1 <= goals::BLOCKED_64MIB_NS),
        });
        rows.push(Row {
            group: "blocked",
            measure: format!("persist an unchanged {name} checkpoint (incremental: linked)"),
            baseline_name: "persisting it new (--wait-for-upload)".into(),
            baseline: blocking.0,
            ours: blocking.2,
            unit: Unit::Nanos,
            goal: goals::comparison("locally every file is still read and hashed"),
            met: None,
        });
    }
    Ok(rows)
}

/// The goal of a blocked-in-report row: stated for 64 MiB only.
fn blocked_goal(total: u64) -> String {
    if total == 64 << 20 {
        format!("≤ {} ms blocked", goals::BLOCKED_64MIB_NS / 1e6)
    } else {
        goals::comparison("the 5 ms goal is for 64 MiB")
    }
}

// --------------------------------------------------------------- restart

fn restart(reps: usize, cache: &Path) -> Result<Vec<Row>> {
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
    }])
}

// ------------------------------------------------------------------- cli

fn cli(bin: &Path, reps: usize) -> Result<Vec<Row>> {
    let work = tempfile::tempdir()?;
    let cache = work.path().join("cache");
    let run = |cache: &Path| -> Result<f64> {
        let (wall, _) = time_command(
            Command::new(bin)
                .args([
                    "run",
                    LINEAR_REGRESSION,
                    "-q",
                    "--fresh",
                    "-n",
                    "cli",
                    "-w",
                    "2",
                ])
                .args(["-c", r#"{"num_epochs": 5}"#, "-s"])
                .arg(work.path().join("storage"))
                .arg("--cache-dir")
                .arg(cache)
                .env("RUST_LOG", "error"),
        )?;
        Ok(wall.as_nanos() as f64)
    };
    let (mut cold, mut warm) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let _ = std::fs::remove_dir_all(&cache);
        cold.push(run(&cache)?);
        warm.push(run(&cache)?);
    }
    let (cold, warm) = (median(cold), median(warm));
    Ok(vec![Row {
        group: "cli",
        measure: "whole CLI run of the example, 2 ranks, 5 epochs (process start to exit)".into(),
        baseline_name: "cold: compiling the guest".into(),
        baseline: cold,
        ours: warm,
        unit: Unit::Nanos,
        goal: format!(
            "≤ {} s warm with 2 ranks (Ray: 18.6 s)",
            goals::CLI_WARM_NS / 1e9
        ),
        met: Some(warm <= goals::CLI_WARM_NS),
    }])
}

// ------------------------------------------------------------------- sgd

fn sgd(quick: bool, reps: usize) -> Result<Vec<Row>> {
    let (steps, dim, batch) = (if quick { 2_000 } else { 20_000 }, 256, 64);
    let native = || trainhost_bench_kernel::time_sgd(steps, dim, batch);
    let storage = tempfile::tempdir()?;
    let config = json!({"mode": "sgd", "steps": steps, "dim": dim, "batch": batch});
    let guest = |limits: ResourceLimits, interruption: Interruption| -> Result<(f64, f64)> {
        let result = run_guest(
            config.clone(),
            1,
            RunConfig {
                limits,
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
    let (mut n, mut g, mut h, mut l) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..reps {
        let (native_ns, native_loss) = native();
        let (guest_ns, guest_loss) = guest(unlimited.clone(), Interruption::Anywhere)?;
        let (calls_ns, calls_loss) = guest(unlimited.clone(), Interruption::AtHostCalls)?;
        let (limited_ns, _) = guest(limited.clone(), Interruption::Anywhere)?;
        for loss in [guest_loss, calls_loss] {
            if (f64::from(native_loss) - loss).abs() > 1e-3 * loss.abs().max(1e-6) {
                bail!("native and guest SGD disagree: loss {native_loss} vs {loss}");
            }
        }
        n.push(native_ns);
        g.push(guest_ns);
        h.push(calls_ns);
        l.push(limited_ns);
    }
    let (n, g, h, l) = (median(n), median(g), median(h), median(l));
    Ok(vec![
        Row {
            group: "sgd",
            measure: format!(
                "SGD step, linear model, {dim} features × {batch} rows (guest: release, simd128)"
            ),
            baseline_name: "the same Rust code compiled natively (release)".into(),
            baseline: n,
            ours: g,
            unit: Unit::Nanos,
            goal: format!("≤ {} × native", goals::SGD_VS_NATIVE),
            met: Some(g <= goals::SGD_VS_NATIVE * n),
        },
        Row {
            group: "sgd",
            measure: "SGD step as above, `--interrupt host-calls` (no epoch checks in the guest's loops)".into(),
            baseline_name: "the same Rust code compiled natively (release)".into(),
            baseline: n,
            ours: h,
            unit: Unit::Nanos,
            goal: format!("≤ {} × native", goals::SGD_VS_NATIVE),
            met: Some(h <= goals::SGD_VS_NATIVE * n),
        },
        Row {
            group: "sgd",
            measure: "SGD step in the guest with every limit set (memory, stall, wall clock, output, checkpoint size)".into(),
            baseline_name: "the same guest without limits".into(),
            baseline: g,
            ours: l,
            unit: Unit::Nanos,
            goal: goals::comparison("what the limits cost"),
            met: None,
        },
    ])
}

// -------------------------------------------------------------------- s3

/// A moto S3 server on loopback, stopped on drop.
struct Moto(std::process::Child, u16);

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_moto() -> Result<Moto> {
    let bin = std::env::var("TRAINHOST_MOTO_SERVER")
        .context("TRAINHOST_MOTO_SERVER is not set (scripts/bench.sh installs moto)")?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let child = Command::new(&bin)
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .with_context(|| format!("cannot start {bin}"))?;
    let moto = Moto(child, port);
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            bail!("moto did not start on port {port}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(moto)
}

fn s3(quick: bool, reps: usize) -> Result<Vec<Row>> {
    let aws = std::env::var("TRAINHOST_AWS_CLI")
        .context("TRAINHOST_AWS_CLI is not set (scripts/bench.sh installs the AWS CLI v1)")?;
    let moto = start_moto()?;
    let endpoint = format!("http://127.0.0.1:{}", moto.1);
    let bucket = "bench";
    // SAFETY: set before any thread of ours reads the environment.
    for (k, v) in [
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
        ("AWS_EC2_METADATA_DISABLED", "true"),
    ] {
        unsafe { std::env::set_var(k, v) };
    }
    time_command(Command::new(&aws).args([
        "s3",
        "mb",
        &format!("s3://{bucket}"),
        "--endpoint-url",
        &endpoint,
    ]))?;
    let work = tempfile::tempdir()?;
    let layout = [(if quick { 2 } else { 8 }, 16u64 << 20)];
    trainhost_bench_kernel::write_layout(work.path(), &layout, 1)?;
    let options = StorageOptions {
        options: vec![
            ("aws_endpoint".into(), endpoint.clone()),
            ("allow_http".into(), "true".into()),
        ],
        ..StorageOptions::default()
    };
    let (mut aw, mut ac, mut ow, mut oc) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..reps {
        let (wall, cpu) = time_command(
            Command::new(&aws)
                .args(["s3", "cp", "--recursive", "--quiet"])
                .arg(work.path())
                .arg(format!("s3://{bucket}/aws-{i}"))
                .args(["--endpoint-url", &endpoint]),
        )?;
        aw.push(wall.as_nanos() as f64);
        ac.push(cpu.as_nanos() as f64);
        let cpu = self_cpu();
        let started = Instant::now();
        trainhost::bench::persist_directory(
            work.path(),
            &format!("s3://{bucket}"),
            &format!("ours-{i}"),
            &options,
        )?;
        ow.push(started.elapsed().as_nanos() as f64);
        oc.push(self_cpu().saturating_sub(cpu).as_nanos() as f64);
    }
    let what = describe(&layout);
    let (aw, ac, ow, oc) = (median(aw), median(ac), median(ow), median(oc));
    Ok(vec![
        Row {
            group: "s3",
            measure: format!("upload {what} to S3 (moto on loopback), wall"),
            baseline_name: "`aws s3 cp --recursive` (awscli v1)".into(),
            baseline: aw,
            ours: ow,
            unit: Unit::Nanos,
            goal: format!(
                "≥ {}× faster (ratio ≤ {:.2})",
                goals::S3_SPEEDUP,
                1.0 / goals::S3_SPEEDUP
            ),
            met: Some(ow * goals::S3_SPEEDUP <= aw),
        },
        Row {
            group: "s3",
            measure: format!("upload {what} to S3, CPU time of the uploading process"),
            baseline_name: "`aws s3 cp --recursive` (awscli v1)".into(),
            baseline: ac,
            ours: oc,
            unit: Unit::Nanos,
            goal: format!("≤ {} × its CPU", goals::S3_CPU_SHARE),
            met: Some(oc <= goals::S3_CPU_SHARE * ac),
        },
    ])
}

// ----------------------------------------------------------------- ranks

fn child_ranks(n: u32, cache: Option<&Path>) -> Result<()> {
    let storage = tempfile::tempdir()?;
    let started = Instant::now();
    let mut builder = Trainer::builder(BENCH_GUEST)
        .train_loop_config(json!({"mode": "start"}))
        .scaling_config(ScalingConfig { num_workers: n })
        .run_config(local_run(storage.path()))
        .output(Arc::new(Lines::default()));
    if let Some(cache) = cache {
        builder = builder.compile_cache(cache);
    }
    let result = builder.build()?.fit()?;
    if let Some(e) = result.error {
        bail!("{e}");
    }
    let wall = started.elapsed();
    let status = std::fs::read_to_string("/proc/self/status")?;
    let hwm_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmHWM in /proc/self/status")?;
    println!("{} {}", wall.as_nanos(), hwm_kb * 1024);
    Ok(())
}

fn ranks(quick: bool, cache: &Path) -> Result<Vec<Row>> {
    trainhost::bench::compile(&std::fs::read(BENCH_GUEST)?, Some(cache))?;
    let counts: &[u32] = if quick {
        &[1, 8]
    } else {
        &[1, 2, 4, 8, 16, 32, 64]
    };
    let mut measured = Vec::new();
    for &n in counts {
        let out = Command::new(std::env::current_exe()?)
            .arg("--child-ranks")
            .arg(n.to_string())
            .arg("--child-cache")
            .arg(cache)
            .output()?;
        if !out.status.success() {
            bail!("{n} ranks failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let text = String::from_utf8(out.stdout)?;
        let mut parts = text.split_whitespace().map(str::parse::<f64>);
        let (Some(Ok(wall)), Some(Ok(rss))) = (parts.next(), parts.next()) else {
            bail!("unexpected output from the child: {text}");
        };
        measured.push((n, wall, rss));
    }
    let (_, wall1, rss1) = measured[0];
    let mut rows = Vec::new();
    for &(n, wall, rss) in &measured[1..] {
        rows.push(Row {
            group: "ranks",
            measure: format!("{n} ranks: start, one report, end (whole fit)"),
            baseline_name: "1 rank".into(),
            baseline: wall1,
            ours: wall,
            unit: Unit::Nanos,
            goal: format!(
                "informational: {:.2} ms per extra rank",
                (wall - wall1) / 1e6 / f64::from(n - 1)
            ),
            met: None,
        });
        rows.push(Row {
            group: "ranks",
            measure: format!("{n} ranks: peak host memory"),
            baseline_name: "1 rank".into(),
            baseline: rss1,
            ours: rss,
            unit: Unit::Bytes,
            goal: format!(
                "≤ {} MiB per rank: {:.2} MiB per extra rank",
                goals::RANK_MIB,
                (rss - rss1) / (1024.0 * 1024.0) / f64::from(n - 1)
            ),
            met: Some((rss - rss1) / (1024.0 * 1024.0) / f64::from(n - 1) <= goals::RANK_MIB),
        });
    }
    Ok(rows)
}

// --------------------------------------------------------------- results

fn markdown(rows: &[Row]) -> String {
    let mut out = String::from(
        "| group | measure | baseline | baseline value | ours | ratio (ours / baseline) | goal | met |\n|---|---|---|---:|---:|---:|---|---|\n",
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.3} | {} | {} |\n",
            r.group,
            r.measure,
            r.baseline_name,
            r.unit.show(r.baseline),
            r.unit.show(r.ours),
            r.ours / r.baseline,
            r.goal,
            match r.met {
                Some(true) => "yes",
                Some(false) => "**no**",
                None => "",
            }
        ));
    }
    out
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or("?".into(), |kb| format!("{} GiB", kb >> 20));
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!("{cpu}, {cores} cores, {mem} RAM, Linux {}", kernel.trim())
}

fn write_results(
    path: &Path,
    table: &str,
    skipped: &[String],
    args: &str,
    took: Duration,
) -> Result<()> {
    let mut text = String::new();
    text.push_str(include_str!("header.md"));
    text.push('\n');
    text.push_str(&goals::describe());
    text.push_str(&format!(
        "\n## Results\n\nMachine: {}. Command: `scripts/bench.sh{}{}` ({} in all).\n\n",
        machine(),
        if args.is_empty() { "" } else { " " },
        args,
        humantime_secs(took)
    ));
    text.push_str(table);
    for s in skipped {
        text.push_str(&format!("\nSkipped: {s}\n"));
    }
    text.push_str(include_str!("notes.md"));
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

fn humantime_secs(d: Duration) -> String {
    format!("{:.0} s", d.as_secs_f64())
}
