//! What a node's ranks called in a round, as the nodes exchange it: the
//! calls and data a node brings to the round (`NodeCalls`), node 0's
//! outcome with its data (`Settlement`), and the shapes of the calls a
//! node keeps to read that outcome. The protocol that moves them is
//! `span.rs`.

use super::gate::Describe;
use super::round::Arrival;
use crate::cluster::wire::{self, Frame, Header, Listed, Message, Settled, Summary};
use crate::collective::{self, Call, Op, Values};

/// What a node brings to a round: to node 0, or to every node in a round
/// every node settles itself ([`settled_everywhere`]).
pub(super) struct NodeCalls {
    pub calls: Vec<Summary>,
    pub parts: Vec<Vec<u8>>,
    /// In a report, its ranks' checkpoint files (see `shards.rs`).
    pub files: Result<Vec<Listed>, String>,
    /// In an all-reduce whose ranks here agree: the node's partial
    /// result. Sent as its bytes, the one part, unless it is summed over
    /// the nodes by MPI (the leader takes it out for that first).
    pub partial: Option<(Values, Op)>,
    /// In an all-reduce, how many elements each rank's buffer held before
    /// it went into the partial result (0 in other rounds, and in what
    /// other nodes send: the node settling the round checks the sizes
    /// against its own).
    pub elements: usize,
}

/// A round's outcome with its data, as node 0 sends it.
pub(super) struct Settlement {
    pub outcome: Settled,
    pub parts: Vec<Vec<u8>>,
    /// An all-reduce's result where this node combined it: sent as its
    /// bytes, the one part, and kept as it is for this node's ranks.
    pub reduced: Option<Values>,
}

impl Settlement {
    /// An outcome without data.
    pub fn of(outcome: Settled) -> Self {
        Self {
            outcome,
            parts: Vec::new(),
            reduced: None,
        }
    }

    /// A collective's result as `parts`.
    pub fn exchanged(parts: Vec<Vec<u8>>) -> Self {
        Self {
            parts,
            ..Self::of(Settled::Exchanged)
        }
    }

    /// An all-reduce's result.
    pub fn reduced(values: Values) -> Self {
        Self {
            reduced: Some(values),
            ..Self::of(Settled::Exchanged)
        }
    }
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
                Values::F32(_) | Values::F32Parts(_) | Values::F32Lent(_) => {
                    Values::F32(Vec::new())
                }
                Values::F64(_) => Values::F64(Vec::new()),
                Values::S64(_) => Values::S64(Vec::new()),
            }),
        })
        .collect()
}

/// Whether every node settles a round whose first call here is
/// `arrivals`' first (looked at before [`node_calls`] takes the data):
/// a collective whose data all travel in the nodes' calls (a barrier, a
/// broadcast, an all-gather, an all-reduce small enough:
/// [`collective::exchanged`]), which every node then sends every other. Node 0 settles a report (it records it) and a larger
/// all-reduce. A signature decides it, so nodes whose first calls agree
/// decide alike, and nodes that decide otherwise called different things:
/// node 0 finds that and tells every node.
pub(super) fn settled_everywhere(arrivals: &[Arrival]) -> bool {
    match arrivals.first() {
        Some(Arrival::Collective(Call::AllReduce { values, .. })) => {
            collective::exchanged(values.len(), values.element_size())
        }
        Some(Arrival::Collective(_)) => true,
        Some(Arrival::Report { .. }) | None => false,
    }
}

/// What this node brings to the round: every rank's call, and its data:
/// the root's broadcast data (if the root is here), every rank's
/// all-gather piece, or the node's partial all-reduce (if its own ranks
/// agree). `first` is the world rank of the node's first rank.
///
/// The data is taken out of `arrivals` (an all-reduce's buffers are left
/// empty, of their type), not copied: the ranks get their results from
/// the round's outcome. Copying a rank's 64 MiB before summing it over 2
/// nodes cost about a fifth of a bare `MPI_Allreduce` of the same bytes.
/// Values lent from the guests' memory are read there, into the partial.
/// `None` if a rank's lent values were returned: its call was dropped, as
/// the attempt stops.
pub(super) fn node_calls(arrivals: &mut [Arrival], first: u32) -> Option<NodeCalls> {
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
                partial = Some((collective::partial(values, op)?, op));
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
    Some(NodeCalls {
        calls,
        parts,
        files: Ok(Vec::new()),
        partial,
        elements,
    })
}

/// A frame whose payload is `values`, the one part, or else `parts`: each
/// written into the frame, not joined first. `header` is given the
/// lengths that split the payload again.
fn frame(
    header: impl FnOnce(Vec<u64>) -> Header,
    values: Option<&Values>,
    parts: &[Vec<u8>],
) -> Frame {
    match values {
        Some(values) => {
            let len = values.len() * values.element_size() as usize;
            Frame::new(&header(vec![len as u64]), len, |out| {
                values.write_le_bytes(out)
            })
        }
        None => {
            let lengths: Vec<u64> = parts.iter().map(|p| p.len() as u64).collect();
            let len = parts.iter().map(Vec::len).sum();
            Frame::new(&header(lengths), len, |out| {
                for part in parts {
                    out.extend_from_slice(part);
                }
            })
        }
    }
}

/// A node's calls as it sends them (its data copied into the frame: a
/// node settling the round itself needs it after). A report's listing of
/// files is moved into the frame: only node 0 needs it, and node 0 sends
/// none.
pub(super) fn encode_calls(attempt: u64, round: u64, calls: &mut NodeCalls) -> Frame {
    let files = std::mem::replace(&mut calls.files, Ok(Vec::new()));
    let header = |parts| Header::Arrive {
        attempt,
        round,
        calls: calls.calls.clone(),
        parts,
        files,
    };
    let values = calls.partial.as_ref().map(|(values, _)| values);
    frame(header, values, &calls.parts)
}

/// Another node's calls as it sent them.
pub(super) fn decode_calls(message: Message) -> Option<NodeCalls> {
    let Header::Arrive {
        calls,
        parts,
        files,
        ..
    } = message.header
    else {
        return None;
    };
    let parts = wire::split(message.payload, &parts).ok()?;
    Some(NodeCalls {
        calls,
        parts,
        files,
        partial: None,
        elements: 0,
    })
}

pub(super) fn encode_settlement(attempt: u64, round: u64, settlement: &Settlement) -> Frame {
    let header = |parts| Header::Settle {
        attempt,
        round,
        outcome: settlement.outcome.clone(),
        parts,
    };
    frame(header, settlement.reduced.as_ref(), &settlement.parts)
}

pub(super) fn decode_settlement(message: Message) -> Option<Settlement> {
    let Header::Settle { outcome, parts, .. } = message.header else {
        return None;
    };
    let parts = wire::split(message.payload, &parts).ok()?;
    Some(Settlement {
        parts,
        ..Settlement::of(outcome)
    })
}
