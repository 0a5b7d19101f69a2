//! Many QUIC nodes on loopback exchanging halo blocks all-to-all: nothing in the transport
//! may assume a small number of peers (connections, streams, dials at once). Bounded in time.
mod common;

use common::{block, run_id};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use trellis_transport::certs::ClusterCa;
use trellis_transport::quic::{QuicConfig, QuicTransport};
use trellis_transport::{HaloBlock, PartId, Transport};

type Inbox = Arc<Mutex<Vec<HaloBlock>>>;

/// `n` nodes, node `i` hosting partition `i`, every node knowing every other; each sends one
/// block to every other node at the same moment (every connection is dialled at once), twice.
async fn all_to_all(n: u32) {
    let ca = ClusterCa::generate().unwrap();
    // Every connection of every node is handled by this one process's two runtime threads
    // here (a real cluster spreads them over its node processes): allow for the queue.
    let cfg = QuicConfig {
        connect_timeout: Duration::from_secs(60),
        idle_timeout: Duration::from_secs(30),
        keep_alive: Duration::from_secs(2),
        ..QuicConfig::loopback()
    };
    let mut nodes: Vec<(QuicTransport, Inbox)> = Vec::new();
    for id in 0..n {
        let (t, _control) =
            QuicTransport::bind(cfg.clone(), &ca.issue_identity(id).unwrap()).unwrap();
        let inbox: Inbox = Arc::default();
        let sink = inbox.clone();
        t.register(
            PartId(id),
            Arc::new(move |b| {
                sink.lock().unwrap().push(b);
                true
            }),
        );
        t.set_epoch(run_id(), 1);
        nodes.push((t, inbox));
    }
    let addrs: Vec<_> = nodes.iter().map(|(t, _)| t.local_addr()).collect();
    for (t, _) in &nodes {
        for (j, addr) in addrs.iter().enumerate() {
            t.add_peer(j as u32, *addr);
            t.route(PartId(j as u32), j as u32);
        }
    }
    let mut failures: Vec<_> = nodes.iter().map(|(t, _)| t.failures()).collect();
    let start = Instant::now();
    for round in 1..=2u32 {
        for (i, (t, _)) in nodes.iter().enumerate() {
            for j in 0..n {
                if j != i as u32 {
                    t.send(block(i as u32, j, round, 3, 16)).unwrap();
                }
            }
        }
        for (i, (t, _)) in nodes.iter().enumerate() {
            t.flush(Duration::from_secs(120))
                .await
                .unwrap_or_else(|e| panic!("node {i}, round {round}: {e}"));
        }
    }
    let expect = 2 * (n as usize - 1);
    while nodes
        .iter()
        .any(|(_, ib)| ib.lock().unwrap().len() < expect)
    {
        assert!(
            start.elapsed() < Duration::from_secs(140),
            "not every block arrived"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for (i, f) in failures.iter_mut().enumerate() {
        assert!(f.try_recv().is_err(), "node {i} saw a peer failure");
    }
    for (i, (t, ib)) in nodes.iter().enumerate() {
        let got = ib.lock().unwrap();
        assert_eq!(got.len(), expect, "node {i}");
        let mut senders: Vec<u32> = got.iter().map(|b| b.header.from.0).collect();
        senders.sort_unstable();
        senders.dedup();
        assert_eq!(
            senders.len(),
            n as usize - 1,
            "node {i} heard every other node"
        );
        assert_eq!(t.stats().refused_handshakes, 0, "node {i}");
    }
    eprintln!(
        "{n} nodes: {} connections dialled at once, every block delivered in {:?}",
        n * (n - 1),
        start.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forty_nodes_exchange_all_to_all() {
    tokio::time::timeout(Duration::from_secs(150), all_to_all(40))
        .await
        .expect("test timed out");
}

/// A dial that fails (the peer is not up yet, or the machine is too busy for the handshake in
/// time) is not held against the peer: the next message dials again and gets through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_dial_is_retried_by_the_next_message() {
    tokio::time::timeout(Duration::from_secs(30), async {
        let ca = ClusterCa::generate().unwrap();
        let cfg = QuicConfig {
            connect_timeout: Duration::from_millis(500),
            ..QuicConfig::loopback()
        };
        let (a, _) = QuicTransport::bind(cfg.clone(), &ca.issue_identity(1).unwrap()).unwrap();
        // Node 2's address answers nothing yet.
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = silent.local_addr().unwrap();
        a.add_peer(2, addr);
        a.route(PartId(20), 2);
        a.send(block(10, 20, 1, 2, 2)).unwrap();
        let e = a.flush(Duration::from_secs(5)).await.unwrap_err();
        assert!(e.is_dial_failure(), "{e}");
        // Node 2 comes up on that address.
        drop(silent);
        let b_cfg = QuicConfig {
            bind: addr,
            ..cfg.clone()
        };
        let (b, _) = QuicTransport::bind(b_cfg, &ca.issue_identity(2).unwrap()).unwrap();
        let inbox: Inbox = Arc::default();
        let sink = inbox.clone();
        b.register(
            PartId(20),
            Arc::new(move |blk| {
                sink.lock().unwrap().push(blk);
                true
            }),
        );
        b.set_epoch(run_id(), 1);
        a.send(block(10, 20, 1, 3, 3))
            .expect("a failed dial does not fail the peer for good");
        a.flush(Duration::from_secs(10)).await.unwrap();
        while inbox.lock().unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(inbox.lock().unwrap()[0].rows, 3);
    })
    .await
    .expect("test timed out");
}
