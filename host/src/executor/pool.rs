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

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Polls run under `catch_unwind` outside these locks, so a poisoned
    // lock only means a panic between two plain statements: the data is
    // still whole.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How long a lane may hold ready tasks while its thread begins no poll
/// before another thread that has nothing to do takes them, as that idle
/// thread sees it (the busy threads never read the clock for this). A
/// thread that keeps up begins a poll every microsecond or so (a `report`
/// takes about one); one that has not for this long is in a long poll (a
/// guest computing) or set aside by the operating system for other work,
/// which lasts milliseconds.
const STEAL_AFTER: Duration = Duration::from_micros(5);

/// The ready tasks of one thread (their home: a task runs on its own
/// thread while that thread keeps up, so that its fiber and memory stay in
/// that core's caches).
struct Lane {
    /// Ready tasks, in the order they were queued.
    ready: Mutex<VecDeque<usize>>,
    /// `ready`'s length, read without the lock by idle threads.
    queued: AtomicUsize,
    /// Polls the lane's thread has begun; only that thread writes it.
    polls: AtomicU64,
    /// The thread whose lane this is, once it has called `work`.
    owner: OnceLock<Worker>,
}

impl Lane {
    fn update(&self, ready: &VecDeque<usize>) {
        self.queued.store(ready.len(), Ordering::SeqCst);
    }

    fn pop(&self) -> Option<usize> {
        if self.queued.load(Ordering::SeqCst) == 0 {
            return None;
        }
        let mut ready = lock(&self.ready);
        let task = ready.pop_front();
        self.update(&ready);
        task
    }

    /// Whether another thread should take this lane's tasks now: it holds
    /// some, and its thread has begun no poll for [`STEAL_AFTER`] since
    /// `seen` (what the caller saw of this lane before, or else sees now).
    fn stalled(&self, seen: &mut Option<Seen>, now: Instant) -> bool {
        if self.queued.load(Ordering::SeqCst) == 0 {
            *seen = None;
            return false;
        }
        let polls = self.polls.load(Ordering::Relaxed);
        match seen {
            Some(s) if s.polls == polls => now - s.at >= STEAL_AFTER,
            _ => {
                *seen = Some(Seen { polls, at: now });
                false
            }
        }
    }
}

/// How many polls a lane's thread had begun when an idle thread first saw
/// that count with tasks queued.
#[derive(Clone, Copy)]
struct Seen {
    polls: u64,
    at: Instant,
}

/// A thread taking part, as the queue wakes it.
struct Worker {
    thread: Thread,
    /// Set by the thread before it parks; taken by whoever wakes it.
    asleep: AtomicBool,
}

impl Worker {
    fn wake(&self) {
        if self.asleep.swap(false, Ordering::SeqCst) {
            self.thread.unpark();
        }
    }
}

/// What wakers reach: every task's state and the lanes. `'static`, unlike
/// the tasks' futures, which may borrow.
struct Queue {
    states: Vec<AtomicU8>,
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
        {
            let mut ready = lock(&lane.ready);
            ready.push_back(task);
            lane.update(&ready);
        }
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
        if self
            .lanes
            .iter()
            .all(|l| l.queued.load(Ordering::SeqCst) == 0)
        {
            seen.fill(None);
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
    deadline: Mutex<Option<Instant>>,
}

/// Tasks run by `threads` threads, each of which calls [`Pool::work`];
/// `work` returns once every task has completed. Task `i`'s own thread is
/// the `i % threads`th to call `work`; another thread, idle, takes it from
/// that thread's lane once it has seen the lane hold tasks while that
/// thread began no poll for [`STEAL_AFTER`].
pub(crate) struct Pool<'a, T> {
    tasks: Vec<Task<'a, T>>,
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
        let lanes: Vec<Lane> = (0..threads.max(1))
            .map(|_| Lane {
                ready: Mutex::default(),
                queued: AtomicUsize::new(0),
                polls: AtomicU64::new(0),
                owner: OnceLock::new(),
            })
            .collect();
        let queue = Arc::new(Queue {
            states: (0..n).map(|_| AtomicU8::new(QUEUED)).collect(),
            lanes,
            remaining: AtomicUsize::new(n),
        });
        for i in 0..n {
            queue.push(i);
        }
        let tasks = tasks
            .into_iter()
            .enumerate()
            .map(|(i, (id, future))| Task {
                id,
                future: Mutex::new(Some(future)),
                waker: Waker::from(Arc::new(TaskWaker {
                    task: i,
                    queue: Arc::clone(&queue),
                })),
                brief: AtomicBool::new(false),
                deadline: Mutex::new(None),
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
            let _ = lane.owner.set(Worker {
                thread: std::thread::current(),
                asleep: AtomicBool::new(false),
            });
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
        *lock(&task.deadline) = DEADLINE.with(|d| d.get());
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
        let others_hold = || {
            (0..queue.lanes.len())
                .any(|l| Some(l) != mine && queue.lanes[l].queued.load(Ordering::SeqCst) > 0)
        };
        if others_hold() {
            std::hint::spin_loop();
            return;
        }
        let mine_queued = || mine.is_some_and(|l| queue.lanes[l].queued.load(Ordering::SeqCst) > 0);
        let found =
            || mine_queued() || others_hold() || queue.remaining.load(Ordering::SeqCst) == 0;
        let waiting = |i: usize| queue.states[i].load(Ordering::Acquire) == WAITING;
        if (0..self.tasks.len()).any(|i| waiting(i) && self.tasks[i].brief.load(Ordering::Relaxed))
        {
            self.idle.wait(found);
        }
        let deadline = (0..self.tasks.len())
            .filter(|&i| waiting(i))
            .filter_map(|i| *lock(&self.tasks[i].deadline))
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
                if waiting(i) && lock(&task.deadline).is_some_and(|d| d <= at) {
                    queue.wake(i);
                }
            }
        }
    }
}
