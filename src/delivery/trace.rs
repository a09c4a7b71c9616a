//! W3C Trace Context for deliveries: a producer's `traceparent` (and `tracestate`) is kept
//! with the event, and each attempt is a span, a child of the producer's, whose context
//! goes out in the attempt's `traceparent` header. Spans go to whatever tracer provider the
//! process installed (`--otlp-endpoint` installs an OTLP exporter); with none, the attempt
//! carries the producer's context on unchanged.

use opentelemetry::trace::{
    Span, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState,
    Tracer,
};
use opentelemetry::{Context, KeyValue, global};

/// Most bytes of a `tracestate` kept (the W3C limit is 32 list members; 512 bytes is what
/// the spec says a vendor must be able to propagate).
pub const MAX_TRACESTATE: usize = 512;

/// A producer's trace context, as its headers carried it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parent {
    pub context: SpanContext,
    pub tracestate: Option<String>,
}

/// The producer's context from its `traceparent` header (version 00, or a later version
/// read as 00 by its first four fields), and its `tracestate` when short and printable.
/// Anything malformed is no context at all, as the W3C spec asks: the event is still
/// accepted, without a trace.
pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<Parent> {
    let mut fields = traceparent.trim().split('-');
    let (version, trace, span, flags) = (
        fields.next()?,
        fields.next()?,
        fields.next()?,
        fields.next()?,
    );
    let hex = |s: &str, n: usize| {
        s.len() == n && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    if !hex(version, 2) || version == "ff" || !hex(trace, 32) || !hex(span, 16) || !hex(flags, 2) {
        return None;
    }
    if version == "00" && fields.next().is_some() {
        return None;
    }
    let trace_id = TraceId::from_hex(trace).ok()?;
    let span_id = SpanId::from_hex(span).ok()?;
    if trace_id == TraceId::INVALID || span_id == SpanId::INVALID {
        return None;
    }
    let flags = TraceFlags::new(u8::from_str_radix(flags, 16).ok()? & TraceFlags::SAMPLED.to_u8());
    let tracestate = tracestate.map(str::trim).filter(|s| {
        !s.is_empty() && s.len() <= MAX_TRACESTATE && s.bytes().all(|b| (0x20..0x7f).contains(&b))
    });
    let state = tracestate
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    Some(Parent {
        context: SpanContext::new(trace_id, span_id, flags, true, state),
        tracestate: tracestate.map(str::to_string),
    })
}

/// The trace context a stored envelope keeps (see [`crate::delivery::format::Envelope`]).
pub fn stored(body: &[u8]) -> Option<Parent> {
    let envelope = serde_json::from_slice::<crate::delivery::format::Envelope<'_>>(body).ok()?;
    parse(&envelope.traceparent?, envelope.tracestate.as_deref())
}

/// The `traceparent` header for a span context.
pub fn header(context: &SpanContext) -> String {
    format!(
        "00-{}-{}-{:02x}",
        context.trace_id(),
        context.span_id(),
        context.trace_flags().to_u8()
    )
}

/// One attempt's span: started as a child of the producer's context, ended with the
/// attempt's answer.
pub struct AttemptSpan {
    span: global::BoxedSpan,
    /// The headers the attempt carries: `traceparent` (this span's context) and the
    /// producer's `tracestate`.
    pub traceparent: String,
    pub tracestate: Option<String>,
}

impl AttemptSpan {
    pub fn start(
        parent: &Parent,
        namespace: &str,
        subscription: &str,
        event_id: &str,
        attempt: u32,
    ) -> Self {
        let tracer = global::tracer("herald");
        let cx = Context::new().with_remote_span_context(parent.context.clone());
        let span = tracer
            .span_builder("webhook attempt")
            .with_kind(SpanKind::Client)
            .with_attributes([
                KeyValue::new("herald.namespace", namespace.to_string()),
                KeyValue::new("herald.subscription", subscription.to_string()),
                KeyValue::new("herald.event_id", event_id.to_string()),
                KeyValue::new("herald.attempt", i64::from(attempt)),
            ])
            .start_with_context(&tracer, &cx);
        let traceparent = header(span.span_context());
        Self {
            span,
            traceparent,
            tracestate: parent.tracestate.clone(),
        }
    }

    /// Ends the span with the attempt's outcome and, when answered, its status code.
    pub fn end(mut self, outcome: &'static str, status: Option<u16>, failed: bool) {
        self.span
            .set_attribute(KeyValue::new("herald.outcome", outcome));
        if let Some(status) = status {
            self.span.set_attribute(KeyValue::new(
                "http.response.status_code",
                i64::from(status),
            ));
        }
        if failed {
            self.span.set_status(Status::error(outcome));
        }
        self.span.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_traceparent_is_read_as_the_w3c_spec_says() {
        let parent = parse(GOOD, Some("congo=t61rcWkgMzE")).unwrap();
        assert_eq!(
            parent.context.trace_id(),
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
        );
        assert!(parent.context.is_sampled() && parent.context.is_remote());
        assert_eq!(parent.tracestate.as_deref(), Some("congo=t61rcWkgMzE"));
        assert_eq!(header(&parent.context), GOOD);
        // A later version is read by its first four fields.
        assert!(parse(&format!("cc-{}-extra", &GOOD[3..]), None).is_some());
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
        ] {
            assert_eq!(parse(bad, None), None, "{bad:?}");
        }
        // A tracestate too long or not printable is dropped; the context stays.
        let long = "a=".to_string() + &"b".repeat(MAX_TRACESTATE);
        assert_eq!(parse(GOOD, Some(&long)).unwrap().tracestate, None);
        assert_eq!(parse(GOOD, Some("a=b\u{7}")).unwrap().tracestate, None);
    }

    #[test]
    fn without_a_tracer_an_attempt_carries_the_producers_context_on() {
        let parent = parse(GOOD, Some("congo=t61rcWkgMzE")).unwrap();
        let span = AttemptSpan::start(&parent, "ns", "sub", "evt", 1);
        assert_eq!(span.traceparent, GOOD);
        assert_eq!(span.tracestate.as_deref(), Some("congo=t61rcWkgMzE"));
        span.end("Accepted", Some(200), false);
    }

    #[test]
    fn a_stored_context_is_read_back_even_when_escaped() {
        let stored_body = format!(
            r#"{{"id":"a\"b","type":"t","timestamp":"x","traceparent":"{GOOD}","tracestate":"k=v\"w","data":1}}"#
        );
        let parent = stored(stored_body.as_bytes()).unwrap();
        assert_eq!(header(&parent.context), GOOD);
        assert_eq!(parent.tracestate.as_deref(), Some(r#"k=v"w"#));
    }
}
