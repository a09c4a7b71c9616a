//! herald's CRDs on a real kube-apiserver: they install and become Established, `kubectl`
//! lists and explains them, the API server applies the schema's defaults and refuses what
//! the schema forbids, and a WebhookSubscription can be created, read, status-patched and
//! deleted through a finalizer with kube-rs.

mod support;

use std::time::{Duration, Instant};

use herald::api::{WebhookSubscription, WebhookSubscriptionStatus, conditions};
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::ApiResource;
use serde_json::json;
use support::control_plane::ControlPlane;
use support::herald::merge;

const FINALIZER: &str = "herald.dev/purge-attempts";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crds_on_a_real_api_server() {
    let Some(cp) = ControlPlane::start() else {
        return;
    };
    let client = cp.client().await;

    kubectl_lists_and_explains_the_crds(&cp);
    samples_apply_cleanly(&cp);
    crud_status_and_finalizer(&cp, client.clone()).await;
    schema_refuses_invalid_specs(&cp, client).await;
}

fn kubectl_lists_and_explains_the_crds(cp: &ControlPlane) {
    let resources = cp.kubectl_ok(&["api-resources", "--api-group=herald.dev", "-o", "name"]);
    let mut names: Vec<_> = resources.lines().collect();
    names.sort();
    assert_eq!(
        names,
        [
            "webhookquotas.herald.dev",
            "webhooksubscriptions.herald.dev"
        ]
    );

    let explain = cp.kubectl_eventually(
        &["explain", "webhooksubscription.spec.delivery.retry"],
        Duration::from_secs(60),
    );
    for expected in [
        "maxDuration",
        "initialBackoff",
        "full jitter",
        "No retry starts later",
    ] {
        assert!(
            explain.contains(expected),
            "kubectl explain lacks {expected:?}:\n{explain}"
        );
    }
}

fn samples_apply_cleanly(cp: &ControlPlane) {
    cp.kubectl_ok(&["create", "namespace", "samples"]);
    let applied = cp.kubectl_ok(&[
        "apply",
        "-n",
        "samples",
        "-f",
        "config/samples/subscription.yaml",
        "-f",
        "config/samples/quota.yaml",
    ]);
    assert!(
        applied.contains("webhooksubscription.herald.dev/orders created"),
        "{applied}"
    );
    assert!(
        applied.contains("webhookquota.herald.dev/default created"),
        "{applied}"
    );
    let table = cp.kubectl_ok(&["get", "whsub", "-n", "samples"]);
    let header: Vec<_> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        ["NAME", "URL", "READY", "PENDING", "LAST", "STATUS", "AGE"]
    );
}

async fn crud_status_and_finalizer(cp: &ControlPlane, client: kube::Client) {
    cp.kubectl_ok(&["create", "namespace", "crud"]);
    let api: Api<WebhookSubscription> = Api::namespaced(client, "crud");
    let minimal: WebhookSubscription = serde_json::from_value(json!({
        "apiVersion": "herald.dev/v1alpha1",
        "kind": "WebhookSubscription",
        "metadata": {"name": "minimal"},
        "spec": {
            "url": "https://receiver.example/hook",
            "eventTypes": ["*"],
            "signing": {"secretRef": {"name": "s", "key": "k"}}
        }
    }))
    .unwrap();
    api.create(&PostParams::default(), &minimal).await.unwrap();

    // Defaults come from the schema, applied by the API server, not by herald.
    let raw: DynamicObject = Api::namespaced_with(
        api.clone().into_client(),
        "crud",
        &ApiResource::erase::<WebhookSubscription>(&()),
    )
    .get("minimal")
    .await
    .unwrap();
    let spec = &raw.data["spec"];
    assert_eq!(spec["signing"]["scheme"], "standard-webhooks");
    assert_eq!(spec["delivery"]["timeout"], "10s");
    assert_eq!(spec["delivery"]["maxInFlight"], 1);
    assert_eq!(spec["delivery"]["retry"]["maxDuration"], "72h");
    assert_eq!(spec["paused"], false);

    // Finalizer on, status through server-side apply on the status subresource.
    api.patch(
        "minimal",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": [FINALIZER]}})),
    )
    .await
    .unwrap();
    let mut status = WebhookSubscriptionStatus {
        observed_generation: Some(1),
        pending_attempts: Some(3),
        shard: Some(7),
        ..Default::default()
    };
    conditions::set(
        &mut status.conditions,
        conditions::types::READY,
        conditions::Status::True,
        "Delivering",
        "test status",
        Some(1),
        k8s_openapi::jiff::Timestamp::now(),
    );
    api.patch_status(
        "minimal",
        &PatchParams::apply("herald-test").force(),
        &Patch::Apply(json!({
            "apiVersion": "herald.dev/v1alpha1",
            "kind": "WebhookSubscription",
            "status": status,
        })),
    )
    .await
    .unwrap();
    let read = api.get("minimal").await.unwrap();
    assert_eq!(read.status, Some(status));
    assert_eq!(
        read.spec.delivery.retry.max_duration.get(),
        Duration::from_secs(72 * 3600)
    );

    // Delete waits on the finalizer; removing it lets the object go.
    api.delete("minimal", &DeleteParams::default())
        .await
        .unwrap();
    let held = api.get("minimal").await.unwrap();
    assert!(held.metadata.deletion_timestamp.is_some());
    api.patch(
        "minimal",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while api.get_opt("minimal").await.unwrap().is_some() {
        assert!(
            Instant::now() < deadline,
            "object still there after its finalizer was removed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn schema_refuses_invalid_specs(cp: &ControlPlane, client: kube::Client) {
    cp.kubectl_ok(&["create", "namespace", "invalid"]);
    let subscriptions: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        "invalid",
        &ApiResource::erase::<WebhookSubscription>(&()),
    );
    let base = json!({
        "url": "https://receiver.example/hook",
        "eventTypes": ["invoice.*"],
        "signing": {"secretRef": {"name": "s", "key": "k"}}
    });
    let cases: Vec<(&str, serde_json::Value, &str)> = vec![
        (
            "ftp url",
            json!({"url": "ftp://receiver.example/x"}),
            "must be an absolute http",
        ),
        (
            "relative url",
            json!({"url": "/hook"}),
            "must be an absolute http",
        ),
        (
            "user info",
            json!({"url": "https://u:p@receiver.example/"}),
            "user info",
        ),
        (
            "no event types",
            json!({"eventTypes": []}),
            "at least 1 items",
        ),
        (
            "inner glob",
            json!({"eventTypes": ["invoice*"]}),
            "should match",
        ),
        (
            "bad duration",
            json!({"delivery": {"timeout": "5 days"}}),
            "should match",
        ),
        (
            "timeout too long",
            json!({"delivery": {"timeout": "10m"}}),
            "between 100ms and 5m",
        ),
        (
            "lane width 0",
            json!({"delivery": {"maxInFlight": 0}}),
            "greater than or equal to 1",
        ),
        (
            "backoff order",
            json!({"delivery": {"retry": {"initialBackoff": "2h", "maxBackoff": "1h"}}}),
            "initialBackoff must not exceed maxBackoff",
        ),
        (
            "reserved header",
            json!({"headers": {"Content-Type": "text/plain"}}),
            "cannot be set",
        ),
        (
            "hop-by-hop header",
            json!({"headers": {"Connection": "close"}}),
            "cannot be set",
        ),
        (
            "framing header",
            json!({"headers": {"Content-Encoding": "gzip"}}),
            "cannot be set",
        ),
        (
            "reserved signing.header",
            json!({"signing": {"scheme": "stripe", "header": "Content-Type"}}),
            "must not name a header herald sets itself",
        ),
        (
            "signing.header repeated in headers",
            json!({"signing": {"scheme": "stripe", "header": "X-Sig"}, "headers": {"x-sig": "v"}}),
            "signing.header must not also be one of spec.headers",
        ),
        (
            "bad header name",
            json!({"headers": {"bad header": "x"}}),
            "HTTP tokens",
        ),
        (
            "unknown scheme",
            json!({"signing": {"scheme": "md5", "secretRef": {"name": "s", "key": "k"}}}),
            "Unsupported value",
        ),
        (
            "no secret",
            json!({"signing": {"secretRef": null}}),
            "secretRef",
        ),
    ];
    for (i, (what, patch, expected)) in cases.into_iter().enumerate() {
        let mut spec = base.clone();
        merge(&mut spec, &patch);
        let object: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "herald.dev/v1alpha1",
            "kind": "WebhookSubscription",
            "metadata": {"name": format!("invalid-{i}")},
            "spec": spec,
        }))
        .unwrap();
        match subscriptions.create(&PostParams::default(), &object).await {
            Ok(_) => panic!("{what}: the API server accepted {patch}"),
            Err(kube::Error::Api(status)) => assert!(
                status.message.contains(expected),
                "{what}: expected {expected:?} in {:?}",
                status.message
            ),
            Err(other) => panic!("{what}: unexpected error {other}"),
        }
    }

    let quotas: Api<DynamicObject> = Api::namespaced_with(
        client,
        "invalid",
        &ApiResource::erase::<herald::api::WebhookQuota>(&()),
    );
    let below_floor: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "herald.dev/v1alpha1",
        "kind": "WebhookQuota",
        "metadata": {"name": "tiny"},
        "spec": {"maxInFlight": 8},
    }))
    .unwrap();
    let err = quotas
        .create(&PostParams::default(), &below_floor)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("greater than or equal to 16"),
        "{err}"
    );
}
