//! The tasks of one executor and the queue of those ready to run, shared
//! by its threads.
//!
//! Any thread runs any ready task. A round of a collective then never waits
//! for one particular thread: when the machine is busy and the operating
//! system has set one of the executor's threads aside to run other work,
//! the threads still running go on with every rank the round woke, instead
//! of each waiting for the ranks that live on the thread set aside. A task
//! is polled by one thread at a time; its state says whether it is waiting,
//! queued, being polled (and whether it was woken meanwhile), or done.
//!
//! What one thread writes often and another reads lies on cache lines of
//! its own ([`CachePadded`]): a task's state and waker here, a lane's
//! queue, flag and poll count (`lane.rs`). Packed together, two threads
//! polling neighbouring tasks moved a line between cores at every poll.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use super::lane::{Lane, STEAL_AFTER, Seen, Worker, lock};
use super::{BRIEF, DEADLINE, IdleWait, TaskFuture, panic_message};

/// Waiting for a wake-up.
const WAITING: u8 = 0;
/// In the queue.
const QUEUED: u8 = 1;
/// Being polled by a thread.
const POLLING: u8 = 2;
/// Woken while being polled: queued again once that poll returns.
const WOKEN: u8 = 3;
/// Completed (or panicked).
const DONE: u8 = 4;

/// What wakers reach: every task's state and the lanes. `'static`, unlike
/// the tasks' futures, which may borrow.
struct Queue {
    states: Vec<CachePadded<AtomicU8>>,
    lanes: Vec<Lane>,
    /// Tasks not yet completed.
    remaining: AtomicUsize,
}

impl Queue {
    fn home(&self, task: usize) -> &Lane {
        &self.lanes[task % self.lanes.len()]
    }

    /// Queue `task` on its home lane and wake that lane's thread if it is
    /// parked or about to park. A thread that is busy polling needs no
    /// call: it looks at its lane when its poll returns.
    fn push(&self, task: usize) {
        let lane = self.home(task);
        lane.push(task);
        match lane.owner.get() {
            Some(owner) => owner.wake(),
            // Its thread never came (it could not be started): any thread
            // takes the lane's tasks, once one is awake.
            None => {
                for owner in self.lanes.iter().filter_map(|l| l.owner.get()) {
                    owner.wake();
                }
            }
        }
    }

    /// A task of a lane whose thread has not taken it for [`STEAL_AFTER`],
    /// by what the calling thread has `seen` of each lane.
    fn steal(&self, mine: Option<usize>, seen: &mut [Option<Seen>]) -> Option<usize> {
        if !self.lanes.iter().any(Lane::holds) {
            seen.iter_mut().for_each(Seen::forget_unless_stalled);
            return None;
        }
        let now = Instant::now();
        (0..self.lanes.len())
            .filter(|&l| Some(l) != mine && self.lanes[l].stalled(&mut seen[l], now))
            .find_map(|l| self.lanes[l].pop())
    }

    fn wake_all(&self) {
        for lane in &self.lanes {
            if let Some(owner) = lane.owner.get() {
                owner.asleep.store(false, Ordering::SeqCst);
                owner.thread.unpark();
            }
        }
    }

    /// Task `task` was woken: queue it, or have its poll requeue it.
    fn wake(&self, task: usize) {
        let state = &self.states[task];
        let mut seen = state.load(Ordering::Acquire);
        loop {
            let next = match seen {
                WAITING => QUEUED,
                POLLING => WOKEN,
                _ => return,
            };
            match state.compare_exchange_weak(seen, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) if next == QUEUED => return self.push(task),
                Ok(_) => return,
                Err(now) => seen = now,
            }
        }
    }
}

/// A task's waker. Each wait that registers it takes a reference and each
/// wake-up drops one, so its count is written every round: aligned to a
/// cache line, the wakers of tasks on different threads never share one.
#[repr(align(128))]
struct TaskWaker {
    task: usize,
    queue: Arc<Queue>,
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.queue.wake(self.task);
    }
}

/// One task: its future (taken by the thread polling it) and what its last
/// `Pending` said about the wait.
struct Task<'a, T> {
    id: T,
    future: Mutex<Option<TaskFuture<'a>>>,
    waker: Waker,
    brief: AtomicBool,
    deadline: Deadline,
}

/// When a waiting task must be polled again, if ever: read by idle threads
/// without a lock (a lock would take the line from the thread that polls
/// the task).
struct Deadline {
    /// Nanoseconds after `epoch`, plus one; 0 for none.
    at: AtomicU64,
    epoch: Instant,
}

impl Deadline {
    fn new(epoch: Instant) -> Self {
        Self {
            at: AtomicU64::new(0),
            epoch,
        }
    }

    fn set(&self, at: Option<Instant>) {
        let nanos = at.map_or(0, |at| {
            let after = at.saturating_duration_since(self.epoch).as_nanos();
            u64::try_from(after).unwrap_or(u64::MAX - 1) + 1
        });
        self.at.store(nanos, Ordering::Relaxed);
    }

    fn get(&self) -> Option<Instant> {
        match self.at.load(Ordering::Relaxed) {
            0 => None,
            nanos => Some(self.epoch + Duration::from_nanos(nanos - 1)),
        }
    }
}

/// Tasks run by `threads` threads, each of which calls [`Pool::work`];
/// `work` returns once every task has completed. Task `i`'s own thread is
/// the `i % threads`th to call `work`; another thread, idle, takes it from
/// that thread's lane once it has seen the lane hold tasks while that
/// thread began no poll for [`STEAL_AFTER`].
pub(crate) struct Pool<'a, T> {
    tasks: Vec<CachePadded<Task<'a, T>>>,
    queue: Arc<Queue>,
    idle: &'a IdleWait,
    /// Threads that have called `work`, to give each its lane.
    joined: AtomicUsize,
}

impl<'a, T: Copy> Pool<'a, T> {
    /// A pool of `tasks` for `threads` threads, every task ready to be
    /// polled; idle threads wait as `idle` says.
    pub fn new(
        tasks: impl IntoIterator<Item = (T, TaskFuture<'a>)>,
        threads: usize,
        idle: &'a IdleWait,
    ) -> Self {
        let tasks: Vec<(T, TaskFuture<'a>)> = tasks.into_iter().collect();
        let n = tasks.len();
        let lanes: Vec<Lane> = (0..threads.max(1)).map(|_| Lane::new()).collect();
        let queue = Arc::new(Queue {
            states: (0..n)
                .map(|_| CachePadded::new(AtomicU8::new(QUEUED)))
                .collect(),
            lanes,
            remaining: AtomicUsize::new(n),
        });
        for i in 0..n {
            queue.push(i);
        }
        let epoch = Instant::now();
        let tasks = tasks
            .into_iter()
            .enumerate()
            .map(|(i, (id, future))| {
                CachePadded::new(Task {
                    id,
                    future: Mutex::new(Some(future)),
                    waker: Waker::from(Arc::new(TaskWaker {
                        task: i,
                        queue: Arc::clone(&queue),
                    })),
                    brief: AtomicBool::new(false),
                    deadline: Deadline::new(epoch),
                })
            })
            .collect();
        Self {
            tasks,
            queue,
            idle,
            joined: AtomicUsize::new(0),
        }
    }

    /// Run tasks on this thread until every task has completed. A task that
    /// panics is dropped and `panicked` is told its id and the panic's
    /// message; the others go on.
    pub fn work(&self, mut panicked: impl FnMut(T, String)) {
        let queue = &self.queue;
        let index = self.joined.fetch_add(1, Ordering::SeqCst);
        // A thread beyond the lanes only takes stalled tasks.
        let mine = (index < queue.lanes.len()).then_some(index);
        let lane = mine.map(|l| &queue.lanes[l]);
        if let Some(lane) = lane {
            let _ = lane.owner.set(CachePadded::new(Worker {
                thread: std::thread::current(),
                asleep: AtomicBool::new(false),
            }));
        }
        let mut seen = vec![None; queue.lanes.len()];
        while queue.remaining.load(Ordering::SeqCst) > 0 {
            if let Some(task) = lane
                .and_then(Lane::pop)
                .or_else(|| queue.steal(mine, &mut seen))
            {
                if let Some(lane) = lane {
                    // Only this thread writes it: no atomic increment.
                    let polls = lane.polls.load(Ordering::Relaxed);
                    lane.polls.store(polls + 1, Ordering::Relaxed);
                }
                self.poll(task, &mut panicked);
                continue;
            }
            self.wait(mine);
        }
    }

    /// Poll task `i`, which this thread took off a lane.
    fn poll(&self, i: usize, panicked: &mut impl FnMut(T, String)) {
        let task = &self.tasks[i];
        let state = &self.queue.states[i];
        state.store(POLLING, Ordering::Release);
        let mut slot = lock(&task.future);
        let Some(future) = slot.as_mut() else {
            return;
        };
        BRIEF.with(|b| b.set(false));
        DEADLINE.with(|d| d.set(None));
        let mut cx = Context::from_waker(&task.waker);
        let poll = std::panic::catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(&mut cx)));
        task.brief.store(BRIEF.with(|b| b.get()), Ordering::Relaxed);
        task.deadline.set(DEADLINE.with(|d| d.get()));
        let ended = match poll {
            Ok(Poll::Pending) => None,
            Ok(Poll::Ready(())) => Some(None),
            Err(payload) => Some(Some(panic_message(payload.as_ref()))),
        };
        let Some(panic) = ended else {
            drop(slot);
            // Woken during the poll: back to the end of its lane, so that
            // a task that keeps waking itself lets the others run.
            if state
                .compare_exchange(POLLING, WAITING, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                state.store(QUEUED, Ordering::Release);
                self.queue.push(i);
            }
            return;
        };
        *slot = None;
        drop(slot);
        state.store(DONE, Ordering::Release);
        if let Some(message) = panic {
            panicked(task.id, message);
        }
        if self.queue.remaining.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.queue.wake_all();
        }
    }

    /// Nothing to take now. While another lane holds tasks (which will
    /// stall unless their thread takes them), look again; else spin for a
    /// moment if a waiting task said its wait is brief, then park until
    /// woken or until the first waiting task's deadline, and queue the
    /// tasks whose deadline has passed.
    fn wait(&self, mine: Option<usize>) {
        let queue = &self.queue;
        let others_hold =
            || (0..queue.lanes.len()).any(|l| Some(l) != mine && queue.lanes[l].holds());
        if others_hold() {
            std::hint::spin_loop();
            return;
        }
        let mine_queued = || mine.is_some_and(|l| queue.lanes[l].holds());
        let found =
            || mine_queued() || others_hold() || queue.remaining.load(Ordering::SeqCst) == 0;
        let waiting = |i: usize| queue.states[i].load(Ordering::Acquire) == WAITING;
        if (0..self.tasks.len()).any(|i| waiting(i) && self.tasks[i].brief.load(Ordering::Relaxed))
        {
            self.idle.wait(found);
        }
        let deadline = (0..self.tasks.len())
            .filter(|&i| waiting(i))
            .filter_map(|i| self.tasks[i].deadline.get())
            .min();
        // Asleep first, then look: a task queued after the look finds the
        // flag set and unparks this thread (a wake-up before the park is
        // not lost: `park` returns at once). A thread beyond the lanes is
        // never unparked: it looks again every `STEAL_AFTER`.
        let owner = mine.and_then(|l| queue.lanes[l].owner.get());
        if let Some(owner) = owner {
            owner.asleep.store(true, Ordering::SeqCst);
        }
        if !found() {
            let timeout = match (deadline, owner) {
                (Some(at), _) => Some(at.saturating_duration_since(Instant::now())),
                (None, None) => Some(STEAL_AFTER),
                (None, Some(_)) => None,
            };
            match timeout {
                Some(t) => std::thread::park_timeout(t),
                None => std::thread::park(),
            }
        }
        if let Some(owner) = owner {
            owner.asleep.store(false, Ordering::SeqCst);
        }
        if let Some(at) = deadline
            && Instant::now() >= at
        {
            for (i, task) in self.tasks.iter().enumerate() {
                if waiting(i) && task.deadline.get().is_some_and(|d| d <= at) {
                    queue.wake(i);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_reads_back_as_set() {
        let epoch = Instant::now();
        let deadline = Deadline::new(epoch);
        assert_eq!(deadline.get(), None);
        for at in [
            epoch,
            epoch + Duration::from_nanos(1),
            epoch + Duration::from_secs(3600),
        ] {
            deadline.set(Some(at));
            assert_eq!(deadline.get(), Some(at));
        }
        deadline.set(None);
        assert_eq!(deadline.get(), None);
    }
}
