//! Inference before training on a shared CPU: background work (training kernels, a model
//! swap's full recomputation) runs at a lower scheduling priority than the threads that
//! answer queries, so that when both want the cores the kernel scheduler runs the queries
//! first (Linux `nice`: a thread at nice 10 gets about a tenth of the CPU share of one at 0
//! while both are runnable, and all of it while the query threads sleep).
//!
//! Priorities are per thread on Linux, and new threads inherit their creator's.
use trellis_gpu::ThreadBudget;

/// The nice value background work runs at.
pub const BACKGROUND_NICE: i32 = 10;

/// Lowers the calling thread's priority to `nice` (never raises it: an unprivileged process
/// may not). Returns false where the system refused.
pub fn lower_this_thread(nice: i32) -> bool {
    // SAFETY: plain syscalls on the calling thread's own id; no memory is passed.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        *libc::__errno_location() = 0;
        let now = libc::getpriority(libc::PRIO_PROCESS, tid);
        if *libc::__errno_location() != 0 {
            return false;
        }
        if now >= nice {
            return true;
        }
        libc::setpriority(libc::PRIO_PROCESS, tid, nice) == 0
    }
}

/// Lowers every thread of the kernel thread pool `budget` to `nice`; returns how many
/// agreed. Queries answered from published rows do not use the pool, so they keep the
/// priority of the threads that read them.
pub fn lower_pool(budget: &ThreadBudget, nice: i32) -> usize {
    budget.install(|| {
        rayon::broadcast(|_| lower_this_thread(nice))
            .into_iter()
            .filter(|&ok| ok)
            .count()
    })
}

/// The calling thread's nice value.
pub fn this_thread_nice() -> Option<i32> {
    // SAFETY: as in `lower_this_thread`.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        *libc::__errno_location() = 0;
        let n = libc::getpriority(libc::PRIO_PROCESS, tid);
        (*libc::__errno_location() == 0).then_some(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_lowers_its_own_priority_and_not_its_parents() {
        let before = this_thread_nice().unwrap();
        let child = std::thread::spawn(|| {
            assert!(lower_this_thread(BACKGROUND_NICE));
            this_thread_nice().unwrap()
        })
        .join()
        .unwrap();
        assert!(child >= BACKGROUND_NICE);
        assert_eq!(this_thread_nice().unwrap(), before);
    }
}
