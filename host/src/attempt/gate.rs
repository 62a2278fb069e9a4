//! The gate: makes `report` and the collectives collective (R6, R29).
//!
//! The k-th collective calls of all ranks (`report` or a call of the
//! `collective` interface) form round k. Each rank's call waits here until
//! every rank's k-th call has arrived; the last to arrive becomes the
//! leader, runs the round (persists and commits a report, matches and sets
//! up an exchange) while the others wait, and then everyone returns the
//! same outcome. Ranks that disagree on the number of calls fail the run
//! with an error naming them: at once when one rank has already returned
//! from `train`, else after the report timeout. Whether the calls of a
//! round agree with each other is for the leader to say.
//!
//! Waiting is built for many short rounds: a rank waits as a future, so a
//! thread running several ranks goes on with the next one (see
//! `crate::executor`), and the leader wakes exactly the waiting ranks once
//! the outcome is stored. A waiter tells the executor that its wait should
//! be brief (the others are on their way), and when its timeout falls: the
//! report timeout after the round's first arrival. A rank's call takes the
//! lock once, to arrive; it reads the outcome without the lock (each lock
//! moves the lock's cache line to the core that takes it, and on a machine
//! whose cores are far apart a round of 16 ranks paid tens of such moves).
//! It reads no clock unless it is the round's first, and keeps its waker
//! from round to round.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::executor;

/// A rank must stop: the run is failing (the failure is recorded where it
/// happened).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Aborted;

/// What an arrival is, for messages: "report", "barrier", ...
pub(crate) trait Describe {
    fn describe(&self) -> String;
}

/// Every rank's arrival for one round, by rank.
pub(crate) struct Gathered<A> {
    pub arrivals: Vec<A>,
}

struct State<A> {
    /// The round being gathered (the number of completed rounds).
    round: u64,
    arrivals: Vec<Option<A>>,
    arrived: usize,
    /// All ranks arrived; the leader is processing the round.
    closed: bool,
    /// When the round's first rank arrived: its timeout counts from then.
    started: Option<Instant>,
    /// Per rank: the number of rounds it returned from `train` after.
    finished: Vec<Option<u64>>,
    aborted: bool,
    /// The ranks waiting for the current round (or for an abort), by rank.
    waiting: Vec<bool>,
    /// Each rank's last waker, kept across rounds: a rank's task keeps its
    /// waker, and a clone per round would cost a reference count written
    /// on one core and dropped on another.
    wakers: Vec<Option<Waker>>,
}

impl<A> State<A> {
    /// Mark the run as failing and wake every waiting rank.
    fn abort(&mut self) {
        self.aborted = true;
        self.wake_waiting();
    }

    /// Wake the waiting ranks. Under the lock: a waker only queues its
    /// task, and the ranks it wakes find the outcome stored.
    fn wake_waiting(&mut self) {
        for (waiting, waker) in self.waiting.iter_mut().zip(&self.wakers) {
            if std::mem::take(waiting)
                && let Some(waker) = waker
            {
                waker.wake_by_ref();
            }
        }
    }
}

/// A reusable barrier for `world_size` ranks that hands the leader every
/// rank's arrival.
pub(crate) struct ReportGate<A, O> {
    world_size: usize,
    /// The run's rank of this gate's rank 0, for messages: in a run over
    /// several hosts a node's gate holds its own ranks only.
    first: usize,
    timeout: Duration,
    state: Mutex<State<A>>,
    /// The last completed round's outcome.
    published: Published<O>,
}

/// The outcome of the last completed round, which its waiting ranks read
/// without the gate's lock. Ranks read it before they can call again, and
/// a round cannot complete without every rank, so one slot is enough: the
/// next round's leader writes it only once every rank has arrived again,
/// that is, once every rank has read it.
struct Published<O> {
    /// Rounds completed; `outcome` holds the last one's.
    rounds: AtomicU64,
    outcome: UnsafeCell<Option<O>>,
}

// SAFETY: the outcome is written by one thread at a time (the leader, under
// the gate's lock) and only while no rank reads it (see `publish`); readers
// only clone it through a shared reference.
unsafe impl<O: Send + Sync> Sync for Published<O> {}

impl<O: Clone> Published<O> {
    fn new() -> Self {
        Self {
            rounds: AtomicU64::new(0),
            outcome: UnsafeCell::new(None),
        }
    }

    /// Store round `round`'s outcome and count the round completed.
    ///
    /// # Safety
    ///
    /// The caller holds the gate's lock and every rank has arrived for
    /// `round`: each rank that waited for the round before has read its
    /// outcome before arriving again, and none reads this one yet.
    unsafe fn publish(&self, round: u64, outcome: O) {
        // SAFETY: no reader and no other writer, by the contract above.
        unsafe { *self.outcome.get() = Some(outcome) };
        self.rounds.store(round + 1, Ordering::Release);
    }

    /// Round `round`'s outcome, once it is published; for a rank that
    /// arrived for `round` and has not arrived again.
    fn read(&self, round: u64) -> Option<O> {
        if self.rounds.load(Ordering::Acquire) != round + 1 {
            return None;
        }
        // SAFETY: the write happened before the release store this load
        // acquired, and the next write waits for this rank's next arrival.
        unsafe { (*self.outcome.get()).clone() }
    }
}

impl<A, O> std::fmt::Debug for ReportGate<A, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReportGate")
            .field("world_size", &self.world_size)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// What the gate tells its caller when ranks broke the protocol (R6); the
/// caller fails the run with it. The text names the ranks and what each
/// did.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("collective protocol violation: {0}")]
pub(crate) struct Violation(String);

impl Violation {
    pub fn new(message: String) -> Self {
        Self(message)
    }

    /// The message without the prefix the display adds.
    pub fn message(&self) -> &str {
        &self.0
    }
}

impl<A: Describe, O: Clone> ReportGate<A, O> {
    pub fn new(world_size: usize, timeout: Duration) -> Self {
        Self {
            world_size,
            first: 0,
            timeout,
            state: Mutex::new(State {
                round: 0,
                arrivals: (0..world_size).map(|_| None).collect(),
                arrived: 0,
                closed: false,
                started: None,
                finished: vec![None; world_size],
                aborted: false,
                waiting: vec![false; world_size],
                wakers: (0..world_size).map(|_| None).collect(),
            }),
            published: Published::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<A>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Arrive with `arrival` for this rank's next collective call and wait
    /// for the round's outcome. The last rank to arrive runs `lead` on everyone's
    /// arrivals (without holding the lock) and its result is every rank's
    /// outcome.
    ///
    /// Returns `Err(Ok(violation))` when this call broke the protocol (the
    /// caller fails the run), `Err(Err(Aborted))` when the run is failing
    /// for another reason.
    ///
    /// A plain function returning the waiting future, not an `async fn`:
    /// that would keep `arrival` and `lead` in its state beside the future
    /// they move into, and each report's future is boxed by the bindings
    /// (see `crate::runtime::session`).
    pub fn arrive<L: FnOnce(Gathered<A>) -> O>(
        &self,
        rank: usize,
        arrival: A,
        lead: L,
    ) -> impl Future<Output = Result<O, Result<Violation, Aborted>>> + use<'_, A, O, L> {
        let mut arriving = Some((arrival, lead));
        let mut round = 0;
        std::future::poll_fn(move |cx| {
            // Woken by the leader: the outcome is there, no lock needed.
            if arriving.is_none()
                && let Some(outcome) = self.published.read(round)
            {
                return Poll::Ready(Ok(outcome));
            }
            let st = self.lock();
            let (st, arrived) = match arriving.take() {
                Some((arrival, lead)) => match self.enter(st, rank, arrival, lead) {
                    Entered::Done(result) => return Poll::Ready(result),
                    Entered::Waiting { round: r, st } => {
                        round = r;
                        (st, true)
                    }
                },
                None => (st, false),
            };
            self.wait(st, rank, round, arrived, cx)
        })
    }

    /// The part of [`Self::arrive`] that does not wait: the arrival, and
    /// the round if this rank is the last to arrive.
    fn enter<'g>(
        &'g self,
        mut st: MutexGuard<'g, State<A>>,
        rank: usize,
        arrival: A,
        lead: impl FnOnce(Gathered<A>) -> O,
    ) -> Entered<'g, A, O> {
        if st.aborted {
            return Entered::Done(Err(Err(Aborted)));
        }
        let round = st.round;
        // A rank that has returned from `train` will never make this call.
        let gone: Vec<String> = st
            .finished
            .iter()
            .enumerate()
            .filter_map(|(r, n)| n.filter(|n| *n <= round).map(|n| (r, n)))
            .map(|(r, n)| {
                let r = r + self.first;
                format!("rank {r} returned from train after {n} collective calls")
            })
            .collect();
        if !gone.is_empty() {
            st.abort();
            return Entered::Done(Err(Ok(Violation(format!(
                "rank {} called {} as its {} collective call, but {}; {SAME_CALLS}",
                rank + self.first,
                arrival.describe(),
                ordinal(round + 1),
                gone.join(", ")
            )))));
        }
        debug_assert!(st.arrivals[rank].is_none(), "rank {rank} arrived twice");
        st.arrivals[rank] = Some(arrival);
        st.arrived += 1;

        if st.arrived == self.world_size {
            st.closed = true;
            let arrivals = st
                .arrivals
                .iter_mut()
                .map(|a| a.take().expect("all arrived"))
                .collect();
            drop(st);
            let outcome = lead(Gathered { arrivals });
            let mut st = self.lock();
            // SAFETY: under the lock, and every rank arrived for `round`.
            unsafe { self.published.publish(round, outcome.clone()) };
            st.round += 1;
            st.arrived = 0;
            st.closed = false;
            st.started = None;
            st.wake_waiting();
            return Entered::Done(Ok(outcome));
        }
        if st.arrived == 1 {
            st.started = Some(Instant::now());
        }
        Entered::Waiting { round, st }
    }

    /// One look at `round`, which `rank` arrived for (`arrived`: just
    /// now): its outcome, or the rank waits (and the round times out once
    /// the report timeout has passed since its first arrival).
    fn wait(
        &self,
        mut st: MutexGuard<'_, State<A>>,
        rank: usize,
        round: u64,
        arrived: bool,
        cx: &mut Context<'_>,
    ) -> Poll<Result<O, Result<Violation, Aborted>>> {
        // A completed round's outcome stands even if the run began
        // stopping since: a mismatch the leader found is told to every
        // rank of the round.
        if let Some(outcome) = self.published.read(round) {
            return Poll::Ready(Ok(outcome));
        }
        if st.aborted {
            return Poll::Ready(Err(Err(Aborted)));
        }
        // An arrival reads no clock: the round's others have not timed it
        // out, so its deadline has not passed.
        let deadline = st.started.map(|at| at + self.timeout);
        if !arrived
            && !st.closed
            && let Some(at) = deadline
            && Instant::now() >= at
        {
            let (came, missing): (Vec<usize>, Vec<usize>) =
                (0..self.world_size).partition(|r| st.arrivals[*r].is_some());
            let (came, missing) = (self.shown(came), self.shown(missing));
            let what = self.calls(&st);
            st.abort();
            return Poll::Ready(Err(Ok(Violation(format!(
                "ranks {came:?} waited {} in their {} collective call ({}) for ranks {missing:?}, which did not arrive; {SAME_CALLS} (raise the report timeout if a step can take longer)",
                humantime::format_duration(self.timeout),
                ordinal(round + 1),
                what,
            )))));
        }
        st.waiting[rank] = true;
        match &mut st.wakers[rank] {
            Some(w) if w.will_wake(cx.waker()) => {}
            slot => *slot = Some(cx.waker().clone()),
        }
        // The others are on their way, or the leader is recording,
        // which takes microseconds without a checkpoint (the idle wait
        // learns when it does not). Once the round is closed the leader
        // has its own storage timeouts, so wait without a deadline.
        executor::waiting_briefly();
        if !st.closed
            && let Some(at) = deadline
        {
            executor::poll_again_at(at);
        }
        Poll::Pending
    }

    /// Name ranks in messages from `first` on: the gate of a node whose
    /// first rank is the run's rank `first`.
    pub fn numbered_from(mut self, first: usize) -> Self {
        self.first = first;
        self
    }

    /// The ranks `local` as the run numbers them.
    fn shown(&self, local: impl IntoIterator<Item = usize>) -> Vec<usize> {
        local.into_iter().map(|r| r + self.first).collect()
    }

    /// How long a rank waits for the others.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The number of completed rounds.
    pub fn rounds(&self) -> u64 {
        self.lock().round
    }

    /// What the ranks waiting in the current round called.
    fn calls(&self, st: &State<A>) -> String {
        let mut calls: Vec<String> = st.arrivals.iter().flatten().map(A::describe).collect();
        calls.dedup();
        calls.join(", ")
    }

    /// Note that `rank` returned from `train`. Returns a violation if ranks
    /// are waiting for a collective call it will never make.
    pub fn finish(&self, rank: usize) -> Result<(), Violation> {
        let mut st = self.lock();
        // Every round before the current one completed with this rank, and
        // it is not in the current one: that is how many calls it made.
        let calls = st.round;
        st.finished[rank] = Some(calls);
        if st.aborted || st.arrived == 0 {
            return Ok(());
        }
        let waiting = self.shown((0..self.world_size).filter(|r| st.arrivals[*r].is_some()));
        let round = st.round;
        let what = self.calls(&st);
        st.abort();
        drop(st);
        Err(Violation(format!(
            "rank {} returned from train after {calls} collective calls while ranks {waiting:?} wait in their {} ({what}); {SAME_CALLS}",
            rank + self.first,
            ordinal(round + 1)
        )))
    }

    /// Wake every waiting rank with [`Aborted`]; later arrivals get it too.
    pub fn abort(&self) {
        self.lock().abort();
    }
}

/// What a rank's arrival came to at once.
enum Entered<'g, A, O> {
    /// The call's result: this rank led the round, or may not take part.
    Done(Result<O, Result<Violation, Aborted>>),
    /// The round is waiting for other ranks; the lock is still held.
    Waiting {
        round: u64,
        st: MutexGuard<'g, State<A>>,
    },
}

/// The rule every protocol violation ends with.
const SAME_CALLS: &str = "every rank must make the same collective calls (report and the calls of `collective`) in the same order";

pub(super) fn ordinal(n: u64) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

#[cfg(test)]
#[path = "gate_tests.rs"]
mod tests;
