//! [`QuicConfig`]: deadlines, flow-control windows and limits of a QUIC node.
//!
//! The defaults are tuned for bulk halo transfer on a cluster fabric (measured on loopback, see
//! `crate::bench` for the numbers):
//! * MTU discovery may climb to 65527 bytes (`max_udp_payload`): on loopback it settles at
//!   65495, one encryption and one `sendmsg` per ~64 KiB instead of per ~1.4 KiB. Probes carry
//!   don't-fragment, so on a 1500-byte network discovery simply stops at ~1450.
//! * GSO is off: quinn 0.11 batches up to 10 datagrams per GSO send without capping the batch
//!   at the kernel's 64 KiB, so with large datagrams every batch is refused, looks like loss,
//!   trips MTU black-hole detection and drops the MTU to 1200 for a minute. On a 1500-byte
//!   network prefer `max_udp_payload: 1452, gso: true`.
//! * Receive windows are small (6 MiB per connection): in-flight data then always fits in the
//!   UDP socket buffer (8 MiB requested; Linux caps it at 2 x net.core.rmem_max), so a busy
//!   receiver throttles the sender through flow control instead of dropping datagrams, which
//!   cost Cubic its window (with 16/64 MiB windows 1-2% of datagrams were lost and throughput
//!   fell by up to half).
use crate::wire::Limits;
use std::net::SocketAddr;
use std::time::Duration;

/// Settings of a [`super::QuicNode`].
#[derive(Debug, Clone)]
pub struct QuicConfig {
    /// UDP address to listen on (port 0: an ephemeral port).
    pub bind: SocketAddr,
    /// A connection with no packet from the peer for this long is dead (negotiated: the lower
    /// of both ends' values applies).
    pub idle_timeout: Duration,
    /// Keep-alive interval on idle connections; must be well below `idle_timeout`.
    pub keep_alive: Duration,
    /// Deadline for dialling a peer, its TLS handshake and the hello exchange.
    pub connect_timeout: Duration,
    /// Deadline for one message to be sent and acknowledged, and for one frame to be received.
    pub send_timeout: Duration,
    /// Receive window of one stream, bytes.
    pub stream_window: u64,
    /// Receive window of one connection (all its streams), bytes: the most a peer can have in
    /// flight towards this node.
    pub conn_window: u64,
    /// Unacknowledged bytes this node keeps in flight to one peer.
    pub send_window: u64,
    /// Incoming unidirectional streams a peer may have open at once.
    pub max_streams: u32,
    /// Halo streams this node keeps in flight to one peer.
    pub send_streams: usize,
    /// Frame size limits.
    pub limits: Limits,
    /// Largest control message: one over the envelope limit (`limits.max_meta`) travels in
    /// pieces of half that limit, put together by the receiver up to this size.
    pub max_message: u64,
    /// Bytes of halo bodies being received from one peer at once; a frame waits for budget
    /// before its buffer is allocated. At least `limits.max_body`.
    pub recv_budget: u64,
    /// Bytes of blocks queued for one peer and not yet sent; `send` fails beyond.
    pub max_queued: u64,
    /// Largest UDP payload MTU discovery may try (probes with don't-fragment; 1200..=65527).
    pub max_udp_payload: u16,
    /// UDP payload the network is known to carry (loopback: 65 KB; jumbo-frame fabrics: 8972):
    /// packets start at that size and never fall below it. `None`: start at 1200 bytes and
    /// discover (on a loopback address, with a single probe at the loopback interface's MTU:
    /// see [`QuicConfig::loopback_mtu`]). A value the path cannot carry breaks every
    /// connection.
    pub known_mtu: Option<u16>,
    /// After a suspected MTU black hole (bursts of lost large packets, which congestion on a
    /// busy host also causes), wait this long before probing larger packets again.
    pub mtu_black_hole_cooldown: Duration,
    /// Use UDP segmentation offload (GSO) where the OS supports it.
    pub gso: bool,
    /// SO_SNDBUF / SO_RCVBUF of the UDP socket (the kernel caps it at net.core.*mem_max);
    /// 0 keeps the OS default.
    pub socket_buffer: usize,
}

impl Default for QuicConfig {
    fn default() -> Self {
        QuicConfig {
            bind: SocketAddr::from(([0, 0, 0, 0], 0)),
            idle_timeout: Duration::from_secs(10),
            keep_alive: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(5),
            send_timeout: Duration::from_secs(30),
            stream_window: 6 << 20,
            conn_window: 6 << 20,
            send_window: 8 << 20,
            max_streams: 64,
            send_streams: 4,
            limits: Limits::default(),
            max_message: 1 << 30,
            recv_budget: 1 << 30,
            max_queued: 4 << 30,
            max_udp_payload: 65527,
            known_mtu: None,
            mtu_black_hole_cooldown: Duration::from_secs(60),
            gso: false,
            socket_buffer: 8 << 20,
        }
    }
}

impl QuicConfig {
    /// Bytes per piece of a control message over the envelope limit: half the limit, so
    /// that a piece and its envelope fit in one frame.
    pub(crate) fn control_piece(&self) -> usize {
        (self.limits.max_meta / 2) as usize
    }

    /// Defaults, listening on `bind`.
    pub fn with_bind(bind: SocketAddr) -> Self {
        QuicConfig {
            bind,
            ..Self::default()
        }
    }

    /// Defaults on 127.0.0.1 with an ephemeral port, short deadlines: for tests.
    pub fn loopback() -> Self {
        QuicConfig {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            idle_timeout: Duration::from_secs(3),
            keep_alive: Duration::from_millis(500),
            connect_timeout: Duration::from_secs(3),
            send_timeout: Duration::from_secs(10),
            ..Self::default()
        }
    }

    /// quinn 0.11's own transport defaults (1.25 MB stream window, unbounded connection
    /// window, 10 MB send window, 1452-byte MTU ceiling, OS socket buffers), for comparison.
    pub fn quinn_defaults() -> Self {
        QuicConfig {
            stream_window: 1_250_000,
            conn_window: (1 << 62) - 1,
            send_window: 10_000_000,
            max_streams: 100,
            max_udp_payload: 1452,
            gso: true,
            socket_buffer: 0,
            ..Self::default()
        }
    }

    /// For a node bound to a loopback address: the largest UDP payload the loopback interface
    /// carries (Linux: `/sys/class/net/lo/mtu` less the IP and UDP headers, within the 16-bit
    /// length fields), capped at `max_udp_payload`. MTU discovery then probes only that size.
    ///
    /// Discovering the path MTU is not free: quinn pads every probe with one-byte PADDING
    /// frames and parses them one by one, so climbing from 1200 to ~65 KB costs the receiver
    /// ~14 ms of CPU per connection (measured: 16 nodes dialling all-to-all took 3.6 s of CPU
    /// with discovery, 0.19 s with a 1452-byte ceiling). A cluster of N nodes on one machine
    /// opens N(N-1) connections at its first halo exchange, so above ~32 nodes the handshakes
    /// starved each other past the connect timeout. On loopback the answer is known.
    pub fn loopback_mtu(&self) -> Option<u16> {
        if !self.bind.ip().is_loopback() {
            return None;
        }
        let mtu: u32 = std::fs::read_to_string("/sys/class/net/lo/mtu")
            .ok()?
            .trim()
            .parse()
            .ok()?;
        // IPv4's total length (header included) and IPv6's payload length are 16-bit fields.
        let udp = if self.bind.is_ipv4() {
            mtu.min(65_535).checked_sub(20)?
        } else {
            mtu.checked_sub(40)?.min(65_535)
        };
        let payload = udp.checked_sub(8)?.min(u32::from(self.max_udp_payload));
        (payload >= 1200).then_some(payload as u16)
    }

    pub(crate) fn recv_budget_kib(&self) -> u32 {
        let bytes = self.recv_budget.max(self.limits.max_body);
        (bytes.div_ceil(1024)).min(u32::MAX as u64 >> 4) as u32
    }
}
