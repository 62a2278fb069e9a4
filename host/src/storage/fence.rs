//! Fencing: a location written only while this host owns it.
//!
//! Whoever owns the location (see `crate::owner`) keeps the fence up to
//! date: how long ownership is known to last, or that it was lost. Every
//! write through a fenced [`super::Storage`] waits while ownership is
//! unknown (a lease that could not be renewed yet, as in a storage outage),
//! fails once it is lost, and is cancelled when ownership lapses while it
//! is in flight, so that a host that was paused (SIGSTOP, a frozen VM) and
//! wakes up after another host took over sends nothing more.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::watch;

use crate::error::Error;

#[derive(Clone, Debug)]
enum Validity {
    /// Owned at least until then; after it, unknown until news arrive.
    Until(Instant),
    /// Owned by someone else now: why, as a sentence.
    Lost(Arc<str>),
}

/// What is known of this host's ownership of a location.
#[derive(Debug)]
pub(crate) struct Fence {
    validity: watch::Sender<Validity>,
}

impl Fence {
    /// Ownership known to last until `until`.
    pub fn new(until: Instant) -> Arc<Self> {
        Arc::new(Self {
            validity: watch::Sender::new(Validity::Until(until)),
        })
    }

    /// Ownership confirmed until `until`.
    pub fn extend(&self, until: Instant) {
        self.validity.send_if_modified(|v| match v {
            Validity::Until(t) if *t < until => {
                *t = until;
                true
            }
            _ => false,
        });
    }

    /// Ownership lost: every write fails from now on, saying `reason`.
    pub fn lose(&self, reason: String) {
        self.validity.send_if_modified(|v| match v {
            Validity::Lost(_) => false,
            _ => {
                *v = Validity::Lost(reason.into());
                true
            }
        });
    }

    /// Why ownership was lost, if it was.
    pub fn lost(&self) -> Option<Arc<str>> {
        match &*self.validity.borrow() {
            Validity::Lost(reason) => Some(Arc::clone(reason)),
            Validity::Until(_) => None,
        }
    }

    /// Run the write `make()` builds while ownership holds, on behalf of
    /// `url`. If ownership lapses while it is in flight (a storage outage
    /// that delayed the lease's renewal, or a pause), the write is
    /// dropped, and made again from the start once ownership is confirmed:
    /// an outage costs time, not the run. `make` must build the whole
    /// write each time.
    pub(super) async fn guard<T, F, Fut>(&self, url: &str, mut make: F) -> Result<T, Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, Error>>,
    {
        let mut news = self.validity.subscribe();
        let fenced = |reason: &str| Error::Fenced {
            run: url.to_owned(),
            reason: reason.to_owned(),
        };
        loop {
            // Wait until ownership is known to hold.
            let mut until = loop {
                let validity = news.borrow_and_update().clone();
                match validity {
                    Validity::Lost(reason) => return Err(fenced(&reason)),
                    Validity::Until(t) if t > Instant::now() => break t,
                    Validity::Until(_) => {
                        // The sender lives as long as `self`.
                        let _ = news.changed().await;
                    }
                }
            };
            let write = make();
            tokio::pin!(write);
            loop {
                tokio::select! {
                    // A host that wakes up from a pause sees the deadline
                    // passed before it sends anything more.
                    biased;
                    _ = tokio::time::sleep_until(until.into()) => {}
                    done = &mut write => return done,
                }
                match &*news.borrow_and_update() {
                    Validity::Lost(reason) => return Err(fenced(reason)),
                    Validity::Until(t) if *t > Instant::now() => until = *t,
                    Validity::Until(_) => break,
                }
            }
            tracing::debug!(%url, "ownership lapsed during a write; waiting for the lease");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    use super::*;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
    }

    #[test]
    fn a_lost_fence_refuses_writes_and_names_the_reason() {
        let fence = Fence::new(Instant::now() + Duration::from_secs(60));
        fence.lose("another host took the run over".into());
        let made = AtomicU32::new(0);
        let result = rt().block_on(fence.guard("s3://b/run", || {
            made.fetch_add(1, Ordering::SeqCst);
            async { Ok(()) }
        }));
        let e = result.unwrap_err().to_string();
        assert!(e.contains("another host took the run over"), "{e}");
        assert_eq!(made.load(Ordering::SeqCst), 0, "nothing was sent");
    }

    #[test]
    fn a_write_in_flight_when_ownership_lapses_is_dropped_and_made_again_once_confirmed() {
        let rt = rt();
        let fence = Fence::new(Instant::now() + Duration::from_millis(50));
        let made = AtomicU32::new(0);
        let result = rt.block_on(async {
            let renew = async {
                tokio::time::sleep(Duration::from_millis(200)).await;
                fence.extend(Instant::now() + Duration::from_secs(60));
                std::future::pending::<()>().await
            };
            let write = fence.guard("s3://b/run", || {
                let n = made.fetch_add(1, Ordering::SeqCst);
                async move {
                    if n == 0 {
                        // Still in flight when ownership lapses.
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                    }
                    Ok(n)
                }
            });
            tokio::select! {
                done = write => done,
                _ = renew => unreachable!(),
            }
        });
        assert_eq!(result.unwrap(), 1, "made a second time after the renewal");
    }
}
