//! What a round across nodes comes to: every rank's calls matched and
//! the round carried out (`settle`), on node 0 for every node or on each
//! node for itself, and what that outcome means for this node's ranks
//! (`local_outcome`). Who sends what to whom is `span.rs`.

use std::sync::Arc;

use super::Shared;
use super::Span;
use super::calls::{NodeCalls, Settlement, Shape};
use super::gate::{Violation, ordinal};
use super::round::{Arrival, Outcome};
use crate::cluster::wire::{Settled, Summary};
use crate::collective::{self, Call, Exchange, Op, Reduced, Values};

impl Shared {
    /// Match every rank's call and carry out the round: node 0 for every
    /// node, or each node for itself in a round every node settles.
    /// `all` are every node's calls by node; `mine` this node's ranks'
    /// arrivals (the data taken out), which say what kind of round it is.
    pub(super) fn settle(
        &self,
        span: &Span,
        round: u64,
        mut all: Vec<NodeCalls>,
        mine: Vec<Arrival>,
    ) -> Settlement {
        let calls: Vec<&Summary> = all.iter().flat_map(|n| &n.calls).collect();
        let first = &calls[0].signature;
        if calls.iter().any(|c| &c.signature != first) {
            let each: Vec<String> = calls
                .iter()
                .enumerate()
                .map(|(r, c)| format!("rank {r} called {}", c.describe))
                .collect();
            return Settlement::of(Settled::Mismatch(format!(
                "the {} collective call does not match: {}",
                ordinal(self.gate.rounds() + 1),
                each.join(", ")
            )));
        }
        let Some(Arrival::Collective(call)) = mine.first() else {
            // Every rank reported: node 0 records.
            let listings = all.into_iter().skip(1).map(|n| n.files).collect();
            return Settlement::of(self.record_across(span, round, listings, mine));
        };
        let world = span.layout.world_size() as usize;
        let max_memory = self.limits.max_memory;
        // As the first rank called it (`node_calls` took the data out of
        // the calls); the data is moved out of `all` below.
        let described = std::mem::take(&mut all[0].calls[0].describe);
        let elements = all[span.link.index() as usize].elements;
        match call {
            Call::Barrier => Settlement::of(Settled::Exchanged),
            Call::Broadcast { root, .. } => {
                let node = (*root / span.layout.per_node) as usize;
                match all.get_mut(node).and_then(|n| n.parts.pop()) {
                    Some(data) => {
                        match collective::too_large(|| described, data.len() as u64, max_memory) {
                            Some(message) => Settlement::of(Settled::Invalid(message)),
                            None => Settlement::exchanged(vec![data]),
                        }
                    }
                    None => Settlement::of(Settled::Invalid(format!(
                        "broadcast from rank {root}, but the run has ranks 0 to {}",
                        world - 1
                    ))),
                }
            }
            Call::AllGather { .. } => {
                let pieces: Vec<Vec<u8>> = all.into_iter().flat_map(|n| n.parts).collect();
                let bytes = pieces.iter().map(|p| p.len() as u64 + 8).sum();
                match collective::too_large(|| described, bytes, max_memory) {
                    Some(message) => Settlement::of(Settled::Invalid(message)),
                    None => Settlement::exchanged(pieces),
                }
            }
            Call::AllReduce { values, op } => {
                if *op == Op::Mean && matches!(values, Values::S64(_)) {
                    return Settlement::of(Settled::Invalid(
                        "the mean of s64 values is not an s64; all-reduce the sum and divide"
                            .into(),
                    ));
                }
                let bytes = elements as u64 * values.element_size();
                if let Some(message) = collective::too_large(|| described, bytes, max_memory) {
                    return Settlement::of(Settled::Invalid(message));
                }
                if collective::sums_over_nodes(*op, elements, values.element_size()) {
                    // Every node's signature is this one: each kept its
                    // partial for MPI.
                    return Settlement::of(Settled::SumOverNodes);
                }
                // This node's own partial as it is, the others' as sent.
                let partials: Option<Vec<Values>> = all
                    .into_iter()
                    .map(|n| match n.partial {
                        Some((partial, _)) => Some(partial),
                        None => Values::from_le_bytes(values, n.parts.first()?),
                    })
                    .collect();
                match partials {
                    Some(partials) if partials.iter().all(|p| p.len() == elements) => {
                        Settlement::reduced(collective::combine_in_order(partials, *op, world))
                    }
                    _ => Settlement::of(Settled::Mismatch(
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
    pub(super) fn local_outcome(
        &self,
        span: &Span,
        shapes: &[Shape],
        settlement: Settlement,
        partial: Option<(Values, Op)>,
    ) -> Outcome {
        let Settlement {
            outcome,
            parts,
            reduced,
        } = settlement;
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
            Settled::Mismatch(message) => Outcome::MismatchEverywhere(Violation::new(message)),
            Settled::SumOverNodes => {
                let Some((values, op)) = partial else {
                    return self.garbled();
                };
                let link = &span.link;
                let mut summed = values.into_flat();
                match &mut summed {
                    Values::F32(v) => link.sum_over_nodes(v),
                    Values::F64(v) => link.sum_over_nodes(v),
                    Values::S64(v) => link.sum_over_nodes(v),
                    Values::F32Parts(_) | Values::F32Lent(_) => unreachable!("flattened above"),
                }
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
                        let values = reduced
                            .or_else(|| parts.first().and_then(|p| Values::from_le_bytes(like, p)));
                        match values {
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
    pub(super) fn garbled(&self) -> Outcome {
        let violation =
            Violation::new("node 0 answered a round with a message this node cannot read".into());
        Outcome::Mismatch(violation)
    }
}
