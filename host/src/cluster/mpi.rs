//! The nodes of a job as MPI processes: messages between them.
//!
//! Every node runs one receiver thread that takes each message addressed to
//! it off the wire (a matched probe, then a receive of exactly its size) and
//! files it in the node's inbox. It probes without blocking: MPICH's
//! blocking calls poll in a loop, so a receiver blocked in `MPI_Mprobe`
//! would take a whole core from the ranks for the length of the run.
//! Instead it probes back to back (yielding its core) for [`BURST`] after
//! a message arrived and for [`WAIT_SPIN`] after a thread began waiting
//! for one (a round's messages come together), and otherwise every
//! [`IDLE_POLL`], which bounds how late a message is seen when its sender
//! is slow, or nobody waits for it (another node's failure). Any thread may send
//! with a blocking send: since every node always drains its incoming
//! messages, a send completes however large the message is and whatever
//! the receiving node's ranks are doing, and two nodes sending each other
//! 64 MiB at once cannot deadlock. A thread waiting for a message waits on
//! the inbox, where it can also give up when its attempt stops; a blocking
//! MPI collective could not be abandoned by a node whose peer had failed.
//! The one collective used, an all-reduce's sum ([`Node::sum_all`]), is
//! entered only once node 0 has matched the round and told every node to:
//! each node's leader then enters it from host code, which no guest can
//! keep from it; a node that dies instead ends the whole job.
//!
//! MPI is initialized with `MPI_THREAD_MULTIPLE` (sends from several threads
//! beside the receiver); a library that grants less is refused.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mpi::Threading;
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::point_to_point::MatchedReceiveVec;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator, CommunicatorCollectives, Destination, Equivalence, Source};

use super::Envelope;

/// The tag of every trainhost message (MPI tags keep other traffic apart).
const TAG: i32 = 0x7a1;
/// How often an idle receiver probes.
const IDLE_POLL: Duration = Duration::from_micros(250);
/// How long after a message the receiver keeps probing back to back.
const BURST: Duration = Duration::from_micros(500);
/// How long after a thread began waiting for a message the receiver keeps
/// probing back to back: a round's other nodes arrive within a step's
/// skew, and a receiver that fell back to polling every [`IDLE_POLL`]
/// made every later round late too (4 KiB all-reduces across 2 nodes took
/// 2.8 ms a round with 500 µs here).
const WAIT_SPIN: Duration = Duration::from_millis(20);

/// Why this process could not join the job's nodes.
#[derive(Debug, thiserror::Error)]
pub(crate) enum JoinError {
    #[error("MPI could not be initialized (MPI_Init_thread failed)")]
    Init,
    #[error(
        "the MPI library grants {0:?} threading, but trainhost needs MPI_THREAD_MULTIPLE: use an MPI built with threads (MPICH and Open MPI are by default)"
    )]
    Threading(Threading),
}

/// Messages received and not yet taken, in arrival order.
struct Inbox {
    messages: Mutex<VecDeque<Envelope>>,
    arrived: Condvar,
    /// When a thread last started waiting in [`Node::take`] (since
    /// `epoch`, in µs): the receiver probes back to back for a moment.
    wait_started: AtomicU64,
    epoch: Instant,
    /// The node is leaving: the receiver stops.
    leaving: AtomicBool,
}

impl Inbox {
    fn new() -> Self {
        Self {
            messages: Mutex::default(),
            arrived: Condvar::new(),
            wait_started: AtomicU64::new(0),
            epoch: Instant::now(),
            leaving: AtomicBool::new(false),
        }
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }
}

/// This process as one node of the job.
pub(crate) struct Node {
    index: u32,
    nodes: u32,
    inbox: Arc<Inbox>,
    /// Sends are serialized: a large send holds it until the peer's
    /// receiver has taken the message.
    send: Mutex<()>,
    receiver: Option<JoinHandle<()>>,
    /// Finalizes MPI when dropped, after the receiver has stopped.
    universe: Option<Universe>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("index", &self.index)
            .field("nodes", &self.nodes)
            .finish_non_exhaustive()
    }
}

impl Node {
    /// Initialize MPI and start receiving. Once per process.
    pub fn join() -> Result<Self, JoinError> {
        let (universe, threading) =
            mpi::initialize_with_threading(Threading::Multiple).ok_or(JoinError::Init)?;
        if threading != Threading::Multiple {
            return Err(JoinError::Threading(threading));
        }
        let world = universe.world();
        let (index, nodes) = (world.rank() as u32, world.size() as u32);
        let inbox = Arc::new(Inbox::new());
        let filed = Arc::clone(&inbox);
        let receiver = std::thread::Builder::new()
            .name("trainhost-mpi-receiver".into())
            .spawn(move || receive(&filed))
            .expect("a thread for MPI messages");
        Ok(Self {
            index,
            nodes,
            inbox,
            send: Mutex::new(()),
            receiver: Some(receiver),
            universe: Some(universe),
        })
    }

    /// This node's index, from 0.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// How many nodes the job has.
    pub fn nodes(&self) -> u32 {
        self.nodes
    }

    /// Send `bytes` to node `to`; returns once MPI has taken them.
    pub fn send(&self, to: u32, bytes: &[u8]) {
        let _one = self.send.lock().unwrap_or_else(|p| p.into_inner());
        SimpleCommunicator::world()
            .process_at_rank(to as i32)
            .send_with_tag(bytes, TAG);
    }

    /// The element-wise sum of `data` over every node, the same on each:
    /// MPI's own all-reduce. Every node must call it for the same round,
    /// with as many elements (at most `i32::MAX`); it blocks until all
    /// have.
    pub fn sum_all<T: Equivalence + Copy + Default>(&self, data: &[T]) -> Vec<T> {
        let mut out = vec![T::default(); data.len()];
        SimpleCommunicator::world().all_reduce_into(data, &mut out[..], SystemOperation::sum());
        out
    }

    /// Take the first message `wanted` accepts, waiting for it until
    /// `stop` says to give up (checked every `poll`, without the inbox
    /// locked, so it may look at the inbox); other messages stay.
    pub fn take(
        &self,
        mut wanted: impl FnMut(&Envelope) -> bool,
        stop: impl Fn() -> bool,
        poll: Duration,
    ) -> Option<Envelope> {
        self.inbox
            .wait_started
            .store(self.inbox.now(), Ordering::SeqCst);
        loop {
            let mut messages = self.lock();
            if let Some(i) = messages.iter().position(&mut wanted) {
                return messages.remove(i);
            }
            messages = self
                .inbox
                .arrived
                .wait_timeout(messages, poll)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            if let Some(i) = messages.iter().position(&mut wanted) {
                return messages.remove(i);
            }
            drop(messages);
            if stop() {
                return None;
            }
        }
    }

    /// What `wanted` makes of the first waiting message it accepts (the
    /// message stays).
    pub fn find<T>(&self, wanted: impl Fn(&Envelope) -> Option<T>) -> Option<T> {
        self.lock().iter().find_map(wanted)
    }

    /// Drop every message `stale` accepts (of an attempt that ended, say).
    pub fn discard(&self, stale: impl Fn(&Envelope) -> bool) {
        self.lock().retain(|m| !stale(m));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Envelope>> {
        self.inbox
            .messages
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }
}

/// The receiver thread: file every message until the node leaves.
fn receive(inbox: &Inbox) {
    let world = SimpleCommunicator::world();
    let (burst, wait_spin) = (BURST.as_micros() as u64, WAIT_SPIN.as_micros() as u64);
    let mut last = 0;
    while !inbox.leaving.load(Ordering::SeqCst) {
        let Some(probed) = world.any_process().immediate_matched_probe_with_tag(TAG) else {
            let now = inbox.now();
            if now < last + burst || now < inbox.wait_started.load(Ordering::SeqCst) + wait_spin {
                std::thread::yield_now();
            } else {
                std::thread::sleep(IDLE_POLL);
            }
            continue;
        };
        let (bytes, status) = probed.matched_receive_vec::<u8>();
        let from = status.source_rank() as u32;
        inbox
            .messages
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(Envelope { from, bytes });
        inbox.arrived.notify_all();
        last = inbox.now();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(receiver) = self.receiver.take() {
            self.inbox.leaving.store(true, Ordering::SeqCst);
            let _ = receiver.join();
        }
        // Every node finalizes together; MPI_Finalize waits for the others.
        drop(self.universe.take());
    }
}

#[cfg(test)]
mod tests {
    //! These run as several processes under a real `mpiexec`: the test
    //! starts this test binary again, one process per node, running the
    //! ignored test `node`.

    use super::*;
    use std::process::Command;

    const CHILD: &str = "TRAINHOST_MPI_TEST_NODE";

    /// One node of the test job: every node sends every node a small
    /// message and a large one, all at once, and checks what it gets.
    #[test]
    #[ignore = "run as a node by messages_reach_every_node_under_mpiexec"]
    fn node() {
        assert_eq!(
            std::env::var(CHILD).as_deref(),
            Ok("1"),
            "run by mpiexec only"
        );
        let node = Node::join().unwrap();
        let (me, n) = (node.index(), node.nodes());
        // Far over the size MPI sends eagerly: a send waits for the receiver.
        let large = |from: u32| vec![from as u8 ^ 0x5a; 8 << 20];
        std::thread::scope(|s| {
            for to in 0..n {
                let node = &node;
                s.spawn(move || {
                    node.send(to, format!("hello {to} from {me}").as_bytes());
                    node.send(to, &large(me));
                });
            }
        });
        for from in 0..n {
            let hello = node
                .take(
                    |m| m.from == from && m.bytes.len() < 100,
                    || false,
                    Duration::from_millis(10),
                )
                .unwrap();
            assert_eq!(hello.bytes, format!("hello {me} from {from}").as_bytes());
            let big = node
                .take(|m| m.from == from, || false, Duration::from_millis(10))
                .unwrap();
            assert!(big.bytes == large(from), "the large message from {from}");
        }
        // Nothing waits forever: a stop is honoured.
        assert!(
            node.take(|_| true, || true, Duration::from_millis(1))
                .is_none()
        );
        // An idle node leaves the cores to the ranks: its receiver does
        // not spin (MPICH's blocking probe would take a whole core).
        let before = cpu_seconds();
        std::thread::sleep(Duration::from_secs(1));
        let used = cpu_seconds() - before;
        assert!(used < 0.25, "an idle node used {used} s of CPU in 1 s");
    }

    /// The CPU time this process has used, from `/proc/self/stat`.
    fn cpu_seconds() -> f64 {
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
        // Fields after the command (which may hold spaces): utime is the
        // 12th, stime the 13th, in clock ticks.
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let fields: Vec<&str> = rest.split(' ').collect();
        let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
        let per_second = rustix::param::clock_ticks_per_second() as f64;
        ticks / per_second
    }

    #[test]
    fn messages_reach_every_node_under_mpiexec() {
        if Command::new("mpiexec").arg("--version").output().is_err() {
            assert!(
                std::env::var("TRAINHOST_REQUIRE_MPI").as_deref() != Ok("1"),
                "mpiexec is not installed and TRAINHOST_REQUIRE_MPI=1: install MPICH (apt-get install mpich)"
            );
            eprintln!("skipped: mpiexec is not installed (install MPICH: apt-get install mpich)");
            return;
        }
        let exe = std::env::current_exe().unwrap();
        for nodes in ["2", "3"] {
            let out = Command::new("mpiexec")
                .args(["-n", nodes])
                .arg(&exe)
                .args([
                    "--exact",
                    "cluster::mpi::tests::node",
                    "--ignored",
                    "--nocapture",
                ])
                .env(CHILD, "1")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{nodes} nodes: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}
