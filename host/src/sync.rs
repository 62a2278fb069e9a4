//! Mirroring a local run directory to a remote target with the user's own
//! command, as Ray Tune's custom syncer does (`aws s3 sync {source}
//! {target}`, `rsync -a {source}/ {target}/`, `gsutil -m rsync -r ...`).
//!
//! The command runs through `sh -c` with `{source}` and `{target}` replaced
//! by shell-quoted paths: after reports, at most once per period, and once
//! more when the run ends. When the local run directory is missing at
//! start, it runs once the other way round to restore it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::config::SyncConfig;

/// The command line for one sync from `source` to `target`.
fn render(config: &SyncConfig, source: &str, target: &str) -> String {
    config
        .command
        .replace("{source}", &shell_quote(source))
        .replace("{target}", &shell_quote(target))
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Why a sync did not happen.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SyncFailed {
    #[error("cannot run `sh -c {line}`: {source}")]
    Spawn {
        line: String,
        #[source]
        source: std::io::Error,
    },
    #[error("sync command `{line}` failed ({status}): {output}")]
    Status {
        line: String,
        status: std::process::ExitStatus,
        /// What it printed, stdout then stderr.
        output: String,
    },
}

/// Run the command once; the error carries its status and output.
fn run_once(config: &SyncConfig, source: &str, target: &str) -> Result<(), SyncFailed> {
    let line = render(config, source, target);
    let started = Instant::now();
    let out = match Command::new("sh").arg("-c").arg(&line).output() {
        Ok(out) => out,
        Err(source) => return Err(SyncFailed::Spawn { line, source }),
    };
    if out.status.success() {
        tracing::info!(elapsed = ?started.elapsed(), "synced: {line}");
        return Ok(());
    }
    let mut output = String::from_utf8_lossy(&out.stderr).trim().to_owned();
    let stdout = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if !stdout.is_empty() {
        output = format!("{stdout}\n{output}");
    }
    Err(SyncFailed::Status {
        line,
        status: out.status,
        output,
    })
}

/// Restore `local` from `<target>/<run>` when it does not exist yet.
/// Failing is not fatal: the run may simply be new.
pub(crate) fn restore_if_missing(config: &SyncConfig, local: &Path, run: &str) {
    if local.join(crate::record::layout::RUN_STATE).exists() {
        return;
    }
    let remote = remote_dir(config, run);
    match std::fs::create_dir_all(local) {
        Ok(()) => match run_once(config, &remote, &local.display().to_string()) {
            Ok(()) => tracing::info!("restored the run from {remote}"),
            Err(e) => tracing::warn!("nothing restored from {remote} (a new run?): {e}"),
        },
        Err(e) => tracing::warn!("cannot create {}: {e}", local.display()),
    }
}

fn remote_dir(config: &SyncConfig, run: &str) -> String {
    format!("{}/{run}", config.target.trim_end_matches('/'))
}

/// A background thread that mirrors the run directory when it changed, at
/// most once per period.
pub(crate) struct Syncer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    config: SyncConfig,
    source: String,
    target: String,
}

impl Syncer {
    /// Start mirroring `local` (the run directory); `changed` tells whether
    /// anything was written since the value it returned last time.
    pub fn start(
        config: SyncConfig,
        local: PathBuf,
        run: &str,
        changed: impl Fn() -> u64 + Send + 'static,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let source = local.display().to_string();
        let target = remote_dir(&config, run);
        let thread = {
            let (stop, config) = (Arc::clone(&stop), config.clone());
            let (source, target) = (source.clone(), target.clone());
            std::thread::Builder::new()
                .name("trainhost-sync".into())
                .spawn(move || {
                    let mut synced = changed();
                    let mut last = Instant::now();
                    while !stop.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_millis(50));
                        let now = changed();
                        if now != synced && last.elapsed() >= config.period {
                            // A failed periodic sync is retried at the next
                            // change and at the end, whose failure counts.
                            if let Err(e) = run_once(&config, &source, &target) {
                                tracing::error!("{e}");
                            }
                            synced = now;
                            last = Instant::now();
                        }
                    }
                })
                .ok()
        };
        Self {
            stop,
            thread,
            config,
            source,
            target,
        }
    }

    /// Stop the thread and sync once more; the error, if that final sync
    /// failed.
    pub fn finish(mut self) -> Result<(), SyncFailed> {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        run_once(&self.config, &self.source, &self.target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(command: &str) -> SyncConfig {
        SyncConfig::for_test(command)
    }

    #[test]
    fn paths_are_shell_quoted() {
        let c = config("cp -R {source} {target}");
        assert_eq!(render(&c, "/a b", "/it's"), r"cp -R '/a b' '/it'\''s'");
    }

    #[test]
    fn a_failing_command_reports_its_output() {
        let c = config("echo to-stdout; echo to-stderr >&2; exit 3 # {source} {target}");
        let err = run_once(&c, "/s", "/t").unwrap_err().to_string();
        assert!(err.contains("exit status: 3"), "{err}");
        assert!(
            err.contains("to-stdout") && err.contains("to-stderr"),
            "{err}"
        );
    }
}
