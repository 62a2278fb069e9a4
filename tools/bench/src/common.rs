//! What the groups share: a result row, running the bench guest, timing
//! commands and the checkpoint layouts.

use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;
use trainhost::{
    Interruption, MetricValue, OutputSink, RunConfig, ScalingConfig, Stream, TrainResult, Trainer,
};
use trainhost_test_artifacts::BENCH_GUEST;

/// A goal's verdict on one pair (baseline, ours): `None` for a row that
/// states no goal to meet.
type Judge = Arc<dyn Fn(f64, f64) -> Option<bool> + Send + Sync>;

/// One line of the results: a measure, its baseline, the goal, and the
/// samples behind them. The figures (medians, range, verdicts) are taken
/// from the samples when the table is written, so that the samples of the
/// suite's passes can be put together first ([`Row::absorb`]).
pub(crate) struct Row {
    pub group: &'static str,
    pub measure: String,
    pub baseline_name: String,
    pub unit: Unit,
    pub goal: String,
    /// One pair per repetition, over every pass of the suite.
    pairs: Paired,
    judge: Judge,
    /// A figure taken from the medians (baseline, ours), shown after the
    /// goal.
    detail: Option<Detail>,
}

/// A figure to show from a pair of medians (baseline, ours).
type Detail = Arc<dyn Fn(f64, f64) -> String + Send + Sync>;

impl Row {
    /// The medians of the baseline and of ours.
    pub(crate) fn medians(&self) -> (f64, f64) {
        self.pairs.medians()
    }

    /// Whether the goal is met by the medians, when the row has one.
    pub(crate) fn met(&self) -> Option<bool> {
        let (baseline, ours) = self.medians();
        (self.judge)(baseline, ours)
    }

    /// How many repetitions, judged on their own, met the goal, and of
    /// how many: a median that meets a goal some repetitions miss (or the
    /// reverse) is a result a re-run may not reproduce. `None` for a
    /// single measure or no goal.
    pub(crate) fn met_in(&self) -> Option<(usize, usize)> {
        self.pairs.met_in(&*self.judge)
    }

    /// The lowest and highest ratio of ours to the baseline over the
    /// repetitions, each taken in the same repetition. `None` for a single
    /// measure.
    pub(crate) fn spread(&self) -> Option<(f64, f64)> {
        self.pairs.spread()
    }

    /// The goal column: the goal, and the row's detail if it has one.
    pub(crate) fn goal_text(&self) -> String {
        match &self.detail {
            None => self.goal.clone(),
            Some(detail) => {
                let (baseline, ours) = self.medians();
                format!("{}: {}", self.goal, detail(baseline, ours))
            }
        }
    }

    /// With a figure from the medians shown after the goal.
    pub(crate) fn with_detail(
        self,
        detail: impl Fn(f64, f64) -> String + Send + Sync + 'static,
    ) -> Self {
        Self {
            detail: Some(Arc::new(detail)),
            ..self
        }
    }

    /// In another unit than time.
    pub(crate) fn in_unit(self, unit: Unit) -> Self {
        Self { unit, ..self }
    }

    /// Whether `other` is the same line (from another pass).
    pub(crate) fn same_line(&self, other: &Row) -> bool {
        self.group == other.group
            && self.measure == other.measure
            && self.baseline_name == other.baseline_name
    }

    /// Take the samples of the same line from another pass.
    pub(crate) fn absorb(&mut self, other: Row) {
        debug_assert!(self.same_line(&other));
        self.pairs.baseline.extend(other.pairs.baseline);
        self.pairs.ours.extend(other.pairs.ours);
    }
}

/// Paired samples of a measure and its baseline, one pair per repetition.
#[derive(Default, Clone)]
pub(crate) struct Paired {
    pub baseline: Vec<f64>,
    pub ours: Vec<f64>,
}

impl Paired {
    pub(crate) fn push(&mut self, baseline: f64, ours: f64) {
        self.baseline.push(baseline);
        self.ours.push(ours);
    }

    /// The medians of both.
    pub(crate) fn medians(&self) -> (f64, f64) {
        (median(self.baseline.clone()), median(self.ours.clone()))
    }

    /// A row of times from these samples, with `met` as `judge` finds it
    /// from a pair (baseline, ours): the medians' and each repetition's.
    pub(crate) fn row(
        &self,
        group: &'static str,
        measure: String,
        baseline_name: String,
        goal: String,
        judge: impl Fn(f64, f64) -> Option<bool> + Send + Sync + 'static,
    ) -> Row {
        Row {
            group,
            measure,
            baseline_name,
            unit: Unit::Nanos,
            goal,
            pairs: self.clone(),
            judge: Arc::new(judge),
            detail: None,
        }
    }

    /// How many repetitions meet the goal as `judge` finds it from their
    /// pair (baseline, ours), and of how many; `None` for a single
    /// repetition or a row without a goal.
    pub(crate) fn met_in(
        &self,
        judge: impl Fn(f64, f64) -> Option<bool>,
    ) -> Option<(usize, usize)> {
        let judged: Vec<bool> = self
            .baseline
            .iter()
            .zip(&self.ours)
            .filter_map(|(&b, &o)| judge(b, o))
            .collect();
        (judged.len() > 1).then(|| (judged.iter().filter(|&&m| m).count(), judged.len()))
    }

    /// The range of the per-repetition ratios, when there are several.
    pub(crate) fn spread(&self) -> Option<(f64, f64)> {
        let ratios = self.baseline.iter().zip(&self.ours).map(|(b, o)| o / b);
        let (lo, hi) = ratios.fold((f64::INFINITY, 0f64), |(lo, hi), r| (lo.min(r), hi.max(r)));
        (self.ours.len() > 1).then_some((lo, hi))
    }
}

#[derive(Clone, Copy)]
pub(crate) enum Unit {
    Nanos,
    Bytes,
}

impl Unit {
    pub(crate) fn show(self, v: f64) -> String {
        match self {
            Unit::Nanos if v >= 1e9 => format!("{:.2} s", v / 1e9),
            Unit::Nanos if v >= 1e6 => format!("{:.1} ms", v / 1e6),
            Unit::Nanos if v >= 1e3 => format!("{:.1} µs", v / 1e3),
            Unit::Nanos => format!("{v:.0} ns"),
            Unit::Bytes => format!("{:.1} MiB", v / (1024.0 * 1024.0)),
        }
    }
}

/// Collects the ranks' output lines.
#[derive(Default)]
pub(crate) struct Lines(Mutex<Vec<String>>);

impl OutputSink for Lines {
    fn line(&self, _rank: u32, _stream: Stream, line: &str) {
        self.0.lock().unwrap().push(line.to_owned());
    }
}

impl Lines {
    /// The number after `key ` in the first line that starts with it.
    pub(crate) fn value(&self, key: &str) -> Result<u128> {
        let lines = self.0.lock().unwrap();
        let line = lines
            .iter()
            .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix(' ')))
            .with_context(|| format!("the guest printed no {key}: {lines:?}"))?;
        Ok(line.trim().parse()?)
    }
}

/// Run the bench guest with `config` and return the result.
pub(crate) fn run_guest(
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

pub(crate) fn local_run(storage: &Path) -> RunConfig {
    RunConfig {
        name: Some("bench".into()),
        storage_path: storage.display().to_string(),
        fresh: true,
        ..RunConfig::default()
    }
}

/// The time of a training step a digits example reports with
/// `bench_steps` (1 rank, default interruption), in ns.
pub(crate) fn step_ns(guest: &str, config: Value, storage: &Path) -> Result<f64> {
    let result = Trainer::builder(guest)
        .train_loop_config(config)
        .scaling_config(ScalingConfig { num_workers: 1 })
        .run_config(RunConfig {
            interruption: Interruption::Anywhere,
            ..local_run(storage)
        })
        .output(Arc::new(Lines::default()))
        .build()?
        .fit()?;
    if let Some(e) = &result.error {
        bail!("{guest} failed: {e}");
    }
    match result.metrics.as_ref().and_then(|m| m.get("step_seconds")) {
        Some(s) => Ok(MetricValue::as_f64(s).unwrap_or(f64::NAN) * 1e9),
        None => bail!("{guest} reported no step_seconds"),
    }
}

/// A float metric of the last report.
pub(crate) fn metric(result: &TrainResult, name: &str) -> Result<f64> {
    let metrics = result.metrics.as_ref().context("no report")?;
    match metrics.get(name) {
        Some(MetricValue::Float(v)) => Ok(*v),
        Some(MetricValue::Integer(v)) => Ok(*v as f64),
        other => bail!("metric {name} is {other:?}"),
    }
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A checkpoint of `total` bytes: half in small files, half in four large
/// ones. (count, size) per group, as the bench guest takes them.
pub(crate) fn layout(total: u64) -> Vec<(u32, u64)> {
    let small = if total >= 1 << 30 {
        256 << 10
    } else {
        64 << 10
    };
    vec![((total / 2 / small) as u32, small), (4, total / 8)]
}

/// A checkpoint of `total` bytes as `count` files of one size.
pub(crate) fn small_files_layout(total: u64, count: u32) -> Vec<(u32, u64)> {
    vec![(count, total / u64::from(count))]
}

pub(crate) fn size_name(total: u64) -> String {
    if total >= 1 << 30 {
        format!("{} GiB", total >> 30)
    } else {
        format!("{} MiB", total >> 20)
    }
}

pub(crate) fn describe(layout: &[(u32, u64)]) -> String {
    layout
        .iter()
        .map(|(n, s)| format!("{n} × {}", Unit::Bytes.show(*s as f64)))
        .collect::<Vec<_>>()
        .join(" + ")
}

/// Wall time of a command, and the CPU time it used (user + system).
pub(crate) fn time_command(cmd: &mut Command) -> Result<(Duration, Duration)> {
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
pub(crate) fn sync() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
}

pub(crate) fn rusage(who: libc::c_int) -> Duration {
    // SAFETY: getrusage writes one struct rusage, which we provide zeroed.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(who, &mut usage);
        usage
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

pub(crate) fn self_cpu() -> Duration {
    rusage(libc::RUSAGE_SELF)
}

pub(crate) fn children_cpu() -> Duration {
    rusage(libc::RUSAGE_CHILDREN)
}

/// The checkpoint sizes the persist and blocked groups measure.
pub(crate) fn checkpoint_sizes(quick: bool) -> &'static [u64] {
    if quick {
        &[64 << 20]
    } else {
        &[64 << 20, 1 << 30]
    }
}

/// How a row is sampled: the one place that says how many samples of a
/// measure each pass of the suite takes (the header states the counts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sampling {
    /// Three a pass, nine in a default run: a median of nine falls outside
    /// another run's range of nine about three times in a hundred.
    Standard,
    /// Two a pass: each sample starts `mpiexec` and its processes twice.
    Processes,
    /// One a pass: each sample writes a gigabyte and takes seconds.
    Gigabyte,
}

impl Sampling {
    /// A checkpoint of `total` bytes: gigabyte rows take one sample a pass.
    pub(crate) fn of_checkpoint(total: u64) -> Self {
        if total <= 64 << 20 {
            Sampling::Standard
        } else {
            Sampling::Gigabyte
        }
    }

    /// How many samples one pass takes; `--quick` takes one of everything.
    pub(crate) fn per_pass(self, quick: bool) -> usize {
        match (quick, self) {
            (true, _) | (false, Sampling::Gigabyte) => 1,
            (false, Sampling::Processes) => 2,
            (false, Sampling::Standard) => 3,
        }
    }
}
