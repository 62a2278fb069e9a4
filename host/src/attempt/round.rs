//! One round of collective calls: what each rank brings, what the leader
//! does with it, and what every rank takes back (R6, R29–R33).
//!
//! A round is a report when every rank called `report`, an exchange when
//! every rank called a collective; anything else is a mismatch that fails
//! the run. The leader (the last rank to arrive, see `gate.rs`) commits the
//! report or sets up the exchange; each rank then takes its own result from
//! the shared outcome.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::FutureExt;

use super::gate::{Describe, Gathered, Violation, ordinal};
use super::queue::RecordFailed;
use super::{Aborted, Refused, Shared};
use crate::collective::{self, Call, CollectiveError, Delivered, Exchange, Unmet};
use crate::failure::{FailureKind, RunFailure};
use crate::metrics::Metrics;
use crate::persist::{Capture, Collision, Plan, PlanError, merge};

/// What a rank brings to a round.
pub(super) enum Arrival {
    Report {
        metrics: Metrics,
        capture: Option<Capture>,
    },
    Collective(Call),
}

impl Describe for Arrival {
    fn describe(&self) -> String {
        match self {
            Arrival::Report { capture: None, .. } => "report".into(),
            Arrival::Report {
                capture: Some(_), ..
            } => "report with a checkpoint".into(),
            Arrival::Collective(call) => call.describe(),
        }
    }
}

/// This node's ranks' report: rank 0's metrics (R6) and their files,
/// merged (R7). `Err` is a refusal to tell every rank.
pub(super) fn take_report(
    arrivals: &mut [Arrival],
) -> (
    Metrics,
    Result<Option<Plan>, Result<Collision, crate::error::Error>>,
) {
    let mut captures: Vec<Capture> = Vec::new();
    let mut metrics = None;
    for arrival in arrivals {
        if let Arrival::Report {
            metrics: m,
            capture,
        } = arrival
        {
            captures.extend(capture.take());
            metrics.get_or_insert_with(|| std::mem::take(m));
        }
    }
    let plan = if captures.is_empty() {
        Ok(None)
    } else {
        match merge(captures) {
            Ok(plan) => Ok(Some(plan)),
            Err(PlanError::Collision(collision)) => Err(Ok(collision)),
            Err(PlanError::Failed(e)) => Err(Err(e)),
        }
    };
    (metrics.unwrap_or_default(), plan)
}

/// A round's outcome, the same for every rank.
#[derive(Debug, Clone)]
pub(super) enum Outcome {
    Recorded,
    Refused(Collision),
    /// Node 0 refused the report (the message says why).
    RefusedElsewhere(String),
    /// Recording failed; the attempt is failing.
    Failed,
    Exchanged(Arc<Exchange>),
    Invalid(String),
    /// The calls do not match: every rank fails the run with this.
    Mismatch(Violation),
    /// The same in a round across nodes, settled with it: every node
    /// learns it from the round itself (node 0 sends every node its
    /// settlement of a violation, and a node holding every node's calls
    /// finds calls that differ as node 0 does). The failure is then not
    /// sent to the other nodes: sent by a node that heard node 0, it could
    /// reach a third node before node 0's settlement does and stop its
    /// ranks without the violation (R30: every rank of the round gets it).
    /// Node 0 still sends the failures it finds waiting (a node that does
    /// not come to the round is told by that).
    MismatchEverywhere(Violation),
}

impl Shared {
    /// Rank `rank`'s part of the next collective report. Returns the
    /// report's outcome, or `Aborted` if the attempt is stopping (this call
    /// may be the cause).
    pub(super) fn report(
        &self,
        rank: u32,
        metrics: Metrics,
        capture: Option<Capture>,
    ) -> impl Future<Output = Result<Result<(), Refused>, Aborted>> + use<'_> {
        self.round(rank, Arrival::Report { metrics, capture })
            .map(|outcome| match outcome {
                Ok(Outcome::Recorded) => Ok(Ok(())),
                Ok(Outcome::Refused(collision)) => Ok(Err(Refused::Collision(collision))),
                Ok(Outcome::RefusedElsewhere(message)) => Ok(Err(Refused::Elsewhere(message))),
                // A report has no error for a mismatch: the rank is
                // stopped, and the run fails saying why.
                Ok(_) | Err(_) => Err(Aborted),
            })
    }

    /// Rank `rank`'s part of the next collective call of the `collective`
    /// interface.
    pub(super) async fn collective(
        &self,
        rank: u32,
        call: Call,
    ) -> Result<Delivered, CollectiveError> {
        let lent = call.lends();
        match self.round(rank, Arrival::Collective(call)).await {
            Ok(Outcome::Exchanged(exchange)) => match exchange.deliver(rank as usize, lent).await {
                Some(delivered) => Ok(delivered),
                // A rank's lent values were not read: its call was dropped,
                // as the attempt stops.
                None => Err(CollectiveError::Aborted(self.stop_reason())),
            },
            Ok(Outcome::Invalid(message)) => Err(CollectiveError::Invalid(message)),
            Err(Some(violation)) => Err(CollectiveError::Mismatch(violation.to_string())),
            Ok(_) | Err(None) => Err(CollectiveError::Aborted(self.stop_reason())),
        }
    }

    /// See [`super::RankHandle::collective_alone`].
    pub(super) fn collective_alone(&self, rank: u32) -> Result<(), CollectiveError> {
        debug_assert!(self.span.is_none(), "one rank in all means one node");
        self.supervisor.alive(rank);
        match self.supervisor.is_stopping() {
            true => Err(CollectiveError::Aborted(self.stop_reason())),
            false => Ok(()),
        }
    }

    /// Arrive for the next round and wait for its outcome. `Err` when the
    /// attempt is stopping: with the violation if the ranks broke the
    /// protocol (the run is failed with it).
    ///
    /// Its callers' futures hold this one, and a report's is boxed by the
    /// bindings: the future is the gate's own with the outcome mapped, no
    /// `async fn` state around it that would keep the arrival twice.
    fn round(
        &self,
        rank: u32,
        arrival: Arrival,
    ) -> impl Future<Output = Result<Outcome, Option<Violation>>> + use<'_> {
        // Waiting for slower ranks is not stalling; the stall clock starts
        // again when the call returns.
        self.supervisor.waiting(rank, true);
        self.gate
            .arrive(rank as usize, arrival, |gathered| self.lead(gathered))
            .map(move |outcome| {
                self.supervisor.alive(rank);
                self.supervisor.waiting(rank, false);
                match outcome {
                    Ok(Outcome::Mismatch(violation)) | Err(Ok(violation)) => {
                        // Every rank of a mismatched round gets here; the
                        // first failure is the one kept.
                        self.fail_protocol(violation.clone());
                        Err(Some(violation))
                    }
                    Ok(Outcome::MismatchEverywhere(violation)) => {
                        self.fail_here(protocol_failure(&violation));
                        Err(Some(violation))
                    }
                    Ok(Outcome::Failed) | Err(Err(Aborted)) => Err(None),
                    Ok(outcome) => Ok(outcome),
                }
            })
    }

    /// The leader's part: run the round every rank has arrived for.
    fn lead(&self, gathered: Gathered<Arrival>) -> Outcome {
        let arrivals = gathered.arrivals;
        if let Some(span) = &self.span {
            return self.lead_across(span, arrivals);
        }
        if arrivals.iter().all(|a| matches!(a, Arrival::Report { .. })) {
            return self.record(arrivals);
        }
        let mismatch = |each: String| {
            Outcome::Mismatch(Violation::new(format!(
                "the {} collective call does not match: {each}",
                ordinal(self.gate.rounds() + 1)
            )))
        };
        if arrivals.iter().any(|a| matches!(a, Arrival::Report { .. })) {
            let each: Vec<String> = arrivals
                .iter()
                .enumerate()
                .map(|(r, a)| format!("rank {r} called {}", a.describe()))
                .collect();
            return mismatch(each.join(", "));
        }
        let calls = arrivals
            .into_iter()
            .map(|a| match a {
                Arrival::Collective(call) => call,
                Arrival::Report { .. } => unreachable!("no report in this round"),
            })
            .collect();
        match collective::meet(calls, self.limits.max_memory) {
            Ok(exchange) => Outcome::Exchanged(Arc::new(exchange)),
            Err(Unmet::Invalid(message)) => Outcome::Invalid(message),
            Err(Unmet::Mismatch(each)) => mismatch(each),
        }
    }

    /// Record a report every rank of this host made (a run on one host).
    pub(super) fn record(&self, mut arrivals: Vec<Arrival>) -> Outcome {
        let Some(recorder) = &self.recorder else {
            debug_assert!(false, "only the node that records leads a report");
            return Outcome::Failed;
        };
        let (metrics, plan) = take_report(&mut arrivals);
        let result = match plan {
            Ok(plan) => recorder.record_plan(metrics, plan, None).map(Ok),
            Err(Ok(collision)) => Ok(Err(collision)),
            Err(Err(e)) => Err(e.into()),
        };
        self.recorded(result)
    }

    /// The outcome of recording a report; latches a stop request.
    pub(super) fn recorded(&self, result: Result<Result<(), Collision>, RecordFailed>) -> Outcome {
        let outcome = match result {
            Ok(Ok(())) => Outcome::Recorded,
            Ok(Err(collision)) => Outcome::Refused(collision),
            Err(failed) => {
                self.fail_recording(failed);
                Outcome::Failed
            }
        };
        // Latched here, between reports, so that every rank sees the
        // request after the same report.
        let completed = self.completed.fetch_add(1, Ordering::SeqCst) + 1;
        if self.preemption.is_requested() {
            self.preempt_after.get_or_init(|| completed);
        }
        outcome
    }

    /// Ranks broke the protocol: the message names them all.
    pub(super) fn fail_protocol(&self, violation: Violation) {
        self.fail(protocol_failure(&violation));
    }

    /// Why the attempt is stopping, for a rank released from a collective.
    fn stop_reason(&self) -> String {
        match self.supervisor.failure() {
            Some(failure) => format!("the run is stopping: {failure}"),
            None => "the run is stopping: preemption's grace period ran out or the run was stopped"
                .into(),
        }
    }
}

/// The run's failure for a violation of the protocol.
fn protocol_failure(violation: &Violation) -> RunFailure {
    RunFailure {
        rank: None,
        kind: FailureKind::Protocol,
        message: violation.to_string(),
    }
}
