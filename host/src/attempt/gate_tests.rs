//! Tests of the gate (`gate.rs`).

use super::*;
use crate::executor::IdleWait;
use crate::executor::block_on;
use std::sync::Arc;

impl Describe for u32 {
    fn describe(&self) -> String {
        format!("call {self}")
    }
}

fn gate(n: usize, timeout_ms: u64) -> Arc<ReportGate<u32, u32>> {
    Arc::new(ReportGate::new(n, Duration::from_millis(timeout_ms)))
}

#[test]
fn every_rank_gets_the_leaders_outcome() {
    let g = gate(4, 10_000);
    let handles: Vec<_> = (0..4)
        .map(|r| {
            let g = Arc::clone(&g);
            std::thread::spawn(move || {
                (0..3)
                    .map(|_| {
                        block_on(g.arrive(r, r as u32, |gathered| {
                            gathered.arrivals.iter().sum::<u32>()
                        }))
                        .unwrap()
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), vec![6, 6, 6]);
    }
}

#[test]
fn every_way_of_waiting_hands_out_every_round() {
    // 6 ranks on 2 executor threads, as ranks outnumbering cores run.
    for idle in IdleWait::every_way() {
        let g = ReportGate::<u32, u32>::new(6, Duration::from_secs(60));
        let results: Vec<Mutex<Vec<u32>>> = (0..6).map(|_| Mutex::default()).collect();
        let tasks = (0..6).map(|r| {
            let (g, results) = (&g, &results);
            let task: executor::TaskFuture<'_> = Box::pin(async move {
                for i in 0..300u32 {
                    let sum = g
                        .arrive(r, i * 10 + r as u32, |gathered| {
                            gathered.arrivals.iter().sum::<u32>()
                        })
                        .await
                        .unwrap();
                    results[r].lock().unwrap().push(sum);
                }
            });
            (r, task)
        });
        executor::run(2, tasks, &idle, |r, m| panic!("rank {r}: {m}"));
        let expected: Vec<u32> = (0..300u32).map(|i| i * 60 + 15).collect();
        for r in results {
            assert_eq!(r.into_inner().unwrap(), expected, "{idle:?}");
        }
    }
}

#[test]
fn a_finished_rank_fails_waiting_ranks_at_once() {
    let g = gate(2, 60_000);
    let g1 = Arc::clone(&g);
    let waiter = std::thread::spawn(move || block_on(g1.arrive(1, 0, |_| 0)));
    while g.lock().arrived == 0 {
        std::thread::yield_now();
    }
    let violation = g.finish(0).unwrap_err().to_string();
    assert!(
        violation.contains("rank 0 returned from train after 0 collective calls"),
        "{violation}"
    );
    assert!(
        violation.contains("ranks [1] wait in their 1st (call 0)"),
        "{violation}"
    );
    assert_eq!(waiter.join().unwrap(), Err(Err(Aborted)));
}

#[test]
fn reporting_after_another_rank_finished_is_a_violation() {
    let g = gate(2, 60_000);
    g.finish(0).unwrap();
    let err = block_on(g.arrive(1, 7, |_| 0))
        .unwrap_err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("rank 1 called call 7 as its 1st collective call"),
        "{err}"
    );
}

#[test]
fn a_missing_rank_times_out_naming_it() {
    let g = gate(3, 50);
    let g0 = Arc::clone(&g);
    let t = std::thread::spawn(move || block_on(g0.arrive(0, 0, |_| 0)));
    let started = Instant::now();
    let err = block_on(g.arrive(2, 0, |_| 0));
    let other = t.join().unwrap();
    let violation = match (err, other) {
        (Err(Ok(v)), Err(Err(Aborted))) | (Err(Err(Aborted)), Err(Ok(v))) => v.to_string(),
        other => panic!("unexpected {other:?}"),
    };
    assert!(violation.contains("ranks [0, 2]"), "{violation}");
    assert!(violation.contains("for ranks [1]"), "{violation}");
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn a_late_rank_fails_with_the_round_at_the_first_arrivals_timeout() {
    // Rank 2 comes 800 ms after rank 0, with a timeout of 1 s: the
    // round fails 1 s after rank 0 came, not 1 s after rank 2, and
    // rank 2 is told at once.
    let g = gate(3, 1_000);
    let g0 = Arc::clone(&g);
    let t = std::thread::spawn(move || block_on(g0.arrive(0, 0, |_| 0)));
    while g.lock().arrived == 0 {
        std::thread::yield_now();
    }
    std::thread::sleep(Duration::from_millis(800));
    let late = Instant::now();
    let err = block_on(g.arrive(2, 0, |_| 0));
    let waited = late.elapsed();
    let other = t.join().unwrap();
    assert!(
        matches!(
            (&err, &other),
            (Err(Ok(_)), Err(Err(Aborted))) | (Err(Err(Aborted)), Err(Ok(_)))
        ),
        "{err:?} {other:?}"
    );
    assert!(waited < Duration::from_millis(700), "waited {waited:?}");
}

#[test]
fn a_rank_keeps_its_waker_from_round_to_round() {
    // Two ranks on one thread: each round the waiting rank is woken,
    // and its registered waker stays for the next round.
    let g = ReportGate::<u32, u32>::new(2, Duration::from_secs(60));
    let tasks = (0..2).map(|r| {
        let g = &g;
        let task: executor::TaskFuture<'_> = Box::pin(async move {
            for i in 0..100u32 {
                let sum = g
                    .arrive(r, i, |gathered| gathered.arrivals.iter().sum())
                    .await;
                assert_eq!(sum, Ok(2 * i));
            }
        });
        (r, task)
    });
    executor::run(1, tasks, &IdleWait::new(1), |r, m| panic!("rank {r}: {m}"));
    let st = g.lock();
    assert!(st.wakers.iter().all(Option::is_some));
    assert!(st.waiting.iter().all(|w| !w));
}

#[test]
fn ordinals() {
    assert_eq!(ordinal(1), "1st");
    assert_eq!(ordinal(2), "2nd");
    assert_eq!(ordinal(3), "3rd");
    assert_eq!(ordinal(11), "11th");
    assert_eq!(ordinal(22), "22nd");
}
