//! The nodes of a job: where this process sits among the processes a
//! launcher started (`mpiexec` of MPICH or Open MPI, Slurm's `srun`), and
//! the link to the other nodes.
//!
//! A run spans several hosts as one trainhost per node: the launcher starts
//! the processes, MPI connects them (`mpi.rs`, with the `mpi` feature), and
//! the nodes speak the messages of `wire.rs`. Node 0 leads: it owns the
//! run's record in storage, matches every round's calls, and decides when
//! attempts start and end; the other nodes follow. Launchers say how many
//! processes they started, and which one this is, in the environment they
//! give each process; those variables are read here and nowhere else.
//! Without the `mpi` feature a process that finds itself one of several
//! refuses to start ([`crate::error::Error::SeveralProcesses`]): each would
//! otherwise train the whole run on its own.

#[cfg(feature = "mpi")]
pub(crate) mod mpi;
pub(crate) mod wire;

#[cfg(not(feature = "mpi"))]
use absent::Transport;
#[cfg(feature = "mpi")]
use mpi::Node as Transport;

/// A message from another node (or this one), as it came off the wire.
#[derive(Debug)]
pub(crate) struct Envelope {
    pub from: u32,
    pub bytes: Vec<u8>,
    /// Its header, read the first time a filter looks at it: a message
    /// waiting in the inbox is looked at by every take until one wants
    /// it, and the one taken is opened without reading it again.
    header: OnceCell<Option<Header>>,
}

impl Envelope {
    /// Made by the transport, which exists with the `mpi` feature.
    #[cfg(any(feature = "mpi", test))]
    pub fn new(from: u32, bytes: Vec<u8>) -> Self {
        Self {
            from,
            bytes,
            header: OnceCell::new(),
        }
    }

    /// Its header, if it decodes.
    fn header(&self) -> Option<&Header> {
        self.header.get_or_init(|| wire::peek(&self.bytes)).as_ref()
    }
}

/// Without the `mpi` feature there is no transport: [`Link`] cannot be
/// made, and its calls need no code.
#[cfg(not(feature = "mpi"))]
mod absent {
    use super::Envelope;
    use std::time::Duration;

    pub(crate) enum Transport {}

    impl Transport {
        pub fn send(&self, _to: u32, _bytes: &[u8]) {
            match *self {}
        }

        pub fn take(
            &self,
            _wanted: impl FnMut(&Envelope) -> bool,
            _stop: impl Fn() -> bool,
            _poll: Duration,
        ) -> Option<Envelope> {
            match *self {}
        }

        pub fn take_waiting(&self, _wanted: impl FnMut(&Envelope) -> bool) -> Option<Envelope> {
            match *self {}
        }

        pub fn share_host(&self, _threads: usize, _cores: usize) {
            match *self {}
        }

        pub fn host_processes(&self) -> u32 {
            match *self {}
        }

        pub fn discard(&self, _stale: impl Fn(&Envelope) -> bool) {
            match *self {}
        }

        pub fn find<T>(&self, _wanted: impl Fn(&Envelope) -> Option<T>) -> Option<T> {
            match *self {}
        }

        pub fn sum_all<T>(&self, _data: &mut [T]) {
            match *self {}
        }
    }
}

/// A number type the nodes can sum element-wise with the transport's own
/// all-reduce ([`Link::sum_over_nodes`]).
#[cfg(feature = "mpi")]
pub(crate) trait Summable: ::mpi::traits::Equivalence + Copy {}
/// A number type the nodes can sum element-wise with the transport's own
/// all-reduce ([`Link::sum_over_nodes`]).
#[cfg(not(feature = "mpi"))]
pub(crate) trait Summable: Copy {}

impl Summable for f32 {}
impl Summable for f64 {}
impl Summable for i64 {}

/// The most elements [`Link::sum_over_nodes`] takes at once (MPI counts
/// are C ints).
pub(crate) const MAX_SUMMED: usize = i32::MAX as usize;

use std::cell::OnceCell;
use std::time::Duration;

use crate::error::Error;
use wire::{Frame, Header, Message};

/// This process among those a launcher started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Launch {
    /// This process's index, from 0.
    pub index: u32,
    /// How many processes the launcher started.
    pub processes: u32,
    /// The launcher, for messages.
    pub launcher: &'static str,
}

/// The variables each launcher sets: (launcher, size, index). Slurm's batch
/// script sees `SLURM_NTASKS` and `SLURM_PROCID` too, though it is one
/// process: only a step that `srun` started has `SLURM_STEP_NUM_TASKS`.
const LAUNCHERS: [(&str, &str, &str); 3] = [
    // MPICH's Hydra (also behind Intel MPI), then Open MPI; either is
    // started as `mpiexec` or `mpirun`.
    ("mpiexec", "PMI_SIZE", "PMI_RANK"),
    ("mpiexec", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    ("srun", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID"),
];

/// How this process was launched, if by one of the known launchers, from
/// the environment `var` reads.
pub(crate) fn detect(var: impl Fn(&str) -> Option<String>) -> Option<Launch> {
    LAUNCHERS.iter().find_map(|(launcher, size, index)| {
        let processes = var(size)?.trim().parse().ok()?;
        let index = var(index).and_then(|i| i.trim().parse().ok()).unwrap_or(0);
        Some(Launch {
            index,
            processes,
            launcher,
        })
    })
}

/// Join the job's other nodes, if a launcher started several processes:
/// `None` when this process is the whole job.
pub(crate) fn join() -> Result<Option<Link>, Error> {
    let Some(launch) = detect(|name| std::env::var(name).ok()).filter(|l| l.processes > 1) else {
        return Ok(None);
    };
    Link::join(launch).map(Some)
}

/// How a run's ranks are spread over its nodes: the same number on each,
/// node `n` holding ranks `n × per_node` up to the next node's first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    pub node: u32,
    pub nodes: u32,
    pub per_node: u32,
}

impl Layout {
    /// Spread `workers` ranks over `nodes` nodes, or say why they do not
    /// split evenly.
    pub fn new(workers: u32, node: u32, nodes: u32) -> Result<Self, Error> {
        if nodes == 0 || !workers.is_multiple_of(nodes) || workers < nodes {
            return Err(Error::InvalidConfig(format!(
                "--workers {workers} does not split evenly over {nodes} nodes (the processes the launcher started); use a multiple of {nodes}, each node runs the same number of ranks"
            )));
        }
        Ok(Self {
            node,
            nodes,
            per_node: workers / nodes,
        })
    }

    /// The run's ranks on every node together.
    pub fn world_size(&self) -> u32 {
        self.nodes * self.per_node
    }

    /// The world rank of this node's `local` rank.
    pub fn world_rank(&self, local: u32) -> u32 {
        self.node * self.per_node + local
    }
}

/// This node's link to the job's other nodes. Without the `mpi` feature
/// there is none: the type cannot be made.
pub(crate) struct Link {
    index: u32,
    nodes: u32,
    transport: Transport,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("index", &self.index)
            .field("nodes", &self.nodes)
            .finish_non_exhaustive()
    }
}

/// How often a node waiting for a message checks whether to give up.
const POLL: Duration = Duration::from_millis(10);

impl Link {
    #[cfg(not(feature = "mpi"))]
    fn join(launch: Launch) -> Result<Self, Error> {
        Err(Error::SeveralProcesses {
            index: launch.index,
            processes: launch.processes,
            launcher: launch.launcher,
        })
    }

    #[cfg(feature = "mpi")]
    fn join(launch: Launch) -> Result<Self, Error> {
        let node = mpi::Node::join().map_err(|e| Error::Cluster(e.to_string()))?;
        if node.nodes() != launch.processes {
            return Err(Error::Cluster(format!(
                "{} started {} processes, but MPI sees {}: trainhost and {} must come from the same MPI (MPICH's mpiexec for a trainhost built on MPICH)",
                launch.launcher,
                launch.processes,
                node.nodes(),
                launch.launcher
            )));
        }
        Ok(Self {
            index: node.index(),
            nodes: node.nodes(),
            transport: node,
        })
    }

    /// This node's index: 0 leads.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// How many nodes the job has.
    pub fn nodes(&self) -> u32 {
        self.nodes
    }

    /// How many of the job's processes (nodes) run on this host, this one
    /// among them.
    pub fn host_processes(&self) -> u32 {
        self.transport.host_processes()
    }

    /// This node runs its ranks on `threads` threads, on a host of
    /// `cores`: whether a thread waiting for a message can poll for it
    /// itself depends on how many processes share the host.
    pub fn share_host(&self, threads: usize, cores: usize) {
        self.transport.share_host(threads, cores);
    }

    /// Send `message` to node `to`.
    pub fn send(&self, to: u32, message: &Message) {
        self.send_frame(to, &message.encode());
    }

    /// Send `message` to every other node.
    pub fn send_to_others(&self, message: &Message) {
        self.send_frame_to_others(&message.encode());
    }

    /// Send a message framed already to node `to`.
    pub fn send_frame(&self, to: u32, frame: &Frame) {
        self.transport.send(to, frame.bytes());
    }

    /// Send a message framed already to every other node.
    pub fn send_frame_to_others(&self, frame: &Frame) {
        for to in (0..self.nodes).filter(|n| *n != self.index) {
            self.transport.send(to, frame.bytes());
        }
    }

    /// The first message whose sender and header `wanted` accepts, waiting
    /// until `stop` says to give up; other messages stay for later.
    pub fn take(
        &self,
        wanted: impl Fn(u32, &Header) -> bool,
        stop: impl Fn() -> bool,
    ) -> Option<(u32, Message)> {
        let envelope = self.transport.take(accepting(wanted), stop, POLL)?;
        open(envelope)
    }

    /// The first message here whose sender and header `wanted` accepts,
    /// without waiting for one: for threads that look now and then (the
    /// watcher), which must not hold the node's polling of MPI.
    pub fn take_waiting(&self, wanted: impl Fn(u32, &Header) -> bool) -> Option<(u32, Message)> {
        open(self.transport.take_waiting(accepting(wanted))?)
    }

    /// The next message from node `from` whose header `wanted` accepts,
    /// however long it takes: for the steps every node goes through
    /// together (start, the end of an attempt), where a node that died
    /// ends the job anyway.
    pub fn receive(&self, from: u32, wanted: impl Fn(&Header) -> bool) -> Message {
        loop {
            if let Some((_, message)) = self.take(|f, h| f == from && wanted(h), || false) {
                return message;
            }
        }
    }

    /// The header of a waiting message from `from` that `wanted` accepts;
    /// the message stays.
    pub fn find(&self, from: u32, wanted: impl Fn(&Header) -> bool) -> Option<Header> {
        self.transport.find(|e| {
            (e.from == from)
                .then(|| e.header())
                .flatten()
                .filter(|h| wanted(h))
                .cloned()
        })
    }

    /// Replace `data` with its element-wise sum over every node, the same
    /// on each (MPI_Allreduce, in place). Every node must call it in the same round with as
    /// many elements, at most [`MAX_SUMMED`]; it blocks until all have: call
    /// it only once node 0 has told every node to (no node can then be
    /// kept from it but by dying, which ends the job).
    pub fn sum_over_nodes<T: Summable>(&self, data: &mut [T]) {
        self.transport.sum_all(data)
    }

    /// Drop waiting messages whose header `stale` accepts (and any that
    /// does not decode).
    pub fn discard(&self, stale: impl Fn(&Header) -> bool) {
        self.transport.discard(|e| e.header().is_none_or(&stale));
    }
}

/// An envelope filter from a filter of sender and header: an envelope
/// whose header does not decode is not wanted.
fn accepting(wanted: impl Fn(u32, &Header) -> bool) -> impl FnMut(&Envelope) -> bool {
    move |e| e.header().is_some_and(|h| wanted(e.from, h))
}

/// A taken envelope's sender and message. Its header was read when it
/// was taken.
fn open(envelope: Envelope) -> Option<(u32, Message)> {
    let Envelope {
        from,
        bytes,
        header,
    } = envelope;
    let header = header.into_inner().flatten()?;
    Message::after_peek(header, bytes).ok().map(|m| (from, m))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn launch(vars: &[(&str, &str)]) -> Option<Launch> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        detect(|name| vars.get(name).cloned())
    }

    #[test]
    fn each_launcher_is_read_from_its_own_variables() {
        assert_eq!(launch(&[]), None);
        assert_eq!(
            launch(&[("PMI_SIZE", "2"), ("PMI_RANK", "1")]),
            Some(Launch {
                index: 1,
                processes: 2,
                launcher: "mpiexec"
            })
        );
        assert_eq!(
            launch(&[("OMPI_COMM_WORLD_SIZE", "4"), ("OMPI_COMM_WORLD_RANK", "3")])
                .map(|l| (l.index, l.processes)),
            Some((3, 4))
        );
        assert_eq!(
            launch(&[("SLURM_STEP_NUM_TASKS", "8"), ("SLURM_PROCID", "5")]).map(|l| (
                l.launcher,
                l.index,
                l.processes
            )),
            Some(("srun", 5, 8))
        );
    }

    #[test]
    fn a_slurm_batch_script_is_one_process() {
        assert_eq!(
            launch(&[("SLURM_NTASKS", "8"), ("SLURM_PROCID", "0")]),
            None
        );
    }

    #[test]
    fn ranks_split_evenly_over_nodes_or_not_at_all() {
        let layout = Layout::new(6, 1, 3).unwrap();
        assert_eq!((layout.per_node, layout.world_size()), (2, 6));
        assert_eq!(layout.world_rank(1), 3);
        for (workers, nodes) in [(5, 2), (1, 2), (0, 1)] {
            let e = Layout::new(workers, 0, nodes).unwrap_err().to_string();
            assert!(
                e.contains(&format!("--workers {workers} does not split evenly")),
                "{e}"
            );
        }
    }

    #[test]
    fn an_envelope_opens_with_the_header_its_filter_read() {
        let message = Message {
            header: Header::Over { attempt: 3 },
            payload: vec![1, 2, 3],
        };
        let envelope = Envelope::new(1, message.encode().bytes().to_vec());
        let mut wanted = accepting(|from, h| from == 1 && matches!(h, Header::Over { .. }));
        assert!(wanted(&envelope));
        assert!(envelope.header.get().is_some(), "read once, kept");
        assert_eq!(open(envelope), Some((1, message)));
        let garbage = Envelope::new(1, vec![9, 0, 0, 0, 1]);
        assert!(!accepting(|_, _| true)(&garbage));
        assert_eq!(open(garbage), None);
    }

    #[test]
    fn garbage_is_no_launch() {
        assert_eq!(launch(&[("PMI_SIZE", "two")]), None);
    }
}
