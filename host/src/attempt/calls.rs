//! What a node's ranks called in a round, as the nodes exchange it: the
//! calls and data a node brings to node 0 (`NodeCalls`), node 0's
//! outcome with its data (`Settlement`), and the shapes of the calls a
//! node keeps to read that outcome. The protocol that moves them is
//! `span.rs`.

use super::gate::Describe;
use super::round::Arrival;
use crate::cluster::wire::{self, Header, Listed, Message, Settled, Summary};
use crate::collective::{self, Call, Op, Values};

/// What a node brings to node 0 for a round.
pub(super) struct NodeCalls {
    pub calls: Vec<Summary>,
    pub parts: Vec<Vec<u8>>,
    /// In a report, its ranks' checkpoint files (see `shards.rs`).
    pub files: Result<Vec<Listed>, String>,
    /// An all-reduce summed over the nodes by MPI: the node's partial
    /// result, kept here (nothing of it goes to node 0).
    pub partial: Option<(Values, Op)>,
    /// In an all-reduce, how many elements each rank's buffer held before
    /// it went into the partial result (0 in other rounds, and in what
    /// other nodes send: node 0 checks the sizes against its own).
    pub elements: usize,
}

/// A round's outcome with its data, as node 0 sends it.
pub(super) struct Settlement {
    pub outcome: Settled,
    pub parts: Vec<Vec<u8>>,
}

/// What a rank called, without its data.
pub(super) enum Shape {
    Report,
    Barrier,
    Broadcast,
    AllGather,
    /// An empty buffer of the all-reduce's type.
    AllReduce(Values),
}

/// What this node's ranks called, for messages.
pub(super) fn shapes_text(shapes: &[Shape]) -> &'static str {
    match shapes.first() {
        Some(Shape::Report) => "report",
        Some(Shape::Barrier) => "barrier",
        Some(Shape::Broadcast) => "broadcast",
        Some(Shape::AllGather) => "all-gather",
        Some(Shape::AllReduce(_)) => "all-reduce",
        None => "nothing",
    }
}

pub(super) fn arrivals_shapes(arrivals: &[Arrival]) -> Vec<Shape> {
    arrivals
        .iter()
        .map(|a| match a {
            Arrival::Report { .. } => Shape::Report,
            Arrival::Collective(Call::Barrier) => Shape::Barrier,
            Arrival::Collective(Call::Broadcast { .. }) => Shape::Broadcast,
            Arrival::Collective(Call::AllGather { .. }) => Shape::AllGather,
            Arrival::Collective(Call::AllReduce { values, .. }) => Shape::AllReduce(match values {
                // Results from other nodes come in one buffer.
                Values::F32(_) | Values::F32Parts(_) => Values::F32(Vec::new()),
                Values::F64(_) => Values::F64(Vec::new()),
                Values::S64(_) => Values::S64(Vec::new()),
            }),
        })
        .collect()
}

/// What this node sends node 0: every rank's call, and its data: the
/// root's broadcast data (if the root is here), every rank's all-gather
/// piece, or the node's partial all-reduce (if its own ranks agree).
/// `first` is the world rank of the node's first rank.
///
/// The data is taken out of `arrivals` (an all-reduce's buffers are left
/// empty, of their type), not copied: the ranks get their results from
/// the round's outcome. Copying a rank's 64 MiB before summing it over 2
/// nodes cost about a fifth of a bare `MPI_Allreduce` of the same bytes.
pub(super) fn node_calls(arrivals: &mut [Arrival], first: u32) -> NodeCalls {
    let calls = arrivals
        .iter()
        .map(|a| Summary {
            describe: a.describe(),
            signature: match a {
                Arrival::Report { .. } => "report".into(),
                Arrival::Collective(call) => call.signature_text(),
            },
        })
        .collect::<Vec<_>>();
    let agree = calls.windows(2).all(|w| w[0].signature == w[1].signature);
    let mut parts = Vec::new();
    let mut partial = None;
    let mut elements = 0;
    let mut collective: Vec<&mut Call> = arrivals
        .iter_mut()
        .filter_map(|a| match a {
            Arrival::Collective(call) => Some(call),
            Arrival::Report { .. } => None,
        })
        .collect();
    if agree {
        match collective.first() {
            Some(Call::AllReduce { op, values }) => {
                let op = *op;
                elements = values.len();
                let values: Vec<Values> = collective
                    .iter_mut()
                    .filter_map(|c| match c {
                        Call::AllReduce { values, .. } => Some(values.take()),
                        _ => None,
                    })
                    .collect();
                let mine = collective::partial(values, op);
                if collective::sums_over_nodes(op, elements) {
                    partial = Some((mine, op));
                } else {
                    parts.push(mine.to_le_bytes());
                }
            }
            Some(Call::AllGather { .. }) => parts.extend(collective.iter_mut().map(|c| match c {
                Call::AllGather { data } => std::mem::take(data),
                _ => Vec::new(),
            })),
            Some(Call::Broadcast { root, .. }) => {
                if let Some(Call::Broadcast { data, .. }) = root
                    .checked_sub(first)
                    .and_then(|i| collective.get_mut(i as usize))
                {
                    parts.push(std::mem::take(data));
                }
            }
            Some(Call::Barrier) | None => {}
        }
    }
    NodeCalls {
        calls,
        parts,
        files: Ok(Vec::new()),
        partial,
        elements,
    }
}

pub(super) fn join_parts(parts: Vec<Vec<u8>>) -> (Vec<u8>, Vec<u64>) {
    let lengths = parts.iter().map(|p| p.len() as u64).collect();
    (parts.concat(), lengths)
}

pub(super) fn encode_settlement(attempt: u64, round: u64, settlement: &Settlement) -> Message {
    let (payload, parts) = join_parts(settlement.parts.clone());
    Message {
        header: Header::Settle {
            attempt,
            round,
            outcome: settlement.outcome.clone(),
            parts,
        },
        payload,
    }
}

pub(super) fn decode_settlement(message: Message) -> Option<Settlement> {
    let Header::Settle { outcome, parts, .. } = message.header else {
        return None;
    };
    let parts = wire::split(&message.payload, &parts).ok()?;
    Some(Settlement { outcome, parts })
}
