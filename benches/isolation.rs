//! Isolation at scale (RFC 0215 §A): a healthy subscription's publish → arrival latency
//! while 0, 100, 1,000 and 10,000 receivers accept requests and never answer, spread over
//! namespaces of 100 held subscriptions each (each namespace under its own quota). Each
//! level's p99 is compared with the p99 with nothing held, measured in the same run.
//!
//! Run: `cargo bench --bench isolation` (HERALD_BENCH_HELD=0,100,1000 for fewer levels;
//! `HERALD_BENCH_MODE=quick` takes fewer samples per level, benches/common/mod.rs).
//! Targets: p99 at 1,000 held ≤ 1.5 × p99 at 0; p99 at 10,000 held < 50 ms.

#[path = "../tests/support/mod.rs"]
mod support;

mod common;

use std::time::{Duration, Instant};

use common::{Report, Target, ms, percentile, thousands};
use serde_json::{Value, json};
use support::herald::{Herald, secret, subscription};
use support::receiver::{Behaviour, Receiver};

const PER_NAMESPACE: usize = 100;
/// herald's defaults: the shared pool and each namespace's reserved floor.
const POOL: usize = 4096;
const FLOOR: usize = 16;

/// Healthy events published and not measured before the samples of each level.
const WARM_UP: usize = 20;

/// Publish → arrival latencies of the healthy subscription, one event at a time.
async fn healthy_latency(herald: &Herald, receiver: &Receiver, samples: usize) -> Vec<Duration> {
    let client = reqwest::Client::new();
    let url = format!("{}/v1/namespaces/healthy/events", herald.base);
    let mut latencies = Vec::with_capacity(samples);
    for i in 0..samples {
        let before = receiver.count();
        let started = Instant::now();
        let response = client
            .post(&url)
            .json(&json!({"type": "ping", "data": {"i": i}}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 202);
        let arrived = receiver
            .wait_for("the healthy delivery", Duration::from_secs(10), |hits| {
                hits[before..]
                    .iter()
                    .find(|h| h.path == "/ok")
                    .map(|h| h.at)
            })
            .await;
        latencies.push(arrived - started);
    }
    latencies
}

async fn level(held: usize, samples: usize) -> (Duration, Duration, usize) {
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
        .wait_for(
            &format!("{open} held attempts open"),
            Duration::from_secs(300),
            |hits| (hits.iter().filter(|h| h.path != "/ok").count() >= open).then_some(()),
        )
        .await;
    // Warm-up, the same at every level: the first deliveries open the connection to the
    // receiver and warm herald's store; at 0 held nothing else has.
    healthy_latency(&herald, &receiver, WARM_UP).await;
    let mut samples = healthy_latency(&herald, &receiver, samples).await;
    (
        percentile(&mut samples, 0.5),
        percentile(&mut samples, 0.99),
        open,
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut report = Report::new("isolation");
    let samples = report.mode.pick(50, 1_000);
    let levels: Vec<usize> = std::env::var("HERALD_BENCH_HELD")
        .unwrap_or_else(|_| "0,100,1000,10000".into())
        .split(',')
        .map(|v| v.trim().parse().expect("HERALD_BENCH_HELD: numbers"))
        .collect();
    report.param("samples_per_level", samples);
    report.param("held_per_namespace", PER_NAMESPACE);
    let mut rows = Vec::new();
    for held in levels {
        let (p50, p99, open) = level(held, samples).await;
        eprintln!("held {held}: {open} on the wire, healthy p50 {p50:.2?} p99 {p99:.2?}");
        report.param(&format!("on_the_wire_held_{held}"), open);
        rows.push((held, open, p50, p99));
    }
    let none = rows.iter().find(|r| r.0 == 0).copied();
    for (held, open, p50, p99) in rows {
        let what = format!(
            "isolation: healthy publish → arrival with {} receivers held ({} on the wire, {} namespaces)",
            thousands(held),
            thousands(open),
            held.div_ceil(PER_NAMESPACE)
        );
        for (quantile, value, reference) in [
            ("p50", p50, none.map(|n| n.2)),
            ("p99", p99, none.map(|n| n.3)),
        ] {
            let figure = report.add(
                &format!("isolation.held_{held}.{quantile}"),
                &format!("{what}, {quantile}"),
                ms(value),
                "ms",
            );
            if let Some(reference) = reference.filter(|_| held > 0) {
                figure.reference(
                    &format!("{quantile} with none held, same run"),
                    ms(reference),
                );
            }
            match (quantile, held) {
                ("p99", 1000) if reference.is_some() => {
                    figure.target(Target::RatioAtMost(1.5));
                }
                ("p99", 10000) => {
                    figure.target(Target::Below(50.0));
                }
                _ => {}
            }
        }
    }
    report.finish();
}
