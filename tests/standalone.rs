//! Standalone mode as a process: the folder is re-read on SIGHUP alone and by polling alone,
//! a bad folder keeps the last configuration, a SIGHUP right after readiness is handled, a
//! subscription whose secret is missing holds its events until the secret appears, the
//! publish token guards every API call, and the health endpoints answer.

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::herald::{Herald, secret, subscription};
use support::receiver::{Behaviour, Receiver};

const NS: &str = "shop";
const ALLOW_LOOPBACK: &[&str] = &["--egress-allow", "127.0.0.0/8"];

fn hook(receiver: &Receiver, name: &str, spec: Value) -> Value {
    subscription(NS, name, &receiver.url(&format!("/{name}")), &["*"], spec)
}

/// Waits until herald knows (or, with `present` false, no longer knows) the subscription.
async fn wait_known(herald: &Herald, name: &str, present: bool) {
    herald
        .poll(
            &format!("{name} to be {}", if present { "added" } else { "removed" }),
            &format!("/v1/namespaces/{NS}/subscriptions/{name}"),
            Duration::from_secs(20),
            |status, _| (status == 200) == present,
        )
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_alone_reloads_the_folder() {
    let receiver = Receiver::start().await;
    // Polling off: only SIGHUP can make herald read the folder again.
    let mut herald = Herald::start_env(
        &[secret(NS), hook(&receiver, "a", json!({}))],
        ALLOW_LOOPBACK,
        &[("HERALD_CONFIG_POLL_MS", "0")],
    );
    herald.write_files(&[
        secret(NS),
        hook(&receiver, "a", json!({})),
        hook(&receiver, "b", json!({})),
    ]);
    herald.hangup();
    wait_known(&herald, "b", true).await;
    // Twice, to see the handler stays installed.
    herald.write_files(&[secret(NS), hook(&receiver, "b", json!({}))]);
    herald.hangup();
    wait_known(&herald, "a", false).await;
    assert!(herald.running());
    let accepted = herald.publish(NS, json!({"type": "order.paid"})).await;
    assert_eq!(accepted["matched"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_alone_notices_a_changed_folder() {
    let receiver = Receiver::start().await;
    let herald = Herald::start(
        &[secret(NS), hook(&receiver, "a", json!({}))],
        ALLOW_LOOPBACK,
    );
    // No signal: the default one-second polling must find the change.
    herald.write_files(&[
        secret(NS),
        hook(&receiver, "a", json!({})),
        hook(&receiver, "b", json!({})),
    ]);
    wait_known(&herald, "b", true).await;
    herald.write_files(&[secret(NS), hook(&receiver, "b", json!({}))]);
    wait_known(&herald, "a", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sighup_right_after_readiness_is_handled() {
    let receiver = Receiver::start().await;
    // A large folder makes the moments around readiness long enough to hit.
    let padding: String = (0..200_000)
        .map(|i| format!("# padding line {i:08} to make the folder slow to read\n"))
        .chain(["---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: padding}\n".to_string()])
        .collect();
    let mut herald = Herald::start(
        &[secret(NS), hook(&receiver, "a", json!({}))],
        ALLOW_LOOPBACK,
    );
    herald.write_text("padding.yaml", &padding);
    for round in 0..3 {
        // SIGHUP the moment the ready file appears: herald must handle it, not die of it.
        herald.restart_hangup_at_ready();
        let answer = reqwest::get(format!("{}/healthz", herald.base)).await;
        assert!(
            answer.is_ok_and(|r| r.status() == 200),
            "round {round}: herald did not survive a SIGHUP at readiness (running: {}):\n{}",
            herald.running(),
            herald.log()
        );
        herald
            .wait_log("configuration applied", round + 1, Duration::from_secs(30))
            .await;
        assert!(herald.running(), "round {round}:\n{}", herald.log());
    }
}

/// Issue 9, defect 1: an empty (truncated) file, a symlink that does not resolve and an
/// emptied folder are what a configuration being written looks like; none of them may purge
/// pending deliveries, and the restored folder finds the same subscription with its events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_written_folder_purges_nothing() {
    let receiver = Receiver::start().await;
    let paused = |paused: bool| hook(&receiver, "hook", json!({"paused": paused}));
    let herald = Herald::start_env(
        &[secret(NS), paused(true)],
        ALLOW_LOOPBACK,
        &[("HERALD_CONFIG_POLL_MS", "0")],
    );
    for i in 0..2 {
        herald
            .publish(NS, json!({"id": format!("evt-{i}"), "type": "order.paid"}))
            .await;
    }
    let config = herald.dir.join("config");
    let manifests = config.join("manifests.yaml");
    type Step<'a> = (&'a str, Box<dyn Fn() + 'a>);
    let steps: [Step; 3] = [
        (
            "an empty file",
            Box::new(|| std::fs::write(&manifests, "").unwrap()),
        ),
        (
            "a broken symlink",
            Box::new(|| {
                std::fs::remove_file(&manifests).unwrap();
                std::os::unix::fs::symlink(config.join("elsewhere.yaml"), &manifests).unwrap();
            }),
        ),
        (
            "an emptied folder",
            Box::new(|| std::fs::remove_file(&manifests).unwrap()),
        ),
    ];
    for (n, (what, step)) in steps.iter().enumerate() {
        step();
        herald.hangup();
        herald
            .wait_log("configuration not applied", n + 1, Duration::from_secs(20))
            .await;
        let pending = herald.deliveries(NS, "hook", "pending").await;
        assert_eq!(pending.len(), 2, "after {what}: {pending:?}");
    }
    herald.write_config(&[secret(NS), paused(false)]);
    receiver
        .wait_until("the kept deliveries", Duration::from_secs(20), |h| {
            h.len() == 2
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_folder_on_reload_keeps_the_last_configuration() {
    let receiver = Receiver::start().await;
    let paused = |paused: bool| hook(&receiver, "hook", json!({"paused": paused}));
    let herald = Herald::start_env(
        &[secret(NS), paused(true)],
        ALLOW_LOOPBACK,
        &[("HERALD_CONFIG_POLL_MS", "0")],
    );
    for i in 0..2 {
        herald
            .publish(NS, json!({"id": format!("evt-{i}"), "type": "order.paid"}))
            .await;
    }
    // Each of these must change nothing: not parse, an invalid subscription next to a
    // folder without "hook" (which, applied, would purge its pending deliveries).
    let broken = [
        "{ not yaml".to_string(),
        format!(
            "---\n{}\n---\n{}\n",
            secret(NS),
            subscription(NS, "other", "ftp://example.com/", &["*"], json!({}))
        ),
    ];
    for (n, text) in broken.iter().enumerate() {
        herald.write_text("manifests.yaml", text);
        herald.hangup();
        herald
            .wait_log("configuration not applied", n + 1, Duration::from_secs(20))
            .await;
        let pending = herald.deliveries(NS, "hook", "pending").await;
        assert_eq!(pending.len(), 2, "after bad folder {n}: {pending:?}");
        let (status, _) = herald
            .get(&format!("/v1/namespaces/{NS}/subscriptions/other"))
            .await;
        assert_eq!(status, 404);
    }
    // The last good configuration still delivers once the folder is fixed.
    herald.write_config(&[secret(NS), paused(false)]);
    receiver
        .wait_until("the kept deliveries", Duration::from_secs(20), |h| {
            h.len() == 2
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_secret_holds_events_until_it_appears() {
    let receiver = Receiver::start().await;
    let later = json!({"signing": {"secretRef": {"name": "later-secret", "key": "secret"}}});
    let manifests = |with_secret: bool| {
        let mut list = vec![
            secret(NS),
            hook(&receiver, "waiting", later.clone()),
            // Gets the same events: once they reached it, "waiting" had every chance.
            hook(&receiver, "witness", json!({})),
        ];
        if with_secret {
            let mut s = secret(NS);
            s["metadata"]["name"] = json!("later-secret");
            list.push(s);
        }
        list
    };
    let herald = Herald::start(&manifests(false), ALLOW_LOOPBACK);
    for i in 0..3 {
        let accepted = herald
            .publish(NS, json!({"id": format!("evt-{i}"), "type": "order.paid"}))
            .await;
        assert_eq!(
            accepted["matched"], 2,
            "events for it are accepted and kept"
        );
    }
    receiver
        .wait_until("the witness's deliveries", Duration::from_secs(20), |h| {
            h.iter().filter(|h| h.path == "/witness").count() == 3
        })
        .await;
    assert!(receiver.hits_for("/waiting").is_empty());
    let pending = herald.deliveries(NS, "waiting", "pending").await;
    assert_eq!(pending.len(), 3, "{pending:?}");
    assert!(pending.iter().all(|d| d["attempts"] == 0), "{pending:?}");
    assert!(herald.log().contains("Secret shop/later-secret not found"));

    herald.write_config(&manifests(true));
    let hits = receiver
        .wait_until("the held deliveries", Duration::from_secs(20), |h| {
            h.iter().filter(|h| h.path == "/waiting").count() == 3
        })
        .await;
    assert!(
        hits.iter()
            .filter(|h| h.path == "/waiting")
            .all(|h| h.verified && h.header("herald-attempt") == "1")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_publish_token_guards_every_api_call_but_health() {
    let receiver = Receiver::start().await;
    receiver.set("/hook", Behaviour::Status(404));
    let herald = Herald::start(
        &[secret(NS), hook(&receiver, "hook", json!({}))],
        &["--egress-allow", "127.0.0.0/8", "--publish-token", "s3cret"],
    );
    // Through the helper (which sends the token): one dead letter to read and replay.
    herald
        .publish(NS, json!({"id": "evt-1", "type": "order.paid"}))
        .await;
    herald
        .poll(
            "the dead letter",
            &format!("/v1/namespaces/{NS}/subscriptions/hook/attempts?state=dead"),
            Duration::from_secs(20),
            |status, body| status == 200 && body["items"].as_array().is_some_and(|i| i.len() == 1),
        )
        .await;

    let client = reqwest::Client::new();
    let base = format!("{}/v1/namespaces/{NS}", herald.base);
    let calls: [(&str, String); 6] = [
        ("POST", format!("{base}/events")),
        ("GET", format!("{base}/subscriptions/hook")),
        ("GET", format!("{base}/subscriptions/hook/attempts")),
        (
            "GET",
            format!("{base}/subscriptions/hook/events/evt-1/attempts"),
        ),
        ("POST", format!("{base}/subscriptions/hook/replay")),
        ("POST", format!("{base}/subscriptions/hook/enable")),
    ];
    for (method, url) in &calls {
        for token in [None, Some("wrong")] {
            let mut request = match *method {
                "GET" => client.get(url),
                _ => client.post(url).json(&json!({"type": "order.paid"})),
            };
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            let body: Value = response.json().await.unwrap_or(Value::Null);
            assert_eq!(
                (status, body["error"]["code"].as_str()),
                (401, Some("unauthenticated")),
                "{method} {url} with token {token:?}"
            );
        }
    }
    // Nothing refused was done: still one event, still one dead letter.
    let all = herald.deliveries(NS, "hook", "all").await;
    assert_eq!(all.len(), 1, "{all:?}");
    assert_eq!(all[0]["state"], "dead");
    // With the token, each call is served.
    for (method, url) in &calls {
        let request = match *method {
            "GET" => client.get(url),
            "POST" if url.ends_with("/events") => {
                client.post(url).json(&json!({"type": "order.paid"}))
            }
            _ => client.post(url).json(&json!({})),
        };
        let status = request.bearer_auth("s3cret").send().await.unwrap().status();
        assert!(status.is_success(), "{method} {url}: {status}");
    }
    // Health and readiness need no token (probes carry none).
    for path in ["/healthz", "/readyz"] {
        let response = client
            .get(format!("{}{path}", herald.base))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 200, "{path}");
        assert_eq!(response.text().await.unwrap(), "ok", "{path}");
    }
}
