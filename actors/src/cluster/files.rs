//! Shipping partition files from the coordinator to a node that lacks them (or holds a copy
//! that does not match the manifest): the coordinator streams the file in chunks over the
//! ordered control stream; the node writes them to a temporary file, fsyncs, renames, and the
//! normal open path then checks the size and BLAKE3 digest recorded in the partition book.
use super::proto::ControlMsg;
use crate::ActorError;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use trellis_runtime::partition::PartInfo;
use trellis_transport::quic::QuicTransport;

/// Bytes per chunk: a file is read and sent a chunk at a time, never whole in memory.
pub const CHUNK: usize = 8 << 20;

/// Streams partition file `info` from `dir` to `node` on a thread of its own, so disk reads
/// never stall the coordinator. A failure is logged; the node then times out its setup.
pub fn serve_part(transport: Arc<QuicTransport>, node: u32, dir: PathBuf, info: PartInfo) {
    let part = info.part as u32;
    let run = move || -> Result<(), String> {
        let path = dir.join(&info.file);
        let mut f = File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let total = info.file_bytes;
        let mut offset = 0u64;
        loop {
            let mut data = vec![0u8; CHUNK.min((total - offset) as usize)];
            f.read_exact(&mut data)
                .map_err(|e| format!("{}: {e}", path.display()))?;
            let n = data.len() as u64;
            let msg = ControlMsg::PartChunk {
                part,
                offset,
                total,
                data,
            };
            transport
                .send_control(node, msg.encode())
                .map_err(|e| e.to_string())?;
            offset += n;
            if offset >= total {
                return Ok(());
            }
        }
    };
    let spawned = std::thread::Builder::new()
        .name(format!("trellis-ship-{part}"))
        .spawn(move || {
            if let Err(e) = run() {
                tracing::warn!(peer = node, "shipping partition {part} to node {node}: {e}");
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start a thread to ship partition {part}: {e}");
    }
}

/// A partition file being received.
pub struct PartDownload {
    part: u32,
    tmp: PathBuf,
    dst: PathBuf,
    file: File,
    total: u64,
    written: u64,
}

impl PartDownload {
    /// Starts receiving `info` into `dir`.
    pub fn start(dir: &Path, info: &PartInfo) -> Result<Self, ActorError> {
        let dst = dir.join(&info.file);
        let tmp = dir.join(format!("{}.part", info.file));
        let file = File::create(&tmp).map_err(|e| io(&tmp, e))?;
        Ok(PartDownload {
            part: info.part as u32,
            tmp,
            dst,
            file,
            total: info.file_bytes,
            written: 0,
        })
    }

    /// Writes one chunk; `Ok(true)` once the file is complete, synced and in place.
    pub fn chunk(&mut self, offset: u64, total: u64, data: &[u8]) -> Result<bool, ActorError> {
        if offset != self.written || total != self.total {
            return Err(ActorError::Cluster(format!(
                "partition {}: chunk at {offset} of {total} bytes, expected offset {} of {}",
                self.part, self.written, self.total
            )));
        }
        self.file.write_all(data).map_err(|e| io(&self.tmp, e))?;
        self.written += data.len() as u64;
        if self.written < self.total {
            return Ok(false);
        }
        self.file.sync_all().map_err(|e| io(&self.tmp, e))?;
        std::fs::rename(&self.tmp, &self.dst).map_err(|e| io(&self.dst, e))?;
        Ok(true)
    }
}

fn io(path: &Path, e: std::io::Error) -> ActorError {
    ActorError::Cluster(format!("{}: {e}", path.display()))
}
