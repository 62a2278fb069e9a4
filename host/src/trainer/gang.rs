//! The ranks of a run on this host, and their directories: what every node
//! runs for each attempt.

use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::Trainer;
use super::workdir::WorkDir;
use crate::attempt::{Attempt, Ended, RestoreCache};
use crate::cluster::Layout;
use crate::error::Error;
use crate::runtime::{
    GuestComponent, RESTORE_GUEST_PATH, RankDirs, RankInfo, RankShared, run_rank,
};

/// Where a host's ranks live during a run: its working directory (the
/// ranks' scratch directories, snapshots, directories handed over) and the
/// local copies of restored checkpoints, which every rank sees read-only.
pub(super) struct Site {
    pub work: WorkDir,
    restore_root: PathBuf,
    pub restore: Arc<RestoreCache>,
}

impl Site {
    pub fn create() -> Result<Self, Error> {
        let work = WorkDir::create()?;
        let restore_root = work.path().join("checkpoints");
        create_dir(&restore_root, "create the restore directory")?;
        Ok(Self {
            restore: Arc::new(RestoreCache::new(restore_root.clone(), RESTORE_GUEST_PATH)),
            work,
            restore_root,
        })
    }

    /// The ranks of `trainer`'s run `run_name` on this host.
    pub fn gang<'a>(
        &'a self,
        trainer: &Trainer,
        guest: &'a GuestComponent,
        run_name: &str,
        layout: Layout,
    ) -> Gang<'a> {
        Gang {
            guest,
            work: self.work.path(),
            restore_root: &self.restore_root,
            shared: RankShared {
                config_json: serde_json::to_string(&trainer.config)
                    .expect("JSON values serialize")
                    .into(),
                run_name: run_name.into(),
                output: Arc::clone(&trainer.output),
                limits: trainer.run.limits.clone(),
            },
            layout,
            attempts: Cell::new(0),
        }
    }
}

/// The ranks of a run on this host, and where they live.
pub(super) struct Gang<'a> {
    guest: &'a GuestComponent,
    /// The run's working directory.
    work: &'a Path,
    restore_root: &'a Path,
    shared: RankShared,
    layout: Layout,
    /// How many attempts this host has run: each gets scratch directories
    /// of its own.
    attempts: Cell<u32>,
}

impl Gang<'_> {
    /// Run every rank once as `attempt`.
    pub fn run(&self, attempt: Attempt) -> Result<Ended, Error> {
        // Fresh scratch directories: nothing of a failed attempt leaks into
        // the next one but what it committed.
        let n = self.attempts.get();
        self.attempts.set(n + 1);
        let root = self.work.join(format!("attempt-{n}"));
        let scratch: Vec<PathBuf> = (0..self.layout.per_node)
            .map(|r| root.join(format!("rank-{r}")))
            .collect();
        for dir in &scratch {
            create_dir(dir, "create a rank's scratch directory")?;
        }
        // The previous attempt's are removed while this one runs, not
        // before it starts: on a file system busy with another process's
        // writes each unlink can wait tens of milliseconds for the journal,
        // and a restart would wait for all of them.
        let previous = n
            .checked_sub(1)
            .map(|p| self.work.join(format!("attempt-{p}")));
        Ok(std::thread::scope(|scope| {
            if let Some(previous) = &previous {
                let removal = std::thread::Builder::new()
                    .name("trainhost-scratch-removal".into())
                    .spawn_scoped(scope, move || remove_scratch(previous));
                if removal.is_err() {
                    // No thread to spare: remove them now instead.
                    remove_scratch(previous);
                }
            }
            self.run_ranks(attempt, &scratch)
        }))
    }

    fn run_ranks(&self, attempt: Attempt, scratch: &[PathBuf]) -> Ended {
        let ticker = self.guest.start_ticker();
        let ended = attempt.run(scratch, |handle| {
            let rank = handle.rank();
            let info = RankInfo {
                world_rank: self.layout.world_rank(rank),
                world_size: self.layout.world_size(),
                local_rank: rank,
                local_world_size: self.layout.per_node,
                node_rank: self.layout.node,
            };
            let dirs = RankDirs {
                scratch: &scratch[rank as usize],
                restore: self.restore_root,
            };
            Box::pin(run_rank(
                self.guest,
                info,
                self.shared.clone(),
                dirs,
                handle,
            ))
        });
        drop(ticker);
        ended
    }
}

/// Remove a finished attempt's scratch directories. Failing to is not an
/// error of the run (the run's working directory goes when it ends): it is
/// logged.
fn remove_scratch(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        tracing::warn!(dir = %dir.display(), "cannot remove a finished attempt's scratch directories: {e}");
    }
}

fn create_dir(dir: &Path, operation: &'static str) -> Result<(), Error> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        operation,
        source,
    })
}
