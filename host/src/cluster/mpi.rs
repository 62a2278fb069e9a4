//! The nodes of a job as MPI processes: messages between them.
//!
//! Messages are taken off the wire (a matched probe, then a receive of
//! exactly its size) by whichever thread is there to do it, one at a time
//! (so each sender's messages are filed in the order it sent them), and
//! filed in the node's inbox. Nothing probes blocking: MPICH's blocking
//! calls poll in a loop, so a thread blocked in `MPI_Mprobe` would take a
//! whole core from the ranks for the length of the run.
//!
//! Where the host has a core for every thread that runs ranks in every
//! process on it ([`Node::share_host`]), a thread waiting for a message (a
//! leader waiting for node 0's outcome, node 0 waiting for the other
//! nodes' calls) probes MPI itself, back to back for up to [`WAIT_SPIN`]
//! (without yielding its core for the first [`PURE_SPIN`]), and takes its
//! message straight off the wire: a
//! round's messages come together, and handing each one over through
//! another thread cost a wake through the scheduler per message. Only one
//! waiting thread polls at a time; the others wait on the inbox. Otherwise
//! the node's receiver thread polls: back to back for [`WAIT_SPIN`] after
//! a thread went to wait on the inbox and for [`BURST`] after a message
//! arrived, and else every [`IDLE_POLL`], which bounds how late a message
//! is seen when nobody waits for it yet (another node's failure, the next
//! round's first call).
//!
//! Any thread may send, and a send returns once MPI has taken the
//! message: since every node always drains its incoming messages (the
//! sending thread too, while its send is pending: [`Node::send`]), a
//! send completes however large the message is and whatever the
//! receiving node's ranks are doing, and two nodes sending each other
//! 64 MiB at once cannot deadlock. A thread
//! waiting for a message gives up when its attempt stops; a blocking MPI
//! collective could not be abandoned by a node whose peer had failed.
//! The one collective used, an all-reduce's sum ([`Node::sum_all`]), is
//! entered only once node 0 has matched the round and told every node to:
//! each node's leader then enters it from host code, which no guest can
//! keep from it; a node that dies instead ends the whole job.
//!
//! MPI is initialized with `MPI_THREAD_MULTIPLE` (sends from several threads
//! beside the receiver); a library that grants less is refused.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use mpi::Threading;
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::point_to_point::MatchedReceiveVec;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator, Destination, Equivalence, Source};

use super::Envelope;

unsafe extern "C" {
    /// `MPI_IN_PLACE` of the MPI library trainhost is built against, a
    /// macro Rust cannot name (`csrc/mpi_in_place.c`, built by build.rs).
    static trainhost_mpi_in_place: *mut std::ffi::c_void;
}

/// The tag of every trainhost message (MPI tags keep other traffic apart).
const TAG: i32 = 0x7a1;
/// How often an idle receiver probes.
const IDLE_POLL: Duration = Duration::from_micros(250);
/// How long after a message the receiver keeps probing back to back.
const BURST: Duration = Duration::from_micros(500);
/// How long a waiting thread probes back to back before it waits on the
/// inbox, and how long the receiver does for a thread waiting there: a
/// round's other nodes arrive within a step's skew, and a node that fell back to
/// polling every [`IDLE_POLL`] made every later round late too (4 KiB
/// all-reduces across 2 nodes took 2.8 ms a round with 500 µs here).
const WAIT_SPIN: Duration = Duration::from_millis(20);
/// How long a waiting thread that probes MPI itself spins before it yields
/// its core between probes. A small round's answer comes within a few
/// microseconds, and a `sched_yield` between probes put a pass through the
/// scheduler between the message's arrival and its taking: 4 KiB across 2
/// nodes of a rank took 6.0–6.7 µs a round yielding, 4.6–4.8 µs spinning
/// first. It only spins where the host has a core for each rank thread
/// ([`Node::share_host`]), and for less than a scheduler tick.
const PURE_SPIN: Duration = Duration::from_micros(50);

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
    /// Held by the thread taking messages off the wire: one at a time, so
    /// that each sender's messages are filed in the order it sent them.
    receiving: Mutex<()>,
    /// Whether a waiting thread polls MPI itself (see [`Node::share_host`]).
    poll_itself: AtomicBool,
    /// A thread waiting in [`Node::take`] polls MPI itself: the receiver
    /// and other waiting threads keep off.
    polled: AtomicBool,
    /// When a thread last went to wait on the inbox (since `epoch`, in
    /// µs): the receiver polls back to back for [`WAIT_SPIN`].
    parked: AtomicU64,
    epoch: Instant,
    /// The receiver thread, woken when a waiting thread stops polling.
    receiver: OnceLock<Thread>,
    /// The node is leaving: the receiver stops.
    leaving: AtomicBool,
}

impl Inbox {
    fn new() -> Self {
        Self {
            messages: Mutex::default(),
            arrived: Condvar::new(),
            receiving: Mutex::new(()),
            poll_itself: AtomicBool::new(false),
            polled: AtomicBool::new(false),
            parked: AtomicU64::new(0),
            epoch: Instant::now(),
            receiver: OnceLock::new(),
            leaving: AtomicBool::new(false),
        }
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// Whether a thread waits on the inbox for what the receiver files.
    fn awaited(&self) -> bool {
        self.now() < self.parked.load(Ordering::SeqCst) + WAIT_SPIN.as_micros() as u64
    }

    /// A thread goes to wait on the inbox: the receiver polls for it.
    fn park(&self) {
        self.parked.store(self.now(), Ordering::SeqCst);
        self.wake_receiver();
    }

    fn wake_receiver(&self) {
        if let Some(receiver) = self.receiver.get() {
            receiver.unpark();
        }
    }

    fn messages(&self) -> std::sync::MutexGuard<'_, VecDeque<Envelope>> {
        self.messages.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Take the first filed message `wanted` accepts, or else one message
    /// off the wire: returned if `wanted` accepts it, filed (and waiting
    /// threads told) if not.
    fn receive(
        &self,
        world: &SimpleCommunicator,
        wanted: &mut impl FnMut(&Envelope) -> bool,
    ) -> Received {
        let _one = self.receiving.lock().unwrap_or_else(|p| p.into_inner());
        // Looked at under `receiving`: nothing filed is newer than what
        // the probe below finds.
        {
            let mut messages = self.messages();
            if let Some(i) = messages.iter().position(&mut *wanted)
                && let Some(envelope) = messages.remove(i)
            {
                return Received::Wanted(envelope);
            }
        }
        let Some(probed) = world.any_process().immediate_matched_probe_with_tag(TAG) else {
            return Received::Nothing;
        };
        let (bytes, status) = probed.matched_receive_vec::<u8>();
        let envelope = Envelope::new(status.source_rank() as u32, bytes);
        if wanted(&envelope) {
            return Received::Wanted(envelope);
        }
        self.messages().push_back(envelope);
        self.arrived.notify_all();
        Received::Filed
    }
}

/// What one look at the inbox and the wire found.
enum Received {
    Wanted(Envelope),
    Filed,
    Nothing,
}

/// Gives up polling MPI (see [`Inbox::polled`]) when dropped, waking the
/// receiver if other threads wait on the inbox.
struct Polling<'a>(&'a Inbox);

impl Drop for Polling<'_> {
    fn drop(&mut self) {
        self.0.polled.store(false, Ordering::SeqCst);
        if self.0.awaited() {
            self.0.wake_receiver();
        }
    }
}

/// This process as one node of the job.
pub(crate) struct Node {
    index: u32,
    nodes: u32,
    /// How many of the job's processes run on this host, this one among
    /// them (MPI's shared-memory split).
    host_processes: u32,
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
        let host_processes = world.split_shared(0).size() as u32;
        let inbox = Arc::new(Inbox::new());
        let filed = Arc::clone(&inbox);
        let receiver = std::thread::Builder::new()
            .name("trainhost-mpi-receiver".into())
            .spawn(move || {
                let _ = filed.receiver.set(std::thread::current());
                receive(&filed)
            })
            .expect("a thread for MPI messages");
        Ok(Self {
            index,
            nodes,
            host_processes,
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

    /// How many of the job's processes run on this host, this one among
    /// them.
    pub fn host_processes(&self) -> u32 {
        self.host_processes
    }

    /// This node runs its ranks on `threads` threads, and the host has
    /// `cores`: a waiting thread polls MPI itself only if every process on
    /// this host can have that many cores. Where they cannot, a thread
    /// polling while it waited took the core a rank needed to finish the
    /// round: 1 MiB all-reduces with 2 ranks on each of 2 nodes on 2 cores,
    /// each node on 2 threads, took 1.9–2.1 ms a round against 0.6–1.2 ms
    /// with the receiver polling (with a rank on each, 4 KiB took 8.4–9.2
    /// µs against 18 µs). Since the processes on a host share its cores
    /// (`crate::cores::share`), that happens only where they
    /// outnumber the cores.
    pub fn share_host(&self, threads: usize, cores: usize) {
        let needed = self.host_processes as usize * threads;
        self.inbox
            .poll_itself
            .store(needed <= cores, Ordering::Relaxed);
    }

    /// Send `bytes` to node `to`; returns once MPI has taken them.
    ///
    /// A message past MPI's eager size (a few KiB over shared memory) is
    /// taken only once the peer receives it, and the peer may be sending
    /// to this node at that moment: in a round every node settles itself,
    /// every node sends every other its calls at once. So the send does
    /// not block in MPI: while it is pending, the sending thread takes
    /// what arrives off the wire itself and files it. Left to the
    /// receiver thread, which polls every [`IDLE_POLL`] while nobody
    /// waits, 8 KiB all-reduces across 2 nodes took 2.5 ms a round.
    pub fn send(&self, to: u32, bytes: &[u8]) {
        let _one = self.send.lock().unwrap_or_else(|p| p.into_inner());
        let world = SimpleCommunicator::world();
        mpi::request::scope(|scope| {
            let mut request = world
                .process_at_rank(to as i32)
                .immediate_send_with_tag(scope, bytes, TAG);
            // Wants nothing: everything it takes is filed.
            let mut nothing = |_: &Envelope| false;
            let started = Instant::now();
            loop {
                request = match request.test() {
                    Ok(_) => return,
                    Err(pending) => pending,
                };
                let spin =
                    self.inbox.poll_itself.load(Ordering::Relaxed) && started.elapsed() < PURE_SPIN;
                match self.inbox.receive(&world, &mut nothing) {
                    Received::Filed | Received::Wanted(_) => {}
                    Received::Nothing if spin => std::hint::spin_loop(),
                    Received::Nothing => std::thread::yield_now(),
                }
            }
        })
    }

    /// Replace `data` with its element-wise sum over every node, the same
    /// on each: MPI's own all-reduce. Every node must call it for the same
    /// round, with as many elements (at most `i32::MAX`); it blocks until
    /// all have.
    ///
    /// In place (`MPI_IN_PLACE`): MPI then does not copy `data` into a
    /// separate result buffer first (MPICH's algorithms start so), and no
    /// buffer is allocated for the result. Against a new buffer for the
    /// result, a 64 MiB sum across 2 nodes of one rank each took 32-33 ms
    /// a round instead of 41-51 ms (a host tensor, alternating runs; a
    /// bare `MPI_Allreduce` between two buffers took 44-54 ms meanwhile).
    pub fn sum_all<T: Equivalence + Copy>(&self, data: &mut [T]) {
        use mpi::raw::AsRaw;
        let world = SimpleCommunicator::world();
        let count = i32::try_from(data.len()).expect("callers send at most MAX_SUMMED elements");
        // SAFETY: `data` holds `count` elements of `T`'s MPI datatype, read
        // and written in place; MPI_IN_PLACE is the library's own (an
        // error aborts the job: MPI_ERRORS_ARE_FATAL).
        unsafe {
            mpi::ffi::MPI_Allreduce(
                trainhost_mpi_in_place,
                data.as_mut_ptr().cast(),
                count,
                T::equivalent_datatype().as_raw(),
                SystemOperation::sum().as_raw(),
                world.as_raw(),
            );
        }
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
        let inbox = &*self.inbox;
        if inbox.poll_itself.load(Ordering::Relaxed)
            && inbox
                .polled
                .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            let _polling = Polling(inbox);
            let world = SimpleCommunicator::world();
            // One clock read a probe: the time waited says when to stop
            // spinning, to stop yielding and to ask `stop` again.
            let started = Instant::now();
            let mut looked = Duration::ZERO;
            loop {
                let received = inbox.receive(&world, &mut wanted);
                let waited = started.elapsed();
                match received {
                    Received::Wanted(envelope) => return Some(envelope),
                    _ if waited >= WAIT_SPIN => break,
                    Received::Filed => continue,
                    Received::Nothing if waited < PURE_SPIN => std::hint::spin_loop(),
                    Received::Nothing => std::thread::yield_now(),
                }
                if waited - looked >= poll {
                    if stop() {
                        return None;
                    }
                    looked = waited;
                }
            }
        } else {
            inbox.park();
        }
        loop {
            let mut messages = inbox.messages();
            if let Some(i) = messages.iter().position(&mut wanted) {
                return messages.remove(i);
            }
            messages = inbox
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

    /// Take the first message `wanted` accepts if one is here, without
    /// waiting; other messages stay.
    pub fn take_waiting(&self, wanted: impl FnMut(&Envelope) -> bool) -> Option<Envelope> {
        let mut messages = self.inbox.messages();
        let i = messages.iter().position(wanted)?;
        messages.remove(i)
    }

    /// What `wanted` makes of the first waiting message it accepts (the
    /// message stays).
    pub fn find<T>(&self, wanted: impl Fn(&Envelope) -> Option<T>) -> Option<T> {
        self.inbox.messages().iter().find_map(wanted)
    }

    /// Drop every message `stale` accepts (of an attempt that ended, say).
    pub fn discard(&self, stale: impl Fn(&Envelope) -> bool) {
        self.inbox.messages().retain(|m| !stale(m));
    }
}

/// The receiver thread: file every message nobody polls for, until the
/// node leaves.
fn receive(inbox: &Inbox) {
    let world = SimpleCommunicator::world();
    // Wants nothing: everything it takes is filed.
    let mut nothing = |_: &Envelope| false;
    let mut last: Option<Instant> = None;
    while !inbox.leaving.load(Ordering::SeqCst) {
        if inbox.polled.load(Ordering::SeqCst) {
            std::thread::park_timeout(IDLE_POLL);
            continue;
        }
        match inbox.receive(&world, &mut nothing) {
            Received::Nothing if last.is_some_and(|at| at.elapsed() < BURST) || inbox.awaited() => {
                std::thread::yield_now()
            }
            Received::Nothing => std::thread::park_timeout(IDLE_POLL),
            Received::Filed | Received::Wanted(_) => last = Some(Instant::now()),
        }
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
    /// message and a large one, all at once, then many small ones to two
    /// threads waiting at once, and checks what each gets.
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
        // Two threads wait at once while the messages they want arrive
        // interleaved: each sender's messages stay in order, whether a
        // waiting thread polls MPI itself (taking its own straight off the
        // wire, filing the other's) or the receiver files them all.
        const EACH: u32 = 200;
        for cores in [usize::MAX, 0] {
            node.share_host(1, cores);
            std::thread::scope(|s| {
                for kind in ["a", "b"] {
                    let node = &node;
                    s.spawn(move || {
                        for from in 0..n {
                            for i in 0..EACH {
                                let mine = |m: &Envelope| {
                                    m.from == from && m.bytes.starts_with(kind.as_bytes())
                                };
                                let got = node
                                    .take(mine, || false, Duration::from_millis(10))
                                    .unwrap();
                                assert_eq!(
                                    got.bytes,
                                    format!("{kind} {i}").as_bytes(),
                                    "from node {from}, with {cores} cores"
                                );
                            }
                        }
                    });
                }
                let node = &node;
                s.spawn(move || {
                    for i in 0..EACH {
                        for to in 0..n {
                            node.send(to, format!("a {i}").as_bytes());
                            node.send(to, format!("b {i}").as_bytes());
                        }
                    }
                });
            });
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
