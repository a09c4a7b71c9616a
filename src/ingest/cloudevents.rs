//! Publishing a CloudEvent (CloudEvents 1.0 over HTTP), in structured mode (one
//! `application/cloudevents+json` document) or binary mode (`ce-*` headers, the data as the
//! body). Its `id` is the idempotency key, as a herald event's is; `type` and `data` are
//! the event's; `source` is kept for CloudEvents receivers. Other attributes (`time`,
//! `subject`, extensions) are not kept: herald stamps its own time. Data must be JSON, as
//! every herald event's is. Pure, so it can be fuzzed without a server.

use axum::http::HeaderMap;
use axum::http::header::CONTENT_TYPE;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::{ApiError, PublishRequest, bad_request};

/// How a CloudEvent was sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Structured,
    Binary,
}

/// The mode of a CloudEvent publish, or None for herald's own body.
pub fn mode(headers: &HeaderMap) -> Option<Mode> {
    let content_type = headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if media_type(content_type) == "application/cloudevents+json" {
        Some(Mode::Structured)
    } else if headers.contains_key("ce-specversion") {
        Some(Mode::Binary)
    } else {
        None
    }
}

fn media_type(content_type: &str) -> String {
    content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase()
}

/// JSON data: no content type (JSON is assumed), application/json, or a +json type.
fn is_json(content_type: Option<&str>) -> bool {
    content_type.is_none_or(|t| {
        let media = media_type(t);
        media == "application/json" || media.ends_with("+json")
    })
}

/// A CloudEvent in structured mode: other attributes (`time`, `subject`, extensions) are
/// taken and not kept.
#[derive(Deserialize, utoipa::ToSchema)]
pub struct StructuredEvent {
    /// 1.0, the only version taken.
    #[schema(pattern = "^1\\.0$")]
    specversion: String,
    /// The idempotency key, as a herald event's id (1-255 visible ASCII characters).
    #[schema(min_length = 1, max_length = 255, pattern = "^[!-~]+$")]
    id: String,
    /// Kept, and sent to CloudEvents receivers: 1-1024 visible ASCII characters.
    #[schema(min_length = 1, max_length = 1024, pattern = "^[!-~]+$")]
    source: String,
    /// The event's type, as a herald event's.
    #[serde(rename = "type")]
    #[schema(min_length = 1, max_length = 253, pattern = "^[A-Za-z0-9_.:/-]+$")]
    kind: String,
    /// application/json or a +json type (JSON when absent).
    datacontenttype: Option<String>,
    /// Any JSON value.
    #[schema(value_type = Option<serde_json::Value>)]
    data: Option<Box<RawValue>>,
    /// Refused: only JSON data is taken.
    #[schema(ignore)]
    data_base64: Option<serde::de::IgnoredAny>,
}

/// A CloudEvent as the publish it stands for; the caller applies herald's rules to the id
/// and type.
pub fn decode(mode: Mode, headers: &HeaderMap, body: &[u8]) -> Result<PublishRequest, ApiError> {
    let invalid = |message: String| bad_request("invalid_cloudevent", message);
    let (spec_version, id, source, kind, data) = match mode {
        Mode::Structured => {
            let event: StructuredEvent = serde_json::from_slice(body).map_err(|e| {
                invalid(format!(
                    "a structured CloudEvent is a JSON object with specversion, id, source and type: {e}"
                ))
            })?;
            if event.data_base64.is_some() || !is_json(event.datacontenttype.as_deref()) {
                return Err(invalid(
                    "only JSON data is accepted (no data_base64; datacontenttype application/json or +json)"
                        .into(),
                ));
            }
            (
                event.specversion,
                event.id,
                event.source,
                event.kind,
                event.data,
            )
        }
        Mode::Binary => {
            let attribute = |name: &str| -> Result<String, ApiError> {
                headers
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string)
                    .ok_or_else(|| invalid(format!("a binary CloudEvent needs the header {name}")))
            };
            let content_type = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok());
            if !is_json(content_type) {
                return Err(invalid(
                    "only JSON data is accepted (content-type application/json or +json)".into(),
                ));
            }
            let data = if body.iter().all(u8::is_ascii_whitespace) {
                None
            } else {
                let text = std::str::from_utf8(body)
                    .map_err(|_| invalid("the data is not UTF-8 JSON".into()))?;
                Some(
                    RawValue::from_string(text.trim().to_string())
                        .map_err(|e| invalid(format!("the data is not JSON: {e}")))?,
                )
            };
            (
                attribute("ce-specversion")?,
                attribute("ce-id")?,
                attribute("ce-source")?,
                attribute("ce-type")?,
                data,
            )
        }
    };
    if spec_version != "1.0" {
        return Err(invalid(format!(
            "specversion {spec_version:?}: herald speaks CloudEvents 1.0"
        )));
    }
    if source.is_empty() || source.len() > 1024 || !source.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(invalid(
            "source must be 1-1024 visible ASCII characters".into(),
        ));
    }
    Ok(PublishRequest {
        id: Some(id),
        kind,
        data,
        source: Some(source),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, value.parse().unwrap());
        }
        map
    }

    #[test]
    fn the_mode_is_told_by_the_content_type_or_ce_specversion() {
        let structured = headers(&[(
            "content-type",
            "application/cloudevents+json; charset=utf-8",
        )]);
        assert_eq!(mode(&structured), Some(Mode::Structured));
        assert_eq!(
            mode(&headers(&[("ce-specversion", "1.0")])),
            Some(Mode::Binary)
        );
        assert_eq!(
            mode(&headers(&[("content-type", "application/json")])),
            None
        );
    }

    #[test]
    fn a_structured_event_keeps_its_id_type_source_and_data() {
        let body = br#"{"specversion":"1.0","id":"ce-1","source":"/shop","type":"order.created","time":"2026-01-01T00:00:00Z","data":{"n":1}}"#;
        let request = decode(Mode::Structured, &HeaderMap::new(), body).unwrap();
        assert_eq!(request.id.as_deref(), Some("ce-1"));
        assert_eq!(request.kind, "order.created");
        assert_eq!(request.source.as_deref(), Some("/shop"));
        assert_eq!(request.data.unwrap().get(), r#"{"n":1}"#);
    }

    #[test]
    fn a_binary_event_takes_its_attributes_from_headers() {
        let h = headers(&[
            ("ce-specversion", "1.0"),
            ("ce-id", "ce-2"),
            ("ce-source", "/shop"),
            ("ce-type", "order.paid"),
        ]);
        let request = decode(Mode::Binary, &h, br#" [1, 2] "#).unwrap();
        assert_eq!(
            (request.id.as_deref(), request.kind.as_str()),
            (Some("ce-2"), "order.paid")
        );
        assert_eq!(request.data.unwrap().get(), "[1, 2]");
        assert!(decode(Mode::Binary, &h, b"").unwrap().data.is_none());
    }

    #[test]
    fn what_herald_cannot_keep_is_refused_with_a_reason() {
        let cases: [(Mode, HeaderMap, &[u8]); 6] = [
            (Mode::Structured, HeaderMap::new(), br#"{"specversion":"0.3","id":"a","source":"/s","type":"t"}"#),
            (Mode::Structured, HeaderMap::new(), br#"{"specversion":"1.0","id":"a","type":"t"}"#),
            (Mode::Structured, HeaderMap::new(), br#"{"specversion":"1.0","id":"a","source":"/s","type":"t","data_base64":"AAAA"}"#),
            (Mode::Structured, HeaderMap::new(), br#"{"specversion":"1.0","id":"a","source":"/s","type":"t","datacontenttype":"text/plain","data":"x"}"#),
            (Mode::Binary, headers(&[("ce-specversion", "1.0"), ("ce-id", "a"), ("ce-type", "t")]), b"{}"),
            (Mode::Binary, headers(&[("ce-specversion", "1.0"), ("ce-id", "a"), ("ce-source", "/s"), ("ce-type", "t")]), b"{not json"),
        ];
        for (mode, h, body) in cases {
            let refused = decode(mode, &h, body).unwrap_err();
            assert_eq!(
                refused.code,
                "invalid_cloudevent",
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }
}
