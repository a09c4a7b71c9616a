//! Faults: the system clock stepped backwards and forwards while herald runs.
//!
//! herald runs under libfaketime (Debian's `faketime` package; the test command installs
//! it), which shifts only the wall clock (`CLOCK_REALTIME`) by the offset written in a file,
//! read again every second; the monotonic clock stays true. Backoff and retry deadlines
//! must not move with the wall clock, and signature timestamps must follow it.

mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};
use support::herald::{Herald, secret, subscription};
use support::receiver::{Behaviour, Receiver};

const NS: &str = "clock";

fn libfaketime() -> PathBuf {
    let candidates = [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/faketime/libfaketime.so.1",
    ];
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .expect("libfaketime is required for the clock-step test: apt-get install faketime (the test command installs it)")
}

/// Sets the offset of herald's wall clock, in seconds.
fn step_to(file: &Path, offset_s: i64) {
    std::fs::write(file, format!("{offset_s:+}\n")).unwrap();
}

fn real_now_s() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// Waits until the delivery of `event` on `name` is pending with at least `attempts` recorded.
async fn recorded(herald: &Herald, name: &str, event: &str, attempts: u64) -> Value {
    let path = format!("/v1/namespaces/{NS}/subscriptions/{name}/attempts?state=pending");
    let body = herald
        .poll(
            &format!("{attempts} or more recorded attempts of {event} on {name}"),
            &path,
            Duration::from_secs(30),
            |_, body| {
                body["items"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|d| d["eventId"] == event && d["attempts"].as_u64() >= Some(attempts))
            },
        )
        .await;
    body["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["eventId"] == event)
        .unwrap()
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backoff_ignores_clock_steps_and_signatures_follow_them() {
    let receiver = Receiver::start().await;
    // A retry that is due exactly 5 s after the first answer.
    receiver.set("/back", Behaviour::RetryAfterOnce(503, "5".into()));
    receiver.set("/forward", Behaviour::Status(500));
    let manifests = [
        secret(NS),
        subscription(NS, "back", &receiver.url("/back"), &["back"], json!({})),
        subscription(
            NS,
            "forward",
            &receiver.url("/forward"),
            &["forward"],
            json!({"delivery": {"retry": {"initialBackoff": "500ms", "maxBackoff": "500ms", "maxDuration": "10m", "maxAttempts": 1000}}}),
        ),
    ];
    // Declared before herald, so herald stops before its clock's folder goes.
    let dir = support::Scratch::new("herald-clock");
    let offset_file = dir.join("offset");
    step_to(&offset_file, 0);
    let preload = libfaketime();
    let herald = Herald::start_env(
        &manifests,
        &["--egress-allow", "127.0.0.0/8"],
        &[
            ("LD_PRELOAD", preload.to_str().unwrap()),
            ("FAKETIME_TIMESTAMP_FILE", offset_file.to_str().unwrap()),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
            ("FAKETIME_CACHE_DURATION", "1"),
        ],
    );

    // A step backwards between an attempt and its retry: the retry comes when it was due,
    // not an hour later.
    herald
        .publish(NS, json!({"id": "b-1", "type": "back", "data": {}}))
        .await;
    recorded(&herald, "back", "b-1", 1).await;
    step_to(&offset_file, -3600);
    herald
        .wait_log("the system clock stepped", 1, Duration::from_secs(10))
        .await;
    let hits = receiver
        .wait_until(
            "the retry after the step back",
            Duration::from_secs(30),
            |h| h.iter().filter(|h| h.path == "/back").count() >= 2,
        )
        .await;
    let retry = hits.iter().filter(|h| h.path == "/back").nth(1).unwrap();
    let stamp: i64 = retry.header("webhook-timestamp").parse().unwrap();
    let expected = real_now_s() - 3600;
    assert!(
        (stamp - expected).abs() <= 30,
        "the signature timestamp follows the system clock: {stamp} vs {expected}"
    );

    // A step forwards of a day while a delivery is retrying under a 10-minute maxDuration:
    // it is not given up, and its retries keep their backoff instead of all firing at once.
    herald
        .publish(NS, json!({"id": "f-1", "type": "forward", "data": {}}))
        .await;
    recorded(&herald, "forward", "f-1", 2).await;
    step_to(&offset_file, 86_400);
    herald
        .wait_log("the system clock stepped", 2, Duration::from_secs(10))
        .await;
    let before = receiver.hits_for("/forward").len();
    receiver
        .wait_until(
            "three retries after the step forwards",
            Duration::from_secs(30),
            |h| h.iter().filter(|h| h.path == "/forward").count() >= before + 3,
        )
        .await;
    // Still retrying: waiting for its next attempt, or (500 ms later) on the wire with it.
    let delivery = recorded(&herald, "forward", "f-1", before as u64 + 3).await;
    assert!(
        matches!(delivery["state"].as_str(), Some("pending" | "in-flight")),
        "{delivery}"
    );
    let last = receiver.hits_for("/forward").pop().unwrap();
    let stamp: i64 = last.header("webhook-timestamp").parse().unwrap();
    let expected = real_now_s() + 86_400;
    assert!(
        (stamp - expected).abs() <= 30,
        "the signature timestamp follows the system clock: {stamp} vs {expected}"
    );
    let dead = herald.deliveries(NS, "forward", "dead").await;
    assert!(dead.is_empty(), "given up after the step: {dead:?}");
}
