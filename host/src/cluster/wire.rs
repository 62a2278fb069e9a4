//! What nodes say to each other, and how it is framed: a header (JSON, so
//! that every field is named and checked) and raw payload bytes (the data
//! of a collective, never encoded).

use serde::{Deserialize, Serialize};

use crate::failure::RunFailure;

/// A message's header.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) enum Header {
    /// A node to node 0 at start: what must be the same on every node,
    /// as (what, digest) pairs.
    Hello { fingerprint: Vec<(String, String)> },
    /// Node 0 to every node: the run's name and whether node 0 generated
    /// it, or why the run cannot start.
    Verdict { run: Result<(String, bool), String> },
    /// Node 0 to every node: read this probe object in the run's storage.
    Probe { key: String, expected: String },
    /// A node to node 0: what reading the probe gave.
    ProbeRead { error: Option<String> },
    /// Node 0 to every node: whether every node read the probe.
    ProbeVerdict { error: Option<String> },
    /// Node 0 to every node: an attempt starts, resuming from `resume`
    /// (a checkpoint's location), or the run ends with `end`.
    Attempt { attempt: u64, next: Next },
    /// A node to node 0: its ranks' calls of one round, with its data in
    /// the payload (`parts` gives the lengths of its pieces).
    Arrive {
        attempt: u64,
        round: u64,
        calls: Vec<Summary>,
        parts: Vec<u64>,
        /// In a report: the checkpoint files its ranks reported, or why
        /// the node refused them (ranks of the node disagree, R7).
        files: Result<Vec<Listed>, String>,
    },
    /// Node 0 to a node, in a report: send the SHA-256 of these files
    /// (another node reported files under the same paths).
    Hash {
        attempt: u64,
        round: u64,
        paths: Vec<String>,
    },
    /// A node to node 0: the digests asked for, in order. (A node that
    /// cannot read its files fails the attempt instead.)
    Hashed {
        attempt: u64,
        round: u64,
        digests: Vec<String>,
    },
    /// Node 0 to a node, in a report: the report's checkpoint is number
    /// `checkpoint`; persist the node's files into it but those in `skip`
    /// (a lower node persists them), then tell node 0 (`Persisted`).
    Persist {
        attempt: u64,
        round: u64,
        checkpoint: u64,
        skip: Vec<String>,
    },
    /// A node to node 0: its files of checkpoint `checkpoint` are durable
    /// in storage.
    Persisted {
        attempt: u64,
        checkpoint: u64,
        files: Vec<Shipped>,
    },
    /// Node 0 to a node: a round's outcome, data in the payload.
    Settle {
        attempt: u64,
        round: u64,
        outcome: Settled,
        parts: Vec<u64>,
    },
    /// Any node to every other: the attempt failed here.
    Failed { attempt: u64, failure: RunFailure },
    /// Any node to every other: a stop was requested here (a signal).
    Preempt { attempt: u64 },
    /// Node 0 to every node: its ranks have all ended the attempt; a rank
    /// still calling is a violation.
    Over { attempt: u64 },
    /// A node to node 0: how its part of the attempt ended.
    Ended {
        attempt: u64,
        failure: Option<RunFailure>,
        stop_requested: bool,
        preempted: bool,
    },
}

/// What node 0 decided after an attempt (or at start).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) enum Next {
    /// Run an attempt, resuming from this checkpoint location if any.
    Run { resume: Option<String> },
    /// The run is over.
    End {
        error: Option<RunFailure>,
        preempted: bool,
        failures: u32,
    },
}

/// One rank's call in a round, as node 0 needs it to match the calls.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Summary {
    /// For messages: "report", "all-reduce (sum) of 10 f32".
    pub describe: String,
    /// What must agree across ranks: the call's signature, or "report".
    pub signature: String,
}

/// A checkpoint file a node's ranks reported.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Listed {
    pub path: String,
    pub size: u64,
    /// World ranks that reported it.
    pub ranks: Vec<u32>,
}

/// A checkpoint file a node persisted, as the manifest will list it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Shipped {
    pub path: String,
    pub size: u64,
    pub sha256: String,
    pub ranks: Vec<u32>,
}

/// A round's outcome as node 0 tells it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) enum Settled {
    /// With the number of reports after which every rank sees preemption
    /// requested, once node 0 has latched it.
    Recorded {
        preempt_after: Option<u64>,
    },
    Refused(String),
    Failed,
    Invalid(String),
    Mismatch(String),
    /// A collective: every rank's result is in the payload (the pieces of
    /// an all-gather, or the one result of the others).
    Exchanged,
    /// An all-reduce's sum (or mean): every node now sums its partial
    /// result with the others' through MPI's own all-reduce.
    SumOverNodes,
}

/// A header and its payload.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Message {
    pub header: Header,
    pub payload: Vec<u8>,
}

/// A message that does not decode: a bug, or another program on the wire.
#[derive(Debug, thiserror::Error)]
#[error("a message from another node does not decode: {0}")]
pub(crate) struct Garbled(String);

impl Message {
    pub fn new(header: Header) -> Self {
        Self {
            header,
            payload: Vec::new(),
        }
    }

    /// `[header length: u32 LE][header JSON][payload]`.
    pub fn encode(&self) -> Vec<u8> {
        let header = serde_json::to_vec(&self.header).expect("headers serialize");
        let mut out = Vec::with_capacity(4 + header.len() + self.payload.len());
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
        out.extend_from_slice(&header);
        out.extend_from_slice(&self.payload);
        out
    }

    pub fn decode(mut bytes: Vec<u8>) -> Result<Self, Garbled> {
        let len = bytes
            .get(..4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
            .ok_or_else(|| Garbled("shorter than its frame".into()))?;
        let end = 4usize
            .checked_add(len)
            .filter(|end| *end <= bytes.len())
            .ok_or_else(|| Garbled("header longer than the message".into()))?;
        let header = serde_json::from_slice(&bytes[4..end]).map_err(|e| Garbled(e.to_string()))?;
        let payload = bytes.split_off(end);
        Ok(Self { header, payload })
    }
}

/// The header of an encoded message, without copying its payload.
pub(crate) fn peek(bytes: &[u8]) -> Option<Header> {
    let len = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
    serde_json::from_slice(bytes.get(4..4usize.checked_add(len)?)?).ok()
}

/// Split `payload` into pieces of the given lengths.
pub(crate) fn split(payload: &[u8], parts: &[u64]) -> Result<Vec<Vec<u8>>, Garbled> {
    let mut out = Vec::with_capacity(parts.len());
    let mut at = 0usize;
    for &len in parts {
        let end = at
            .checked_add(len as usize)
            .filter(|e| *e <= payload.len())
            .ok_or_else(|| Garbled("parts longer than the payload".into()))?;
        out.push(payload[at..end].to_vec());
        at = end;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_garbage_is_refused() {
        let m = Message {
            header: Header::Arrive {
                attempt: 2,
                round: 7,
                calls: vec![Summary {
                    describe: "barrier".into(),
                    signature: "barrier".into(),
                }],
                parts: vec![3, 0, 2],
                files: Ok(vec![Listed {
                    path: "model.bin".into(),
                    size: 8,
                    ranks: vec![2, 3],
                }]),
            },
            payload: vec![1, 2, 3, 4, 5],
        };
        let back = Message::decode(m.encode()).unwrap();
        assert_eq!(back, m);
        assert_eq!(
            split(&back.payload, &[3, 0, 2]).unwrap(),
            vec![vec![1, 2, 3], vec![], vec![4, 5]]
        );
        assert!(split(&back.payload, &[6]).is_err());
        assert!(Message::decode(vec![1]).is_err());
        assert!(Message::decode(vec![200, 0, 0, 0, b'{']).is_err());
        assert!(Message::decode(vec![1, 0, 0, 0, b'x']).is_err());
    }
}
