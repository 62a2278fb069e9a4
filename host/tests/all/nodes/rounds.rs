//! Collective rounds over several nodes: one result everywhere, and
//! calls that do not match, or do not come, failing every node alike
//! whichever way each node waits for the round (R38).

use serde_json::json;

use super::{DEBUG, TOLD, have_mpiexec, mpiexec, mpiexec_logging, rank_lines, scripted_args};

#[test]
fn collectives_span_the_nodes_with_one_result_everywhere() {
    if !have_mpiexec() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let len = 100_000;
    let steps = json!([
        {"barrier": true},
        {"broadcast": "from {rank}", "root": 3},
        {"all_gather": "r{rank}"},
        {"all_reduce": "s64", "len": len, "op": "sum"},
        {"all_reduce": "f64", "len": 1000, "op": "mean"},
        // Sent to every node with the calls, and combined on each.
        {"all_reduce": "f64", "len": 100, "op": "mean"},
        // Combined on node 0 (min and max keep trainhost's comparisons).
        {"all_reduce": "f32", "len": 1000, "op": "max"},
        {"report": {"done": true}},
    ]);
    let (ok, stdout, stderr) = mpiexec(&[(3, scripted_args(6, steps, &[]))], dir.path());
    assert!(ok, "{stdout}\n{stderr}");
    let sum = crate::collective::expected(6, "s64", "sum", len);
    let small_mean = by_nodes(3, 2, 100);
    assert_ne!(
        small_mean,
        crate::collective::expected(6, "f64", "mean", 100),
        "node by node is bracketed otherwise than rank by rank"
    );
    let max = crate::collective::expected(6, "f32", "max", 1000);
    let mean: Vec<String> = (0..6)
        .map(|r| {
            rank_lines(&stdout, r)
                .into_iter()
                .filter(|l| l.starts_with("all_reduce: 1000 "))
                .collect()
        })
        .collect();
    for rank in 0..6 {
        let lines = rank_lines(&stdout, rank);
        for want in [
            "barrier ok",
            "broadcast: from 3",
            "all_gather: r0|r1|r2|r3|r4|r5",
            sum.as_str(),
            small_mean.as_str(),
            max.as_str(),
        ] {
            assert!(lines.contains(&want), "rank {rank}: {want}\n{stdout}");
        }
        // Summed by MPI's all-reduce: the same bits on every rank.
        assert_eq!(mean[rank as usize], mean[0], "{stdout}");
    }
}

/// The line a rank prints for a mean of `len` f64 over `nodes` nodes of
/// `per_node` ranks combined as R38 says for a small one: each node's
/// ranks in rank order, then the nodes' partial sums in node order, then
/// divided once.
fn by_nodes(nodes: u32, per_node: u32, len: usize) -> String {
    let of = |r: u32, i: usize| crate::collective::value(r, i) as f64 / 7.0 - 60.0;
    let bytes: Vec<u8> = (0..len)
        .map(|i| {
            let node = |n: u32| {
                (1..per_node).fold(of(n * per_node, i), |acc, r| acc + of(n * per_node + r, i))
            };
            (1..nodes).fold(node(0), |acc, n| acc + node(n)) / f64::from(nodes * per_node)
        })
        .flat_map(f64::to_le_bytes)
        .collect();
    format!("all_reduce: {len} {:016x}", crate::collective::fnv(&bytes))
}

#[test]
fn a_result_over_the_memory_limit_is_refused_on_every_node_naming_the_call() {
    if !have_mpiexec() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let steps = json!([
        // 2 × 40 MiB gathered into every rank: over 64 MiB.
        {"all_gather": "", "bytes": 40 << 20},
        {"all_gather": "small {rank}"},
    ]);
    let args = scripted_args(2, steps, &["--max-memory", "64MiB"]);
    let (ok, stdout, stderr) = mpiexec(&[(2, args)], dir.path());
    assert!(ok, "{stdout}\n{stderr}");
    let want = format!(
        "collective error: invalid collective call: the result of all-gather of {} bytes would take",
        40 << 20
    );
    for rank in 0..2 {
        let lines = rank_lines(&stdout, rank);
        assert!(
            lines
                .first()
                .is_some_and(|l| l.starts_with(&want) && l.contains("(--max-memory)")),
            "rank {rank}: {want}\n{stdout}"
        );
        assert!(
            lines.contains(&"all_gather: small 0|small 1"),
            "rank {rank}\n{stdout}"
        );
    }
}

#[test]
fn collectives_of_host_tensors_span_the_nodes() {
    if !have_mpiexec() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let steps = json!([
        {"tensor_all_reduce_list": [400, 600], "op": "max"},
        {"tensor_all_reduce": 1000, "op": "sum"},
        {"tensor_broadcast": 100, "root": 3},
        {"report": {"done": true}},
    ]);
    let (ok, stdout, stderr) = mpiexec(&[(3, scripted_args(6, steps, &[]))], dir.path());
    assert!(ok, "{stdout}\n{stderr}");
    let max = crate::collective::expected(6, "f32", "max", 1000);
    let threes: Vec<u8> = (0..100)
        .flat_map(|i| (crate::collective::value(3, i) as f32).to_le_bytes())
        .collect();
    let broadcast = format!("tensor_broadcast: {:016x}", crate::collective::fnv(&threes));
    let first = rank_lines(&stdout, 0);
    for rank in 0..6 {
        let lines = rank_lines(&stdout, rank);
        assert!(lines.contains(&max.as_str()), "rank {rank}\n{stdout}");
        assert!(lines.contains(&broadcast.as_str()), "rank {rank}\n{stdout}");
        // The sum crosses the nodes by MPI: the same bits on every rank.
        assert_eq!(lines, first, "rank {rank}");
    }
}

/// Ranks whose f32 values the host reads in their guest's memory
/// (`collective-bits`) and ranks whose values it copies (the lifted list) get
/// the same result across nodes, bit for bit, on every path a round
/// crosses the nodes by: with the calls (small), summed by MPI, combined
/// on node 0 (min and max).
#[test]
fn ranks_lending_their_values_and_ranks_copying_them_agree_across_nodes() {
    if !have_mpiexec() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<(&str, usize)> = ["sum", "mean", "max"]
        .into_iter()
        .flat_map(|op| [(op, 1000), (op, 100_003)])
        .collect();
    // Rank 0 copies beside rank 1 lending on node 0; node 1's ranks lend.
    // Then every rank copies.
    let steps: Vec<serde_json::Value> = cases
        .iter()
        .flat_map(|(op, len)| {
            [
                json!({"all_reduce": "f32", "op": op, "len": len, "into": "list", "ranks": [0]}),
                json!({"all_reduce": "f32", "op": op, "len": len, "into": "bits", "ranks": [1, 2, 3]}),
                json!({"all_reduce": "f32", "op": op, "len": len, "into": "list"}),
            ]
        })
        .collect();
    let (ok, stdout, stderr) = mpiexec(&[(2, scripted_args(4, json!(steps), &[]))], dir.path());
    assert!(ok, "{stdout}\n{stderr}");
    let first = rank_lines(&stdout, 0);
    assert_eq!(first.len(), 2 * cases.len(), "{stdout}");
    for (pair, (op, len)) in first.chunks(2).zip(&cases) {
        assert_eq!(pair[0], pair[1], "{op} of {len}: lent and copied\n{stdout}");
    }
    let max = crate::collective::expected(4, "f32", "max", 100_003);
    assert!(first.contains(&max.as_str()), "{stdout}");
    for rank in 1..4 {
        assert_eq!(rank_lines(&stdout, rank), first, "rank {rank}\n{stdout}");
    }
}

#[test]
fn calls_that_differ_across_nodes_fail_every_node_naming_each_rank() {
    if !have_mpiexec() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let steps = json!([
        {"barrier": true, "ranks": [3]},
        {"report": {"i": 0}, "ranks": [0, 1, 2]},
    ]);
    let (ok, stdout, stderr) = mpiexec(&[(2, scripted_args(4, steps, &[]))], dir.path());
    assert!(!ok, "{stdout}\n{stderr}");
    let want = "error: the run failed: collective protocol violation: the 1st collective call does not match: rank 0 called report, rank 1 called report, rank 2 called report, rank 3 called barrier";
    assert_eq!(
        stderr.matches(want).count(),
        2,
        "on both nodes: {stdout}\n{stderr}"
    );
}

#[test]
fn a_node_names_its_own_ranks_by_their_rank_in_the_run() {
    if !have_mpiexec() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Rank 3 (node 1's second) returns while rank 2 waits: node 1's own
    // gate finds it.
    let steps = json!([{"barrier": true, "ranks": [0, 1, 2]}]);
    let (ok, stdout, stderr) = mpiexec(&[(2, scripted_args(4, steps, &[]))], dir.path());
    assert!(!ok, "{stdout}\n{stderr}");
    assert!(
        stderr.contains("rank 3 returned from train after 0 collective calls"),
        "{stderr}"
    );
    assert!(!stderr.contains("rank 1 returned"), "{stderr}");
}

#[test]
fn a_node_whose_ranks_do_not_arrive_times_out_naming_it() {
    if !have_mpiexec() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let steps = json!([
        {"sleep_ms": 60_000, "ranks": [2, 3]},
        {"report": {"i": 0}},
    ]);
    let args = scripted_args(4, steps, &["--report-timeout", "1s"]);
    let started = std::time::Instant::now();
    let (ok, stdout, stderr) = mpiexec(&[(2, args)], dir.path());
    assert!(!ok, "{stdout}\n{stderr}");
    let want = "error: the run failed: collective protocol violation: the ranks on node 0 waited 1s in their 1st collective call for the ranks on node 1, which did not arrive";
    assert_eq!(stderr.matches(want).count(), 2, "on both nodes: {stderr}");
    // The sleeping ranks were stopped, not waited for.
    assert!(started.elapsed() < std::time::Duration::from_secs(50));
}

/// Calls that differ where nodes wait for the round in different ways:
/// a node whose ranks call a collective that travels in the calls
/// exchanges them with every node, one whose ranks report waits for node
/// 0's word. Every node must still fail with the same message, none
/// wait for calls that never come (`mpiexec` would time out), and every
/// rank's collective call return that message as its error.
#[test]
fn calls_that_differ_fail_every_node_whichever_way_it_waits() {
    if !have_mpiexec() {
        return;
    }
    for (calls, want) in [
        (
            // Node 0 exchanges, node 1 waits for node 0, node 2 exchanges.
            [
                json!({"barrier": true}),
                json!({"report": {"i": 0}}),
                json!({"all_reduce": "f32", "len": 10, "op": "sum"}),
            ],
            "rank 0 called barrier, rank 1 called report, rank 2 called all-reduce (sum) of 10 f32",
        ),
        (
            // Node 0 records; nodes 1 and 2 exchange and wait for node 0's
            // calls, which never come to them.
            [
                json!({"report": {"i": 0}}),
                json!({"barrier": true}),
                json!({"barrier": true}),
            ],
            "rank 0 called report, rank 1 called barrier, rank 2 called barrier",
        ),
        (
            // Every node exchanges; all-reduces of different lengths.
            [
                json!({"all_reduce": "f64", "len": 8, "op": "mean"}),
                json!({"all_reduce": "f64", "len": 8, "op": "mean"}),
                json!({"all_reduce": "f64", "len": 9, "op": "mean"}),
            ],
            "rank 0 called all-reduce (mean) of 8 f64, rank 1 called all-reduce (mean) of 8 f64, rank 2 called all-reduce (mean) of 9 f64",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let steps: Vec<_> = calls
            .into_iter()
            .enumerate()
            .map(|(rank, mut call)| {
                call["ranks"] = json!([rank]);
                call
            })
            .collect();
        // Without epochs a rank told to stop runs on to its next call of
        // trainhost: its guest prints the error its call returned before.
        let args = scripted_args(3, json!(steps), &["--interrupt", "host-calls"]);
        let (ok, stdout, stderr) = mpiexec_logging(&[(3, args)], dir.path(), DEBUG);
        assert!(!ok, "{stdout}\n{stderr}");
        // Each node learns the violation from the round, none from another
        // node's failure, which could overtake node 0's word.
        assert!(!stderr.contains(TOLD), "{stderr}");
        let violation = format!(
            "collective protocol violation: the 1st collective call does not match: {want}"
        );
        assert_eq!(
            stderr
                .matches(&format!("error: the run failed: {violation}"))
                .count(),
            3,
            "on every node: {violation}\n{stdout}\n{stderr}"
        );
        // Each rank that called a collective gets the violation as its
        // call's error, on whichever node and however it waited: node 0
        // tells a node waiting for calls that never come to it.
        for (rank, step) in steps.iter().enumerate() {
            if step.get("report").is_none() {
                let line = format!("[rank {rank}] collective error: {violation}");
                assert!(stdout.contains(&line), "{line}\n{stdout}\n{stderr}");
            }
        }
    }
}

/// A node whose ranks exchange a round's calls with every node, while node
/// 0's ranks have returned from train, fails naming them, and so does the
/// run.
#[test]
fn a_node_left_alone_in_a_round_names_the_ranks_that_returned() {
    if !have_mpiexec() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let steps = json!([{"barrier": true, "ranks": [2, 3]}]);
    let (ok, stdout, stderr) = mpiexec(&[(2, scripted_args(4, steps, &[]))], dir.path());
    assert!(!ok, "{stdout}\n{stderr}");
    let want = "error: the run failed: collective protocol violation: the ranks on node 0 returned from train while ranks [2, 3] on node 1 wait in their 1st collective call (barrier)";
    assert_eq!(stderr.matches(want).count(), 2, "on both nodes: {stderr}");
}

/// A node that does not come to a round whose calls every node exchanges:
/// node 0 alone keeps the deadline, and tells the nodes waiting with it.
#[test]
fn a_node_that_does_not_come_to_an_exchange_times_out_naming_it() {
    if !have_mpiexec() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let steps = json!([
        {"sleep_ms": 60_000, "ranks": [1]},
        {"barrier": true},
    ]);
    let args = scripted_args(3, steps, &["--report-timeout", "1s"]);
    let started = std::time::Instant::now();
    let (ok, stdout, stderr) = mpiexec(&[(3, args)], dir.path());
    assert!(!ok, "{stdout}\n{stderr}");
    let want = "error: the run failed: collective protocol violation: the ranks on node 0 waited 1s in their 1st collective call for the ranks on node 1, which did not arrive";
    assert_eq!(stderr.matches(want).count(), 3, "on every node: {stderr}");
    assert!(started.elapsed() < std::time::Duration::from_secs(50));
}
