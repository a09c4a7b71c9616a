//! herald as an operator, end to end: a real kube-apiserver (with etcd and
//! kube-controller-manager), herald in cluster mode as a process, real receivers on
//! 127.0.0.1, and `kubectl` wherever a person would use it.

mod support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use herald::api::{SigningScheme, WebhookSubscription};
use herald::signing::Signer;
use kube::runtime::{WatchStreamExt, watcher};
use reqwest::Method;
use serde_json::{Value, json};
use support::control_plane::ControlPlane;
use support::herald::{merge, quota, secret, subscription};
use support::operator::Operator;
use support::receiver::{Behaviour, Hit, Receiver, SECRET};

/// A ServiceAccount `name` in `namespace` bound to a Role with these rules on herald.dev.
fn account(namespace: &str, name: &str, rules: Value) -> Vec<Value> {
    vec![
        json!({"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": name, "namespace": namespace}}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": name, "namespace": namespace},
               "rules": rules}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": name, "namespace": namespace},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]}),
    ]
}

/// A producer: may create webhookevents (publish) in the namespace, nothing else.
fn publisher(namespace: &str) -> Vec<Value> {
    account(
        namespace,
        "producer",
        json!([{"apiGroups": ["herald.dev"], "resources": ["webhookevents"], "verbs": ["create"]}]),
    )
}

fn namespace(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
}

/// (status, reason) of a condition, as `kubectl get` shows it; empty strings when absent.
fn condition(cp: &ControlPlane, ns: &str, name: &str, type_: &str) -> (String, String) {
    let path = format!(
        "{{.status.conditions[?(@.type==\"{type_}\")].status}}/{{.status.conditions[?(@.type==\"{type_}\")].reason}}"
    );
    let out = cp.kubectl(&[
        "get",
        "whsub",
        name,
        "-n",
        ns,
        "-o",
        &format!("jsonpath={path}"),
    ]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (s, r) = text.split_once('/').unwrap_or(("", ""));
    (s.to_string(), r.to_string())
}

async fn wait_condition(cp: &ControlPlane, ns: &str, name: &str, type_: &str, want: (&str, &str)) {
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let got = condition(cp, ns, name, type_);
        if (got.0.as_str(), got.1.as_str()) == want {
            return;
        }
        assert!(
            Instant::now() < end,
            "{ns}/{name}: {type_} is {got:?}, not {want:?}:\n{}",
            cp.kubectl_ok(&["get", "whsub", name, "-n", ns, "-o", "yaml"])
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The reasons of the Kubernetes Events recorded for an object.
fn event_reasons(cp: &ControlPlane, ns: &str, name: &str) -> Vec<String> {
    cp.kubectl_ok(&[
        "get",
        "events",
        "-n",
        ns,
        "--field-selector",
        &format!("involvedObject.name={name}"),
        "-o",
        "jsonpath={.items[*].reason}",
    ])
    .split_whitespace()
    .map(str::to_string)
    .collect()
}

async fn wait_event(cp: &ControlPlane, ns: &str, name: &str, reason: &str) {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let reasons = event_reasons(cp, ns, name);
        if reasons.iter().any(|r| r == reason) {
            return;
        }
        assert!(
            Instant::now() < end,
            "no {reason} Event for {ns}/{name}; got {reasons:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn verifies_with(hit: &Hit, secret: &str) -> bool {
    let signer = Signer::new(SigningScheme::StandardWebhooks, &[secret], None).unwrap();
    let pairs: Vec<(&str, &str)> = hit
        .headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    signer
        .verify(
            pairs,
            &hit.body,
            herald::signing::unix_now(),
            Duration::from_secs(300),
        )
        .is_ok()
}

fn event_id(hit: &Hit) -> String {
    hit.header("webhook-id").to_string()
}

/// One publish from a producer's load loop; must be accepted.
async fn post_accepted(client: &reqwest::Client, url: &str, token: &str, event: &Value) {
    let response = client
        .post(url)
        .bearer_auth(token)
        .json(event)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 202);
}

fn sub(ns: &str, name: &str, url: &str, types: &[&str], extra: Value) -> Value {
    subscription(ns, name, url, types, extra)
}

/// A status field of a subscription, read with kubectl.
fn status_field(cp: &ControlPlane, ns: &str, name: &str, path: &str) -> String {
    let out = cp.kubectl(&[
        "get",
        "whsub",
        name,
        "-n",
        ns,
        "-o",
        &format!("jsonpath={{{path}}}"),
    ]);
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

async fn wait_status_field(cp: &ControlPlane, ns: &str, name: &str, path: &str, want: &str) {
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let got = status_field(cp, ns, name, path);
        if got == want {
            return;
        }
        assert!(
            Instant::now() < end,
            "{ns}/{name} {path} is {got:?}, not {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_end_to_end() {
    // None only with HERALD_SKIP_CONTROL_PLANE=1, which the test command names as a skip.
    let Some(cp) = ControlPlane::start() else {
        return;
    };
    let receiver = Receiver::start().await;
    let interval = status_interval().to_string();
    let herald = Operator::start(&cp, &["--status-interval-seconds", &interval]).await;

    // A tenant applies a secret and a subscription; a producer is granted publishing.
    let mut tenant = vec![namespace("a"), secret("a")];
    tenant.push(sub(
        "a",
        "orders",
        &receiver.url("/orders"),
        &["order.*"],
        json!({}),
    ));
    tenant.extend(publisher("a"));
    cp.apply(&tenant);
    cp.wait_ready("a", "whsub/orders");
    let finalizers = cp.kubectl_ok(&[
        "get",
        "whsub",
        "orders",
        "-n",
        "a",
        "-o",
        "jsonpath={.metadata.finalizers}",
    ]);
    assert!(finalizers.contains("herald.dev/purge"), "{finalizers}");
    assert_eq!(
        status_field(&cp, "a", "orders", ".status.observedGeneration"),
        cp.kubectl_ok(&[
            "get",
            "whsub",
            "orders",
            "-n",
            "a",
            "-o",
            "jsonpath={.metadata.generation}"
        ])
    );
    wait_event(&cp, "a", "orders", "Ready").await;

    let token = cp.token("a", "producer");
    let answer = herald
        .publish(
            "a",
            &token,
            json!({"id": "evt-1", "type": "order.created", "data": {"n": 1}}),
        )
        .await;
    assert_eq!(answer["matched"], 1);
    let hits = receiver
        .wait_until("the first delivery", Duration::from_secs(30), |h| {
            h.iter().any(|h| h.path == "/orders")
        })
        .await;
    let hit = hits.iter().find(|h| h.path == "/orders").unwrap();
    assert!(hit.verified, "the delivery's signature does not verify");
    assert_eq!(event_id(hit), "evt-1");
    wait_status_field(&cp, "a", "orders", ".status.counters.delivered", "1").await;
    wait_status_field(
        &cp,
        "a",
        "orders",
        ".status.lastAttempt.outcome",
        "Accepted",
    )
    .await;
    let table = cp.kubectl_ok(&["get", "whsub", "-n", "a"]);
    assert!(
        table.contains("True") && table.contains("Accepted"),
        "{table}"
    );

    secrets_missing_then_created(&cp, &herald, &receiver, &token).await;
    rotation(&cp, &herald, &receiver, &token).await;
    tenants_are_isolated(&cp, &herald, &receiver, &token).await;
    quota_bounds_a_namespace(&cp, &herald, &receiver, &token).await;
    auto_disable_and_kubectl_reenable(&cp, &herald, &receiver, &token).await;
    gone_disables_at_once(&cp, &herald, &receiver, &token).await;
    a_receiver_asking_to_slow_down_is_shown(&cp, &herald, &receiver, &token).await;
    status_writes_are_coalesced(&cp, &herald, &receiver).await;
}

async fn secrets_missing_then_created(
    cp: &ControlPlane,
    herald: &Operator,
    receiver: &Receiver,
    token: &str,
) {
    let mut late = sub("a", "late", &receiver.url("/late"), &["late.*"], json!({}));
    merge(
        &mut late,
        &json!({"spec": {"signing": {"secretRef": {"name": "late-secret", "key": "secret"}}}}),
    );
    cp.apply(&[late]);
    wait_condition(cp, "a", "late", "Ready", ("False", "SecretNotFound")).await;
    wait_event(cp, "a", "late", "SecretNotFound").await;
    // Events published meanwhile wait.
    herald
        .publish("a", token, json!({"id": "late-1", "type": "late.x"}))
        .await;

    // The key is missing first, then present: each shows, without restarting herald.
    cp.apply(&[json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "late-secret", "namespace": "a"}, "stringData": {"other": "x"}})]);
    wait_condition(cp, "a", "late", "Ready", ("False", "SecretKeyMissing")).await;
    cp.apply(&[json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "late-secret", "namespace": "a"}, "stringData": {"secret": "not-a-whsec"}})]);
    wait_condition(cp, "a", "late", "Ready", ("False", "InvalidSecret")).await;
    assert!(
        receiver.hits_for("/late").is_empty(),
        "delivered without a usable secret"
    );
    cp.apply(&[json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "late-secret", "namespace": "a"}, "stringData": {"secret": SECRET}})]);
    wait_condition(cp, "a", "late", "Ready", ("True", "Active")).await;
    let hits = receiver
        .wait_until("the waiting event", Duration::from_secs(30), |h| {
            h.iter().any(|h| h.path == "/late")
        })
        .await;
    assert!(
        hits.iter()
            .filter(|h| h.path == "/late")
            .all(|h| h.verified)
    );
    let message = cp.kubectl_ok(&["describe", "whsub", "late", "-n", "a"]);
    assert!(
        message.contains("SecretNotFound") && message.contains("Ready"),
        "{message}"
    );
}

const NEW_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

async fn rotation(cp: &ControlPlane, herald: &Operator, receiver: &Receiver, token: &str) {
    cp.apply(&[
        json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "rot-secret", "namespace": "a"}, "stringData": {"current": SECRET}}),
        sub("a", "rot", &receiver.url("/rot"), &["rot.*"],
            json!({"signing": {"secretRef": {"name": "rot-secret", "key": "current"}}})),
    ]);
    cp.wait_ready("a", "whsub/rot");
    let mut n = 0;
    let mut deliver = || {
        n += 1;
        format!("rot-{n}")
    };
    let id = deliver();
    herald
        .publish("a", token, json!({"id": id, "type": "rot.x"}))
        .await;
    let hit = wait_for_id(receiver, &id).await;
    assert!(verifies_with(&hit, SECRET) && !verifies_with(&hit, NEW_SECRET));

    // The Secret's value changes: the next deliveries sign with the new value only.
    cp.apply(&[json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "rot-secret", "namespace": "a"}, "stringData": {"current": NEW_SECRET}})]);
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let id = deliver();
        herald
            .publish("a", token, json!({"id": id, "type": "rot.x"}))
            .await;
        let hit = wait_for_id(receiver, &id).await;
        if verifies_with(&hit, NEW_SECRET) {
            assert!(!verifies_with(&hit, SECRET));
            break;
        }
        assert!(Instant::now() < end, "the new secret never took effect");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Overlap: the old value kept under another key and named in additionalSecretRefs;
    // each delivery then verifies with either.
    cp.apply(&[json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "rot-secret", "namespace": "a"},
        "stringData": {"current": NEW_SECRET, "previous": SECRET}})]);
    cp.kubectl_ok(&[
        "patch",
        "whsub",
        "rot",
        "-n",
        "a",
        "--type=merge",
        "-p",
        r#"{"spec":{"signing":{"additionalSecretRefs":[{"name":"rot-secret","key":"previous"}]}}}"#,
    ]);
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let id = deliver();
        herald
            .publish("a", token, json!({"id": id, "type": "rot.x"}))
            .await;
        let hit = wait_for_id(receiver, &id).await;
        if verifies_with(&hit, SECRET) && verifies_with(&hit, NEW_SECRET) {
            break;
        }
        assert!(Instant::now() < end, "the overlap never took effect");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_for_id(receiver: &Receiver, id: &str) -> Hit {
    let hits = receiver
        .wait_until(&format!("delivery of {id}"), Duration::from_secs(30), |h| {
            h.iter().any(|h| event_id(h) == id)
        })
        .await;
    hits.into_iter().find(|h| event_id(h) == id).unwrap()
}

async fn tenants_are_isolated(
    cp: &ControlPlane,
    herald: &Operator,
    receiver: &Receiver,
    token_a: &str,
) {
    let mut b = vec![
        namespace("b"),
        secret("b"),
        sub("b", "all", &receiver.url("/b"), &["*"], json!({})),
    ];
    b.extend(publisher("b"));
    b.extend(account("a", "reader", json!([{"apiGroups": ["herald.dev"], "resources": ["webhooksubscriptions"], "verbs": ["get"]}])));
    b.extend(account("a", "operator", json!([{"apiGroups": ["herald.dev"], "resources": ["webhooksubscriptions"], "verbs": ["get", "patch"]}])));
    cp.apply(&b);
    cp.wait_ready("b", "whsub/all");

    let publish = |ns: &str| format!("/v1/namespaces/{ns}/events");
    let event = || Some(json!({"type": "order.created"}));
    let (status, body) = herald
        .call(Method::POST, &publish("b"), Some(token_a), event())
        .await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(body["error"]["code"], "forbidden");
    let (status, body) = herald
        .call(Method::POST, &publish("a"), Some("not-a-token"), event())
        .await;
    assert_eq!(status, 401, "{body}");
    assert_eq!(body["error"]["code"], "unauthenticated");
    let (status, _) = herald
        .call(Method::POST, &publish("a"), None, event())
        .await;
    assert_eq!(status, 401);

    // b's own producer reaches b; a's events never reach b's subscription.
    let token_b = cp.token("b", "producer");
    herald
        .publish(
            "a",
            token_a,
            json!({"id": "for-a-only", "type": "order.created"}),
        )
        .await;
    herald
        .publish(
            "b",
            &token_b,
            json!({"id": "for-b", "type": "order.created"}),
        )
        .await;
    wait_for_id(receiver, "for-b").await;
    wait_for_id(receiver, "for-a-only").await;
    let b_hits = receiver.hits_for("/b");
    assert_eq!(b_hits.iter().map(event_id).collect::<Vec<_>>(), ["for-b"]);

    // Reading needs get, replay and enable need patch.
    let attempts = "/v1/namespaces/a/subscriptions/orders/attempts";
    let replay = "/v1/namespaces/a/subscriptions/orders/replay";
    let (status, _) = herald
        .call(Method::GET, attempts, Some(token_a), None)
        .await;
    assert_eq!(status, 403, "a producer may not read attempts");
    let reader = cp.token("a", "reader");
    let body = herald
        .expect(Method::GET, attempts, Some(&reader), None, 200)
        .await;
    assert!(!body["items"].as_array().unwrap().is_empty());
    let (status, _) = herald.call(Method::POST, replay, Some(&reader), None).await;
    assert_eq!(status, 403, "get alone may not replay");
    let operator = cp.token("a", "operator");
    herald
        .expect(Method::POST, replay, Some(&operator), None, 200)
        .await;
    let (status, _) = herald
        .call(
            Method::GET,
            "/v1/namespaces/b/subscriptions/all/attempts",
            Some(&reader),
            None,
        )
        .await;
    assert_eq!(status, 403, "a's reader may not read b");
}

async fn quota_bounds_a_namespace(
    cp: &ControlPlane,
    herald: &Operator,
    receiver: &Receiver,
    token_a: &str,
) {
    // 24 subscriptions whose receivers never answer, in a namespace whose quota allows 16.
    let mut q = vec![namespace("q"), secret("q"), quota("q", 16)];
    for i in 0..24 {
        receiver.set(&format!("/held-{i}"), Behaviour::Hang);
        q.push(sub(
            "q",
            &format!("held-{i}"),
            &receiver.url(&format!("/held-{i}")),
            &[&format!("held.{i}")],
            json!({"delivery": {"timeout": "5m"}}),
        ));
    }
    q.extend(publisher("q"));
    cp.apply(&q);
    let quota_ready = cp.kubectl_eventually(
        &[
            "wait",
            "--for=condition=Ready",
            "webhookquota/quota",
            "-n",
            "q",
            "--timeout=5s",
        ],
        Duration::from_secs(60),
    );
    assert!(quota_ready.contains("condition met"), "{quota_ready}");
    for i in 0..24 {
        cp.wait_ready("q", &format!("whsub/held-{i}"));
    }
    let token_q = cp.token("q", "producer");
    for i in 0..24 {
        herald
            .publish("q", &token_q, json!({"type": format!("held.{i}")}))
            .await;
    }
    let held = |h: &[Hit]| h.iter().filter(|h| h.path.starts_with("/held-")).count();
    receiver
        .wait_until("16 held attempts", Duration::from_secs(30), |h| {
            held(h) >= 16
        })
        .await;

    // Another namespace is unaffected: its delivery arrives while q is at its quota.
    let started = Instant::now();
    herald
        .publish(
            "a",
            token_a,
            json!({"id": "beside-the-quota", "type": "order.created"}),
        )
        .await;
    wait_for_id(receiver, "beside-the-quota").await;
    println!("delivery beside a full quota: {:?}", started.elapsed());
    assert_eq!(held(&receiver.hits()), 16, "the quota of 16 was exceeded");

    // Removing the quota restores the default (256): the other 8 start.
    cp.kubectl_ok(&["delete", "webhookquota", "quota", "-n", "q"]);
    receiver
        .wait_until("all 24 held attempts", Duration::from_secs(30), |h| {
            held(h) == 24
        })
        .await;
}

async fn auto_disable_and_kubectl_reenable(
    cp: &ControlPlane,
    herald: &Operator,
    receiver: &Receiver,
    token: &str,
) {
    receiver.set("/flaky", Behaviour::Status(500));
    cp.apply(&[sub("a", "flaky", &receiver.url("/flaky"), &["flaky.*"], json!({
        "disableAfterConsecutiveFailures": 3,
        "delivery": {"retry": {"initialBackoff": "10ms", "maxBackoff": "50ms", "maxAttempts": 2}}
    }))]);
    cp.wait_ready("a", "whsub/flaky");
    // Two attempts for the first event (dead after maxAttempts), one for the second: 3.
    herald
        .publish("a", token, json!({"id": "flaky-1", "type": "flaky.x"}))
        .await;
    receiver
        .wait_until("2 failed attempts", Duration::from_secs(30), |h| {
            h.iter().filter(|h| h.path == "/flaky").count() == 2
        })
        .await;
    herald
        .publish("a", token, json!({"id": "flaky-2", "type": "flaky.x"}))
        .await;
    herald
        .publish("a", token, json!({"id": "flaky-3", "type": "flaky.x"}))
        .await;
    wait_condition(cp, "a", "flaky", "Ready", ("False", "AutoDisabled")).await;
    wait_condition(cp, "a", "flaky", "Disabled", ("True", "AutoDisabled")).await;
    wait_event(cp, "a", "flaky", "AutoDisabled").await;
    let describe = cp.kubectl_ok(&["describe", "whsub", "flaky", "-n", "a"]);
    assert!(
        describe.contains("3 consecutive failed attempts"),
        "{describe}"
    );
    assert_eq!(
        receiver.hits_for("/flaky").len(),
        3,
        "attempts after the auto-disable"
    );

    let switched = Instant::now();
    receiver.set("/flaky", Behaviour::Status(204));
    cp.kubectl_ok(&[
        "annotate",
        "whsub",
        "flaky",
        "-n",
        "a",
        "herald.dev/reenable=first",
    ]);
    wait_condition(cp, "a", "flaky", "Ready", ("True", "Active")).await;
    wait_event(cp, "a", "flaky", "Reenabled").await;
    assert_eq!(
        status_field(cp, "a", "flaky", ".status.reenableHandled"),
        "first"
    );
    // The waiting event is delivered; the dead letters come back with a replay.
    wait_for_id(receiver, "flaky-3").await;
    let operator = cp.token("a", "operator");
    let (status, body) = herald
        .call(
            Method::POST,
            "/v1/namespaces/a/subscriptions/flaky/replay",
            Some(&operator),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert!(body["replayed"].as_u64().unwrap() >= 1, "{body}");
    for id in ["flaky-1", "flaky-2", "flaky-3"] {
        let hits = receiver
            .wait_until(&format!("{id} accepted"), Duration::from_secs(30), |h| {
                h.iter()
                    .any(|h| h.path == "/flaky" && h.at > switched && event_id(h) == id)
            })
            .await;
        assert!(hits.iter().any(|h| event_id(h) == id));
    }
    wait_status_field(cp, "a", "flaky", ".status.deadAttempts", "0").await;
}

/// A receiver answering 410 Gone disables its subscription after one attempt (the default
/// threshold is 100), with reason Gone and an Event; the re-enable annotation brings it back
/// and the event kept meanwhile is delivered.
async fn gone_disables_at_once(
    cp: &ControlPlane,
    herald: &Operator,
    receiver: &Receiver,
    token: &str,
) {
    receiver.set("/gone", Behaviour::Status(410));
    cp.apply(&[sub(
        "a",
        "gone",
        &receiver.url("/gone"),
        &["gone.*"],
        json!({}),
    )]);
    cp.wait_ready("a", "whsub/gone");
    herald
        .publish("a", token, json!({"id": "gone-1", "type": "gone.x"}))
        .await;
    wait_condition(cp, "a", "gone", "Ready", ("False", "Gone")).await;
    wait_condition(cp, "a", "gone", "Disabled", ("True", "Gone")).await;
    wait_event(cp, "a", "gone", "Gone").await;
    let describe = cp.kubectl_ok(&["describe", "whsub", "gone", "-n", "a"]);
    assert!(describe.contains("410 Gone"), "{describe}");
    herald
        .publish("a", token, json!({"id": "gone-2", "type": "gone.x"}))
        .await;
    wait_status_field(cp, "a", "gone", ".status.pendingAttempts", "1").await;
    assert_eq!(receiver.hits_for("/gone").len(), 1, "attempts after a 410");

    receiver.set("/gone", Behaviour::Status(204));
    cp.kubectl_ok(&[
        "annotate",
        "whsub",
        "gone",
        "-n",
        "a",
        "herald.dev/reenable=back",
    ]);
    wait_condition(cp, "a", "gone", "Ready", ("True", "Active")).await;
    wait_for_id(receiver, "gone-2").await;
    wait_status_field(cp, "a", "gone", ".status.deadAttempts", "1").await;
    assert_eq!(
        receiver
            .hits_for("/gone")
            .iter()
            .filter(|h| event_id(h) == "gone-1")
            .count(),
        1,
        "the event answered 410 was tried again"
    );
}

/// A 429 slows the subscription down, and its status says so (Degraded, reason
/// Throttled, with the pace); the event is delivered on its retry.
async fn a_receiver_asking_to_slow_down_is_shown(
    cp: &ControlPlane,
    herald: &Operator,
    receiver: &Receiver,
    token: &str,
) {
    receiver.set("/slow", Behaviour::Script(vec![429, 204]));
    cp.apply(&[sub(
        "a",
        "slow",
        &receiver.url("/slow"),
        &["slow.*"],
        json!({
            "delivery": {"retry": {"initialBackoff": "100ms", "maxBackoff": "200ms"}}
        }),
    )]);
    cp.wait_ready("a", "whsub/slow");
    herald
        .publish("a", token, json!({"id": "slow-1", "type": "slow.x"}))
        .await;
    wait_condition(cp, "a", "slow", "Degraded", ("True", "Throttled")).await;
    let describe = cp.kubectl_ok(&["describe", "whsub", "slow", "-n", "a"]);
    assert!(describe.contains("asked to slow down"), "{describe}");
    assert_eq!(
        condition(cp, "a", "slow", "Ready"),
        ("True".into(), "Active".into())
    );
    receiver
        .wait_until("slow-1 delivered", Duration::from_secs(30), |h| {
            h.iter().filter(|h| h.path == "/slow").count() == 2
        })
        .await;
}

/// The status interval of the end-to-end test's herald (2 s unless
/// HERALD_TEST_STATUS_INTERVAL says otherwise, to measure at the default of 5 s).
fn status_interval() -> u64 {
    std::env::var("HERALD_TEST_STATUS_INTERVAL")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2)
}

/// Status writes counted from the API server's side (a watch on the objects) while every
/// subscription receives a steady stream of events: at most one per subscription per
/// status interval, plus the reconcile's.
async fn status_writes_are_coalesced(cp: &ControlPlane, herald: &Operator, receiver: &Receiver) {
    let subs: usize = std::env::var("HERALD_TEST_LOAD_SUBSCRIPTIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let rate: usize = std::env::var("HERALD_TEST_LOAD_EVENTS_PER_SECOND")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let seconds = 10u64;
    let interval = status_interval() as f64;
    let mut load = vec![namespace("load"), secret("load")];
    for i in 0..subs {
        load.push(sub(
            "load",
            &format!("l-{i}"),
            &receiver.url(&format!("/load-{i}")),
            &[&format!("load.{i}")],
            json!({"delivery": {"maxInFlight": 8}}),
        ));
    }
    load.extend(publisher("load"));
    cp.apply(&load);
    for i in 0..subs {
        cp.wait_ready("load", &format!("whsub/l-{i}"));
    }
    let token = cp.token("load", "producer");
    // Matches nothing; makes sure the grant has reached the authorizer.
    herald
        .publish("load", &token, json!({"type": "warm.up"}))
        .await;

    let api: kube::Api<WebhookSubscription> = kube::Api::namespaced(cp.client().await, "load");
    let writes: std::sync::Arc<std::sync::Mutex<HashMap<String, usize>>> = Default::default();
    let counting = writes.clone();
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let watch = tokio::spawn(async move {
        let mut started = Some(started_tx);
        let mut stream = watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        let mut live = false;
        while let Some(event) = stream.next().await {
            match event {
                Ok(watcher::Event::InitDone) => {
                    live = true;
                    if let Some(tx) = started.take() {
                        let _ = tx.send(());
                    }
                }
                Ok(watcher::Event::Apply(obj)) if live => {
                    *counting
                        .lock()
                        .unwrap()
                        .entry(obj.metadata.name.unwrap_or_default())
                        .or_default() += 1;
                }
                _ => {}
            }
        }
    });
    started_rx.await.unwrap();
    let reconciled_before = herald.metric("herald_reconcile_total", "").await;

    let began = Instant::now();
    let producers = 8;
    let per_producer = rate * seconds as usize / producers;
    let mut tasks = Vec::new();
    for p in 0..producers {
        let client = reqwest::Client::new();
        let url = format!("{}/v1/namespaces/load/events", herald.base);
        let token = token.clone();
        tasks.push(tokio::spawn(async move {
            let start = Instant::now();
            for n in 0..per_producer {
                let due =
                    start + Duration::from_secs_f64(n as f64 * producers as f64 / rate as f64);
                tokio::time::sleep_until(tokio::time::Instant::from_std(due)).await;
                let event = json!({"type": format!("load.{}", (p + n * producers) % subs)});
                post_accepted(&client, &url, &token, &event).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let total = rate * seconds as usize / producers * producers;
    receiver
        .wait_until("every load event", Duration::from_secs(60), |h| {
            h.iter().filter(|h| h.path.starts_with("/load-")).count() >= total
        })
        .await;
    let window = began.elapsed();
    // Let the last coalesced writes land, then count.
    tokio::time::sleep(Duration::from_secs_f64(interval + 1.5)).await;
    watch.abort();
    let writes = writes.lock().unwrap().clone();
    let all: usize = writes.values().sum();
    let bound = (window.as_secs_f64() + interval + 1.5) / interval + 2.0;
    println!(
        "status writes: {all} for {subs} subscriptions over {:.1}s with {} deliveries ({:.1} writes/s, {:.2} per subscription per second; bound {bound:.1} per subscription)",
        window.as_secs_f64(),
        total,
        all as f64 / window.as_secs_f64(),
        all as f64 / subs as f64 / window.as_secs_f64()
    );
    assert!(
        all >= subs,
        "no status write seen: the count proves nothing ({writes:?})"
    );
    for (name, count) in &writes {
        assert!(
            (*count as f64) <= bound,
            "{name}: {count} status writes (bound {bound:.1})"
        );
    }
    // herald's own status writes come back as watch events; none may start a reconcile (a
    // straggler from the set-up above is tolerated).
    let reconciled = herald.metric("herald_reconcile_total", "").await - reconciled_before;
    assert!(
        reconciled <= 2.0,
        "{reconciled} reconciles during the load, with no spec or Secret changed ({all} status writes)"
    );
    // And the status caught up with what was delivered.
    for i in 0..subs {
        let arrived = receiver.hits_for(&format!("/load-{i}")).len();
        wait_status_field(
            cp,
            "load",
            &format!("l-{i}"),
            ".status.counters.delivered",
            &arrived.to_string(),
        )
        .await;
    }
}

/// RFC 0215 §B through the cluster path, three ways: `kubectl delete` of the target; the
/// same with herald SIGKILLed right after the delete is issued and started again; and the
/// deletion of the target's whole namespace. Each time the control (in another namespace,
/// answered 500 like the target) is still retried while the target never is again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregister_through_the_cluster() {
    // None only with HERALD_SKIP_CONTROL_PLANE=1, which the test command names as a skip.
    let Some(cp) = ControlPlane::start() else {
        return;
    };
    let receiver = Receiver::start().await;
    let mut herald = Operator::start(&cp, &[]).await;
    let fast = json!({"disableAfterConsecutiveFailures": 0, "delivery": {"timeout": "2s", "retry": {
        "maxAttempts": 1000, "initialBackoff": "50ms", "maxBackoff": "400ms", "maxDuration": "1h"}}});
    let mut setup = vec![namespace("control"), secret("control")];
    setup.extend(publisher("control"));
    receiver.set("/control", Behaviour::Status(500));
    setup.push(sub(
        "control",
        "control",
        &receiver.url("/control"),
        &["run.completed"],
        fast.clone(),
    ));
    cp.apply(&setup);
    cp.wait_ready("control", "whsub/control");
    let ready_since = |cp: &ControlPlane| {
        cp.kubectl_ok(&[
            "get",
            "whsub",
            "control",
            "-n",
            "control",
            "-o",
            r#"jsonpath={.status.conditions[?(@.type=="Ready")].lastTransitionTime}"#,
        ])
    };
    let control_ready_since = ready_since(&cp);
    assert!(!control_ready_since.is_empty(), "no Ready condition time");
    let control_token = cp.token("control", "producer");
    herald
        .publish("control", &control_token, json!({"type": "run.completed"}))
        .await;

    for (round, how) in ["delete", "sigkill", "while-down", "namespace"]
        .iter()
        .enumerate()
    {
        let ns = format!("target-{round}");
        let path = format!("/target-{round}");
        receiver.set(&path, Behaviour::Status(500));
        let mut objects = vec![namespace(&ns), secret(&ns)];
        objects.extend(publisher(&ns));
        objects.push(sub(
            &ns,
            "target",
            &receiver.url(&path),
            &["run.completed"],
            fast.clone(),
        ));
        cp.apply(&objects);
        cp.wait_ready(&ns, "whsub/target");
        let token = cp.token(&ns, "producer");
        for i in 0..5 {
            herald
                .publish(
                    &ns,
                    &token,
                    json!({"id": format!("evt-{i}"), "type": "run.completed"}),
                )
                .await;
        }
        receiver
            .wait_until(
                "the target's answered attempts",
                Duration::from_secs(30),
                |h| h.iter().filter(|h| h.path == path).count() >= 10,
            )
            .await;

        let removed_at = match *how {
            "delete" => {
                let started = Instant::now();
                cp.kubectl_ok(&["delete", "whsub", "target", "-n", &ns, "--timeout=60s"]);
                println!(
                    "{how}: kubectl delete returned after {:?}",
                    started.elapsed()
                );
                Instant::now()
            }
            "sigkill" => {
                // Stopped first, so herald cannot see the delete before it dies.
                herald.signal("STOP");
                cp.kubectl_ok(&["delete", "whsub", "target", "-n", &ns, "--wait=false"]);
                herald.kill();
                let restarted = Instant::now();
                herald.restart().await;
                cp.kubectl_ok(&[
                    "wait",
                    "--for=delete",
                    "whsub/target",
                    "-n",
                    &ns,
                    "--timeout=60s",
                ]);
                restarted
            }
            "while-down" => {
                // Deleted for good while herald is down (its finalizer removed by hand).
                herald.kill();
                cp.kubectl_ok(&["delete", "whsub", "target", "-n", &ns, "--wait=false"]);
                cp.kubectl_ok(&[
                    "patch",
                    "whsub",
                    "target",
                    "-n",
                    &ns,
                    "--type=merge",
                    "-p",
                    r#"{"metadata":{"finalizers":null}}"#,
                ]);
                cp.kubectl_ok(&[
                    "wait",
                    "--for=delete",
                    "whsub/target",
                    "-n",
                    &ns,
                    "--timeout=60s",
                ]);
                let restarted = Instant::now();
                herald.restart().await;
                restarted
            }
            _ => {
                cp.kubectl_ok(&["delete", "namespace", &ns, "--timeout=120s"]);
                Instant::now()
            }
        };
        let gone = cp.kubectl(&["get", "whsub", "target", "-n", &ns]);
        assert!(!gone.status.success(), "{how}: the object is still there");
        wait_event_or_gone(&cp, &ns, how);

        let quiet_from = removed_at + Duration::from_secs(5);
        let watch_until = quiet_from + Duration::from_secs(4);
        tokio::time::sleep_until(tokio::time::Instant::from_std(watch_until)).await;
        let hits = receiver.hits();
        let late_target = hits
            .iter()
            .filter(|h| h.path == path && h.at > quiet_from)
            .count();
        let late_control = hits
            .iter()
            .filter(|h| h.path == "/control" && h.at > quiet_from)
            .count();
        let after_removal = hits
            .iter()
            .filter(|h| h.path == path && h.at > removed_at)
            .count();
        println!(
            "{how}: target attempts after the removal: {after_removal}, after +5 s: {late_target}; control after +5 s: {late_control}"
        );
        assert!(
            late_control >= 2,
            "{how}: the control was not retried ({late_control}): the test proves nothing"
        );
        assert_eq!(late_target, 0, "{how}: attempts for the deleted target");
        if matches!(*how, "sigkill" | "while-down") {
            // Not one attempt after the restart, although the object (sigkill) still
            // existed then: it is purged at start and never registered with the engine.
            assert_eq!(after_removal, 0, "{how}: attempts after the restart");
        }
        if *how == "while-down" {
            // The start-up purge also removed the 5 pending attempts from the store: they no
            // longer count against the namespace's pending quota.
            cp.apply(&[
                json!({"apiVersion": "herald.dev/v1alpha1", "kind": "WebhookQuota",
                       "metadata": {"name": "pending", "namespace": ns},
                       "spec": {"maxInFlight": 16, "maxPendingAttempts": 5}}),
                sub(
                    &ns,
                    "after",
                    &receiver.url(&format!("/after-{round}")),
                    &["after"],
                    json!({}),
                ),
            ]);
            cp.kubectl_ok(&[
                "wait",
                "--for=condition=Ready",
                "whsub/after",
                "webhookquota/pending",
                "-n",
                &ns,
                "--timeout=60s",
            ]);
            for i in 0..5 {
                herald
                    .publish(
                        &ns,
                        &token,
                        json!({"id": format!("after-{i}"), "type": "after"}),
                    )
                    .await;
            }
        }
    }
    // Two restarts later the control's status was rewritten (counters, last attempt), but it
    // stayed ready throughout: its condition keeps the time it became so.
    assert_eq!(
        ready_since(&cp),
        control_ready_since,
        "the control's Ready condition moved its lastTransitionTime across restarts"
    );
}

/// The purge Event can only be read while the namespace exists.
fn wait_event_or_gone(cp: &ControlPlane, ns: &str, how: &str) {
    if how == "delete" {
        let reasons = event_reasons(cp, ns, "target");
        assert!(
            reasons.iter().any(|r| r == "Purged"),
            "no Purged Event: {reasons:?}"
        );
    }
}

/// The API server stops (SIGSTOP) for 10 s while deliveries run: they go on, nothing is
/// lost, and the status catches up once it is back. Then SIGTERM stops herald cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_server_outage() {
    // None only with HERALD_SKIP_CONTROL_PLANE=1, which the test command names as a skip.
    let Some(cp) = ControlPlane::start() else {
        return;
    };
    let receiver = Receiver::start().await;
    let mut herald = Operator::start(&cp, &["--status-interval-seconds", "1"]).await;
    let mut objects = vec![namespace("o"), secret("o")];
    objects.extend(publisher("o"));
    // Two transient failures for every event: retries fall due during the outage.
    receiver.set(
        "/o",
        Behaviour::Script(vec![503; 40].into_iter().chain([204]).collect()),
    );
    objects.push(sub(
        "o",
        "steady",
        &receiver.url("/o"),
        &["*"],
        json!({
        "delivery": {"maxInFlight": 4, "retry": {"initialBackoff": "1s", "maxBackoff": "2s"}}}),
    ));
    cp.apply(&objects);
    cp.wait_ready("o", "whsub/steady");
    let token = cp.token("o", "producer");
    let fresh_token = cp.token("o", "producer");
    for i in 0..20 {
        herald
            .publish("o", &token, json!({"id": format!("o-{i}"), "type": "t"}))
            .await;
    }

    let apiserver = cp.pid("kube-apiserver");
    let signal = |sig: &str| support::signal(apiserver, sig);
    signal("STOP");
    let stopped = Instant::now();
    let during = std::panic::AssertUnwindSafe(async {
        // A token herald has not seen cannot be reviewed: 503, never a 202 that is lost.
        let refused = async {
            let (status, body) = herald
                .call(
                    Method::POST,
                    "/v1/namespaces/o/events",
                    Some(&fresh_token),
                    Some(json!({"type": "t"})),
                )
                .await;
            assert_eq!(status, 503, "{body}");
            assert_eq!(body["error"]["code"], "auth_unavailable");
        };
        // The first 40 attempts fail, every later one succeeds: 60 attempts deliver all 20.
        let delivered = receiver.wait_until(
            "every event delivered during the outage",
            Duration::from_secs(9),
            |h| {
                let o: Vec<&Hit> = h.iter().filter(|h| h.path == "/o").collect();
                let ok: std::collections::HashSet<String> =
                    o.iter().skip(40).map(|h| event_id(h)).collect();
                ok.len() == 20
            },
        );
        tokio::join!(refused, delivered);
    });
    let outcome = futures::FutureExt::catch_unwind(during).await;
    let remaining = Duration::from_secs(10).saturating_sub(stopped.elapsed());
    tokio::time::sleep(remaining).await;
    signal("CONT");
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
    let delivered_during = receiver
        .hits_for("/o")
        .iter()
        .filter(|h| h.at < stopped + Duration::from_secs(10))
        .count();
    println!("attempts during the 10 s outage: {delivered_during}");

    // Status catches up: all 20 delivered, nothing pending.
    wait_status_field(&cp, "o", "steady", ".status.counters.delivered", "20").await;
    wait_status_field(&cp, "o", "steady", ".status.pendingAttempts", "0").await;
    let mut ids: Vec<String> = receiver.hits_for("/o").iter().map(event_id).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 20);
    // Publishing works again.
    herald
        .publish("o", &fresh_token, json!({"id": "after", "type": "t"}))
        .await;
    wait_for_id(&receiver, "after").await;

    assert_eq!(
        herald.terminate(Duration::from_secs(30)),
        Some(0),
        "SIGTERM did not stop herald cleanly"
    );
}

/// Deleting a subscription with 100,000 pending attempts: `kubectl delete` returns once
/// the finalizer purged them all; the bound is printed and checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_subscription_with_100000_pending_attempts() {
    // None only with HERALD_SKIP_CONTROL_PLANE=1, which the test command names as a skip.
    let Some(cp) = ControlPlane::start() else {
        return;
    };
    let pending: usize = std::env::var("HERALD_TEST_PURGE_PENDING")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let receiver = Receiver::start().await;
    let herald = Operator::start(&cp, &[]).await;
    let mut objects = vec![
        namespace("p"),
        secret("p"),
        sub(
            "p",
            "bulk",
            &receiver.url("/bulk"),
            &["bulk"],
            json!({"paused": true}),
        ),
    ];
    objects.extend(publisher("p"));
    objects.extend(account("p", "reader", json!([{"apiGroups": ["herald.dev"], "resources": ["webhooksubscriptions"], "verbs": ["get"]}])));
    cp.apply(&objects);
    wait_condition(&cp, "p", "bulk", "Ready", ("False", "Paused")).await;
    let token = cp.token("p", "producer");
    let reader = cp.token("p", "reader");
    // Matches nothing; makes sure the grant has reached the authorizer.
    herald
        .publish("p", &token, json!({"type": "warm.up"}))
        .await;

    let producers = 32;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for p in 0..producers {
        let client = reqwest::Client::new();
        let url = format!("{}/v1/namespaces/p/events", herald.base);
        let token = token.clone();
        tasks.push(tokio::spawn(async move {
            for n in (p..pending).step_by(producers) {
                let event = json!({"id": format!("bulk-{n}"), "type": "bulk"});
                post_accepted(&client, &url, &token, &event).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    println!("published {pending} events in {:?}", started.elapsed());
    let state = herald
        .expect(
            Method::GET,
            "/v1/namespaces/p/subscriptions/bulk",
            Some(&reader),
            None,
            200,
        )
        .await;
    assert_eq!(state["pending"], pending as u64);
    wait_status_field(
        &cp,
        "p",
        "bulk",
        ".status.pendingAttempts",
        &pending.to_string(),
    )
    .await;

    let started = Instant::now();
    cp.kubectl_ok(&["delete", "whsub", "bulk", "-n", "p", "--timeout=120s"]);
    let took = started.elapsed();
    println!(
        "deleting a subscription with {pending} pending attempts: kubectl delete returned after {took:?}"
    );
    assert!(
        !cp.kubectl(&["get", "whsub", "bulk", "-n", "p"])
            .status
            .success()
    );
    let (status, _) = herald
        .call(
            Method::GET,
            "/v1/namespaces/p/subscriptions/bulk",
            Some(&reader),
            None,
        )
        .await;
    assert_eq!(status, 404, "herald still knows the deleted subscription");
    assert!(
        took < Duration::from_secs(30),
        "the purge took {took:?}, over the 30 s bound"
    );
    assert!(
        receiver.hits().is_empty(),
        "a paused subscription was delivered to"
    );
}
