//! Tracing glue of the epoch protocol: which node this process is, and how a span's W3C trace
//! context is read into a message ([`context_of`]) and made the parent of the span that handles
//! the message ([`set_parent`]), so that one run is one trace across partitions and nodes.
//!
//! Spans are `tracing` spans; they become OpenTelemetry spans only when the process installed
//! the OpenTelemetry layer (`trellis::telemetry::init`). Without a subscriber every span here is
//! disabled: creating one is a cached flag check, and these functions return at once.
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use std::sync::atomic::{AtomicU32, Ordering};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use trellis_runtime::metrics::{names, Key, Metrics};
use trellis_transport::TraceContext;

static NODE: AtomicU32 = AtomicU32::new(0);

/// Sets the node id recorded on this process's spans (0 unless set).
pub fn set_node(id: u32) {
    NODE.store(id, Ordering::Relaxed);
}

/// The node id recorded on this process's spans.
pub fn node() -> u32 {
    NODE.load(Ordering::Relaxed)
}

/// The node id as a span attribute (OpenTelemetry integers are i64; `tracing` would record a
/// u32 field as text).
pub fn node_attr() -> i64 {
    i64::from(node())
}

/// The trace context of `span`, if it is recorded by OpenTelemetry.
pub fn context_of(span: &Span) -> Option<TraceContext> {
    if span.is_disabled() {
        return None;
    }
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    if !sc.is_valid() {
        return None;
    }
    TraceContext::new(
        sc.trace_id().to_bytes(),
        sc.span_id().to_bytes(),
        sc.trace_flags().to_u8(),
    )
}

/// The trace context of the current span.
pub fn current() -> Option<TraceContext> {
    context_of(&Span::current())
}

fn span_context(p: TraceContext) -> SpanContext {
    SpanContext::new(
        TraceId::from_bytes(p.trace_id),
        SpanId::from_bytes(p.span_id),
        TraceFlags::new(p.flags),
        true,
        TraceState::default(),
    )
}

/// Makes the span described by `parent` (possibly on another node) the parent of `span`.
/// Call it before `span` is first entered.
pub fn set_parent(span: &Span, parent: Option<TraceContext>) {
    let Some(p) = parent else { return };
    if span.is_disabled() {
        return;
    }
    // Fails only when the span was already started, which callers rule out.
    let _ =
        span.set_parent(opentelemetry::Context::new().with_remote_span_context(span_context(p)));
}

/// Serving: `span` does work for every request of `requests` (their HTTP spans; `None`
/// for one that is not traced). The first traced one becomes its parent, so a step that
/// serves one request is part of that request's trace; each other one gets a span link
/// (a batch step serving many requests). Call it before `span` is first entered.
pub fn join_requests(span: &Span, requests: impl IntoIterator<Item = Option<TraceContext>>) {
    if span.is_disabled() {
        return;
    }
    let mut traced = requests.into_iter().flatten();
    let Some(first) = traced.next() else { return };
    set_parent(span, Some(first));
    for other in traced {
        span.add_link(span_context(other));
    }
}

/// Records how long partition `part`'s parked step waited for `peer`'s halo block (zero when
/// the block came before the step needed it) and counts nothing else.
pub(crate) fn record_halo_wait(part: u32, peer: u32, waited: std::time::Duration) {
    Metrics::global().record(
        Key::new(names::HALO_EXCHANGE)
            .with("partition", part)
            .with("peer", peer),
        waited,
    );
}

/// Counts one halo block of `bytes` sent from `part` to `peer`.
pub(crate) fn count_halo_send(part: u32, peer: u32, bytes: u64) {
    let m = Metrics::global();
    let key = |name| Key::new(name).with("partition", part).with("peer", peer);
    m.add(key(names::HALO_BYTES), bytes);
    m.add(key(names::HALO_MESSAGES), 1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_subscriber_spans_carry_no_context() {
        let span = tracing::info_span!("epoch", epoch = 1u32);
        assert!(span.is_disabled());
        assert_eq!(context_of(&span), None);
        let tc = TraceContext::new([1; 16], [2; 8], 1);
        set_parent(&span, tc);
        join_requests(&span, [tc, None, tc]);
        assert_eq!(current(), None);
        set_node(3);
        assert_eq!(node(), 3);
    }
}
