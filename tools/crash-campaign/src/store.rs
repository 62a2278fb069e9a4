//! Where the campaign's runs live, and what storage holds after a kill.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail, ensure};
use trainhost::{MetricValue, StorageOptions};

/// The storage the runs are kept in: a local directory, or an object
/// store URL with its options (an S3 server such as moto, say).
#[derive(Debug)]
pub enum Store {
    Local(PathBuf),
    Remote {
        url: String,
        options: Vec<(String, String)>,
    },
}

impl Store {
    /// The `--storage` argument.
    pub fn location(&self) -> String {
        match self {
            Store::Local(dir) => dir.display().to_string(),
            Store::Remote { url, .. } => url.clone(),
        }
    }

    /// The `--storage-option` arguments, as `key=value`.
    pub fn option_args(&self) -> Vec<String> {
        match self {
            Store::Local(_) => Vec::new(),
            Store::Remote { options, .. } => {
                options.iter().map(|(k, v)| format!("{k}={v}")).collect()
            }
        }
    }

    fn options(&self) -> StorageOptions {
        StorageOptions {
            options: match self {
                Store::Local(_) => Vec::new(),
                Store::Remote { options, .. } => options.clone(),
            },
            ..StorageOptions::default()
        }
    }

    /// Remove a finished run from local storage (runs on an object store
    /// are left: each run has a name of its own).
    pub fn remove(&self, run: &str) -> anyhow::Result<()> {
        if let Store::Local(dir) = self {
            let _ = std::fs::remove_dir_all(dir.join(run));
        }
        Ok(())
    }

    /// What storage holds of `run` after a kill: every committed checkpoint
    /// verified, and the newest one's index and epoch (`None` before the
    /// run's state exists).
    pub fn inspect(&self, run: &str) -> anyhow::Result<Option<(u64, i64)>> {
        let location = format!("{}/{run}", self.location());
        let committed = match trainhost::committed_checkpoints_with(&location, &self.options()) {
            Ok(committed) => committed,
            // No run state yet: killed before the run was created.
            Err(trainhost::Error::InvalidConfig(message))
                if message.contains("holds no trainhost run") =>
            {
                return Ok(None);
            }
            Err(e) => return Err(e.into()),
        };
        for c in &committed {
            c.verify().with_context(|| {
                format!("committed checkpoint {} does not verify", c.location())
            })?;
        }
        Ok(committed.iter().max_by_key(|c| c.index()).map(|c| {
            let epoch = match c.metrics().get("epoch") {
                Some(MetricValue::Integer(e)) => *e,
                _ => -1,
            };
            (c.index(), epoch)
        }))
    }

    /// `run` finished: its result (`result`, written by the run) lists
    /// every epoch as reported, and the latest checkpoint holds the last
    /// epoch and verifies.
    pub fn check_complete(&self, run: &str, result: &Path, epochs: u32) -> anyhow::Result<u64> {
        let json: serde_json::Value = serde_json::from_slice(
            &std::fs::read(result)
                .with_context(|| format!("the run wrote no {}", result.display()))?,
        )?;
        let mut seen = vec![false; epochs as usize];
        for report in json["metrics_history"]
            .as_array()
            .context("no metrics history")?
        {
            if let Some(e) = report["metrics"]["epoch"].as_u64() {
                seen[e as usize] = true;
            }
        }
        if let Some(missing) = seen.iter().position(|s| !s) {
            bail!("epoch {missing} was never reported");
        }
        let newest = self
            .inspect(run)?
            .context("no committed checkpoint at the end")?;
        ensure!(
            newest.1 == i64::from(epochs) - 1,
            "the last checkpoint holds epoch {}, not {}",
            newest.1,
            epochs - 1
        );
        // Over the run's life, its earlier processes included.
        Ok(json["failures"].as_u64().unwrap_or(0))
    }
}
