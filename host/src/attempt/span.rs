//! Rounds whose ranks live on several nodes (a run over several hosts):
//! who tells whom what. What a round's calls come to is `settle.rs`.
//!
//! Each node's gate gathers its own ranks' calls as on one host; its
//! leader then takes the round across nodes, in one of two ways, chosen
//! by the round's calls alone (`calls::settled_everywhere`):
//!
//! - A collective whose data is small enough to travel in the calls (a
//!   barrier, a broadcast, an all-gather, an all-reduce of at most
//!   `collective::EXCHANGED_BYTES`): every node sends every other what
//!   its ranks called, with its data (the root's broadcast data, its
//!   ranks' all-gather pieces, its partial all-reduce), and settles the
//!   round itself from all of them, in node order: the same values and
//!   the same operations give every node the same, bit-identical result.
//! - A report, or a larger all-reduce: a node sends node 0 its calls (and
//!   a partial min or max), and waits for node 0's outcome. Node 0
//!   matches the calls of every rank of the job (R30 across nodes),
//!   records a report (only node 0 records; every node persists its own
//!   ranks' checkpoint files, see `shards.rs`), or combines the exchange,
//!   and tells every node; a sum or mean it tells every node to sum with
//!   MPI's all-reduce, each keeping its partial result for that (R38).
//!
//! Either way node 0 alone judges what goes wrong (a node that does not
//! arrive in time, calls that do not match) and tells every node, so a
//! node whose ranks called something else than the others learns it
//! whichever way it waits.
//!
//! A leader waiting for other nodes gives up when its attempt stops: a
//! failure anywhere reaches every node as a message (`Shared::fail`, and
//! the watcher, which takes failures of other nodes off the link).

use std::time::Instant;

use super::calls::{
    NodeCalls, Settlement, Shape, arrivals_shapes, decode_calls, decode_settlement, encode_calls,
    encode_settlement, node_calls, settled_everywhere, shapes_text,
};
use super::gate::{Violation, ordinal};
use super::round::{Arrival, Outcome, take_report};
use super::{Shared, Span, shards};
use crate::cluster::Link;
use crate::cluster::wire::{Header, Message, Settled};
use crate::collective;

impl Shared {
    /// The leader's part of a round when the run spans nodes: `arrivals`
    /// are this node's ranks', by local rank.
    pub(super) fn lead_across(&self, span: &Span, mut arrivals: Vec<Arrival>) -> Outcome {
        let round = self.gate.rounds();
        let link = &span.link;
        let everywhere = settled_everywhere(&arrivals);
        let Some(mut mine) = node_calls(&mut arrivals, span.layout.world_rank(0)) else {
            // A rank's call was dropped: the attempt is stopping, which
            // reaches the other nodes as it stops their wait for this one.
            return Outcome::Failed;
        };
        // A partial summed over the nodes by MPI stays here.
        let elements = mine.elements;
        let partial = mine.partial.take_if(|(values, op)| {
            collective::sums_over_nodes(*op, elements, values.element_size())
        });
        let shapes = arrivals_shapes(&arrivals);
        let settlement = if everywhere {
            match self.settle_everywhere(span, round, mine, arrivals, &shapes) {
                Ok(settlement) => settlement,
                Err(outcome) => return outcome,
            }
        } else if link.index() == 0 {
            let all = match self.gather(span, round, mine) {
                Ok(all) => all,
                Err(outcome) => return outcome,
            };
            let settlement = self.settle(span, round, all, arrivals);
            link.send_frame_to_others(&encode_settlement(span.attempt, round, &settlement));
            settlement
        } else {
            // Node 0 commits; this node lists its files and persists them
            // when told (`shards.rs`).
            let plan = match take_report(&mut arrivals).1 {
                Ok(plan) => plan,
                Err(Ok(collision)) => {
                    mine.files = Err(collision.to_string());
                    None
                }
                Err(Err(e)) => {
                    self.fail_recording(e.into());
                    return Outcome::Failed;
                }
            };
            if mine.files.is_ok() {
                mine.files = Ok(shards::listing(plan.as_ref()));
            }
            link.send_frame(0, &encode_calls(span.attempt, round, &mut mine));
            let Some(message) = self.follow_report(span, round, plan, || node_0_over(span)) else {
                return self.unanswered(span, round, &shapes);
            };
            match decode_settlement(message) {
                Some(s) => s,
                None => return self.garbled(),
            }
        };
        self.local_outcome(span, &shapes, settlement, partial)
    }

    /// A round every node settles itself ([`settled_everywhere`]): send
    /// this node's calls and data to every other node, take theirs, and
    /// settle the round from all of them as node 0 would, each node the
    /// same. One exchange between the nodes, where node 0's matching and
    /// its answer would take two before the data moved.
    ///
    /// Node 0 still judges what goes wrong: a node that does not arrive in
    /// time or whose ranks ended (it alone waits with a deadline, as for
    /// any round), and calls that do not match; it then tells every node
    /// its outcome, which a node whose ranks called something else (a
    /// report) waits for, and which ends another node's wait for calls
    /// that will not come: its ranks get the violation as their call's
    /// outcome, as on the nodes that found it, rather than being stopped
    /// by node 0's failure.
    fn settle_everywhere(
        &self,
        span: &Span,
        round: u64,
        mut mine: NodeCalls,
        arrivals: Vec<Arrival>,
        shapes: &[Shape],
    ) -> Result<Settlement, Outcome> {
        let link = &span.link;
        link.send_frame_to_others(&encode_calls(span.attempt, round, &mut mine));
        let all = if link.index() == 0 {
            self.gather(span, round, mine)?
        } else {
            match self.hear_everyone(span, round, mine, shapes)? {
                Heard::All(all) => all,
                Heard::Settled(settlement) => return Ok(settlement),
            }
        };
        let settlement = self.settle(span, round, all, arrivals);
        if link.index() == 0 && matches!(settlement.outcome, Settled::Mismatch(_)) {
            link.send_frame_to_others(&encode_settlement(span.attempt, round, &settlement));
        }
        Ok(settlement)
    }

    /// Node 0: every node's calls for `round`, by node, `mine` first. If a
    /// node does not arrive in time, or its ranks ended, every node is
    /// told of the violation; `Err` is this node's outcome then, and if
    /// the attempt stops first.
    fn gather(&self, span: &Span, round: u64, mine: NodeCalls) -> Result<Vec<NodeCalls>, Outcome> {
        match self.gather_others(span, round) {
            Ok(others) => Ok(std::iter::once(mine).chain(others).collect()),
            Err(Some(violation)) => {
                // The other nodes are waiting for this round too.
                let settlement = Settlement::of(Settled::Mismatch(violation.message().to_owned()));
                span.link.send_frame_to_others(&encode_settlement(
                    span.attempt,
                    round,
                    &settlement,
                ));
                Err(Outcome::Mismatch(violation))
            }
            Err(None) => Err(Outcome::Failed),
        }
    }

    /// Any node but node 0, in a round every node settles: every node's
    /// calls for `round`, by node, `mine` among them, or node 0's word if
    /// it settled the round for everyone (a violation). `Err` if the
    /// attempt stops, or node 0's ranks ended, first.
    fn hear_everyone(
        &self,
        span: &Span,
        round: u64,
        mine: NodeCalls,
        shapes: &[Shape],
    ) -> Result<Heard, Outcome> {
        let link = &span.link;
        let mut all: Vec<Option<NodeCalls>> = (0..link.nodes()).map(|_| None).collect();
        all[link.index() as usize] = Some(mine);
        while all.iter().any(Option::is_none) {
            let wanted = |from: u32, h: &Header| match h {
                Header::Arrive {
                    attempt, round: r, ..
                } => {
                    *attempt == span.attempt
                        && *r == round
                        && all.get(from as usize).is_some_and(Option::is_none)
                }
                Header::Settle {
                    attempt, round: r, ..
                } => from == 0 && *attempt == span.attempt && *r == round,
                _ => false,
            };
            let Some((from, message)) = link.take(wanted, || {
                self.supervisor.is_stopping() || node_0_over(span)
            }) else {
                return Err(self.unanswered(span, round, shapes));
            };
            if matches!(message.header, Header::Settle { .. }) {
                return decode_settlement(message)
                    .map(Heard::Settled)
                    .ok_or_else(|| self.garbled());
            }
            all[from as usize] = Some(decode_calls(message).ok_or_else(|| self.garbled())?);
        }
        Ok(Heard::All(all.into_iter().flatten().collect()))
    }

    /// A node but node 0 stopped waiting for a round: node 0's ranks
    /// returned from train while this node's wait (a violation), or the
    /// attempt stops.
    fn unanswered(&self, span: &Span, round: u64, shapes: &[Shape]) -> Outcome {
        if node_0_over(span) && !self.supervisor.is_stopping() {
            return Outcome::Mismatch(Violation::new(format!(
                "the ranks on node 0 returned from train while ranks {:?} on node {} wait in their {} collective call ({})",
                (span.layout.world_rank(0)..span.layout.world_rank(span.layout.per_node))
                    .collect::<Vec<_>>(),
                span.layout.node,
                ordinal(round + 1),
                shapes_text(shapes),
            )));
        }
        Outcome::Failed
    }

    /// Node 0: every other node's calls for `round`, by node; `None` if
    /// the attempt stops first.
    fn gather_others(&self, span: &Span, round: u64) -> Result<Vec<NodeCalls>, Option<Violation>> {
        let link = &span.link;
        // The same limit as for the ranks of one node (R6).
        let timeout = self.gate.timeout();
        let deadline = Instant::now() + timeout;
        (1..link.nodes())
            .map(|node| {
                let wanted = |from: u32, h: &Header| {
                    from == node && matches!(h, Header::Arrive { attempt, round: r, .. } if *attempt == span.attempt && *r == round)
                };
                // A node whose ranks all ended will not arrive.
                let ended = || {
                    link.find(node, |h| matches!(h, Header::Ended { attempt, .. } if *attempt == span.attempt))
                };
                let late = || Instant::now() >= deadline;
                let Some((_, message)) = link.take(wanted, || {
                    self.supervisor.is_stopping() || ended().is_some() || late()
                }) else {
                    if self.supervisor.is_stopping() {
                        return Err(None);
                    }
                    if ended().is_none() {
                        return Err(Some(Violation::new(format!(
                            "the ranks on node 0 waited {} in their {} collective call for the ranks on node {node}, which did not arrive; every rank must make the same collective calls in the same order (raise the report timeout if a step can take longer)",
                            humantime::format_duration(timeout),
                            ordinal(round + 1)
                        ))));
                    }
                    return Err(match ended() {
                        // Its ranks failed: the run fails with that (its
                        // message may not have been taken off the link yet).
                        Some(Header::Ended {
                            failure: Some(failure),
                            ..
                        }) => {
                            self.fail_here(failure);
                            None
                        }
                        _ => Some(Violation::new(format!(
                            "the ranks on node {node} returned from train after {round} collective calls while the ranks on node 0 wait in their {}",
                            ordinal(round + 1)
                        ))),
                    });
                };
                decode_calls(message).ok_or(None)
            })
            .collect()
    }
}

/// How a node but node 0 heard a round every node settles.
enum Heard {
    /// Every node's calls, by node.
    All(Vec<NodeCalls>),
    /// Node 0's outcome for every node.
    Settled(Settlement),
}

/// Whether node 0's ranks have all ended the attempt: a node waiting for a
/// round then waits in vain.
fn node_0_over(span: &Span) -> bool {
    span.link
        .find(
            0,
            |h| matches!(h, Header::Over { attempt } if *attempt == span.attempt),
        )
        .is_some()
}

/// Pass stop requests between the nodes: one made here (a signal to this
/// node's process) is sent to the others once, and one made elsewhere is
/// made here. Called by the watcher, every poll.
pub(super) fn share_preemption(shared: &Shared, span: &Span) {
    let link = &span.link;
    let mine =
        |_: u32, h: &Header| matches!(h, Header::Preempt { attempt } if *attempt == span.attempt);
    if link.take_waiting(mine).is_some() {
        // Already known everywhere: the node it came from told them all.
        shared
            .preemption_shared
            .store(true, std::sync::atomic::Ordering::SeqCst);
        shared.preemption.request();
    }
    if shared.preemption.is_requested()
        && !shared
            .preemption_shared
            .swap(true, std::sync::atomic::Ordering::SeqCst)
    {
        link.send_to_others(&Message::new(Header::Preempt {
            attempt: span.attempt,
        }));
    }
}

/// Tell the other nodes that this attempt failed here.
pub(super) fn tell_failure(link: &Link, attempt: u64, failure: &crate::failure::RunFailure) {
    tracing::debug!(
        attempt,
        "telling the other nodes this node's failure: {failure}"
    );
    link.send_to_others(&Message::new(Header::Failed {
        attempt,
        failure: failure.clone(),
    }));
}
