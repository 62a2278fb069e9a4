//! A report's checkpoint when its files come from ranks on several nodes:
//! one commit for all of them (R39).
//!
//! Each node lists its ranks' files (merged within the node, R7) and
//! brings the list to node 0 with its calls. Node 0 checks the lists
//! against each other: a path reported on several nodes must hold the
//! same bytes everywhere (sizes first, then SHA-256 digests, which node 0
//! asks only of the nodes holding such a path), else the report is
//! refused to every rank, as on one host. Then each path is persisted
//! once, by the lowest node holding it: node 0 clears the checkpoint's
//! directory, tells every node the checkpoint's number and which files to
//! leave out (`Persist`), persists its own, and commits (manifest, run
//! state, history) only once every node said its files are durable
//! (`Persisted`). A node that fails to persist fails the attempt, and
//! nothing is committed.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::queue::Remote;
use super::round::{Arrival, Outcome, take_report};
use super::{Shared, Span};
use crate::cluster::wire::{Header, Listed, Message, Settled};
use crate::failure::{FailureKind, RunFailure};
use crate::persist::{Collision, Plan};
use crate::storage::sha256_of;

/// The files of a plan, as another node sees them.
pub(super) fn listing(plan: Option<&Plan>) -> Vec<Listed> {
    plan.map(|plan| {
        plan.files
            .iter()
            .map(|f| Listed {
                path: f.path.clone(),
                size: f.size,
                ranks: f.ranks.clone(),
            })
            .collect()
    })
    .unwrap_or_default()
}

impl Shared {
    /// Node 0, a report every rank of every node made: check the nodes'
    /// files against each other and record the report, each node
    /// persisting its own files (see the module's description). `listings`
    /// are the other nodes' files, from node 1 on.
    pub(super) fn record_across(
        &self,
        span: &Span,
        round: u64,
        listings: Vec<Result<Vec<Listed>, String>>,
        mut mine: Vec<Arrival>,
    ) -> Settled {
        let Some(recorder) = &self.recorder else {
            return Settled::Failed;
        };
        let (metrics, plan) = take_report(&mut mine);
        let plan = match plan {
            Ok(plan) => plan,
            Err(Ok(collision)) => return Settled::Refused(collision.to_string()),
            Err(Err(e)) => {
                self.fail_recording(e.into());
                return Settled::Failed;
            }
        };
        let mut nodes = vec![listing(plan.as_ref())];
        for files in listings {
            match files {
                Ok(files) => nodes.push(files),
                Err(refused) => return Settled::Refused(refused),
            }
        }
        let result = if nodes[1..].iter().all(Vec::is_empty) {
            // Only this node's files, if any: as on one host.
            recorder.record_plan(metrics, plan, None)
        } else {
            let remote = match self.divide(span, round, &nodes, plan.as_ref()) {
                Ok(remote) => remote,
                Err(settled) => return settled,
            };
            let plan = plan.unwrap_or_else(Plan::empty);
            recorder.record_plan(metrics, Some(plan), Some(remote))
        };
        match self.recorded(result.map(Ok)) {
            Outcome::Recorded => Settled::Recorded {
                preempt_after: self.preempt_after.get().copied(),
            },
            _ => Settled::Failed,
        }
    }

    /// Node 0: check that every path reported on several nodes holds the
    /// same bytes on each, and say which node persists it (the lowest).
    fn divide(
        &self,
        span: &Span,
        round: u64,
        nodes: &[Vec<Listed>],
        plan: Option<&Plan>,
    ) -> Result<Remote, Settled> {
        let mut by_path: BTreeMap<&str, Vec<(usize, &Listed)>> = BTreeMap::new();
        for (node, files) in nodes.iter().enumerate() {
            for file in files {
                by_path.entry(&file.path).or_default().push((node, file));
            }
        }
        let shared: Vec<(&str, &Vec<(usize, &Listed)>)> = by_path
            .iter()
            .filter(|(_, copies)| copies.len() > 1)
            .map(|(path, copies)| (*path, copies))
            .collect();
        for (path, copies) in &shared {
            let sizes = copies
                .iter()
                .map(|(_, f)| (format!("{} bytes", f.size), f.ranks.clone()));
            if let Some(collision) = Collision::among(path, sizes) {
                return Err(Settled::Refused(collision.to_string()));
            }
        }
        let digests = self.digests(span, round, &shared, plan)?;
        for (path, copies) in &shared {
            let described = copies.iter().map(|(node, f)| {
                let digest = &digests[&(*node, path.to_string())];
                (
                    format!("sha256 {}", &digest[..12.min(digest.len())]),
                    f.ranks.clone(),
                )
            });
            if let Some(collision) = Collision::among(path, described) {
                return Err(Settled::Refused(collision.to_string()));
            }
        }
        let mut persist = Vec::new();
        for (node, files) in nodes.iter().enumerate().skip(1) {
            let skip: Vec<String> = files
                .iter()
                .filter(|f| by_path[f.path.as_str()][0].0 != node)
                .map(|f| f.path.clone())
                .collect();
            if skip.len() < files.len() {
                persist.push((node as u32, skip));
            }
        }
        let also = shared
            .iter()
            .map(|(path, copies)| {
                let ranks = copies[1..]
                    .iter()
                    .flat_map(|(_, f)| f.ranks.iter().copied())
                    .collect();
                (path.to_string(), ranks)
            })
            .collect();
        let ranks = nodes[1..]
            .iter()
            .flatten()
            .flat_map(|f| f.ranks.iter().copied())
            .collect();
        Ok(Remote {
            link: Arc::clone(&span.link),
            attempt: span.attempt,
            round,
            persist,
            also,
            ranks,
        })
    }

    /// Node 0: the SHA-256 of every copy of the paths reported on several
    /// nodes, by node and path: this node's computed here, the others'
    /// asked of their nodes.
    fn digests(
        &self,
        span: &Span,
        round: u64,
        shared: &[(&str, &Vec<(usize, &Listed)>)],
        plan: Option<&Plan>,
    ) -> Result<BTreeMap<(usize, String), String>, Settled> {
        let mut asked: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        for (path, copies) in shared {
            for (node, _) in copies.iter() {
                asked.entry(*node).or_default().push(path.to_string());
            }
        }
        for (node, paths) in &asked {
            if *node != 0 {
                span.link.send(
                    *node as u32,
                    &Message::new(Header::Hash {
                        attempt: span.attempt,
                        round,
                        paths: paths.clone(),
                    }),
                );
            }
        }
        let mut digests = BTreeMap::new();
        for (node, paths) in asked {
            let found = if node == 0 {
                let plan = plan.ok_or(Settled::Failed)?;
                paths
                    .iter()
                    .map(|path| {
                        let file = plan.files.iter().find(|f| &f.path == path);
                        let file = file.ok_or(Settled::Failed)?;
                        sha256_of(&file.source, path).map_err(|e| {
                            self.fail_recording(e.into());
                            Settled::Failed
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?
            } else {
                let wanted = |from: u32, h: &Header| {
                    from == node as u32
                        && matches!(h, Header::Hashed { attempt, round: r, .. } if *attempt == span.attempt && *r == round)
                };
                // A node that cannot hash its files fails the attempt.
                let Some((_, message)) = span.link.take(wanted, || self.supervisor.is_stopping())
                else {
                    return Err(Settled::Failed);
                };
                match message.header {
                    Header::Hashed { digests, .. } if digests.len() == paths.len() => digests,
                    _ => return Err(Settled::Failed),
                }
            };
            digests.extend(paths.into_iter().zip(found).map(|(p, d)| ((node, p), d)));
        }
        Ok(digests)
    }

    /// A node other than 0, waiting for a report's outcome: answer node
    /// 0's questions about this node's files (`plan`) and persist them
    /// when told. Returns node 0's `Settle`, or `None` if the attempt
    /// stops first.
    pub(super) fn follow_report(
        &self,
        span: &Span,
        round: u64,
        mut plan: Option<Plan>,
        over: impl Fn() -> bool,
    ) -> Option<Message> {
        let link = &span.link;
        let wanted = |from: u32, h: &Header| {
            from == 0
                && match h {
                    Header::Settle {
                        attempt, round: r, ..
                    }
                    | Header::Hash {
                        attempt, round: r, ..
                    }
                    | Header::Persist {
                        attempt, round: r, ..
                    } => *attempt == span.attempt && *r == round,
                    _ => false,
                }
        };
        loop {
            let (_, message) = link.take(wanted, || self.supervisor.is_stopping() || over())?;
            match message.header {
                Header::Hash { paths, .. } => {
                    let digests = paths
                        .iter()
                        .map(|path| {
                            let file = plan
                                .as_ref()
                                .and_then(|p| p.files.iter().find(|f| &f.path == path))
                                .ok_or_else(|| crate::error::Error::Cluster(format!(
                                    "node 0 asked for the digest of {path}, which no rank of this node reported"
                                )))?;
                            sha256_of(&file.source, path)
                        })
                        .collect::<Result<Vec<_>, _>>();
                    match digests {
                        Ok(digests) => link.send(
                            0,
                            &Message::new(Header::Hashed {
                                attempt: span.attempt,
                                round,
                                digests,
                            }),
                        ),
                        Err(e) => {
                            self.fail_recording(e.into());
                            return None;
                        }
                    }
                }
                Header::Persist {
                    checkpoint, skip, ..
                } => {
                    let (Some(shipper), Some(mut plan)) = (&self.shipper, plan.take()) else {
                        self.fail(RunFailure {
                            rank: None,
                            kind: FailureKind::Host,
                            message: "node 0 asked this node to persist checkpoint files it does not have".into(),
                        });
                        return None;
                    };
                    plan.files.retain(|f| !skip.contains(&f.path));
                    if let Err(failed) = shipper.ship(checkpoint, plan) {
                        self.fail_recording(failed);
                        return None;
                    }
                }
                _ => return Some(message),
            }
        }
    }
}
