//! Delivery throughput, as a ratio against a reference measured in the same run: a bare
//! reqwest POST loop with the same concurrency against the same loopback receiver.
//!
//! herald runs as its own process (standalone, durable SQLite store). Two figures:
//! - delivery: 10,000 events already stored, released at once (subscriptions unpaused);
//!   time until the receiver has them all;
//! - end to end: 10,000 events published (each acknowledged only once durable) and
//!   delivered; time from the first publish to the last arrival.
//!
//! - latency at idle: one event at a time, from the start of the publish request to its
//!   arrival at the receiver (p50, p99), against one bare POST round trip.
//!
//! Run: `cargo bench --bench delivery_throughput`. Targets: delivery ≥ 0.5 × bare reqwest;
//! latency p50 ≤ 2 ms, p99 ≤ 10 ms.

#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::herald::{Herald, lanes};
use support::receiver::Receiver;

const EVENTS: usize = 10_000;
const CONCURRENCY: usize = 32;
const LANES: usize = 4;
const NS: &str = "bench";

fn manifests(receiver: &Receiver, paused: bool) -> Vec<Value> {
    lanes(receiver, NS, "bench", LANES, CONCURRENCY / LANES, paused)
}

/// Runs `n` jobs over `CONCURRENCY` workers.
async fn concurrently<F, Fut>(n: usize, job: F)
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let next = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let (next, job) = (next.clone(), job.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        return;
                    }
                    job(i).await;
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
}

async fn publish_all(herald: &Herald, offset: usize) {
    let client = reqwest::Client::new();
    let url = format!("{}/v1/namespaces/{NS}/events", herald.base);
    concurrently(EVENTS, move |i| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let i = i + offset;
            let response = client
                .post(&url)
                .json(&json!({"id": format!("evt-{i}"), "type": format!("bench.{}", i % LANES), "data": {"i": i}}))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status().as_u16(), 202);
        }
    })
    .await;
}

const LATENCY_SAMPLES: usize = 300;

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    samples[((samples.len() as f64 * p) as usize).min(samples.len() - 1)]
}

/// Publish → arrival, one event at a time, and the bare POST round trip for reference.
async fn latency(herald: &Herald, receiver: &Receiver) -> (Vec<Duration>, Vec<Duration>) {
    let client = reqwest::Client::new();
    let mut bare = Vec::with_capacity(LATENCY_SAMPLES);
    for _ in 0..LATENCY_SAMPLES {
        let started = Instant::now();
        client
            .post(receiver.url("/reference"))
            .body("{}")
            .send()
            .await
            .unwrap();
        bare.push(started.elapsed());
    }
    let url = format!("{}/v1/namespaces/{NS}/events", herald.base);
    let mut through = Vec::with_capacity(LATENCY_SAMPLES);
    for i in 0..LATENCY_SAMPLES {
        let before = receiver.count();
        let started = Instant::now();
        let response = client
            .post(&url)
            .json(&json!({"id": format!("lat-{i}"), "type": "bench.0", "data": {}}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 202);
        let hits = receiver
            .wait_until("the event", Duration::from_secs(10), |hits| {
                hits.len() > before
            })
            .await;
        through.push(hits[before].at - started);
    }
    (through, bare)
}

fn rate(n: usize, took: Duration) -> f64 {
    n as f64 / took.as_secs_f64()
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let receiver = Receiver::start().await;

        // Reference: a bare reqwest loop, same concurrency, same receiver, same body size.
        let client = reqwest::Client::new();
        let url = receiver.url("/reference");
        let body = serde_json::to_vec(&json!({"id": "evt-00000", "type": "bench.0", "timestamp": "2026-01-01T00:00:00Z", "data": {"i": 0}})).unwrap();
        let started = Instant::now();
        concurrently(EVENTS, move |_| {
            let (client, url, body) = (client.clone(), url.clone(), body.clone());
            async move {
                let status = client.post(&url).body(body).send().await.unwrap().status();
                assert!(status.is_success());
            }
        })
        .await;
        let bare = rate(EVENTS, started.elapsed());

        // herald, delivery only: events stored while paused, then released.
        let herald = Herald::start(&manifests(&receiver, true), &["--egress-allow", "127.0.0.0/8"]);
        publish_all(&herald, 0).await;
        let before = receiver.hits().len();
        let started = Instant::now();
        herald.write_config(&manifests(&receiver, false));
        receiver
            .wait_until("all deliveries", Duration::from_secs(300), |hits| hits.len() >= before + EVENTS)
            .await;
        let delivery = rate(EVENTS, started.elapsed());

        // herald, end to end: publish and deliver at once.
        let before = receiver.hits().len();
        let started = Instant::now();
        publish_all(&herald, EVENTS).await;
        let published = rate(EVENTS, started.elapsed());
        receiver
            .wait_until("all deliveries", Duration::from_secs(300), |hits| hits.len() >= before + EVENTS)
            .await;
        let end_to_end = rate(EVENTS, started.elapsed());

        let (mut through, mut bare_rtt) = latency(&herald, &receiver).await;
        let (p50, p99) = (percentile(&mut through, 0.50), percentile(&mut through, 0.99));
        let (r50, r99) = (percentile(&mut bare_rtt, 0.50), percentile(&mut bare_rtt, 0.99));

        println!("bare reqwest loop:        {bare:>8.0} requests/s (reference, concurrency {CONCURRENCY})");
        println!("herald delivery:          {delivery:>8.0} events/s  = {:.2} x reference", delivery / bare);
        println!("herald publish (durable): {published:>8.0} events/s  = {:.2} x reference", published / bare);
        println!("herald end to end:        {end_to_end:>8.0} events/s  = {:.2} x reference", end_to_end / bare);
        println!(
            "latency at idle, publish to arrival: p50 {p50:.2?} p99 {p99:.2?} (targets 2 ms, 10 ms); bare POST round trip p50 {r50:.2?} p99 {r99:.2?} = {:.1} x / {:.1} x",
            p50.as_secs_f64() / r50.as_secs_f64(),
            p99.as_secs_f64() / r99.as_secs_f64()
        );
        println!("time to deliver {EVENTS} events: herald {:.2}s, bare reqwest {:.2}s", EVENTS as f64 / delivery, EVENTS as f64 / bare);
    });
}
