//! `/metrics` on the metrics port: after deliveries of every outcome (delivered, retried,
//! dead, refused by the egress guard, purged) each counter and histogram moved by exactly
//! what happened, and the exposition parses with the Prometheus project's own Python parser
//! (`prometheus_client`, from PyPI; scripts/test puts its virtualenv first on PATH).

mod support;

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{Value, json};
use support::herald::{Herald, secret, subscription};
use support::receiver::{Behaviour, Receiver};

const NS: &str = "metered";

/// A sample's labels, sorted by name.
type Labels = Vec<(String, String)>;
/// Every sample of a scrape: (name, labels) → value.
type Samples = HashMap<(String, Labels), f64>;

/// Parses an exposition with prometheus_client; returns (name, labels) → value.
fn parse(exposition: &str) -> Samples {
    let script = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
out = []
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        out.append([s.name, sorted(s.labels.items()), s.value])
print(json.dumps(out))
"#;
    let out = support::python(
        &["-c", script],
        exposition.as_bytes(),
        &format!("prometheus_client parsing the exposition\n{exposition}\n"),
    );
    let samples: Vec<(String, Labels, f64)> = serde_json::from_slice(&out).unwrap();
    samples
        .into_iter()
        .map(|(name, labels, value)| ((name, labels), value))
        .collect()
}

async fn scrape(herald: &Herald) -> Samples {
    let url = format!(
        "{}/metrics",
        herald.metrics.as_ref().expect("--metrics-listen")
    );
    let response = reqwest::get(&url).await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let content_type = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    parse(&response.text().await.unwrap())
}

fn value(samples: &Samples, name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut labels: Vec<(String, String)> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    labels.sort();
    samples
        .get(&(name.to_string(), labels))
        .copied()
        .unwrap_or(0.0)
}

fn manifests(receiver: &Receiver, with_bulk: bool) -> Vec<Value> {
    let fast = json!({"disableAfterConsecutiveFailures": 0, "delivery": {"retry": {"initialBackoff": "10ms", "maxBackoff": "20ms"}}});
    let mut list = vec![
        secret(NS),
        subscription(NS, "ok", &receiver.url("/ok"), &["ok"], fast.clone()),
        subscription(
            NS,
            "retry",
            &receiver.url("/retry"),
            &["retry"],
            fast.clone(),
        ),
        subscription(
            NS,
            "dead",
            &receiver.url("/dead"),
            &["dead"],
            json!({"disableAfterConsecutiveFailures": 1}),
        ),
        // 10.0.0.1 is private: the egress guard refuses it (only 127.0.0.0/8 is allowed).
        subscription(NS, "refused", "http://10.0.0.1/hook", &["refused"], fast),
    ];
    if with_bulk {
        list.push(subscription(
            NS,
            "bulk",
            &receiver.url("/bulk"),
            &["bulk"],
            json!({"paused": true}),
        ));
    }
    list
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_exactly_what_happened() {
    let receiver = Receiver::start().await;
    receiver.set("/retry", Behaviour::Script(vec![503, 204]));
    receiver.set("/dead", Behaviour::Status(404));
    let herald = Herald::start(
        &manifests(&receiver, true),
        &[
            "--egress-allow",
            "127.0.0.0/8",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
    );
    let before = scrape(&herald).await;

    for kind in ["ok", "retry", "dead", "refused", "bulk", "bulk", "bulk"] {
        herald.publish(NS, json!({"type": kind})).await;
    }
    // A repeated id is one published event.
    herald
        .publish(NS, json!({"id": "same", "type": "none"}))
        .await;
    herald
        .publish(NS, json!({"id": "same", "type": "none"}))
        .await;
    receiver
        .wait_until("every delivery", Duration::from_secs(30), |hits| {
            let n = |p: &str| hits.iter().filter(|h| h.path == p).count();
            n("/ok") == 1 && n("/retry") == 2 && n("/dead") == 1
        })
        .await;
    for name in ["ok", "retry", "dead", "refused"] {
        herald
            .poll(
                &format!("{name} to settle"),
                &format!("/v1/namespaces/{NS}/subscriptions/{name}/attempts?state=pending"),
                Duration::from_secs(30),
                |status, body| {
                    status == 200 && body["items"].as_array().is_some_and(|i| i.is_empty())
                },
            )
            .await;
    }
    let pending = scrape(&herald).await;
    assert_eq!(
        value(&pending, "herald_pending_attempts", &[("namespace", NS)]),
        3.0,
        "3 wait for the paused subscription"
    );

    herald.write_config(&manifests(&receiver, false));
    herald.wait_removed(NS, "bulk").await;
    let after = scrape(&herald).await;

    let delta = |name: &str, labels: &[(&str, &str)]| {
        value(&after, name, labels) - value(&before, name, labels)
    };
    let ns = ("namespace", NS);
    assert_eq!(
        delta("herald_attempts_total", &[ns, ("outcome", "accepted")]),
        2.0
    );
    assert_eq!(
        delta("herald_attempts_total", &[ns, ("outcome", "transient")]),
        1.0
    );
    assert_eq!(
        delta("herald_attempts_total", &[ns, ("outcome", "terminal")]),
        1.0
    );
    assert_eq!(
        delta("herald_attempts_total", &[ns, ("outcome", "refused")]),
        1.0
    );
    // Requests actually sent: ok, retry twice, dead.
    assert_eq!(delta("herald_attempt_duration_seconds_count", &[ns]), 4.0);
    assert!(delta("herald_attempt_duration_seconds_sum", &[ns]) > 0.0);
    assert_eq!(
        delta("herald_dead_letters_total", &[ns]),
        2.0,
        "dead and refused"
    );
    assert_eq!(
        delta("herald_auto_disabled_total", &[ns]),
        1.0,
        "dead disables after 1 failure"
    );
    assert_eq!(delta("herald_purged_attempts_total", &[ns]), 3.0);
    assert_eq!(
        delta("herald_events_published_total", &[ns]),
        8.0,
        "7 events and one id twice"
    );
    assert_eq!(value(&after, "herald_pending_attempts", &[ns]), 0.0);
    assert_eq!(value(&after, "herald_in_flight_attempts", &[ns]), 0.0);
    assert_eq!(
        delta(
            "herald_store_operation_duration_seconds_count",
            &[("operation", "publish")]
        ),
        9.0
    );
    assert_eq!(
        delta(
            "herald_store_operation_duration_seconds_count",
            &[("operation", "remove_subscription")]
        ),
        1.0
    );
    // Histogram buckets are cumulative and end in +Inf = count.
    assert_eq!(
        value(
            &after,
            "herald_attempt_duration_seconds_bucket",
            &[ns, ("le", "+Inf")]
        ),
        value(&after, "herald_attempt_duration_seconds_count", &[ns])
    );
    // No per-subscription series without --metrics-subscription-labels.
    assert!(
        !after
            .keys()
            .any(|(name, _)| name.starts_with("herald_subscription_"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_subscription_labels_only_behind_the_flag() {
    let receiver = Receiver::start().await;
    let herald = Herald::start(
        &[
            secret(NS),
            subscription(NS, "ok", &receiver.url("/ok"), &["ok"], json!({})),
        ],
        &[
            "--egress-allow",
            "127.0.0.0/8",
            "--metrics-listen",
            "127.0.0.1:0",
            "--metrics-subscription-labels",
        ],
    );
    herald.publish(NS, json!({"type": "ok"})).await;
    receiver
        .wait_until("the delivery", Duration::from_secs(30), |h| h.len() == 1)
        .await;
    let end = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let samples = scrape(&herald).await;
        let labels = [
            ("namespace", NS),
            ("subscription", "ok"),
            ("outcome", "accepted"),
        ];
        if value(&samples, "herald_subscription_attempts_total", &labels) == 1.0 {
            break;
        }
        assert!(
            std::time::Instant::now() < end,
            "no per-subscription series"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Issue 10: idle subscriptions cost nothing at start. 500 subscriptions with nothing
/// pending make no claim on the store (each used to ask it once, 100,000 times at 100,000
/// subscriptions); after a restart, the one with pending work is still woken and delivers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_subscriptions_are_not_claimed_for_at_start() {
    let receiver = Receiver::start().await;
    let mut list = vec![secret(NS)];
    for n in 0..500 {
        list.push(subscription(
            NS,
            &format!("idle-{n}"),
            &receiver.url(&format!("/idle-{n}")),
            &[&format!("idle.{n}")],
            json!({}),
        ));
    }
    let args = [
        "--egress-allow",
        "127.0.0.0/8",
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    let claims = |samples: &Samples| {
        value(
            samples,
            "herald_store_operation_duration_seconds_count",
            &[("operation", "claim_next")],
        )
    };
    let mut herald = Herald::start(&list, &args);
    // Readiness follows the first apply; give the dispatcher a moment it would use to claim.
    herald.publish(NS, json!({"type": "nobody.listens"})).await;
    let samples = scrape(&herald).await;
    assert_eq!(
        claims(&samples),
        0.0,
        "claims at start with nothing pending"
    );

    // Pending work survives a restart and is claimed for: an event whose first attempt failed.
    receiver.set("/idle-7", Behaviour::Status(503));
    herald
        .publish(NS, json!({"id": "kept", "type": "idle.7"}))
        .await;
    // Retries may follow before this waiter runs on a loaded machine: at least one.
    receiver
        .wait_until("the first attempt", Duration::from_secs(30), |h| {
            !h.is_empty()
        })
        .await;
    herald.kill();
    let before_restart = receiver.count();
    receiver.set("/idle-7", Behaviour::Status(204));
    herald.restart();
    receiver
        .wait_until(
            "the retry after the restart",
            Duration::from_secs(60),
            |h| h.len() > before_restart,
        )
        .await;
    let samples = scrape(&herald).await;
    assert!(
        claims(&samples) < 20.0,
        "only the lane with work claims: {}",
        claims(&samples)
    );
}

/// `POST .../events/batch`: a thousand events are one store commit (`publish_batch` timed
/// once, no `publish`), every accepted event arrives once, and each event has its own
/// result: an id published before answers its first publish, and an invalid event and one
/// past the namespace's stored-bytes limit are refused alone while the rest go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_a_thousand_is_one_commit_and_every_event_arrives() {
    let receiver = Receiver::start().await;
    let herald = Herald::start(
        &[
            secret(NS),
            subscription(NS, "ok", &receiver.url("/ok"), &["ok"], json!({})),
        ],
        &[
            "--egress-allow",
            "127.0.0.0/8",
            "--metrics-listen",
            "127.0.0.1:0",
            // A small event stores under 1 KB: 997 of them fit, one of 1,000,000 bytes not.
            "--namespace-max-stored-bytes",
            "1500000",
        ],
    );
    herald.publish(NS, json!({"id": "b-0", "type": "ok"})).await;
    let before = scrape(&herald).await;

    let mut events = vec![json!({"id": "b-0", "type": "ok"})];
    events
        .extend((1..=997).map(|n| json!({"id": format!("b-{n}"), "type": "ok", "data": {"n": n}})));
    events.push(json!({"type": "not a type!"}));
    events.push(json!({"type": "ok", "data": "x".repeat(1_000_000)}));
    let (status, body) = herald
        .post(
            &format!("/v1/namespaces/{NS}/events/batch"),
            json!({"events": events}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let results = body["results"].as_array().expect("results");
    assert_eq!(results.len(), 1000);
    assert_eq!(
        results[0],
        json!({"id": "b-0", "matched": 1, "duplicate": true})
    );
    for (n, result) in results.iter().enumerate().take(998).skip(1) {
        assert_eq!(
            *result,
            json!({"id": format!("b-{n}"), "matched": 1, "duplicate": false})
        );
    }
    assert_eq!(results[998]["status"], 400, "{}", results[998]);
    assert_eq!(results[998]["error"]["code"], "invalid_type");
    assert_eq!(results[999]["status"], 429, "{}", results[999]);
    assert_eq!(results[999]["error"]["code"], "quota_exceeded");

    let hits = receiver
        .wait_until("998 events", Duration::from_secs(120), |h| h.len() >= 998)
        .await;
    let mut ids: Vec<String> = hits
        .iter()
        .map(|h| {
            serde_json::from_slice::<Value>(&h.body).unwrap()["id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 998, "each of b-0..b-997 once");
    assert!(hits.iter().all(|h| h.verified));

    let after = scrape(&herald).await;
    let count = |samples: &Samples, operation: &str| {
        value(
            samples,
            "herald_store_operation_duration_seconds_count",
            &[("operation", operation)],
        )
    };
    assert_eq!(
        count(&after, "publish_batch") - count(&before, "publish_batch"),
        1.0
    );
    assert_eq!(count(&after, "publish") - count(&before, "publish"), 0.0);
    let published = |samples: &Samples| {
        value(
            samples,
            "herald_events_published_total",
            &[("namespace", NS)],
        )
    };
    assert_eq!(published(&after) - published(&before), 997.0);
}
