//! Describing a rank's trap for people: what happened first, on the first
//! line (the line one greps a log for), then the evidence.
//!
//! A Rust guest that panics prints its message on stderr and then traps
//! with `unreachable`; the trap itself only says "wasm `unreachable`
//! instruction executed" after a backtrace of the panic machinery. So the
//! first line is the guest's panic message when its stderr has one, else
//! the trap's own cause; then the trap with its wasm backtrace; then the
//! last lines of the rank's stderr.

/// The failure message of a rank that trapped with `error`, whose stderr
/// ended with `stderr_tail`.
pub(super) fn describe(error: &wasmtime::Error, stderr_tail: &[String]) -> String {
    let mut cause = error.root_cause().to_string();
    if let Some(remedy) = remedy(&cause) {
        cause = format!("{cause}: {remedy}");
    }
    let first = panic_in(stderr_tail).unwrap_or_else(|| cause.clone());
    // `{:#}`: the trap and the guest's wasm backtrace. Not `{:?}`, which
    // with RUST_BACKTRACE set also symbolizes the host's own stack: noise
    // for the user, and ~100 ms on every failure.
    let mut message = format!("{first}\n{error:#}");
    if !stderr_tail.is_empty() {
        message.push_str("\nlast lines of its stderr:\n  ");
        message.push_str(&stderr_tail.join("\n  "));
    }
    message
}

/// What to do about a trap wasmtime raised for a limit of its own, whose
/// message does not say.
fn remedy(cause: &str) -> Option<&'static str> {
    // Each handle the guest holds counts: files and directories it opened,
    // their streams, pollables, tensors and programs.
    cause.contains("store handle limit exceeded").then_some(
        "the rank held more handles at once than wasmtime allows a rank \
         (files and directories it opened, streams, pollables, tensors, \
         programs); close or drop those it no longer uses",
    )
}

/// The last Rust panic in `lines`, as `panicked at FILE:LINE:COL: MESSAGE`
/// (the message's first line). Rust prints `thread 'NAME' (ID) panicked
/// at FILE:LINE:COL:` and the message on the lines after it.
fn panic_in(lines: &[String]) -> Option<String> {
    let at = lines
        .iter()
        .rposition(|l| l.starts_with("thread '") && l.contains(" panicked at "))?;
    let location = lines[at]
        .split(" panicked at ")
        .nth(1)?
        .trim_end_matches(':');
    let message = lines[at + 1..]
        .iter()
        .map(|l| l.trim())
        .find(|l| !l.is_empty() && !l.starts_with("note: run with `RUST_BACKTRACE"));
    Some(match message {
        Some(message) => format!("panicked at {location}: {message}"),
        None => format!("panicked at {location}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(text: &str) -> Vec<String> {
        text.lines().map(str::to_owned).collect()
    }

    #[test]
    fn the_panic_message_comes_first() {
        let tail = lines(
            "about to give up\n\nthread '<unnamed>' (1) panicked at src/lib.rs:228:9:\nloss is NaN\nnote: run with `RUST_BACKTRACE=1` environment variable to display a backtrace",
        );
        assert_eq!(
            panic_in(&tail).unwrap(),
            "panicked at src/lib.rs:228:9: loss is NaN"
        );
        let trap = wasmtime::Error::msg("wasm trap: wasm `unreachable` instruction executed");
        let message = describe(&trap, &tail);
        assert_eq!(
            message.lines().next(),
            Some("panicked at src/lib.rs:228:9: loss is NaN")
        );
        assert!(message.contains("last lines of its stderr:\n  about to give up"));
    }

    #[test]
    fn a_trap_for_wasmtimes_handle_limit_says_what_to_do() {
        let trap =
            wasmtime::Error::msg("cannot allocate another handle: store handle limit exceeded");
        let message = describe(&trap, &[]);
        assert_eq!(
            message.lines().next(),
            Some(
                "cannot allocate another handle: store handle limit exceeded: the rank held more \
                 handles at once than wasmtime allows a rank (files and directories it opened, \
                 streams, pollables, tensors, programs); close or drop those it no longer uses"
            )
        );
        let other = describe(
            &wasmtime::Error::msg("wasm trap: integer divide by zero"),
            &[],
        );
        assert_eq!(
            other.lines().next(),
            Some("wasm trap: integer divide by zero")
        );
    }

    #[test]
    fn without_a_panic_the_traps_cause_comes_first() {
        let trap = wasmtime::Error::msg("wasm trap: out of bounds memory access")
            .context("error while executing at wasm backtrace:\n    0: 0x1 - guest!f");
        let message = describe(&trap, &[]);
        assert_eq!(
            message.lines().next(),
            Some("wasm trap: out of bounds memory access")
        );
        assert!(!message.contains("last lines"));
    }
}
