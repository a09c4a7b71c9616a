//! What an attempt's body looks like: herald's JSON envelope as stored (`spec.format: json`,
//! the default), or a CloudEvent (CloudEvents 1.0 over HTTP) made from it, in binary mode
//! (the attributes as `ce-*` headers, the data as the body) or structured mode (one
//! `application/cloudevents+json` document). Pure: the stored envelope in, the body and the
//! headers out; the body is what gets signed.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

pub use crate::api::subscription::Format;

/// The stored envelope herald builds at publish (see `Engine::publish`). Its strings are
/// borrowed from the stored bytes when they can be and copied when JSON escaped them (an
/// id may hold `"` or `\`): an envelope is always read back.
#[derive(Serialize, Deserialize)]
pub struct Envelope<'a> {
    #[serde(borrow)]
    pub id: Cow<'a, str>,
    #[serde(rename = "type", borrow)]
    pub kind: Cow<'a, str>,
    #[serde(borrow)]
    pub timestamp: Cow<'a, str>,
    /// The CloudEvents `source` a producer gave (publishing a CloudEvent); else none.
    #[serde(default, skip_serializing_if = "Option::is_none", borrow)]
    pub source: Option<Cow<'a, str>>,
    /// The producer's W3C trace context (see [`crate::delivery::trace`]): sent as headers,
    /// never in a body.
    #[serde(default, skip_serializing_if = "Option::is_none", borrow)]
    pub traceparent: Option<Cow<'a, str>>,
    #[serde(default, skip_serializing_if = "Option::is_none", borrow)]
    pub tracestate: Option<Cow<'a, str>>,
    #[serde(borrow)]
    pub data: &'a RawValue,
}

/// Whether a stored envelope may carry a trace context: only those are read before an
/// attempt, and rewritten without it for the json format. The envelope's fields come in
/// the order above, the trace context before `data`, and a key cannot appear inside a JSON
/// string (its quotes would be escaped): so the look stops at `"data":`, whatever the
/// size of the data.
pub fn may_be_traced(body: &[u8]) -> bool {
    const KEY: &[u8] = b"\"traceparent\":";
    const DATA: &[u8] = b"\"data\":";
    for at in 0..body.len() {
        let rest = &body[at..];
        if rest.starts_with(KEY) {
            return true;
        }
        if rest.starts_with(DATA) {
            return false;
        }
    }
    false
}

/// The CloudEvents spec version herald speaks.
pub const SPEC_VERSION: &str = "1.0";

/// The `source` of an event published without one: its namespace.
pub fn default_source(namespace: &str) -> String {
    format!("/namespaces/{namespace}")
}

/// An attempt's body and the headers that describe it (content type first).
#[derive(Debug, PartialEq, Eq)]
pub struct Rendered {
    pub body: Vec<u8>,
    pub headers: Vec<(&'static str, String)>,
}

/// Renders the stored `body` for `format`. An envelope that cannot be read (a store
/// written by a herald without envelopes would be a bug) is sent as stored, as JSON.
pub fn render(format: Format, namespace: &str, body: &[u8]) -> Rendered {
    let as_stored = || Rendered {
        body: body.to_vec(),
        headers: vec![("content-type", "application/json".into())],
    };
    if format == Format::Json && !may_be_traced(body) {
        return as_stored();
    }
    let Ok(envelope) = serde_json::from_slice::<Envelope<'_>>(body) else {
        return as_stored();
    };
    if format == Format::Json {
        if envelope.traceparent.is_none() {
            return as_stored();
        }
        // The envelope as an untraced event's: the trace context goes in headers.
        let untraced = Envelope {
            traceparent: None,
            tracestate: None,
            ..envelope
        };
        return match serde_json::to_vec(&untraced) {
            Ok(body) => Rendered {
                body,
                headers: vec![("content-type", "application/json".into())],
            },
            Err(_) => as_stored(),
        };
    }
    let source = envelope
        .source
        .as_deref()
        .map_or_else(|| default_source(namespace), str::to_string);
    match format {
        Format::Json => as_stored(),
        Format::CloudeventsBinary => Rendered {
            body: envelope.data.get().as_bytes().to_vec(),
            headers: vec![
                ("content-type", "application/json".into()),
                ("ce-specversion", SPEC_VERSION.into()),
                ("ce-id", envelope.id.to_string()),
                ("ce-source", source),
                ("ce-type", envelope.kind.to_string()),
                ("ce-time", envelope.timestamp.to_string()),
            ],
        },
        Format::CloudeventsStructured => {
            #[derive(Serialize)]
            struct Structured<'a> {
                specversion: &'a str,
                id: &'a str,
                source: &'a str,
                #[serde(rename = "type")]
                kind: &'a str,
                time: &'a str,
                datacontenttype: &'a str,
                data: &'a RawValue,
            }
            let document = Structured {
                specversion: SPEC_VERSION,
                id: &envelope.id,
                source: &source,
                kind: &envelope.kind,
                time: &envelope.timestamp,
                datacontenttype: "application/json",
                data: envelope.data,
            };
            match serde_json::to_vec(&document) {
                Ok(body) => Rendered {
                    body,
                    headers: vec![("content-type", "application/cloudevents+json".into())],
                },
                Err(_) => as_stored(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STORED: &[u8] = br#"{"id":"evt-1","type":"order.created","timestamp":"2026-12-04T10:00:00Z","data":{"n":1, "s":"x"}}"#;

    #[test]
    fn json_is_sent_as_stored() {
        let rendered = render(Format::Json, "shop", STORED);
        assert_eq!(rendered.body, STORED);
        assert_eq!(
            rendered.headers,
            [("content-type", "application/json".into())]
        );
    }

    #[test]
    fn binary_mode_carries_the_attributes_in_headers_and_the_data_as_written() {
        let rendered = render(Format::CloudeventsBinary, "shop", STORED);
        assert_eq!(rendered.body, br#"{"n":1, "s":"x"}"#);
        let header = |name: &str| {
            rendered
                .headers
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(header("ce-specversion"), Some("1.0"));
        assert_eq!(header("ce-id"), Some("evt-1"));
        assert_eq!(header("ce-type"), Some("order.created"));
        assert_eq!(header("ce-source"), Some("/namespaces/shop"));
        assert_eq!(header("ce-time"), Some("2026-12-04T10:00:00Z"));
        assert_eq!(header("content-type"), Some("application/json"));
    }

    #[test]
    fn structured_mode_is_one_document_with_the_producers_source() {
        let stored = br#"{"id":"ce-9","type":"t","timestamp":"2026-12-04T10:00:00Z","source":"/shop/orders","data":[1,2]}"#;
        let rendered = render(Format::CloudeventsStructured, "shop", stored);
        assert_eq!(
            rendered.headers,
            [("content-type", "application/cloudevents+json".into())]
        );
        let document: serde_json::Value = serde_json::from_slice(&rendered.body).unwrap();
        assert_eq!(
            document,
            serde_json::json!({
                "specversion": "1.0", "id": "ce-9", "source": "/shop/orders", "type": "t",
                "time": "2026-12-04T10:00:00Z", "datacontenttype": "application/json",
                "data": [1, 2]
            })
        );
    }

    #[test]
    fn an_unreadable_envelope_goes_as_stored() {
        let rendered = render(Format::CloudeventsBinary, "shop", b"not json");
        assert_eq!(rendered.body, b"not json");
    }

    #[test]
    fn a_trace_context_goes_in_headers_never_in_the_body() {
        let traced = br#"{"id":"evt-1","type":"order.created","timestamp":"2026-12-04T10:00:00Z","traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01","tracestate":"a=b","data":{"n":1, "s":"x"}}"#;
        assert!(may_be_traced(traced) && !may_be_traced(STORED));
        let rendered = render(Format::Json, "shop", traced);
        assert_eq!(
            rendered.body,
            br#"{"id":"evt-1","type":"order.created","timestamp":"2026-12-04T10:00:00Z","data":{"n":1, "s":"x"}}"#
        );
        assert_eq!(render(Format::Json, "shop", STORED).body, STORED);
        let structured = render(Format::CloudeventsStructured, "shop", traced);
        assert!(!String::from_utf8_lossy(&structured.body).contains("traceparent"));
        // "traceparent" inside the data is the producer's business, sent as written, and
        // not looked for (a large body is not read through for it).
        let in_data = br#"{"id":"e","type":"t","timestamp":"x","data":{"traceparent":1}}"#;
        assert!(!may_be_traced(in_data));
        assert_eq!(render(Format::Json, "shop", in_data).body, in_data);
    }

    #[test]
    fn escaped_strings_in_the_envelope_are_read_like_any_other() {
        // A visible-ASCII id may hold a quote or a backslash, and a tracestate value a
        // quote: JSON escapes them, so they cannot be borrowed from the stored bytes.
        let traced = br#"{"id":"a\"b\\c","type":"t","timestamp":"x","traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01","tracestate":"k=v\"w","data":1}"#;
        let json = render(Format::Json, "shop", traced);
        assert_eq!(
            json.body,
            br#"{"id":"a\"b\\c","type":"t","timestamp":"x","data":1}"#
        );
        let binary = render(Format::CloudeventsBinary, "shop", traced);
        assert_eq!(binary.body, b"1");
        assert!(binary.headers.contains(&("ce-id", r#"a"b\c"#.into())));
    }
}
