//! Recorded programs (`tensors.program`): a run gives the values of the
//! same calls made directly, matches them collectively, refuses what does
//! not fit before anything runs, notices a tensor dropped since it was
//! recorded, is bounded in kernels and memory, and stops with the run.

use serde_json::json;
use trainhost::FailureKind;

use crate::util::*;

/// Three steps of a network using every kernel a program records, made
/// by a program on one rank and call by call on the other (their
/// all-reduces meet), then by programs on both: every tensor ends with
/// the same bits, and the losses are the same.
#[test]
fn a_programs_run_gives_the_values_of_the_same_calls_made_directly() {
    let run = run(
        2,
        json!([
            {"program_step": "program", "ranks": [0]},
            {"program_step": "direct", "ranks": [1]},
            {"program_step": "program"},
        ]),
    );
    run.assert_ok();
    let (first, second) = (run.stdout(0), run.stdout(1));
    assert_eq!(first.len(), 2, "{first:?}");
    assert!(first[0].starts_with("program_step: "), "{first:?}");
    assert_eq!(first, second);
    assert_eq!(first[0], first[1]);
    // Three losses, one a step.
    assert_eq!(first[0].matches("), (").count(), 2, "{first:?}");
}

#[test]
fn a_program_refuses_bad_calls_when_recorded_and_runs_that_do_not_fit_before_they_run() {
    let run = run(1, json!([{"program_refusals": true}]));
    run.assert_ok();
    let own = "each tensor it writes must be a tensor of its own, passed once and not also as one it reads";
    assert_eq!(
        run.stdout(0),
        [
            "program error: program.gemm: op(a) is 6×5 and op(b) 4×3, so c must be 6×3 with \
             equal inner sizes; c is 6×4"
                .to_string(),
            format!("program error: program.dense: {own}"),
            format!("program error: program.all-reduce-list: {own}"),
            "program error: program.softmax-cross-entropy: the label of row 2 is 3, not below \
             the 3 classes"
                .to_string(),
            "program error: program.sgd-momentum-list: 1 params, 2 velocities and 1 gradients; \
             the lists must be as long"
                .to_string(),
            "program error: program.gather-rows: a source with 5 columns needs out of shape \
             [rows, 5], not [6, 4]"
                .to_string(),
            "program error: program.run: kernel 0 (gather-rows) takes 6 rows, and the run was \
             given 3"
                .to_string(),
            "program error: program.run: rows[5] is 20, past the 20 rows in the source of \
             kernel 0 (gather-rows)"
                .to_string(),
            "program error: program.run: rows[5] is 10, past the 10 labels of kernel 0 \
             (softmax-cross-entropy)"
                .to_string(),
            "program unchanged: true".to_string(),
            "program error: program.run: a tensor that kernel 0 (activate) names was dropped \
             since it was recorded; record the program again with the tensors it should use"
                .to_string(),
            "program refused: invalid".to_string(),
        ]
    );
}

#[test]
fn a_program_holds_a_bounded_number_of_kernels() {
    let run = run(1, json!([{"program_full": true}]));
    run.assert_ok();
    assert_eq!(
        run.stdout(0),
        [
            "program_full: 4096 recorded",
            "program error: program.scale: a program holds at most 4096 kernels; record another \
             step in a program of its own"
        ]
    );
}

/// Labels kept by a program count against the memory limit, and are
/// given back when the program is dropped.
#[test]
fn a_programs_kernels_count_against_the_memory_limit() {
    let (builder, storage, lines) = scripted(1, json!([{"program_labels_mb": 6}]));
    let builder = with_max_memory(builder, &storage, 64 << 20);
    let run = finish(builder, storage, lines);
    run.assert_ok();
    let out = run.stdout(0);
    assert_eq!(out.len(), 3, "{out:?}");
    let recorded: u32 = out[0]
        .strip_prefix("program_labels: ")
        .and_then(|r| r.strip_suffix(" recorded"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{out:?}"));
    // 6 MiB each under 64 MiB that the guest's own memory shares.
    assert!((2..=10).contains(&recorded), "{out:?}");
    let refused = &out[1];
    assert!(
        refused.starts_with("program error: out of memory: a program's kernel of 6")
            && refused.contains("would take the rank past its memory limit of 64 MiB"),
        "{out:?}"
    );
    assert_eq!(out[2], "program_labels: recorded again");
}

#[test]
fn empty_programs_count_against_the_memory_limit() {
    // A program's constructor has no error to return: the program that
    // does not fit stops the rank with the memory limit's failure.
    let (builder, storage, lines) = scripted(1, json!([{"program_empty": 200_000}]));
    let builder = with_max_memory(builder, &storage, 8 << 20);
    let run = finish(builder, storage, lines);
    let e = run.result.error.clone().expect("the run fails");
    assert_eq!(e.kind, FailureKind::Limit, "{e}");
    assert!(
        e.message
            .contains("a program of 128 B would take the rank past its memory limit of 8 MiB"),
        "{e}"
    );
    assert!(run.stdout(0).is_empty(), "{:?}", run.stdout(0));
}

#[test]
fn a_rank_holds_a_bounded_number_of_programs() {
    let run = run(1, json!([{"program_empty": 95_000}]));
    let e = run.result.error.clone().expect("the run fails");
    assert_eq!(e.kind, FailureKind::Limit, "{e}");
    assert!(
        e.message.contains(
            "a program would make the rank hold more than 90000 tensors and programs at once (it holds 90000); drop those it no longer uses"
        ),
        "{e}"
    );
}

#[test]
fn a_failing_rank_stops_another_inside_a_programs_long_kernel() {
    crate::tensors::stops_inside_a_long_gemm("program_gemm");
}
