//! An allocator for processes that run trainhost: the system allocator,
//! with large blocks backed by transparent huge pages where the kernel
//! offers them.
//!
//! Every collective call and every checkpoint copy moves guest data
//! through host buffers the canonical ABI allocates afresh for each call
//! (a 64 MiB list is a new 64 MiB vector each time). The system allocator
//! maps blocks that large from the kernel and unmaps them on free, so each
//! call pays a page fault per 4 KiB page, a third of the time of an
//! all-reduce of 64 MiB here. Asking for huge pages on such blocks
//! (`madvise(MADV_HUGEPAGE)`, what glibc's `glibc.malloc.hugetlb=1` tunable
//! does) makes that one fault per 2 MiB.
//!
//! The `trainhost` command line installs it; a program embedding the host
//! may too:
//!
//! ```no_run
//! #[global_allocator]
//! static ALLOCATOR: trainhost::HugePageAllocator = trainhost::HugePageAllocator;
//! ```

use std::alloc::{GlobalAlloc, Layout, System};

/// Blocks from this size up are advised to use huge pages.
const LARGE: usize = 4 << 20;
/// The size of a transparent huge page on x86-64 and most arm64 kernels;
/// only whole aligned huge pages inside a block are advised.
const HUGE_PAGE: usize = 2 << 20;

/// The system allocator, with blocks of 4 MiB and more advised to use
/// transparent huge pages (see the module's description). Where the
/// kernel has them disabled the advice is ignored and nothing changes.
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

// SAFETY: every block comes from `System` and goes back to it unchanged;
// `advise` only affects how the kernel backs pages.
unsafe impl GlobalAlloc for HugePageAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is passed on.
        let ptr = unsafe { System.alloc(layout) };
        advise(ptr, layout.size());
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        advise(ptr, layout.size());
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
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
