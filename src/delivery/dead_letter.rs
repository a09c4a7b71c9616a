//! A dead letter for a subscription's sink (`spec.deadLetterSink`): the event that died,
//! why, and its last attempt, as an event of its own that the subscription's sink lane
//! sends. Pure: built from what the attempt knew.

use serde::Serialize;
use serde_json::value::RawValue;

use super::SubscriptionConfig;
use super::format::Envelope;
use crate::store::{AttemptRecord, Claimed, NewEvent};

/// The type of every dead letter.
pub const LETTER_TYPE: &str = "herald.dead_letter";

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Letter<'a> {
    subscription: Named<'a>,
    /// The event as herald stored it: {"id", "type", "timestamp", "source"?, "data"}.
    event: &'a RawValue,
    /// How many attempts were made.
    attempts: u32,
    /// What the last attempt's record says (the reason retries stopped, if they did).
    reason: &'a str,
    last_attempt: &'a AttemptRecord,
}

#[derive(Serialize)]
struct Named<'a> {
    namespace: &'a str,
    name: &'a str,
}

/// The letter for `claimed`, dead after `last`. Its id is the delivery's and the time of
/// its death: a record made again after a lost answer queues it once, and the same event
/// dying again after a replay queues another.
pub fn letter(config: &SubscriptionConfig, claimed: &Claimed, last: &AttemptRecord) -> NewEvent {
    let id = format!("herald-dead-letter-{}-{}", claimed.delivery_id, last.at_ms);
    // The stored envelope without the producer's trace context (headers' business, never a
    // body's); anything else (a bug) is carried as a string.
    let event = serde_json::from_slice::<Envelope<'_>>(&claimed.body)
        .ok()
        .and_then(|stored| {
            serde_json::value::to_raw_value(&Envelope {
                traceparent: None,
                tracestate: None,
                ..stored
            })
            .ok()
        })
        .or_else(|| serde_json::value::to_raw_value(&String::from_utf8_lossy(&claimed.body)).ok());
    let fallback = RawValue::NULL.to_owned();
    let data = serde_json::value::to_raw_value(&Letter {
        subscription: Named {
            namespace: &config.namespace,
            name: &config.name,
        },
        event: event.as_deref().unwrap_or(&fallback),
        attempts: claimed.attempt,
        reason: &last.message,
        last_attempt: last,
    })
    .unwrap_or_else(|_| RawValue::NULL.to_owned());
    let timestamp = k8s_openapi::jiff::Timestamp::from_millisecond(last.at_ms)
        .map(|t| t.to_string())
        .unwrap_or_default();
    let body = serde_json::to_vec(&Envelope {
        id: id.as_str().into(),
        kind: LETTER_TYPE.into(),
        timestamp: timestamp.as_str().into(),
        source: None,
        traceparent: None,
        tracestate: None,
        data: &data,
    })
    .unwrap_or_default();
    NewEvent {
        namespace: config.namespace.to_string(),
        event_id: id,
        event_type: LETTER_TYPE.into(),
        body,
        published_ms: last.at_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_letter_carries_the_event_why_and_the_last_attempt() {
        let spec: crate::api::subscription::WebhookSubscriptionSpec =
            serde_json::from_value(serde_json::json!({
                "url": "https://example.com/hook", "eventTypes": ["*"],
                "signing": {"secretRef": {"name": "s", "key": "k"}},
                "deadLetterSink": {"url": "https://example.com/dead"}
            }))
            .unwrap();
        let config = SubscriptionConfig::from_spec(
            "uid-1",
            "shop",
            "orders",
            &spec,
            Ok(vec!["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into()]),
        )
        .unwrap();
        let claimed = Claimed {
            delivery_id: 42,
            subscription_uid: "uid-1".into(),
            event_id: "evt-1".into(),
            event_type: "order.paid".into(),
            // A traced event: its trace context stays out of the letter's body.
            body: br#"{"id":"evt-1","type":"order.paid","timestamp":"t","traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01","tracestate":"a=b","data":{"n":1}}"#.to_vec(),
            attempt: 3,
            window_start_ms: 0,
            fence: None,
        };
        let last = AttemptRecord {
            at_ms: 1_780_000_000_000,
            outcome: "Transient".into(),
            status_code: Some(503),
            latency_ms: 7,
            message: "gave up after 3 attempts; last: busy".into(),
        };
        let letter = letter(&config, &claimed, &last);
        assert_eq!(letter.event_id, "herald-dead-letter-42-1780000000000");
        assert_eq!(letter.event_type, LETTER_TYPE);
        assert_eq!(letter.namespace, "shop");
        let body: serde_json::Value = serde_json::from_slice(&letter.body).unwrap();
        assert_eq!(body["id"], letter.event_id);
        assert_eq!(body["type"], LETTER_TYPE);
        assert_eq!(
            body["data"],
            serde_json::json!({
                "subscription": {"namespace": "shop", "name": "orders"},
                "event": {"id": "evt-1", "type": "order.paid", "timestamp": "t", "data": {"n": 1}},
                "attempts": 3,
                "reason": "gave up after 3 attempts; last: busy",
                "lastAttempt": {"atMs": 1_780_000_000_000_i64, "outcome": "Transient",
                                "statusCode": 503, "latencyMs": 7,
                                "message": "gave up after 3 attempts; last: busy"},
            })
        );
        // Not JSON (never stored so; a bug): carried as a string rather than lost.
        let odd = Claimed {
            body: b"\xffnot json".to_vec(),
            ..claimed
        };
        let body: serde_json::Value =
            serde_json::from_slice(&super::letter(&config, &odd, &last).body).unwrap();
        assert!(
            body["data"]["event"]
                .as_str()
                .unwrap()
                .ends_with("not json")
        );
    }
}
