//! Memory hints for the large host row tables (a serving partition's layer, pre-activation
//! and feature tables: 1 KB rows at random places of tables of a GB). An update reads and
//! writes a few thousand such rows; with 4 KB pages each one misses the TLB as well as the
//! cache, so the tables ask for transparent huge pages, and the loops over rows prefetch the
//! next rows while they work on one. Both are hints: where the kernel has no transparent huge
//! pages (or the CPU no prefetch instruction) nothing changes but speed.
//!
//! Written here because no maintained crate offers either on a plain `Vec` (`memmap2`
//! advises only its own mappings; the rows live in `Vec<f32>` tables shared with the rest of
//! the runtime).

/// Tables smaller than this keep their pages (a few calls per table are not worth it, and
/// small tables fit the TLB anyway).
const MIN_BYTES: usize = 64 << 20;

/// `MADV_COLLAPSE` of Linux 6.1 (`libc` names it for glibc targets only; older kernels
/// answer EINVAL, which leaves the pages as they are).
#[cfg(target_os = "linux")]
const MADV_COLLAPSE: libc::c_int = 25;

/// Asks the kernel to back the allocation of `v` with transparent huge pages: its whole
/// capacity for pages touched later (`MADV_HUGEPAGE`), and its present values now
/// (`MADV_COLLAPSE`, Linux 6.1 and later; it copies the pages already touched into huge
/// ones). Call it once a large table is allocated and again when it moves; errors (a kernel
/// without transparent huge pages, or with them disabled) leave the pages as they are.
pub fn prefer_huge_pages(v: &[f32], capacity: usize) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let bytes = capacity * std::mem::size_of::<f32>();
        if bytes < MIN_BYTES {
            return;
        }
        let start = v.as_ptr() as usize;
        // The 2 MB-aligned pieces inside the allocation (a hint cannot split a huge page
        // with the allocator's neighbours).
        let first = start.next_multiple_of(HUGE);
        let end_of = |len: usize| (start + len * std::mem::size_of::<f32>()) & !(HUGE - 1);
        let (all_end, used_end) = (end_of(capacity), end_of(v.len()));
        // SAFETY: both ranges lie inside `v`'s allocation of `capacity` values (rounded inwards
        // to 2 MB boundaries). Neither advice changes the memory's contents or its mapping's
        // protection: MADV_HUGEPAGE marks the range eligible for huge pages, MADV_COLLAPSE
        // copies present pages into huge pages with the same values (the kernel keeps them
        // consistent for concurrent readers, and `v` is borrowed, so no writer runs).
        unsafe {
            if all_end > first {
                libc::madvise(
                    first as *mut libc::c_void,
                    all_end - first,
                    libc::MADV_HUGEPAGE,
                );
            }
            if used_end > first {
                libc::madvise(first as *mut libc::c_void, used_end - first, MADV_COLLAPSE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (v, capacity);
}

/// Starts loading `row` into the cache (every 64-byte line of it), for a loop that will
/// read or write it a few rows later.
#[inline]
pub fn prefetch(row: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for line in row.chunks(16) {
        // SAFETY: `_mm_prefetch` needs SSE, which every x86_64 CPU has; it only hints the
        // cache, reads nothing the program sees and cannot fault (the address is in `row`).
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr().cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

#[cfg(test)]
mod tests {
    /// The hints change no value, on a table large enough to take them (and on one too
    /// small to); prefetching any row, the last included, is harmless.
    #[test]
    fn hints_leave_every_value_as_it_was() {
        for n in [1000, (80 << 20) / 4] {
            let mut v: Vec<f32> = (0..n).map(|i| i as f32).collect();
            v.reserve(1 << 20);
            super::prefer_huge_pages(&v, v.capacity());
            for row in v.chunks(256) {
                super::prefetch(row);
            }
            assert!(
                v.iter().enumerate().all(|(i, &x)| x == i as f32),
                "{n} values"
            );
        }
    }
}
