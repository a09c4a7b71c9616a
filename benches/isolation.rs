//! Isolation at scale (RFC 0215 §A): a healthy subscription's publish → arrival latency
//! while 0, 100, 1,000 and 10,000 receivers accept requests and never answer, spread over
//! namespaces of 100 held subscriptions each (each namespace under its own quota). Each
//! level's p99 is compared with the p99 with nothing held, measured in the same run.
//!
//! Run: `cargo bench --bench isolation` (HERALD_BENCH_HELD=0,100,1000 for fewer levels).
//! Targets: p99 at 1,000 held ≤ 1.5 × p99 at 0; p99 at 10,000 held < 50 ms.

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::herald::{Herald, secret, subscription};
use support::receiver::{Behaviour, Receiver};

const PER_NAMESPACE: usize = 100;
const SAMPLES: usize = 200;
/// herald's defaults: the shared pool and each namespace's reserved floor.
const POOL: usize = 4096;
const FLOOR: usize = 16;

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    samples[((samples.len() as f64 * p) as usize).min(samples.len() - 1)]
}

/// Publish → arrival latencies of the healthy subscription, one event at a time.
async fn healthy_latency(herald: &Herald, receiver: &Receiver) -> Vec<Duration> {
    let client = reqwest::Client::new();
    let url = format!("{}/v1/namespaces/healthy/events", herald.base);
    let mut samples = Vec::with_capacity(SAMPLES);
    for i in 0..SAMPLES {
        let before = receiver.hits_for("/ok").len();
        let started = Instant::now();
        let response = client
            .post(&url)
            .json(&json!({"id": format!("ping-{i}"), "type": "ping", "data": {}}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 202);
        let hits = receiver
            .wait_until("the healthy delivery", Duration::from_secs(10), |hits| {
                hits.iter().filter(|h| h.path == "/ok").count() > before
            })
            .await;
        let arrived = hits.iter().filter(|h| h.path == "/ok").nth(before).unwrap();
        samples.push(arrived.at - started);
    }
    samples
}

async fn level(held: usize) -> (Duration, Duration, usize) {
    let receiver = Receiver::start().await;
    let namespaces = held.div_ceil(PER_NAMESPACE);
    let mut manifests: Vec<Value> = Vec::with_capacity(held + namespaces + 2);
    for n in 0..namespaces {
        let ns = format!("held-{n}");
        manifests.push(secret(&ns));
        for i in 0..PER_NAMESPACE.min(held - n * PER_NAMESPACE) {
            let path = format!("/{ns}/{i}");
            receiver.set(&path, Behaviour::Hang);
            manifests.push(subscription(
                &ns,
                &format!("h-{i}"),
                &receiver.url(&path),
                &["held"],
                json!({"delivery": {"timeout": "5m"}}),
            ));
        }
    }
    manifests.push(secret("healthy"));
    manifests.push(subscription(
        "healthy",
        "ok",
        &receiver.url("/ok"),
        &["ping"],
        json!({}),
    ));
    let herald = Herald::start(&manifests, &["--egress-allow", "127.0.0.0/8"]);
    for n in 0..namespaces {
        herald
            .publish(&format!("held-{n}"), json!({"type": "held"}))
            .await;
    }
    // Each namespace holds its floor; the rest of its attempts share the pool.
    let open = (namespaces * FLOOR).min(held) + held.saturating_sub(namespaces * FLOOR).min(POOL);
    receiver
        .wait_until(
            &format!("{open} held attempts open"),
            Duration::from_secs(300),
            |hits| hits.iter().filter(|h| h.path != "/ok").count() >= open,
        )
        .await;
    let mut samples = healthy_latency(&herald, &receiver).await;
    (
        percentile(&mut samples, 0.5),
        percentile(&mut samples, 0.99),
        open,
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let levels: Vec<usize> = std::env::var("HERALD_BENCH_HELD")
        .unwrap_or_else(|_| "0,100,1000,10000".into())
        .split(',')
        .map(|v| v.trim().parse().expect("HERALD_BENCH_HELD: numbers"))
        .collect();
    let mut rows = Vec::new();
    for held in levels {
        let (p50, p99, open) = level(held).await;
        eprintln!("held {held}: {open} on the wire, healthy p50 {p50:.2?} p99 {p99:.2?}");
        rows.push((held, open, p50, p99));
    }
    let reference = rows
        .iter()
        .find(|r| r.0 == 0)
        .map(|r| r.3)
        .unwrap_or(rows[0].3);
    println!();
    println!(
        "| held receivers | attempts on the wire | healthy p50 | healthy p99 | p99 / p99 with none held |"
    );
    println!("| --- | --- | --- | --- | --- |");
    let mut json_rows = Vec::new();
    for (held, open, p50, p99) in &rows {
        let ratio = p99.as_secs_f64() / reference.as_secs_f64();
        println!("| {held} | {open} | {p50:.2?} | {p99:.2?} | {ratio:.2} |");
        json_rows.push(json!({
            "held": held, "on_the_wire": open,
            "p50_ms": p50.as_secs_f64() * 1e3, "p99_ms": p99.as_secs_f64() * 1e3,
            "p99_ratio": ratio,
        }));
    }
    println!("{}", json!({"isolation": json_rows}));
}
