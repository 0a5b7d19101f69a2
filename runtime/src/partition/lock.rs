//! [`DirLock`]: an advisory lock on a folder (`flock` on `FOLDER/.trellis.lock`), so that two
//! runs never write one partition or checkpoint folder at once. A writer holds it exclusively;
//! readers of a partition folder hold it shared (many runs may train from the same files, but
//! none may re-partition under them). The lock file names the last process that took it, so
//! a refusal can say who holds the folder. The kernel drops the lock when the holder exits,
//! however it exits.
use crate::{Result, RuntimeError};
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// The lock file's name inside a locked folder.
pub const LOCK_FILE: &str = ".trellis.lock";

/// How a folder is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockMode {
    /// Reading: other readers may hold it too.
    Shared,
    /// Writing: nobody else may hold it.
    Exclusive,
}

/// A held folder lock; released on drop (or when the process ends).
#[derive(Debug)]
pub struct DirLock {
    path: PathBuf,
    file: File,
    mode: LockMode,
}

impl DirLock {
    /// Takes the lock of `dir` (created if missing) in `mode`, without waiting. A folder held
    /// by another process is an error naming the folder and that process; `what` says what
    /// the folder is for ("partition folder", "checkpoint folder").
    pub fn acquire(dir: &Path, mode: LockMode, what: &str) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| RuntimeError::io(dir, e))?;
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| RuntimeError::io(&path, e))?;
        let taken = match mode {
            LockMode::Shared => file.try_lock_shared(),
            LockMode::Exclusive => file.try_lock(),
        };
        match taken {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                let holder = if holder.is_empty() {
                    "another process".to_string()
                } else {
                    holder.to_string()
                };
                return Err(RuntimeError::Config(format!(
                    "{what} {} is in use by {holder} (lock file {}); wait for it to finish or use another folder",
                    dir.display(),
                    path.display()
                )));
            }
            Err(TryLockError::Error(e)) => return Err(RuntimeError::io(&path, e)),
        }
        // Best effort: who holds it now, for the next refusal's message.
        let me = format!(
            "pid {} ({})\n",
            std::process::id(),
            std::env::args().collect::<Vec<_>>().join(" ")
        );
        let _ = file
            .set_len(0)
            .and_then(|_| file.seek(SeekFrom::Start(0)))
            .and_then(|_| file.write_all(me.as_bytes()));
        Ok(DirLock { path, file, mode })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn mode(&self) -> LockMode {
        self.mode
    }
}

/// Unlocks explicitly instead of relying on the close: a `flock` belongs to the open file
/// description, which a child forked meanwhile (a test or launcher spawning a process) shares
/// until its `exec` closes it, so a lock released by closing alone could outlive the drop
/// for that moment and refuse this same process (`in use by pid <itself>`).
impl Drop for DirLock {
    fn drop(&mut self) {
        let _ = self.file.unlock();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writers_exclude_everyone_and_readers_share() {
        let dir = tempfile::tempdir().unwrap();
        let w = DirLock::acquire(dir.path(), LockMode::Exclusive, "partition folder").unwrap();
        let e = DirLock::acquire(dir.path(), LockMode::Shared, "partition folder")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("is in use by pid") && e.contains(&std::process::id().to_string()),
            "{e}"
        );
        assert!(e.contains(&dir.path().display().to_string()), "{e}");
        drop(w);
        let r1 = DirLock::acquire(dir.path(), LockMode::Shared, "partition folder").unwrap();
        let _r2 = DirLock::acquire(dir.path(), LockMode::Shared, "partition folder").unwrap();
        assert!(DirLock::acquire(dir.path(), LockMode::Exclusive, "partition folder").is_err());
        assert_eq!(r1.mode(), LockMode::Shared);
    }

    #[test]
    fn a_dropped_lock_is_released_while_a_copy_of_its_descriptor_lives() {
        let dir = tempfile::tempdir().unwrap();
        let w = DirLock::acquire(dir.path(), LockMode::Exclusive, "partition folder").unwrap();
        // What a child forked at this moment holds until its exec.
        let inherited = w.file.try_clone().unwrap();
        drop(w);
        let again = DirLock::acquire(dir.path(), LockMode::Exclusive, "partition folder");
        assert!(again.is_ok(), "{:?}", again.err());
        drop(inherited);
    }
}
