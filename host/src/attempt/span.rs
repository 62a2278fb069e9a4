//! Rounds whose ranks live on several nodes (a run over several hosts).
//!
//! Each node's gate gathers its own ranks' calls as on one host; its
//! leader then takes the round across nodes: it sends node 0 what its
//! ranks called (`calls.rs`), with the data node 0 needs (the root's
//! broadcast data, its ranks' all-gather pieces, a node's partial min or
//! max), and waits for node 0's outcome. Node 0 matches the calls of every
//! rank of the job (R30 across nodes), records a report (only node 0
//! records; every node persists its own ranks' checkpoint files, see
//! `shards.rs`), or combines the exchange, and tells every node; a sum or
//! mean it tells every node to sum with MPI's all-reduce, each keeping its
//! partial result for that (R38). Combining once, on node 0 or by MPI,
//! makes results bit-identical on every rank.
//!
//! A leader waiting for other nodes gives up when its attempt stops: a
//! failure anywhere reaches every node as a message (`Shared::fail`, and
//! the watcher, which takes failures of other nodes off the link).

use std::sync::Arc;
use std::time::Instant;

use super::calls::{
    NodeCalls, Settlement, Shape, arrivals_shapes, decode_settlement, encode_settlement,
    join_parts, node_calls, shapes_text,
};
use super::gate::{Violation, ordinal};
use super::round::{Arrival, Outcome, take_report};
use super::{Shared, Span, shards};
use crate::cluster::Link;
use crate::cluster::wire::{self, Header, Message, Settled, Summary};
use crate::collective::{self, Call, Exchange, Op, Reduced, Values};

impl Shared {
    /// The leader's part of a round when the run spans nodes: `arrivals`
    /// are this node's ranks', by local rank.
    pub(super) fn lead_across(&self, span: &Span, mut arrivals: Vec<Arrival>) -> Outcome {
        let round = self.gate.rounds();
        let link = &span.link;
        let mut mine = node_calls(&mut arrivals, span.layout.world_rank(0));
        let partial = mine.partial.take();
        let shapes = arrivals_shapes(&arrivals);
        let settlement = if link.index() == 0 {
            let others = match self.gather(span, round) {
                Ok(others) => others,
                Err(Some(violation)) => {
                    // The other nodes are waiting for this round too.
                    let settlement = Settlement {
                        outcome: Settled::Mismatch(violation.message().to_owned()),
                        parts: Vec::new(),
                    };
                    link.send_to_others(&encode_settlement(span.attempt, round, &settlement));
                    return Outcome::Mismatch(violation);
                }
                Err(None) => return Outcome::Failed,
            };
            let all: Vec<NodeCalls> = std::iter::once(mine).chain(others).collect();
            let settlement = self.settle(span, round, all, arrivals);
            let message = encode_settlement(span.attempt, round, &settlement);
            link.send_to_others(&message);
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
            let (parts, lengths) = join_parts(mine.parts);
            link.send(
                0,
                &Message {
                    header: Header::Arrive {
                        attempt: span.attempt,
                        round,
                        calls: mine.calls,
                        parts: lengths,
                        files: mine.files,
                    },
                    payload: parts,
                },
            );
            let over = || {
                link.find(
                    0,
                    |h| matches!(h, Header::Over { attempt } if *attempt == span.attempt),
                )
                .is_some()
            };
            let Some(message) = self.follow_report(span, round, plan, over) else {
                if over() && !self.supervisor.is_stopping() {
                    return Outcome::Mismatch(Violation::new(format!(
                        "the ranks on node 0 returned from train while ranks {:?} on node {} wait in their {} collective call ({})",
                        (span.layout.world_rank(0)..span.layout.world_rank(span.layout.per_node))
                            .collect::<Vec<_>>(),
                        span.layout.node,
                        ordinal(round + 1),
                        shapes_text(&shapes),
                    )));
                }
                return Outcome::Failed;
            };
            match decode_settlement(message) {
                Some(s) => s,
                None => return self.garbled(),
            }
        };
        self.local_outcome(span, &shapes, settlement, partial)
    }

    /// Node 0: every other node's calls for `round`, by node; `None` if
    /// the attempt stops first.
    fn gather(&self, span: &Span, round: u64) -> Result<Vec<NodeCalls>, Option<Violation>> {
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
                let Header::Arrive {
                    calls, parts, files, ..
                } = message.header
                else {
                    return Err(None);
                };
                let parts = wire::split(&message.payload, &parts).map_err(|_| None)?;
                Ok(NodeCalls {
                    calls,
                    parts,
                    files,
                    partial: None,
                    elements: 0,
                })
            })
            .collect()
    }

    /// Node 0: match every rank's call and carry out the round.
    fn settle(
        &self,
        span: &Span,
        round: u64,
        all: Vec<NodeCalls>,
        mine: Vec<Arrival>,
    ) -> Settlement {
        let settled = |outcome| Settlement {
            outcome,
            parts: Vec::new(),
        };
        let calls: Vec<&Summary> = all.iter().flat_map(|n| &n.calls).collect();
        let first = &calls[0].signature;
        if calls.iter().any(|c| &c.signature != first) {
            let each: Vec<String> = calls
                .iter()
                .enumerate()
                .map(|(r, c)| format!("rank {r} called {}", c.describe))
                .collect();
            return settled(Settled::Mismatch(format!(
                "the {} collective call does not match: {}",
                ordinal(self.gate.rounds() + 1),
                each.join(", ")
            )));
        }
        let Some(Arrival::Collective(call)) = mine.first() else {
            // Every rank reported: node 0 records.
            let listings = all.into_iter().skip(1).map(|n| n.files).collect();
            return settled(self.record_across(span, round, listings, mine));
        };
        let world = span.layout.world_size() as usize;
        let max_memory = self.limits.max_memory;
        // As the first rank called it: `node_calls` took the data out of
        // the calls.
        let described = &calls[0].describe;
        let elements = all[0].elements;
        match call {
            Call::Barrier => settled(Settled::Exchanged),
            Call::Broadcast { root, .. } => {
                let node = (*root / span.layout.per_node) as usize;
                match all.get(node).and_then(|n| n.parts.first()) {
                    Some(data) => {
                        match collective::too_large(
                            || described.clone(),
                            data.len() as u64,
                            max_memory,
                        ) {
                            Some(message) => settled(Settled::Invalid(message)),
                            None => Settlement {
                                outcome: Settled::Exchanged,
                                parts: vec![data.clone()],
                            },
                        }
                    }
                    None => settled(Settled::Invalid(format!(
                        "broadcast from rank {root}, but the run has ranks 0 to {}",
                        world - 1
                    ))),
                }
            }
            Call::AllGather { .. } => {
                let pieces: Vec<Vec<u8>> = all.iter().flat_map(|n| n.parts.clone()).collect();
                let bytes = pieces.iter().map(|p| p.len() as u64 + 8).sum();
                match collective::too_large(|| described.clone(), bytes, max_memory) {
                    Some(message) => settled(Settled::Invalid(message)),
                    None => Settlement {
                        outcome: Settled::Exchanged,
                        parts: pieces,
                    },
                }
            }
            Call::AllReduce { values, op } => {
                if *op == Op::Mean && matches!(values, Values::S64(_)) {
                    return settled(Settled::Invalid(
                        "the mean of s64 values is not an s64; all-reduce the sum and divide"
                            .into(),
                    ));
                }
                let bytes = elements as u64 * values.element_size();
                if let Some(message) =
                    collective::too_large(|| described.clone(), bytes, max_memory)
                {
                    return settled(Settled::Invalid(message));
                }
                if collective::sums_over_nodes(*op, elements) {
                    // Every node's signature is this one: each kept its
                    // partial for MPI.
                    return settled(Settled::SumOverNodes);
                }
                let partials: Option<Vec<Values>> = all
                    .iter()
                    .map(|n| Values::from_le_bytes(values, n.parts.first()?))
                    .collect();
                match partials {
                    Some(partials) if partials.iter().all(|p| p.len() == elements) => {
                        let result = collective::combine_in_order(partials, *op, world);
                        Settlement {
                            outcome: Settled::Exchanged,
                            parts: vec![result.to_le_bytes()],
                        }
                    }
                    _ => settled(Settled::Mismatch(
                        "a node sent an all-reduce's partial result of the wrong size".into(),
                    )),
                }
            }
        }
    }

    /// This node's outcome of a settled round. `shapes` are its ranks'
    /// calls (without their data), to read the data node 0 sent;
    /// `partial` the node's partial all-reduce, if it kept it to sum over
    /// the nodes.
    fn local_outcome(
        &self,
        span: &Span,
        shapes: &[Shape],
        settlement: Settlement,
        partial: Option<(Values, Op)>,
    ) -> Outcome {
        let Settlement { outcome, parts } = settlement;
        match outcome {
            Settled::Recorded { preempt_after } => {
                // Latched on node 0: every rank sees the request after the
                // same report, on every node.
                if let Some(after) = preempt_after {
                    self.preempt_after.get_or_init(|| after);
                }
                Outcome::Recorded
            }
            Settled::Refused(message) => Outcome::RefusedElsewhere(message),
            Settled::Failed => {
                // Node 0 failed recording; its failure reaches this node.
                Outcome::Failed
            }
            Settled::Invalid(message) => Outcome::Invalid(message),
            Settled::Mismatch(message) => Outcome::Mismatch(Violation::new(message)),
            Settled::SumOverNodes => {
                let Some((values, op)) = partial else {
                    return self.garbled();
                };
                let link = &span.link;
                let summed = match values {
                    Values::F32(v) => Values::F32(link.sum_over_nodes(&v)),
                    Values::F32Parts(parts) => Values::F32(link.sum_over_nodes(&parts.concat())),
                    Values::F64(v) => Values::F64(link.sum_over_nodes(&v)),
                    Values::S64(v) => Values::S64(link.sum_over_nodes(&v)),
                };
                let world = span.layout.world_size() as usize;
                let result = collective::finish_sum(summed, op, world);
                Outcome::Exchanged(Arc::new(Exchange::Reduced(Reduced::new(
                    result,
                    shapes.len(),
                ))))
            }
            Settled::Exchanged => {
                let exchange = match shapes.first() {
                    Some(Shape::Barrier) | None => Exchange::Barrier,
                    Some(Shape::Broadcast) => {
                        Exchange::Broadcast(parts.into_iter().next().unwrap_or_default())
                    }
                    Some(Shape::AllGather) => Exchange::AllGather(parts),
                    Some(Shape::AllReduce(like)) => {
                        match parts.first().and_then(|p| Values::from_le_bytes(like, p)) {
                            Some(values) => Exchange::Reduced(Reduced::new(values, shapes.len())),
                            None => return self.garbled(),
                        }
                    }
                    Some(Shape::Report) => return self.garbled(),
                };
                Outcome::Exchanged(Arc::new(exchange))
            }
        }
    }

    /// A message from node 0 did not make sense: a bug, which fails the run.
    fn garbled(&self) -> Outcome {
        let violation =
            Violation::new("node 0 answered a round with a message this node cannot read".into());
        Outcome::Mismatch(violation)
    }
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
    link.send_to_others(&Message::new(Header::Failed {
        attempt,
        failure: failure.clone(),
    }));
}
