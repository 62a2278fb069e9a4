//! Requests that never left this host, sent again.
//!
//! object_store retries a request whose connection could not be made, or
//! that the server answered with a retryable status, but not one hyper
//! cancelled before sending it: a new connection that closed before the
//! request could go out ("connection was not ready"), as when a store
//! restarts with connections waiting in its accept queue. Such a request
//! reached no server, so sending it again is safe for every operation,
//! conditional writes included; [`Resend`] does, within the storage's
//! retry budget.
//!
//! Parts of a multipart upload cannot be sent again from outside (a part
//! is numbered when it is handed to the upload), so they go back through
//! object_store's own hook for parts ([`PartRetry`]). A part is an
//! idempotent PUT of a numbered part, so any transport failure is
//! retried there, within the same budget. The request completing an
//! upload is not sent again: object_store's upload gives its list of
//! parts to the first completion.

use std::error::Error as StdError;
use std::time::{Duration, Instant};

use object_store::client::HttpErrorKind;
use object_store::retry::{RetryContext, RetryFailure, RetryPolicy};

use crate::config::StorageOptions;
use crate::error::Error;

/// The first wait before sending again; it doubles each time, up to
/// [`MAX_WAIT`]. Short: the request was not refused by a server, and a
/// store that is really down fails the next connection attempt, which
/// object_store retries with its own backoff.
const FIRST_WAIT: Duration = Duration::from_millis(50);
const MAX_WAIT: Duration = Duration::from_secs(5);

/// How often, and for how long, a request may be sent again.
#[derive(Clone, Copy, Debug)]
pub(super) struct Resend {
    max_retries: usize,
    retry_timeout: Duration,
}

impl Resend {
    /// The budget of `options`: the same as object_store's own retries.
    pub(super) fn new(options: &StorageOptions) -> Self {
        Self {
            max_retries: options.max_retries,
            retry_timeout: options.retry_timeout,
        }
    }

    /// Never again: local and in-memory stores send no requests.
    pub(super) fn never() -> Self {
        Self {
            max_retries: 0,
            retry_timeout: Duration::ZERO,
        }
    }

    /// Run the request `make()` builds until it is answered, or fails for
    /// another reason than never having been sent, or the budget is spent.
    pub(super) async fn run<T, F, Fut>(&self, mut make: F) -> Result<T, Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, Error>>,
    {
        let mut attempts = self.attempts();
        loop {
            match make().await {
                Err(e) if attempts.again(&e).await => {}
                result => return result,
            }
        }
    }

    /// The attempts of one request, for callers that cannot hand
    /// [`Resend::run`] a closure (the request borrows mutably).
    pub(super) fn attempts(&self) -> Attempts {
        Attempts {
            budget: *self,
            start: Instant::now(),
            sent_again: 0,
        }
    }

    /// The same budget for the parts of multipart uploads.
    pub(super) fn parts(&self) -> PartRetry {
        PartRetry { budget: *self }
    }
}

/// The attempts of one request so far.
pub(super) struct Attempts {
    budget: Resend,
    start: Instant,
    sent_again: usize,
}

impl Attempts {
    /// Whether to send the request that failed with `error` again; if so,
    /// after waiting a little.
    pub(super) async fn again(&mut self, error: &Error) -> bool {
        let Error::Storage {
            url,
            operation,
            source,
        } = error
        else {
            return false;
        };
        if !never_sent(source)
            || self.sent_again >= self.budget.max_retries
            || self.start.elapsed() >= self.budget.retry_timeout
        {
            return false;
        }
        self.sent_again += 1;
        tracing::info!(
            store = %url,
            "{operation}: the request was not sent ({source}); sending it again ({} of at most {})",
            self.sent_again,
            self.budget.max_retries
        );
        tokio::time::sleep(wait(self.sent_again)).await;
        true
    }
}

/// Whether `error` says hyper gave up on the request before sending it.
pub(super) fn never_sent(error: &(dyn StdError + 'static)) -> bool {
    let mut current = Some(error);
    while let Some(e) = current {
        if e.downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_canceled)
        {
            return true;
        }
        current = e.source();
    }
    false
}

/// The wait before the `n`th retry (from 1).
fn wait(n: usize) -> Duration {
    let doubled = FIRST_WAIT.saturating_mul(1 << n.saturating_sub(1).min(16));
    doubled.min(MAX_WAIT)
}

/// object_store's [`RetryPolicy`] for parts: a part whose requests failed
/// in transport (never sent, cut off, timed out) is sent again within the
/// storage's budget; an error status, already retried by object_store as
/// far as it is retryable, is final.
#[derive(Debug)]
pub(super) struct PartRetry {
    budget: Resend,
}

impl PartRetry {
    /// Whether the `attempt`th failure (from 1), `elapsed` after the
    /// part's first attempt, may be followed by another.
    fn allows(&self, failure: RetryFailure, attempt: usize, elapsed: Duration) -> bool {
        let transport = matches!(
            failure,
            RetryFailure::Transport(kind) if kind != HttpErrorKind::Decode
        );
        transport && attempt <= self.budget.max_retries && elapsed < self.budget.retry_timeout
    }
}

#[async_trait::async_trait]
impl RetryPolicy for PartRetry {
    async fn retry(&self, context: RetryContext) -> bool {
        if !self.allows(context.failure, context.attempt, context.elapsed) {
            return false;
        }
        tracing::info!(
            "a part upload failed ({:?}); sending it again ({} of at most {})",
            context.failure,
            context.attempt,
            self.budget.max_retries
        );
        tokio::time::sleep(wait(context.attempt)).await;
        true
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use hyper_util::rt::TokioIo;

    use super::*;

    /// A real cancelled request: the connection closed before hyper could
    /// hand it over, as when a store drops connections it accepted.
    async fn cancelled() -> hyper::Error {
        let (ours, theirs) = tokio::io::duplex(64);
        drop(theirs);
        let (mut send, connection) =
            hyper::client::conn::http1::handshake::<_, String>(TokioIo::new(ours))
                .await
                .expect("handshake needs no I/O");
        let _ = connection.await;
        let request = hyper::Request::new(String::new());
        let e = send
            .send_request(request)
            .await
            .expect_err("the connection is gone");
        assert!(e.is_canceled(), "{e:?}");
        e
    }

    fn storage_error(source: impl StdError + Send + Sync + 'static) -> Error {
        Error::Storage {
            url: "s3://bucket".into(),
            operation: "write x".into(),
            source: object_store::Error::Generic {
                store: "S3",
                source: Box::new(source),
            },
        }
    }

    fn budget(max_retries: usize) -> Resend {
        Resend {
            max_retries,
            retry_timeout: Duration::from_secs(60),
        }
    }

    #[tokio::test]
    async fn a_request_never_sent_is_recognised_through_object_stores_wrapping() {
        let Error::Storage { source, .. } = storage_error(cancelled().await) else {
            unreachable!()
        };
        assert!(never_sent(&source));
        let other = object_store::Error::Generic {
            store: "S3",
            source: "HTTP error: connection reset".into(),
        };
        assert!(!never_sent(&other));
    }

    #[tokio::test]
    async fn a_request_never_sent_is_sent_again_and_other_failures_are_not() {
        let tries = AtomicUsize::new(0);
        let answered = budget(3)
            .run(|| async {
                if tries.fetch_add(1, Ordering::SeqCst) < 2 {
                    Err(storage_error(cancelled().await))
                } else {
                    Ok("answered")
                }
            })
            .await;
        assert_eq!(answered.unwrap(), "answered");
        assert_eq!(tries.load(Ordering::SeqCst), 3);

        let tries = AtomicUsize::new(0);
        let refused: Result<(), Error> = budget(3)
            .run(|| async {
                tries.fetch_add(1, Ordering::SeqCst);
                Err(storage_error(std::io::Error::other("403 Forbidden")))
            })
            .await;
        assert!(refused.is_err());
        assert_eq!(tries.load(Ordering::SeqCst), 1, "sent once");
    }

    #[tokio::test]
    async fn the_budget_ends_sending_again() {
        let tries = AtomicUsize::new(0);
        let result: Result<(), Error> = budget(2)
            .run(|| async {
                tries.fetch_add(1, Ordering::SeqCst);
                Err(storage_error(cancelled().await))
            })
            .await;
        let e = result.expect_err("still not sent");
        assert!(e.to_string().contains("write x"), "{e}");
        assert_eq!(tries.load(Ordering::SeqCst), 3, "once, then twice again");
        assert!(
            Resend::never()
                .run(|| async { Err::<(), _>(storage_error(cancelled().await)) })
                .await
                .is_err()
        );
    }

    #[test]
    fn parts_are_sent_again_after_transport_failures_within_the_budget() {
        let policy = budget(2).parts();
        let second = Duration::from_secs(1);
        let unknown = RetryFailure::Transport(HttpErrorKind::Unknown);
        assert!(policy.allows(unknown, 1, second));
        assert!(policy.allows(unknown, 2, second));
        assert!(!policy.allows(unknown, 3, second), "retries spent");
        assert!(
            !policy.allows(unknown, 1, Duration::from_secs(60)),
            "retry timeout spent"
        );
        let garbled = RetryFailure::Transport(HttpErrorKind::Decode);
        assert!(!policy.allows(garbled, 1, second), "an answer came back");
    }
}
