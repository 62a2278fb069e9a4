//! The process the campaign kills: this binary re-executed in `host` mode
//! (one node, through the trainhost library), or `mpiexec` starting the
//! trainhost command line once per node; and killing it.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use trainhost::{
    CheckpointConfig, FailureConfig, MaxFailures, OutputSink, RunConfig, ScalingConfig,
    StorageOptions, Stream, Trainer,
};

use crate::store::Store;
use crate::{Campaign, Rng};

/// Checkpoints the runs keep.
const KEEP: usize = 3;
/// The environment variable that marks a start's processes.
const TOKEN: &str = "TRAINHOST_CAMPAIGN_START";
/// How soon the job must end on every node once one node's process died.
const JOB_END: Duration = Duration::from_secs(30);

#[derive(clap::Args, Debug)]
pub struct HostArgs {
    #[arg(long)]
    guest: PathBuf,
    #[arg(long)]
    storage: String,
    #[arg(long = "storage-option")]
    storage_options: Vec<String>,
    #[arg(long)]
    name: String,
    #[arg(long)]
    result_json: PathBuf,
    #[arg(long)]
    config: String,
    #[arg(long)]
    workers: u32,
    /// As the command line takes it: 0 fails at the first failure, -1
    /// never gives up.
    #[arg(long, default_value = "0", allow_hyphen_values = true)]
    max_failures: MaxFailures,
}

/// Prints rank 0's lines on stdout, where the campaign reads them.
struct Rank0;

impl OutputSink for Rank0 {
    fn line(&self, rank: u32, _: Stream, line: &str) {
        if rank == 0 {
            println!("{line}");
        }
    }
}

/// `host` mode: run the example once through the library, writing the
/// result where the command line's `--result-json` would.
pub fn host(args: &HostArgs) -> anyhow::Result<()> {
    let options = args
        .storage_options
        .iter()
        .map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .context("--storage-option takes key=value")
        })
        .collect::<anyhow::Result<_>>()?;
    let result = Trainer::builder(args.guest.as_path())
        .train_loop_config(serde_json::from_str(&args.config)?)
        .scaling_config(ScalingConfig {
            num_workers: args.workers,
        })
        .run_config(RunConfig {
            name: Some(args.name.clone()),
            storage_path: args.storage.clone(),
            storage_options: StorageOptions {
                options,
                ..StorageOptions::default()
            },
            checkpoint_config: CheckpointConfig {
                num_to_keep: Some(KEEP),
                ..Default::default()
            },
            failure_config: FailureConfig {
                max_failures: args.max_failures,
            },
            ..Default::default()
        })
        .output(Arc::new(Rank0))
        .build()?
        .fit()?;
    std::fs::write(&args.result_json, serde_json::to_vec(&result.to_json())?)?;
    if let Some(e) = result.error {
        bail!("the run failed: {e}");
    }
    Ok(())
}

/// A started run.
#[derive(Debug)]
pub struct Host {
    pub child: Child,
    /// Rank 0's output lines.
    pub lines: mpsc::Receiver<String>,
    /// Marks the processes of this start (an environment variable's
    /// value), to find each node's process.
    token: String,
}

/// Start run `run` in `store`, writing its result to `result`.
pub fn start(
    c: &Campaign,
    store: &Store,
    run: &str,
    result: &std::path::Path,
) -> anyhow::Result<Host> {
    let config = serde_json::json!({
        "num_epochs": c.epochs,
        "padding_mb": c.padding_mb,
        "hand_over": c.hand_over,
        "sharded": c.sharded,
        "fail_every": c.fail_every,
    })
    .to_string();
    let token = format!("{}-{:?}", std::process::id(), Instant::now());
    let mut command = if c.nodes > 1 {
        let trainhost = c
            .trainhost
            .as_ref()
            .context("--nodes needs --trainhost: the command line built with `--features mpi`")?;
        let mut command = Command::new("mpiexec");
        command
            .args(["-n", &c.nodes.to_string()])
            .arg(trainhost)
            .arg("run")
            .arg(&c.guest)
            .args(["--num-to-keep", &KEEP.to_string()]);
        command
    } else {
        let mut command = Command::new(std::env::current_exe()?);
        command.arg("host").arg("--guest").arg(&c.guest);
        command
    };
    command.args(["--storage", &store.location(), "--name", run]);
    for option in store.option_args() {
        command.args(["--storage-option", &option]);
    }
    if c.fail_every > 0 {
        // The command line's flag; `host` mode takes it alike.
        command.arg("--max-failures=-1");
    }
    let _ = std::fs::remove_file(result);
    let mut child = command
        .arg("--result-json")
        .arg(result)
        .args(["--config", &config, "--workers", &c.workers.to_string()])
        .env("RUST_LOG", "error")
        .env(TOKEN, &token)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start the host")?;
    let stdout = child.stdout.take().context("no stdout")?;
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            // The command line prefixes each rank's lines.
            let line = match line.strip_prefix("[rank ") {
                Some(rest) => match rest.strip_prefix("0] ") {
                    Some(rank0) => rank0.to_owned(),
                    None => continue,
                },
                None => line,
            };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    Ok(Host {
        child,
        lines,
        token,
    })
}

/// The trainhost processes of `host`'s start, by node (MPI rank), read
/// from /proc: each carries the start's token in its environment.
fn node_processes(host: &Host) -> Vec<(u32, u32)> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        let vars: Vec<&[u8]> = environ.split(|b| *b == 0).collect();
        let value = |name: &str| {
            vars.iter().find_map(|v| {
                v.strip_prefix(name.as_bytes())
                    .and_then(|rest| rest.strip_prefix(b"="))
                    .map(|v| String::from_utf8_lossy(v).into_owned())
            })
        };
        if value(TOKEN).as_deref() != Some(host.token.as_str()) {
            continue;
        }
        let Ok(exe) = std::fs::read_link(entry.path().join("exe")) else {
            continue;
        };
        if exe.file_name().is_none_or(|n| n != "trainhost") {
            continue;
        }
        if let Some(node) = value("PMI_RANK").and_then(|r| r.parse().ok()) {
            found.push((node, pid));
        }
    }
    found.sort_unstable();
    found
}

/// Kill the start: its one process, or one node's process chosen by
/// `rng`; then check that the whole job ends within `JOB_END`.
pub fn kill(c: &Campaign, host: &mut Host, rng: &mut Rng) -> anyhow::Result<()> {
    if c.nodes <= 1 {
        host.child.kill()?;
        host.child.wait()?;
        return Ok(());
    }
    let nodes = node_processes(host);
    let Some(&(node, pid)) = nodes.get(rng.below(nodes.len() as u64) as usize) else {
        // Not started yet, or ending: kill the launcher itself.
        host.child.kill()?;
        host.child.wait()?;
        return Ok(());
    };
    Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()?;
    let deadline = Instant::now() + JOB_END;
    while host.child.try_wait()?.is_none() {
        if Instant::now() > deadline {
            host.child.kill()?;
            bail!("node {node}'s process was killed, but the job had not ended {JOB_END:?} later");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let left = node_processes(host);
    ensure!(
        left.is_empty(),
        "the launcher ended after node {node} was killed, but node processes live on: {left:?}"
    );
    Ok(())
}
