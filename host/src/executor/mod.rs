//! Ranks as tasks on a few threads: the executor that polls the ranks'
//! futures.
//!
//! A rank is a future (its call of `train`, which wasmtime runs on a fiber
//! of its own). One thread per rank would be simplest, but when ranks
//! outnumber cores every collective round then costs the operating system
//! a context switch per rank to park the waiters and another to wake them:
//! 16 ranks on 2 cores took 46 µs a round quiet and 340 µs with every core
//! busy. Here at most one thread per core runs the ranks, each thread
//! taking whichever rank is ready next (`pool.rs`): a rank that waits for
//! the others in a collective returns `Pending`, and the thread goes on
//! with the next rank that can run, a switch of fibers instead of threads.
//! A round then wakes one thread per core at most, not one per rank, and it
//! never waits for a thread the operating system has set aside while
//! another thread could run the ranks it woke.
//!
//! Futures tell the executor two things about a wait through
//! [`waiting_briefly`] and [`poll_again_at`]: that it should end within
//! microseconds (the other ranks of a round are on their way), so an idle
//! thread waits actively for a moment before parking (`idle.rs`); and when
//! it must be polled again even if nobody wakes it (a timeout).

mod idle;
mod lane;
mod pool;

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::time::Instant;

pub(crate) use idle::IdleWait;
pub(crate) use pool::Pool;

/// A task's future: `Send`, as any of the executor's threads may poll it,
/// and it may borrow what outlives them.
pub(crate) type TaskFuture<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// How many threads run `tasks` futures: one per core this process may use
/// at most ([`crate::cores`]).
pub(crate) fn threads_for(tasks: usize) -> usize {
    tasks.clamp(1, crate::cores::cores())
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

/// Run `tasks` on `threads` threads, this one among them, until every one
/// has completed; between polls an idle thread waits as `idle` says. A task
/// that panics is dropped and `panicked` is told its id and the panic's
/// message; the others go on. (The host's own runs spawn their threads
/// themselves and use [`Pool`].)
#[cfg(any(test, feature = "bench"))]
pub(crate) fn run<'a, T: Copy + Send + Sync>(
    threads: usize,
    tasks: impl IntoIterator<Item = (T, TaskFuture<'a>)>,
    idle: &'a IdleWait,
    panicked: impl Fn(T, String) + Sync,
) {
    let pool = Pool::new(tasks, threads, idle);
    std::thread::scope(|scope| {
        for _ in 1..threads {
            scope.spawn(|| pool.work(&panicked));
        }
        pool.work(&panicked);
    });
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
pub(crate) fn block_on<F: Future<Output: Send> + Send>(future: F) -> F::Output {
    let mut out = None;
    let task: TaskFuture<'_> = Box::pin(async {
        out = Some(future.await);
    });
    run(1, [((), task)], &IdleWait::new(1), |(), m| panic!("{m}"));
    out.expect("the task completed")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::task::{Poll, Waker};
    use std::time::Duration;

    type Boxed<'a> = TaskFuture<'a>;

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
        run(1, tasks, &idle, |_, m| panic!("{m}"));
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
        run(1, tasks, &idle, |_, m| panic!("{m}"));
        assert!(Instant::now() >= until);
    }

    #[test]
    fn a_panicking_task_is_reported_and_the_others_finish() {
        let idle = IdleWait::new(1);
        let done = AtomicBool::new(false);
        let panics = Mutex::new(Vec::new());
        let tasks: Vec<(u8, Boxed<'_>)> = vec![
            (7, Box::pin(async { panic!("broken") })),
            (
                8,
                Box::pin(async {
                    done.store(true, Ordering::Relaxed);
                }),
            ),
        ];
        run(1, tasks, &idle, |id, m| {
            panics.lock().unwrap().push((id, m))
        });
        assert_eq!(*panics.lock().unwrap(), vec![(7, "broken".to_owned())]);
        assert!(done.load(Ordering::Relaxed));
    }

    #[test]
    fn ready_tasks_go_on_while_one_thread_is_held() {
        // Task 0 holds its thread (as the operating system holds a thread
        // it has set aside) until tasks 1–3, which wait for each other in
        // turn, have all run: the other thread must run all three.
        // Splitting the tasks between the threads would leave one of them
        // behind the held thread.
        for idle in IdleWait::every_way() {
            let (one, two) = (Flag::default(), Flag::default());
            let released = AtomicBool::new(false);
            let held = Mutex::new(None);
            let tasks: Vec<(u8, Boxed<'_>)> = vec![
                (
                    0,
                    Box::pin(async {
                        let since = Instant::now();
                        while !released.load(Ordering::Acquire)
                            && since.elapsed() < Duration::from_secs(10)
                        {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        *held.lock().unwrap() = Some(since.elapsed());
                    }),
                ),
                (
                    1,
                    Box::pin(async {
                        one.wait(true).await;
                        released.store(true, Ordering::Release);
                    }),
                ),
                (
                    2,
                    Box::pin(async {
                        two.wait(true).await;
                        one.set();
                    }),
                ),
                (3, Box::pin(async { two.set() })),
            ];
            run(2, tasks, &idle, |_, m| panic!("{m}"));
            assert!(released.load(Ordering::Acquire));
            let held = held.lock().unwrap().expect("task 0 ran");
            assert!(held < Duration::from_secs(10), "{idle:?}: held {held:?}");
        }
    }

    #[test]
    fn a_task_woken_while_it_is_polled_is_polled_again() {
        // A task that wakes itself before returning `Pending` (as a guest
        // yielding at an epoch tick does) must be polled again, not lost.
        let idle = IdleWait::new(2);
        let polls = AtomicUsize::new(0);
        let tasks: Vec<(u8, Boxed<'_>)> = vec![(
            0,
            Box::pin(std::future::poll_fn(|cx| {
                if polls.fetch_add(1, Ordering::Relaxed) == 1000 {
                    return Poll::Ready(());
                }
                cx.waker().wake_by_ref();
                Poll::Pending
            })),
        )];
        run(2, tasks, &idle, |_, m| panic!("{m}"));
        assert_eq!(polls.load(Ordering::Relaxed), 1001);
    }

    #[test]
    fn the_tasks_of_a_thread_that_never_came_are_run_by_the_others() {
        // A pool for two threads of which only one works (the other could
        // not be started): the missing thread's task, woken while the one
        // thread is parked, must still be run, well before its own
        // deadline would poll it.
        let idle = IdleWait::new(2);
        let flag = Arc::new(Flag::default());
        let remote = Arc::clone(&flag);
        let setter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            remote.set();
        });
        let started = Instant::now();
        let tasks: Vec<(u8, Boxed<'_>)> = vec![
            (0, Box::pin(async {})),
            (
                1,
                Box::pin(async {
                    let limit = started + Duration::from_secs(10);
                    std::future::poll_fn(|cx| {
                        *flag.waker.lock().unwrap() = Some(cx.waker().clone());
                        if flag.set.load(Ordering::Acquire) || Instant::now() >= limit {
                            return Poll::Ready(());
                        }
                        poll_again_at(limit);
                        Poll::Pending
                    })
                    .await;
                }),
            ),
        ];
        Pool::new(tasks, 2, &idle).work(|_, m| panic!("{m}"));
        setter.join().unwrap();
        let took = started.elapsed();
        assert!(took < Duration::from_secs(5), "took {took:?}");
    }
}
