//! Watching the cluster: `WebhookSubscription`s drive the reconciler, changes of the Secrets
//! they reference re-reconcile exactly those subscriptions, and `WebhookQuota`s are applied
//! to the engine per namespace. Also the start-up pass that purges subscriptions deleted
//! while herald was down, before anything is dispatched.
//!
//! Memory: the subscription cache holds each object without its managedFields and without
//! its status (the status writer keeps what it needs of that: `shown`); Secrets are watched
//! as metadata only and not cached (a reconcile reads the referenced Secrets with a GET,
//! which other reconciles reuse for a few seconds: `secret_reads`).

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ListParams};
use kube::core::PartialObjectMeta;
use kube::runtime::controller::Controller;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, predicates, watcher};
use kube::{Resource, ResourceExt};

use super::conditions::quota_in_force;
use super::reconcile::{Context, error_policy, reconcile, reconcile_digest};
use super::status::{StatusWriter, write_quota_status};
use crate::api::{WebhookQuota, WebhookSubscription};
use crate::delivery::Engine;

/// Where herald looks: every namespace, or the listed ones.
#[derive(Clone, Debug)]
pub struct Scope(pub Vec<String>);

impl Scope {
    fn apis<K>(&self, client: &kube::Client) -> Vec<Api<K>>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        K::DynamicType: Default,
    {
        if self.0.is_empty() {
            vec![Api::all(client.clone())]
        } else {
            self.0
                .iter()
                .map(|ns| Api::namespaced(client.clone(), ns))
                .collect()
        }
    }

    fn covers(&self, namespace: &str) -> bool {
        self.0.is_empty() || self.0.iter().any(|ns| ns == namespace)
    }
}

/// What the cache keeps of a WebhookSubscription: neither managedFields nor annotations
/// other than herald's own (kubectl's last-applied-configuration alone is a copy of the whole
/// object), which herald never reads, nor the status, of which the status writer has kept
/// what it reads; with 100,000 subscriptions that is most of the cache.
fn trim_for_cache(obj: &mut WebhookSubscription) {
    obj.managed_fields_mut().clear();
    obj.annotations_mut()
        .retain(|key, _| key.starts_with("herald.dev/"));
    obj.status = None;
}

/// Passes a watch event on to the cache, having shown the status writer the status the
/// object carries (and told it of an object gone).
fn record_and_trim(
    status: &StatusWriter,
    mut event: watcher::Event<WebhookSubscription>,
) -> watcher::Event<WebhookSubscription> {
    match &mut event {
        watcher::Event::Apply(obj) | watcher::Event::InitApply(obj) => {
            status.saw(obj);
            trim_for_cache(obj);
        }
        watcher::Event::Delete(obj) => {
            if let Some(uid) = obj.uid() {
                status.forget(&uid);
            }
            trim_for_cache(obj);
        }
        watcher::Event::Init | watcher::Event::InitDone => {}
    }
    event
}

/// Before dispatching anything after a start: every subscription the store holds as live
/// whose object is gone, or is being deleted, is purged and fenced now. Fails (and herald
/// does not start delivering) when the API server cannot be listed.
pub async fn purge_deleted_while_down(
    client: &kube::Client,
    engine: &Engine,
    scope: &Scope,
) -> anyhow::Result<u64> {
    let mut present = HashSet::new();
    let mut deleting = Vec::new();
    for api in scope.apis::<WebhookSubscription>(client) {
        let mut params = ListParams::default().limit(500);
        loop {
            let page = api.list_metadata(&params).await?;
            for obj in &page.items {
                let Some(uid) = obj.uid() else { continue };
                if obj.meta().deletion_timestamp.is_some() {
                    deleting.push((obj.namespace().unwrap_or_default(), uid));
                } else {
                    present.insert(uid);
                }
            }
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(token) => params = params.continue_token(&token),
                None => break,
            }
        }
    }
    let mut removed = 0;
    for record in engine.stored_subscriptions().await? {
        if scope.covers(&record.namespace) && !present.contains(&record.uid) {
            let purged = engine.remove(&record.namespace, &record.uid).await?;
            tracing::info!(namespace = %record.namespace, subscription = %record.name, purged, "subscription deleted while herald was down; its pending attempts are purged");
            removed += 1;
        }
    }
    // Objects still held by the finalizer (the loop above purged those the store knew):
    // fenced now, the finalizer comes off when the controller reconciles them.
    for (namespace, uid) in deleting {
        engine.remove(&namespace, &uid).await?;
    }
    Ok(removed)
}

/// Subscriptions referencing a Secret, from the controller's cache.
fn referencing(
    store: &Store<WebhookSubscription>,
    secret: &PartialObjectMeta<Secret>,
) -> Vec<ObjectRef<WebhookSubscription>> {
    let (Some(namespace), Some(name)) = (secret.namespace(), secret.metadata.name.as_deref())
    else {
        return Vec::new();
    };
    store
        .state()
        .iter()
        .filter(|sub| {
            sub.namespace().as_deref() == Some(namespace.as_str())
                && std::iter::once(&sub.spec.signing.secret_ref)
                    .chain(&sub.spec.signing.additional_secret_refs)
                    .any(|r| r.name == name)
        })
        .map(|sub| ObjectRef::from_obj(&**sub))
        .collect()
}

/// Waits until every subscription of the first full list has been reconciled once (or is
/// being deleted), so that a replica reporting ready routes an event to every subscription
/// that existed when it started; after two minutes it stops waiting and says so.
async fn reconciled_once(listed: &Store<WebhookSubscription>, ctx: &Context) {
    let mut left: Vec<String> = listed
        .state()
        .iter()
        .filter(|o| o.meta().deletion_timestamp.is_none())
        .filter_map(|o| o.uid())
        .collect();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        left.retain(|uid| !ctx.status.knows(uid));
        if left.is_empty() {
            return;
        }
        if tokio::time::Instant::now() > deadline {
            tracing::warn!(
                left = left.len(),
                "subscriptions not reconciled two minutes after the first list; reporting ready anyway"
            );
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Runs the subscription controllers (one per watched namespace, or one for all) until
/// the process ends. `synced` is told when every cache has its first full list.
pub async fn run_subscriptions(
    ctx: Arc<Context>,
    scope: Scope,
    concurrency: u16,
    synced: tokio::sync::mpsc::UnboundedSender<()>,
) {
    let sweeper = ctx.clone();
    tokio::spawn(async move { sweeper.secrets.keep_swept().await });
    let mut controllers = Vec::new();
    let secret_apis = scope.apis::<PartialObjectMeta<Secret>>(&ctx.client);
    for (api, secrets) in scope
        .apis::<WebhookSubscription>(&ctx.client)
        .into_iter()
        .zip(secret_apis)
    {
        let (reader, writer) = reflector::store();
        // Told from the stream itself: kube-runtime's Store::wait_until_ready wakes only one
        // of several waiters, and the controller is already one.
        let synced = synced.clone();
        let (listed, ready_ctx) = (reader.clone(), ctx.clone());
        let (changes, shown) = (ctx.status.clone(), ctx.status.clone());
        let subscriptions = watcher(api, watcher::Config::default())
            .default_backoff()
            .map_ok(move |event| record_and_trim(&shown, event))
            .reflect(writer)
            .inspect(move |event| {
                if let Ok(watcher::Event::InitDone) = event {
                    let (listed, ctx, synced) = (listed.clone(), ready_ctx.clone(), synced.clone());
                    tokio::spawn(async move {
                        reconciled_once(&listed, &ctx).await;
                        let _ = synced.send(());
                    });
                }
            })
            .applied_objects()
            // Herald's own status writes do not pass. Filtered against the status writer's
            // book, not kube-runtime's predicate_filter, whose cache costs a few hundred
            // bytes per subscription.
            .try_filter(move |obj| {
                let pass = obj.uid().is_none_or(|uid| {
                    changes.changed_since_reconciled(&uid, reconcile_digest(obj))
                });
                std::future::ready(pass)
            });
        let secret_changes = watcher(secrets, watcher::Config::default())
            .default_backoff()
            .touched_objects()
            .predicate_filter(predicates::resource_version, Default::default());
        let (index, reads) = (reader.clone(), ctx.clone());
        let controller = Controller::for_stream(subscriptions, reader)
            .with_config(kube::runtime::controller::Config::default().concurrency(concurrency))
            .watches_stream(secret_changes, move |secret| {
                // Before the reconciles it starts, which must read the Secret again.
                if let (Some(namespace), Some(name)) =
                    (secret.namespace(), secret.metadata.name.as_deref())
                {
                    reads.secrets.changed(&namespace, name);
                }
                referencing(&index, &secret)
            })
            .run(reconcile, error_policy, ctx.clone())
            .for_each(|result| async move {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "controller");
                }
            });
        controllers.push(controller);
    }
    futures::future::join_all(controllers).await;
}

/// Applies WebhookQuotas to the engine: per namespace the oldest quota is in force, later
/// ones are marked superseded; removing the last one restores the default.
pub async fn run_quotas(
    client: kube::Client,
    engine: Arc<Engine>,
    scope: Scope,
    synced: tokio::sync::mpsc::UnboundedSender<()>,
) {
    let mut loops = Vec::new();
    for api in scope.apis::<WebhookQuota>(&client) {
        let (reader, writer) = reflector::store();
        let client = client.clone();
        let engine = engine.clone();
        let synced = synced.clone();
        loops.push(async move {
            let mut applied: BTreeSet<String> = BTreeSet::new();
            let mut initialised = false;
            let mut events = watcher(api, watcher::Config::default())
                .default_backoff()
                .modify(|obj| obj.managed_fields_mut().clear())
                .reflect(writer)
                .boxed();
            while let Some(event) = events.next().await {
                let namespaces: BTreeSet<String> = match event {
                    Ok(watcher::Event::Apply(q) | watcher::Event::Delete(q)) => {
                        q.namespace().into_iter().collect()
                    }
                    Ok(watcher::Event::InitDone) => {
                        if !initialised {
                            initialised = true;
                            let _ = synced.send(());
                        }
                        reader
                            .state()
                            .iter()
                            .filter_map(|q| q.namespace())
                            .chain(applied.iter().cloned())
                            .collect()
                    }
                    Ok(_) => continue,
                    Err(e) => {
                        tracing::warn!(error = %e, "watching WebhookQuotas");
                        continue;
                    }
                };
                for namespace in namespaces {
                    apply_quota(&client, &engine, &reader, &namespace, &mut applied).await;
                }
            }
        });
    }
    futures::future::join_all(loops).await;
}

async fn apply_quota(
    client: &kube::Client,
    engine: &Engine,
    reader: &Store<WebhookQuota>,
    namespace: &str,
    applied: &mut BTreeSet<String>,
) {
    let quotas: Vec<Arc<WebhookQuota>> = reader
        .state()
        .into_iter()
        .filter(|q| {
            q.namespace().as_deref() == Some(namespace) && q.meta().deletion_timestamp.is_none()
        })
        .collect();
    let keys: Vec<_> = quotas
        .iter()
        .map(|q| {
            (
                q.meta().creation_timestamp.as_ref().map(|t| t.0),
                q.metadata.name.as_deref().unwrap_or_default(),
            )
        })
        .collect();
    let Some(winner) = quota_in_force(&keys) else {
        if applied.remove(namespace) {
            engine.set_quota(namespace, None, None);
            tracing::info!(namespace, "no WebhookQuota left; the default limits apply");
        }
        return;
    };
    let spec = &quotas[winner].spec;
    engine.set_quota(
        namespace,
        Some(spec.max_in_flight),
        Some(spec.max_pending_attempts),
    );
    applied.insert(namespace.to_string());
    let winner_name = quotas[winner].name_any();
    for (i, quota) in quotas.iter().enumerate() {
        if let Err(e) = write_quota_status(client, quota, i == winner, &winner_name).await {
            tracing::debug!(error = %e, namespace, quota = %quota.name_any(), "quota status not written; retried on the next change");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_keeps_only_herald_annotations_and_no_status() {
        let mut obj: WebhookSubscription = serde_json::from_value(serde_json::json!({
            "apiVersion": "herald.dev/v1alpha1",
            "kind": "WebhookSubscription",
            "metadata": {
                "name": "orders", "namespace": "shop",
                "annotations": {
                    "kubectl.kubernetes.io/last-applied-configuration": "{\"a whole copy\":1}",
                    "herald.dev/reenable": "2026-11-30",
                },
                "managedFields": [{"manager": "kubectl", "operation": "Apply"}],
                "finalizers": ["herald.dev/purge"],
            },
            "spec": {"url": "https://example.com/hook", "eventTypes": ["*"],
                     "signing": {"secretRef": {"name": "s", "key": "k"}}},
            "status": {"observedGeneration": 1},
        }))
        .unwrap();
        trim_for_cache(&mut obj);
        let annotations: Vec<_> = obj.annotations().keys().collect();
        assert_eq!(annotations, ["herald.dev/reenable"]);
        assert!(obj.managed_fields().is_empty());
        assert_eq!(obj.finalizers(), ["herald.dev/purge"]);
        assert!(obj.status.is_none());
    }
}
