//! Starting a run over several hosts: the nodes agree that they run the
//! same thing, and that they share the run's storage, before any rank
//! starts.
//!
//! Every node sends node 0 a fingerprint of what must be the same
//! everywhere (trainhost's version, the guest's bytes, the loop's config,
//! the run's settings); node 0 compares each with its own and answers with
//! the run's name, or with one error naming every difference, which every
//! node returns. Then node 0, owning the run, writes a probe object into
//! it, every other node reads it back through its own storage settings,
//! and a node that cannot fails the start for all: a directory that is not
//! shared, or an object store a node cannot reach, is found before any
//! work is lost.

use bytes::Bytes;
use sha2::{Digest, Sha256};

use super::Trainer;
use crate::attempt::Ended;
use crate::cluster::Link;
use crate::cluster::wire::{Header, Message};
use crate::error::Error;
use crate::storage::Storage;

/// The probe object's name, in the run's directory.
const PROBE: &str = ".trainhost-node-probe";

/// (what, digest) pairs of `parts`.
fn digests(parts: &[(&str, &[u8])]) -> Vec<(String, String)> {
    parts
        .iter()
        .map(|(what, bytes)| ((*what).to_owned(), hex::encode(Sha256::digest(bytes))))
        .collect()
}

/// Agree with the other nodes on what runs: returns the run's name (node
/// 0's `proposed` one) and whether node 0 generated it.
pub(super) fn agree(
    link: &Link,
    mine: Vec<(String, String)>,
    proposed: (String, bool),
) -> Result<(String, bool), Error> {
    if link.index() != 0 {
        link.send(0, &Message::new(Header::Hello { fingerprint: mine }));
        let message = link.receive(0, |h| matches!(h, Header::Verdict { .. }));
        let Header::Verdict { run } = message.header else {
            unreachable!("taken as a verdict");
        };
        return run.map_err(Error::Cluster);
    }
    let mut differences = Vec::new();
    for node in 1..link.nodes() {
        let message = link.receive(node, |h| matches!(h, Header::Hello { .. }));
        let Header::Hello { fingerprint } = message.header else {
            unreachable!("taken as a hello");
        };
        for ((what, ours), (_, theirs)) in mine.iter().zip(&fingerprint) {
            if ours != theirs {
                differences.push(format!(
                    "node {node}'s {what} differs from node 0's (sha256 {} vs {})",
                    &theirs[..12],
                    &ours[..12]
                ));
            }
        }
        if fingerprint.len() != mine.len() {
            differences.push(format!("node {node} runs another version of trainhost"));
        }
    }
    let run = if differences.is_empty() {
        Ok(proposed.clone())
    } else {
        Err(format!(
            "the nodes of this run do not run the same thing: {}; every node must be given the same guest, config and settings",
            differences.join("; ")
        ))
    };
    link.send_to_others(&Message::new(Header::Verdict { run: run.clone() }));
    run.map_err(Error::Cluster)?;
    Ok(proposed)
}

/// Node 0's verdict on the probe, on another node.
fn probe_verdict(link: &Link) -> Result<(), Error> {
    let message = link.receive(0, |h| matches!(h, Header::ProbeVerdict { .. }));
    match message.header {
        Header::ProbeVerdict { error: Some(e) } => Err(Error::Cluster(e)),
        _ => Ok(()),
    }
}

/// Node 0: check that every node reads what this one writes into the run's
/// storage `run`.
pub(super) async fn probe(link: &Link, run: &Storage) -> Result<(), Error> {
    let expected = format!("{:016x}", crate::owner::random_u64());
    run.put(PROBE, Bytes::from(expected.clone())).await?;
    link.send_to_others(&Message::new(Header::Probe {
        key: PROBE.into(),
        expected,
    }));
    let mut failures = Vec::new();
    for node in 1..link.nodes() {
        let message = link.receive(node, |h| matches!(h, Header::ProbeRead { .. }));
        if let Header::ProbeRead { error: Some(e) } = message.header {
            failures.push(format!("node {node} {e}"));
        }
    }
    let _ = run.delete(PROBE).await;
    let error = (!failures.is_empty()).then(|| {
        format!(
            "the run's storage {} is not shared by every node: {}; give every node the same object store URL, or a directory every node mounts",
            run.url(),
            failures.join("; ")
        )
    });
    link.send_to_others(&Message::new(Header::ProbeVerdict {
        error: error.clone(),
    }));
    error.map_or(Ok(()), |e| Err(Error::Cluster(e)))
}

/// A node other than 0: read node 0's probe from the run's storage `run`.
pub(super) async fn answer_probe(link: &Link, run: &Storage) -> Result<(), Error> {
    let message = link.receive(0, |h| matches!(h, Header::Probe { .. }));
    let Header::Probe { key, expected } = message.header else {
        unreachable!("taken as a probe");
    };
    let error = match run.get(&key).await {
        Ok(Some(bytes)) if bytes == expected.as_bytes() => None,
        Ok(Some(_)) => Some(format!("read other bytes at {}/{key}", run.url())),
        Ok(None) => Some(format!("finds nothing at {}/{key}", run.url())),
        Err(e) => Some(format!(
            "cannot read {}/{key}: {}",
            run.url(),
            crate::error::chain(&e)
        )),
    };
    link.send(0, &Message::new(Header::ProbeRead { error }));
    probe_verdict(link)
}

/// What must be the same on every node of a run, for [`agree`].
pub(super) fn fingerprint(trainer: &Trainer, guest: &[u8]) -> Vec<(String, String)> {
    let run = &trainer.run;
    // Settings that may differ per node (credentials, a local mirror) are
    // left out; the storage is checked by the probe.
    let settings = crate::config::RunConfig {
        storage_options: Default::default(),
        sync: None,
        ..run.clone()
    };
    let config = serde_json::to_vec(&trainer.config).expect("JSON values serialize");
    let version = format!(
        "{} {}",
        env!("CARGO_PKG_VERSION"),
        crate::runtime::wit_package()
    );
    digests(&[
        ("trainhost version", version.as_bytes()),
        ("guest", guest),
        ("config", &config),
        ("--workers", &trainer.scaling.num_workers.to_le_bytes()),
        ("storage", trainer.storage.to_string().as_bytes()),
        ("run settings", format!("{settings:?}").as_bytes()),
        (
            "--resume-from",
            trainer.resume_from.as_deref().unwrap_or("").as_bytes(),
        ),
    ])
}

/// The attempt a message belongs to, if it belongs to one.
pub(super) fn message_attempt(header: &Header) -> Option<u64> {
    match header {
        Header::Arrive { attempt, .. }
        | Header::Settle { attempt, .. }
        | Header::Hash { attempt, .. }
        | Header::Hashed { attempt, .. }
        | Header::Persist { attempt, .. }
        | Header::Persisted { attempt, .. }
        | Header::Preempt { attempt }
        | Header::Failed { attempt, .. }
        | Header::Ended { attempt, .. }
        | Header::Over { attempt }
        | Header::Attempt { attempt, .. } => Some(*attempt),
        _ => None,
    }
}

/// Node 0: how every other node's part of `attempt` ended, merged with
/// this node's `ended`: the first failure by node, a stop if any node saw
/// one.
pub(super) fn merge_ended(link: &Link, attempt: u64, mut ended: Ended) -> Ended {
    for node in 1..link.nodes() {
        let message = link.receive(
            node,
            |h| matches!(h, Header::Ended { attempt: a, .. } if *a == attempt),
        );
        if let Header::Ended {
            failure,
            stop_requested,
            preempted,
            ..
        } = message.header
        {
            if ended.failure.is_none() {
                ended.failure = failure;
            }
            ended.stop_requested |= stop_requested;
            ended.preempted |= preempted;
        }
    }
    ended
}
