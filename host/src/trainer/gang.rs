//! The ranks of a run on this host, and their directories: what every node
//! runs for each attempt.

use std::path::{Path, PathBuf};

use crate::attempt::{Attempt, Ended};
use crate::cluster::Layout;
use crate::error::Error;
use crate::runtime::{GuestComponent, RankDirs, RankInfo, RankShared, run_rank};

/// The ranks of a run on this host, and where they live.
pub(super) struct Gang<'a> {
    pub guest: &'a GuestComponent,
    /// The run's working directory.
    pub work: &'a Path,
    pub restore_root: &'a Path,
    pub shared: RankShared,
    pub layout: Layout,
}

impl Gang<'_> {
    /// Run every rank once as `attempt`.
    pub fn run(&self, attempt: Attempt) -> Result<Ended, Error> {
        // Fresh scratch directories: nothing of a failed attempt leaks into
        // the next one but what it committed.
        let scratch: Vec<PathBuf> = (0..self.layout.per_node)
            .map(|r| self.work.join(format!("rank-{r}")))
            .collect();
        for dir in &scratch {
            let _ = std::fs::remove_dir_all(dir);
            create_dir(dir, "create a rank's scratch directory")?;
        }
        let ticker = self.guest.start_ticker();
        let ended = attempt.run(|handle| {
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
        Ok(ended)
    }
}

pub(super) fn create_dir(dir: &Path, operation: &'static str) -> Result<(), Error> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        operation,
        source,
    })
}
