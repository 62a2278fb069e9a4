//! A node other than 0 of a run over several hosts: it runs its ranks'
//! part of every attempt node 0 starts, restoring the checkpoint node 0
//! chose, and tells node 0 how the attempt ended, until node 0 says the
//! run is over. It keeps no record of the run (node 0 does); it persists
//! its own ranks' checkpoint files, which node 0 commits.

use std::sync::Arc;

use super::Trainer;
use super::gang::Site;
use super::nodes::message_attempt;
use crate::attempt::{Attempt, AttemptSetup, Ended, Following, Records, Span};
use crate::checkpoint::Checkpoint;
use crate::cluster::wire::{Header, Message, Next};
use crate::cluster::{Layout, Link};
use crate::error::Error;
use crate::failure::{FailureKind, RunFailure};
use crate::result::TrainResult;
use crate::runtime::GuestComponent;
use crate::storage::Storage;

/// Run each attempt node 0 starts, until node 0 says the run is over.
pub(super) fn follow(
    trainer: &Trainer,
    rt: &tokio::runtime::Runtime,
    guest: &GuestComponent,
    link: Arc<Link>,
    layout: Layout,
    run_name: String,
    storage: Storage,
) -> Result<TrainResult, Error> {
    let run = &trainer.run;
    let site = Site::create()?;
    let gang = site.gang(trainer, guest, &run_name, layout);
    tracing::info!(
        node = layout.node,
        nodes = layout.nodes,
        ranks = layout.per_node,
        "following node 0"
    );
    loop {
        let message = link.receive(0, |h| matches!(h, Header::Attempt { .. }));
        let Header::Attempt { attempt, next } = message.header else {
            unreachable!("taken as an attempt");
        };
        let resume = match next {
            Next::Run { resume } => resume,
            Next::End {
                error,
                preempted,
                failures,
            } => {
                drop(gang);
                drop(site);
                return Ok(TrainResult {
                    path: storage.child(&run_name).url().to_owned(),
                    run_name,
                    checkpoint: None,
                    best_checkpoints: Vec::new(),
                    metrics: None,
                    metrics_history: Vec::new(),
                    failures,
                    failure_history: Vec::new(),
                    error,
                    preempted,
                    node: (layout.node, layout.nodes),
                });
            }
        };
        // Messages of an earlier attempt are no use any more.
        link.discard(|h| message_attempt(h).is_some_and(|a| a < attempt));
        let resume = match resume {
            Some(location) => {
                match rt.block_on(Checkpoint::open_async(&location, &run.storage_options)) {
                    Ok(checkpoint) => Ok(Some(checkpoint)),
                    Err(e) => Err(e),
                }
            }
            None => Ok(None),
        };
        let span = Span {
            link: Arc::clone(&link),
            layout,
            attempt,
        };
        let ended = match resume {
            Ok(resume) => gang.run(Attempt::new(AttemptSetup {
                world_size: layout.per_node,
                span: Some(span),
                report_timeout: run.report_timeout,
                records: Records::Elsewhere(Box::new(Following {
                    retention: trainer.retention.clone(),
                    resume,
                    run: storage.child(&run_name),
                })),
                snapshots: run
                    .persist_in_background
                    .then(|| site.work.path().join("snapshots")),
                handed_over: site.work.path().join("handed-over"),
                restore: Arc::clone(&site.restore),
                resume_from: None,
                preemption: trainer.preemption.clone(),
                grace: run.preemption_grace,
                limits: run.limits.clone(),
                handle: rt.handle().clone(),
            }))?,
            Err(e) => Ended {
                failure: Some(RunFailure {
                    rank: None,
                    kind: FailureKind::Restore,
                    message: format!(
                        "node {} cannot open the checkpoint to resume from: {}",
                        layout.node,
                        crate::error::chain(&e)
                    ),
                }),
                stop_requested: false,
                preempted: false,
            },
        };
        link.send(
            0,
            &Message::new(Header::Ended {
                attempt,
                failure: ended.failure,
                stop_requested: ended.stop_requested,
                preempted: ended.preempted,
            }),
        );
    }
}
