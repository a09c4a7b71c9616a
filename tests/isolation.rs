//! RFC 0215 §A: an attempt to one subscription never waits for an attempt to another.
//! Held receivers accept each request and never answer; the held attempts' timeout (60s)
//! is far beyond each scenario, so "still held" means herald has not given up on them.

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::herald::{Herald, quota, secret, subscription};
use support::receiver::{Behaviour, Receiver};

const HELD: &str = "run.started";
const HEALTHY: &str = "run.completed";

fn held_spec() -> Value {
    json!({"delivery": {"timeout": "60s"}})
}

/// Sets up `held` subscriptions per namespace (receivers that hang) and one healthy
/// subscription in `healthy_ns`; publishes the held event in every namespace, waits until
/// `expect_open` held attempts are open, then publishes the healthy event and checks it
/// arrives while every held attempt is still open.
async fn healthy_arrives_while_held(
    held: &[(&str, usize)],
    healthy_ns: &str,
    extra: Vec<Value>,
    expect_open: usize,
    args: &[&str],
) {
    let receiver = Receiver::start().await;
    let mut manifests = extra;
    for (ns, count) in held {
        manifests.push(secret(ns));
        for i in 0..*count {
            let path = format!("/{ns}/held-{i}");
            receiver.set(&path, Behaviour::Hang);
            manifests.push(subscription(
                ns,
                &format!("held-{i}"),
                &receiver.url(&path),
                &[HELD],
                held_spec(),
            ));
        }
    }
    if !held.iter().any(|(ns, _)| *ns == healthy_ns) {
        manifests.push(secret(healthy_ns));
    }
    manifests.push(subscription(
        healthy_ns,
        "healthy",
        &receiver.url("/healthy"),
        &[HEALTHY],
        json!({}),
    ));
    let herald = Herald::start(
        &manifests,
        &[&["--egress-allow", "127.0.0.0/8"], args].concat(),
    );

    for (ns, _) in held {
        herald.publish(ns, json!({"type": HELD, "data": {}})).await;
    }
    receiver
        .wait_until(
            &format!("{expect_open} held attempts open"),
            Duration::from_secs(30),
            |hits| hits.iter().filter(|h| h.path != "/healthy").count() >= expect_open,
        )
        .await;

    herald
        .publish(healthy_ns, json!({"type": HEALTHY, "data": {}}))
        .await;
    let hits = receiver
        .wait_until("the healthy attempt", Duration::from_secs(20), |hits| {
            hits.iter().any(|h| h.path == "/healthy")
        })
        .await;
    let healthy = hits.iter().find(|h| h.path == "/healthy").unwrap();
    assert!(
        healthy.verified,
        "the healthy delivery's signature did not verify"
    );

    // Every held attempt is still on the wire from herald's side: none has finished, none
    // was abandoned, and the healthy one did not wait for any of them.
    let held_hits: Vec<_> = hits.iter().filter(|h| h.path != "/healthy").collect();
    assert_eq!(held_hits.len(), expect_open, "held attempts that arrived");
    for (ns, count) in held {
        for i in 0..*count {
            let open = herald.deliveries(ns, &format!("held-{i}"), "pending").await;
            let states: Vec<_> = open
                .iter()
                .map(|d| d["state"].as_str().unwrap_or_default().to_string())
                .collect();
            assert!(
                states.iter().all(|s| s == "in-flight" || s == "pending"),
                "{ns}/held-{i}: {states:?}"
            );
            assert!(
                open.iter().all(|d| d.get("lastAttempt").is_none()),
                "{ns}/held-{i} finished an attempt: {open:?}"
            );
        }
    }
    let in_flight: usize = {
        let mut n = 0;
        for (ns, count) in held {
            for i in 0..*count {
                n += herald
                    .deliveries(ns, &format!("held-{i}"), "pending")
                    .await
                    .iter()
                    .filter(|d| d["state"] == "in-flight")
                    .count();
            }
        }
        n
    };
    assert_eq!(
        in_flight, expect_open,
        "held attempts herald holds in flight"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_held_receivers_do_not_delay_a_ninth_subscription() {
    healthy_arrives_while_held(&[("tenant", 8)], "tenant", vec![], 8, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_held_receivers_over_three_namespaces() {
    healthy_arrives_while_held(
        &[("ns-a", 67), ("ns-b", 67), ("ns-c", 66)],
        "ns-a",
        vec![],
        200,
        &[],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_at_its_quota_does_not_delay_another_namespace() {
    // 24 held subscriptions in a namespace whose quota lets 16 attempts be on the wire: 16
    // are held, 8 wait (holding nothing), and another namespace's delivery goes straight out.
    healthy_arrives_while_held(&[("noisy", 24)], "quiet", vec![quota("noisy", 16)], 16, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_attempts_beyond_the_shared_pool_do_not_delay_a_quiet_namespace() {
    // A shared pool of 32 (--max-in-flight) and a floor of 16 per namespace: three
    // namespaces with 30 held each, every one under its own quota (256), hold their floors
    // (3 × 16) and the whole pool (32) — more attempts than --max-in-flight, which used to be
    // a global limit that, once full, stopped every other namespace. A quiet namespace still
    // starts at once, from its own floor.
    healthy_arrives_while_held(
        &[("n1", 30), ("n2", 30), ("n3", 30)],
        "quiet",
        vec![],
        3 * 16 + 32,
        &[
            "--max-in-flight",
            "32",
            "--namespace-reserved-in-flight",
            "16",
        ],
    )
    .await;
}
