//! Fair admission (issue 9, defect 6; issue 24, item 4): a namespace may have only so many
//! publishes waiting for the store (a flood beyond that is answered 429 `publish_busy` with
//! Retry-After at once, writes nothing, and never keeps another namespace from publishing)
//! and store only so many bytes. (Reads: tests/read_flood.rs.)

mod support;

use std::time::Duration;

use serde_json::json;
use support::herald::{Herald, secret, subscription};
use support::receiver::Receiver;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_is_turned_away_at_the_door_and_others_publish() {
    // Paused subscriptions keep every accepted event as a pending delivery, to count them.
    let herald = Herald::start(
        &[
            secret("flood"),
            subscription(
                "flood",
                "sink",
                "http://127.0.0.1:9/",
                &["*"],
                json!({"paused": true}),
            ),
            secret("calm"),
            subscription(
                "calm",
                "sink",
                "http://127.0.0.1:9/",
                &["*"],
                json!({"paused": true}),
            ),
        ],
        &["--namespace-max-concurrent-publishes", "1"],
    );
    let client = reqwest::Client::new();
    let url = |ns: &str| format!("{}/v1/namespaces/{ns}/events", herald.base);
    let flood: Vec<_> = (0..200)
        .map(|i| {
            let request = client
                .post(url("flood"))
                .json(&json!({"id": format!("flood-{i}"), "type": "x"}));
            tokio::spawn(async move {
                let response = request.send().await.unwrap();
                let status = response.status().as_u16();
                let retry_after = response
                    .headers()
                    .get("retry-after")
                    .map(|v| v.to_str().unwrap().to_string());
                let body: serde_json::Value = response.json().await.unwrap();
                (status, retry_after, body)
            })
        })
        .collect();
    // Meanwhile another namespace publishes: never turned away (it has nothing waiting).
    for i in 0..20 {
        let response = client
            .post(url("calm"))
            .json(&json!({"id": format!("calm-{i}"), "type": "x"}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 202, "calm was refused");
    }
    let mut accepted = 0;
    let mut busy = 0;
    for task in flood {
        let (status, retry_after, body) = task.await.unwrap();
        match status {
            202 => accepted += 1,
            429 => {
                assert_eq!(body["error"]["code"], "publish_busy", "{body}");
                assert_eq!(retry_after.as_deref(), Some("1"));
                busy += 1;
            }
            other => panic!("flood publish answered {other} {body}"),
        }
    }
    println!("flood: {accepted} accepted, {busy} turned away");
    assert!(
        busy > 0,
        "200 concurrent publishes with room for 1: none was turned away"
    );
    // Exactly the accepted ones were written; the turned-away ones left nothing behind.
    let pending = |ns: &'static str| {
        let herald = &herald;
        async move {
            let (status, body) = herald
                .get(&format!("/v1/namespaces/{ns}/subscriptions/sink"))
                .await;
            assert_eq!(status, 200, "{body}");
            body["pending"].as_u64().unwrap()
        }
    };
    assert_eq!(pending("flood").await, accepted);
    assert_eq!(pending("calm").await, 20);
    // Turned away, then tried again: accepted, like any publish.
    let response = tokio::time::timeout(
        Duration::from_secs(10),
        client
            .post(url("flood"))
            .json(&json!({"id": "later", "type": "x"}))
            .send(),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(response.status().as_u16(), 202);
}

/// Issue 24 item 4: one namespace publishes 60 KiB events, delivered at once to a fast
/// receiver (bodies are kept for the history all the same), until its 1 MiB byte budget
/// refuses them: 429 `quota_exceeded` naming the limit, nothing written. Another namespace
/// keeps publishing and delivering; a retry of an accepted event still gets its first
/// answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_over_its_byte_budget_is_refused_and_others_keep_delivering() {
    let receiver = Receiver::start().await;
    let herald = Herald::start(
        &[
            secret("flood"),
            subscription("flood", "sink", &receiver.url("/flood"), &["*"], json!({})),
            json!({
                "apiVersion": "herald.dev/v1alpha1",
                "kind": "WebhookQuota",
                "metadata": {"name": "quota", "namespace": "flood"},
                "spec": {"maxStoredBytes": 1048576},
            }),
            secret("calm"),
            subscription("calm", "sink", &receiver.url("/calm"), &["*"], json!({})),
        ],
        &["--egress-allow", "127.0.0.0/8"],
    );
    let pad = "x".repeat(60 * 1024);
    let mut accepted = 0;
    let refusal = loop {
        let (status, body) = herald
            .post(
                "/v1/namespaces/flood/events",
                json!({"id": format!("big-{accepted}"), "type": "x", "data": {"pad": pad}}),
            )
            .await;
        if status != 202 {
            assert_eq!(status, 429, "{body}");
            break body;
        }
        accepted += 1;
        assert!(accepted < 40, "40 events of 60 KiB passed a 1 MiB budget");
    };
    println!("flood: {accepted} events of 60 KiB accepted, then {refusal}");
    assert_eq!(refusal["error"]["code"], "quota_exceeded", "{refusal}");
    let message = refusal["error"]["message"].as_str().unwrap();
    assert!(message.contains("maxStoredBytes of 1048576"), "{message}");
    // 1 MiB over 60 KiB bodies plus their overheads: 16.
    assert_eq!(accepted, 16);
    // Refused events wrote nothing; a retry of an accepted one gets its first answer.
    let (status, body) = herald
        .post(
            "/v1/namespaces/flood/events",
            json!({"id": "big-3", "type": "x", "data": {"pad": pad}}),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    receiver
        .wait_until("the flood's deliveries", Duration::from_secs(30), |hits| {
            hits.iter().filter(|h| h.path == "/flood").count() >= accepted
        })
        .await;

    // Delivered, the flood's bodies still count: it stays refused. The other namespace is
    // not held to its budget.
    let (status, _) = herald
        .post(
            "/v1/namespaces/flood/events",
            json!({"id": "big-later", "type": "x", "data": {"pad": pad}}),
        )
        .await;
    assert_eq!(status, 429);
    for i in 0..20 {
        herald
            .publish(
                "calm",
                json!({"id": format!("calm-{i}"), "type": "x", "data": {"pad": pad}}),
            )
            .await;
    }
    receiver
        .wait_until(
            "the calm namespace's deliveries",
            Duration::from_secs(30),
            |hits| hits.iter().filter(|h| h.path == "/calm").count() >= 20,
        )
        .await;
    assert_eq!(
        receiver
            .hits()
            .iter()
            .filter(|h| h.path == "/flood")
            .count(),
        accepted,
        "a refused event was delivered"
    );
}
