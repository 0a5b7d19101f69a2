//! Measuring the rate an emulated link achieves: one TCP stream from one node's namespace to
//! another's for a fixed time, the receiver counting bytes. The first fifth of the time is
//! left out (slow start, and the token bucket's initial burst), so the figure is the
//! sustained rate. It is TCP payload (goodput): at MTU 1500, headers take 4.4% of what tbf
//! counts (1448 payload bytes per 1514-byte frame).
use super::{EmulatedNet, LinkRate, NetError};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// What a probe measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProbeResult {
    pub from: u32,
    pub to: u32,
    pub configured: LinkRate,
    /// Payload bytes counted in the measured window.
    pub bytes: u64,
    /// Length of the measured window, s.
    pub seconds: f64,
}

impl ProbeResult {
    /// Achieved payload rate, bits per second.
    pub fn measured_bits_per_sec(&self) -> f64 {
        self.bytes as f64 * 8.0 / self.seconds
    }

    /// Achieved over configured.
    pub fn ratio(&self) -> f64 {
        self.measured_bits_per_sec() / self.configured.bits_per_sec() as f64
    }

    /// `1 Gbit/s configured, 941.2 Mbit/s measured (94.1%, TCP payload, node 0 -> 1)`.
    pub fn summary(&self) -> String {
        format!(
            "{} configured, {:.1} Mbit/s measured ({:.1}%, TCP payload over {:.1} s, node {} -> {})",
            self.configured,
            self.measured_bits_per_sec() / 1e6,
            100.0 * self.ratio(),
            self.seconds,
            self.from,
            self.to
        )
    }
}

/// Chunk the sender writes.
const CHUNK: usize = 256 << 10;

impl EmulatedNet {
    /// Sends bytes from node `from` to node `to` for `duration` and measures the rate.
    pub fn probe(&self, from: u32, to: u32, duration: Duration) -> Result<ProbeResult, NetError> {
        let fail = |detail: String| NetError::Probe { from, to, detail };
        if from == to || from >= self.nodes() || to >= self.nodes() {
            return Err(fail(format!(
                "needs two different nodes of the {}",
                self.nodes()
            )));
        }
        let deadline = Instant::now() + duration + Duration::from_secs(10);
        // The receiver's port, or `None` when it could not listen (its error says why).
        let (port_tx, port_rx) = mpsc::channel::<Option<u16>>();
        std::thread::scope(|s| {
            let receiver = s.spawn(move || -> Result<Vec<(Instant, u64)>, NetError> {
                let setup = (|| {
                    self.join_current_thread(to)?;
                    let listener = TcpListener::bind((self.addr(to), 0))
                        .and_then(|l| l.set_nonblocking(true).map(|_| l))
                        .map_err(|e| fail(format!("cannot listen: {e}")))?;
                    let port = listener
                        .local_addr()
                        .map_err(|e| fail(e.to_string()))?
                        .port();
                    Ok((listener, port))
                })();
                let listener = match setup {
                    Ok((l, port)) => {
                        let _ = port_tx.send(Some(port));
                        l
                    }
                    Err(e) => {
                        let _ = port_tx.send(None);
                        return Err(e);
                    }
                };
                let mut stream = loop {
                    match listener.accept() {
                        Ok((s, _)) => break s,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            if Instant::now() > deadline {
                                return Err(fail("no connection arrived".into()));
                            }
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        Err(e) => return Err(fail(format!("accept: {e}"))),
                    }
                };
                stream
                    .set_nonblocking(false)
                    .and_then(|_| stream.set_read_timeout(Some(Duration::from_secs(2))))
                    .map_err(|e| fail(e.to_string()))?;
                let mut buf = vec![0u8; CHUNK];
                let mut total = 0u64;
                let mut samples = Vec::new();
                loop {
                    match stream.read(&mut buf) {
                        Ok(0) => return Ok(samples),
                        Ok(n) => {
                            total += n as u64;
                            samples.push((Instant::now(), total));
                        }
                        Err(e) => return Err(fail(format!("receive: {e}"))),
                    }
                    if Instant::now() > deadline {
                        return Err(fail("the sender did not finish".into()));
                    }
                }
            });
            let sender = s.spawn(move || -> Result<(), NetError> {
                let port = port_rx
                    .recv()
                    .ok()
                    .flatten()
                    .ok_or_else(|| fail("the receiver could not listen".into()))?;
                self.join_current_thread(from)?;
                let addr = SocketAddr::from((self.addr(to), port));
                let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
                    .map_err(|e| fail(format!("cannot connect to {addr}: {e}")))?;
                let chunk = vec![0x5au8; CHUNK];
                let start = Instant::now();
                while start.elapsed() < duration {
                    stream
                        .write_all(&chunk)
                        .map_err(|e| fail(format!("send: {e}")))?;
                }
                stream
                    .shutdown(std::net::Shutdown::Write)
                    .map_err(|e| fail(format!("shutdown: {e}")))
            });
            let sent = sender
                .join()
                .unwrap_or_else(|_| Err(fail("the sender panicked".into())));
            let samples = receiver
                .join()
                .unwrap_or_else(|_| Err(fail("the receiver panicked".into())))?;
            sent?;
            sustained(&samples, duration / 5)
                .map(|(bytes, seconds)| ProbeResult {
                    from,
                    to,
                    configured: self.spec().rate,
                    bytes,
                    seconds,
                })
                .ok_or_else(|| fail(format!("too few bytes arrived ({} reads)", samples.len())))
        })
    }
}

/// Bytes and seconds between the first sample `warmup` after the first byte and the last
/// sample; `None` when that window is empty.
fn sustained(samples: &[(Instant, u64)], warmup: Duration) -> Option<(u64, f64)> {
    let &(first, _) = samples.first()?;
    let &(end, total) = samples.last()?;
    let &(start, at_start) = samples.iter().find(|(t, _)| *t >= first + warmup)?;
    let seconds = (end - start).as_secs_f64();
    (seconds > 0.0).then_some((total - at_start, seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_warm_up_is_left_out_of_the_rate() {
        let t0 = Instant::now();
        let at = |ms: u64, bytes: u64| (t0 + Duration::from_millis(ms), bytes);
        // A burst of 1000 bytes, then 100 bytes per 100 ms.
        let samples = [
            at(0, 1000),
            at(100, 1100),
            at(200, 1200),
            at(300, 1300),
            at(500, 1500),
        ];
        let (bytes, seconds) = sustained(&samples, Duration::from_millis(150)).unwrap();
        assert_eq!(bytes, 300);
        assert!((seconds - 0.3).abs() < 1e-9);
        assert_eq!(sustained(&samples[..1], Duration::ZERO), None);
        assert_eq!(sustained(&[], Duration::ZERO), None);
    }
}
