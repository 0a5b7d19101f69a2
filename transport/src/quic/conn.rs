//! Connections: dialling, accepting, the hello exchange, and watching a connection die.
use super::error::StopCode;
use super::node::{bump, Core, Peer, Shared};
use super::tls::cert_is_for_node;
use super::QuicError;
use crate::certs::node_server_name;
use crate::wire::{encode_to_vec, Frame, FrameDecoder, Limits, PROTOCOL_VERSION};
use quinn::{Connection, ConnectionError, RecvStream};
use rustls::pki_types::CertificateDer;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::time::timeout;

const HELLO_LIMITS: Limits = Limits {
    max_meta: 1024,
    max_body: 0,
};

/// Reads one small frame (a hello) from `r`.
async fn read_frame(r: &mut RecvStream) -> Result<Frame, String> {
    let mut dec = FrameDecoder::new(HELLO_LIMITS);
    loop {
        if let Some(f) = dec.poll_frame() {
            return f.map_err(|e| e.to_string());
        }
        match r
            .read_chunk(dec.want().max(1), true)
            .await
            .map_err(|e| e.to_string())?
        {
            Some(c) => dec.handle_bytes(&c.bytes),
            None => {
                dec.handle_eof().map_err(|e| e.to_string())?;
                return Err("stream ended before the hello".into());
            }
        }
    }
}

fn hello(core: &Core) -> Vec<u8> {
    encode_to_vec(&Frame::Hello {
        node: core.me,
        protocol: PROTOCOL_VERSION,
        incarnation: core.incarnation,
    })
}

/// How the reason of a connection the peer refused starts, in dial and connection errors.
pub const REFUSED_PREFIX: &str = "refused by the peer:";

/// Why a connection ended, in words.
pub(crate) fn describe(e: &ConnectionError, core: &Core) -> String {
    match e {
        ConnectionError::TimedOut => format!(
            "no answer within the idle timeout ({:?})",
            core.cfg.idle_timeout
        ),
        // The peer said why it refused us: say it too (a node can stop retrying).
        ConnectionError::ApplicationClosed(c) if c.error_code == StopCode::Refused.varint() => {
            format!("{REFUSED_PREFIX} {}", String::from_utf8_lossy(&c.reason))
        }
        e => e.to_string(),
    }
}

impl Shared {
    /// The live connection to `peer`, dialling it (within the connect timeout) if needed.
    pub(crate) async fn connection(
        self: &Arc<Self>,
        peer: &Arc<Peer>,
    ) -> Result<Connection, QuicError> {
        if let Some(c) = peer.live_conn() {
            return Ok(c);
        }
        let _dialling = peer.dial.lock().await;
        if let Some(c) = peer.live_conn() {
            return Ok(c);
        }
        let (node, after) = (peer.node, self.core.cfg.connect_timeout);
        let (conn, incarnation) = loop {
            // Registered before the address is read, so a change after it is not missed.
            let readdressed = peer.readdressed.notified();
            let addr = peer.addr();
            tokio::select! {
                dialled = timeout(after, self.dial(node, addr)) => match dialled {
                    Err(_) => return Err(QuicError::ConnectTimeout { node, addr, after }),
                    Ok(r) => break r?,
                },
                () = readdressed => tracing::debug!(
                    peer = node,
                    "node {node} moved from {addr} to {}; dialling it there",
                    peer.addr()
                ),
            }
        };
        adopt(&self.core, peer, conn.clone(), incarnation);
        Ok(conn)
    }

    /// Dials `node` at `addr` and exchanges hellos: the connection and the incarnation of
    /// the process that answered.
    async fn dial(&self, node: u32, addr: SocketAddr) -> Result<(Connection, u64), QuicError> {
        let err = |reason: String| QuicError::Connect { node, addr, reason };
        let connecting = self
            .endpoint
            .connect_with(self.client.clone(), addr, &node_server_name(node))
            .map_err(|e| err(e.to_string()))?;
        let conn = connecting
            .await
            .map_err(|e| err(describe(&e, &self.core)))?;
        let (mut s, mut r) = conn
            .open_bi()
            .await
            .map_err(|e| err(describe(&e, &self.core)))?;
        s.write_all(&hello(&self.core))
            .await
            .map_err(|e| err(e.to_string()))?;
        let _ = s.finish();
        // A peer that refuses us closes the connection saying why: report that, not the
        // broken read.
        let frame = match read_frame(&mut r).await {
            Ok(f) => f,
            Err(e) => {
                let why = conn.close_reason().map(|c| describe(&c, &self.core));
                return Err(err(why.unwrap_or(e)));
            }
        };
        match frame {
            Frame::Hello {
                node: n,
                protocol,
                incarnation,
            } if n == node && protocol == PROTOCOL_VERSION => Ok((conn, incarnation)),
            Frame::Refused(why) => {
                conn.close(StopCode::Refused.varint(), b"told");
                Err(err(format!("{REFUSED_PREFIX} {why}")))
            }
            Frame::Hello {
                node: n, protocol, ..
            } => {
                conn.close(StopCode::Refused.varint(), b"unexpected hello");
                Err(err(format!(
                    "answered as node {n} speaking protocol {protocol}"
                )))
            }
            other => Err(err(format!("answered {other:?} instead of a hello"))),
        }
    }
}

/// Accepts connections until the endpoint closes.
pub(crate) async fn accept_loop(shared: Weak<Shared>, endpoint: quinn::Endpoint) {
    while let Some(incoming) = endpoint.accept().await {
        let Some(s) = shared.upgrade() else { break };
        let core = s.core.clone();
        core.rt
            .spawn(handle_incoming(shared.clone(), core.clone(), incoming));
    }
}

/// A refused peer is a security event: counted, and logged with its address and the reason
/// (on stderr directly where no tracing subscriber is installed).
fn refuse(core: &Core, from: SocketAddr, reason: &str) {
    bump(&core.counters.refused_handshakes, 1);
    let line = format!(
        "security: node {} refused a connection from {from}: {reason}",
        core.me
    );
    tracing::warn!(%from, "{line}");
    if !tracing::dispatcher::has_been_set() {
        use std::io::Write;
        let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
    }
    core.inbound.refused(from, reason);
}

/// Whether the process behind `conn` is alive: the peer's QUIC stack acknowledges a small
/// frame (a `Pong`, which the receiver ignores) on a new stream within four round trips
/// (at least 500 ms, at most the idle timeout). A killed or frozen process acknowledges
/// nothing.
async fn answers_probe(core: &Core, conn: &Connection) -> bool {
    let within = (conn.rtt() * 4)
        .max(Duration::from_millis(500))
        .min(core.cfg.idle_timeout);
    let probe = async {
        let mut s = conn.open_uni().await.ok()?;
        s.write_all(&encode_to_vec(&Frame::Pong(0))).await.ok()?;
        s.finish().ok()?;
        s.stopped().await.ok()
    };
    matches!(timeout(within, probe).await, Ok(Some(_)))
}

/// How the accepting side of a handshake ended.
enum Handshake {
    /// The peer is who it says it is and was answered with our hello; `peer` is its entry
    /// (an error when this node is shutting down or gone). `restart_of`: the live
    /// connection of the process this one replaces (a new incarnation at the same address).
    Accepted {
        conn: Connection,
        incarnation: u64,
        peer: Result<Arc<Peer>, String>,
        restart_of: Option<Connection>,
    },
    /// The peer said a hello we will not accept: it is told why on its hello stream.
    Refused {
        conn: Connection,
        stream: quinn::SendStream,
        why: String,
    },
}

async fn handle_incoming(shared: Weak<Shared>, core: Arc<Core>, incoming: quinn::Incoming) {
    let from = incoming.remote_address();
    let handshake = async {
        let conn = incoming
            .await
            .map_err(|e| format!("TLS handshake failed: {}", describe(&e, &core)))?;
        let (mut s, mut r) = conn.accept_bi().await.map_err(|e| describe(&e, &core))?;
        let (node, protocol, incarnation) = match read_frame(&mut r).await? {
            Frame::Hello {
                node,
                protocol,
                incarnation,
            } => (node, protocol, incarnation),
            other => return Err(format!("first message {other:?} is not a hello")),
        };
        let refused = |why: String, stream| {
            Ok(Handshake::Refused {
                conn: conn.clone(),
                stream,
                why,
            })
        };
        if protocol != PROTOCOL_VERSION {
            return refused(
                format!("node {node} speaks protocol {protocol}, this node {PROTOCOL_VERSION}"),
                s,
            );
        }
        let certs = conn
            .peer_identity()
            .and_then(|id| id.downcast::<Vec<CertificateDer<'static>>>().ok());
        if !certs
            .as_ref()
            .and_then(|c| c.first())
            .is_some_and(|c| cert_is_for_node(c, node))
        {
            return refused(
                format!(
                    "claims to be node {node} but its certificate is not for {}",
                    node_server_name(node)
                ),
                s,
            );
        }
        // A second process claiming a node id that is connected from another address (a
        // copied certificate, an operator's mistake) is refused at once, instead of taking
        // over the node's traffic.
        let peer = match shared.upgrade() {
            Some(sh) => sh.peer(node, Some(from)).map_err(|e| e.to_string()),
            None => Err(format!("node {} is gone", core.me)),
        };
        let live = peer.as_ref().ok().and_then(|p| p.live_conn());
        let other_process = peer
            .as_ref()
            .is_ok_and(|p| p.incarnation() != Some(incarnation));
        // Another address: a new process of the node bound elsewhere (a restart with port
        // 0), or a second process claiming its id. The live connection is asked to
        // acknowledge a probe: if it does, its process is alive and keeps the node's traffic.
        if let Some(old) = live.as_ref().filter(|c| c.remote_address() != from) {
            let at = old.remote_address();
            if !other_process || answers_probe(&core, old).await {
                return refused(format!("node {node} is already connected from {at}"), s);
            }
            tracing::debug!(
                peer = node,
                "node {node}'s connection from {at} acknowledged no probe: its process is gone"
            );
        }
        // Another incarnation whose old connection is gone: at the same address, the process
        // that held it released the port this one is bound to; elsewhere, it did not answer
        // the probe. Either way it is gone, whatever its connection still looks like before
        // the idle timeout.
        let restart_of = live.filter(|_| other_process);
        let policy = shared
            .upgrade()
            .and_then(|sh| sh.returns.lock().expect("poisoned").clone());
        if let Some(why) = policy.and_then(|refuse| refuse(node, restart_of.is_some())) {
            if let (Some(old), Ok(p)) = (&restart_of, &peer) {
                lose_process(&core, p, p.incarnation(), old, from);
            }
            return refused(why, s);
        }
        s.write_all(&hello(&core))
            .await
            .map_err(|e| e.to_string())?;
        let _ = s.finish();
        Ok(Handshake::Accepted {
            conn,
            incarnation,
            peer,
            restart_of,
        })
    };
    match timeout(core.cfg.connect_timeout, handshake).await {
        Err(_) => refuse(
            &core,
            from,
            &format!("no hello within {:?}", core.cfg.connect_timeout),
        ),
        Ok(Err(reason)) => refuse(&core, from, &reason),
        Ok(Ok(Handshake::Refused { conn, stream, why })) => {
            refuse(&core, from, &why);
            tell_refused(&core, conn, stream, &why).await;
        }
        Ok(Ok(Handshake::Accepted {
            conn,
            incarnation,
            peer,
            restart_of,
        })) => match peer {
            Ok(peer) => {
                tracing::debug!(peer = peer.node, %from, "accepted connection");
                if let Some(old) = restart_of {
                    replace_restarted(&core, &peer, old, conn, incarnation);
                } else {
                    adopt(&core, &peer, conn, incarnation);
                }
            }
            Err(e) => conn.close(StopCode::Shutdown.varint(), e.as_bytes()),
        },
    }
}

/// Answers a refused hello with `Refused{why}` on its stream and waits (up to the connect
/// timeout) for the dialler to close the connection once it has read it; then closes it with
/// the reason too. A `CONNECTION_CLOSE` alone is sent once and forgotten after a few probe
/// timeouts: a dialler that was not scheduled meanwhile (a loaded machine) would see only a
/// stateless reset, not the reason, and keep retrying.
async fn tell_refused(core: &Core, conn: Connection, mut stream: quinn::SendStream, why: &str) {
    let told = async {
        stream
            .write_all(&encode_to_vec(&Frame::Refused(why.to_string())))
            .await
            .ok()?;
        stream.finish().ok()?;
        conn.closed().await;
        Some(())
    };
    let _ = timeout(core.cfg.connect_timeout, told).await;
    conn.close(StopCode::Refused.varint(), why.as_bytes());
}

/// Makes `conn` (to the process `incarnation` of the peer) `peer`'s connection unless it has
/// a live one, serves its incoming streams and watches it close.
///
/// A current connection that has closed but whose watcher has not yet run (it then finds
/// the connection no longer current and says nothing) is reported here: when a restarted
/// process binds its old port, the old connection's next packets reach the new process,
/// which resets it, and its hello can come before the watcher runs.
pub(crate) fn adopt(core: &Arc<Core>, peer: &Arc<Peer>, conn: Connection, incarnation: u64) {
    let closed = {
        let mut current = peer.conn.lock().expect("poisoned");
        if current.as_ref().is_none_or(|c| c.close_reason().is_some()) {
            let old = current.replace(conn.clone());
            let gone = peer
                .incarnation
                .lock()
                .expect("poisoned")
                .replace(incarnation);
            old.and_then(|c| c.close_reason()).map(|err| (err, gone))
        } else {
            None
        }
    };
    if let Some((err, gone)) = closed {
        let mut reason = describe(&err, core);
        if gone != Some(incarnation) {
            let from = conn.remote_address();
            reason = format!(
                "a new process of it connected from {from} (the old one is gone: {reason})"
            );
        }
        report_closed(core, peer, &err, gone, reason);
    }
    serve_and_watch(core, peer, conn);
}

/// `peer`'s current connection to the process `process` closed with `err`: a graceful
/// close is a departure, anything else the process's loss, reported with `reason`.
fn report_closed(
    core: &Core,
    peer: &Peer,
    err: &ConnectionError,
    process: Option<u64>,
    reason: String,
) {
    let graceful = match err {
        ConnectionError::LocallyClosed => true,
        ConnectionError::ApplicationClosed(c) => c.error_code == StopCode::Shutdown.varint(),
        _ => false,
    };
    if graceful || core.closing.load(Ordering::Relaxed) {
        tracing::debug!(peer = peer.node, "connection closed: {err}");
        if matches!(err, ConnectionError::ApplicationClosed(_)) {
            let _ = core.departures.send(peer.node);
        }
        return;
    }
    *peer.lost.lock().expect("poisoned") = process;
    report_lost(core, peer, reason);
}

/// `peer`'s process is lost, for `reason`.
fn report_lost(core: &Core, peer: &Peer, reason: String) {
    let (node, addr) = (peer.node, peer.addr());
    core.fail(peer, QuicError::PeerLost { node, addr, reason });
}

/// A new process of `peer` connected from the address of its live connection `old`: the old
/// process is lost (reported at once, as the idle timeout would report it later, unless it
/// was declared lost already: `QuicNode::declare_lost`), and `conn` replaces its connection.
fn replace_restarted(
    core: &Arc<Core>,
    peer: &Arc<Peer>,
    old: Connection,
    conn: Connection,
    incarnation: u64,
) {
    let gone = {
        let mut current = peer.conn.lock().expect("poisoned");
        *current = Some(conn.clone());
        peer.incarnation
            .lock()
            .expect("poisoned")
            .replace(incarnation)
    };
    lose_process(core, peer, gone, &old, conn.remote_address());
    serve_and_watch(core, peer, conn);
}

/// The process `gone` behind `old`, `peer`'s connection until a new process of it said
/// hello from `from`, is lost: `old` is closed (its watcher ends quietly, as it is no longer
/// current) and the process reported lost, unless it was known lost already.
fn lose_process(core: &Core, peer: &Peer, gone: Option<u64>, old: &Connection, from: SocketAddr) {
    let known = gone.is_some() && {
        let mut lost = peer.lost.lock().expect("poisoned");
        let known = *lost == gone;
        *lost = gone;
        known
    };
    {
        let mut current = peer.conn.lock().expect("poisoned");
        if current
            .as_ref()
            .is_some_and(|c| c.stable_id() == old.stable_id())
        {
            *current = None;
        }
    }
    old.close(StopCode::Shutdown.varint(), b"replaced by a new process");
    if known {
        tracing::debug!(
            peer = peer.node,
            "a new process of node {} replaced one already lost",
            peer.node
        );
        return;
    }
    let reason = format!("a new process of it connected from {from} (the old one is gone)");
    report_lost(core, peer, reason);
}

fn serve_and_watch(core: &Arc<Core>, peer: &Arc<Peer>, conn: Connection) {
    core.rt
        .spawn(super::recv::serve(core.clone(), peer.clone(), conn.clone()));
    core.rt.spawn(watch(core.clone(), peer.clone(), conn));
}

async fn watch(core: Arc<Core>, peer: Arc<Peer>, conn: Connection) {
    let err = conn.closed().await;
    let was_current = {
        let mut current = peer.conn.lock().expect("poisoned");
        let same = current
            .as_ref()
            .is_some_and(|c| c.stable_id() == conn.stable_id());
        if same {
            *current = None;
        }
        same
    };
    if !was_current {
        tracing::debug!(peer = peer.node, "connection closed: {err}");
        return;
    }
    let reason = describe(&err, &core);
    report_closed(&core, &peer, &err, peer.incarnation(), reason);
}
