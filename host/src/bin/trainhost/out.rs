//! The command line's own lines on stdout and stderr, each written whole.
//!
//! Under `mpiexec` or `srun` every node's stderr (and stdout) is merged
//! into one stream. `writeln!` on the unbuffered stderr issues one `write`
//! per formatted piece, so two nodes failing together printed
//! `error: error: ...` with the rest of both lines after it. A line
//! formatted first and written in one call reaches a pipe whole (up to
//! `PIPE_BUF`, 4 KiB on Linux), as the library's tracing lines already do.

use std::fmt;
use std::io::Write;

/// Writes `args` and a newline to `to` in one `write_all`. A line that
/// cannot be written (stderr closed: `trainhost run ... 2>&1 | head`) is
/// dropped and the run goes on.
pub fn line(mut to: impl Write, args: fmt::Arguments<'_>) {
    let mut text = fmt::format(args);
    text.push('\n');
    let _ = to.write_all(text.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;

    /// Records each `write` call apart.
    #[derive(Default)]
    struct Writes(Vec<Vec<u8>>);

    impl Write for &mut Writes {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            self.0.push(bytes.to_vec());
            Ok(bytes.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_line_of_several_pieces_is_one_write() {
        let mut writes = Writes::default();
        let cause = "the storage is unreachable";
        line(
            &mut writes,
            format_args!("error: {}: {cause} ({})", "node 1", 7),
        );
        let writes: Vec<String> = writes
            .0
            .iter()
            .map(|w| String::from_utf8_lossy(w).into_owned())
            .collect();
        assert_eq!(writes, ["error: node 1: the storage is unreachable (7)\n"]);
    }

    #[test]
    fn a_line_that_cannot_be_written_is_dropped() {
        struct Closed;
        impl Write for Closed {
            fn write(&mut self, _: &[u8]) -> io::Result<usize> {
                Err(io::ErrorKind::BrokenPipe.into())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        line(Closed, format_args!("last metrics: {}", "{}"));
    }
}
