//! Nothing acknowledged is lost: SIGKILL herald while 10,000 acknowledged events are being
//! delivered, restart it on the same data folder, and every event arrives at least once.
//! Prints the number of duplicates (attempts on the wire at the kill are sent again).

mod support;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use support::herald::{Herald, lanes};
use support::receiver::Receiver;

const NS: &str = "load";
const EVENTS: usize = 10_000;
const LANES: usize = 4;

fn manifests(receiver: &Receiver, paused: bool) -> Vec<Value> {
    lanes(receiver, NS, "load", LANES, 8, paused)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_delivery_loses_no_acknowledged_event() {
    let receiver = Receiver::start().await;
    // Paused while publishing, so that the kill lands in the middle of delivery.
    let mut herald = Herald::start(
        &manifests(&receiver, true),
        &["--egress-allow", "127.0.0.0/8"],
    );

    let herald_base = herald.base.clone();
    let client = reqwest::Client::new();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut publishers = Vec::new();
    for _ in 0..32 {
        let (client, next, base) = (client.clone(), next.clone(), herald_base.clone());
        publishers.push(tokio::spawn(async move {
            let mut acknowledged = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= EVENTS {
                    return acknowledged;
                }
                let id = format!("evt-{i:05}");
                let response = client
                    .post(format!("{base}/v1/namespaces/{NS}/events"))
                    .json(
                        &json!({"id": id, "type": format!("load.{}", i % LANES), "data": {"i": i}}),
                    )
                    .send()
                    .await
                    .unwrap();
                assert_eq!(response.status().as_u16(), 202);
                acknowledged.push(id);
            }
        }));
    }
    let mut acknowledged = HashSet::new();
    for publisher in publishers {
        acknowledged.extend(publisher.await.unwrap());
    }
    assert_eq!(acknowledged.len(), EVENTS);

    herald.write_config(&manifests(&receiver, false));
    receiver
        .wait_until(
            "a fifth of the deliveries",
            Duration::from_secs(60),
            |hits| hits.len() >= EVENTS / 5,
        )
        .await;
    herald.kill();
    let at_kill = receiver.hits().len();
    assert!(
        at_kill < EVENTS,
        "everything was delivered before the kill; the test proves nothing"
    );
    herald.restart();

    let hits = receiver
        .wait_until(
            "every acknowledged event",
            Duration::from_secs(180),
            |hits| {
                hits.iter()
                    .map(|h| h.header("webhook-id"))
                    .collect::<HashSet<_>>()
                    .len()
                    >= EVENTS
            },
        )
        .await;
    let delivered: HashSet<String> = hits
        .iter()
        .map(|h| h.header("webhook-id").to_string())
        .collect();
    assert_eq!(
        delivered, acknowledged,
        "delivered ids differ from acknowledged ids"
    );
    assert!(
        hits.iter().all(|h| h.verified),
        "a delivery's signature did not verify"
    );
    println!(
        "crash safety: {EVENTS} acknowledged, killed after {at_kill} deliveries, all {} delivered after restart, {} duplicate(s)",
        delivered.len(),
        hits.len() - delivered.len()
    );
}
