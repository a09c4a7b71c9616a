//! Issue 9 (hardening), against a real herald process on 127.0.0.1: an accepted event id is
//! answered before any quota, unmatched events keep no body, the ingest listener times out
//! slow and idle connections, malformed HTTP (hyper's own 400/414/431 too) gets JSON errors,
//! and at its descriptor limit herald queues and recovers. (A namespace's flood of
//! publishes turned away with 429 and Retry-After: tests/admission.rs.)

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

/// Defect 9: the answers hyper writes by itself (a request line it cannot parse, a URI or a
/// header section over its limits) have the documented JSON shape too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unparseable_requests_get_json_errors() {
    let herald = Herald::start(&[secret(NS)], &[]);
    let long_uri = format!(
        "GET /v1/namespaces/{NS}/events?{} HTTP/1.1\r\nHost: x\r\n\r\n",
        "a".repeat(70_000)
    );
    let big_headers = format!(
        "GET /healthz HTTP/1.1\r\nHost: x\r\n{}\r\n",
        (0..200)
            .map(|i| format!("x-filler-{i}: {}\r\n", "b".repeat(2_000)))
            .collect::<String>()
    );
    let cases: [(&str, &[u8], &str, &str); 4] = [
        (
            "a garbled request line",
            b"GARBAGE\r\n\r\n",
            "400",
            "bad_request",
        ),
        (
            "a header without a colon",
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
            "400",
            "bad_request",
        ),
        (
            "a URI over the limit",
            long_uri.as_bytes(),
            "414",
            "uri_too_long",
        ),
        (
            "a header section over the limit",
            big_headers.as_bytes(),
            "431",
            "headers_too_large",
        ),
    ];
    for (what, request, status, code) in cases {
        let (answer, _) = raw(&herald.base, request, Duration::from_secs(20));
        let (head, body) = answer
            .split_once("\r\n\r\n")
            .unwrap_or_else(|| panic!("{what}: no complete answer: {answer:?}"));
        assert!(
            head.starts_with(&format!("HTTP/1.1 {status} ")),
            "{what}: {head}"
        );
        assert!(
            head.contains("content-type: application/json"),
            "{what}: {head}"
        );
        let body: Value = serde_json::from_str(body)
            .unwrap_or_else(|e| panic!("{what}: the body is not JSON ({e}): {body:?}"));
        assert_eq!(body["error"]["code"], code, "{what}: {body}");
        assert!(body["error"]["message"].is_string(), "{what}: {body}");
    }
}

/// Reads until the server closes the connection; panics if it is still open at `deadline`.
/// Returns what was read and when the connection closed.
fn closed_within(stream: &mut TcpStream, deadline: Duration, what: &str) -> (String, Duration) {
    let started = Instant::now();
    stream
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut answer = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buffer[..n]),
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => break,
        }
        assert!(
            started.elapsed() < deadline,
            "{what}: the connection is still open after {deadline:?}"
        );
    }
    (
        String::from_utf8_lossy(&answer).into_owned(),
        started.elapsed(),
    )
}

fn connect(herald: &Herald) -> TcpStream {
    TcpStream::connect(herald.base.trim_start_matches("http://")).unwrap()
}

/// Defect 2: a head trickled a byte at a time, a connection that sends nothing, an idle
/// keep-alive connection and a trickled body are all ended by the listener's timeouts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ingest_listener_times_slow_and_idle_connections_out() {
    let herald = Herald::start_env(
        &[secret(NS)],
        &[],
        &[
            ("HERALD_INGEST_HEADER_TIMEOUT", "1s"),
            ("HERALD_INGEST_BODY_TIMEOUT", "1s"),
        ],
    );
    // Generous for a loaded machine, far below "never".
    let deadline = Duration::from_secs(15);

    // Nothing sent at all.
    let mut silent = connect(&herald);
    // A head trickled a byte every 100 ms, forever.
    let mut trickled = connect(&herald);
    let mut writer = trickled.try_clone().unwrap();
    std::thread::spawn(move || {
        let head = format!("POST /v1/namespaces/{NS}/events HTTP/1.1\r\nHost: x\r\nX-Slow: ");
        let _ = writer.write_all(head.as_bytes());
        while writer.write_all(b"a").is_ok() {
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    // An idle keep-alive connection after one answered request.
    let mut idle = connect(&herald);
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    // A body trickled a byte every 100 ms.
    let mut slow_body = connect(&herald);
    let mut writer = slow_body.try_clone().unwrap();
    std::thread::spawn(move || {
        let head = format!(
            "POST /v1/namespaces/{NS}/events HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
        );
        let _ = writer.write_all(head.as_bytes());
        while writer.write_all(b" ").is_ok() {
            std::thread::sleep(Duration::from_millis(100));
        }
    });

    closed_within(&mut silent, deadline, "a silent connection");
    closed_within(&mut trickled, deadline, "a trickled head");
    let (answer, _) = closed_within(&mut idle, deadline, "an idle keep-alive connection");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let (answer, _) = closed_within(&mut slow_body, deadline, "a trickled body");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"body_timeout\""), "{answer}");
    // And the API still serves.
    let accepted = herald.publish(NS, json!({"type": "order.paid"})).await;
    assert_eq!(accepted["matched"], 0);
}

/// Defect 2: at the connection bound herald says so in its log and serves the next
/// connection once one closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ingest_listener_bounds_connections_and_says_so() {
    let herald = Herald::start_env(
        &[secret(NS)],
        &[],
        &[
            ("HERALD_INGEST_MAX_CONNECTIONS", "4"),
            ("HERALD_INGEST_HEADER_TIMEOUT", "60s"),
        ],
    );
    let held: Vec<TcpStream> = (0..4).map(|_| connect(&herald)).collect();
    // The fifth is accepted by the kernel and waits.
    let mut waiting = connect(&herald);
    waiting
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    herald
        .wait_log(
            "ingest connection limit reached",
            1,
            Duration::from_secs(20),
        )
        .await;
    drop(held);
    let (answer, _) = closed_within(&mut waiting, Duration::from_secs(20), "the waiting request");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

fn open_descriptors(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count() as u64
}

/// Faults: herald at its descriptor limit degrades by queueing and never crashes. The limit
/// is lowered while it runs to just above what it holds, silent connections take what is
/// left, and 20 publishes and their deliveries (each needing a socket) still all complete
/// once the listener's timeout frees descriptors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_descriptor_limit_herald_queues_and_recovers() {
    let receiver = Receiver::start().await;
    let mut manifests = vec![secret(NS)];
    manifests.push(subscription(
        NS,
        "orders",
        &receiver.url("/orders"),
        &["order.created"],
        json!({"delivery": {"maxInFlight": 20, "retry": {"initialBackoff": "200ms", "maxBackoff": "1s"}}}),
    ));
    let mut herald = Herald::start_env(
        &manifests,
        ALLOW_LOOPBACK,
        &[("HERALD_INGEST_HEADER_TIMEOUT", "2s")],
    );
    let pid = herald.pid().unwrap();
    let limit = open_descriptors(pid) + 4;
    rlimit::prlimit(
        pid as i32,
        rlimit::Resource::NOFILE,
        Some((limit, limit)),
        None,
    )
    .unwrap();
    // Silent connections: herald accepts them until it is out of descriptors; the rest wait
    // in the kernel's backlog.
    let silent: Vec<TcpStream> = (0..16).map(|_| connect(&herald)).collect();
    herald
        .wait_log(
            "accepting an ingest connection failed",
            1,
            Duration::from_secs(20),
        )
        .await;

    let publishes = (0..20).map(|i| {
        let herald = &herald;
        async move {
            herald
                .publish(
                    NS,
                    json!({"id": format!("fd-{i}"), "type": "order.created", "data": {"n": i}}),
                )
                .await
        }
    });
    let answers = futures::future::join_all(publishes).await;
    assert_eq!(answers.len(), 20);
    let hits = receiver
        .wait_until("all 20 deliveries", Duration::from_secs(90), |hits| {
            let ids: std::collections::HashSet<_> = hits
                .iter()
                .filter(|h| h.verified)
                .map(|h| h.header("webhook-id").to_string())
                .collect();
            ids.len() >= 20
        })
        .await;
    assert!(hits.iter().all(|h| h.path == "/orders"));
    eprintln!(
        "descriptor limit {limit}: 20 events delivered in {} requests",
        hits.len()
    );
    assert!(herald.running(), "herald exited:\n{}", herald.log());
    drop(silent);
}
