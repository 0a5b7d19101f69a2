//! Durable checkpoints: the committed model state (weights, optimizer moments, step) and the
//! epoch log so far, written every K epochs by the coordinator to one file (temporary file,
//! fsync, rename, fsync of the folder), from which a whole run restarts (`--resume`), e.g.
//! after the coordinator's node died. Every partition's replica and optimizer state are
//! identical after a step, so one snapshot is the state of the whole run.
use crate::replica::Snapshot;
use crate::ActorError;
use rkyv::{Archive, Deserialize, Serialize};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use trellis_gpu::Tensor;
use trellis_runtime::{EpochLog, TrainConfig};

/// The file name inside the checkpoint folder.
pub const CHECKPOINT_FILE: &str = "checkpoint.rkyv";
const VERSION: u32 = 1;

#[derive(Archive, Serialize, Deserialize)]
struct Mat {
    rows: u32,
    cols: u32,
    data: Vec<f32>,
}

#[derive(Archive, Serialize, Deserialize)]
struct CheckpointFile {
    version: u32,
    /// The training configuration with `epochs` set to 0 (a resumed run may train longer).
    config_json: String,
    data_digest: String,
    parts: u32,
    epoch: u32,
    digest: String,
    params: Vec<Mat>,
    moments: Vec<(Mat, Mat)>,
    opt_steps: u64,
    logs_json: String,
}

/// A checkpoint in memory.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub snapshot: Snapshot,
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

fn config_key(cfg: &TrainConfig) -> String {
    let mut c = cfg.clone();
    c.epochs = 0;
    serde_json::to_string(&c).expect("a config serialises")
}

impl Checkpoint {
    /// Writes the checkpoint into `dir` atomically: a reader sees the old or the new one.
    pub fn write(&self, dir: &Path) -> Result<PathBuf, ActorError> {
        std::fs::create_dir_all(dir).map_err(|e| bad(dir, e))?;
        let bytes = self.to_bytes();
        let path = dir.join(CHECKPOINT_FILE);
        let tmp = dir.join(format!("{CHECKPOINT_FILE}.tmp"));
        let write = || -> std::io::Result<()> {
            let mut f = File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)?;
            // The rename is durable once the folder is synced.
            File::open(dir)?.sync_all()
        };
        write().map_err(|e| bad(&path, e))?;
        Ok(path)
    }

    /// The checkpoint's archived bytes (the file's content).
    pub fn to_bytes(&self) -> Vec<u8> {
        let s = &self.snapshot;
        let file = CheckpointFile {
            version: VERSION,
            config_json: config_key(&self.config),
            data_digest: self.data_digest.clone(),
            parts: self.parts as u32,
            epoch: s.epoch,
            digest: s.digest.clone(),
            params: s.params.iter().map(mat).collect(),
            moments: s.opt_state.iter().map(|(a, b)| (mat(a), mat(b))).collect(),
            opt_steps: s.opt_steps,
            logs_json: serde_json::to_string(&self.logs).expect("logs serialise"),
        };
        rkyv::to_bytes::<rkyv::rancor::Error>(&file)
            .map(|b| b.into_vec())
            .expect("serialising plain data into a growable buffer cannot fail")
    }

    /// Reads `dir`'s checkpoint; `None` if there is none. A corrupt file is an error.
    pub fn read(dir: &Path) -> Result<Option<Self>, ActorError> {
        let path = dir.join(CHECKPOINT_FILE);
        match std::fs::read(&path) {
            Ok(b) => Self::from_bytes(&b, &path).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(bad(&path, e)),
        }
    }

    /// Decodes archived bytes (`path` names them in errors); never panics on bad input.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self, ActorError> {
        let path = path.to_path_buf();
        let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(bytes.len());
        aligned.extend_from_slice(bytes);
        let f = rkyv::from_bytes::<CheckpointFile, rkyv::rancor::Error>(&aligned)
            .map_err(|e| bad(&path, format!("corrupt or truncated: {e}")))?;
        if f.version != VERSION {
            return Err(bad(
                &path,
                format!("format version {} (this build reads {VERSION})", f.version),
            ));
        }
        let config: TrainConfig = serde_json::from_str(&f.config_json)
            .map_err(|e| bad(&path, format!("bad configuration: {e}")))?;
        let logs: Vec<EpochLog> = serde_json::from_str(&f.logs_json)
            .map_err(|e| bad(&path, format!("bad epoch log: {e}")))?;
        let params = f
            .params
            .into_iter()
            .map(|m| tensor(m, &path))
            .collect::<Result<Vec<_>, _>>()?;
        let opt_state = f
            .moments
            .into_iter()
            .map(|(a, b)| Ok((tensor(a, &path)?, tensor(b, &path)?)))
            .collect::<Result<Vec<_>, ActorError>>()?;
        Ok(Checkpoint {
            snapshot: Snapshot {
                epoch: f.epoch,
                params,
                opt_state,
                opt_steps: f.opt_steps,
                digest: f.digest,
            },
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
        let path = dir.join(CHECKPOINT_FILE);
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

/// Writes checkpoints of the state in a replica store of this process.
pub struct CheckpointWriter {
    pub store: std::sync::Arc<crate::replica::ReplicaStore>,
    pub dir: PathBuf,
    pub config: TrainConfig,
    pub data_digest: String,
    pub parts: usize,
}

impl CheckpointWriter {
    /// Writes the state committed after `epoch` (weights `digest`) with the logs so far.
    pub fn write(
        &self,
        epoch: u32,
        digest: &str,
        logs: &[EpochLog],
    ) -> Result<PathBuf, ActorError> {
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
        Checkpoint {
            snapshot: (*snap).clone(),
            logs: logs.to_vec(),
            config: self.config.clone(),
            data_digest: self.data_digest.clone(),
            parts: self.parts,
        }
        .write(&self.dir)
    }

    /// The writer as the coordinator's checkpoint callback.
    pub fn into_fn(self) -> crate::shells::coordinator::CheckpointFn {
        Box::new(move |epoch, digest, logs| self.write(epoch, digest, logs).map(|_| ()))
    }
}

/// Where and how often to checkpoint, and whether to resume.
#[derive(Debug, Clone)]
pub struct CheckpointPolicy {
    pub dir: PathBuf,
    /// Write after every `every` epochs (0: never write, only resume).
    pub every: u32,
    /// Resume from the folder's checkpoint if there is one.
    pub resume: bool,
}
