//! The operator's figures (cluster mode, against a real kube-apiserver), each against a
//! reference from the same run:
//! - publishing with cluster authorization (TokenReview + SubjectAccessReview, cached) as a
//!   ratio to standalone mode's static `--publish-token`, same herald build, same load, in
//!   alternating turns;
//! - memory: herald's RSS with N idle subscriptions reconciled (namespaces of 1,000, created
//!   16 at a time through the API), against its RSS with one, measured just before they are
//!   created; the slope per subscription, and the RSS it projects for 100,000 (a projection
//!   unless N is 100,000);
//! - reconciling them, against the time the API server took to create them;
//! - start-up: herald restarted with N subscriptions until /readyz answers, against its
//!   first start with none.
//!
//! Needs the test control plane (`scripts/control-plane build`). Run:
//! `cargo bench --bench operator` (`HERALD_BENCH_MODE=quick`: 200 subscriptions and 2,000
//! events; full: 10,000 and 20,000; HERALD_BENCH_SUBSCRIPTIONS overrides N).

#[path = "../tests/support/mod.rs"]
mod support;

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{Report, Target, memory, thousands};
use futures::StreamExt;
use herald::api::WebhookSubscription;
use kube::api::{Api, DynamicObject, PostParams};
use kube::core::ApiResource;
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::{Value, json};
use support::control_plane::ControlPlane;
use support::herald::{Herald, idle_subscriptions, secret, subscription};
use support::operator::Operator;

const CONCURRENCY: usize = 32;
const PER_NAMESPACE: usize = 1_000;
/// Subscriptions created at once through the API.
const CREATORS: usize = 16;
const PROJECTED: usize = 100_000;
/// Turns of publishing to each herald, alternately.
const PUBLISH_TURNS: usize = 4;

/// Publishes `events` events over CONCURRENCY producers; how long that took.
async fn publish_for(base: &str, namespace: &str, token: &str, events: usize) -> Duration {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let next = next.clone();
            let url = format!("{base}/v1/namespaces/{namespace}/events");
            let token = token.to_string();
            let client = reqwest::Client::new();
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= events {
                        return;
                    }
                    let r = client
                        .post(&url)
                        .bearer_auth(&token)
                        .json(&json!({"type": "bench.event", "data": {"i": i}}))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status().as_u16(), 202);
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    started.elapsed()
}

fn paused_subscription(namespace: &str, name: &str) -> Value {
    subscription(
        namespace,
        name,
        "http://127.0.0.1:9/never",
        &["bench.*"],
        json!({"paused": true}),
    )
}

/// Creates the subscriptions through the API server, CREATORS at a time.
async fn create(cp: &ControlPlane, subscriptions: Vec<Value>) {
    let client = cp.client().await;
    let resource = ApiResource::erase::<WebhookSubscription>(&());
    futures::stream::iter(subscriptions)
        .map(|manifest| {
            let (client, resource) = (client.clone(), resource.clone());
            async move {
                let object: DynamicObject = serde_json::from_value(manifest).unwrap();
                let namespace = object.metadata.namespace.clone().unwrap();
                Api::<DynamicObject>::namespaced_with(client, &namespace, &resource)
                    .create(&PostParams::default(), &object)
                    .await
                    .unwrap();
            }
        })
        .buffer_unordered(CREATORS)
        .collect::<()>()
        .await;
}

/// Waits until `expected` WebhookSubscriptions in the cluster show herald's status for
/// their generation. Follows one watch rather than relisting: at 100,000 objects a list
/// every second would load the API server more than herald does.
async fn wait_reconciled(cp: &ControlPlane, expected: usize, deadline: Duration) {
    let api: Api<WebhookSubscription> = Api::all(cp.client().await);
    let mut events =
        std::pin::pin!(watcher(api, watcher::Config::default().page_size(1_000)).default_backoff());
    let mut done: HashSet<String> = HashSet::new();
    let end = tokio::time::Instant::now() + deadline;
    while done.len() < expected {
        let event = tokio::time::timeout_at(end, events.next())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "only {} of {expected} subscriptions reconciled after {deadline:?}",
                    done.len()
                )
            })
            .expect("the watch does not end");
        match event {
            // A relist starts over: every object comes again.
            Ok(watcher::Event::Init) => done.clear(),
            Ok(watcher::Event::InitApply(s) | watcher::Event::Apply(s)) => {
                let uid = s.metadata.uid.clone().unwrap_or_default();
                if s.status.as_ref().and_then(|st| st.observed_generation) == s.metadata.generation
                {
                    done.insert(uid);
                } else {
                    done.remove(&uid);
                }
            }
            Ok(watcher::Event::Delete(s)) => {
                done.remove(&s.metadata.uid.unwrap_or_default());
            }
            Ok(watcher::Event::InitDone) => {}
            Err(e) => eprintln!("watching subscriptions: {e}; the watcher retries"),
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut report = Report::new("operator");
    let events = report.mode.pick(2_000, 20_000);
    let subscriptions: usize = std::env::var("HERALD_BENCH_SUBSCRIPTIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(report.mode.pick(200, 10_000));
    let (events_n, subs_n, projected_n) = (
        thousands(events),
        thousands(subscriptions),
        thousands(PROJECTED),
    );
    report.param("events", events);
    report.param("concurrency", CONCURRENCY);
    report.param("subscriptions", subscriptions);
    report.param("subscriptions_per_namespace", PER_NAMESPACE);

    let cp = ControlPlane::start().expect("the benchmark needs the control plane");
    let mut operator = Operator::start(&cp, &[]).await;
    let start_none = operator.started_in;

    // Publishing: one paused subscription, so every event is stored with one pending
    // delivery and nothing is sent; the same in both modes.
    let objects = vec![
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "bench"}}),
        secret("bench"),
        paused_subscription("bench", "stored"),
        json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "producer", "namespace": "bench"}}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": "producer", "namespace": "bench"},
               "rules": [{"apiGroups": ["herald.dev"], "resources": ["webhookevents"], "verbs": ["create"]}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "producer", "namespace": "bench"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "producer"},
               "subjects": [{"kind": "ServiceAccount", "name": "producer", "namespace": "bench"}]}),
    ];
    cp.apply(&objects);
    wait_reconciled(&cp, 1, Duration::from_secs(60)).await;
    let token = cp.token("bench", "producer");
    // The first publish may meet a grant not yet visible to the authorizer: retried.
    operator
        .publish("bench", &token, json!({"type": "bench.warmup"}))
        .await;
    let standalone = Herald::start(
        &[secret("bench"), paused_subscription("bench", "stored")],
        &["--publish-token", "bench-token"],
    );
    // In turns, so that both meet the same machine whatever else it does meanwhile.
    let (mut rbac, mut static_token) = (Duration::ZERO, Duration::ZERO);
    let turn = events / PUBLISH_TURNS;
    for _ in 0..PUBLISH_TURNS {
        rbac += publish_for(&operator.base, "bench", &token, turn).await;
        static_token += publish_for(&standalone.base, "bench", "bench-token", turn).await;
    }
    drop(standalone);
    let published = (turn * PUBLISH_TURNS) as f64;
    let (with_rbac, with_token) = (
        published / rbac.as_secs_f64(),
        published / static_token.as_secs_f64(),
    );
    report
        .add(
            "publish.cluster_auth",
            &format!("publish with TokenReview + SubjectAccessReview (cached), {events_n} events, {CONCURRENCY} producers"),
            with_rbac,
            "events/s",
        )
        .reference(
            &format!("standalone --publish-token, same load, in {PUBLISH_TURNS} turns alternating with it"),
            with_token,
        );

    // Memory: N idle subscriptions, their namespaces and secrets first.
    let (secrets, idle): (Vec<Value>, Vec<Value>) =
        idle_subscriptions(subscriptions, PER_NAMESPACE, "http://127.0.0.1:9/never")
            .into_iter()
            .partition(|m| m["kind"] == "Secret");
    let namespaces: Vec<Value> = secrets
        .iter()
        .map(|s| json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": s["metadata"]["namespace"]}}))
        .collect();
    cp.apply(&namespaces);
    cp.apply(&secrets);
    let before = memory(operator.pid());
    let started = Instant::now();
    create(&cp, idle).await;
    let created = started.elapsed();
    // Reconciling runs at tens per second here (status writes through the API server).
    let deadline = Duration::from_secs(600 + subscriptions as u64 / 20);
    wait_reconciled(&cp, subscriptions + 1, deadline).await;
    let reconciled = started.elapsed();
    let after = memory(operator.pid());
    eprintln!(
        "{subscriptions} subscriptions created in {created:.2?}, reconciled in {reconciled:.2?}; {before:?} → {after:?}"
    );
    let reference = "1 subscription, just before, same run";
    report.memory(
        "memory.cluster",
        &format!("{subs_n} idle subscriptions reconciled, cluster mode"),
        after,
        reference,
        before,
        (subscriptions >= PROJECTED).then_some(Target::AtMost(200.0)),
    );
    let slope_kib = (after.rss_mb - before.rss_mb) * 1e6 / 1024.0 / subscriptions as f64;
    report.add(
        "memory.cluster.per_subscription",
        &format!(
            "RSS per subscription, cluster mode ((RSS with {subs_n} − RSS with 1) / {subs_n})"
        ),
        slope_kib,
        "KiB",
    );
    let projected = before.rss_mb + slope_kib * 1024.0 / 1e6 * PROJECTED as f64;
    let label = if subscriptions == PROJECTED {
        format!("RSS with {projected_n} subscriptions, cluster mode (measured)")
    } else {
        format!(
            "RSS with {projected_n} subscriptions, cluster mode: PROJECTION (RSS with 1 + {projected_n} × the slope measured at {subs_n})"
        )
    };
    report
        .add("memory.cluster.projected_100k", &label, projected, "MB")
        .reference(&format!("RSS with {reference}"), before.rss_mb)
        .target(Target::AtMost(200.0));
    report
        .add(
            "reconcile.cluster",
            &format!("{subs_n} subscriptions: from the first create to all reconciled"),
            reconciled.as_secs_f64(),
            "s",
        )
        .reference(
            &format!("the API server creating them, {CREATORS} at a time"),
            created.as_secs_f64(),
        );

    operator.restart().await;
    report
        .add(
            "startup.cluster",
            &format!("start-up to /readyz with {subs_n} subscriptions, cluster mode"),
            operator.started_in.as_secs_f64(),
            "s",
        )
        .reference(
            "first start-up, no subscription, same run",
            start_none.as_secs_f64(),
        )
        .target(Target::AtMost(10.0));
    drop(operator);
    report.finish();
}
