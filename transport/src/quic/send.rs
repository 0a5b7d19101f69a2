//! The send side: one writer task per peer. Halo blocks go out on their own unidirectional
//! streams, up to `send_streams` at once, their buffers handed to quinn without a copy;
//! control messages share one ordered stream per connection (one over the envelope limit in
//! pieces, back to back); bulk control messages go one at a time on streams of their own at
//! a lower priority than both.
use super::error::StopCode;
use super::node::{bump, Core, Outgoing, Peer, Shared};
use super::QuicError;
use crate::wire::{control_frames, encode_head, encode_to_vec, halo_body, Envelope, Frame};
use crate::HaloBlock;
use bytes::Bytes;
use quinn::{Connection, SendStream, WriteError};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use tokio::sync::{mpsc, Semaphore};
use tokio::time::timeout;

fn write_error(core: &Core, peer: &Peer, e: WriteError) -> QuicError {
    match e {
        WriteError::ConnectionLost(c) => QuicError::PeerLost {
            node: peer.node,
            addr: peer.addr(),
            reason: super::conn::describe(&c, core),
        },
        e => QuicError::Send {
            node: peer.node,
            addr: peer.addr(),
            reason: e.to_string(),
        },
    }
}

/// Sends what is queued for `peer` until the queue closes.
pub(crate) async fn writer(
    shared: Weak<Shared>,
    peer: Arc<Peer>,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
) {
    let mut slots: Option<Arc<Semaphore>> = None;
    let bulk = Arc::new(Semaphore::new(1));
    let mut control: Option<(usize, SendStream)> = None;
    while let Some(msg) = rx.recv().await {
        let bytes = msg.bytes();
        let Some(s) = shared.upgrade() else { break };
        let core = s.core.clone();
        let slots = slots
            .get_or_insert_with(|| Arc::new(Semaphore::new(core.cfg.send_streams.max(1))))
            .clone();
        if peer.failure().is_some() {
            peer.queued.fetch_sub(bytes, Ordering::SeqCst);
            peer.settle();
            continue;
        }
        let conn = match s.connection(&peer).await {
            Ok(c) => c,
            Err(e) => {
                core.fail(&peer, e);
                peer.queued.fetch_sub(bytes, Ordering::SeqCst);
                peer.settle();
                continue;
            }
        };
        drop(s);
        match msg {
            Outgoing::Halo(block) => {
                let permit = slots.acquire_owned().await.expect("never closed");
                peer.queued.fetch_sub(bytes, Ordering::SeqCst);
                let (core, peer, shared) = (core.clone(), peer.clone(), shared.clone());
                let corrupt = peer.chaos.take_corrupt();
                core.rt.clone().spawn(async move {
                    let halo = HaloChunks::of(block, corrupt);
                    let r = on_current(&shared, &peer, conn, |c| {
                        send_halo(&core, &peer, c, halo.clone())
                    })
                    .await;
                    if let Err(e) = r {
                        core.fail(&peer, e);
                    }
                    drop(permit);
                    peer.settle();
                });
            }
            Outgoing::Control(b) => {
                peer.queued.fetch_sub(bytes, Ordering::SeqCst);
                // The pieces of one message go back to back: this task is the control
                // stream's only writer.
                let frames = control_frames(b, core.cfg.control_piece());
                let mut r = send_frames(&core, &peer, &conn, &mut control, &frames).await;
                if r.is_err() {
                    if let Some(next) = resend_on(&shared, &peer, &conn).await {
                        r = match next {
                            Ok(c) => {
                                let again = send_frames(&core, &peer, &c, &mut control, &frames);
                                forgive_superseded(&peer, &c, again.await)
                            }
                            Err(e) => Err(e),
                        };
                    }
                }
                if let Err(e) = r {
                    core.fail(&peer, e);
                }
                peer.settle();
            }
            Outgoing::Bulk(b) => {
                peer.queued.fetch_sub(bytes, Ordering::SeqCst);
                let (core, peer, bulk) = (core.clone(), peer.clone(), bulk.clone());
                let shared = shared.clone();
                core.rt.clone().spawn(async move {
                    let permit = bulk.acquire_owned().await.expect("never closed");
                    let r = on_current(&shared, &peer, conn, |c| {
                        send_bulk(&core, &peer, c, b.clone())
                    })
                    .await;
                    if let Err(e) = r {
                        core.fail(&peer, e);
                    }
                    drop(permit);
                    peer.settle();
                });
            }
            Outgoing::Pong(n) => {
                let _ = send_small(&core, &peer, &conn, &mut control, &Frame::Pong(n)).await;
                peer.settle();
            }
        }
    }
}

/// Whether `conn` is no longer `peer`'s connection on purpose: a new process of the peer
/// replaced it, or it was dropped as a lost process's (`QuicNode::reset_peer`). A connection
/// that died by itself is still current until its watcher reports the loss.
fn superseded(peer: &Peer, conn: &Connection) -> bool {
    let current = peer.conn.lock().expect("poisoned");
    match current.as_ref() {
        Some(c) => c.stable_id() != conn.stable_id(),
        None => matches!(
            conn.close_reason(),
            Some(quinn::ConnectionError::LocallyClosed)
        ),
    }
}

/// Runs `send` on `conn`; when that fails because `conn` was superseded (the message was
/// on its way to a process that is gone), once more on the peer's current connection (the
/// node's new process, dialled if needed).
async fn on_current<F, Fut>(
    shared: &Weak<Shared>,
    peer: &Arc<Peer>,
    conn: Connection,
    send: F,
) -> Result<(), QuicError>
where
    F: Fn(Connection) -> Fut,
    Fut: std::future::Future<Output = Result<(), QuicError>>,
{
    let first = send(conn.clone()).await;
    if first.is_err() {
        if let Some(next) = resend_on(shared, peer, &conn).await {
            return match next {
                Ok(c) => forgive_superseded(peer, &c, send(c.clone()).await),
                Err(e) => Err(e),
            };
        }
    }
    first
}

/// Where to send again a message whose send on `conn` failed: `None` when `conn` was not
/// superseded (the failure is the peer's), else the peer's current connection.
async fn resend_on(
    shared: &Weak<Shared>,
    peer: &Arc<Peer>,
    conn: &Connection,
) -> Option<Result<Connection, QuicError>> {
    if !superseded(peer, conn) {
        return None;
    }
    let s = shared.upgrade()?;
    Some(s.connection(peer).await)
}

/// An error on a connection superseded again is not the peer's failure either: the message
/// is dropped, as one to a lost process is.
fn forgive_superseded(
    peer: &Peer,
    conn: &Connection,
    r: Result<(), QuicError>,
) -> Result<(), QuicError> {
    match r {
        Err(e) if superseded(peer, conn) => {
            tracing::debug!(peer = peer.node, "dropped a message superseded twice: {e}");
            Ok(())
        }
        r => r,
    }
}

/// The frames of one control message, back to back on the control stream.
async fn send_frames(
    core: &Core,
    peer: &Peer,
    conn: &Connection,
    control: &mut Option<(usize, SendStream)>,
    frames: &[Frame],
) -> Result<(), QuicError> {
    for frame in frames {
        send_small(core, peer, conn, control, frame).await?;
    }
    Ok(())
}

/// Halo streams, as the control stream, have quinn's default priority.
const HALO_PRIORITY: i32 = 0;

/// Below halo streams and the control stream: quinn sends a lower-priority stream's data
/// only when the higher ones have none ready.
const BULK_PRIORITY: i32 = -1;

/// Sends one control frame on a new low-priority stream and waits until the peer
/// acknowledged it, within the send timeout.
async fn send_bulk(
    core: &Core,
    peer: &Peer,
    conn: Connection,
    body: Vec<u8>,
) -> Result<(), QuicError> {
    let mut frames: Vec<Bytes> = control_frames(body, core.cfg.control_piece())
        .iter()
        .map(|f| Bytes::from(encode_to_vec(f)))
        .collect();
    let bytes: usize = frames.iter().map(Bytes::len).sum();
    send_on_new_stream(core, peer, &conn, &mut frames, BULK_PRIORITY, || {
        format!("a {bytes}-byte bulk message")
    })
    .await
    .map(drop)
}

/// Writes `chunks` on a new stream of `priority`, finishes it and waits until the peer
/// acknowledged all of it (`None`) or stopped it (`Some(code)`), within the send timeout
/// (`what` names the message in the timeout error).
async fn send_on_new_stream(
    core: &Core,
    peer: &Peer,
    conn: &Connection,
    chunks: &mut [Bytes],
    priority: i32,
    what: impl FnOnce() -> String,
) -> Result<Option<quinn::VarInt>, QuicError> {
    let after = core.cfg.send_timeout;
    let work = async {
        let mut s = conn
            .open_uni()
            .await
            .map_err(|e| write_error(core, peer, WriteError::ConnectionLost(e)))?;
        let _ = s.set_priority(priority);
        s.write_all_chunks(chunks)
            .await
            .map_err(|e| write_error(core, peer, e))?;
        let _ = s.finish();
        s.stopped().await.map_err(|e| QuicError::Send {
            node: peer.node,
            addr: peer.addr(),
            reason: e.to_string(),
        })
    };
    timeout(after, work).await.unwrap_or_else(|_| {
        Err(QuicError::SendTimeout {
            node: peer.node,
            addr: peer.addr(),
            what: what(),
            after,
        })
    })
}

/// Writes a small frame on the connection's control stream (opened on first use).
async fn send_small(
    core: &Core,
    peer: &Peer,
    conn: &Connection,
    control: &mut Option<(usize, SendStream)>,
    frame: &Frame,
) -> Result<(), QuicError> {
    let after = core.cfg.send_timeout;
    let data = encode_to_vec(frame);
    let work = async {
        if control
            .as_ref()
            .is_none_or(|(id, _)| *id != conn.stable_id())
        {
            let s = conn
                .open_uni()
                .await
                .map_err(|e| write_error(core, peer, WriteError::ConnectionLost(e)))?;
            *control = Some((conn.stable_id(), s));
        }
        let (_, s) = control.as_mut().expect("just opened");
        s.write_all(&data)
            .await
            .map_err(|e| write_error(core, peer, e))
    };
    match timeout(after, work).await {
        Ok(r) => r,
        Err(_) => {
            *control = None;
            Err(QuicError::SendTimeout {
                node: peer.node,
                addr: peer.addr(),
                what: "a control message".into(),
                after,
            })
        }
    }
}

/// A halo block as it goes on the wire (cheap to clone: shared buffers), for partition `to`.
#[derive(Clone)]
struct HaloChunks {
    to: crate::PartId,
    bytes: u64,
    chunks: [Bytes; 2],
}

impl HaloChunks {
    fn of(block: HaloBlock, corrupt: bool) -> Self {
        let (to, bytes) = (block.header.to, block.payload_bytes());
        let mut head = encode_head(&Envelope::halo(&block), bytes);
        if corrupt {
            super::chaos::corrupt_head(&mut head);
        }
        HaloChunks {
            to,
            bytes,
            chunks: [Bytes::from(head), halo_body(&block.payload)],
        }
    }
}

/// Sends one block on a new stream and waits until the peer acknowledged all of it (or
/// refused it), within the send timeout.
async fn send_halo(
    core: &Core,
    peer: &Peer,
    conn: Connection,
    halo: HaloChunks,
) -> Result<(), QuicError> {
    let HaloChunks {
        to,
        bytes,
        mut chunks,
    } = halo;
    let stopped = send_on_new_stream(core, peer, &conn, &mut chunks, HALO_PRIORITY, || {
        format!("a {bytes}-byte block for partition {to}")
    })
    .await?;
    match stopped {
        None => {
            bump(&core.counters.blocks_sent, 1);
            bump(&core.counters.bytes_sent, bytes);
            Ok(())
        }
        Some(code) => {
            bump(&core.counters.rejected_by_peer, 1);
            let why = StopCode::from_code(code.into_inner())
                .map_or(format!("code {code}"), |c| format!("{c:?}"));
            tracing::warn!(
                peer = peer.node,
                "node {} refused a block for partition {to}: {why}",
                peer.node
            );
            Ok(())
        }
    }
}
