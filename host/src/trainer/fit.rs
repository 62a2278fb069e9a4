//! One run of a trainer, from start to result: the guest compiled once,
//! the run's record opened (or resumed), then attempts until one ends
//! without a failure, the failures run out (R20), or a stop is requested;
//! then the result (R25).
//!
//! A run over several hosts runs this on every node (`nodes.rs` for the
//! start): node 0 owns the run's record and decides, after every attempt,
//! whether the nodes run another one together; the other nodes follow
//! (`follow`), running their ranks' part of each attempt and telling node 0
//! how it ended.

use std::path::PathBuf;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::{Trainer, nodes};
use crate::attempt::{Attempt, AttemptSetup, Ended, Records, Span};
use crate::checkpoint::Checkpoint;
use crate::cluster::wire::{Header, Message, Next};
use crate::cluster::{Layout, Link};
use crate::config::MaxFailures;
use crate::error::Error;
use crate::failure::{FailureKind, RunFailure};
use crate::ledger::{Ledger, LedgerOptions};
use crate::owner::Owner;
use crate::result::TrainResult;
use crate::runtime::GuestComponent;
use crate::storage::Storage;
use crate::sync::Syncer;

use super::gang::Site;

pub(super) fn fit(trainer: &Trainer) -> Result<TrainResult, Error> {
    if tokio::runtime::Handle::try_current().is_ok() {
        return Err(Error::InsideAsyncRuntime);
    }
    let link = crate::cluster::join()?.map(Arc::new);
    let layout = match &link {
        Some(link) => Layout::new(trainer.scaling.num_workers, link.index(), link.nodes())?,
        None => Layout {
            node: 0,
            nodes: 1,
            per_node: trainer.scaling.num_workers,
        },
    };
    if let Some(link) = &link {
        let host_processes = link.host_processes() as usize;
        crate::cores::share(host_processes);
        if host_processes > 1 {
            tracing::info!(
                host_processes,
                cores = crate::cores::cores(),
                host_cores = crate::cores::host_cores(),
                "the job's processes on this host share its cores"
            );
        }
        let threads = crate::executor::threads_for(layout.per_node as usize);
        link.share_host(threads, crate::cores::host_cores());
    }
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
    let bytes = trainer.guest.read()?;
    let (guest, cached) = GuestComponent::compile(
        &bytes,
        &trainer.guest.shown(),
        run.interruption,
        trainer.compile_cache.as_ref(),
    )?;
    tracing::debug!(elapsed = ?started.elapsed(), cache = ?cached, "guest ready");

    let proposed = match &run.name {
        Some(name) => (name.clone(), false),
        None => (default_run_name(&trainer.guest.stem()), true),
    };
    let (run_name, generated) = match &link {
        Some(link) => nodes::agree(link, nodes::fingerprint(trainer, &bytes), proposed)?,
        None => proposed,
    };
    let storage = Storage::open(&trainer.storage, &run.storage_options)?;
    rt.block_on(storage.probe())?;
    if let Some(link) = link.as_ref().filter(|l| l.index() != 0) {
        rt.block_on(nodes::answer_probe(link, &storage.child(&run_name)))?;
        return super::follow::follow(
            trainer,
            &rt,
            &guest,
            Arc::clone(link),
            layout,
            run_name,
            storage,
        );
    }
    let local_run_dir = storage.local_path().map(|p| p.join(&run_name));
    if let (Some(sync), Some(dir)) = (&run.sync, &local_run_dir) {
        crate::sync::restore_if_missing(sync, dir, &run_name);
    }
    let owner = rt.block_on(Owner::acquire(
        &storage.child(&run_name),
        &run.storage_options,
    ))?;
    if let Some(link) = &link
        && let Err(e) = rt.block_on(nodes::probe(link, owner.storage()))
    {
        rt.block_on(owner.release());
        return Err(e);
    }
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
        link.map(|link| (link, layout)),
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

/// The run, once this host owns it; with the other nodes, if it spans
/// several hosts.
fn fit_owned(
    trainer: &Trainer,
    rt: &tokio::runtime::Runtime,
    guest: &GuestComponent,
    named: Named,
    nodes: Option<(Arc<Link>, Layout)>,
) -> Result<TrainResult, Error> {
    let run = &trainer.run;
    let Named {
        run_name,
        generated,
        storage: run_storage,
        local_run_dir,
    } = named;
    let world_size = trainer.scaling.num_workers;
    let layout = nodes.as_ref().map_or(
        Layout {
            node: 0,
            nodes: 1,
            per_node: world_size,
        },
        |(_, layout)| *layout,
    );
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
            tensorboard: run.tensorboard,
        },
        rt.handle().clone(),
    ))?);
    let resume_from = match &trainer.resume_from {
        Some(location) => {
            Some(rt.block_on(Checkpoint::open_async(location, &run.storage_options))?)
        }
        None => None,
    };

    let site = Site::create()?;
    let gang = site.gang(trainer, guest, &run_name, layout);
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
    let mut number = 0u64;
    // The copy of the checkpoint the next attempt restores, started ahead
    // of it; dropped (stopped, its thread joined) before the site is.
    let mut ahead = None;
    let preempted = loop {
        number += 1;
        ledger.begin_attempt();
        let span = nodes.as_ref().map(|(link, layout)| Span {
            link: Arc::clone(link),
            layout: *layout,
            attempt: number,
        });
        if let Some(span) = &span {
            // The other nodes restore what this node's ranks will: the
            // latest committed checkpoint, else --resume-from.
            let resume = ledger
                .newest_first()
                .first()
                .map(|record| run_storage.child(&record.dir_name()).url().to_owned())
                .or_else(|| resume_from.as_ref().map(|c| c.location().to_owned()));
            span.link
                .discard(|h| nodes::message_attempt(h).is_some_and(|a| a < number));
            span.link.send_to_others(&Message::new(Header::Attempt {
                attempt: number,
                next: Next::Run { resume },
            }));
        }
        let attempt = Attempt::new(AttemptSetup {
            world_size: layout.per_node,
            span: span.clone(),
            report_timeout: run.report_timeout,
            records: Records::Here(Arc::clone(&ledger)),
            snapshots: run
                .persist_in_background
                .then(|| site.work.path().join("snapshots")),
            handed_over: site.work.path().join("handed-over"),
            restore: Arc::clone(&site.restore),
            resume_from: resume_from.clone(),
            preemption: trainer.preemption.clone(),
            grace: run.preemption_grace,
            limits: run.limits.clone(),
            handle: rt.handle().clone(),
        });
        let mut ended = gang.run(attempt)?;
        if let Some(span) = &span {
            // Ranks elsewhere still calling would wait for these forever.
            span.link
                .send_to_others(&Message::new(Header::Over { attempt: number }));
            ended = nodes::merge_ended(&span.link, number, ended);
        }
        let Ended {
            failure,
            stop_requested,
            preempted,
        } = ended;
        let Some(failure) = failure else {
            break preempted;
        };
        // A restart follows unless this failure is one too many (checked
        // again below) or the machine is going away:
        // the next ranks' checkpoint is copied meanwhile.
        if !stop_requested && max_failures.allows(ledger.failure_count() + 1) {
            ahead = Some(site.restore.prefetch(
                Arc::clone(&ledger),
                resume_from.clone(),
                rt.handle(),
            ));
        }
        let total = ledger.note_failure(&failure);
        // The previous restart's record must have landed before this one
        // is left behind (a guest failing at once while storage is down
        // restarts no faster than storage answers); if it could not be
        // stored, storage is failing and a restart could not commit
        // anything either. A machine going away is no place to restart.
        let behind = ledger.finish_behind();
        if stop_requested || !max_failures.allows(total) || behind.is_err() {
            let stored = behind.and_then(|()| ledger.store_now());
            if let Err(e) = stored {
                tracing::error!(
                    "cannot record the failure in storage ({}); not restarting",
                    crate::error::chain(e.as_ref())
                );
            }
            error = Some(failure);
            break preempted;
        }
        // The failure's record and the history are stored while the next
        // attempt starts (see `ledger::writes`); if they cannot be, that
        // attempt fails with the storage error and the run ends there.
        // Committed checkpoints stay.
        ledger.store_behind();
        let budget = match max_failures {
            MaxFailures::Unlimited => "no limit".to_owned(),
            MaxFailures::Limited(n) => format!("{total} of {n} allowed"),
        };
        // The failure's evidence (a trap's backtrace, the rank's stderr)
        // is logged here, or in the run's error when it is not restarted;
        // where it happened only its headline is.
        tracing::warn!(
            "failure {total} ({budget}), restarting every rank from the latest committed checkpoint: {failure}"
        );
    };
    // A run that ended on a failure waited for the writes left behind
    // above, and logged their failure; one whose last attempt succeeded
    // may still have the previous failure's record in flight.
    if error.is_none()
        && let Err(e) = ledger.finish_behind()
    {
        tracing::error!(
            "cannot record a failure in storage ({})",
            crate::error::chain(e.as_ref())
        );
        error.get_or_insert(RunFailure {
            rank: None,
            kind: FailureKind::Storage,
            message: crate::error::chain(e.as_ref()),
        });
    }
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

    let mut result = rt.block_on(collect_result(&ledger, run_name, error, preempted));
    result.node = (layout.node, layout.nodes);
    if let Some((link, _)) = &nodes {
        link.send_to_others(&Message::new(Header::Attempt {
            attempt: number + 1,
            next: Next::End {
                error: result.error.clone(),
                preempted: result.preempted,
                failures: result.failures,
            },
        }));
    }
    drop(ahead);
    drop(gang);
    drop(site);
    Ok(result)
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
        node: (0, 1),
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
