//! [`TraceContext`]: the W3C trace context (`traceparent`) a message carries so that the span
//! receiving it becomes a child of the span that sent it, on this node or another.
use std::fmt;

/// The sending span's identity: trace id, span id and trace flags of a W3C `traceparent`.
///
/// Plain bytes: this crate does not depend on a tracing library; the telemetry layer turns
/// these into its own span contexts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    /// W3C trace flags; bit 0 is "sampled".
    pub flags: u8,
}

impl TraceContext {
    /// A context, or `None` when either id is all zeros (invalid per W3C Trace Context).
    pub fn new(trace_id: [u8; 16], span_id: [u8; 8], flags: u8) -> Option<Self> {
        (trace_id != [0; 16] && span_id != [0; 8]).then_some(TraceContext {
            trace_id,
            span_id,
            flags,
        })
    }

    /// Whether the sender sampled (records) its trace.
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    /// Parses a version-00 `traceparent` header value (`00-<32 hex>-<16 hex>-<2 hex>`).
    pub fn from_traceparent(s: &str) -> Option<Self> {
        let mut parts = s.trim().split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || version != "00" {
            return None;
        }
        let mut trace_id = [0u8; 16];
        let mut span_id = [0u8; 8];
        let mut flag = [0u8; 1];
        hex_into(trace, &mut trace_id)?;
        hex_into(span, &mut span_id)?;
        hex_into(flags, &mut flag)?;
        Self::new(trace_id, span_id, flag[0])
    }

    /// The trace id as 32 lowercase hex digits.
    pub fn trace_id_hex(&self) -> String {
        hex(&self.trace_id)
    }
}

/// Formats as a version-00 `traceparent` header value.
impl fmt::Display for TraceContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{}-{}-{:02x}",
            hex(&self.trace_id),
            hex(&self.span_id),
            self.flags
        )
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Decodes exactly `out.len()` bytes of lowercase hex (W3C forbids uppercase).
fn hex_into(s: &str, out: &mut [u8]) -> Option<()> {
    let s = s.as_bytes();
    if s.len() != out.len() * 2 {
        return None;
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    for (o, pair) in out.iter_mut().zip(s.chunks_exact(2)) {
        *o = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_round_trips_and_rejects_bad_values() {
        let s = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let tc = TraceContext::from_traceparent(s).unwrap();
        assert_eq!(tc.trace_id[0], 0x4b);
        assert_eq!(tc.span_id[7], 0xb7);
        assert!(tc.sampled());
        assert_eq!(tc.to_string(), s);
        assert_eq!(tc.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        for bad in [
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
        ] {
            assert_eq!(TraceContext::from_traceparent(bad), None, "{bad}");
        }
    }
}
