use std::time::Duration;
use trellis_transport::certs::ClusterCa;
use trellis_transport::quic::{QuicConfig, QuicTransport};
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtu() {
    let ca = ClusterCa::generate().unwrap();
    let (a, _) = QuicTransport::bind(QuicConfig::loopback(), &ca.issue_identity(1).unwrap()).unwrap();
    let (b, _) = QuicTransport::bind(QuicConfig::loopback(), &ca.issue_identity(2).unwrap()).unwrap();
    a.add_peer(2, b.local_addr());
    a.connect(2).await.unwrap();
    for _ in 0..10 {
        let s = a.node().connection_stats(2).unwrap();
        eprintln!("mtu {} sent {} lost {} black {}", s.path.current_mtu, s.path.sent_plpmtud_probes, s.path.lost_plpmtud_probes, s.path.black_holes_detected);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
