//! Writing what herald observed: status (server-side apply on the status subresource, field
//! manager `herald`) and Kubernetes Events. Delivery activity never writes status directly:
//! attempts only mark a subscription dirty, and the flusher writes a dirty subscription at
//! most once per `--status-interval` (an auto-disable within a second). So under any load a
//! subscription costs at most one status write per interval, plus one per reconcile whose
//! outcome changes the status.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use serde_json::json;

use super::conditions::{Announcement, Facts, Problem, subscription_status};
use super::events::{EventWriter, Note};
use crate::api::{LastAttempt, WebhookQuota, WebhookSubscription, WebhookSubscriptionStatus};
use crate::delivery::{Engine, Notice};

/// The field manager of every write herald makes.
pub const FIELD_MANAGER: &str = "herald";

/// What herald keeps per subscription between reconciles: what the status is computed from,
/// and a digest of what was last written. Small and fixed in size; neither the spec nor the
/// status is kept (the watch cache has both).
#[derive(Clone, Debug, Default)]
pub struct Entry {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub generation: Option<i64>,
    pub url: String,
    pub paused: bool,
    pub disable_after: u32,
    pub problem: Option<Problem>,
    pub reenable_handled: Option<String>,
    /// A digest of the spec and secrets the engine runs, to skip unchanged upserts.
    pub applied: Option<[u8; 32]>,
    /// The object's `reconcile_digest` at this reconcile.
    pub reconciled: Option<u64>,
    pub(super) last_attempt: Option<LastAttempt>,
    /// A digest of the status herald last wrote. The status itself is not kept here: the
    /// watch cache holds the object as the API server has it, status included.
    pub(super) written: Option<u64>,
    pub(super) written_at: Option<Instant>,
    pub(super) dirty: bool,
    pub(super) urgent: bool,
}

#[derive(Default)]
struct Book {
    /// Boxed: a table keeps up to twice as many slots as entries, and an Entry is hundreds
    /// of bytes.
    entries: HashMap<String, Box<Entry>>,
    by_name: HashMap<(String, String), String>,
}

pub struct StatusWriter {
    client: kube::Client,
    engine: Arc<Engine>,
    events: EventWriter,
    interval: Duration,
    book: Mutex<Book>,
    /// The controllers' watch caches (one per watched namespace, or one for all): the
    /// status each subscription shows now, which the next one is computed from.
    caches: RwLock<Vec<Store<WebhookSubscription>>>,
}

fn reference(namespace: &str, name: &str, uid: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some(format!("{}/{}", crate::api::GROUP, crate::api::VERSION)),
        kind: Some("WebhookSubscription".into()),
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        uid: Some(uid.into()),
        ..Default::default()
    }
}

impl StatusWriter {
    pub fn new(client: kube::Client, engine: Arc<Engine>, interval: Duration) -> Arc<Self> {
        Arc::new(Self {
            events: EventWriter::new(client.clone(), "herald", std::env::var("POD_NAME").ok()),
            client,
            engine,
            interval,
            book: Mutex::new(Book::default()),
            caches: RwLock::default(),
        })
    }

    /// Reads the status subscriptions show from this watch cache.
    pub fn read_from(&self, cache: Store<WebhookSubscription>) {
        self.caches
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push(cache);
    }

    /// The status the object shows now, if the watch cache has this object (same uid).
    fn shown(&self, namespace: &str, name: &str, uid: &str) -> Option<WebhookSubscriptionStatus> {
        let key = ObjectRef::new(name).within(namespace);
        let caches = self.caches.read().unwrap_or_else(|e| e.into_inner());
        caches
            .iter()
            .find_map(|cache| cache.get(&key))
            .filter(|obj| obj.metadata.uid.as_deref() == Some(uid))
            .and_then(|obj| obj.status.clone())
    }

    fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a reconcile has recorded the subscription.
    pub fn knows(&self, uid: &str) -> bool {
        self.book().entries.contains_key(uid)
    }

    /// Whether a watched object changed, in what its reconcile reads, since it was last
    /// reconciled (always, for one not reconciled yet).
    pub fn changed_since_reconciled(&self, uid: &str, digest: u64) -> bool {
        self.book()
            .entries
            .get(uid)
            .is_none_or(|e| e.reconciled != Some(digest))
    }

    /// What was known of the subscription before this reconcile (None the first time).
    pub fn entry(&self, uid: &str) -> Option<Entry> {
        self.book().entries.get(uid).map(|e| Entry::clone(e))
    }

    /// Records a reconcile's findings. `current` is the status the object carries; the
    /// first time herald sees it (for example after a restart) its last attempt is kept.
    pub fn observe(&self, entry: Entry, current: Option<&WebhookSubscriptionStatus>) {
        let mut book = self.book();
        let key = (entry.namespace.clone(), entry.name.clone());
        let uid = entry.uid.clone();
        let merged = match book.entries.remove(&uid).map(|old| *old) {
            Some(old) => Entry {
                last_attempt: old.last_attempt,
                written: old.written,
                written_at: old.written_at,
                ..entry
            },
            None => Entry {
                last_attempt: current.and_then(|s| s.last_attempt.clone()),
                ..entry
            },
        };
        if let Some(previous) = book.by_name.insert(key, uid.clone())
            && previous != uid
        {
            // Same name, new object: the old one is gone.
            book.entries.remove(&previous);
        }
        book.entries.insert(uid, Box::new(merged));
    }

    /// Stops tracking a subscription (its object is gone).
    pub fn forget(&self, uid: &str) {
        let mut book = self.book();
        if let Some(entry) = book.entries.remove(uid) {
            let key = (entry.namespace, entry.name);
            if book.by_name.get(&key).is_some_and(|u| u == uid) {
                book.by_name.remove(&key);
            }
        }
    }

    /// Computes the subscription's status from what is known now and writes it if it
    /// changed; then records the Events the change deserves.
    pub async fn write(&self, uid: &str) -> Result<(), kube::Error> {
        let Some(entry) = self.entry(uid) else {
            return Ok(());
        };
        // With several replicas, only the one delivering for the shard writes its status;
        // the others keep it dirty, to write should the shard become theirs.
        let shard = self.engine.shard_of(uid);
        if shard.is_some() && !self.engine.holds_shard_of(uid) {
            if let Some(e) = self.book().entries.get_mut(uid) {
                e.dirty = true;
            }
            return Ok(());
        }
        // Clear the flag before reading the store, so activity meanwhile marks it again.
        if let Some(e) = self.book().entries.get_mut(uid) {
            e.dirty = false;
            e.urgent = false;
        }
        let state = match self.engine.store().subscription_state(uid).await {
            Ok(state) => state,
            Err(e) => {
                tracing::warn!(error = %e, namespace = %entry.namespace, subscription = %entry.name, "cannot read the store for status; keeping the counters");
                None
            }
        };
        let facts = Facts {
            namespace: &entry.namespace,
            name: &entry.name,
            generation: entry.generation,
            url: &entry.url,
            paused: entry.paused,
            disable_after: entry.disable_after,
            problem: entry.problem.as_ref(),
            state: state.as_ref(),
            last_attempt: entry.last_attempt.as_ref(),
            reenable_handled: entry.reenable_handled.as_deref(),
            shard,
        };
        // Computed from what the object shows, so that conditions keep their transition
        // times across restarts and shard moves. Just after a write the cache may not show
        // it yet: for a while the digest stops the same status being written (and announced)
        // twice. Only for a while: another replica may write the status after this one.
        let shown = self.shown(&entry.namespace, &entry.name, uid);
        let (status, announcements) = subscription_status(&facts, shown.as_ref(), Timestamp::now());
        let digest = status_digest(&status);
        let just_written = entry.written == Some(digest)
            && entry
                .written_at
                .is_some_and(|at| at.elapsed() < self.interval);
        if shown.as_ref() == Some(&status) || just_written {
            return Ok(());
        }
        let api: Api<WebhookSubscription> = Api::namespaced(self.client.clone(), &entry.namespace);
        let patch = json!({
            "apiVersion": format!("{}/{}", crate::api::GROUP, crate::api::VERSION),
            "kind": "WebhookSubscription",
            // The uid makes the write conditional: a new object of the same name is not
            // given the old one's status.
            "metadata": {"name": entry.name, "uid": entry.uid},
            "status": status,
        });
        let params = PatchParams::apply(FIELD_MANAGER).force();
        match api
            .patch_status(&entry.name, &params, &Patch::Apply(&patch))
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {
                tracing::debug!(namespace = %entry.namespace, subscription = %entry.name, "object gone or replaced; its status is not written");
                self.forget(uid);
                return Ok(());
            }
            Err(e) => {
                self.mark(uid, |e| e.dirty = true);
                return Err(e);
            }
        }
        crate::metrics::get().status_writes.inc();
        self.mark(uid, |e| {
            e.written = Some(digest);
            e.written_at = Some(Instant::now());
        });
        for announcement in announcements {
            self.announce(&entry.namespace, &entry.name, uid, announcement)
                .await;
        }
        Ok(())
    }

    fn mark(&self, uid: &str, f: impl FnOnce(&mut Entry)) {
        if let Some(entry) = self.book().entries.get_mut(uid) {
            f(entry);
        }
    }

    /// Records a Kubernetes Event on the subscription. Failing to record one (the namespace
    /// is being deleted, the API server is away) is logged and never blocks anything.
    pub async fn announce(&self, namespace: &str, name: &str, uid: &str, what: Announcement) {
        tracing::info!(namespace, subscription = name, reason = what.reason, note = %what.note, "event");
        let note = Note {
            warning: what.warning,
            reason: what.reason,
            action: "Reconcile",
            note: &what.note,
        };
        if let Err(e) = self
            .events
            .write(reference(namespace, name, uid), &note)
            .await
        {
            tracing::debug!(error = %e, namespace, subscription = name, "could not record an Event");
        }
    }

    /// Turns delivery notices into dirty marks, and writes what is due, until the process
    /// ends.
    pub fn spawn(self: &Arc<Self>) {
        let marker = self.clone();
        tokio::spawn(async move { marker.follow_notices().await });
        let flusher = self.clone();
        tokio::spawn(async move { flusher.flush_loop().await });
    }

    async fn follow_notices(&self) {
        let mut notices = self.engine.notices();
        loop {
            match notices.recv().await {
                Ok(Notice::Attempt {
                    namespace,
                    name,
                    outcome,
                    status_code,
                    latency_ms,
                    message,
                    ..
                }) => {
                    let mut book = self.book();
                    let Some(uid) = book.by_name.get(&(namespace, name)).cloned() else {
                        continue;
                    };
                    if let Some(entry) = book.entries.get_mut(&uid) {
                        entry.last_attempt = Some(LastAttempt {
                            time: Time(
                                Timestamp::from_second(Timestamp::now().as_second())
                                    .unwrap_or_else(|_| Timestamp::now()),
                            ),
                            outcome: outcome.as_str().into(),
                            status_code,
                            latency_ms: Some(latency_ms),
                            message: (!message.is_empty()).then_some(message),
                        });
                        entry.dirty = true;
                    }
                }
                Ok(Notice::Published { subscriptions, .. }) => {
                    let mut book = self.book();
                    for uid in subscriptions {
                        if let Some(entry) = book.entries.get_mut(&uid) {
                            entry.dirty = true;
                        }
                    }
                }
                Ok(
                    Notice::Disabled {
                        namespace, name, ..
                    }
                    | Notice::Enabled { namespace, name },
                ) => {
                    let mut book = self.book();
                    if let Some(uid) = book.by_name.get(&(namespace, name)).cloned()
                        && let Some(entry) = book.entries.get_mut(&uid)
                    {
                        entry.dirty = true;
                        entry.urgent = true;
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                    // Notices were missed: every subscription may have changed.
                    self.book()
                        .entries
                        .values_mut()
                        .for_each(|e| e.dirty = true);
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            }
        }
    }

    async fn flush_loop(&self) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let now = Instant::now();
            let due: Vec<String> = self
                .book()
                .entries
                .values()
                .filter(|e| {
                    e.dirty
                        && self.engine.holds_shard_of(&e.uid)
                        && (e.urgent
                            || e.written_at
                                .is_none_or(|at| now.duration_since(at) >= self.interval))
                })
                .map(|e| e.uid.clone())
                .collect();
            for chunk in due.chunks(16) {
                let writes = chunk.iter().map(|uid| self.write(uid));
                for result in futures::future::join_all(writes).await {
                    if let Err(e) = result {
                        tracing::debug!(error = %e, "status write failed; retrying later");
                    }
                }
            }
        }
    }
}

fn status_digest(status: &WebhookSubscriptionStatus) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    serde_json::to_vec(status)
        .unwrap_or_default()
        .hash(&mut hasher);
    hasher.finish()
}

/// Writes a WebhookQuota's status when it differs from what the object shows.
pub async fn write_quota_status(
    client: &kube::Client,
    quota: &WebhookQuota,
    in_force: bool,
    winner: &str,
) -> Result<(), kube::Error> {
    use crate::api::conditions::{self, Status, types};
    let Some(namespace) = quota.metadata.namespace.as_deref() else {
        return Ok(());
    };
    let name = quota.metadata.name.clone().unwrap_or_default();
    let current = quota.status.clone().unwrap_or_default();
    let mut status = current.clone();
    let generation = quota.metadata.generation;
    if in_force {
        conditions::set(
            &mut status.conditions,
            types::READY,
            Status::True,
            "InForce",
            format!(
                "limits the namespace to {} attempts in flight and {} pending",
                quota.spec.max_in_flight, quota.spec.max_pending_attempts
            ),
            generation,
            Timestamp::now(),
        );
    } else {
        conditions::set(
            &mut status.conditions,
            types::READY,
            Status::False,
            "Superseded",
            format!(
                "WebhookQuota {winner} is older and in force; only one quota per namespace applies. Delete this one or {winner}."
            ),
            generation,
            Timestamp::now(),
        );
    }
    status.observed_generation = generation;
    if status == current {
        return Ok(());
    }
    let api: Api<WebhookQuota> = Api::namespaced(client.clone(), namespace);
    let patch = json!({
        "apiVersion": format!("{}/{}", crate::api::GROUP, crate::api::VERSION),
        "kind": "WebhookQuota",
        "metadata": {"name": name, "uid": quota.metadata.uid},
        "status": status,
    });
    api.patch_status(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    Ok(())
}
