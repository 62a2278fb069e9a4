//! An allocator for processes that run trainhost: the system allocator,
//! with large blocks backed by transparent huge pages where the kernel
//! offers them, and very large freed blocks kept a moment for reuse.
//!
//! Every collective call and every checkpoint copy moves guest data
//! through host buffers the canonical ABI allocates afresh for each call
//! (a 64 MiB list is a new 64 MiB vector each time). The system allocator
//! maps blocks that large from the kernel and unmaps them on free, so each
//! call pays a page fault per 4 KiB page, a third of the time of an
//! all-reduce of 64 MiB here. Asking for huge pages on such blocks
//! (`madvise(MADV_HUGEPAGE)`, what glibc's `glibc.malloc.hugetlb=1` tunable
//! does) makes that one fault per 2 MiB. The kernel still zeroes every
//! fresh page, a seventh of that all-reduce's time; so a freed block of
//! [`KEEP_FROM`] bytes or more is kept on a shelf (at most [`KEEP_BYTES`]
//! in all) and handed to the next allocation of exactly its size (zeroed
//! here if zeroed memory was asked for), and one
//! not taken within [`KEEP_FOR`] goes back to the system at the next large
//! allocation or free. A loop that all-reduces the same buffer every step
//! then reuses the same pages. The price: up to that bound of memory the
//! process already used stays mapped while no large block is allocated or
//! freed (jemalloc, for comparison, keeps freed pages 10 s by default).
//!
//! The `trainhost` command line installs it; a program embedding the host
//! may too:
//!
//! ```no_run
//! #[global_allocator]
//! static ALLOCATOR: trainhost::HugePageAllocator = trainhost::HugePageAllocator;
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Blocks from this size up are advised to use huge pages.
const LARGE: usize = 4 << 20;
/// The size of a transparent huge page on x86-64 and most arm64 kernels;
/// only whole aligned huge pages inside a block are advised.
const HUGE_PAGE: usize = 2 << 20;

/// Freed blocks from this size up are kept for reuse: below it the system
/// allocator keeps freed blocks itself (glibc raises its mmap threshold up
/// to 32 MiB as blocks are freed).
const KEEP_FROM: usize = 16 << 20;
/// At most this many bytes are kept, in at most [`SLOTS`] blocks.
const KEEP_BYTES: usize = 512 << 20;
const SLOTS: usize = 16;
/// A kept block not reused within this long is returned to the system.
const KEEP_FOR: Duration = Duration::from_secs(1);

/// The system allocator, with blocks of 4 MiB and more advised to use
/// transparent huge pages, and freed blocks of 16 MiB and more kept a
/// second for an allocation of the same size (see the module's
/// description). Where the kernel has no huge pages the advice is ignored.
#[derive(Debug, Default, Clone, Copy)]
pub struct HugePageAllocator;

/// Advise the whole huge pages inside `[ptr, ptr + size)`.
fn advise(ptr: *mut u8, size: usize) {
    if ptr.is_null() || size < LARGE {
        return;
    }
    let start = (ptr as usize).next_multiple_of(HUGE_PAGE);
    let end = (ptr as usize + size) / HUGE_PAGE * HUGE_PAGE;
    if end > start {
        // SAFETY: the range lies inside a block the system allocator just
        // handed out; the advice changes how its pages are backed, not its
        // contents. A failure (no THP support) leaves things as they were.
        let _ = unsafe {
            rustix::mm::madvise(
                start as *mut std::ffi::c_void,
                end - start,
                rustix::mm::Advice::LinuxHugepage,
            )
        };
    }
}

/// A freed block waiting for reuse.
struct Kept {
    ptr: *mut u8,
    layout: Layout,
    since: Instant,
}

/// The kept blocks.
struct Shelf {
    slots: [Option<Kept>; SLOTS],
    bytes: usize,
}

// SAFETY: a kept block belongs to no thread; only the shelf's lock holder
// touches the pointer, to hand the block out or free it.
unsafe impl Send for Shelf {}

static SHELF: Mutex<Shelf> = Mutex::new(Shelf::new());

/// Blocks a shelf operation found kept longer than [`KEEP_FOR`], to free
/// once the lock is released.
type Expired = [Option<Kept>; SLOTS];

impl Shelf {
    const fn new() -> Self {
        Shelf {
            slots: [const { None }; SLOTS],
            bytes: 0,
        }
    }

    /// Move blocks kept longer than [`KEEP_FOR`] at `now` into `expired`.
    fn expire(&mut self, now: Instant, expired: &mut Expired) {
        for (slot, out) in self.slots.iter_mut().zip(expired.iter_mut()) {
            if slot
                .as_ref()
                .is_some_and(|k| now.duration_since(k.since) >= KEEP_FOR)
            {
                *out = slot.take();
                self.bytes -= out.as_ref().map_or(0, |k| k.layout.size());
            }
        }
    }

    /// A kept block of exactly `layout`, if there is one.
    fn take(&mut self, layout: Layout, now: Instant, expired: &mut Expired) -> Option<*mut u8> {
        self.expire(now, expired);
        let slot = self
            .slots
            .iter_mut()
            .find(|s| s.as_ref().is_some_and(|k| k.layout == layout));
        let taken = slot.and_then(Option::take)?;
        self.bytes -= taken.layout.size();
        Some(taken.ptr)
    }

    /// Keep the freed block `ptr` of `layout` if there is room; false if
    /// the caller must free it.
    fn keep(&mut self, ptr: *mut u8, layout: Layout, now: Instant, expired: &mut Expired) -> bool {
        self.expire(now, expired);
        if self.bytes + layout.size() > KEEP_BYTES {
            return false;
        }
        let Some(slot) = self.slots.iter_mut().find(|s| s.is_none()) else {
            return false;
        };
        *slot = Some(Kept {
            ptr,
            layout,
            since: now,
        });
        self.bytes += layout.size();
        true
    }
}

/// Run `f` on the process's shelf, then free what expired.
fn with_shelf<R>(f: impl FnOnce(&mut Shelf, Instant, &mut Expired) -> R) -> R {
    let mut expired = [const { None }; SLOTS];
    let r = {
        // Nothing in the shelf's code panics; a poisoned lock still guards
        // a consistent shelf.
        let mut shelf = SHELF.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut shelf, Instant::now(), &mut expired)
    };
    free(expired);
    r
}

/// A kept block of exactly `layout`, if it is large enough to be kept and
/// one is waiting.
fn shelved(layout: Layout) -> Option<*mut u8> {
    if layout.size() < KEEP_FROM {
        return None;
    }
    with_shelf(|shelf, now, expired| shelf.take(layout, now, expired))
}

/// Give `blocks` back to the system (outside the shelf's lock: unmapping
/// takes a while).
fn free(blocks: Expired) {
    for k in blocks.into_iter().flatten() {
        // SAFETY: the block came from `System` with this layout and was
        // freed by its owner; the shelf held the only pointer to it.
        unsafe { System.dealloc(k.ptr, k.layout) }
    }
}

// SAFETY: every block comes from `System` and goes back to it unchanged, to
// the caller who asked for its layout or to `System`; `advise` only affects
// how the kernel backs pages.
unsafe impl GlobalAlloc for HugePageAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if let Some(ptr) = shelved(layout) {
            return ptr;
        }
        // SAFETY: the caller's contract is passed on.
        let ptr = unsafe { System.alloc(layout) };
        advise(ptr, layout.size());
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // A kept block is zeroed here: the same work the kernel does for
        // fresh pages, without the faults. Taking kept blocks for zeroed
        // requests too keeps the shelf from filling up with blocks freed
        // after such requests while nothing takes them.
        if let Some(ptr) = shelved(layout) {
            // SAFETY: the block is `layout.size()` bytes, and now the
            // caller's alone.
            unsafe { ptr.write_bytes(0, layout.size()) };
            return ptr;
        }
        // SAFETY: as for `alloc`.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        advise(ptr, layout.size());
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if layout.size() >= KEEP_FROM
            && with_shelf(|shelf, now, expired| shelf.keep(ptr, layout, now, expired))
        {
            return;
        }
        // SAFETY: as for `alloc`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let ptr = unsafe { System.realloc(ptr, layout, new_size) };
        advise(ptr, new_size);
        ptr
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block's address for the shelf's own tests: never dereferenced,
    /// never freed.
    fn fake(i: usize) -> *mut u8 {
        std::ptr::without_provenance_mut(4096 * (i + 1))
    }

    fn layout(size: usize) -> Layout {
        Layout::from_size_align(size, 64).unwrap()
    }

    #[test]
    fn a_kept_block_goes_to_the_next_allocation_of_exactly_its_layout() {
        let mut shelf = Shelf::new();
        let mut expired = [const { None }; SLOTS];
        let now = Instant::now();
        assert!(shelf.keep(fake(0), layout(KEEP_FROM), now, &mut expired));
        assert!(shelf.keep(fake(1), layout(KEEP_FROM * 2), now, &mut expired));
        assert_eq!(shelf.bytes, KEEP_FROM * 3);
        // Another size or alignment is not served from the shelf.
        assert_eq!(shelf.take(layout(KEEP_FROM + 64), now, &mut expired), None);
        let other_align = Layout::from_size_align(KEEP_FROM, 4096).unwrap();
        assert_eq!(shelf.take(other_align, now, &mut expired), None);
        assert_eq!(
            shelf.take(layout(KEEP_FROM * 2), now, &mut expired),
            Some(fake(1))
        );
        assert_eq!(shelf.take(layout(KEEP_FROM * 2), now, &mut expired), None);
        assert_eq!(shelf.bytes, KEEP_FROM);
        assert!(expired.iter().all(Option::is_none));
    }

    #[test]
    fn the_shelf_holds_at_most_its_bytes_and_slots() {
        let mut shelf = Shelf::new();
        let mut expired = [const { None }; SLOTS];
        let now = Instant::now();
        let mut kept = 0;
        for i in 0..KEEP_BYTES / KEEP_FROM + 4 {
            if shelf.keep(fake(i), layout(KEEP_FROM), now, &mut expired) {
                kept += 1;
            }
            assert!(shelf.bytes <= KEEP_BYTES);
        }
        assert_eq!(kept, SLOTS.min(KEEP_BYTES / KEEP_FROM));
        // A block larger than the whole shelf is never kept.
        let mut empty = Shelf::new();
        assert!(!empty.keep(fake(0), layout(KEEP_BYTES + 64), now, &mut expired));
        assert_eq!(empty.bytes, 0);
    }

    #[test]
    fn a_block_kept_too_long_is_handed_back_for_freeing() {
        let mut shelf = Shelf::new();
        let mut expired = [const { None }; SLOTS];
        let then = Instant::now();
        assert!(shelf.keep(fake(0), layout(KEEP_FROM), then, &mut expired));
        assert!(shelf.keep(
            fake(1),
            layout(KEEP_FROM * 2),
            then + KEEP_FOR / 2,
            &mut expired
        ));
        // The first has waited KEEP_FOR, the second not yet.
        let later = then + KEEP_FOR;
        assert_eq!(shelf.take(layout(KEEP_FROM), later, &mut expired), None);
        let gone: Vec<*mut u8> = expired.iter().flatten().map(|k| k.ptr).collect();
        assert_eq!(gone, [fake(0)]);
        assert_eq!(shelf.bytes, KEEP_FROM * 2);
        assert_eq!(
            shelf.take(layout(KEEP_FROM * 2), later, &mut expired),
            Some(fake(1))
        );
    }

    #[test]
    fn a_freed_large_block_is_handed_out_again_zeroed_if_asked() {
        // Through the process's shelf: a size no other test uses.
        let a = HugePageAllocator;
        let l = layout(KEEP_FROM + 3 * 4096);
        // SAFETY: a non-zero layout; each block is freed with it.
        unsafe {
            let p = a.alloc(l);
            assert!(!p.is_null());
            p.write_bytes(9, l.size());
            a.dealloc(p, l);
            let q = a.alloc(l);
            assert_eq!(q, p, "the kept block is handed out again");
            // Usable as a fresh block: written and read end to end.
            q.write_bytes(0xab, l.size());
            assert_eq!(*q.add(l.size() - 1), 0xab);
            a.dealloc(q, l);
            let z = a.alloc_zeroed(l);
            assert_eq!(z, p, "and to a request for zeroed memory");
            let block = std::slice::from_raw_parts(z, l.size());
            assert!(block.iter().all(|b| *b == 0));
            a.dealloc(z, l);
        }
    }

    #[test]
    fn large_blocks_are_usable_and_small_ones_untouched() {
        let a = HugePageAllocator;
        for size in [16, LARGE - 1, LARGE, 64 << 20] {
            let layout = Layout::from_size_align(size, 64).unwrap();
            // SAFETY: a non-zero layout; the block is freed with it.
            unsafe {
                let p = a.alloc(layout);
                assert!(!p.is_null());
                p.write_bytes(7, size);
                assert_eq!(*p.add(size - 1), 7);
                let q = a.realloc(p, layout, size * 2);
                assert_eq!(*q.add(size - 1), 7);
                a.dealloc(q, Layout::from_size_align(size * 2, 64).unwrap());
            }
        }
    }
}
