//! The emulated network's IPv4 /24: the first of a few candidates that no address or route of
//! the host overlaps. The nodes live in their own namespaces, so an overlap would not break
//! them; it would make addresses in logs and cluster files ambiguous, and a cluster file
//! naming a host address would silently reach the host instead.
use super::NetError;
use std::net::Ipv4Addr;

/// The candidates, in order of preference (private space, rarely used by hosts or VPNs).
const CANDIDATES: [[u8; 3]; 4] = [[10, 77, 0], [10, 77, 1], [10, 78, 0], [172, 31, 77]];

/// A /24: node `i` gets `.i+1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Subnet {
    prefix: [u8; 3],
}

impl Subnet {
    /// The first candidate that none of the host's routes and addresses overlaps.
    pub fn choose() -> Result<Self, NetError> {
        let mut taken = Vec::new();
        for args in [
            &["-4", "-o", "addr", "show"][..],
            &["-4", "route", "show", "table", "all"][..],
        ] {
            taken.extend(parse_networks(&super::command::run("ip", args)?));
        }
        Self::first_free(&taken)
    }

    fn first_free(taken: &[Network]) -> Result<Self, NetError> {
        CANDIDATES
            .iter()
            .map(|&prefix| Subnet { prefix })
            .find(|s| !taken.iter().any(|n| n.overlaps(&s.network())))
            .ok_or_else(|| NetError::NoSubnet {
                tried: CANDIDATES
                    .iter()
                    .map(|p| format!("{}.{}.{}.0/24", p[0], p[1], p[2]))
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// Node `i`'s address (`i` < 253).
    pub fn node_addr(&self, i: u32) -> Ipv4Addr {
        let [a, b, c] = self.prefix;
        Ipv4Addr::new(a, b, c, (i + 1) as u8)
    }

    fn network(&self) -> Network {
        let [a, b, c] = self.prefix;
        Network {
            base: u32::from(Ipv4Addr::new(a, b, c, 0)),
            len: 24,
        }
    }
}

impl std::fmt::Display for Subnet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [a, b, c] = self.prefix;
        write!(f, "{a}.{b}.{c}.0/24")
    }
}

/// An IPv4 network `base/len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Network {
    base: u32,
    len: u32,
}

impl Network {
    fn mask(&self) -> u32 {
        if self.len == 0 {
            0
        } else {
            u32::MAX << (32 - self.len)
        }
    }

    fn overlaps(&self, other: &Network) -> bool {
        let mask = self.mask() & other.mask();
        self.base & mask == other.base & mask
    }
}

/// Every `A.B.C.D[/LEN]` in `ip` output (an address without a length is a /32; `default`
/// routes are left out: they overlap everything and say nothing about local subnets).
fn parse_networks(text: &str) -> Vec<Network> {
    text.split_whitespace()
        .filter_map(|word| {
            let (addr, len) = match word.split_once('/') {
                Some((a, l)) => (a, l.parse::<u32>().ok()?),
                None => (word, 32),
            };
            let ip: Ipv4Addr = addr.parse().ok()?;
            (len <= 32).then(|| Network {
                base: u32::from(ip),
                len,
            })
        })
        .filter(|n| n.len > 0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_candidate_that_no_host_route_overlaps_is_chosen() {
        let host = parse_networks(
            "default via 192.0.2.1 dev eth0\n192.0.2.0/24 dev eth0 proto kernel scope link src 192.0.2.2\n\
             2: eth0    inet 192.0.2.2/24 brd 192.0.2.255 scope global eth0\n",
        );
        assert_eq!(host.len(), 5, "{host:?}");
        let s = Subnet::first_free(&host).unwrap();
        assert_eq!(s.to_string(), "10.77.0.0/24");
        assert_eq!(s.node_addr(0), Ipv4Addr::new(10, 77, 0, 1));
        // A VPN route over 10.77.0.0/16 pushes it to 10.78.0.0/24.
        let vpn = parse_networks("10.77.0.0/16 dev tun0");
        assert_eq!(
            Subnet::first_free(&vpn).unwrap().to_string(),
            "10.78.0.0/24"
        );
        let all = parse_networks("10.0.0.0/8 dev a\n172.16.0.0/12 dev b");
        let e = Subnet::first_free(&all).unwrap_err().to_string();
        assert!(
            e.contains("10.77.0.0/24") && e.contains("172.31.77.0/24"),
            "{e}"
        );
    }
}
