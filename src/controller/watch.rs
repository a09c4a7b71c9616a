//! Watching the cluster: `WebhookSubscription`s drive the reconciler, changes of the Secrets
//! they reference re-reconcile exactly those subscriptions, and `WebhookQuota`s are applied
//! to the engine per namespace. Also the start-up pass that purges subscriptions deleted
//! while herald was down, before anything is dispatched.
//!
//! Memory: no subscription object is cached. The object a watch event carries waits in the
//! reconcile queue (`queue`) until reconciled, trimmed of what herald never reads and of its
//! status (the status writer keeps what it needs of that: `shown`). Secrets are watched as
//! metadata only and not cached (a reconcile reads the referenced Secrets with a GET, which
//! other reconciles reuse for a few seconds: `secret_reads`).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ListParams};
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};

use super::queue::{Key, Queue};
use super::reconcile::{Context, reconcile_digest};
use super::status::write_quota_status;
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

/// What a queued WebhookSubscription keeps: neither managedFields nor annotations other than
/// herald's own (kubectl's last-applied-configuration alone is a copy of the whole object),
/// which herald never reads, nor the status, of which the status writer has kept what it
/// reads. At start-up every object waits at once.
fn trim_for_queue(obj: &mut WebhookSubscription) {
    obj.managed_fields_mut().clear();
    obj.annotations_mut()
        .retain(|key, _| key.starts_with("herald.dev/"));
    obj.status = None;
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
    let removed = remove_vanished(client, engine, &|ns| scope.covers(ns), &present).await?;
    // Objects still held by the finalizer (the loop above purged those the store knew):
    // fenced now, the finalizer comes off when the controller reconciles them.
    for (namespace, uid) in deleting {
        engine.remove(&namespace, &uid).await?;
    }
    Ok(removed)
}

/// Purges and fences every subscription the store holds as live, within `covers`, whose uid
/// a full list (`listed`) did not show and whose object is gone (confirmed by a GET, which
/// the API server answers from its current state): the finalizer's cleanup never ran for
/// it, because someone removed the finalizer or herald was not watching. The GET keeps a
/// subscription created after the list was taken (and already stored, perhaps by another
/// replica) from being fenced. Returns how many were removed.
async fn remove_vanished(
    client: &kube::Client,
    engine: &Engine,
    covers: &(dyn Fn(&str) -> bool + Sync),
    listed: &HashSet<String>,
) -> anyhow::Result<u64> {
    let mut removed = 0;
    for record in engine.stored_subscriptions().await? {
        if !covers(&record.namespace) || listed.contains(&record.uid) {
            continue;
        }
        let api: Api<WebhookSubscription> = Api::namespaced(client.clone(), &record.namespace);
        let now = api.get_metadata_opt(&record.name).await?;
        if now.as_ref().and_then(|o| o.uid()).as_deref() == Some(record.uid.as_str()) {
            continue;
        }
        let purged = engine.remove(&record.namespace, &record.uid).await?;
        tracing::info!(namespace = %record.namespace, subscription = %record.name, purged, "subscription gone without herald's cleanup (deleted while herald was not watching, or its finalizer removed); its pending attempts are purged");
        removed += 1;
    }
    Ok(removed)
}

/// A Delete event: the object is gone, whether or not herald's finalizer ran (anyone who
/// may edit it may remove the finalizer). The purge-and-fence runs again (for an object
/// whose finalizer ran it finds nothing), retried until the store takes it.
fn remove_deleted(ctx: &Arc<Context>, namespace: String, uid: String, name: String) {
    let engine = ctx.engine.clone();
    tokio::spawn(async move {
        let mut delay = std::time::Duration::from_millis(200);
        loop {
            match engine.remove(&namespace, &uid).await {
                Ok(purged) => {
                    if purged > 0 {
                        tracing::info!(%namespace, subscription = %name, purged, "subscription deleted without herald's cleanup (its finalizer was removed); its pending attempts are purged");
                    }
                    return;
                }
                Err(e) => {
                    tracing::warn!(%namespace, subscription = %name, error = %e, "purging a deleted subscription failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(std::time::Duration::from_secs(10));
                }
            }
        }
    });
}

/// After a watch listed again: subscriptions that vanished while it was down (no Delete
/// event comes for them) are purged and fenced, in the background, retried until done.
fn sweep_after_relist(ctx: &Arc<Context>, namespace: Option<String>, listed: HashSet<String>) {
    let ctx = ctx.clone();
    tokio::spawn(async move {
        let covers = |ns: &str| namespace.as_deref().is_none_or(|n| n == ns);
        let mut delay = std::time::Duration::from_millis(500);
        loop {
            match remove_vanished(&ctx.client, &ctx.engine, &covers, &listed).await {
                Ok(_) => return,
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "checking for subscriptions deleted while the watch was down failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(std::time::Duration::from_secs(30));
                }
            }
        }
    });
}

/// Waits until every subscription of the first full list (`left`, their uids) has been
/// reconciled once, so that a replica reporting ready routes an event to every subscription
/// that existed when it started; after two minutes it stops waiting and says so.
async fn reconciled_once(mut left: Vec<String>, ctx: &Context) {
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

fn key_of<K: Resource>(obj: &K) -> Option<Key> {
    Some((obj.meta().namespace.clone()?, obj.meta().name.clone()?))
}

/// Runs the subscription watches (one per watched namespace, or one for all), the Secret
/// watches, and the reconciles they ask for, until the process ends. `synced` is told, per
/// watch, when every subscription of its first full list has been reconciled once.
pub async fn run_subscriptions(
    ctx: Arc<Context>,
    watches: kube::Client,
    scope: Scope,
    concurrency: u16,
    synced: tokio::sync::mpsc::UnboundedSender<()>,
) {
    let sweeper = ctx.clone();
    tokio::spawn(async move { sweeper.secrets.keep_swept().await });
    let queue = Arc::new(Queue::default());
    let secret_apis = scope.apis::<PartialObjectMeta<Secret>>(&watches);
    let (secrets_listed, mut lists) = tokio::sync::watch::channel(0usize);
    let secret_watches = secret_apis.len();
    let mut loops: Vec<futures::future::BoxFuture<'static, ()>> = Vec::new();
    for api in secret_apis {
        loops.push(watch_secrets(api, ctx.clone(), queue.clone(), secrets_listed.clone()).boxed());
    }
    let namespaces: Vec<Option<String>> = if scope.0.is_empty() {
        vec![None]
    } else {
        scope.0.iter().cloned().map(Some).collect()
    };
    for (api, namespace) in scope
        .apis::<WebhookSubscription>(&watches)
        .into_iter()
        .zip(namespaces)
    {
        loops.push(
            watch_subscriptions(api, namespace, ctx.clone(), queue.clone(), synced.clone()).boxed(),
        );
    }
    // Reconciles start once every Secret watch has its first list: a Secret that changes
    // after a reconcile read it then always arrives as a watch event.
    let (dispatch, dispatch_ctx) = (queue.clone(), ctx.clone());
    loops.push(
        async move {
            let wait = std::time::Duration::from_secs(30);
            let first = tokio::time::timeout(wait, lists.wait_for(|n| *n >= secret_watches))
                .await
                .map(|listed| listed.is_ok());
            let listed = match first {
                Ok(listed) => listed,
                Err(_) => {
                    tracing::warn!(
                        "no subscription is reconciled until every Secret watch has its first list, and after 30s one has not (may herald list and watch Secrets?)"
                    );
                    lists.wait_for(|n| *n >= secret_watches).await.is_ok()
                }
            };
            if listed {
                dispatch.run(dispatch_ctx, concurrency.into()).await;
            }
        }
        .boxed(),
    );
    futures::future::join_all(loops).await;
}

/// Watches WebhookSubscriptions: each event shows the status writer what the object shows,
/// and one that changed what a reconcile reads is queued with the object it carries.
async fn watch_subscriptions(
    api: Api<WebhookSubscription>,
    namespace: Option<String>,
    ctx: Arc<Context>,
    queue: Arc<Queue>,
    synced: tokio::sync::mpsc::UnboundedSender<()>,
) {
    // The uids of the first full list, until it is done.
    let mut first_list: Option<Vec<String>> = None;
    let mut listed = false;
    // Every uid of the list in progress (each relist), to find what vanished meanwhile.
    let mut listing: Option<HashSet<String>> = None;
    let mut events = watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    while let Some(event) = events.next().await {
        match event {
            Ok(watcher::Event::Init) => {
                if !listed {
                    first_list = Some(Vec::new());
                }
                listing = Some(HashSet::new());
            }
            Ok(watcher::Event::InitApply(mut obj) | watcher::Event::Apply(mut obj)) => {
                let Some(key) = key_of(&obj) else { continue };
                if let (Some(seen), Some(uid)) = (listing.as_mut(), obj.uid()) {
                    seen.insert(uid);
                }
                if let (Some(list), Some(uid)) = (first_list.as_mut(), obj.uid())
                    && obj.meta().deletion_timestamp.is_none()
                {
                    list.push(uid);
                }
                ctx.status.saw(&obj);
                trim_for_queue(&mut obj);
                // Herald's own status writes do not pass: they change nothing it reads.
                let changed = obj.uid().is_none_or(|uid| {
                    ctx.status
                        .changed_since_reconciled(&uid, reconcile_digest(&obj))
                });
                if changed {
                    queue.push(key, Some(Arc::new(obj)));
                }
            }
            Ok(watcher::Event::Delete(obj)) => {
                if let Some(key) = key_of(&obj) {
                    queue.remove(&key);
                    if let Some(uid) = obj.uid() {
                        ctx.status.forget(&uid);
                        remove_deleted(&ctx, key.0, uid, key.1);
                    }
                }
            }
            Ok(watcher::Event::InitDone) => {
                if let Some(seen) = listing.take() {
                    sweep_after_relist(&ctx, namespace.clone(), seen);
                }
                if let Some(uids) = first_list.take() {
                    listed = true;
                    let (ctx, synced) = (ctx.clone(), synced.clone());
                    tokio::spawn(async move {
                        reconciled_once(uids, &ctx).await;
                        let _ = synced.send(());
                    });
                }
            }
            Err(e) => tracing::warn!(error = %e, "watching WebhookSubscriptions; retrying"),
        }
    }
}

/// Watches Secrets (metadata only): a change of one re-reconciles the subscriptions that
/// reference it. Resource versions are remembered so that a watch that lists again does not
/// re-reconcile for Secrets that did not change.
async fn watch_secrets(
    api: Api<PartialObjectMeta<Secret>>,
    ctx: Arc<Context>,
    queue: Arc<Queue>,
    listed: tokio::sync::watch::Sender<usize>,
) {
    let mut versions: HashMap<Key, String> = HashMap::new();
    let mut first = true;
    let mut events = watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    while let Some(event) = events.next().await {
        let (secret, deleted) = match event {
            Ok(watcher::Event::Apply(s) | watcher::Event::InitApply(s)) => (s, false),
            Ok(watcher::Event::Delete(s)) => (s, true),
            Ok(watcher::Event::InitDone) => {
                if std::mem::take(&mut first) {
                    listed.send_modify(|n| *n += 1);
                }
                continue;
            }
            Ok(watcher::Event::Init) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "watching Secrets; retrying");
                continue;
            }
        };
        let Some(key) = key_of(&secret) else { continue };
        let changed = if deleted {
            versions.remove(&key).is_some()
        } else {
            let version = secret.metadata.resource_version.clone().unwrap_or_default();
            versions.insert(key.clone(), version.clone()) != Some(version)
        };
        if !changed {
            continue;
        }
        // Before the reconciles it starts, which must read the Secret again.
        ctx.secrets.changed(&key.0, &key.1);
        for subscription in ctx.status.referencing(&key.0, &key.1) {
            queue.push(subscription, None);
        }
    }
}

/// Applies WebhookQuotas to the engine: per namespace the oldest quota is in force, later
/// ones are marked superseded; removing the last one restores the default.
pub async fn run_quotas(
    client: kube::Client,
    watches: kube::Client,
    engine: Arc<Engine>,
    scope: Scope,
    synced: tokio::sync::mpsc::UnboundedSender<()>,
) {
    let mut loops = Vec::new();
    for api in scope.apis::<WebhookQuota>(&watches) {
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
    let Some(winner) = crate::api::quota::in_force(&keys) else {
        if applied.remove(namespace) {
            engine.set_quota(namespace, None, None, None);
            tracing::info!(namespace, "no WebhookQuota left; the default limits apply");
        }
        return;
    };
    let spec = &quotas[winner].spec;
    engine.set_quota(
        namespace,
        Some(spec.max_in_flight),
        Some(spec.max_pending_attempts),
        spec.max_stored_bytes,
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
    fn a_queued_object_keeps_only_herald_annotations_and_no_status() {
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
        trim_for_queue(&mut obj);
        let annotations: Vec<_> = obj.annotations().keys().collect();
        assert_eq!(annotations, ["herald.dev/reenable"]);
        assert!(obj.managed_fields().is_empty());
        assert_eq!(obj.finalizers(), ["herald.dev/purge"]);
        assert!(obj.status.is_none());
    }
}
