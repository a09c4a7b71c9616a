//! RFC 0215 §B, against a control: two subscriptions on one receiver, both answered 500
//! and retried quickly. The target is removed once its first attempt has been answered; the
//! control is left alone, so its retries show when the target's would have come. From the
//! removal + 5 s on, the control is still retried and the target never is — also when herald
//! is SIGKILLed right after the removal and restarted.

mod support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::herald::{Herald, secret, subscription};
use support::receiver::{Behaviour, Receiver};

const NS: &str = "tenant";
const GRACE: Duration = Duration::from_secs(5);
/// How long after the grace the control must keep being retried while the target is not.
const WATCH: Duration = Duration::from_secs(4);

fn manifests(receiver: &Receiver, with_target: bool) -> Vec<Value> {
    let fast_retries = json!({"disableAfterConsecutiveFailures": 0, "delivery": {"timeout": "2s", "retry": {
        "maxAttempts": 1000, "initialBackoff": "50ms", "maxBackoff": "400ms", "maxDuration": "1h"
    }}});
    let mut list = vec![
        secret(NS),
        subscription(
            NS,
            "control",
            &receiver.url("/control"),
            &["run.completed"],
            fast_retries.clone(),
        ),
    ];
    if with_target {
        list.push(subscription(
            NS,
            "target",
            &receiver.url("/target"),
            &["run.completed"],
            fast_retries,
        ));
    }
    list
}

async fn unregister_stops_attempts(crash_after_removal: bool) {
    let receiver = Receiver::start().await;
    receiver.set("/control", Behaviour::Status(500));
    receiver.set("/target", Behaviour::Status(500));
    let mut herald = Herald::start(
        &manifests(&receiver, true),
        &["--egress-allow", "127.0.0.0/8"],
    );
    // Several events, so that retries of many deliveries are pending at the removal.
    for i in 0..5 {
        herald
            .publish(
                NS,
                json!({"id": format!("evt-{i}"), "type": "run.completed", "data": {}}),
            )
            .await;
    }
    receiver
        .wait_until(
            "the target's first answered attempts",
            Duration::from_secs(20),
            |hits| hits.iter().filter(|h| h.path == "/target").count() >= 5,
        )
        .await;
    assert!(
        !herald.deliveries(NS, "target", "pending").await.is_empty(),
        "retries are pending at the removal"
    );

    herald.write_config(&manifests(&receiver, false));
    let removed_at;
    if crash_after_removal {
        removed_at = Instant::now();
        herald.kill();
        herald.restart();
        herald.wait_removed(NS, "target").await;
    } else {
        herald.wait_removed(NS, "target").await;
        removed_at = Instant::now();
    }

    let quiet_from = removed_at + GRACE;
    let watch_until = quiet_from + WATCH;
    tokio::time::sleep_until(tokio::time::Instant::from_std(watch_until)).await;
    let hits = receiver.hits();
    let late_target: Vec<_> = hits
        .iter()
        .filter(|h| h.path == "/target" && h.at > quiet_from)
        .collect();
    let late_control = hits
        .iter()
        .filter(|h| h.path == "/control" && h.at > quiet_from)
        .count();
    let all_target = hits.iter().filter(|h| h.path == "/target").count();
    println!(
        "target: {all_target} attempt(s), {} after the removal + 5 s; control: {late_control} attempt(s) after that point",
        late_target.len()
    );
    assert!(
        late_control >= 2,
        "the control was not retried after the removal + 5 s ({late_control}): the test proves nothing"
    );
    assert!(
        late_target.is_empty(),
        "{} attempt(s) for the removed target after the removal + 5 s",
        late_target.len()
    );
    let (status, _) = herald
        .get(&format!(
            "/v1/namespaces/{NS}/subscriptions/target/attempts"
        ))
        .await;
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_subscription_stops_its_retries() {
    unregister_stops_attempts(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removal_holds_across_sigkill_and_restart() {
    unregister_stops_attempts(true).await;
}
