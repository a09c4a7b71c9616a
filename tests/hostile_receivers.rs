//! Issue 9 (hardening): hostile receivers, each a raw TCP server on 127.0.0.1 written here.
//! A response trickled a byte a second, a connection that is never answered and one whose
//! body never ends stop at the subscription's `delivery.timeout`; a huge body is read only
//! as far as the 512-byte excerpt, so herald's memory stays flat; a reset and garbage
//! instead of HTTP are transient failures. In every case a second subscription on a healthy
//! receiver keeps getting its deliveries promptly while the hostile one misbehaves.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::herald::{Herald, secret, subscription, transient_message};
use support::receiver::Receiver;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const NS: &str = "shop";
const ALLOW_LOOPBACK: &[&str] = &["--egress-allow", "127.0.0.0/8"];
/// How long a healthy delivery may take, publish to arrival, while the hostile one misbehaves.
const PROMPT: Duration = Duration::from_secs(2);

#[derive(Clone, Copy, Debug)]
enum Hostile {
    /// Reads the request, then sends a response one byte a second.
    Trickle,
    /// Reads the request, then answers 200 with a body of this many bytes, streamed.
    Huge(u64),
    /// Reads the request and never answers nor closes.
    Silent,
    /// Answers 200 with a body delimited by the connection's end, which never comes.
    NeverClosed,
    /// Reads the request, then resets the connection (SO_LINGER 0).
    Reset,
    /// Reads the request, answers bytes that are not HTTP, closes.
    Garbage,
}

struct HostileServer {
    url: String,
    /// Connections accepted so far.
    accepted: Arc<AtomicUsize>,
    /// Connections still held open by the server.
    open: Arc<AtomicUsize>,
    /// Response bytes the server managed to write.
    written: Arc<AtomicU64>,
}

async fn hostile(kind: Hostile) -> HostileServer {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let accepted = Arc::new(AtomicUsize::new(0));
    let open = Arc::new(AtomicUsize::new(0));
    let written = Arc::new(AtomicU64::new(0));
    let (a, o, w) = (accepted.clone(), open.clone(), written.clone());
    tokio::spawn(async move {
        loop {
            let Ok((socket, _)) = listener.accept().await else {
                return;
            };
            a.fetch_add(1, Ordering::SeqCst);
            o.fetch_add(1, Ordering::SeqCst);
            let (o, w) = (o.clone(), w.clone());
            tokio::spawn(async move {
                misbehave(kind, socket, &w).await;
                o.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    HostileServer {
        url,
        accepted,
        open,
        written,
    }
}

/// Reads one request: headers, then Content-Length bytes of body.
async fn read_request(socket: &mut TcpStream) -> bool {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if buf.len() >= end + 4 + length {
                return true;
            }
        }
        match socket.read(&mut chunk).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Holds the connection until the peer closes it.
async fn hold(socket: &mut TcpStream) {
    let mut chunk = [0u8; 1024];
    while let Ok(n) = socket.read(&mut chunk).await {
        if n == 0 {
            return;
        }
    }
}

async fn misbehave(kind: Hostile, mut socket: TcpStream, written: &AtomicU64) {
    if !read_request(&mut socket).await {
        return;
    }
    match kind {
        Hostile::Trickle => {
            let response = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
            for byte in response {
                if socket.write_all(&[*byte]).await.is_err() {
                    return;
                }
                written.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            hold(&mut socket).await;
        }
        Hostile::Huge(total) => {
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {total}\r\n\r\n");
            if socket.write_all(head.as_bytes()).await.is_err() {
                return;
            }
            let block = vec![b'x'; 64 * 1024];
            let mut sent = 0u64;
            while sent < total {
                let n = (total - sent).min(block.len() as u64) as usize;
                if socket.write_all(&block[..n]).await.is_err() {
                    return;
                }
                sent += n as u64;
                written.fetch_add(n as u64, Ordering::SeqCst);
            }
            hold(&mut socket).await;
        }
        Hostile::Silent => hold(&mut socket).await,
        Hostile::NeverClosed => {
            let _ = socket
                .write_all(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\npartial")
                .await;
            hold(&mut socket).await;
        }
        Hostile::Reset => {
            let _ = socket.set_zero_linger();
            drop(socket);
        }
        Hostile::Garbage => {
            let _ = socket
                .write_all(b"SSH-2.0-OpenSSH_9.6\r\n\x00\xff\xfe not http at all\r\n\r\n")
                .await;
            let _ = socket.shutdown().await;
        }
    }
}

/// herald with a "hostile" subscription (event type `hostile.*`) on the hostile server and a
/// "healthy" one (`healthy.*`) on a normal receiver.
fn start(receiver: &Receiver, server: &HostileServer, hostile_delivery: Value) -> Herald {
    Herald::start(
        &[
            secret(NS),
            subscription(
                NS,
                "hostile",
                &server.url,
                &["hostile.*"],
                json!({"delivery": hostile_delivery}),
            ),
            subscription(
                NS,
                "healthy",
                &receiver.url("/healthy"),
                &["healthy.*"],
                json!({}),
            ),
        ],
        ALLOW_LOOPBACK,
    )
}

/// Publishes `n` events to the hostile subscription; returns their ids.
async fn publish_hostile(herald: &Herald, n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for i in 0..n {
        let id = format!("hostile-{i}");
        herald
            .publish(
                NS,
                json!({"id": id, "type": "hostile.poke", "data": {"i": i}}),
            )
            .await;
        ids.push(id);
    }
    ids
}

/// Whether every hostile delivery is delivered or dead.
async fn hostile_settled(herald: &Herald, expected: usize) -> bool {
    let (status, body) = herald
        .get(&format!(
            "/v1/namespaces/{NS}/subscriptions/hostile/attempts?state=all"
        ))
        .await;
    let items = body["items"].as_array().cloned().unwrap_or_default();
    status == 200
        && items.len() == expected
        && items
            .iter()
            .all(|d| d["state"] == "delivered" || d["state"] == "dead")
}

/// Publishes healthy events one after another until the hostile deliveries have settled,
/// asserting each arrives within [`PROMPT`]. Returns how many arrived while the hostile
/// server held a connection open, and how many in all. `watch` runs at every step.
async fn healthy_stays_prompt(
    herald: &Herald,
    receiver: &Receiver,
    server: &HostileServer,
    hostile_events: usize,
    watch: impl Fn(),
) -> (usize, usize) {
    // The hostile subscription is at work before the healthy one is measured.
    let end = Instant::now() + Duration::from_secs(60);
    while server.accepted.load(Ordering::SeqCst) == 0 {
        assert!(
            Instant::now() < end,
            "herald never connected to the hostile receiver"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (mut during, mut all) = (0, 0);
    loop {
        watch();
        if all >= 3 && hostile_settled(herald, hostile_events).await {
            return (during, all);
        }
        assert!(
            Instant::now() < end,
            "the hostile deliveries did not settle in 60s:\n{}",
            herald.log()
        );
        let held_before = server.open.load(Ordering::SeqCst) > 0;
        herald
            .publish_promptly(
                NS,
                receiver,
                &format!("healthy-{all}"),
                "healthy.ping",
                PROMPT,
            )
            .await;
        if held_before && server.open.load(Ordering::SeqCst) > 0 {
            during += 1;
        }
        all += 1;
        // Pacing, not synchronisation: a steady trickle of healthy events.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every attempt of one hostile event.
async fn attempts(herald: &Herald, id: &str) -> Vec<Value> {
    herald.event_attempts(NS, "hostile", id).await
}

async fn delivery_state(herald: &Herald, id: &str) -> Value {
    let (_, body) = herald
        .get(&format!(
            "/v1/namespaces/{NS}/subscriptions/hostile/attempts?state=all"
        ))
        .await;
    body["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["eventId"] == id)
        .unwrap_or_else(|| panic!("no delivery of {id}: {body}"))["state"]
        .clone()
}

/// Asserts each attempt lasted about `timeout` (not less, and not much more).
fn ended_at_timeout(attempt: &Value, timeout_ms: u64) {
    let latency = attempt["latencyMs"].as_u64().unwrap();
    assert!(
        latency >= timeout_ms && latency < timeout_ms + 2000,
        "an attempt lasted {latency}ms with a {timeout_ms}ms timeout: {attempt}"
    );
}

/// A receiver that holds each request (`kind`) against a 3 s timeout and two attempts:
/// each attempt is a transient failure that lasted about the timeout, the delivery ends
/// dead, and a healthy subscription kept receiving promptly meanwhile.
async fn held_attempts_time_out(kind: Hostile) -> HostileServer {
    let receiver = Receiver::start().await;
    let server = hostile(kind).await;
    let herald = start(
        &receiver,
        &server,
        json!({"timeout": "3s", "retry": {"maxAttempts": 2, "initialBackoff": "10ms", "maxBackoff": "10ms"}}),
    );
    let ids = publish_hostile(&herald, 1).await;
    let (during, _) = healthy_stays_prompt(&herald, &receiver, &server, 1, || ()).await;
    assert!(during >= 3, "only {during} healthy deliveries while held");
    let list = attempts(&herald, &ids[0]).await;
    assert_eq!(list.len(), 2, "{list:?}");
    for attempt in &list {
        assert_eq!(attempt["outcome"], "Transient", "{attempt}");
        assert!(attempt["statusCode"].is_null(), "{attempt}");
        // The last attempt's message also says the delivery was given up.
        assert!(
            attempt["message"]
                .as_str()
                .unwrap()
                .ends_with("timed out after 3000ms"),
            "{attempt}"
        );
        ended_at_timeout(attempt, 3000);
    }
    assert_eq!(delivery_state(&herald, &ids[0]).await, "dead");
    server
}

/// A response trickled a byte a second ends at the subscription's timeout, as a transient
/// failure, and is retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_response_ends_at_the_timeout_as_a_transient_failure() {
    let server = held_attempts_time_out(Hostile::Trickle).await;
    assert!(server.accepted.load(Ordering::SeqCst) >= 2);
    // Three seconds at a byte a second: the status line never arrived.
    assert!(server.written.load(Ordering::SeqCst) < 12);
}

/// Highest resident set size of a process so far, in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// A 200 MB response body is not read beyond the excerpt: herald's peak memory stays flat,
/// the attempt is accepted (the status is the acknowledgment) and records 512 bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_response_body_keeps_memory_flat_and_records_an_excerpt() {
    const HUGE: u64 = 200 << 20;
    let receiver = Receiver::start().await;
    let server = hostile(Hostile::Huge(HUGE)).await;
    let herald = start(&receiver, &server, json!({"timeout": "30s"}));
    let pid = herald.pid().unwrap();
    // Warm up: a first delivery has built the client, the pool and the store's caches.
    herald
        .publish(NS, json!({"id": "warm", "type": "healthy.ping"}))
        .await;
    receiver
        .wait_until("the warm-up delivery", Duration::from_secs(30), |hits| {
            !hits.is_empty()
        })
        .await;
    let before = peak_rss_kib(pid);
    const EVENTS: usize = 3;
    let ids = publish_hostile(&herald, EVENTS).await;
    // Reading even one body whole would add 200 MB.
    let flat = || {
        let grown = peak_rss_kib(pid).saturating_sub(before);
        assert!(
            grown < 48 << 10,
            "herald's peak RSS grew by {grown} KiB over {EVENTS} responses of {HUGE} bytes"
        );
    };
    healthy_stays_prompt(&herald, &receiver, &server, EVENTS, flat).await;
    flat();
    for id in &ids {
        let list = attempts(&herald, id).await;
        assert_eq!(list.len(), 1, "{list:?}");
        assert_eq!(list[0]["outcome"], "Accepted");
        assert_eq!(list[0]["statusCode"], 200);
        let message = list[0]["message"].as_str().unwrap();
        assert!(message.len() <= 512, "{} bytes recorded", message.len());
        assert_eq!(message, "x".repeat(512));
        assert_eq!(delivery_state(&herald, id).await, "delivered");
    }
    // The receiver was cut off long before it could send all of it.
    let written = server.written.load(Ordering::SeqCst);
    assert!(
        written < EVENTS as u64 * HUGE,
        "herald read all {written} bytes"
    );
}

/// A connection accepted and never answered ends at the timeout, as a transient failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_never_answered_request_ends_at_the_timeout() {
    let server = held_attempts_time_out(Hostile::Silent).await;
    assert!(server.accepted.load(Ordering::SeqCst) >= 2);
}

/// A 2xx whose body never ends (delimited by a close that never comes) is accepted — the
/// status is the receiver's acknowledgment — but the attempt still ends at the timeout and
/// says the body was cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_never_closed_ends_at_the_timeout() {
    let receiver = Receiver::start().await;
    let server = hostile(Hostile::NeverClosed).await;
    let herald = start(&receiver, &server, json!({"timeout": "3s"}));
    let ids = publish_hostile(&herald, 2).await;
    let (during, _) = healthy_stays_prompt(&herald, &receiver, &server, 2, || ()).await;
    assert!(during >= 3, "only {during} healthy deliveries while held");
    for id in &ids {
        let list = attempts(&herald, id).await;
        assert_eq!(list.len(), 1, "{list:?}");
        assert_eq!(list[0]["outcome"], "Accepted");
        assert_eq!(list[0]["statusCode"], 200);
        let message = list[0]["message"].as_str().unwrap();
        assert!(
            message.starts_with("partial (response body cut: timed out after 3000ms"),
            "{message}"
        );
        assert!(message.len() <= 512);
        ended_at_timeout(&list[0], 3000);
        assert_eq!(delivery_state(&herald, id).await, "delivered");
    }
}

/// Asserts every attempt of every event failed transiently without a status, for `reason`,
/// and each event was tried `tries` times.
async fn all_transient(herald: &Herald, ids: &[String], tries: usize, reason: &str) {
    for id in ids {
        let list = attempts(herald, id).await;
        assert_eq!(list.len(), tries, "{id}: {list:?}");
        for attempt in &list {
            let message = transient_message(attempt);
            assert!(
                message.contains("transport error") && message.contains(reason),
                "{attempt}"
            );
        }
        assert_eq!(delivery_state(herald, id).await, "dead");
    }
}

/// Three events to a receiver that answers as `behaviour` does: every attempt is a transient
/// failure whose message names `reason`, retried 8 times each, while a healthy subscription
/// stays prompt.
async fn retried_as_transient(behaviour: Hostile, reason: &str) {
    let receiver = Receiver::start().await;
    let server = hostile(behaviour).await;
    let herald = start(
        &receiver,
        &server,
        json!({"retry": {"maxAttempts": 8, "initialBackoff": "200ms", "maxBackoff": "200ms"}}),
    );
    let ids = publish_hostile(&herald, 3).await;
    healthy_stays_prompt(&herald, &receiver, &server, 3, || ()).await;
    all_transient(&herald, &ids, 8, reason).await;
    assert_eq!(server.accepted.load(Ordering::SeqCst), 3 * 8);
}

/// A connection reset right after the request is a transient failure, retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_connection_is_a_transient_failure() {
    retried_as_transient(Hostile::Reset, "reset").await;
}

/// Bytes that are not HTTP instead of a response are a transient failure, retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_instead_of_http_is_a_transient_failure() {
    retried_as_transient(Hostile::Garbage, "invalid HTTP").await;
}
