//! The operator's figures, each against a reference from the same run:
//! - publishing with cluster authorization (TokenReview + SubjectAccessReview, cached) as a
//!   ratio to standalone mode's static `--publish-token`, same herald build, same load;
//! - memory: herald's RSS in cluster mode with N subscriptions reconciled, against its RSS
//!   with none, per subscription.
//!
//! Needs the test control plane (`scripts/control-plane build`). Run:
//! `cargo bench --bench operator` (HERALD_BENCH_SUBSCRIPTIONS, default 10,000).

#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::control_plane::ControlPlane;
use support::herald::{Herald, secret, subscription};
use support::operator::Operator;

const EVENTS: usize = 20_000;
const CONCURRENCY: usize = 32;

/// Publishes EVENTS events over CONCURRENCY producers; events per second.
async fn publish_rate(base: &str, namespace: &str, token: &str) -> f64 {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let next = next.clone();
            let url = format!("{base}/v1/namespaces/{namespace}/events");
            let token = token.to_string();
            let client = reqwest::Client::new();
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= EVENTS {
                        return;
                    }
                    let r = client
                        .post(&url)
                        .bearer_auth(&token)
                        .json(&json!({"type": "bench.event", "data": {"i": i}}))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status().as_u16(), 202);
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    EVENTS as f64 / started.elapsed().as_secs_f64()
}

fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    kib / 1024.0
}

fn paused_subscription(namespace: &str, name: &str) -> Value {
    subscription(
        namespace,
        name,
        "http://127.0.0.1:9/never",
        &["bench.*"],
        json!({"paused": true}),
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let subscriptions: usize = std::env::var("HERALD_BENCH_SUBSCRIPTIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let cp = ControlPlane::start().expect("the benchmark needs the control plane");
    let operator = Operator::start(&cp, &[]).await;

    // Publishing: one paused subscription, so every event is stored with one pending
    // delivery and nothing is sent; the same in both modes.
    let mut objects = vec![
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "bench"}}),
        secret("bench"),
        paused_subscription("bench", "stored"),
        json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "producer", "namespace": "bench"}}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": "producer", "namespace": "bench"},
               "rules": [{"apiGroups": ["herald.dev"], "resources": ["webhookevents"], "verbs": ["create"]}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "producer", "namespace": "bench"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "producer"},
               "subjects": [{"kind": "ServiceAccount", "name": "producer", "namespace": "bench"}]}),
    ];
    cp.apply(&objects);
    cp.kubectl_ok(&[
        "wait",
        "--for=jsonpath={.status.observedGeneration}=1",
        "whsub/stored",
        "-n",
        "bench",
        "--timeout=60s",
    ]);
    let token = cp.token("bench", "producer");
    let rss_idle = rss_mib(operator.pid());
    let with_rbac = publish_rate(&operator.base, "bench", &token).await;

    let standalone = Herald::start(
        &[secret("bench"), paused_subscription("bench", "stored")],
        &["--publish-token", "bench-token"],
    );
    let with_token = publish_rate(&standalone.base, "bench", "bench-token").await;
    drop(standalone);

    // Memory: N subscriptions applied in lists of 500, then reconciled.
    objects.clear();
    let started = Instant::now();
    for chunk in (0..subscriptions).collect::<Vec<_>>().chunks(500) {
        let list: Vec<Value> = chunk
            .iter()
            .map(|i| paused_subscription("bench", &format!("s-{i}")))
            .collect();
        cp.apply(&list);
    }
    let applied = started.elapsed();
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        let out = cp.kubectl_ok(&[
            "get",
            "whsub",
            "-n",
            "bench",
            "-o",
            "jsonpath={range .items[*]}{.status.observedGeneration}{\"\\n\"}{end}",
        ]);
        let done = out.lines().filter(|l| !l.is_empty()).count();
        if done > subscriptions {
            break;
        }
        assert!(Instant::now() < deadline, "only {done} reconciled");
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let reconciled = started.elapsed();
    let rss_full = rss_mib(operator.pid());
    let per_sub_kib = (rss_full - rss_idle) * 1024.0 / subscriptions as f64;

    println!();
    println!("| figure | herald | reference | ratio |");
    println!("| --- | --- | --- | --- |");
    println!(
        "| publish, {EVENTS} events, {CONCURRENCY} producers | {with_rbac:.0}/s (TokenReview + SubjectAccessReview, cached) | {with_token:.0}/s (--publish-token) | {:.2} |",
        with_rbac / with_token
    );
    println!(
        "| RSS with {subscriptions} subscriptions reconciled | {rss_full:.0} MiB | {rss_idle:.0} MiB with 1 | {per_sub_kib:.2} KiB per subscription |"
    );
    println!(
        "| applying {subscriptions} subscriptions / all reconciled | {:.1}s | {:.1}s | |",
        applied.as_secs_f64(),
        reconciled.as_secs_f64()
    );
    let json = json!({
        "publish_rbac_per_s": with_rbac, "publish_token_per_s": with_token,
        "publish_ratio": with_rbac / with_token,
        "rss_idle_mib": rss_idle, "rss_mib": rss_full, "subscriptions": subscriptions,
        "rss_per_subscription_kib": per_sub_kib,
        "reconciled_seconds": reconciled.as_secs_f64(),
    });
    println!("{json}");
    drop(operator);
}
