//! The receive side: one task per incoming stream, frames decoded into their final buffers.
use super::error::StopCode;
use super::node::{bump, Core, Outgoing, Peer};
use crate::wire::{ControlAssembly, Frame, FrameDecoder};
use quinn::{Connection, RecvStream};
use std::sync::Arc;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::{timeout_at, Instant};

/// Serves `conn`'s incoming unidirectional streams until it closes.
pub(crate) async fn serve(core: Arc<Core>, peer: Arc<Peer>, conn: Connection) {
    while let Ok(stream) = conn.accept_uni().await {
        core.rt
            .spawn(read_stream(core.clone(), peer.clone(), stream));
    }
}

fn drop_stream(core: &Core, peer: &Peer, recv: &mut RecvStream, code: StopCode, why: &str) {
    match code {
        StopCode::BadFrame | StopCode::Timeout => bump(&core.counters.bad_frames, 1),
        _ => bump(&core.counters.rejected_blocks, 1),
    }
    tracing::warn!(
        peer = peer.node,
        "dropped a stream from node {}: {why}",
        peer.node
    );
    let _ = recv.stop(code.varint());
}

/// Decodes the frames of one stream. A frame must arrive within the send timeout once begun;
/// a halo body waits for the peer's receive budget before its buffer is allocated and is
/// checked for admission before it is received.
async fn read_stream(core: Arc<Core>, peer: Arc<Peer>, mut recv: RecvStream) {
    let mut dec = FrameDecoder::new(core.cfg.limits);
    let mut assembly = ControlAssembly::new(core.cfg.max_message);
    let mut deadline: Option<Instant> = None;
    let mut budget: Option<OwnedSemaphorePermit> = None;
    let mut admitted = false;
    loop {
        let read = recv.read_chunk(dec.want().max(1), true);
        let res = match deadline {
            Some(d) => match timeout_at(d, read).await {
                Ok(r) => r,
                Err(_) => {
                    let why = format!("frame not received within {:?}", core.cfg.send_timeout);
                    return drop_stream(&core, &peer, &mut recv, StopCode::Timeout, &why);
                }
            },
            None => read.await,
        };
        let chunk = match res {
            Ok(Some(chunk)) => chunk,
            Ok(None) => {
                if let Err(e) = dec.handle_eof() {
                    drop_stream(&core, &peer, &mut recv, StopCode::BadFrame, &e.to_string());
                }
                return;
            }
            Err(e) => {
                tracing::debug!(peer = peer.node, "stream ended: {e}");
                return;
            }
        };
        if dec.is_idle() {
            deadline = Some(Instant::now() + core.cfg.send_timeout);
        }
        dec.handle_bytes(&chunk.bytes);
        if budget.is_none() {
            if let Some(h) = dec.header().filter(|h| h.body_len > 0) {
                let kib = h.body_len.div_ceil(1024) as u32;
                let wait = peer.budget.clone().acquire_many_owned(kib);
                match timeout_at(deadline.expect("inside a frame"), wait).await {
                    Ok(Ok(permit)) => budget = Some(permit),
                    _ => {
                        let why = format!("no receive budget for {} bytes in time", h.body_len);
                        return drop_stream(&core, &peer, &mut recv, StopCode::Timeout, &why);
                    }
                }
            }
        }
        if !admitted {
            if let Some(h) = dec.pending_halo() {
                admitted = true;
                if let Err(r) = core.inbound.admit(peer.node, h) {
                    return drop_stream(
                        &core,
                        &peer,
                        &mut recv,
                        StopCode::of_rejection(&r),
                        &r.to_string(),
                    );
                }
            }
        }
        while let Some(frame) = dec.poll_frame() {
            match frame {
                Ok(Frame::Halo(block)) => {
                    if !admitted {
                        if let Err(r) = core.inbound.admit(peer.node, &block.header) {
                            return drop_stream(
                                &core,
                                &peer,
                                &mut recv,
                                StopCode::of_rejection(&r),
                                &r.to_string(),
                            );
                        }
                    }
                    bump(&core.counters.blocks_received, 1);
                    bump(&core.counters.bytes_received, block.payload_bytes());
                    if peer.chaos.is_cut() {
                        tracing::debug!(peer = peer.node, "link cut (injected): block dropped");
                    } else {
                        core.inbound.halo(peer.node, block);
                    }
                }
                Ok(f @ (Frame::Control(_) | Frame::ControlPiece(_))) if peer.chaos.is_cut() => {
                    assembly.drop_message(matches!(f, Frame::Control(_)));
                    tracing::debug!(peer = peer.node, "link cut (injected): message dropped");
                }
                Ok(f @ (Frame::Control(_) | Frame::ControlPiece(_))) => match assembly.handle(f) {
                    Ok(Some(bytes)) => core.inbound.control(peer.node, bytes),
                    Ok(None) => {}
                    Err(e) => {
                        let why = e.to_string();
                        return drop_stream(&core, &peer, &mut recv, StopCode::BadFrame, &why);
                    }
                },
                Ok(Frame::Ping(nonce)) => {
                    peer.pending
                        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    if peer.tx.send(Outgoing::Pong(nonce)).is_err() {
                        peer.settle();
                    }
                }
                Ok(Frame::Pong(nonce)) => tracing::trace!(peer = peer.node, nonce, "pong"),
                Ok(Frame::Hello { .. } | Frame::Refused(_)) => {
                    tracing::debug!(
                        peer = peer.node,
                        "ignored a handshake frame on a data stream"
                    )
                }
                Err(e) => {
                    return drop_stream(&core, &peer, &mut recv, StopCode::BadFrame, &e.to_string())
                }
            }
        }
        if dec.is_idle() {
            deadline = None;
            budget = None;
            admitted = false;
        }
    }
}
