use std::time::Duration;
use trellis_transport::certs::ClusterCa;
use trellis_transport::quic::{QuicConfig, QuicTransport};
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtu() {
    let ca = ClusterCa::generate().unwrap();
    let mut cfg = QuicConfig::loopback();
    cfg.known_mtu = Some(std::env::var("KM").unwrap().parse().unwrap());
    let (a, _) = QuicTransport::bind(cfg.clone(), &ca.issue_identity(1).unwrap()).unwrap();
    let (b, _) = QuicTransport::bind(cfg, &ca.issue_identity(2).unwrap()).unwrap();
    a.add_peer(2, b.local_addr());
    let r = a.connect(2).await;
    eprintln!("connect: {r:?}");
    for _ in 0..3 {
        if let Some(s) = a.node().connection_stats(2) {
            eprintln!(
                "mtu {} sent {} lost {} black {}",
                s.path.current_mtu,
                s.path.sent_plpmtud_probes,
                s.path.lost_plpmtud_probes,
                s.path.black_holes_detected
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
