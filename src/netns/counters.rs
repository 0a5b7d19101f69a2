//! What crossed each node's link: the kernel's byte counters of the node's `eth0` (every
//! frame: halo rows, gradients, replicas, control, with QUIC, UDP, IP and Ethernet headers)
//! and the packets its token buckets dropped, read with `ip -s -j link` and `tc -s -j qdisc`.
use super::command::run;
use super::{EmulatedNet, NetError};

/// One node's link counters since the network was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkCounters {
    /// Bytes the node sent (frames leaving its `eth0`).
    pub tx_bytes: u64,
    /// Bytes the node received.
    pub rx_bytes: u64,
    /// Packets dropped by the node's two token buckets (queue full).
    pub drops: u64,
}

impl LinkCounters {
    /// The change from `earlier` to `self`.
    pub fn since(&self, earlier: &LinkCounters) -> LinkCounters {
        LinkCounters {
            tx_bytes: self.tx_bytes.saturating_sub(earlier.tx_bytes),
            rx_bytes: self.rx_bytes.saturating_sub(earlier.rx_bytes),
            drops: self.drops.saturating_sub(earlier.drops),
        }
    }
}

impl EmulatedNet {
    /// Every node's counters, by node id.
    pub fn counters(&self) -> Result<Vec<LinkCounters>, NetError> {
        (0..self.nodes())
            .map(|i| {
                let ns = self.namespace(i);
                let bridge = self.bridge_namespace();
                let link = run("ip", &["-n", ns, "-s", "-j", "link", "show", "dev", "eth0"])?;
                let (tx_bytes, rx_bytes) = parse_link_bytes(&link).ok_or_else(|| bad(ns, &link))?;
                let port = format!("n{i}");
                let mut drops = 0;
                for (ns, dev) in [(ns, "eth0"), (bridge, port.as_str())] {
                    let q = run("tc", &["-n", ns, "-s", "-j", "qdisc", "show", "dev", dev])?;
                    drops += parse_tbf_drops(&q).ok_or_else(|| bad(ns, &q))?;
                }
                Ok(LinkCounters {
                    tx_bytes,
                    rx_bytes,
                    drops,
                })
            })
            .collect()
    }
}

fn bad(ns: &str, text: &str) -> NetError {
    NetError::Namespace {
        name: ns.to_string(),
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("unexpected counters from iproute2: {text:.200}"),
        ),
    }
}

/// `(tx, rx)` bytes from `ip -s -j link show dev X`.
fn parse_link_bytes(json: &str) -> Option<(u64, u64)> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    let stats = &v.get(0)?["stats64"];
    Some((
        stats["tx"]["bytes"].as_u64()?,
        stats["rx"]["bytes"].as_u64()?,
    ))
}

/// Drops of the tbf qdisc in `tc -s -j qdisc show dev X`.
fn parse_tbf_drops(json: &str) -> Option<u64> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    v.as_array()?
        .iter()
        .find(|q| q["kind"] == "tbf")
        .and_then(|q| q["drops"].as_u64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_read_from_iproute2_json() {
        let link = r#"[{"ifname":"eth0","stats64":{"rx":{"bytes":700,"packets":3},"tx":{"bytes":1200,"packets":4}}}]"#;
        assert_eq!(parse_link_bytes(link), Some((1200, 700)));
        let q = r#"[{"kind":"tbf","handle":"1:","drops":5},{"kind":"netem","drops":9}]"#;
        assert_eq!(parse_tbf_drops(q), Some(5));
        assert_eq!(parse_tbf_drops(r#"[{"kind":"noqueue"}]"#), None);
        assert_eq!(parse_link_bytes("not json"), None);
        let a = LinkCounters {
            tx_bytes: 10,
            rx_bytes: 20,
            drops: 1,
        };
        let b = LinkCounters {
            tx_bytes: 15,
            rx_bytes: 26,
            drops: 1,
        };
        assert_eq!(b.since(&a).tx_bytes, 5);
        assert_eq!(b.since(&a).rx_bytes, 6);
        assert_eq!(b.since(&a).drops, 0);
    }
}
