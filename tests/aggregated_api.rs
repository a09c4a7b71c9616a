//! The aggregated API (`delivery.herald.dev/v1alpha1`) behind a real kube-apiserver: herald
//! in cluster mode as a process serving it on this host's address, an APIService whose
//! Service points there (the API server routes to endpoints), users with client
//! certificates of the cluster's CA, and `kubectl` as people run it. The API server
//! authenticates, authorizes with RBAC and audits; herald trusts only its front proxy.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use base64::Engine as _;
use futures::StreamExt;
use kube::api::{Api, DynamicObject, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};
use support::control_plane::ControlPlane;
use support::herald::{secret, subscription};
use support::operator::Operator;
use support::receiver::{Receiver, SECRET};
use support::tls::{Ca, Files};

const SERVICE_NAMESPACE: &str = "herald-system";
const SERVICE: &str = "herald-api";
const APISERVICE: &str = "v1alpha1.delivery.herald.dev";

/// This host's first global IPv4 address: the API server refuses loopback endpoints.
fn host_address() -> String {
    let out = Command::new("ip")
        .args(["-4", "-o", "addr", "show", "scope", "global"])
        .output()
        .expect("running ip");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .skip_while(|word| *word != "inet")
        .nth(1)
        .and_then(|cidr| cidr.split('/').next())
        .map(str::to_string)
        .unwrap_or_else(|| panic!("no global IPv4 address on this host (ip says {text:?}): the API server needs a non-loopback endpoint for the aggregated API"))
}

/// A client certificate of the cluster's CA for `user` in `groups`: (certificate, key).
fn user_certificate(
    cp: &ControlPlane,
    dir: &Path,
    user: &str,
    groups: &[&str],
) -> (PathBuf, PathBuf) {
    let pki = cp.dir().join("pki");
    let (key, csr, crt) = (
        dir.join(format!("{user}.key")),
        dir.join(format!("{user}.csr")),
        dir.join(format!("{user}.crt")),
    );
    let subject: String =
        groups.iter().map(|g| format!("/O={g}")).collect::<String>() + &format!("/CN={user}");
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .output()
            .expect("running openssl");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    openssl(&[
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-out",
        key.to_str().unwrap(),
    ]);
    openssl(&[
        "req",
        "-new",
        "-key",
        key.to_str().unwrap(),
        "-subj",
        &subject,
        "-out",
        csr.to_str().unwrap(),
    ]);
    openssl(&[
        "x509",
        "-req",
        "-in",
        csr.to_str().unwrap(),
        "-CA",
        pki.join("ca.crt").to_str().unwrap(),
        "-CAkey",
        pki.join("ca.key").to_str().unwrap(),
        "-CAcreateserial",
        "-days",
        "1",
        "-out",
        crt.to_str().unwrap(),
    ]);
    (crt, key)
}

/// kubectl as a user: the control plane's kubeconfig with the user's certificate.
fn kubectl_as(cp: &ControlPlane, user: &(PathBuf, PathBuf), args: &[&str], input: &str) -> Output {
    let cert = format!("--client-certificate={}", user.0.display());
    let key = format!("--client-key={}", user.1.display());
    let mut all = vec![cert.as_str(), key.as_str()];
    all.extend_from_slice(args);
    cp.kubectl_stdin_output(&all, input)
}

fn event_yaml(name: &str, order: u32) -> String {
    format!(
        "apiVersion: delivery.herald.dev/v1alpha1\nkind: WebhookEvent\nmetadata:\n  name: {name}\n  namespace: shop\nspec:\n  type: order.created\n  data:\n    order: {order}\n"
    )
}

/// The aggregated API's objects: a Service without selector whose endpoints are herald's
/// address, and the APIService trusting herald's serving CA.
fn api_service(address: &str, port: u16, ca_pem: &str) -> Vec<Value> {
    vec![
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": SERVICE_NAMESPACE}}),
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": SERVICE, "namespace": SERVICE_NAMESPACE},
               "spec": {"ports": [{"port": 443, "targetPort": port, "protocol": "TCP"}]}}),
        json!({"apiVersion": "v1", "kind": "Endpoints",
               "metadata": {"name": SERVICE, "namespace": SERVICE_NAMESPACE},
               "subsets": [{"addresses": [{"ip": address}], "ports": [{"port": port, "protocol": "TCP"}]}]}),
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"name": SERVICE, "namespace": SERVICE_NAMESPACE,
                            "labels": {"kubernetes.io/service-name": SERVICE}},
               "addressType": "IPv4",
               "endpoints": [{"addresses": [address], "conditions": {"ready": true}}],
               "ports": [{"port": port, "protocol": "TCP"}]}),
        json!({"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
               "metadata": {"name": APISERVICE},
               "spec": {"group": "delivery.herald.dev", "version": "v1alpha1",
                        "service": {"namespace": SERVICE_NAMESPACE, "name": SERVICE, "port": 443},
                        "caBundle": base64::engine::general_purpose::STANDARD.encode(ca_pem),
                        "groupPriorityMinimum": 1000, "versionPriority": 15}}),
    ]
}

fn publisher_role() -> Vec<Value> {
    vec![
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": "publisher", "namespace": "shop"},
               "rules": [{"apiGroups": ["delivery.herald.dev"], "resources": ["webhookevents", "webhookeventbatches"], "verbs": ["create"]},
                         {"apiGroups": ["herald.dev"], "resources": ["webhookevents"], "verbs": ["create"]}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "publisher", "namespace": "shop"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "publisher"},
               "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "alice"},
                            {"kind": "ServiceAccount", "name": "producer", "namespace": "shop"}]}),
        json!({"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": "producer", "namespace": "shop"}}),
    ]
}

/// The audit log's entries for webhookevents.
fn audit_entries(cp: &ControlPlane) -> Vec<Value> {
    std::fs::read_to_string(cp.dir().join("logs/audit.log"))
        .unwrap_or_default()
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|entry| entry["objectRef"]["resource"] == "webhookevents")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_with_kubectl_through_the_api_server() {
    let Some(cp) = ControlPlane::start() else {
        return;
    };
    let files = Files::new();
    let ca = Ca::new("herald aggregated API test CA");
    let serving = ca.leaf(&[&format!("{SERVICE}.{SERVICE_NAMESPACE}.svc")], 1);
    let cert = files.write("serving.crt", &serving.cert_pem);
    let key = files.write("serving.key", &serving.key_pem);
    let address = host_address();
    let mut operator = Operator::start(
        &cp,
        &[
            "--aggregated-listen",
            &format!("{address}:0"),
            "--aggregated-tls-cert-file",
            cert.to_str().unwrap(),
            "--aggregated-tls-key-file",
            key.to_str().unwrap(),
        ],
    )
    .await;
    let aggregated = operator
        .aggregated
        .clone()
        .expect("the ready file names the aggregated API");
    let port: u16 = aggregated.rsplit(':').next().unwrap().parse().unwrap();
    cp.apply(&api_service(&address, port, &ca.pem));
    let available = cp.kubectl(&[
        "wait",
        "--for=condition=Available",
        &format!("apiservice/{APISERVICE}"),
        "--timeout=90s",
    ]);
    assert!(
        available.status.success(),
        "the APIService did not become Available: {}\n{}\nherald:\n{}",
        String::from_utf8_lossy(&available.stderr),
        cp.kubectl_ok(&["get", "apiservice", APISERVICE, "-o", "yaml"]),
        operator.log()
    );
    let resources = cp.kubectl_eventually(
        &[
            "api-resources",
            "--api-group=delivery.herald.dev",
            "-o",
            "name",
        ],
        Duration::from_secs(60),
    );
    assert_eq!(
        resources.trim(),
        "deliveries.delivery.herald.dev\nenablements.delivery.herald.dev\nreplays.delivery.herald.dev\nwebhookeventbatches.delivery.herald.dev\nwebhookevents.delivery.herald.dev"
    );
    let explained = cp.kubectl_eventually(
        &[
            "explain",
            "webhookevents.spec",
            "--api-version=delivery.herald.dev/v1alpha1",
        ],
        Duration::from_secs(90),
    );
    assert!(
        explained.contains("subscriptions choose events by"),
        "kubectl explain: {explained}"
    );

    let receiver = Receiver::start().await;
    cp.apply(&[json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}})]);
    let mut manifests = vec![
        secret("shop"),
        subscription(
            "shop",
            "orders",
            &receiver.url("/orders"),
            &["order.created"],
            json!({}),
        ),
    ];
    manifests.extend(publisher_role());
    cp.apply(&manifests);
    cp.wait_ready("shop", "whsub/orders");

    let dir = support::Scratch::new("herald-users");
    let alice = user_certificate(&cp, &dir, "alice", &["shop-developers"]);
    let bob = user_certificate(&cp, &dir, "bob", &[]);

    // alice may create webhookevents: kubectl create publishes, and the receiver gets it signed.
    let created = kubectl_as(
        &cp,
        &alice,
        &["create", "-f", "-", "-o", "json"],
        &event_yaml("evt-1", 1),
    );
    assert!(
        created.status.success(),
        "alice's create failed: {}\nherald:\n{}",
        String::from_utf8_lossy(&created.stderr),
        operator.log()
    );
    let object: Value = serde_json::from_slice(&created.stdout).unwrap();
    assert_eq!(object["metadata"]["name"], "evt-1");
    assert_eq!(object["status"]["matched"], 1);
    receiver
        .wait_until("evt-1 delivered", Duration::from_secs(30), |hits| {
            hits.len() == 1
        })
        .await;
    let hit = receiver.hits_for("/orders").remove(0);
    assert!(
        hit.verified,
        "the delivery's signature does not verify with {SECRET}"
    );
    assert_eq!(hit.header("webhook-id"), "evt-1");
    assert_eq!(
        serde_json::from_slice::<Value>(&hit.body).unwrap()["data"]["order"],
        1
    );

    // bob may not: the API server refuses, and herald never hears of it.
    let refused = kubectl_as(&cp, &bob, &["create", "-f", "-"], &event_yaml("evt-2", 2));
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("Forbidden") && stderr.contains("webhookevents"),
        "bob's refusal: {stderr}"
    );

    // The same name again: AlreadyExists, nothing delivered again. A server-side dry run
    // checks without publishing.
    let again = kubectl_as(&cp, &alice, &["create", "-f", "-"], &event_yaml("evt-1", 1));
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("AlreadyExists"),
        "a repeated name: {}",
        String::from_utf8_lossy(&again.stderr)
    );
    let dry = kubectl_as(
        &cp,
        &alice,
        &["create", "--dry-run=server", "-f", "-"],
        &event_yaml("evt-3", 3),
    );
    assert!(
        dry.status.success(),
        "dry run: {}",
        String::from_utf8_lossy(&dry.stderr)
    );
    let invalid = kubectl_as(
        &cp,
        &alice,
        &["create", "-f", "-"],
        &event_yaml("evt-4", 4).replace("order.created", "order created!"),
    );
    assert!(
        String::from_utf8_lossy(&invalid.stderr).contains("type must be"),
        "an invalid type: {}",
        String::from_utf8_lossy(&invalid.stderr)
    );
    // A batch checked without publishing: each event's result, the invalid one refused alone.
    let dry_batch = kubectl_as(
        &cp,
        &alice,
        &[
            "create",
            "-n",
            "shop",
            "--dry-run=server",
            "-f",
            "-",
            "-o",
            "json",
        ],
        &json!({"apiVersion": "delivery.herald.dev/v1alpha1", "kind": "WebhookEventBatch",
                "metadata": {"generateName": "dry-"},
                "spec": {"events": [{"id": "evt-5", "type": "order.created"},
                                    {"type": "order created!"}]}})
        .to_string(),
    );
    assert!(
        dry_batch.status.success(),
        "{}",
        String::from_utf8_lossy(&dry_batch.stderr)
    );
    let dry_batch: Value = serde_json::from_slice(&dry_batch.stdout).unwrap();
    assert_eq!(dry_batch["status"]["accepted"], 0, "{dry_batch}");
    assert_eq!(dry_batch["status"]["refused"], 1, "{dry_batch}");
    assert_eq!(dry_batch["status"]["results"][0]["id"], "evt-5");
    assert_eq!(
        dry_batch["status"]["results"][1]["error"]["code"],
        "invalid_type"
    );
    assert_eq!(
        operator.metric("herald_events_published_total", "").await,
        1.0
    );
    assert_eq!(receiver.count(), 1);

    // The audit log says who published and who was refused.
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let entries = audit_entries(&cp);
        let by = |user: &str, code: u64| {
            entries.iter().any(|e| {
                e["user"]["username"] == user
                    && e["verb"] == "create"
                    && e["objectRef"]["namespace"] == "shop"
                    && e["responseStatus"]["code"] == code
            })
        };
        if by("alice", 201) && by("bob", 403) {
            break;
        }
        assert!(
            Instant::now() < end,
            "the audit log lacks alice's 201 or bob's 403: {entries:#?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    refuses_all_but_the_front_proxy(&cp, &aggregated, &ca).await;
    throughput_against_the_direct_api(&cp, &operator).await;
    kubectl_pages_through_five_thousand_attempts(&cp, &operator, &receiver, &alice).await;
    a_watch_sees_a_retry_arrive(&cp, &receiver).await;
    replays_and_enablements_are_creates(&cp, &receiver, &alice).await;
    the_kubectl_plugin(&cp, &receiver).await;
    herald_down_is_503_for_its_group_only(&cp, &mut operator);
}

/// herald stopped: the API server answers 503 for delivery.herald.dev (the plugin exits 3),
/// and everything else, herald's CRDs included, answers as before.
fn herald_down_is_503_for_its_group_only(cp: &ControlPlane, operator: &mut Operator) {
    operator.kill();
    let refused = cp.kubectl_stdin_output(&["create", "-f", "-"], &event_yaml("evt-down", 9));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && err.contains("ServiceUnavailable"),
        "{err}"
    );
    let dir = support::Scratch::new("herald-plugin-down");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_herald"), dir.join("kubectl-herald")).unwrap();
    let (code, _, err) = plugin(
        cp,
        &dir,
        &cp.kubeconfig,
        &["publish", "-n", "shop", "--type", "order.created"],
    );
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("503"), "{err}");
    assert!(
        cp.kubectl_ok(&["get", "whsub", "-n", "shop", "-o", "name"])
            .contains("webhooksubscription.herald.dev/orders")
    );
    assert!(
        cp.kubectl_ok(&["get", "namespaces", "-o", "name"])
            .contains("namespace/shop")
    );
}

/// `kubectl herald ...`: herald's binary linked as `kubectl-herald` on kubectl's PATH.
fn plugin(
    cp: &ControlPlane,
    dir: &Path,
    kubeconfig: &Path,
    args: &[&str],
) -> (i32, String, String) {
    let path = format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new(cp.bin.join("kubectl"))
        .arg("herald")
        .args(args)
        .env("PATH", path)
        .env("KUBECONFIG", kubeconfig)
        .output()
        .expect("running kubectl herald");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// The plugin's commands end to end, with their exit codes: 0 done, 1 refused, 2 bad
/// usage, 3 unavailable.
async fn the_kubectl_plugin(cp: &ControlPlane, receiver: &Receiver) {
    let dir = support::Scratch::new("herald-plugin");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_herald"), dir.join("kubectl-herald")).unwrap();
    let kubeconfig = cp.kubeconfig.clone();
    let run = |args: &[&str]| plugin(cp, &dir, &kubeconfig, args);

    let (code, out, err) = run(&[
        "publish",
        "-n",
        "shop",
        "--type",
        "order.created",
        "--data",
        r#"{"n": 1}"#,
        "--id",
        "plug-1",
    ]);
    assert_eq!(code, 0, "publish: {out}{err}");
    assert!(
        out.contains("webhookevent/plug-1 published in shop: 1 deliveries"),
        "{out}"
    );
    receiver
        .wait_until("plug-1 delivered", Duration::from_secs(30), |hits| {
            hits.iter().any(|h| h.header("webhook-id") == "plug-1")
        })
        .await;
    let (code, out, _) = run(&[
        "publish",
        "-n",
        "shop",
        "--type",
        "order.created",
        "--id",
        "plug-1",
    ]);
    assert_eq!(code, 0);
    assert!(out.contains("published before"), "{out}");
    let data = dir.join("order.json");
    std::fs::write(&data, r#"{"order": 7}"#).unwrap();
    let (code, out, err) = run(&[
        "publish",
        "-n",
        "shop",
        "--type",
        "order.created",
        "--data",
        &format!("@{}", data.display()),
        "-o",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    let published: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(published["spec"]["data"]["order"], 7);
    assert!(
        published["metadata"]["name"]
            .as_str()
            .unwrap()
            .starts_with("evt-")
    );
    let (code, _, err) = run(&["publish", "-n", "shop", "--type", "order created!"]);
    assert_eq!(code, 1, "an invalid type is refused: {err}");
    assert!(err.contains("BadRequest"), "{err}");

    let (code, out, err) = run(&[
        "deliveries",
        "whsub/orders",
        "-n",
        "shop",
        "--limit",
        "3",
        "-o",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    let list: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(list["items"].as_array().unwrap().len(), 3);
    let (code, out, _) = run(&[
        "deliveries",
        "whsub/gone",
        "-n",
        "shop",
        "--outcome",
        "gone",
    ]);
    assert_eq!(code, 0);
    assert!(
        out.starts_with("TIME") && out.contains("closed-1") && out.contains("410"),
        "{out}"
    );

    let (code, out, err) = run(&["status", "-n", "shop"]);
    assert_eq!(code, 0, "{err}");
    let orders = out
        .lines()
        .find(|l| l.starts_with("orders "))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        orders.contains("True Active") && orders.contains("204"),
        "{out}"
    );
    assert!(out.lines().any(|l| l.starts_with("gone ")), "{out}");

    let (code, out, err) = run(&["status", "-n", "shop", "-o", "yaml"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("namespace: shop") && out.contains("name: orders"),
        "{out}"
    );

    // A dead letter of its own: listed with --state dead, then enable and replay.
    receiver.set("/gone", support::receiver::Behaviour::Status(410));
    let (code, _, err) = run(&[
        "publish",
        "-n",
        "shop",
        "--type",
        "account.closed",
        "--id",
        "plug-gone",
    ]);
    assert_eq!(code, 0, "{err}");
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let (code, out, err) = run(&["deliveries", "whsub/gone", "-n", "shop", "--state", "dead"]);
        assert_eq!(code, 0, "{err}");
        if out.contains("plug-gone") {
            assert!(out.contains("410"), "{out}");
            break;
        }
        assert!(Instant::now() < end, "plug-gone never dead: {out}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    receiver.set("/gone", support::receiver::Behaviour::Status(204));
    let (code, out, err) = run(&["enable", "whsub/gone", "-n", "shop"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("whsub/gone enabled"), "{out}");
    let (code, out, err) = run(&["replay", "whsub/gone", "-n", "shop", "--since", "1h"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("1 dead letters due again"), "{out}");
    receiver
        .wait_until(
            "plug-gone delivered again",
            Duration::from_secs(30),
            |hits| {
                hits.iter()
                    .any(|h| h.header("webhook-id") == "plug-gone" && h.answered == Some(204))
            },
        )
        .await;
    let (code, out, _) = run(&["deliveries", "whsub/gone", "-n", "shop", "--state", "dead"]);
    assert_eq!(code, 0);
    assert!(!out.contains("plug-gone"), "replayed and delivered: {out}");
    let (code, _, err) = run(&[
        "deliveries",
        "whsub/gone",
        "-n",
        "shop",
        "--state",
        "pending",
    ]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = run(&["replay", "whsub/missing", "-n", "shop"]);
    assert_eq!(code, 1, "an unknown subscription is refused: {err}");

    let (code, _, err) = run(&["replay", "pod/orders", "-n", "shop"]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = run(&["publish", "-n", "shop"]);
    assert_eq!(code, 2, "no --type: {err}");
    // An API server that does not answer.
    let dead = dir.join("dead-kubeconfig");
    let text = std::fs::read_to_string(&kubeconfig).unwrap();
    let server = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("server: "))
        .unwrap()
        .to_string();
    std::fs::write(&dead, text.replace(&server, "https://127.0.0.1:9")).unwrap();
    let (code, _, err) = plugin(cp, &dir, &dead, &["status", "-n", "shop"]);
    assert_eq!(code, 3, "{err}");
}

/// A receiver's 410 Gone disables its subscription and dead-letters the event; an
/// Enablement re-enables it and a Replay delivers the dead letter again, each a create the
/// API server authorizes (alice, who may only publish, is refused).
async fn replays_and_enablements_are_creates(
    cp: &ControlPlane,
    receiver: &Receiver,
    alice: &(PathBuf, PathBuf),
) {
    receiver.set("/gone", support::receiver::Behaviour::Status(410));
    cp.apply(&[subscription(
        "shop",
        "gone",
        &receiver.url("/gone"),
        &["account.closed"],
        json!({}),
    )]);
    cp.wait_ready("shop", "whsub/gone");
    let created = cp.kubectl_stdin_output(
        &["create", "-f", "-"],
        &event_yaml("closed-1", 1).replace("order.created", "account.closed"),
    );
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let end = Instant::now() + Duration::from_secs(30);
    while !cp
        .kubectl_ok(&[
            "get",
            "deliveries",
            "-n",
            "shop",
            "--field-selector",
            "subscription=gone,outcome=Gone",
            "-o",
            "name",
        ])
        .contains("gone-")
    {
        assert!(Instant::now() < end, "no Gone attempt");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The dead letter, by its last attempt: listed with state=dead, and found by name.
    let dead: Value = serde_json::from_str(&cp.kubectl_ok(&[
        "get",
        "deliveries",
        "-n",
        "shop",
        "--field-selector",
        "subscription=gone,state=dead",
        "-o",
        "json",
    ]))
    .unwrap();
    let letters = dead["items"].as_array().unwrap();
    assert_eq!(letters.len(), 1, "{dead}");
    assert_eq!(letters[0]["eventId"], "closed-1");
    assert_eq!(letters[0]["state"], "Dead");
    assert_eq!(letters[0]["outcome"], "Gone");
    let name = letters[0]["metadata"]["name"].as_str().unwrap();
    assert!(
        cp.kubectl_ok(&["get", "deliveries", "-n", "shop", name, "-o", "name"])
            .contains(name)
    );
    let refused = cp.kubectl(&[
        "get",
        "deliveries",
        "-n",
        "shop",
        "--field-selector",
        "state=dead",
    ]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && err.contains("add subscription=NAME"),
        "{err}"
    );
    receiver.set("/gone", support::receiver::Behaviour::Status(204));
    let enablement = "apiVersion: delivery.herald.dev/v1alpha1\nkind: Enablement\nmetadata: {generateName: gone-}\nspec: {subscription: gone}\n";
    let replay = "apiVersion: delivery.herald.dev/v1alpha1\nkind: Replay\nmetadata: {generateName: gone-}\nspec: {subscription: gone}\n";
    for input in [enablement, replay] {
        let refused = kubectl_as(cp, alice, &["create", "-n", "shop", "-f", "-"], input);
        assert!(
            String::from_utf8_lossy(&refused.stderr).contains("Forbidden"),
            "{}",
            String::from_utf8_lossy(&refused.stderr)
        );
    }
    let enabled: Value = serde_json::from_str(&cp.kubectl_stdin(
        &["create", "-n", "shop", "-f", "-", "-o", "json"],
        enablement,
    ))
    .unwrap();
    assert_eq!(enabled["status"]["disabled"], false, "{enabled}");
    let replayed: Value = serde_json::from_str(
        &cp.kubectl_stdin(&["create", "-n", "shop", "-f", "-", "-o", "json"], replay),
    )
    .unwrap();
    assert_eq!(replayed["status"]["replayed"], 1, "{replayed}");
    receiver
        .wait_until(
            "closed-1 delivered again",
            Duration::from_secs(30),
            |hits| {
                hits.iter()
                    .any(|h| h.path == "/gone" && h.answered == Some(204))
            },
        )
        .await;
}

/// A WebhookEventBatch of 1,000 is one commit; then `kubectl get deliveries` reads the
/// attempt log a page at a time (`--chunk-size`) and prints it as a table; a field
/// selector narrows it.
async fn kubectl_pages_through_five_thousand_attempts(
    cp: &ControlPlane,
    operator: &Operator,
    receiver: &Receiver,
    alice: &(PathBuf, PathBuf),
) {
    // The first thousand as one WebhookEventBatch through the API server: one commit.
    let commits = || {
        operator.metric(
            "herald_store_operation_duration_seconds_count",
            "operation=\"publish_batch\"",
        )
    };
    let (batches_before, single_before) = (
        commits().await,
        operator
            .metric(
                "herald_store_operation_duration_seconds_count",
                "operation=\"publish\"",
            )
            .await,
    );
    let events: Vec<Value> = (0..1000)
        .map(|n| json!({"id": format!("page-0-{n}"), "type": "order.created", "data": {"n": n}}))
        .collect();
    let created = kubectl_as(
        cp,
        alice,
        &["create", "-n", "shop", "-f", "-", "-o", "json"],
        &json!({"apiVersion": "delivery.herald.dev/v1alpha1", "kind": "WebhookEventBatch",
                "metadata": {"generateName": "page-"}, "spec": {"events": events}})
        .to_string(),
    );
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let created: Value = serde_json::from_slice(&created.stdout).unwrap();
    assert_eq!(
        created["status"]["accepted"], 1000,
        "{}",
        created["status"]["refused"]
    );
    let results = created["status"]["results"].as_array().unwrap();
    assert_eq!(results.len(), 1000);
    assert_eq!(
        results[999],
        json!({"id": "page-0-999", "matched": 1, "duplicate": false})
    );
    assert_eq!(
        commits().await - batches_before,
        1.0,
        "a batch of 1,000 is one commit"
    );
    assert_eq!(
        operator
            .metric(
                "herald_store_operation_duration_seconds_count",
                "operation=\"publish\""
            )
            .await,
        single_before
    );
    let token = cp.token("shop", "producer");
    for batch in 1..5 {
        let events: Vec<Value> = (0..1000)
            .map(|n| json!({"id": format!("page-{batch}-{n}"), "type": "order.created"}))
            .collect();
        let answer = operator
            .expect(
                reqwest::Method::POST,
                "/v1/namespaces/shop/events/batch",
                Some(&token),
                Some(json!({"events": events})),
                200,
            )
            .await;
        assert_eq!(answer["results"].as_array().unwrap().len(), 1000);
    }
    // evt-1, 2 × 400 from the throughput figure, 5,000 here: every one delivered once.
    let total = 1 + 800 + 5000;
    receiver
        .wait_until("every event delivered", Duration::from_secs(120), |hits| {
            hits.len() >= total
        })
        .await;
    let end = Instant::now() + Duration::from_secs(30);
    let listed = loop {
        let out = cp.kubectl(&[
            "get",
            "deliveries",
            "-n",
            "shop",
            "--chunk-size=500",
            "--no-headers",
            "-v=6",
        ]);
        let rows = String::from_utf8_lossy(&out.stdout).lines().count();
        if rows == total || Instant::now() > end {
            break (out, rows);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let (out, rows) = listed;
    assert_eq!(
        rows,
        total,
        "kubectl get deliveries: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pages = String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| l.contains("/deliveries?") && l.contains("limit=500") && l.contains("200 OK"))
        .count();
    // herald's read budget per namespace may answer a page 429 with Retry-After, which
    // client-go honours: only the pages served count.
    assert_eq!(
        pages,
        total.div_ceil(500),
        "one page served per 500 attempts"
    );
    // One by name, as a table (the names come from the list).
    let stdout = String::from_utf8_lossy(&out.stdout);
    let first = stdout.split_whitespace().next().unwrap();
    let table = cp.kubectl_ok(&["get", "delivery", first, "-n", "shop"]);
    let header = table.lines().next().unwrap();
    for column in [
        "NAME",
        "SUBSCRIPTION",
        "EVENT",
        "TYPE",
        "OUTCOME",
        "STATUS",
        "LATENCY",
        "AGE",
    ] {
        assert!(header.contains(column), "no {column} column: {header}");
    }
    let wrong = cp.kubectl(&[
        "get",
        "deliveries",
        "-n",
        "shop",
        "--field-selector",
        "colour=blue",
    ]);
    assert!(String::from_utf8_lossy(&wrong.stderr).contains("field label not supported"));
}

/// A watch from a list's version sees the attempts that follow it (a failed one and its
/// retry) and none of those the list had.
async fn a_watch_sees_a_retry_arrive(cp: &ControlPlane, receiver: &Receiver) {
    use kube::api::{ListParams, WatchEvent, WatchParams};
    // Each event fails once, then is accepted on its retry.
    receiver.set(
        "/flaky",
        support::receiver::Behaviour::Script(vec![503, 204, 503, 204]),
    );
    cp.apply(&[subscription(
        "shop",
        "flaky",
        &receiver.url("/flaky"),
        &["payment.failed"],
        json!({"delivery": {"retry": {"initialBackoff": "200ms", "maxBackoff": "1s"}}}),
    )]);
    cp.wait_ready("shop", "whsub/flaky");
    let gvk = GroupVersionKind::gvk("delivery.herald.dev", "v1alpha1", "Delivery");
    let resource = ApiResource::from_gvk_with_plural(&gvk, "deliveries");
    let deliveries: Api<DynamicObject> = Api::namespaced_with(cp.client().await, "shop", &resource);
    let pay = |id: &str| event_yaml(id, 1).replace("order.created", "payment.failed");
    // pay-0's two attempts come before the list; the watch from its version must not
    // repeat them.
    let created = cp.kubectl_stdin_output(&["create", "-f", "-"], &pay("pay-0"));
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let flaky = ListParams::default().fields("subscription=flaky");
    let end = Instant::now() + Duration::from_secs(30);
    let listed = loop {
        let listed = deliveries.list(&flaky).await.unwrap();
        if listed.items.len() == 2 {
            break listed;
        }
        assert!(
            Instant::now() < end,
            "pay-0's two attempts not listed: {:?}",
            listed.items
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let version = listed.metadata.resource_version.clone().unwrap();
    let mut stream = deliveries
        .watch(
            &WatchParams::default()
                .fields("subscription=flaky")
                .timeout(60),
            &version,
        )
        .await
        .unwrap()
        .boxed();
    let created = cp.kubectl_stdin_output(&["create", "-f", "-"], &pay("pay-1"));
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while seen.len() < 2 {
        let event = tokio::time::timeout_at(deadline, stream.next())
            .await
            .unwrap_or_else(|_| panic!("the watch saw {seen:?} in 30s"))
            .expect("the watch ended")
            .unwrap();
        match event {
            WatchEvent::Added(object) => seen.push((
                object.data["eventId"].as_str().unwrap().to_string(),
                object.data["outcome"].as_str().unwrap().to_string(),
                object.data["statusCode"].as_u64(),
            )),
            other => panic!("unexpected watch event {other:?}"),
        }
    }
    assert_eq!(
        seen,
        [
            ("pay-1".to_string(), "Transient".to_string(), Some(503)),
            ("pay-1".to_string(), "Accepted".to_string(), Some(204))
        ]
    );
}

/// Straight to herald's aggregated port, not through the API server: without the front
/// proxy's client certificate nothing gets in, forged identity headers or not.
async fn refuses_all_but_the_front_proxy(cp: &ControlPlane, aggregated: &str, ca: &Ca) {
    let url =
        format!("{aggregated}/apis/delivery.herald.dev/v1alpha1/namespaces/shop/webhookevents");
    let event = json!({"apiVersion": "delivery.herald.dev/v1alpha1", "kind": "WebhookEvent",
                       "metadata": {"name": "forged"}, "spec": {"type": "order.created"}});
    let pki = cp.dir().join("pki");
    let identity = |name: &str| {
        let mut pem = std::fs::read(pki.join(format!("{name}.crt"))).unwrap();
        pem.extend(std::fs::read(pki.join(format!("{name}.key"))).unwrap());
        reqwest::Identity::from_pem(&pem).unwrap()
    };
    let client = |identity: Option<reqwest::Identity>| {
        let mut builder = reqwest::Client::builder()
            .tls_certs_only([reqwest::Certificate::from_der(&ca.der).unwrap()])
            .resolve(
                &format!("{SERVICE}.{SERVICE_NAMESPACE}.svc"),
                aggregated.trim_start_matches("https://").parse().unwrap(),
            );
        if let Some(identity) = identity {
            builder = builder.identity(identity);
        }
        builder.build().unwrap()
    };
    let url = url.replace(
        aggregated.trim_start_matches("https://"),
        &format!(
            "{SERVICE}.{SERVICE_NAMESPACE}.svc:{}",
            aggregated.rsplit(':').next().unwrap()
        ),
    );
    let forged = |client: reqwest::Client| {
        let url = url.clone();
        let event = event.clone();
        async move {
            client
                .post(url)
                .header("X-Remote-User", "alice")
                .header("X-Remote-Group", "system:masters")
                .json(&event)
                .send()
                .await
        }
    };
    // No client certificate: the handshake fails.
    assert!(
        forged(client(None)).await.is_err(),
        "no client certificate was let in"
    );
    // A certificate of the cluster's CA (the admin's), not the front proxy's: refused too.
    assert!(
        forged(client(Some(identity("admin")))).await.is_err(),
        "the admin's certificate was let in"
    );
    // The front proxy's own certificate without a user: 401 Status.
    let response = client(Some(identity("front-proxy-client")))
        .post(&url)
        .json(&event)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 401);
    let status: Value = response.json().await.unwrap();
    assert_eq!(status["kind"], "Status");
    assert_eq!(status["reason"], "Unauthorized");
}

/// Publish rate through the API server against the direct API, same herald, same run: a
/// figure for the closing note (printed), not a timed assertion.
async fn throughput_against_the_direct_api(cp: &ControlPlane, operator: &Operator) {
    const EVENTS: usize = 400;
    const CONCURRENCY: usize = 8;
    let client = cp.client().await;
    let gvk = GroupVersionKind::gvk("delivery.herald.dev", "v1alpha1", "WebhookEvent");
    let resource = ApiResource::from_gvk_with_plural(&gvk, "webhookevents");
    let events: Api<DynamicObject> = Api::namespaced_with(client, "shop", &resource);
    let started = Instant::now();
    let results: Vec<_> = futures::stream::iter(0..EVENTS)
        .map(|n| {
            let events = events.clone();
            let resource = resource.clone();
            async move {
                let mut object = DynamicObject::new(&format!("agg-{n}"), &resource);
                object.data = json!({"spec": {"type": "order.created", "data": {"n": n}}});
                events.create(&PostParams::default(), &object).await
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    let aggregated = started.elapsed();
    for result in results {
        result.expect("a create through the API server");
    }
    let token = cp.token("shop", "producer");
    let started = Instant::now();
    futures::stream::iter(0..EVENTS)
        .map(|n| {
            let token = token.clone();
            async move {
                operator
                    .publish("shop", &token, json!({"id": format!("direct-{n}"), "type": "order.created", "data": {"n": n}}))
                    .await
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect::<Vec<_>>()
        .await;
    let direct = started.elapsed();
    let rate = |elapsed: Duration| EVENTS as f64 / elapsed.as_secs_f64();
    println!(
        "publish through the aggregated API: {:.0} events/s; direct API: {:.0} events/s; ratio {:.2} ({EVENTS} events, {CONCURRENCY} at a time, each side)",
        rate(aggregated),
        rate(direct),
        rate(aggregated) / rate(direct)
    );
    assert_eq!(
        operator.metric("herald_events_published_total", "").await,
        (1 + 2 * EVENTS) as f64
    );
}
