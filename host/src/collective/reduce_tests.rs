//! Tests of the all-reduce (`reduce.rs`): against a reference computed
//! element by element, with buffers owned, cut into parts and lent.

use super::*;

/// The reference: every element combined in rank order, one at a time.
fn reference(inputs: &[Vec<f32>], op: Op) -> Vec<f32> {
    (0..inputs[0].len())
        .map(|i| {
            let mut acc = inputs[0][i];
            for v in &inputs[1..] {
                acc = match op {
                    Op::Sum | Op::Mean => acc + v[i],
                    Op::Min => acc.min(v[i]),
                    Op::Max => acc.max(v[i]),
                };
            }
            if op == Op::Mean {
                acc / inputs.len() as f32
            } else {
                acc
            }
        })
        .collect()
}

fn inputs(ranks: usize, len: usize) -> Vec<Vec<f32>> {
    (0..ranks)
        .map(|r| {
            (0..len)
                .map(|i| ((i * 7919 + r * 104_729) % 1000) as f32 / 7.0 - 60.0)
                .collect()
        })
        .collect()
}

/// Run the reduction as the ranks do: as tasks of an executor of at
/// most two threads, so that ranks wait for each other.
fn run(inputs: &[Vec<f32>], op: Op) -> Vec<Vec<f32>> {
    let values = inputs.iter().cloned().map(Values::F32).collect();
    run_values(values, op)
        .into_iter()
        .map(|v| match v {
            Values::F32(v) => v,
            other => panic!("{other:?}"),
        })
        .collect()
}

/// [`run`] of any values; every rank's result, by rank.
fn run_values(values: Vec<Values>, op: Op) -> Vec<Values> {
    let ranks = values.len();
    let reduction = Reduction::new(values, op);
    deliver_all(&reduction, ranks)
        .into_iter()
        .enumerate()
        .map(|(r, delivered)| match delivered {
            Some(Delivered::Values(v)) => v,
            Some(Delivered::Shared(shared)) => Values::F32(shared.to_vec()),
            other => panic!("rank {r}: {other:?}"),
        })
        .collect()
}

/// Every rank's delivery of `reduction`, by rank, taken as the ranks
/// take them: as tasks of an executor of at most two threads.
fn deliver_all(reduction: &Reduction, ranks: usize) -> Vec<Option<Delivered>> {
    let results: Vec<std::sync::Mutex<Option<Option<Delivered>>>> =
        (0..ranks).map(|_| Default::default()).collect();
    let threads = ranks.min(2);
    let idle = crate::executor::IdleWait::new(threads);
    let tasks = (0..ranks).map(|r| {
        let results = &results;
        let task: crate::executor::TaskFuture<'_> = Box::pin(async move {
            *results[r].lock().unwrap() = Some(reduction.deliver(r).await);
        });
        (r, task)
    });
    crate::executor::run(threads, tasks, &idle, |r, m| panic!("rank {r}: {m}"));
    results
        .into_iter()
        .map(|r| r.into_inner().unwrap().expect("every rank delivered"))
        .collect()
}

/// f32 values in one buffer.
fn flat(values: Values) -> Vec<f32> {
    match values.into_flat() {
        Values::F32(v) => v,
        other => panic!("{other:?}"),
    }
}

/// `got` is `want`, bit for bit.
fn assert_same_bits(got: &[f32], want: &[f32], what: String) {
    assert!(
        got.len() == want.len()
            && got
                .iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{what}"
    );
}

/// `values` cut into buffers of the given lengths (the last one takes
/// the rest).
fn cut(values: &[f32], lengths: &[usize]) -> Values {
    let mut rest = values;
    let mut parts = Vec::new();
    for &n in lengths {
        let (part, after) = rest.split_at(n.min(rest.len()));
        parts.push(part.to_vec());
        rest = after;
    }
    parts.push(rest.to_vec());
    Values::F32Parts(parts)
}

#[test]
fn values_in_several_buffers_are_combined_where_they_are() {
    // Ranks cut their values differently (empty buffers included), and
    // may hold them in one buffer; whole and split reductions.
    for (ranks, len) in [(2, 1000), (2, 10_001), (3, 70_001)] {
        for op in [Op::Sum, Op::Mean, Op::Min, Op::Max] {
            let inputs = inputs(ranks, len);
            let want = reference(&inputs, op);
            let cuts: [&[usize]; 3] = [&[0, 4096, 64, 0, 640], &[1, 2049, 2047], &[]];
            let values = inputs
                .iter()
                .enumerate()
                .map(|(r, v)| match r {
                    0 => Values::F32(v.clone()),
                    _ => cut(v, cuts[r % 3]),
                })
                .collect();
            for (r, got) in run_values(values, op).into_iter().enumerate() {
                let lengths: Vec<usize> = match &got {
                    Values::F32(v) => vec![v.len()],
                    Values::F32Parts(parts) => parts.iter().map(Vec::len).collect(),
                    other => panic!("{other:?}"),
                };
                let expected = match r {
                    0 => vec![len],
                    _ => match cut(&inputs[r], cuts[r % 3]) {
                        Values::F32Parts(parts) => parts.iter().map(Vec::len).collect(),
                        _ => unreachable!(),
                    },
                };
                assert_eq!(lengths, expected, "rank {r} keeps its buffers");
                let what = format!("ranks {ranks} len {len} {op:?} rank {r}");
                assert_same_bits(&flat(got), &want, what);
            }
        }
    }
}

#[test]
fn split_and_whole_reductions_match_the_reference_bit_for_bit() {
    // Sizes below and above the split (both thresholds: 2 ranks have
    // threads of their own on any machine of 2 cores or more), and
    // lengths that do not divide.
    for (ranks, len) in [
        (1, 10),
        (2, 1000),
        (2, 10_001),
        (3, 70_001),
        (4, 200_003),
        (5, 17),
    ] {
        for op in [Op::Sum, Op::Mean, Op::Min, Op::Max] {
            let inputs = inputs(ranks, len);
            let want = reference(&inputs, op);
            for (r, got) in run(&inputs, op).iter().enumerate() {
                let what = format!("ranks {ranks} len {len} {op:?} rank {r}");
                assert_same_bits(got, &want, what);
            }
        }
    }
}

/// Ranks that lend their values (read in place, one shared result)
/// and ranks that own their buffers meet in one reduction: the same
/// bits on each, whole and split, one rank alone included.
#[test]
fn lent_and_owned_values_combine_alike() {
    for (ranks, len) in [(1, 1000), (2, 1000), (3, 70_001), (4, 200_003)] {
        for op in [Op::Sum, Op::Mean, Op::Min, Op::Max] {
            let inputs = inputs(ranks, len);
            let want = reference(&inputs, op);
            // SAFETY: `inputs` outlive the lendings and are not written.
            let (values, lendings): (Vec<Values>, Vec<_>) = inputs
                .iter()
                .enumerate()
                .map(|(r, v)| match r % 3 {
                    1 => (Values::F32(v.clone()), None),
                    2 => (cut(v, &[1, 4096]), None),
                    _ => {
                        let (lent, lending) = unsafe { crate::collective::Lent::new(v) };
                        (Values::F32Lent(lent), Some(lending))
                    }
                })
                .unzip();
            for (r, got) in run_values(values, op).into_iter().enumerate() {
                let what = format!("ranks {ranks} len {len} {op:?} rank {r}");
                assert_same_bits(&flat(got), &want, what);
            }
            drop(lendings);
        }
    }
}

/// A rank whose call was dropped (its loan returned) before the round
/// was combined: no rank gets a result, and its memory is not read.
#[test]
fn a_returned_loan_is_not_read_and_no_rank_gets_a_result() {
    for len in [1000, 200_003] {
        let inputs = inputs(3, len);
        // SAFETY: `inputs` outlive the lendings and are not written.
        let (lent, lending) = unsafe { crate::collective::Lent::new(&inputs[1]) };
        drop(lending);
        let values = vec![
            Values::F32(inputs[0].clone()),
            Values::F32Lent(lent),
            Values::F32(inputs[2].clone()),
        ];
        let reduction = Reduction::new(values, Op::Sum);
        let delivered = deliver_all(&reduction, 3);
        assert!(
            delivered.iter().all(Option::is_none),
            "len {len}: {delivered:?}"
        );
    }
}

#[test]
fn slices_cover_every_element_once_on_aligned_starts() {
    let values = (0..3).map(|_| Values::F32(vec![0.0; 100_001])).collect();
    let reduction = Reduction::new(values, Op::Sum);
    let mut next = 0;
    for r in 0..3 {
        let s = reduction.slice_of(r);
        assert_eq!(s.start, next);
        assert_eq!(s.start % ALIGN, 0);
        next = s.end;
    }
    assert_eq!(next, 100_001);
}
