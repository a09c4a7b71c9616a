//! What one tenant can do to the control loop everyone shares (issue 24, items 1 and 2),
//! against a real kube-apiserver with herald in cluster mode as a process.

mod support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::control_plane::ControlPlane;
use support::herald::{secret, subscription};
use support::operator::Operator;
use support::receiver::{Behaviour, Receiver};

/// A Secret name that, pasted into the path of a Secret GET, makes it a ten-minute watch.
const WATCH_NAME: &str = "?watch=true&timeoutSeconds=600";

fn namespace(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
}

/// A producer ServiceAccount that may publish in `namespace`.
fn producer(namespace: &str) -> Vec<Value> {
    vec![
        json!({"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": "producer", "namespace": namespace}}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": "producer", "namespace": namespace},
               "rules": [{"apiGroups": ["herald.dev"], "resources": ["webhookevents"], "verbs": ["create"]}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "producer", "namespace": namespace},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "producer"},
               "subjects": [{"kind": "ServiceAccount", "name": "producer", "namespace": namespace}]}),
    ]
}

/// (status, reason) of a subscription's Ready condition; empty strings when absent.
fn ready(cp: &ControlPlane, ns: &str, name: &str) -> (String, String) {
    let out = cp.kubectl(&[
        "get",
        "whsub",
        name,
        "-n",
        ns,
        "-o",
        r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}/{.status.conditions[?(@.type=="Ready")].reason}"#,
    ]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (status, reason) = text.split_once('/').unwrap_or(("", ""));
    (status.to_string(), reason.to_string())
}

/// A subscription whose current Secret is named `secret_name`.
fn naming_secret(ns: &str, name: &str, url: &str, secret_name: &str) -> Value {
    subscription(
        ns,
        name,
        url,
        &["*"],
        json!({"signing": {"secretRef": {"name": secret_name, "key": "secret"}}}),
    )
}

/// The installed CRD with the Secret-name patterns taken out: the schema herald shipped
/// before names were checked, under which such objects could be stored.
fn without_name_patterns(cp: &ControlPlane) -> Value {
    let mut crd: Value = serde_json::from_str(&cp.kubectl_ok(&[
        "get",
        "crd",
        "webhooksubscriptions.herald.dev",
        "-o",
        "json",
    ]))
    .unwrap();
    let signing =
        "/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/signing/properties";
    for path in [
        format!("{signing}/secretRef/properties/name"),
        format!("{signing}/additionalSecretRefs/items/properties/name"),
    ] {
        let node = crd
            .pointer_mut(&path)
            .and_then(Value::as_object_mut)
            .unwrap_or_else(|| panic!("no {path} in the CRD"));
        assert!(
            node.remove("pattern").is_some(),
            "{path} has no pattern: the schema does not check Secret names"
        );
    }
    let metadata = crd["metadata"].as_object_mut().unwrap();
    metadata.retain(|k, _| k == "name" || k == "resourceVersion");
    crd.as_object_mut().unwrap().remove("status");
    crd
}

/// Issue 24 item 1. The API server refuses a Secret name that is no Secret name; objects
/// stored before the schema said so (put in here under the older schema) are
/// `Ready=False InvalidSpec` without herald making any request with that name, and 20 of
/// them in one namespace do not hold up another namespace's subscription.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secret_names_cannot_stall_other_tenants_reconciles() {
    let Some(cp) = ControlPlane::start() else {
        return;
    };
    let receiver = Receiver::start().await;
    cp.apply(&[namespace("evil"), namespace("other"), secret("other")]);

    // The schema refuses it.
    let list = json!({"apiVersion": "v1", "kind": "List",
                      "items": [naming_secret("evil", "probe", &receiver.url("/evil"), WATCH_NAME)]});
    let refused = cp.kubectl_stdin_output(&["apply", "-f", "-"], &list.to_string());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && stderr.contains("secretRef.name"),
        "the API server accepted a Secret name that is no name: {stderr}"
    );

    // Stored under the older schema, then the current one is back.
    let older = without_name_patterns(&cp);
    cp.kubectl_stdin(&["replace", "-f", "-"], &older.to_string());
    let evil: Vec<Value> = (0..20)
        .map(|i| naming_secret("evil", &format!("w{i}"), &receiver.url("/evil"), WATCH_NAME))
        .collect();
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let list = json!({"apiVersion": "v1", "kind": "List", "items": evil});
        let out = cp.kubectl_stdin_output(&["apply", "-f", "-"], &list.to_string());
        if out.status.success() {
            break;
        }
        assert!(
            Instant::now() < end,
            "the older schema was not in force after 60s: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    cp.kubectl_ok(&[
        "apply",
        "--server-side",
        "--force-conflicts",
        "-f",
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/crds/webhooksubscriptions.herald.dev.yaml"
        ),
    ]);

    let herald = Operator::start(&cp, &[]).await;
    // herald is ready once every object of its first list was reconciled once: the 20 did
    // not hold it. A subscription created now, in another namespace, is Ready at once.
    let created = Instant::now();
    cp.apply(&[subscription(
        "other",
        "orders",
        &receiver.url("/orders"),
        &["*"],
        json!({}),
    )]);
    let end = created + Duration::from_secs(20);
    loop {
        if ready(&cp, "other", "orders").0 == "True" {
            break;
        }
        assert!(
            Instant::now() < end,
            "other/orders not Ready 20s after its creation, behind 20 objects naming {WATCH_NAME:?}:\n{}",
            herald.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let other_ready_in = created.elapsed();
    let end = Instant::now() + Duration::from_secs(30);
    let invalid = loop {
        let invalid = (0..20)
            .filter(|i| {
                ready(&cp, "evil", &format!("w{i}")) == ("False".into(), "InvalidSpec".into())
            })
            .count();
        if invalid == 20 || Instant::now() > end {
            break invalid;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    println!(
        "other/orders Ready {other_ready_in:?} after its creation; {invalid} of 20 objects naming {WATCH_NAME:?} are Ready=False InvalidSpec"
    );
    assert_eq!(
        invalid,
        20,
        "{}",
        cp.kubectl_ok(&["get", "whsub", "w0", "-n", "evil", "-o", "yaml"])
    );
    let message = cp.kubectl_ok(&[
        "get",
        "whsub",
        "w0",
        "-n",
        "evil",
        "-o",
        r#"jsonpath={.status.conditions[?(@.type=="Ready")].message}"#,
    ]);
    assert!(message.contains("not a valid Secret name"), "{message}");
}

/// Issue 24 item 2 (RFC 0215 §B): a tenant strips the finalizer and deletes the object
/// while herald is paused, with retries pending. No attempt for it starts after deletion
/// + 5 s, while a control subscription is still retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deletion_without_the_finalizer_still_fences() {
    let Some(cp) = ControlPlane::start() else {
        return;
    };
    let receiver = Receiver::start().await;
    let herald = Operator::start(&cp, &[]).await;
    let fast = json!({"disableAfterConsecutiveFailures": 0, "delivery": {"timeout": "2s", "retry": {
        "maxAttempts": 1000, "initialBackoff": "50ms", "maxBackoff": "300ms", "maxDuration": "1h"}}});
    receiver.set("/target", Behaviour::Status(500));
    receiver.set("/control", Behaviour::Status(500));
    let mut objects = vec![namespace("strip"), secret("strip")];
    objects.extend(producer("strip"));
    for name in ["target", "control"] {
        objects.push(subscription(
            "strip",
            name,
            &receiver.url(&format!("/{name}")),
            &["*"],
            fast.clone(),
        ));
    }
    cp.apply(&objects);
    cp.wait_ready("strip", "whsub/target");
    cp.wait_ready("strip", "whsub/control");
    let token = cp.token("strip", "producer");
    for i in 0..5 {
        herald
            .publish(
                "strip",
                &token,
                json!({"id": format!("evt-{i}"), "type": "run.completed"}),
            )
            .await;
    }
    receiver
        .wait_until("retries of both", Duration::from_secs(30), |hits| {
            ["/target", "/control"]
                .iter()
                .all(|p| hits.iter().filter(|h| h.path == *p).count() >= 10)
        })
        .await;

    // Paused, herald sees neither the patch nor the deletion until it resumes.
    herald.signal("STOP");
    cp.kubectl_ok(&[
        "patch",
        "whsub",
        "target",
        "-n",
        "strip",
        "--type=merge",
        "-p",
        r#"{"metadata":{"finalizers":null}}"#,
    ]);
    cp.kubectl_ok(&["delete", "whsub", "target", "-n", "strip", "--timeout=30s"]);
    let deleted_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    herald.signal("CONT");

    let quiet_from = deleted_at + Duration::from_secs(5);
    tokio::time::sleep_until(tokio::time::Instant::from_std(
        quiet_from + Duration::from_secs(5),
    ))
    .await;
    let hits = receiver.hits();
    let count = |path: &str, from: Instant| {
        hits.iter()
            .filter(|h| h.path == path && h.at > from)
            .count()
    };
    let (late_target, late_control) = (count("/target", quiet_from), count("/control", quiet_from));
    println!(
        "finalizer stripped, object deleted while herald was paused: target attempts after deletion {}, after deletion + 5 s {late_target}; control after + 5 s {late_control}",
        count("/target", deleted_at)
    );
    assert!(
        late_control >= 2,
        "the control was not retried ({late_control}): the test proves nothing"
    );
    assert_eq!(
        late_target,
        0,
        "attempts for the deleted subscription:\n{}",
        herald.log()
    );
}
