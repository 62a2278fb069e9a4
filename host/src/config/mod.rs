//! Everything a user sets about a run, shaped like Ray Train's config
//! objects, and checked once: [`RunConfig::check`] is the only place a
//! setting is validated, and the CLI only maps its flags onto these types
//! (through their `FromStr` where text needs reading).
//!
//! This module sits at the bottom of the crate: it knows no storage, no
//! engine and no ranks, so every other part can take its settings from
//! here.

mod checkpoint;
mod failure;
mod limits;
mod storage;
mod sync;

use std::time::Duration;

pub use checkpoint::{CheckpointConfig, ScoreOrder};
pub(crate) use checkpoint::{NotAScore, Retention};
pub use failure::{FailureConfig, MaxFailures};
pub(crate) use limits::human_bytes;
pub use limits::{Interruption, ResourceLimits};
pub(crate) use storage::Location;
pub use storage::StorageOptions;
pub use sync::{DEFAULT_SYNC_PERIOD, SyncConfig};

use crate::error::Error;

/// The storage used when none is given, as in Ray's `~/ray_results`.
pub const DEFAULT_STORAGE: &str = "./trainhost_results";
/// How long ranks wait for each other in `report` by default.
pub const DEFAULT_REPORT_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// How long ranks have to checkpoint after preemption is requested, by
/// default.
pub const DEFAULT_PREEMPTION_GRACE: Duration = Duration::from_secs(30);

/// How many ranks to run (Ray's `ScalingConfig`).
///
/// ```
/// let scaling = trainhost::ScalingConfig { num_workers: 4 };
/// assert_eq!(trainhost::ScalingConfig::default().num_workers, 1);
/// # let _ = scaling;
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScalingConfig {
    /// The number of ranks (Ray's `num_workers`). Default 1.
    pub num_workers: u32,
}

impl Default for ScalingConfig {
    fn default() -> Self {
        Self { num_workers: 1 }
    }
}

impl ScalingConfig {
    pub(crate) fn check(&self) -> Result<(), Error> {
        if self.num_workers == 0 {
            return Err(Error::InvalidConfig(
                "num_workers is 0; a run needs at least one rank".into(),
            ));
        }
        Ok(())
    }
}

/// Where and under which name the run is recorded (Ray's `RunConfig`).
///
/// ```
/// use std::time::Duration;
/// use trainhost::{FailureConfig, MaxFailures, RunConfig};
/// let run = RunConfig {
///     name: Some("mnist".into()),
///     storage_path: "s3://team-bucket/runs".into(),
///     failure_config: FailureConfig { max_failures: MaxFailures::Unlimited },
///     preemption_grace: Duration::from_secs(120),
///     ..RunConfig::default()
/// };
/// # let _ = run;
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct RunConfig {
    /// The run's name, its directory under `storage_path`. Default: the
    /// guest's file name, the start time and 32 random bits,
    /// `mnist_2026-11-21_10-14-00.123_5f0c9a2e`, always a new run. Running
    /// again with an existing name continues that run, unless another
    /// process owns it right now ([`crate::Error::RunInUse`], R27).
    pub name: Option<String>,
    /// Where runs are stored: a directory (default
    /// [`DEFAULT_STORAGE`]), `file://`, `memory://`, or an object store URL.
    pub storage_path: String,
    /// Which checkpoints to keep.
    pub checkpoint_config: CheckpointConfig,
    /// How many failures to survive.
    pub failure_config: FailureConfig,
    /// How long a rank waits in `report` or a collective for the other
    /// ranks' matching call before the run fails naming the missing ranks.
    /// Default 30 minutes.
    pub report_timeout: Duration,
    /// After preemption is requested, how long the ranks have to report a
    /// final checkpoint and return before they are stopped. Default 30 s.
    pub preemption_grace: Duration,
    /// If a run of this name exists: `false` (default) continues it,
    /// `true` deletes it and starts over. A name whose directory holds
    /// checkpoints or a history but no run state (a start-fresh that was
    /// interrupted) is refused unless `true`, which deletes them.
    pub fresh: bool,
    /// Endpoint, credentials, retries and timeouts for object stores
    /// (also used to read `resume_from`).
    pub storage_options: StorageOptions,
    /// Mirror the run directory (local storage only) to a target with an
    /// external command, and restore from it when the local copy is
    /// missing.
    pub sync: Option<SyncConfig>,
    /// What each rank may use.
    pub limits: ResourceLimits,
    /// `true` (default): `report` returns once a checkpoint's files are
    /// copied to a local snapshot (on local storage: to their place in
    /// storage, which costs the same), and the upload and commit go on in
    /// the background while the ranks train; a storage failure fails the
    /// run at the next report or at the end. `false`: `report` returns once
    /// the checkpoint is committed in storage.
    pub persist_in_background: bool,
    /// How ranks are stopped: anywhere (default), or only when they call
    /// the host, which lets guest code run at native speed. See
    /// [`Interruption`].
    pub interruption: Interruption,
    /// `true` (default): store the metrics history as a TensorBoard event
    /// file too (`events.out.tfevents.trainhost` beside `metrics.jsonl`;
    /// `tensorboard --logdir <storage>` shows every run), rank 0's numeric
    /// metrics with the report's index as the step (R49).
    pub tensorboard: bool,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            name: None,
            storage_path: DEFAULT_STORAGE.into(),
            checkpoint_config: CheckpointConfig::default(),
            failure_config: FailureConfig::default(),
            report_timeout: DEFAULT_REPORT_TIMEOUT,
            preemption_grace: DEFAULT_PREEMPTION_GRACE,
            fresh: false,
            storage_options: StorageOptions::default(),
            sync: None,
            limits: ResourceLimits::default(),
            persist_in_background: true,
            interruption: Interruption::default(),
            tensorboard: true,
        }
    }
}

/// What a run takes from its [`RunConfig`] once checked.
#[derive(Debug, Clone)]
pub(crate) struct Checked {
    /// Where runs are stored.
    pub storage: Location,
    /// The retention policy.
    pub retention: Retention,
}

impl RunConfig {
    /// Where the run named by [`RunConfig::name`] is stored:
    /// `<storage_path>/<name>`, as a directory or URL that
    /// [`crate::committed_checkpoints`] and the CLI's `checkpoints` accept.
    ///
    /// ```
    /// let run = trainhost::RunConfig {
    ///     name: Some("demo".into()),
    ///     storage_path: "s3://bucket/runs/".into(),
    ///     ..trainhost::RunConfig::default()
    /// };
    /// assert_eq!(run.run_location()?, "s3://bucket/runs/demo");
    /// # Ok::<(), trainhost::Error>(())
    /// ```
    pub fn run_location(&self) -> Result<String, Error> {
        let Some(name) = &self.name else {
            return Err(Error::InvalidConfig(
                "the run has no name yet (a name is chosen when it starts); give the run's name"
                    .into(),
            ));
        };
        check_run_name(name)?;
        Ok(Location::parse(&self.storage_path)?.child(name).to_string())
    }

    /// Check every setting, and the settings against each other.
    pub(crate) fn check(&self) -> Result<Checked, Error> {
        if let Some(name) = &self.name {
            check_run_name(name)?;
        }
        let storage = Location::parse(&self.storage_path)?;
        if self.report_timeout.is_zero() {
            return Err(Error::InvalidConfig(
                "report_timeout is zero; ranks need time to meet in report".into(),
            ));
        }
        let retention = self.checkpoint_config.retention()?;
        if self.storage_options.lease_timeout < std::time::Duration::from_secs(2) {
            // Storage servers stamp objects in whole seconds.
            return Err(Error::InvalidConfig(format!(
                "the storage lease timeout (--storage-lease) must be at least 2s, got {:?}",
                self.storage_options.lease_timeout
            )));
        }
        if self.limits.max_scratch_bytes == Some(0) {
            // The limit counts each file at least a block: 0 would fail a
            // rank for its first file, which is never what is meant.
            return Err(Error::InvalidConfig(
                "the scratch limit (max_scratch_bytes, --max-scratch) is 0, which no file fits in; give a size such as 20GiB, or leave the limit out for none".into(),
            ));
        }
        if self.interruption == Interruption::AtHostCalls {
            let limits = &self.limits;
            let needs_stop = [
                ("stall_timeout", limits.stall_timeout.is_some()),
                ("attempt_timeout", limits.attempt_timeout.is_some()),
                ("max_scratch_bytes", limits.max_scratch_bytes.is_some()),
            ];
            if let Some((name, _)) = needs_stop.iter().find(|(_, set)| *set) {
                return Err(Error::InvalidConfig(format!(
                    "{name} needs interruption Anywhere: with AtHostCalls a rank computing past the limit cannot be stopped; drop the limit or interrupt anywhere"
                )));
            }
        }
        if let Some(sync) = &self.sync {
            sync.validate()?;
            if storage.local_dir().is_none() {
                return Err(Error::InvalidConfig(format!(
                    "a sync command mirrors a local run directory; storage {} is not local (sync to it directly, or use a local directory)",
                    self.storage_path
                )));
            }
        }
        if !self.storage_options.options.is_empty() && !storage.is_object_store() {
            return Err(Error::InvalidConfig(format!(
                "storage options apply to object stores (s3://, gs://, az://), not to {}",
                self.storage_path
            )));
        }
        Ok(Checked { storage, retention })
    }
}

/// A run name becomes a directory name: plain, not hidden, no separators.
pub(crate) fn check_run_name(name: &str) -> Result<(), Error> {
    let bad = name.is_empty()
        || name == "."
        || name == ".."
        || name.starts_with('.')
        || name
            .chars()
            .any(|c| c == '/' || c == '\\' || c.is_control());
    if bad {
        return Err(Error::InvalidConfig(format!(
            "run name {name:?} cannot be a directory name; use letters, digits, '-', '_' and '.' (not first)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scratch_limit_of_nothing_is_refused() {
        let config = |bytes| RunConfig {
            limits: ResourceLimits {
                max_scratch_bytes: Some(bytes),
                ..ResourceLimits::default()
            },
            ..RunConfig::default()
        };
        let err = config(0).check().unwrap_err();
        assert!(err.to_string().contains("--max-scratch"), "{err}");
        assert!(config(4096).check().is_ok());
    }

    #[test]
    fn run_names_must_be_plain_directory_names() {
        for bad in ["", ".", "..", ".hidden", "a/b", "a\\b", "a\nb"] {
            assert!(check_run_name(bad).is_err(), "{bad:?}");
        }
        for good in ["demo", "mnist_2026-11-21_10-14-00", "a.b=c"] {
            assert!(check_run_name(good).is_ok(), "{good:?}");
        }
    }
}
