//! Foreground work before background work on a shared CPU. Training beside serving runs
//! in Linux's `SCHED_IDLE` class, below every ordinary thread, so that whenever a thread
//! that answers queries wants a core the kernel scheduler gives it one at once, and the
//! training threads get every cycle the queries leave (where the class is refused, the
//! thread falls back to the lowest `nice`, 19). Storing the replicas that reach a cluster
//! node runs at `nice` 10 beside the training steps: it yields to them but is never starved
//! (`replica::intake`).
//!
//! Where the service's threads run ([`CpuSet`]): an HTTP worker pinned away from a busy
//! thread of the normal class (on one machine, a load generator) is not queued behind it
//! when it wakes. Linux looks for an idle core for a woken thread only while the cache
//! domain is not fully busy, and cores running `SCHED_IDLE` training count as busy there,
//! so an unpinned worker can wait out the slice of the thread that woke it. Pinning pays
//! where there are cores to spare; on two cores the pinned workers wait behind each other
//! instead (docs/benchmarks.md, run N).
//!
//! Policies and CPU masks are per thread on Linux, and new threads inherit their
//! creator's.
use std::fmt;

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

/// A set of CPUs (Linux's `cpu_set_t`, up to `CPU_SETSIZE` = 1024 CPUs), written as a
/// list like `0,2-3`.
#[derive(Clone, Copy)]
pub struct CpuSet {
    set: libc::cpu_set_t,
}

impl CpuSet {
    fn empty() -> Self {
        // SAFETY: cpu_set_t is a plain bit array; all zeroes is the empty set.
        Self {
            set: unsafe { std::mem::zeroed() },
        }
    }

    /// The set of exactly `cpus`; `None` when one is beyond `CPU_SETSIZE`.
    pub fn of(cpus: impl IntoIterator<Item = usize>) -> Option<Self> {
        let mut s = Self::empty();
        for c in cpus {
            if c >= libc::CPU_SETSIZE as usize {
                return None;
            }
            // SAFETY: `c` is below CPU_SETSIZE, so the bit is inside the array.
            unsafe { libc::CPU_SET(c, &mut s.set) };
        }
        Some(s)
    }

    /// Parses a list such as `0`, `0,2` or `1-3,6`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("`{text}` is not a CPU list like `0,2-3`: {why}");
        let mut cpus = Vec::new();
        for item in text.split(',').map(str::trim) {
            let num = |t: &str| {
                t.trim()
                    .parse::<usize>()
                    .map_err(|_| bad(&format!("`{t}` is not a CPU number")))
            };
            match item.split_once('-') {
                Some((a, b)) => {
                    let (a, b) = (num(a)?, num(b)?);
                    if a > b {
                        return Err(bad(&format!("the range `{item}` runs backwards")));
                    }
                    cpus.extend(a..=b);
                }
                None => cpus.push(num(item)?),
            }
        }
        Self::of(cpus).ok_or_else(|| bad(&format!("CPUs are numbered below {}", libc::CPU_SETSIZE)))
    }

    /// The CPUs in the set, ascending.
    pub fn cpus(&self) -> Vec<usize> {
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| self.contains(c))
            .collect()
    }

    pub fn len(&self) -> usize {
        // SAFETY: CPU_COUNT reads the bit array only.
        unsafe { libc::CPU_COUNT(&self.set) as usize }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when `cpu` is in the set.
    pub fn contains(&self, cpu: usize) -> bool {
        // SAFETY: `cpu` is checked below CPU_SETSIZE, so the bit read is inside the array.
        cpu < libc::CPU_SETSIZE as usize && unsafe { libc::CPU_ISSET(cpu, &self.set) }
    }

    /// True when every CPU of `self` is in `other`.
    pub fn is_subset_of(&self, other: &CpuSet) -> bool {
        self.cpus().into_iter().all(|c| other.contains(c))
    }

    /// The CPUs the calling thread may run on.
    pub fn of_this_thread() -> std::io::Result<Self> {
        let mut s = Self::empty();
        // SAFETY: `s.set` is a valid, writable cpu_set_t of the size passed; pid 0 is the
        // calling thread.
        let rc = unsafe {
            libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut s.set)
        };
        if rc == 0 {
            Ok(s)
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    /// Restricts the calling thread (and the threads it creates from now on) to the set.
    pub fn pin_this_thread(&self) -> std::io::Result<()> {
        // SAFETY: `self.set` is a valid cpu_set_t of the size passed; pid 0 is the calling
        // thread.
        let rc = unsafe {
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.set)
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    /// Splits the set into its last CPU and the rest: where a load generator shares the
    /// machine with the service it measures, it runs on the last CPU and the service's
    /// HTTP workers on the others. `None` below two CPUs.
    pub fn split_last(&self) -> Option<(CpuSet, CpuSet)> {
        let cpus = self.cpus();
        let (&last, rest) = cpus.split_last()?;
        if rest.is_empty() {
            return None;
        }
        Some((Self::of(rest.iter().copied())?, Self::of([last])?))
    }
}

impl fmt::Display for CpuSet {
    /// As `0,2-3`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cpus = self.cpus();
        let mut i = 0;
        let mut first = true;
        while i < cpus.len() {
            let mut j = i;
            while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
                j += 1;
            }
            if !first {
                f.write_str(",")?;
            }
            first = false;
            if j == i {
                write!(f, "{}", cpus[i])?;
            } else {
                write!(f, "{}-{}", cpus[i], cpus[j])?;
            }
            i = j + 1;
        }
        Ok(())
    }
}

impl fmt::Debug for CpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CpuSet({self})")
    }
}

impl PartialEq for CpuSet {
    fn eq(&self, other: &Self) -> bool {
        self.cpus() == other.cpus()
    }
}

impl Eq for CpuSet {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_print_and_split() {
        let s = CpuSet::parse("0,2-4, 7").unwrap();
        assert_eq!(s.cpus(), vec![0, 2, 3, 4, 7]);
        assert_eq!(s.len(), 5);
        assert_eq!(s.to_string(), "0,2-4,7");
        assert_eq!(CpuSet::parse(&s.to_string()).unwrap(), s);
        let (rest, last) = s.split_last().unwrap();
        assert_eq!(
            (rest.to_string(), last.to_string()),
            ("0,2-4".into(), "7".into())
        );
        assert!(rest.is_subset_of(&s) && !s.is_subset_of(&rest));
        assert!(CpuSet::parse("3").unwrap().split_last().is_none());
        for bad in ["", "a", "1-", "3-1", "0,,1", "5000"] {
            let e = CpuSet::parse(bad).unwrap_err();
            assert!(e.contains(&format!("`{bad}`")), "{e}");
        }
    }

    #[test]
    fn a_pinned_thread_runs_only_on_its_set_and_its_parent_keeps_its_own() {
        let before = CpuSet::of_this_thread().unwrap();
        assert!(!before.is_empty());
        let first = CpuSet::of(before.cpus().into_iter().take(1)).unwrap();
        let (pinned, inherited) = std::thread::spawn(move || {
            first.pin_this_thread().unwrap();
            let pinned = CpuSet::of_this_thread().unwrap();
            let inherited = std::thread::spawn(|| CpuSet::of_this_thread().unwrap())
                .join()
                .unwrap();
            (pinned, inherited)
        })
        .join()
        .unwrap();
        assert_eq!(pinned, first);
        assert_eq!(inherited, first);
        assert_eq!(CpuSet::of_this_thread().unwrap(), before);
        // A CPU the machine does not have is refused, not ignored.
        let beyond = CpuSet::of([libc::CPU_SETSIZE as usize - 1]).unwrap();
        std::thread::spawn(move || assert!(beyond.pin_this_thread().is_err()))
            .join()
            .unwrap();
    }

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
