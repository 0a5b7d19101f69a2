//! The simulator's seeded randomness and its network: per-message delay, loss, duplication,
//! reordering and corruption, and link cuts, all drawn from one seeded generator so that a
//! schedule replays exactly from its seed.

/// SplitMix64: a tiny, well-studied 64-bit generator. Written out (8 lines) rather than adding
/// a dependency, because the simulator needs only uniform draws that are identical on every
/// platform and version, forever (a failing seed must replay).
#[derive(Debug, Clone)]
pub struct SimRng(u64);

impl SimRng {
    pub fn new(seed: u64) -> Self {
        SimRng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// Uniform in (0, 1].
    pub fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

/// The network's behaviour in one schedule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetSpec {
    /// Delay of every message between two nodes, µs (uniform in the range).
    pub delay_us: (u64, u64),
    /// Probability that a message is lost (a reset stream, a dropped frame).
    pub loss: f64,
    /// Probability that a message is delivered twice.
    pub duplicate: f64,
    /// Probability that a message is held back long enough to overtake later ones.
    pub reorder: f64,
    /// Probability that a frame arrives corrupted (the receiver rejects it).
    pub corrupt: f64,
}

impl NetSpec {
    /// A network that delivers everything, in order, after a fixed delay.
    pub fn perfect() -> Self {
        NetSpec {
            delay_us: (100, 100),
            loss: 0.0,
            duplicate: 0.0,
            reorder: 0.0,
            corrupt: 0.0,
        }
    }
}

/// What the network does to one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fate {
    /// Delivered after these delays, µs (two: duplicated).
    Delivered(Vec<u64>),
    Lost,
    Corrupted,
}

/// Decides each message's fate.
#[derive(Debug)]
pub struct Network {
    pub spec: NetSpec,
    /// Cut links: (a, b, until µs), both ways.
    cuts: Vec<(u32, u32, u64)>,
}

impl Network {
    pub fn new(spec: NetSpec) -> Self {
        Network {
            spec,
            cuts: Vec::new(),
        }
    }

    /// Drops every message between `a` and `b` until virtual time `until`.
    pub fn cut(&mut self, a: u32, b: u32, until: u64) {
        self.cuts.push((a, b, until));
    }

    /// Until when the link between `a` and `b` is cut, if it is at `now`.
    pub fn cut_until(&self, a: u32, b: u32, now: u64) -> Option<u64> {
        self.cuts
            .iter()
            .filter(|&&(x, y, until)| now < until && ((x, y) == (a, b) || (x, y) == (b, a)))
            .map(|c| c.2)
            .max()
    }

    /// Whether the link between `a` and `b` is cut at `now`.
    pub fn is_cut(&self, a: u32, b: u32, now: u64) -> bool {
        self.cuts
            .iter()
            .any(|&(x, y, until)| now < until && ((x, y) == (a, b) || (x, y) == (b, a)))
    }

    /// The fate of a message from `a` to `b` sent at `now`; `lossy`: it may be lost or
    /// corrupted. Replication is not lossy: it rides a reliable stream, which a cut only
    /// delays until the link heals (a cut longer than the idle timeout loses the node).
    pub fn fate(&self, rng: &mut SimRng, a: u32, b: u32, now: u64, lossy: bool) -> Fate {
        let held = match self.cut_until(a, b, now) {
            Some(_) if lossy => return Fate::Lost,
            Some(until) => until - now,
            None => 0,
        };
        if lossy && rng.chance(self.spec.loss) {
            return Fate::Lost;
        }
        if lossy && rng.chance(self.spec.corrupt) {
            return Fate::Corrupted;
        }
        let (lo, hi) = self.spec.delay_us;
        let mut delay = rng.range(lo, hi);
        if rng.chance(self.spec.reorder) {
            delay += rng.range(hi, 10 * hi);
        }
        delay += held;
        let mut delays = vec![delay];
        if rng.chance(self.spec.duplicate) {
            delays.push(delay + rng.range(1, hi));
        }
        Fate::Delivered(delays)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generator_replays_from_its_seed() {
        let a: Vec<u64> = (0..5)
            .scan(SimRng::new(7), |r, _| Some(r.next_u64()))
            .collect();
        let b: Vec<u64> = (0..5)
            .scan(SimRng::new(7), |r, _| Some(r.next_u64()))
            .collect();
        assert_eq!(a, b);
        let mut r = SimRng::new(1);
        assert!((0..1000).all(|_| r.range(3, 5) >= 3 && r.range(3, 5) <= 5));
        assert!(!(0..1000).any(|_| r.chance(0.0)));
    }

    #[test]
    fn cut_links_lose_lossy_messages_and_delay_reliable_ones_until_they_heal() {
        let mut n = Network::new(NetSpec::perfect());
        let mut r = SimRng::new(1);
        n.cut(1, 2, 1000);
        assert_eq!(n.fate(&mut r, 2, 1, 999, true), Fate::Lost);
        assert_eq!(
            n.fate(&mut r, 2, 1, 900, false),
            Fate::Delivered(vec![200]),
            "a reliable stream waits for the link to heal"
        );
        assert_eq!(
            n.fate(&mut r, 1, 2, 1000, false),
            Fate::Delivered(vec![100])
        );
        assert_eq!(n.fate(&mut r, 1, 3, 0, true), Fate::Delivered(vec![100]));
    }
}
