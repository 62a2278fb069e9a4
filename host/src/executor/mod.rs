//! Ranks as tasks on a few threads: the executor that polls the ranks'
//! futures.
//!
//! A rank is a future (its call of `train`, which wasmtime runs on a fiber
//! of its own). One thread per rank would be simplest, but when ranks
//! outnumber cores every collective round then costs the operating system
//! a context switch per rank to park the waiters and another to wake them:
//! 16 ranks on 2 cores took 46 µs a round quiet and 340 µs with every core
//! busy. Here the ranks are spread over at most one thread per core, and a
//! thread runs its ranks in turn: a rank that waits for the others in a
//! collective returns `Pending`, and the thread goes on with the next rank
//! that can run, a switch of fibers instead of threads. A round then wakes
//! one thread per core at most, not one per rank.
//!
//! Futures tell the executor two things about a wait through
//! [`waiting_briefly`] and [`poll_again_at`]: that it should end within
//! microseconds (the other ranks of a round are on their way), so an idle
//! thread waits actively for a moment before parking (`idle.rs`); and when
//! it must be polled again even if nobody wakes it (a timeout).

mod idle;

use std::cell::Cell;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::Instant;

pub(crate) use idle::IdleWait;

/// The cores this process may use, read once: `available_parallelism`
/// reads the cgroup's limits from files each time it is called, which
/// costs more than a small collective.
pub(crate) fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, usize::from))
}

/// A task's future: polled on the thread that made it, so it need not be
/// `Send`, and it may borrow what outlives the executor's threads.
pub(crate) type LocalFuture<'a> = Pin<Box<dyn Future<Output = ()> + 'a>>;

/// How many threads run `tasks` futures: one per core at most.
pub(crate) fn threads_for(tasks: usize) -> usize {
    tasks.clamp(1, cores())
}

thread_local! {
    /// Set by the future being polled: its wait should end soon.
    static BRIEF: Cell<bool> = const { Cell::new(false) };
    /// Set by the future being polled: poll it again by then.
    static DEADLINE: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// Called by a future about to return `Pending` for a wait that should end
/// within microseconds (see [`IdleWait`]). Outside the executor it does
/// nothing.
pub(crate) fn waiting_briefly() {
    BRIEF.with(|b| b.set(true));
}

/// Called by a future about to return `Pending`: poll it again at `when`
/// even if it is not woken (its timeout). Outside the executor it does
/// nothing; such a caller must arrange its own wake-up.
pub(crate) fn poll_again_at(when: Instant) {
    DEADLINE.with(|d| d.set(Some(d.get().map_or(when, |t| t.min(when)))));
}

/// Wakes a thread of the executor: set when any of its tasks is woken.
struct Notify {
    thread: Thread,
    woken: AtomicBool,
}

/// One task's waker.
struct TaskWaker {
    ready: AtomicBool,
    notify: Arc<Notify>,
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.ready.store(true, Ordering::Release);
        self.notify.woken.store(true, Ordering::Release);
        // Cheap unless the thread is parked: then it is the one syscall.
        self.notify.thread.unpark();
    }
}

struct Task<'a, T> {
    id: T,
    future: LocalFuture<'a>,
    waker: Arc<TaskWaker>,
    /// What its last `Pending` said about the wait.
    brief: bool,
    deadline: Option<Instant>,
}

/// Poll `tasks` on this thread until every one has completed. A task that
/// panics is dropped and `panicked` is told its id and the panic's message;
/// the others go on. Between polls, an idle thread waits as `idle` says.
pub(crate) fn run<'a, T: Copy>(
    tasks: impl IntoIterator<Item = (T, LocalFuture<'a>)>,
    idle: &IdleWait,
    mut panicked: impl FnMut(T, String),
) {
    let notify = Arc::new(Notify {
        thread: std::thread::current(),
        woken: AtomicBool::new(false),
    });
    let mut tasks: Vec<Task<'a, T>> = tasks
        .into_iter()
        .map(|(id, future)| Task {
            id,
            future,
            waker: Arc::new(TaskWaker {
                ready: AtomicBool::new(true),
                notify: Arc::clone(&notify),
            }),
            brief: false,
            deadline: None,
        })
        .collect();
    while !tasks.is_empty() {
        notify.woken.store(false, Ordering::Release);
        let mut polled = false;
        let mut i = 0;
        while i < tasks.len() {
            let task = &mut tasks[i];
            if !task.waker.ready.swap(false, Ordering::AcqRel) {
                i += 1;
                continue;
            }
            polled = true;
            BRIEF.with(|b| b.set(false));
            DEADLINE.with(|d| d.set(None));
            let waker = Waker::from(Arc::clone(&task.waker));
            let mut cx = Context::from_waker(&waker);
            let poll =
                std::panic::catch_unwind(AssertUnwindSafe(|| task.future.as_mut().poll(&mut cx)));
            task.brief = BRIEF.with(Cell::get);
            task.deadline = DEADLINE.with(Cell::get);
            match poll {
                Ok(Poll::Pending) => i += 1,
                Ok(Poll::Ready(())) => {
                    tasks.swap_remove(i);
                }
                Err(payload) => {
                    let id = task.id;
                    tasks.swap_remove(i);
                    panicked(id, panic_message(payload.as_ref()));
                }
            }
        }
        if polled || notify.woken.load(Ordering::Acquire) {
            continue;
        }
        // Idle: every task waits.
        if tasks.iter().any(|t| t.brief) {
            idle.wait(|| notify.woken.load(Ordering::Acquire));
        }
        let deadline = tasks.iter().filter_map(|t| t.deadline).min();
        // A wake-up may be spurious: the flags say what happened.
        if !notify.woken.load(Ordering::Acquire) {
            match deadline {
                Some(at) => std::thread::park_timeout(at.saturating_duration_since(Instant::now())),
                None => std::thread::park(),
            }
        }
        if let Some(at) = deadline
            && Instant::now() >= at
        {
            for task in tasks.iter().filter(|t| t.deadline.is_some_and(|d| d <= at)) {
                task.waker.ready.store(true, Ordering::Release);
            }
        }
    }
}

/// The text of a panic's payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panicked".to_owned())
}

/// Run `future` to completion on this thread as the executor's only task,
/// for tests of futures that rely on [`poll_again_at`].
#[cfg(test)]
pub(crate) fn block_on<F: Future>(future: F) -> F::Output {
    let mut out = None;
    let task: LocalFuture<'_> = Box::pin(async {
        out = Some(future.await);
    });
    run([((), task)], &IdleWait::new(1), |(), m| panic!("{m}"));
    out.expect("the task completed")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::time::Duration;

    type Boxed<'a> = LocalFuture<'a>;

    /// A future pending until its flag is set by anyone, waking through
    /// the stored waker.
    #[derive(Default)]
    struct Flag {
        set: AtomicBool,
        waker: Mutex<Option<Waker>>,
    }

    impl Flag {
        fn set(&self) {
            self.set.store(true, Ordering::Release);
            if let Some(w) = self.waker.lock().unwrap().take() {
                w.wake();
            }
        }

        async fn wait(&self, brief: bool) {
            std::future::poll_fn(|cx| {
                *self.waker.lock().unwrap() = Some(cx.waker().clone());
                if self.set.load(Ordering::Acquire) {
                    return Poll::Ready(());
                }
                if brief {
                    waiting_briefly();
                }
                Poll::Pending
            })
            .await
        }
    }

    #[test]
    fn tasks_on_one_thread_wait_for_each_other_and_for_other_threads() {
        // Task 0 waits for task 1 on the same thread, which waits for a
        // flag another thread sets: only cooperative waiting gets through.
        let idle = IdleWait::new(2);
        let first = Flag::default();
        let second = Arc::new(Flag::default());
        let order = Mutex::new(Vec::new());
        let remote = Arc::clone(&second);
        let setter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            remote.set();
        });
        let tasks: Vec<(usize, Boxed<'_>)> = vec![
            (
                0,
                Box::pin(async {
                    first.wait(true).await;
                    order.lock().unwrap().push(0);
                }),
            ),
            (
                1,
                Box::pin(async {
                    second.wait(false).await;
                    order.lock().unwrap().push(1);
                    first.set();
                }),
            ),
        ];
        run(tasks, &idle, |_, m| panic!("{m}"));
        setter.join().unwrap();
        assert_eq!(*order.lock().unwrap(), vec![1, 0]);
    }

    #[test]
    fn a_deadline_polls_a_task_nobody_wakes() {
        let idle = IdleWait::new(1);
        let until = Instant::now() + Duration::from_millis(30);
        let tasks: Vec<(u8, Boxed<'_>)> = vec![(
            0,
            Box::pin(std::future::poll_fn(|_| {
                if Instant::now() >= until {
                    return Poll::Ready(());
                }
                poll_again_at(until);
                Poll::Pending
            })),
        )];
        run(tasks, &idle, |_, m| panic!("{m}"));
        assert!(Instant::now() >= until);
    }

    #[test]
    fn a_panicking_task_is_reported_and_the_others_finish() {
        let idle = IdleWait::new(1);
        let done = AtomicBool::new(false);
        let mut panics = Vec::new();
        let tasks: Vec<(u8, Boxed<'_>)> = vec![
            (7, Box::pin(async { panic!("broken") })),
            (
                8,
                Box::pin(async {
                    done.store(true, Ordering::Relaxed);
                }),
            ),
        ];
        run(tasks, &idle, |id, m| panics.push((id, m)));
        assert_eq!(panics, vec![(7, "broken".to_owned())]);
        assert!(done.load(Ordering::Relaxed));
    }
}
