//! Fair admission of publishes (issue 9, defect 6): a namespace may have only so many
//! publishes waiting for the store; a flood beyond that is answered 429 `publish_busy` with
//! Retry-After at once, writes nothing, and never keeps another namespace from publishing.

mod support;

use std::time::Duration;

use serde_json::json;
use support::herald::{Herald, secret, subscription};

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
