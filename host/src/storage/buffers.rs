//! The buffers files are read into on their way to an object store, of
//! [`PART_SIZE`], kept and reused from one upload to the next; and a bound
//! of [`IN_FLIGHT`] requests' worth of them in use in the whole process.
//!
//! A buffer of fresh memory costs the kernel a zeroed page at each first
//! touch. Uploading 8 files of 16 MiB to moto with a new buffer per part,
//! that zeroing was 47% of the process's CPU samples (system time 84–215
//! ms against 165 ms of user time; first touches are dear on virtual
//! machines). Reused buffers are already mapped: only the first uploads of
//! a process pay for them.
//!
//! A buffer is lent out as the bytes of a request ([`Bytes::from_owner`])
//! and comes back to the pool when every clone of them is dropped. Its
//! share of the bound is held until the request is done ([`InFlight`]), not
//! until its bytes are dropped: a store may keep the bytes after the
//! request (`memory://` keeps every part until the upload completes), and
//! an upload waiting for parts it holds itself would wait forever.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError};

/// The size of a buffer: a file up to this size goes up in one request,
/// a larger one in parts of this size.
pub(super) const PART_SIZE: usize = 8 * 1024 * 1024;

/// Requests in flight in the process, and buffers kept idle: 64 MiB. Eight
/// requests of 8 MiB in flight keep an upload going (the AWS CLI sends ten
/// at a time by default).
const IN_FLIGHT: usize = 8;

/// Buffers for `size` requests at once: a permit for each request being
/// read or sent, and up to `size` buffers idle.
struct Pool {
    size: usize,
    permits: Arc<Semaphore>,
    idle: Mutex<Vec<Vec<u8>>>,
}

impl Pool {
    fn new(size: usize) -> Self {
        Self {
            size,
            permits: Arc::new(Semaphore::new(size)),
            idle: Mutex::new(Vec::new()),
        }
    }
}

fn pool() -> &'static Pool {
    static POOL: std::sync::OnceLock<Pool> = std::sync::OnceLock::new();
    POOL.get_or_init(|| Pool::new(IN_FLIGHT))
}

/// An empty buffer with room for [`PART_SIZE`] bytes, and a request's
/// share of the bound, until it is dropped or lent out with
/// [`Buffer::lend`].
pub(super) struct Buffer {
    bytes: Lent,
    permit: OwnedSemaphorePermit,
}

/// A request's share of the bound: drop it once the request is done.
pub(super) struct InFlight {
    _permit: OwnedSemaphorePermit,
}

/// The bytes lent to a request; back to the pool when dropped.
struct Lent {
    bytes: Vec<u8>,
    pool: &'static Pool,
}

impl Buffer {
    /// Wait for a buffer. A caller that holds buffers lent to requests
    /// must keep those requests going while it waits (see
    /// [`Buffer::try_take`]), or it could wait on itself.
    pub async fn take() -> Self {
        let pool = pool();
        let permit = Arc::clone(&pool.permits)
            .acquire_owned()
            .await
            .expect("the pool's semaphore is never closed");
        Self::with(pool, permit)
    }

    /// Wait for `n` buffers at once (1 ≤ `n` ≤ the pool's size), for one
    /// request of up to `n` × [`PART_SIZE`] bytes. Taken together, not
    /// one by one: two requests each holding some of the buffers the
    /// other waits for would wait forever. The caller must hold no other
    /// buffer while it waits.
    pub async fn take_many(n: usize) -> Vec<Self> {
        Self::take_many_from(pool(), n).await
    }

    async fn take_many_from(pool: &'static Pool, n: usize) -> Vec<Self> {
        let n = n.clamp(1, pool.size);
        let mut permits = Arc::clone(&pool.permits)
            .acquire_many_owned(n as u32)
            .await
            .expect("the pool's semaphore is never closed");
        let mut buffers: Vec<Self> = (1..n)
            .map(|_| {
                let one = permits.split(1).expect("n permits were acquired");
                Self::with(pool, one)
            })
            .collect();
        buffers.push(Self::with(pool, permits));
        buffers
    }

    /// A buffer if one is free now.
    pub fn try_take() -> Option<Self> {
        Self::try_take_from(pool())
    }

    fn try_take_from(pool: &'static Pool) -> Option<Self> {
        match Arc::clone(&pool.permits).try_acquire_owned() {
            Ok(permit) => Some(Self::with(pool, permit)),
            Err(TryAcquireError::NoPermits | TryAcquireError::Closed) => None,
        }
    }

    fn with(pool: &'static Pool, permit: OwnedSemaphorePermit) -> Self {
        let idle = lock(&pool.idle).pop();
        Self {
            bytes: Lent {
                bytes: idle.unwrap_or_else(|| Vec::with_capacity(PART_SIZE)),
                pool,
            },
            permit,
        }
    }

    /// The buffer's bytes, filled by the caller (never beyond
    /// [`PART_SIZE`], so that it is not reallocated). Its capacity is
    /// exactly [`PART_SIZE`]: `Vec::with_capacity` gives exactly what it
    /// is asked for, and only such buffers return to the pool.
    pub fn bytes(&mut self) -> &mut Vec<u8> {
        &mut self.bytes.bytes
    }

    /// The bytes as a request's body, and the request's share of the
    /// bound, to drop once the request is done. The buffer returns to the
    /// pool once every clone of the bytes is dropped.
    pub fn lend(self) -> (Bytes, InFlight) {
        (
            Bytes::from_owner(self.bytes),
            InFlight {
                _permit: self.permit,
            },
        )
    }
}

impl AsRef<[u8]> for Buffer {
    fn as_ref(&self) -> &[u8] {
        &self.bytes.bytes
    }
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        let mut bytes = std::mem::take(&mut self.bytes);
        // A buffer that grew was reallocated, and one the pool has no room
        // for (a store kept its bytes while others were taken): back to the
        // system.
        let mut idle = lock(&self.pool.idle);
        if bytes.capacity() == PART_SIZE && idle.len() < self.pool.size {
            bytes.clear();
            idle.push(bytes);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Only pushes and pops happen under the lock: a poisoned one holds a
    // whole list.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_bounded_and_buffers_come_back_when_their_bytes_are_dropped() {
        // A pool of its own: other tests upload through the process's.
        let pool: &'static Pool = Box::leak(Box::new(Pool::new(2)));
        let take = || Buffer::try_take_from(pool);
        let _first = take().expect("two at once");
        let mut one = take().expect("two at once");
        assert!(take().is_none(), "no more than the bound at once");
        one.bytes().extend_from_slice(b"part");
        let address = one.bytes().as_ptr();
        let (bytes, in_flight) = one.lend();
        let kept = bytes.clone();
        drop(bytes);
        assert!(take().is_none(), "the request is not done");
        // The request is done, but the store kept the bytes: the bound
        // lets another request go, with a buffer of its own.
        drop(in_flight);
        let mut other = take().expect("the request is done");
        assert_ne!(other.bytes().as_ptr(), address, "still lent");
        assert_eq!(&kept[..], b"part");
        drop(other);
        drop(kept);
        let mut again = take().expect("free");
        assert!(again.bytes().is_empty());
        assert_eq!(again.bytes().capacity(), PART_SIZE);
        let idle: Vec<*const u8> = lock(&pool.idle).iter().map(|b| b.as_ptr()).collect();
        assert!(
            again.bytes().as_ptr() == address || idle.contains(&address),
            "the lent buffer came back to the pool"
        );
    }

    #[test]
    fn buffers_for_one_request_are_taken_together() {
        use futures::FutureExt;
        let pool: &'static Pool = Box::leak(Box::new(Pool::new(3)));
        let two = Buffer::take_many_from(pool, 2)
            .now_or_never()
            .expect("three free");
        assert_eq!(two.len(), 2);
        let one = Buffer::try_take_from(pool).expect("one left");
        assert!(Buffer::try_take_from(pool).is_none());
        // Two more wait for two free at once, not for one and then one.
        let mut waiting = Box::pin(Buffer::take_many_from(pool, 2));
        let cx = &mut std::task::Context::from_waker(std::task::Waker::noop());
        assert!(waiting.as_mut().poll(cx).is_pending());
        drop(one);
        assert!(
            waiting.as_mut().poll(cx).is_pending(),
            "one is free, not two"
        );
        // Each buffer's share goes back on its own, once its request is
        // done.
        let mut two = two.into_iter();
        let (_bytes, in_flight) = two.next().unwrap().lend();
        drop(in_flight);
        let std::task::Poll::Ready(got) = waiting.as_mut().poll(cx) else {
            panic!("two are free");
        };
        assert_eq!(got.len(), 2);
        // More than the pool holds is capped at the pool, never a wait on
        // itself.
        drop((got, two));
        let all = Buffer::take_many_from(pool, 10)
            .now_or_never()
            .expect("the whole pool is free");
        assert_eq!(all.len(), 3);
    }
}
