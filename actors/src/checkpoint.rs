//! Durable checkpoints: the committed model state (weights, optimizer moments, step) and the
//! epoch log so far, written every K epochs by the coordinator to one file per epoch
//! (`checkpoint-EEEEEEEE.ckpt`: temporary file, fsync, rename, fsync of the folder), of which
//! the last K are kept (`keep`), and from which a whole run restarts (`--resume`), e.g. after
//! the coordinator's node died. Every partition's replica and optimizer state are identical
//! after a step, so one snapshot is the model state of the whole run; beside it the file
//! holds each partition's own state where the run keeps one (`--grad-codec` residuals, the
//! halo rows held for the next epoch with `--staleness`/`--skip-threshold`, skip records), so
//! a resumed run equals the uninterrupted one with those settings too.
//!
//! Every byte a resume depends on is covered by a BLAKE3 digest checked before anything is
//! decoded: the file is `MAGIC | version u32 | payload length u64 | digest | payload` (little
//! endian), the digest taken over everything before it and the payload (the rkyv archive of
//! weights, moments, step count, epoch log, configuration and data digest). A file that fails
//! the check is never used: reading falls back to the next older kept checkpoint, saying so,
//! and fails naming every file and what is wrong with it when none is intact.
use crate::replica::{ReplicaBytes, Snapshot};
use crate::ActorError;
use rkyv::{Archive, Deserialize, Serialize};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use trellis_gpu::Tensor;
use trellis_runtime::partition::{DirLock, LockMode};
use trellis_runtime::{EpochLog, TrainConfig};

/// File names are `{CHECKPOINT_PREFIX}{epoch:08}{CHECKPOINT_SUFFIX}` inside the folder.
pub const CHECKPOINT_PREFIX: &str = "checkpoint-";
/// See [`CHECKPOINT_PREFIX`].
pub const CHECKPOINT_SUFFIX: &str = ".ckpt";
/// The first bytes of every checkpoint file.
pub const MAGIC: &[u8; 8] = b"TRELCKPT";
/// 7: a partition's state whose held blocks and skip records carry a `mirror` flag (always
/// off in a checkpoint, which holds every row; replicas may leave mirrored rows out); 6 had
/// its raw section before its archive (5 had it after; 5 and later: skip records as the rows
/// sent where the codec has fixed widths, else int8; 4 had them all in int8, 3 in f32, 2 had
/// no partition's own state): refused, as any other version.
const VERSION: u32 = 7;
/// Magic, version, payload length, digest.
const HEAD: usize = 8 + 4 + 8 + 32;
/// The file older builds wrote (no integrity digest): refused with a clear message.
const LEGACY_FILE: &str = "checkpoint.rkyv";

#[derive(Archive, Serialize, Deserialize)]
struct Mat {
    rows: u32,
    cols: u32,
    data: Vec<f32>,
}

#[derive(Archive, Serialize, Deserialize)]
struct CheckpointFile {
    /// The training configuration with `epochs` and `threads` cleared (a resumed run may
    /// train longer, and results do not depend on the thread count).
    config_json: String,
    data_digest: String,
    parts: u32,
    epoch: u32,
    digest: String,
    params: Vec<Mat>,
    moments: Vec<(Mat, Mat)>,
    opt_steps: u64,
    logs_json: String,
    /// Each partition's own state (ascending partition; empty when the run keeps none): its
    /// replica wire form ([`ReplicaBytes`]) without the model.
    part_states: Vec<Vec<u8>>,
}

/// A checkpoint in memory.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// The model state every partition shares (its per-partition fields empty).
    pub snapshot: Snapshot,
    /// Each partition's own state, by partition (empty when the run keeps none); the model
    /// fields of these are empty.
    pub part_states: Vec<Snapshot>,
    pub logs: Vec<EpochLog>,
    pub config: TrainConfig,
    pub data_digest: String,
    pub parts: usize,
}

fn mat(t: &Tensor) -> Mat {
    Mat {
        rows: t.rows() as u32,
        cols: t.cols() as u32,
        data: t.as_slice().to_vec(),
    }
}

fn tensor(m: Mat, path: &Path) -> Result<Tensor, ActorError> {
    Tensor::from_vec(m.rows as usize, m.cols as usize, m.data)
        .map_err(|e| bad(path, format!("corrupt tensor: {e}")))
}

fn bad(path: &Path, m: impl std::fmt::Display) -> ActorError {
    ActorError::Checkpoint {
        path: path.to_path_buf(),
        detail: m.to_string(),
    }
}

/// What must match for a checkpoint to be resumed: everything but `epochs` (a resumed run may
/// train longer) and `threads` (every kernel is bit-identical at any thread count).
fn config_key(cfg: &TrainConfig) -> String {
    let mut c = cfg.clone();
    c.epochs = 0;
    c.threads = 0;
    serde_json::to_string(&c).expect("a config serialises")
}

/// The path of the checkpoint of `epoch` in `dir`.
pub fn checkpoint_path(dir: &Path, epoch: u32) -> PathBuf {
    dir.join(format!("{CHECKPOINT_PREFIX}{epoch:08}{CHECKPOINT_SUFFIX}"))
}

/// The checkpoints in `dir`, newest (highest epoch) first.
fn list(dir: &Path) -> Result<Vec<(u32, PathBuf)>, ActorError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(bad(dir, e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| bad(dir, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let epoch = name
            .strip_prefix(CHECKPOINT_PREFIX)
            .and_then(|r| r.strip_suffix(CHECKPOINT_SUFFIX))
            .and_then(|e| e.parse::<u32>().ok());
        if let Some(epoch) = epoch {
            found.push((epoch, entry.path()));
        }
    }
    found.sort_by_key(|f| std::cmp::Reverse(f.0));
    Ok(found)
}

/// The digest of a file's head (before the digest field) and payload.
fn digest_of(head: &[u8], payload: &[u8]) -> blake3::Hash {
    let mut h = blake3::Hasher::new();
    h.update(&head[..HEAD - 32]);
    h.update(payload);
    h.finalize()
}

/// A checkpoint read back, and the newer ones that were skipped because they failed their
/// integrity check (path, reason).
#[derive(Debug)]
pub struct Resumable {
    pub checkpoint: Checkpoint,
    pub path: PathBuf,
    pub skipped: Vec<(PathBuf, String)>,
}

/// `snap` without its model (weights, moments): the partition's own state.
fn own_state(snap: &Snapshot) -> Snapshot {
    Snapshot {
        params: Vec::new(),
        opt_state: Vec::new(),
        ..snap.clone()
    }
}

/// `snap` without the partition's own state: the model every partition shares.
fn model_state(snap: &Snapshot) -> Snapshot {
    Snapshot {
        grad_residual: Vec::new(),
        held_halo: Vec::new(),
        skip_sent: Vec::new(),
        ..snap.clone()
    }
}

impl Checkpoint {
    /// The committed state of partition `part`: the shared model with its own state.
    pub fn snapshot_for(&self, part: u32) -> Snapshot {
        let mut s = self.snapshot.clone();
        if let Some(own) = self.part_states.get(part as usize) {
            s.grad_residual = own.grad_residual.clone();
            s.held_halo = own.held_halo.clone();
            s.skip_sent = own.skip_sent.clone();
        }
        s
    }

    /// Writes the checkpoint into `dir` atomically (a reader sees the old files or the new
    /// one) and keeps the `keep` newest checkpoints there (at least 1). A full disk is an
    /// error naming the file and saying so.
    pub fn write(&self, dir: &Path, keep: usize) -> Result<PathBuf, ActorError> {
        std::fs::create_dir_all(dir).map_err(|e| bad(dir, e))?;
        let bytes = self.to_bytes();
        let path = checkpoint_path(dir, self.snapshot.epoch);
        let tmp = path.with_extension("ckpt.tmp");
        let write = || -> std::io::Result<()> {
            let mut f = File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)?;
            // The rename is durable once the folder is synced.
            File::open(dir)?.sync_all()
        };
        if let Err(e) = write() {
            let _ = std::fs::remove_file(&tmp);
            return Err(bad(&path, e));
        }
        for (_, old) in list(dir)?.into_iter().skip(keep.max(1)) {
            if let Err(e) = std::fs::remove_file(&old) {
                tracing::warn!("cannot remove the old checkpoint {}: {e}", old.display());
            }
        }
        Ok(path)
    }

    /// The checkpoint's file content: head (magic, version, payload length, digest) and the
    /// rkyv payload.
    pub fn to_bytes(&self) -> Vec<u8> {
        let s = &self.snapshot;
        let file = CheckpointFile {
            config_json: config_key(&self.config),
            data_digest: self.data_digest.clone(),
            parts: self.parts as u32,
            epoch: s.epoch,
            digest: s.digest.clone(),
            params: s.params.iter().map(mat).collect(),
            moments: s.opt_state.iter().map(|(a, b)| (mat(a), mat(b))).collect(),
            opt_steps: s.opt_steps,
            logs_json: serde_json::to_string(&self.logs).expect("logs serialise"),
            part_states: self
                .part_states
                .iter()
                .enumerate()
                .map(|(p, s)| ReplicaBytes::encode(p as u32, &own_state(s)).bytes.to_vec())
                .collect(),
        };
        let payload = rkyv::to_bytes::<rkyv::rancor::Error>(&file)
            .expect("serialising plain data into a growable buffer cannot fail");
        let mut out = Vec::with_capacity(HEAD + payload.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        let digest = digest_of(&out, &payload);
        out.extend_from_slice(digest.as_bytes());
        out.extend_from_slice(&payload);
        out
    }

    /// Reads the newest intact checkpoint in `dir`; `None` if there is none. Newer ones that
    /// fail their integrity check are skipped (and logged); if every one fails, the error
    /// names each file and its fault.
    pub fn read(dir: &Path) -> Result<Option<Self>, ActorError> {
        Ok(Self::read_latest(dir)?.map(|r| {
            for (p, why) in &r.skipped {
                let line = format!(
                    "warning: skipped checkpoint {}: {why}; resuming from {}",
                    p.display(),
                    r.path.display()
                );
                tracing::warn!("{line}");
                eprintln!("{line}");
            }
            r.checkpoint
        }))
    }

    /// As [`Checkpoint::read`], returning which file was used and which were skipped.
    pub fn read_latest(dir: &Path) -> Result<Option<Resumable>, ActorError> {
        let files = list(dir)?;
        if files.is_empty() {
            let legacy = dir.join(LEGACY_FILE);
            if legacy.exists() {
                return Err(bad(
                    &legacy,
                    "corrupt or written by an older Trellis (no integrity digest): it cannot \
                     be checked, so it is not resumed (move it away to start over)",
                ));
            }
            return Ok(None);
        }
        let mut skipped = Vec::new();
        for (_, path) in files {
            let read = std::fs::read(&path)
                .map_err(|e| bad(&path, e))
                .and_then(|b| Self::from_bytes(&b, &path));
            match read {
                Ok(checkpoint) => {
                    return Ok(Some(Resumable {
                        checkpoint,
                        path,
                        skipped,
                    }))
                }
                Err(e) => {
                    let why = e.to_string();
                    let why = why
                        .strip_prefix(&format!("checkpoint {}: ", path.display()))
                        .unwrap_or(&why)
                        .to_string();
                    skipped.push((path, why));
                }
            }
        }
        let list: Vec<String> = skipped
            .iter()
            .map(|(p, why)| format!("{}: {why}", p.display()))
            .collect();
        Err(ActorError::Cluster(format!(
            "no intact checkpoint in {} to resume from: {}",
            dir.display(),
            list.join("; ")
        )))
    }

    /// Checks and decodes a checkpoint file's bytes (`path` names them in errors). The digest
    /// is checked before anything is decoded; never panics on bad input.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self, ActorError> {
        if bytes.len() < HEAD || &bytes[..8] != MAGIC {
            return Err(bad(
                path,
                format!(
                    "not a Trellis checkpoint ({} bytes, no `TRELCKPT` header)",
                    bytes.len()
                ),
            ));
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        if version != VERSION {
            return Err(bad(
                path,
                format!(
                    "format version {version}, written by another Trellis build (this build \
                     reads {VERSION}): start over without --resume, or resume it with the \
                     build that wrote it"
                ),
            ));
        }
        let len = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
        let have = (bytes.len() - HEAD) as u64;
        if len != have {
            return Err(bad(
                path,
                format!("truncated or extended: the header declares {len} payload bytes, the file has {have}"),
            ));
        }
        let payload = &bytes[HEAD..];
        if digest_of(bytes, payload).as_bytes() != &bytes[20..HEAD] {
            return Err(bad(
                path,
                "corrupt: its content does not match its BLAKE3 digest",
            ));
        }
        let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(payload.len());
        aligned.extend_from_slice(payload);
        let f = rkyv::from_bytes::<CheckpointFile, rkyv::rancor::Error>(&aligned)
            .map_err(|e| bad(path, format!("undecodable content: {e}")))?;
        let config: TrainConfig = serde_json::from_str(&f.config_json)
            .map_err(|e| bad(path, format!("bad configuration: {e}")))?;
        let logs: Vec<EpochLog> = serde_json::from_str(&f.logs_json)
            .map_err(|e| bad(path, format!("bad epoch log: {e}")))?;
        if logs.len() != f.epoch as usize {
            return Err(bad(
                path,
                format!("{} epoch log entries for epoch {}", logs.len(), f.epoch),
            ));
        }
        let params = f
            .params
            .into_iter()
            .map(|m| tensor(m, path))
            .collect::<Result<Vec<_>, _>>()?;
        let opt_state = f
            .moments
            .into_iter()
            .map(|(a, b)| Ok((tensor(a, path)?, tensor(b, path)?)))
            .collect::<Result<Vec<_>, ActorError>>()?;
        if !f.part_states.is_empty() && f.part_states.len() != f.parts as usize {
            return Err(bad(
                path,
                format!(
                    "the state of {} partitions for a run of {}",
                    f.part_states.len(),
                    f.parts
                ),
            ));
        }
        let part_states = f
            .part_states
            .into_iter()
            .enumerate()
            .map(|(p, bytes)| {
                let digest = blake3::hash(&bytes).to_hex().to_string();
                let wire = ReplicaBytes {
                    part: p as u32,
                    epoch: f.epoch,
                    bytes: bytes.into(),
                    digest,
                };
                let own = wire.decode().map_err(|e| bad(path, e))?;
                if own.epoch != f.epoch || !own.params.is_empty() {
                    return Err(bad(
                        path,
                        format!(
                            "the state of partition {p} is of step {}, not {}",
                            own.epoch, f.epoch
                        ),
                    ));
                }
                Ok(own)
            })
            .collect::<Result<Vec<_>, ActorError>>()?;
        Ok(Checkpoint {
            snapshot: Snapshot {
                epoch: f.epoch,
                params,
                opt_state,
                opt_steps: f.opt_steps,
                digest: f.digest,
                grad_residual: Vec::new(),
                held_halo: Vec::new(),
                skip_sent: Vec::new(),
            },
            part_states,
            logs,
            config,
            data_digest: f.data_digest,
            parts: f.parts as usize,
        })
    }

    /// Checks that this checkpoint belongs to a run of `cfg` on this data and partitioning.
    pub fn check_matches(
        &self,
        dir: &Path,
        cfg: &TrainConfig,
        data_digest: &str,
        parts: usize,
    ) -> Result<(), ActorError> {
        let path = checkpoint_path(dir, self.snapshot.epoch);
        let comm = |c: &TrainConfig| {
            let halo = serde_json::to_string(&c.halo).expect("a halo config serialises");
            format!("--grad-codec {}, halo exchange {halo}", c.grad_codec)
        };
        if comm(&self.config) != comm(cfg) {
            return Err(bad(
                &path,
                format!(
                    "written by a run with other communication settings ({}; this run: {}): \
                     the partitions' held rows and residuals are those of that run",
                    comm(&self.config),
                    comm(cfg)
                ),
            ));
        }
        if config_key(&self.config) != config_key(cfg) {
            return Err(bad(
                &path,
                "written by a run with another configuration (model, seed or hyper-parameters)",
            ));
        }
        if self.data_digest != data_digest || self.parts != parts {
            return Err(bad(
                &path,
                format!(
                    "written for {} partitions of data {}, this run has {parts} of {data_digest}",
                    self.parts, self.data_digest
                ),
            ));
        }
        if self.snapshot.epoch >= cfg.epochs {
            return Err(bad(
                &path,
                format!(
                    "already at epoch {}; ask for more --epochs to continue",
                    self.snapshot.epoch
                ),
            ));
        }
        Ok(())
    }
}

/// Writes checkpoints of the state in a replica store of this process, holding the checkpoint
/// folder's lock for as long as it lives.
pub struct CheckpointWriter {
    store: std::sync::Arc<crate::replica::ReplicaStore>,
    dir: PathBuf,
    keep: usize,
    config: TrainConfig,
    data_digest: String,
    parts: usize,
    _lock: DirLock,
}

impl CheckpointWriter {
    /// A writer into `policy.dir`, holding `lock` (from [`CheckpointPolicy::lock`]).
    pub fn new(
        policy: &CheckpointPolicy,
        lock: DirLock,
        store: std::sync::Arc<crate::replica::ReplicaStore>,
        config: TrainConfig,
        data_digest: String,
        parts: usize,
    ) -> Self {
        CheckpointWriter {
            _lock: lock,
            store,
            dir: policy.dir.clone(),
            keep: policy.keep,
            config,
            data_digest,
            parts,
        }
    }

    /// Writes the state committed after `epoch` (weights `digest`) with the logs so far.
    /// `Ok(None)`: skipped, because the replica of another node's partition of that step has
    /// not reached this node yet (replication is asynchronous; the next checkpoint is
    /// written as usual) — said on stderr.
    pub fn write(
        &self,
        epoch: u32,
        digest: &str,
        logs: &[EpochLog],
    ) -> Result<Option<PathBuf>, ActorError> {
        let snap = self
            .store
            .latest()
            .filter(|s| s.epoch == epoch && s.digest == digest)
            .ok_or_else(|| {
                bad(
                    &self.dir,
                    format!("no local replica of the committed state of epoch {epoch} to write"),
                )
            })?;
        let mut part_states = Vec::new();
        if self.config.halo.holds_rows() || !self.config.grad_codec.is_none() {
            for p in 0..self.parts as u32 {
                match self.own_state_of(p, epoch, digest)? {
                    Some(s) => part_states.push(s),
                    None => {
                        let line = format!(
                            "warning: checkpoint of epoch {epoch} skipped: the replica of \
                             partition {p}'s state of that step has not reached this node yet"
                        );
                        tracing::warn!("{line}");
                        eprintln!("{line}");
                        return Ok(None);
                    }
                }
            }
        }
        Checkpoint {
            snapshot: model_state(&snap),
            part_states,
            logs: logs.to_vec(),
            config: self.config.clone(),
            data_digest: self.data_digest.clone(),
            parts: self.parts,
        }
        .write(&self.dir, self.keep)
        .map(Some)
    }

    /// Partition `part`'s own state committed after `epoch`: its snapshot here (a partition of
    /// this process) or its replica kept here (a cluster ships every replica to the
    /// coordinator's node when it checkpoints such state).
    /// `None`: not here (yet).
    fn own_state_of(
        &self,
        part: u32,
        epoch: u32,
        digest: &str,
    ) -> Result<Option<Snapshot>, ActorError> {
        let local = self
            .store
            .get(part)
            .filter(|s| s.epoch == epoch)
            .map(|s| own_state(&s));
        let state = match local {
            Some(s) => s,
            None => match self.store.remote_at(part, epoch) {
                Some(bytes) => own_state(
                    &bytes
                        .decode_in(&self.store)
                        .map_err(|e| bad(&self.dir, e))?,
                ),
                None => return Ok(None),
            },
        };
        if state.digest != digest {
            return Err(bad(
                &self.dir,
                format!("partition {part}'s state of epoch {epoch} has other weights"),
            ));
        }
        Ok(Some(state))
    }

    /// The writer as the coordinator's checkpoint callback.
    pub fn into_fn(self) -> crate::shells::coordinator::CheckpointFn {
        Box::new(move |epoch, digest, logs| self.write(epoch, digest, logs).map(|_| ()))
    }
}

/// Where and how often to checkpoint, how many to keep, and whether to resume.
#[derive(Debug, Clone)]
pub struct CheckpointPolicy {
    pub dir: PathBuf,
    /// Write after every `every` epochs (0: never write, only resume).
    pub every: u32,
    /// Keep the newest `keep` checkpoints (at least 1): a corrupt newest one falls back to
    /// the one before.
    pub keep: usize,
    /// Resume from the folder's newest intact checkpoint if there is one.
    pub resume: bool,
}

impl CheckpointPolicy {
    /// Takes the folder's lock: a second run writing the same folder is refused at once,
    /// naming the process that holds it.
    pub fn lock(&self) -> Result<DirLock, ActorError> {
        DirLock::acquire(&self.dir, LockMode::Exclusive, "checkpoint folder").map_err(|e| {
            // The error names the path already; say that it is the checkpoint folder.
            let text = e.to_string();
            let detail = text
                .strip_prefix(&format!("{}: ", self.dir.display()))
                .map(str::to_string)
                .unwrap_or(text);
            ActorError::Checkpoint {
                path: self.dir.clone(),
                detail,
            }
        })
    }
}
