//! Inference before training on a shared CPU: background work (training beside serving)
//! runs in Linux's `SCHED_IDLE` class, below every ordinary thread, so that whenever a
//! thread that answers queries wants a core the kernel scheduler gives it one at once, and
//! the training threads get every cycle the queries leave (where the class is refused, the
//! thread falls back to the lowest `nice`, 19).
//!
//! Policies are per thread on Linux, and new threads inherit their creator's.
use trellis_gpu::ThreadBudget;

/// How a thread was put in the background.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Background {
    /// The `SCHED_IDLE` class.
    Idle,
    /// `nice 19` in the normal class.
    Nice,
    /// Neither was allowed.
    Refused,
}

fn tid() -> libc::pid_t {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as libc::pid_t }
}

/// How far into the background to go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// `SCHED_IDLE`: runs only on cycles no ordinary thread wants (also other processes'
    /// threads: on a machine shared with other work, training can starve).
    Idle,
    /// The normal class at this nice value (10: about a tenth of a nice-0 thread's share
    /// while both are runnable).
    Nice(i32),
}

/// Puts the calling thread (and the threads it creates from now on) in the background.
pub fn background_this_thread() -> Background {
    background_this_thread_as(Class::Idle)
}

/// As [`background_this_thread`], in `class`.
pub fn background_this_thread_as(class: Class) -> Background {
    let param = libc::sched_param { sched_priority: 0 };
    let nice = match class {
        Class::Idle => 19,
        Class::Nice(n) => n,
    };
    // SAFETY: `param` is a valid sched_param for the call's duration; the calls act on the
    // calling thread's own id only.
    unsafe {
        if class == Class::Idle && libc::sched_setscheduler(tid(), libc::SCHED_IDLE, &param) == 0 {
            return Background::Idle;
        }
        if libc::setpriority(libc::PRIO_PROCESS, tid() as libc::id_t, nice) == 0 {
            return Background::Nice;
        }
    }
    Background::Refused
}

/// Puts every thread of the kernel thread pool `budget` in the background; returns what
/// each got. Queries answered from published rows do not use the pool, so their threads
/// keep their class.
pub fn background_pool(budget: &ThreadBudget) -> Vec<Background> {
    background_pool_as(budget, Class::Idle)
}

/// As [`background_pool`], in `class`.
pub fn background_pool_as(budget: &ThreadBudget, class: Class) -> Vec<Background> {
    budget.install(|| rayon::broadcast(|_| background_this_thread_as(class)))
}

/// True when the calling thread is in the `SCHED_IDLE` class.
pub fn this_thread_is_idle_class() -> bool {
    // SAFETY: a query of the calling thread's own policy.
    unsafe { libc::sched_getscheduler(tid()) == libc::SCHED_IDLE }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_goes_to_the_background_and_its_parent_does_not() {
        let parent = this_thread_is_idle_class();
        let (got, idle, inherited) = std::thread::spawn(|| {
            let got = background_this_thread();
            let idle = this_thread_is_idle_class();
            let inherited = std::thread::spawn(this_thread_is_idle_class)
                .join()
                .unwrap();
            (got, idle, inherited)
        })
        .join()
        .unwrap();
        assert_ne!(got, Background::Refused);
        if got == Background::Idle {
            assert!(idle && inherited);
        }
        assert_eq!(this_thread_is_idle_class(), parent);
    }
}
