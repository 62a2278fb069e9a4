//! One run of a trainer, from start to result: the guest compiled once,
//! the run's record opened (or resumed), then attempts until one ends
//! without a failure, the failures run out (R20), or a stop is requested;
//! then the result (R25).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::Trainer;
use crate::attempt::{Attempt, AttemptSetup, Ended, RestoreCache};
use crate::checkpoint::Checkpoint;
use crate::config::MaxFailures;
use crate::error::Error;
use crate::failure::{FailureKind, RunFailure};
use crate::ledger::{Ledger, LedgerOptions};
use crate::owner::Owner;
use crate::result::TrainResult;
use crate::runtime::{
    GuestComponent, RESTORE_GUEST_PATH, RankDirs, RankInfo, RankShared, run_rank,
};
use crate::storage::Storage;
use crate::sync::Syncer;

use super::workdir::WorkDir;

pub(super) fn fit(trainer: &Trainer) -> Result<TrainResult, Error> {
    if tokio::runtime::Handle::try_current().is_ok() {
        return Err(Error::InsideAsyncRuntime);
    }
    crate::cluster::check_single_process()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("trainhost-io")
        .enable_all()
        .build()
        .map_err(|source| Error::Io {
            path: PathBuf::from("<tokio runtime>"),
            operation: "start the async runtime",
            source,
        })?;
    let run = &trainer.run;

    let started = std::time::Instant::now();
    let (guest, cached) = GuestComponent::compile(
        &trainer.guest.read()?,
        &trainer.guest.shown(),
        run.interruption,
        trainer.compile_cache.as_ref(),
    )?;
    tracing::debug!(elapsed = ?started.elapsed(), cache = ?cached, "guest ready");

    let (run_name, generated) = match &run.name {
        Some(name) => (name.clone(), false),
        None => (default_run_name(&trainer.guest.stem()), true),
    };
    let storage = Storage::open(&trainer.storage, &run.storage_options)?;
    rt.block_on(storage.probe())?;
    let local_run_dir = storage.local_path().map(|p| p.join(&run_name));
    if let (Some(sync), Some(dir)) = (&run.sync, &local_run_dir) {
        crate::sync::restore_if_missing(sync, dir, &run_name);
    }
    let owner = rt.block_on(Owner::acquire(
        &storage.child(&run_name),
        &run.storage_options,
    ))?;
    let result = fit_owned(
        trainer,
        &rt,
        &guest,
        Named {
            run_name,
            generated,
            storage: owner.storage().clone(),
            local_run_dir,
        },
    );
    rt.block_on(owner.release());
    result
}

/// The run's name and where it lives.
struct Named {
    run_name: String,
    /// Whether trainhost chose the name (it then must be a new run).
    generated: bool,
    /// The run's storage, as its owner writes it.
    storage: Storage,
    local_run_dir: Option<PathBuf>,
}

/// The run, once this host owns it.
fn fit_owned(
    trainer: &Trainer,
    rt: &tokio::runtime::Runtime,
    guest: &GuestComponent,
    named: Named,
) -> Result<TrainResult, Error> {
    let run = &trainer.run;
    let Named {
        run_name,
        generated,
        storage: run_storage,
        local_run_dir,
    } = named;
    let world_size = trainer.scaling.num_workers;
    let config_json = serde_json::to_string(&trainer.config).expect("JSON values serialize");
    let fingerprint = hex::encode(Sha256::digest(config_json.as_bytes()));
    let ledger = Arc::new(rt.block_on(Ledger::open(
        run_storage.clone(),
        LedgerOptions {
            run_name: &run_name,
            config_fingerprint: &fingerprint,
            world_size,
            retention: trainer.retention.clone(),
            fresh: run.fresh,
            must_be_new: generated,
        },
        rt.handle().clone(),
    ))?);
    let resume_from = match &trainer.resume_from {
        Some(location) => {
            Some(rt.block_on(Checkpoint::open_async(location, &run.storage_options))?)
        }
        None => None,
    };

    let work = WorkDir::create()?;
    let restore_root = work.path().join("checkpoints");
    create_dir(&restore_root, "create the restore directory")?;
    let gang = Gang {
        guest,
        work: work.path(),
        restore_root: &restore_root,
        shared: RankShared {
            config_json: config_json.into(),
            run_name: run_name.clone().into(),
            output: Arc::clone(&trainer.output),
            limits: run.limits.clone(),
        },
        world_size,
    };
    let restore = Arc::new(RestoreCache::new(restore_root.clone(), RESTORE_GUEST_PATH));
    tracing::info!(run = %run_storage.url(), ranks = world_size, "starting run");
    let syncer = match (&run.sync, local_run_dir) {
        (Some(sync), Some(dir)) => {
            let ledger = Arc::clone(&ledger);
            Some(Syncer::start(sync.clone(), dir, &run_name, move || {
                ledger.generation()
            }))
        }
        _ => None,
    };

    let max_failures = run.failure_config.max_failures;
    let mut error = None;
    let preempted = loop {
        let attempt = Attempt::new(AttemptSetup {
            world_size,
            report_timeout: run.report_timeout,
            ledger: Arc::clone(&ledger),
            snapshots: run
                .persist_in_background
                .then(|| work.path().join("snapshots")),
            handed_over: work.path().join("handed-over"),
            restore: Arc::clone(&restore),
            resume_from: resume_from.clone(),
            preemption: trainer.preemption.clone(),
            grace: run.preemption_grace,
            limits: run.limits.clone(),
            handle: rt.handle().clone(),
        });
        let Ended {
            failure,
            stop_requested,
            preempted,
        } = gang.run(attempt)?;
        let Some(failure) = failure else {
            break preempted;
        };
        let total = match ledger.record_failure(&failure) {
            Ok(total) => total,
            Err(e) => {
                // Storage is failing as well; a restart could not commit
                // anything either. Committed checkpoints stay.
                tracing::error!(
                    "cannot record the failure in storage ({}); not restarting",
                    crate::error::chain(&e)
                );
                error = Some(failure);
                break preempted;
            }
        };
        // A machine going away is no place to restart.
        if stop_requested || !max_failures.allows(total) {
            error = Some(failure);
            break preempted;
        }
        let budget = match max_failures {
            MaxFailures::Unlimited => "no limit".to_owned(),
            MaxFailures::Limited(n) => format!("{total} of {n} allowed"),
        };
        tracing::warn!(
            "failure {total} ({budget}): {failure}; restarting every rank from the latest committed checkpoint"
        );
    };
    if let Some(syncer) = syncer
        && let Err(e) = syncer.finish()
    {
        tracing::error!("{e}");
        error.get_or_insert(RunFailure {
            rank: None,
            kind: FailureKind::Storage,
            message: e.to_string(),
        });
    }
    if preempted {
        tracing::warn!(run = %run_storage.url(), "the run stopped early on request; run it again with the same name to resume");
    }

    let result = rt.block_on(collect_result(&ledger, run_name, error, preempted));
    drop(work);
    Ok(result)
}

/// The ranks of a run on this host, and where they live.
struct Gang<'a> {
    guest: &'a GuestComponent,
    /// The run's working directory.
    work: &'a Path,
    restore_root: &'a Path,
    shared: RankShared,
    world_size: u32,
}

impl Gang<'_> {
    /// Run every rank once as `attempt`.
    fn run(&self, attempt: Attempt) -> Result<Ended, Error> {
        // Fresh scratch directories: nothing of a failed attempt leaks into
        // the next one but what it committed.
        let scratch: Vec<PathBuf> = (0..self.world_size)
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
                world_rank: rank,
                world_size: self.world_size,
                local_rank: rank,
                local_world_size: self.world_size,
                node_rank: 0,
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

fn create_dir(dir: &Path, operation: &'static str) -> Result<(), Error> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        operation,
        source,
    })
}

/// `<guest stem>_<UTC start time>_<random>`, like Ray's
/// `TorchTrainer_2026-11-21_10-14-00` with milliseconds and 32 random bits,
/// so that runs started at the same moment get different names.
fn default_run_name(stem: &str) -> String {
    let now = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
    let stamp = now
        .trim_end_matches('Z')
        .replace('T', "_")
        .replace(':', "-");
    format!("{stem}_{stamp}_{:08x}", crate::owner::random_u64() as u32)
}

async fn collect_result(
    ledger: &Ledger,
    run_name: String,
    error: Option<RunFailure>,
    preempted: bool,
) -> TrainResult {
    let (ranked, history, failures) = ledger.snapshot();
    let mut best = Vec::with_capacity(ranked.len());
    for record in &ranked {
        match Checkpoint::load(ledger.storage().child(&record.dir_name())).await {
            Ok(checkpoint) => best.push((checkpoint, record.metrics.clone())),
            // The run's outcome matters more than this listing; storage
            // that just failed may still be failing.
            Err(e) => tracing::warn!(
                "checkpoint {} is committed but could not be read back for the result: {}",
                record.dir_name(),
                crate::error::chain(&e)
            ),
        }
    }
    let checkpoint = best
        .iter()
        .map(|(c, _)| c)
        .max_by_key(|c| c.index())
        .cloned();
    TrainResult {
        run_name,
        path: ledger.storage().url().to_owned(),
        checkpoint,
        best_checkpoints: best,
        metrics: history.last().map(|r| r.metrics.clone()),
        metrics_history: history,
        failures: failures.len() as u32,
        failure_history: failures,
        error,
        preempted,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_names_carry_the_guest_and_a_sortable_time() {
        let stem = crate::runtime::GuestSource::from("dir/linear_regression.wasm").stem();
        let name = default_run_name(&stem);
        assert!(name.starts_with("linear_regression_20"), "{name}");
        assert!(!name.contains(':'), "{name}");
        crate::config::check_run_name(&name).unwrap();
        let names: std::collections::HashSet<String> =
            (0..100).map(|_| default_run_name(&stem)).collect();
        assert_eq!(names.len(), 100, "names made in the same instant differ");
    }
}
