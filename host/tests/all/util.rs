//! Running the scripted test guest and looking at what it left.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use trainhost::{
    Interruption, MetricValue, OutputSink, Preemption, RunConfig, ScalingConfig, Stream,
    TrainResult, Trainer, TrainerBuilder,
};

pub use trainhost_test_artifacts::{LINEAR_REGRESSION, QUICKSTART, TEST_GUEST};

/// Collects every line the ranks print.
#[derive(Default)]
pub struct Lines(pub Mutex<Vec<(u32, Stream, String)>>);

impl Lines {
    /// The text of every line printed so far, every rank's, in order.
    pub fn texts(&self) -> Vec<String> {
        self.0.lock().unwrap().iter().map(|l| l.2.clone()).collect()
    }
}

impl OutputSink for Lines {
    fn line(&self, rank: u32, stream: Stream, line: &str) {
        self.0.lock().unwrap().push((rank, stream, line.to_owned()));
    }
}

/// A finished run of the test guest, with its storage and output. Prints
/// the output if the test fails while it is alive.
pub struct Run {
    pub result: TrainResult,
    pub lines: Arc<Lines>,
    pub storage: tempfile::TempDir,
}

impl Run {
    /// The run's directory in storage.
    pub fn dir(&self) -> PathBuf {
        PathBuf::from(&self.result.path)
    }

    /// Lines printed by `rank` on stdout.
    pub fn stdout(&self, rank: u32) -> Vec<String> {
        self.lines
            .0
            .lock()
            .unwrap()
            .iter()
            .filter(|(r, s, _)| *r == rank && *s == Stream::Stdout)
            .map(|(_, _, l)| l.clone())
            .collect()
    }

    /// The run's error, as text; panics if the run succeeded.
    pub fn error(&self) -> String {
        self.result
            .error
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_else(|| panic!("the run succeeded"))
    }

    /// Panics with the run's error if it failed.
    pub fn assert_ok(&self) {
        if let Some(e) = &self.result.error {
            panic!("the run failed: {e}");
        }
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- guest output ---");
            for (rank, stream, line) in self.lines.0.lock().unwrap().iter() {
                eprintln!("[rank {rank} {stream:?}] {line}");
            }
        }
    }
}

/// A trainer for the scripted guest with `workers` ranks running `steps`,
/// storing in a fresh temporary directory under the run name "t".
pub fn scripted(workers: u32, steps: Value) -> (TrainerBuilder, tempfile::TempDir, Arc<Lines>) {
    let storage = tempfile::tempdir().unwrap();
    let lines = Arc::new(Lines::default());
    let builder = Trainer::builder(TEST_GUEST)
        .train_loop_config(json!({ "steps": steps }))
        .scaling_config(ScalingConfig {
            num_workers: workers,
        })
        .run_config(RunConfig {
            name: Some("t".into()),
            storage_path: storage.path().display().to_string(),
            report_timeout: Duration::from_secs(60),
            ..Default::default()
        })
        .output(lines.clone());
    (builder, storage, lines)
}

/// The scripted guest's trainer of [`scripted`], which the returned
/// handle asks to stop, with `grace` to stop in, its ranks interrupted
/// as `interruption` says.
pub fn preemptible_by(
    builder: TrainerBuilder,
    storage: &tempfile::TempDir,
    grace: Duration,
    interruption: Interruption,
) -> (TrainerBuilder, Preemption) {
    let preemption = Preemption::new();
    let builder = builder
        .preemption(preemption.clone())
        .run_config(RunConfig {
            name: Some("t".into()),
            storage_path: storage.path().display().to_string(),
            preemption_grace: grace,
            interruption,
            ..Default::default()
        });
    (builder, preemption)
}

/// Ask `preemption` to stop the run `after` from now, from another
/// thread; joined, it gives when it asked.
pub fn request_after(
    preemption: &Preemption,
    after: Duration,
) -> std::thread::JoinHandle<std::time::Instant> {
    let preemption = preemption.clone();
    std::thread::spawn(move || {
        std::thread::sleep(after);
        preemption.request();
        std::time::Instant::now()
    })
}

/// The scripted guest's trainer of [`scripted`] with the ranks' memory
/// limited to `max_memory` bytes.
pub fn with_max_memory(
    builder: TrainerBuilder,
    storage: &tempfile::TempDir,
    max_memory: u64,
) -> TrainerBuilder {
    builder.run_config(RunConfig {
        name: Some("t".into()),
        storage_path: storage.path().display().to_string(),
        limits: trainhost::ResourceLimits {
            max_memory: Some(max_memory),
            ..Default::default()
        },
        ..Default::default()
    })
}

/// Run `steps` on `workers` ranks of the scripted guest.
pub fn run(workers: u32, steps: Value) -> Run {
    let (builder, storage, lines) = scripted(workers, steps);
    finish(builder, storage, lines)
}

/// Run `steps` on `workers` ranks of the scripted guest, persisting in the
/// background (the default) or not (`--wait-for-upload`).
pub fn run_persisting(workers: u32, steps: Value, background: bool) -> Run {
    let (builder, storage, lines) = scripted(workers, steps);
    let builder = builder.run_config(RunConfig {
        name: Some("t".into()),
        storage_path: storage.path().display().to_string(),
        persist_in_background: background,
        ..RunConfig::default()
    });
    finish(builder, storage, lines)
}

pub fn finish(builder: TrainerBuilder, storage: tempfile::TempDir, lines: Arc<Lines>) -> Run {
    let result = builder.build().unwrap().fit().unwrap();
    Run {
        result,
        lines,
        storage,
    }
}

/// The files below `dir`, as sorted `/`-separated relative paths, leaving
/// out trainhost's own `.trainhost` directory.
pub fn files(dir: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            if rel == ".trainhost" {
                continue;
            }
            if path.is_dir() {
                walk(root, &path, out);
            } else {
                out.push(rel);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// The bytes the guest's `{"write": .., "bytes": n, "seed": s}` step writes.
pub fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// A numeric metric of the run's last report.
pub fn metric(result: &TrainResult, name: &str) -> f64 {
    result
        .metrics
        .as_ref()
        .and_then(|m| m.get(name))
        .and_then(MetricValue::as_f64)
        .unwrap_or_else(|| panic!("no {name} in {:?}", result.metrics))
}

/// The metrics history a run stored (`metrics.jsonl`): per line, the
/// report's index and the checkpoint it committed, if any.
pub fn stored_history(run_dir: &Path) -> Vec<(u64, Option<u64>)> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["report_index"].as_u64().unwrap(),
                v["checkpoint"].as_u64(),
            )
        })
        .collect()
}

/// The names of the checkpoint directories in a run directory.
pub fn checkpoint_dirs(run_dir: &Path) -> Vec<String> {
    names_starting_with(run_dir, "checkpoint_")
}

/// The names of the entries of `dir` that start with `prefix`, sorted.
pub fn names_starting_with(dir: &Path, prefix: &str) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect();
    out.sort();
    out
}

/// The `trainhost` command running as a separate process, its stdout lines
/// arriving on a channel, so tests can act on what it prints (kill it at a
/// chosen moment, say).
pub struct HostProcess {
    pub child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl HostProcess {
    /// Start `trainhost ARGS` in `dir`.
    pub fn spawn(args: &[&str], dir: &Path) -> Self {
        Self::spawn_with_env(args, dir, &[])
    }

    /// Start `trainhost ARGS` in `dir` with extra environment variables.
    pub fn spawn_with_env(args: &[&str], dir: &Path, env: &[(&str, &Path)]) -> Self {
        use std::io::BufRead;
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_trainhost"))
            .args(args)
            .current_dir(dir)
            .envs(env.iter().copied())
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self { child, lines }
    }

    /// Wait, at most a minute, for a line satisfying `pred`, and return it.
    pub fn wait_for(&self, pred: impl Fn(&str) -> bool) -> String {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let mut last = Vec::new();
        while let Ok(line) = self
            .lines
            .recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
        {
            if pred(&line) {
                return line;
            }
            last.push(line);
            if last.len() > 5 {
                last.remove(0);
            }
        }
        panic!("the host never printed the awaited line; its last lines: {last:?}");
    }

    /// Send SIGTERM, as a scheduler preempting the machine would.
    pub fn sigterm(&self) {
        self.signal("-TERM");
    }

    /// Send a signal (`-STOP`, `-CONT`, ...) with `kill`.
    pub fn signal(&self, signal: &str) {
        let status = std::process::Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }
}

/// Run `trainhost run` of the scripted guest with `config`, on `workers`
/// ranks, storing in `dir`/st, with the process's open-file limit lowered
/// to 512 (`ulimit -n`); its stdout and stderr, after checking it
/// succeeded.
pub fn run_with_512_open_files(dir: &Path, workers: u32, config: &Value) -> (String, String) {
    let out = std::process::Command::new("sh")
        .args(["-c", "ulimit -n 512 && exec \"$@\"", "sh"])
        .arg(env!("CARGO_BIN_EXE_trainhost"))
        .args(["run", trainhost_test_artifacts::TEST_GUEST])
        .args(["--workers", &workers.to_string()])
        .args(["--config", &config.to_string()])
        .args(["--storage", "st", "--name", "open"])
        .current_dir(dir)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stdout}\n{stderr}");
    (stdout, stderr)
}

/// What a `trainhost` process did when run to its end, or killed at a bound.
#[derive(Debug)]
pub struct Bounded {
    /// Its exit status; `None` when it was still running at the bound.
    pub status: Option<i32>,
    pub stderr: String,
}

/// Run `trainhost ARGS` in `dir`, killing it if it runs longer than
/// `bound`.
pub fn run_bounded(args: &[&str], dir: &Path, bound: Duration) -> Bounded {
    use std::io::Read;
    let started = std::time::Instant::now();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_trainhost"))
        .args(args)
        .current_dir(dir)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let reading = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if started.elapsed() > bound {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Bounded {
        status,
        stderr: reading.join().unwrap(),
    }
}

/// The Python that scripts/install-test-servers.sh installs beside moto
/// (with PyYAML and TensorBoard); `None`, saying that `what` is skipped,
/// when the tests run without it, and a failure when CI requires it.
pub fn venv_python(what: &str) -> Option<PathBuf> {
    let python = std::env::var_os("TRAINHOST_MOTO_SERVER")
        .map(PathBuf::from)
        .and_then(|moto| Some(moto.parent()?.join("python")))
        .filter(|p| p.exists());
    if python.is_none() {
        assert!(
            std::env::var("TRAINHOST_REQUIRE_STORAGE_SERVERS").as_deref() != Ok("1"),
            "TRAINHOST_MOTO_SERVER is not set: run the tests with scripts/test.sh"
        );
        eprintln!("skipped: no {what} (TRAINHOST_MOTO_SERVER is not set; scripts/test.sh sets it)");
    }
    python
}
