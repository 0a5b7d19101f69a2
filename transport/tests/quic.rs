//! Two QUIC nodes on loopback: halo exchange, control messages, admission checks, bad frames
//! on the wire, mutual-TLS refusals and peer loss. Every test is bounded by a timeout.
mod common;

use common::{block, f32s, run_id, traced_block};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use trellis_transport::certs::{node_server_name, ClusterCa, NodeIdentity};
use trellis_transport::quic::{tls, ControlRx, QuicConfig, QuicError, QuicTransport};
use trellis_transport::wire::{
    encode_to_vec, Frame, FrameDecoder, FrameHeader, FrameKind, Limits, PROTOCOL_VERSION,
};
use trellis_transport::{HaloBlock, PartId, Transport};

type Inbox = Arc<Mutex<Vec<HaloBlock>>>;

async fn bounded<T>(secs: u64, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .expect("test timed out")
}

/// Waits (bounded) until `cond` holds.
async fn until(what: &str, cond: impl Fn() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Node `id` hosting partition `part` (collected into the returned inbox).
fn node(ca: &ClusterCa, id: u32, part: u32, cfg: QuicConfig) -> (QuicTransport, Inbox) {
    let (t, _control) = QuicTransport::bind(cfg, &ca.issue_identity(id).unwrap()).unwrap();
    let inbox: Inbox = Arc::default();
    let sink = inbox.clone();
    t.register(
        PartId(part),
        Arc::new(move |b| {
            sink.lock().unwrap().push(b);
            true
        }),
    );
    t.set_epoch(run_id(), 1);
    (t, inbox)
}

/// Nodes 1 and 2, node 1 knowing node 2, and node 2's inbox of control messages.
fn control_pair() -> (QuicTransport, QuicTransport, ControlRx) {
    control_pair_with(QuicConfig::loopback())
}

fn control_pair_with(cfg: QuicConfig) -> (QuicTransport, QuicTransport, ControlRx) {
    let ca = ClusterCa::generate().unwrap();
    let (a, _) = QuicTransport::bind(cfg.clone(), &ca.issue_identity(1).unwrap()).unwrap();
    let (b, rx) = QuicTransport::bind(cfg, &ca.issue_identity(2).unwrap()).unwrap();
    a.add_peer(2, b.local_addr());
    (a, b, rx)
}

/// Nodes 1 (partition 10) and 2 (partition 20), each knowing the other.
fn pair(ca: &ClusterCa) -> ((QuicTransport, Inbox), (QuicTransport, Inbox)) {
    let (a, ia) = node(ca, 1, 10, QuicConfig::loopback());
    let (b, ib) = node(ca, 2, 20, QuicConfig::loopback());
    a.add_peer(2, b.local_addr());
    b.add_peer(1, a.local_addr());
    a.route(PartId(20), 2);
    b.route(PartId(10), 1);
    ((a, ia), (b, ib))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_exchange_halo_blocks() {
    bounded(30, async {
        let ca = ClusterCa::generate().unwrap();
        let ((a, ia), (b, ib)) = pair(&ca);
        let sent: Vec<HaloBlock> = vec![
            block(10, 20, 1, 0, 8),
            block(10, 20, 1, 3, 5),
            block(10, 20, 2, 1024, 256),
        ];
        for blk in &sent {
            a.send(blk.clone()).unwrap();
        }
        b.send(block(20, 10, 1, 7, 7)).unwrap();
        // Local delivery on the same node needs no network.
        a.send(block(10, 10, 1, 2, 2)).unwrap();
        a.flush(Duration::from_secs(10)).await.unwrap();
        b.flush(Duration::from_secs(10)).await.unwrap();
        until("blocks at node 2", || ib.lock().unwrap().len() == 3).await;
        until("blocks at node 1", || ia.lock().unwrap().len() == 2).await;
        let mut got = ib.lock().unwrap().clone();
        got.sort_by_key(|b| f32s(b).len());
        for (s, g) in sent.iter().zip(&got) {
            assert_eq!((s.header, s.rows, s.cols), (g.header, g.rows, g.cols));
            assert_eq!(f32s(s)[..], f32s(g)[..]);
            assert_eq!(
                Arc::strong_count(f32s(g)),
                2,
                "one buffer: the inbox's copy of the block and ours"
            );
        }
        assert_eq!(a.stats().blocks_sent, 3);
        assert_eq!(
            b.stats().bytes_received,
            sent.iter().map(|b| b.payload_bytes()).sum::<u64>()
        );
        assert_eq!(a.node().connected_peers(), vec![2]);
        assert_eq!(
            b.node().connected_peers(),
            vec![1],
            "one connection serves both directions"
        );
        a.close().await;
        b.close().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_messages_arrive_in_order() {
    bounded(20, async {
        let (a, _b, mut rx) = control_pair();
        for i in 0..50u32 {
            a.send_control(2, i.to_le_bytes().to_vec()).unwrap();
        }
        for i in 0..50u32 {
            let (from, bytes) = rx.recv().await.unwrap();
            assert_eq!((from, bytes), (1, i.to_le_bytes().to_vec()));
        }
    })
    .await
}

/// Bulk messages (8 MiB each, as replica pieces go) arrive whole as control messages, beside
/// ordinary control messages sent after them, and the sender's flush waits for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_messages_arrive_whole_beside_control_messages() {
    bounded(30, async {
        let (a, b, mut rx) = control_pair();
        let piece = |i: u8| vec![i; 8 << 20];
        for i in 0..3u8 {
            a.send_bulk(2, piece(i)).unwrap();
        }
        a.send_control(2, b"after".to_vec()).unwrap();
        a.flush(Duration::from_secs(20)).await.unwrap();
        let mut got = Vec::new();
        for _ in 0..4 {
            let (from, bytes) = rx.recv().await.unwrap();
            assert_eq!(from, 1);
            got.push(bytes);
        }
        assert!(got.contains(&b"after".to_vec()));
        for i in 0..3u8 {
            assert!(got.contains(&piece(i)), "bulk message {i} arrived whole");
        }
        a.close().await;
        b.close().await;
    })
    .await
}

/// Control messages over the 16 MiB envelope limit travel in pieces: they arrive whole and
/// in order among small ones, on the ordered stream and as bulk messages; one over the
/// message limit is refused at once, naming the peer and the sizes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_messages_over_the_envelope_limit_arrive_whole_and_in_order() {
    bounded(60, async {
        let cfg = QuicConfig {
            max_message: 40 << 20,
            ..QuicConfig::loopback()
        };
        let (a, b, mut rx) = control_pair_with(cfg);
        let big = |i: u8, len: usize| -> Vec<u8> {
            (0..len).map(|j| i.wrapping_add((j % 251) as u8)).collect()
        };
        let sent = vec![
            b"first".to_vec(),
            big(1, (16 << 20) + 3),
            b"between".to_vec(),
            big(2, 40 << 20),
            b"last".to_vec(),
        ];
        for m in &sent {
            a.send_control(2, m.clone()).unwrap();
        }
        for (i, m) in sent.iter().enumerate() {
            let (from, bytes) = rx.recv().await.unwrap();
            assert_eq!(from, 1);
            assert!(
                bytes == *m,
                "message {i}: {} bytes, sent {}",
                bytes.len(),
                m.len()
            );
        }
        a.send_bulk(2, big(3, 20 << 20)).unwrap();
        a.flush(Duration::from_secs(30)).await.unwrap();
        assert!(
            rx.recv().await.unwrap().1 == big(3, 20 << 20),
            "bulk arrived whole"
        );
        for e in [
            a.send_control(2, vec![0; (40 << 20) + 1]).unwrap_err(),
            a.send_bulk(2, vec![0; (40 << 20) + 1]).unwrap_err(),
        ] {
            let text = e.to_string();
            assert!(
                text.contains("node 2") && text.contains("41943041"),
                "{text}"
            );
        }
        a.close().await;
        b.close().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_partitions_runs_and_stale_epochs_are_refused() {
    bounded(20, async {
        let ca = ClusterCa::generate().unwrap();
        let ((a, _), (b, ib)) = pair(&ca);
        b.set_epoch(run_id(), 5);
        a.route(PartId(99), 2); // node 2 does not host 99
        a.send(block(10, 99, 5, 4, 4)).unwrap();
        a.send(block(10, 20, 4, 4, 4)).unwrap(); // stale
        let mut other_run = block(10, 20, 5, 4, 4);
        other_run.header.run = uuid::Uuid::from_bytes([9; 16]);
        a.send(other_run).unwrap();
        a.send(block(10, 20, 5, 4, 4)).unwrap(); // fine
        a.flush(Duration::from_secs(10)).await.unwrap();
        until("refusals counted", || b.stats().rejected_blocks == 3).await;
        until("the good block", || ib.lock().unwrap().len() == 1).await;
        let f = b.filter_stats();
        assert_eq!(
            (
                f.unknown_partition,
                f.stale_epoch,
                f.unknown_run,
                f.accepted
            ),
            (1, 1, 1, 1)
        );
        assert!(
            a.stats().rejected_by_peer <= 3,
            "the sender hears of refusals only before all is acknowledged"
        );
        assert!(
            a.node().peer_failure(2).is_none(),
            "refused blocks do not fail the peer"
        );
    })
    .await
}

/// A raw client connection with identity `id` (or none), trusting `trust`, that performs the
/// hello exchange as node `claim`; a refusal is `Err("refused: <reason>")`.
async fn raw_client(
    trust: &ClusterCa,
    id: Option<&NodeIdentity>,
    claim: u32,
    server: (u32, SocketAddr),
) -> Result<(quinn::Endpoint, quinn::Connection), String> {
    raw_client_reading_after(trust, id, claim, server, Duration::ZERO).await
}

/// [`raw_client`] that waits `delay` after sending its hello before reading the answer (a
/// dialler the machine did not schedule for a while).
async fn raw_client_reading_after(
    trust: &ClusterCa,
    id: Option<&NodeIdentity>,
    claim: u32,
    server: (u32, SocketAddr),
    delay: Duration,
) -> Result<(quinn::Endpoint, quinn::Connection), String> {
    let rustls_cfg = tls::client_config(&trust.cert_der(), id, tls::ALPN).unwrap();
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(rustls_cfg).unwrap();
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    ep.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
    let work = async {
        let conn = ep
            .connect(server.1, &node_server_name(server.0))
            .map_err(|e| e.to_string())?
            .await
            .map_err(|e| e.to_string())?;
        let (mut s, mut r) = conn.open_bi().await.map_err(|e| e.to_string())?;
        s.write_all(&encode_to_vec(&Frame::Hello {
            node: claim,
            protocol: PROTOCOL_VERSION,
            incarnation: 1,
        }))
        .await
        .map_err(|e| e.to_string())?;
        s.finish().map_err(|e| e.to_string())?;
        tokio::time::sleep(delay).await;
        let reply = r.read_to_end(1024).await.map_err(|e| e.to_string())?;
        let mut dec = FrameDecoder::new(Limits::default());
        dec.handle_bytes(&reply);
        match dec.poll_frame() {
            Some(Ok(Frame::Hello { .. })) => Ok(conn),
            Some(Ok(Frame::Refused(why))) => Err(format!("refused: {why}")),
            other => Err(format!("answered {other:?}")),
        }
    };
    let conn = tokio::time::timeout(Duration::from_secs(10), work)
        .await
        .map_err(|_| "timed out".to_string())??;
    Ok((ep, conn))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_refuses_foreign_and_missing_certificates() {
    bounded(30, async {
        let ca = ClusterCa::generate().unwrap();
        let ((a, _), (b, ib)) = pair(&ca);
        let server = (2, b.local_addr());
        let foreign = ClusterCa::generate().unwrap().issue_identity(3).unwrap();
        raw_client(&ca, Some(&foreign), 3, server)
            .await
            .expect_err("foreign CA accepted");
        until("first refusal", || b.stats().refused_handshakes == 1).await;
        raw_client(&ca, None, 3, server)
            .await
            .expect_err("client without certificate accepted");
        until("second refusal", || b.stats().refused_handshakes == 2).await;
        // A genuine node 3 claiming to be node 1 is refused too, and told why on its hello
        // stream even when it reads the answer long after the refusal (far beyond the few
        // probe timeouts a closed QUIC connection is remembered for).
        let three = ca.issue_identity(3).unwrap();
        let why =
            raw_client_reading_after(&ca, Some(&three), 1, server, Duration::from_millis(800))
                .await
                .expect_err("impersonation accepted");
        assert!(
            why.starts_with("refused: claims to be node 1 but its certificate is not for"),
            "{why}"
        );
        until("refusals counted", || b.stats().refused_handshakes == 3).await;
        // ...and a good client is still served.
        raw_client(&ca, Some(&three), 3, server)
            .await
            .expect("node 3 refused");
        a.send(block(10, 20, 1, 2, 2)).unwrap();
        a.flush(Duration::from_secs(10)).await.unwrap();
        until("block after refusals", || ib.lock().unwrap().len() == 1).await;
        assert_eq!(b.stats().refused_handshakes, 3);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_frames_on_the_wire_drop_only_their_stream() {
    bounded(30, async {
        let ca = ClusterCa::generate().unwrap();
        let ((_a, _), (b, ib)) = pair(&ca);
        let three = ca.issue_identity(3).unwrap();
        let (_ep, conn) = raw_client(&ca, Some(&three), 3, (2, b.local_addr()))
            .await
            .unwrap();
        let good = encode_to_vec(&Frame::Halo(block(30, 20, 1, 16, 16)));
        let mut wrong_version = good.clone();
        wrong_version[4] = 9;
        let oversized = FrameHeader {
            kind: FrameKind::Halo,
            meta_len: 64,
            body_len: 1 << 40,
        }
        .encode()
        .to_vec();
        let truncated = good[..good.len() - 10].to_vec();
        let garbage = vec![0x5a; 4096];
        for bad in [wrong_version, oversized, truncated, garbage] {
            let mut s = conn.open_uni().await.unwrap();
            s.write_all(&bad).await.unwrap();
            s.finish().unwrap();
        }
        until("bad frames counted", || b.stats().bad_frames == 4).await;
        // The same connection still delivers a valid block.
        let mut s = conn.open_uni().await.unwrap();
        s.write_all(&good).await.unwrap();
        s.finish().unwrap();
        until("good block", || ib.lock().unwrap().len() == 1).await;
        assert_eq!(ib.lock().unwrap()[0].header.from, PartId(30));
    })
    .await
}

#[test]
fn a_vanished_peer_is_detected_within_the_idle_timeout() {
    let ca = ClusterCa::generate().unwrap();
    let fast = || QuicConfig {
        idle_timeout: Duration::from_secs(1),
        keep_alive: Duration::from_millis(200),
        ..QuicConfig::loopback()
    };
    // Node 2 lives in its own runtime, which is then killed without closing anything.
    let rt_b = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (b, _) = rt_b
        .block_on(async { QuicTransport::bind(fast(), &ca.issue_identity(2).unwrap()) })
        .unwrap();
    let rt_a = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt_a.block_on(bounded(20, async {
        let (a, _) = QuicTransport::bind(fast(), &ca.issue_identity(1).unwrap()).unwrap();
        a.add_peer(2, b.local_addr());
        a.route(PartId(20), 2);
        let mut failures = a.failures();
        a.connect(2).await.unwrap();
        std::mem::forget(b);
        rt_b.shutdown_background();
        let lost_at = Instant::now();
        let e = failures.recv().await.unwrap();
        let took = lost_at.elapsed();
        assert!(took < Duration::from_secs(3), "detected after {took:?}");
        assert_eq!(e.node(), Some(2));
        assert!(matches!(e, QuicError::PeerLost { .. }), "{e}");
        assert!(
            e.to_string().contains("node 2") && e.to_string().contains("idle timeout"),
            "{e}"
        );
        let err = a.send(block(10, 20, 1, 2, 2)).unwrap_err();
        assert!(err.to_string().contains("node 2"), "{err}");
        let flushed = a.flush(Duration::from_secs(5)).await.unwrap_err();
        assert_eq!(flushed.node(), Some(2));
    }));
}

/// A node killed and started again at once at the same address (a service manager's
/// restart): the peer it connects to reports the old process lost as soon as the new one
/// says hello (another incarnation from the same address), not after the idle timeout, and
/// talks to the new process once the loss is dealt with.
#[test]
fn a_process_restarted_at_its_address_is_reported_lost_at_once() {
    restarted_process_is_reported_lost_at_once(true);
}

/// The same restart at another port (port 0): the old connection acknowledges no probe, so
/// its process is gone and the new one takes its place at once. (A live process keeps its
/// place: tests/cluster.rs, `a_second_process_claiming_a_joined_node_id_is_refused_at_once`.)
#[test]
fn a_process_restarted_at_another_port_is_reported_lost_at_once() {
    restarted_process_is_reported_lost_at_once(false);
}

fn restarted_process_is_reported_lost_at_once(same_addr: bool) {
    let ca = ClusterCa::generate().unwrap();
    let slow = || QuicConfig {
        idle_timeout: Duration::from_secs(30),
        ..QuicConfig::loopback()
    };
    // The first process of node 2 lives in its own runtime, killed without closing anything.
    let rt_old = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (a, ia) = rt.block_on(async { node(&ca, 1, 10, slow()) });
    let (old, _) = rt_old
        .block_on(async { QuicTransport::bind(slow(), &ca.issue_identity(2).unwrap()) })
        .unwrap();
    let at = old.local_addr();
    old.add_peer(1, a.local_addr());
    let mut failures = a.failures();
    rt_old.block_on(old.connect(1)).unwrap();
    rt.block_on(bounded(30, async {
        until("node 2 connected", || a.node().connected_peers() == vec![2]).await;
    }));
    // Its runtime stops first (every task dropped, none running), so dropping the node sends
    // nothing, as a SIGKILL: the socket just closes. (Stopped without waiting, a task still
    // running could send the close, a graceful departure.)
    rt_old.shutdown_timeout(Duration::from_secs(5));
    drop(old);
    rt.block_on(bounded(30, async {
        // The new process binds the same address (once the old socket is gone).
        let start = Instant::now();
        let new = loop {
            let bind = if same_addr { at } else { slow().bind };
            let cfg = QuicConfig { bind, ..slow() };
            match QuicTransport::bind(cfg, &ca.issue_identity(2).unwrap()) {
                Ok((t, _)) => break t,
                Err(_) if start.elapsed() < Duration::from_secs(5) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("could not bind {at} again: {e}"),
            }
        };
        new.add_peer(1, a.local_addr());
        new.route(PartId(10), 1);
        let restarted = Instant::now();
        assert_eq!(new.local_addr() == at, same_addr);
        new.connect(1).await.unwrap();
        let e = failures.recv().await.unwrap();
        assert!(
            restarted.elapsed() < Duration::from_secs(3),
            "reported {:?} after the restart (idle timeout 30 s)",
            restarted.elapsed()
        );
        assert!(matches!(e, QuicError::PeerLost { node: 2, .. }), "{e}");
        assert!(e.to_string().contains("a new process of it"), "{e}");
        // The new process's connection is node 2's now: both ways work once the loss is
        // forgotten (as a take-back does).
        a.node().reset_peer(2);
        new.send(block(20, 10, 1, 2, 2)).unwrap();
        new.flush(Duration::from_secs(5)).await.unwrap();
        until("the new process's block", || ia.lock().unwrap().len() == 1).await;
        assert_eq!(a.node().connected_peers(), vec![2]);
        new.close().await;
        a.close().await;
    }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absent_peer_fails_within_the_connect_timeout() {
    bounded(20, async {
        let ca = ClusterCa::generate().unwrap();
        let cfg = QuicConfig {
            connect_timeout: Duration::from_millis(700),
            ..QuicConfig::loopback()
        };
        let (a, _) = QuicTransport::bind(cfg, &ca.issue_identity(1).unwrap()).unwrap();
        // A bound UDP socket that never answers.
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        a.add_peer(5, silent.local_addr().unwrap());
        a.route(PartId(50), 5);
        let start = Instant::now();
        a.send(block(10, 50, 1, 2, 2)).unwrap();
        let e = a.flush(Duration::from_secs(5)).await.unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(3));
        assert!(
            matches!(e, QuicError::ConnectTimeout { node: 5, .. }),
            "{e}"
        );
        assert!(
            a.send(block(10, 77, 1, 1, 1)).is_err(),
            "no route to partition 77"
        );
    })
    .await
}

/// A restarted peer listens elsewhere: blocks queued behind a dial to its old address (a
/// socket that never answers) reach it at the new one once its address is updated, instead
/// of failing with the old dial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dial_to_a_moved_peer_goes_to_its_new_address() {
    bounded(20, async {
        let ca = ClusterCa::generate().unwrap();
        let cfg = QuicConfig {
            connect_timeout: Duration::from_secs(8),
            ..QuicConfig::loopback()
        };
        let (a, _) = QuicTransport::bind(cfg, &ca.issue_identity(1).unwrap()).unwrap();
        let (b, ib) = node(&ca, 2, 20, QuicConfig::loopback());
        let gone = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        a.add_peer(2, gone.local_addr().unwrap());
        a.route(PartId(20), 2);
        a.send(block(10, 20, 1, 2, 2)).unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let moved = Instant::now();
        a.add_peer(2, b.local_addr());
        a.send(block(10, 20, 1, 3, 3)).unwrap();
        a.flush(Duration::from_secs(5)).await.unwrap();
        until("both blocks at node 2", || ib.lock().unwrap().len() == 2).await;
        assert!(
            moved.elapsed() < Duration::from_secs(3),
            "delivered {:?} after the move: the old dial was waited out",
            moved.elapsed()
        );
        a.close().await;
        b.close().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_from_disk() {
    bounded(20, async {
        let dir = tempfile::tempdir().unwrap();
        trellis_transport::certs::init(dir.path()).unwrap();
        assert!(
            trellis_transport::certs::init(dir.path()).is_err(),
            "a CA is never overwritten"
        );
        for n in [1, 2] {
            let (cert, key) = trellis_transport::certs::issue(dir.path(), n).unwrap();
            assert!(cert.exists() && key.exists());
        }
        let id1 = NodeIdentity::load(dir.path(), 1).unwrap();
        let id2 = NodeIdentity::load(dir.path(), 2).unwrap();
        assert!(
            tls::cert_is_for_node(&id1.chain[0], 1) && !tls::cert_is_for_node(&id1.chain[0], 2)
        );
        let (a, _) = QuicTransport::bind(QuicConfig::loopback(), &id1).unwrap();
        let (b, _) = QuicTransport::bind(QuicConfig::loopback(), &id2).unwrap();
        a.add_peer(2, b.local_addr());
        a.connect(2).await.unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_context_crosses_nodes() {
    bounded(20, async {
        let ca = ClusterCa::generate().unwrap();
        let ((a, _), (b, ib)) = pair(&ca);
        a.send(traced_block(10, 20, 1, 4, 4)).unwrap();
        a.send(block(10, 20, 1, 1, 1)).unwrap();
        a.flush(Duration::from_secs(10)).await.unwrap();
        until("blocks at node 2", || ib.lock().unwrap().len() == 2).await;
        let mut got = ib.lock().unwrap().clone();
        got.sort_by_key(|b| f32s(b).len());
        assert_eq!(got[0].trace, None, "an untraced block stays untraced");
        assert_eq!(got[1].trace, traced_block(10, 20, 1, 4, 4).trace);
        a.close().await;
        b.close().await;
    })
    .await
}
