//! Link rates (`100mbit`, `1gbit`, `2.5gbit`) and the token-bucket settings derived from them.
use super::NetError;
use std::fmt;
use std::str::FromStr;

/// The slowest and fastest rates accepted: below 64 kbit/s a single full-size packet takes
/// longer than QUIC's handshake timeouts allow; above 400 Gbit/s no veth pair comes close.
const MIN_BITS: u64 = 64_000;
const MAX_BITS: u64 = 400_000_000_000;

/// A link rate in bits per second.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct LinkRate {
    bits_per_sec: u64,
}

impl LinkRate {
    /// The rate from bits per second (within 64 kbit/s .. 400 Gbit/s).
    pub fn from_bits_per_sec(bits_per_sec: u64) -> Result<Self, NetError> {
        if !(MIN_BITS..=MAX_BITS).contains(&bits_per_sec) {
            return Err(NetError::BadRate {
                value: format!("{bits_per_sec}bit"),
                reason: "the rate must be between 64kbit and 400gbit".into(),
            });
        }
        Ok(Self { bits_per_sec })
    }

    pub fn bits_per_sec(self) -> u64 {
        self.bits_per_sec
    }

    pub fn bytes_per_sec(self) -> f64 {
        self.bits_per_sec as f64 / 8.0
    }

    /// Seconds to carry `bytes` at this rate.
    pub fn seconds_for(self, bytes: u64) -> f64 {
        bytes as f64 / self.bytes_per_sec()
    }

    /// tbf settings for this rate on a link of `mtu` bytes: the bucket holds 1 ms of traffic
    /// (the granularity at which tbf refills it) but at least two full packets, so a packet is
    /// never larger than the bucket; the queue holds 10 ms of traffic on top (a switch port's
    /// buffer, not a bufferbloat queue that would hide congestion), at least ten packets.
    pub fn tbf(self, mtu: u32) -> TbfParams {
        let per_ms = self.bits_per_sec / 8 / 1000;
        let frame = u64::from(mtu) + 14;
        let burst_bytes = per_ms.max(2 * frame);
        let limit_bytes = burst_bytes + (10 * per_ms).max(10 * frame);
        TbfParams {
            rate_bits: self.bits_per_sec,
            burst_bytes,
            limit_bytes,
        }
    }
}

/// The arguments of `tc qdisc add ... tbf`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TbfParams {
    pub rate_bits: u64,
    /// Bucket size: bytes that may leave back to back at full speed.
    pub burst_bytes: u64,
    /// Bytes queued waiting for tokens before packets are dropped.
    pub limit_bytes: u64,
}

impl TbfParams {
    /// `tbf rate Rbit burst B limit L` as tc arguments.
    pub fn tc_args(&self) -> Vec<String> {
        vec![
            "tbf".into(),
            "rate".into(),
            format!("{}bit", self.rate_bits),
            "burst".into(),
            self.burst_bytes.to_string(),
            "limit".into(),
            self.limit_bytes.to_string(),
        ]
    }
}

impl FromStr for LinkRate {
    type Err = NetError;

    /// `NUMBER UNIT` with UNIT `bit`, `kbit`, `mbit`, `gbit` or `tbit` (decimal multiples,
    /// case-insensitive, an optional `/s`): `100mbit`, `1gbit`, `2.5Gbit/s`. tc's byte units
    /// (`mbps` = megabytes per second) are refused as ambiguous.
    fn from_str(s: &str) -> Result<Self, NetError> {
        let bad = |reason: &str| NetError::BadRate {
            value: s.to_string(),
            reason: reason.to_string(),
        };
        let lower = s.trim().to_ascii_lowercase();
        let text = lower.strip_suffix("/s").unwrap_or(&lower);
        let split = text
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| bad("a unit is missing: write e.g. 100mbit, 1gbit or 10gbit"))?;
        let (number, unit) = text.split_at(split);
        if number.is_empty() {
            return Err(bad(
                "not a number before the unit: write e.g. 100mbit, 1gbit or 10gbit",
            ));
        }
        let scale: f64 = match unit.trim() {
            "bit" => 1.0,
            "kbit" => 1e3,
            "mbit" => 1e6,
            "gbit" => 1e9,
            "tbit" => 1e12,
            "bps" | "kbps" | "mbps" | "gbps" | "tbps" => {
                return Err(bad(
                    "tc reads `bps` units as bytes per second; write bits: e.g. 100mbit, 1gbit",
                ))
            }
            _ => return Err(bad("unknown unit: use bit, kbit, mbit, gbit or tbit")),
        };
        let value: f64 = number
            .parse()
            .map_err(|_| bad("not a number before the unit"))?;
        let bits = value * scale;
        if !bits.is_finite() || bits < MIN_BITS as f64 || bits > MAX_BITS as f64 {
            return Err(bad("the rate must be between 64kbit and 400gbit"));
        }
        Ok(Self {
            bits_per_sec: bits.round() as u64,
        })
    }
}

impl fmt::Display for LinkRate {
    /// `1 Gbit/s`, `100 Mbit/s`, `2.5 Gbit/s`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.bits_per_sec as f64;
        let (v, unit) = if b >= 1e9 {
            (b / 1e9, "Gbit/s")
        } else if b >= 1e6 {
            (b / 1e6, "Mbit/s")
        } else {
            (b / 1e3, "kbit/s")
        };
        write!(f, "{} {unit}", trim_float(v))
    }
}

/// `v` with at most 3 decimals and no trailing zeros.
fn trim_float(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse_in_bits_with_decimal_units() {
        let r = |s: &str| s.parse::<LinkRate>().unwrap().bits_per_sec();
        assert_eq!(r("1gbit"), 1_000_000_000);
        assert_eq!(r("100mbit"), 100_000_000);
        assert_eq!(r("10GBit/s"), 10_000_000_000);
        assert_eq!(r("2.5gbit"), 2_500_000_000);
        assert_eq!(r("64kbit"), 64_000);
        assert_eq!("1gbit".parse::<LinkRate>().unwrap().to_string(), "1 Gbit/s");
        assert_eq!(
            "2.5gbit".parse::<LinkRate>().unwrap().to_string(),
            "2.5 Gbit/s"
        );
        assert_eq!(
            "100mbit".parse::<LinkRate>().unwrap().to_string(),
            "100 Mbit/s"
        );
    }

    #[test]
    fn bad_rates_say_what_is_wrong() {
        for (s, says) in [
            ("", "unit is missing"),
            ("100", "unit is missing"),
            ("fast", "not a number"),
            ("1.2.3gbit", "not a number"),
            ("100mbps", "bytes per second"),
            ("10furlongs", "unknown unit"),
            ("0gbit", "between"),
            ("1kbit", "between"),
            ("900gbit", "between"),
        ] {
            let e = s.parse::<LinkRate>().unwrap_err().to_string();
            assert!(
                e.contains(says) && e.contains(&format!("{s:?}")),
                "{s}: {e}"
            );
        }
    }

    #[test]
    fn the_bucket_holds_a_millisecond_and_never_less_than_two_packets() {
        let gbit = "1gbit".parse::<LinkRate>().unwrap().tbf(1500);
        assert_eq!(gbit.burst_bytes, 125_000);
        assert_eq!(gbit.limit_bytes, 125_000 + 1_250_000);
        let slow = "1mbit".parse::<LinkRate>().unwrap().tbf(1500);
        assert_eq!(slow.burst_bytes, 2 * 1514);
        assert_eq!(slow.limit_bytes, 2 * 1514 + 10 * 1514);
        assert_eq!(gbit.tc_args()[..3], ["tbf", "rate", "1000000000bit"]);
    }
}
