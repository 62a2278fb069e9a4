//! Guest stdout and stderr: split into lines and handed to an
//! [`OutputSink`], which by default prints each line prefixed with its rank
//! (R4). A line is always delivered whole, so ranks never interleave within
//! a line.

use std::collections::VecDeque;
use std::io::Write;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamError, StreamResult};

use super::limits::{LimitHit, OutputBudget};

/// How much a guest may hand over in one write.
const WRITE_PERMIT: usize = 64 * 1024;
/// How many of a rank's last stderr lines are kept to explain a trap.
const STDERR_TAIL: usize = 8;

/// Which of a rank's output streams a line came from (see [`OutputSink`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// The guest's stdout.
    Stdout,
    /// The guest's stderr.
    Stderr,
}

/// Receives the ranks' output, one whole line at a time (without its line
/// ending). Called from the ranks' threads, so it must be `Sync`.
///
/// ```
/// use std::sync::Mutex;
/// use trainhost::{OutputSink, Stream};
///
/// /// Keeps rank 0's stdout, drops the rest.
/// #[derive(Default)]
/// struct Rank0(Mutex<Vec<String>>);
///
/// impl OutputSink for Rank0 {
///     fn line(&self, rank: u32, stream: Stream, line: &str) {
///         if rank == 0 && stream == Stream::Stdout {
///             self.0.lock().unwrap().push(line.to_owned());
///         }
///     }
/// }
/// // Trainer::builder("loop.wasm").output(std::sync::Arc::new(Rank0::default()))
/// ```
pub trait OutputSink: Send + Sync + 'static {
    /// One line of `rank`'s `stream`.
    fn line(&self, rank: u32, stream: Stream, line: &str);
}

/// The default sink: each line to the host's stdout or stderr as
/// `[rank N] line`.
///
/// ```
/// use trainhost::{OutputSink, Stream, TerminalOutput};
/// TerminalOutput.line(3, Stream::Stdout, "epoch 1"); // prints "[rank 3] epoch 1"
/// ```
#[derive(Debug, Default, Clone, Copy)]
pub struct TerminalOutput;

impl OutputSink for TerminalOutput {
    fn line(&self, rank: u32, stream: Stream, line: &str) {
        // One locked write per line keeps lines whole across ranks.
        let _ = match stream {
            Stream::Stdout => writeln!(std::io::stdout().lock(), "[rank {rank}] {line}"),
            Stream::Stderr => writeln!(std::io::stderr().lock(), "[rank {rank}] {line}"),
        };
    }
}

struct Buffer {
    pending: Vec<u8>,
    /// Dropping the rest of a line that was cut.
    skipping: bool,
    tail: VecDeque<String>,
}

/// What one rank's two streams share: the output budget, the line cap,
/// and a callback noting that the rank is alive.
pub(crate) struct RankOutputLimits {
    pub budget: Mutex<Option<OutputBudget>>,
    pub max_line: usize,
    pub on_line: Box<dyn Fn() + Send + Sync>,
}

impl RankOutputLimits {
    /// Take `n` bytes of the rank's output budget, if it has one.
    pub fn take(&self, n: usize) -> Result<(), LimitHit> {
        match self
            .budget
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
        {
            Some(budget) => budget.take(n),
            None => Ok(()),
        }
    }
}

/// One rank's stdout or stderr, as given to its WASI context.
#[derive(Clone)]
pub(crate) struct RankStream {
    rank: u32,
    stream: Stream,
    sink: Arc<dyn OutputSink>,
    limits: Arc<RankOutputLimits>,
    buffer: Arc<Mutex<Buffer>>,
}

impl RankStream {
    pub fn new(
        rank: u32,
        stream: Stream,
        sink: Arc<dyn OutputSink>,
        limits: Arc<RankOutputLimits>,
    ) -> Self {
        Self {
            rank,
            stream,
            sink,
            limits,
            buffer: Arc::new(Mutex::new(Buffer {
                pending: Vec::new(),
                skipping: false,
                tail: VecDeque::new(),
            })),
        }
    }

    fn push(&self, bytes: &[u8]) -> Result<(), LimitHit> {
        self.limits.take(bytes.len())?;
        let max = self.limits.max_line;
        let mut buf = self.buffer.lock().unwrap_or_else(|p| p.into_inner());
        buf.pending.extend_from_slice(bytes);
        loop {
            let newline = buf.pending.iter().position(|b| *b == b'\n');
            if buf.skipping {
                match newline {
                    Some(i) => {
                        buf.pending.drain(..=i);
                        buf.skipping = false;
                        continue;
                    }
                    None => {
                        buf.pending.clear();
                        break;
                    }
                }
            }
            match newline {
                Some(i) if i <= max => {
                    let mut line: Vec<u8> = buf.pending.drain(..=i).collect();
                    line.pop();
                    self.emit(&mut buf, &line);
                }
                _ if buf.pending.len() > max => {
                    let mut line: Vec<u8> = buf.pending.drain(..max).collect();
                    line.extend_from_slice(format!(" [line cut at {max} bytes]").as_bytes());
                    self.emit(&mut buf, &line);
                    buf.skipping = true;
                }
                _ => break,
            }
        }
        Ok(())
    }

    fn emit(&self, buf: &mut Buffer, line: &[u8]) {
        let line = String::from_utf8_lossy(line.strip_suffix(b"\r").unwrap_or(line));
        if self.stream == Stream::Stderr {
            if buf.tail.len() == STDERR_TAIL {
                buf.tail.pop_front();
            }
            buf.tail.push_back(line.to_string());
        }
        self.sink.line(self.rank, self.stream, &line);
        (self.limits.on_line)();
    }

    /// Deliver a last line that had no line ending.
    pub fn finish(&self) {
        let mut buf = self.buffer.lock().unwrap_or_else(|p| p.into_inner());
        if !buf.pending.is_empty() && !buf.skipping {
            let line = std::mem::take(&mut buf.pending);
            self.emit(&mut buf, &line);
        }
    }

    /// The last lines written (stderr only), oldest first.
    pub fn tail(&self) -> Vec<String> {
        let buf = self.buffer.lock().unwrap_or_else(|p| p.into_inner());
        buf.tail.iter().cloned().collect()
    }
}

impl IsTerminal for RankStream {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for RankStream {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

impl OutputStream for RankStream {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        self.push(&bytes)
            .map_err(|hit| StreamError::Trap(wasmtime::Error::new(hit)))
    }
    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }
    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(WRITE_PERMIT)
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for RankStream {
    async fn ready(&mut self) {}
}

impl tokio::io::AsyncWrite for RankStream {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Poll::Ready(
            self.push(buf)
                .map(|()| buf.len())
                .map_err(std::io::Error::other),
        )
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Collect(Mutex<Vec<(u32, Stream, String)>>);
    impl OutputSink for Collect {
        fn line(&self, rank: u32, stream: Stream, line: &str) {
            self.0.lock().unwrap().push((rank, stream, line.to_owned()));
        }
    }

    fn stream(
        stream: Stream,
        sink: Arc<Collect>,
        max_line: usize,
        rate: Option<u64>,
    ) -> RankStream {
        let limits = Arc::new(RankOutputLimits {
            budget: Mutex::new(rate.map(OutputBudget::new)),
            max_line,
            on_line: Box::new(|| {}),
        });
        RankStream::new(3, stream, sink, limits)
    }

    #[test]
    fn splits_lines_across_writes_and_flushes_the_rest() {
        let sink = Arc::new(Collect::default());
        let s = stream(Stream::Stderr, sink.clone(), 1024, None);
        s.push(b"hel").unwrap();
        s.push(b"lo\nwor").unwrap();
        s.push(b"ld\r\n\nlast").unwrap();
        s.finish();
        let lines: Vec<String> = sink.0.lock().unwrap().iter().map(|l| l.2.clone()).collect();
        assert_eq!(lines, ["hello", "world", "", "last"]);
        assert_eq!(s.tail(), ["hello", "world", "", "last"]);
    }

    #[test]
    fn cuts_overlong_lines_and_drops_their_rest() {
        let sink = Arc::new(Collect::default());
        let s = stream(Stream::Stdout, sink.clone(), 10, None);
        s.push(&[b'x'; 25]).unwrap();
        s.push(b"yy\nshort\n").unwrap();
        s.finish();
        let lines: Vec<String> = sink.0.lock().unwrap().iter().map(|l| l.2.clone()).collect();
        assert_eq!(lines, ["xxxxxxxxxx [line cut at 10 bytes]", "short"]);
    }

    #[test]
    fn a_flood_hits_the_output_limit() {
        let sink = Arc::new(Collect::default());
        let s = stream(Stream::Stdout, sink, 1024, Some(100));
        assert!(s.push(&[b'a'; 300]).is_ok());
        assert!(
            s.push(&[b'a'; 300])
                .unwrap_err()
                .to_string()
                .contains("output limit")
        );
    }
}
