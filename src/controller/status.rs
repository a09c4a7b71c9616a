//! Writing what herald observed: status (server-side apply on the status subresource, field
//! manager `herald`) and Kubernetes Events. Delivery activity never writes status directly:
//! attempts only mark a subscription dirty, and the flusher writes a dirty subscription at
//! most once per `--status-interval` (an auto-disable within a second). So under any load a
//! subscription costs at most one status write per interval, plus one per reconcile whose
//! outcome changes the status.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use super::conditions::{Announcement, Facts, Problem, subscription_status};
use super::events::{EventWriter, Note};
use super::shown::{Shown, digest as status_digest};
use crate::api::{LastAttempt, WebhookQuota, WebhookSubscription};
use crate::delivery::{Engine, Notice};

/// The field manager of every write herald makes.
pub const FIELD_MANAGER: &str = "herald";

/// What herald keeps per subscription: what the status is computed from (the last reconcile's
/// findings, and what the object shows), and a digest of what was last written. Recorded
/// when the watch first sees the object; the spec is not kept.
/// The namespace and name are shared: the namespace with the book's other entries, the name
/// (like the uid, the book's key) with the engine's config of the subscription.
#[derive(Clone, Debug, Default)]
pub struct Entry {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
    pub generation: Option<i64>,
    pub paused: bool,
    pub disable_after: u32,
    /// Boxed: most subscriptions have none.
    pub problem: Option<Box<Problem>>,
    pub reenable_handled: Option<Box<str>>,
    /// The Secrets the spec names, to find the subscriptions a Secret change concerns.
    pub secrets: Box<[Box<str>]>,
    /// A digest of the spec and secrets the engine runs, to skip unchanged upserts.
    pub applied: Option<[u8; 32]>,
    /// The object's `reconcile_digest` at this reconcile.
    pub reconciled: Option<u64>,
    /// Boxed: most subscriptions are idle, and a LastAttempt is about a hundred bytes.
    pub(super) last_attempt: Option<Box<LastAttempt>>,
    /// What the object shows now (from the watch), None while it shows no status.
    pub(super) shown: Option<Shown>,
    /// A digest of the status herald last wrote, and when.
    pub(super) written: Option<(u64, Instant)>,
    pub(super) dirty: bool,
    pub(super) urgent: bool,
}

#[derive(Default)]
struct Book {
    /// Boxed: a table keeps up to twice as many slots as entries, and an Entry is hundreds
    /// of bytes. Keyed by uid, shared with the engine.
    entries: HashMap<Arc<str>, Box<Entry>>,
    /// One copy of each namespace name the entries hold, and how many hold it.
    namespaces: HashMap<Arc<str>, u32>,
    /// Subscriptions whose status is being written. One write per subscription at a time:
    /// a reconcile's write and the flush loop's could otherwise both compute a status and
    /// land in either order, the older view last (a subscription paused just then kept
    /// showing Ready after its Paused status was written).
    writing: HashSet<Arc<str>>,
}

/// A subscription's status write in progress, until dropped.
struct Writing<'a> {
    writer: &'a StatusWriter,
    uid: Arc<str>,
}

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        self.writer.book().writing.remove(&self.uid);
    }
}

impl Book {
    /// The entries' copy of a namespace name (a new one for a namespace no entry is in).
    fn namespace(&self, name: &str) -> Arc<str> {
        self.namespaces
            .get_key_value(name)
            .map_or_else(|| Arc::from(name), |(shared, _)| shared.clone())
    }

    fn insert(&mut self, uid: Arc<str>, entry: Box<Entry>) {
        *self.namespaces.entry(entry.namespace.clone()).or_default() += 1;
        if let Some(old) = self.entries.insert(uid, entry) {
            self.uncount(&old.namespace);
        }
    }

    fn remove(&mut self, uid: &str) -> Option<Box<Entry>> {
        let entry = self.entries.remove(uid)?;
        self.uncount(&entry.namespace);
        Some(entry)
    }

    fn uncount(&mut self, namespace: &str) {
        if let Some(count) = self.namespaces.get_mut(namespace) {
            *count -= 1;
            if *count == 0 {
                self.namespaces.remove(namespace);
            }
        }
    }
}

pub struct StatusWriter {
    client: kube::Client,
    engine: Arc<Engine>,
    events: EventWriter,
    interval: Duration,
    book: Mutex<Book>,
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
    /// `instance`: this replica's name (its pod's), which its Events name as their reporter.
    pub fn new(
        client: kube::Client,
        engine: Arc<Engine>,
        interval: Duration,
        instance: Option<String>,
    ) -> Arc<Self> {
        Arc::new(Self {
            events: EventWriter::new(client.clone(), "herald", instance),
            client,
            engine,
            interval,
            book: Mutex::new(Book::default()),
        })
    }

    fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a reconcile has recorded the subscription.
    pub fn knows(&self, uid: &str) -> bool {
        self.book()
            .entries
            .get(uid)
            .is_some_and(|e| e.reconciled.is_some())
    }

    /// Records the status a watched object shows, before the object is trimmed of it. An
    /// object being deleted is not added (its cleanup may never come to forget it).
    pub fn saw(&self, obj: &WebhookSubscription) {
        let (Some(uid), Some(namespace), Some(name)) = (
            obj.metadata.uid.as_deref(),
            obj.metadata.namespace.as_deref(),
            obj.metadata.name.as_deref(),
        ) else {
            return;
        };
        let shown = obj.status.as_ref().map(Shown::of);
        let mut book = self.book();
        match book.entries.get_mut(uid) {
            Some(entry) => entry.shown = shown,
            None if obj.metadata.deletion_timestamp.is_none() => {
                let namespace = book.namespace(namespace);
                book.insert(
                    Arc::from(uid),
                    Box::new(Entry {
                        namespace,
                        name: Arc::from(name),
                        shown,
                        ..Default::default()
                    }),
                );
            }
            None => {}
        }
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

    /// The subscription's uid, namespace and name as the book holds them, to share with
    /// the engine rather than copy (made when the book has no entry, or another name).
    pub fn identity(&self, uid: &str, namespace: &str, name: &str) -> [Arc<str>; 3] {
        let book = self.book();
        let (uid, known_name) = match book.entries.get_key_value(uid) {
            Some((uid, entry)) => (uid.clone(), Some(entry.name.clone())),
            None => (Arc::from(uid), None),
        };
        let name = known_name
            .filter(|known| **known == *name)
            .unwrap_or_else(|| Arc::from(name));
        [uid, book.namespace(namespace), name]
    }

    /// Records a reconcile's findings. Until herald has seen an attempt of its own, the
    /// last attempt is the one the object shows (for example after a restart).
    pub fn observe(&self, uid: Arc<str>, entry: Entry) {
        let mut book = self.book();
        let old = book.remove(&uid).map(|old| *old).unwrap_or_default();
        let merged = Entry {
            last_attempt: old
                .last_attempt
                .or_else(|| old.shown.as_ref().and_then(|s| s.last_attempt.clone())),
            shown: old.shown,
            written: old.written,
            ..entry
        };
        book.insert(uid, Box::new(merged));
    }

    /// The reconciled subscriptions whose spec names this Secret.
    pub fn referencing(&self, namespace: &str, secret: &str) -> Vec<(String, String)> {
        self.book()
            .entries
            .values()
            .filter(|e| {
                e.reconciled.is_some()
                    && *e.namespace == *namespace
                    && e.secrets.iter().any(|s| &**s == secret)
            })
            .map(|e| (e.namespace.to_string(), e.name.to_string()))
            .collect()
    }

    /// Stops tracking a subscription (its object is gone).
    pub fn forget(&self, uid: &str) {
        self.book().remove(uid);
    }

    /// Computes the subscription's status from what is known now and writes it if it
    /// changed; then records the Events the change deserves.
    pub async fn write(&self, uid: &str) -> Result<(), kube::Error> {
        let reconciled = |book: &Book| {
            book.entries
                .get(uid)
                .is_some_and(|e| e.reconciled.is_some())
        };
        if !reconciled(&self.book()) {
            return Ok(());
        }
        // With several replicas, only the one delivering for the shard writes its status;
        // the others keep it dirty, to write should the shard become theirs.
        let shard = self.engine.shard_of(uid);
        if shard.is_some() && !self.engine.holds_shard_of(uid) {
            if let Some(e) = self.book().entries.get_mut(uid) {
                e.dirty = true;
            }
            return Ok(());
        }
        // One write at a time: a write already on its way leaves this one to the flush
        // loop, which computes the status again from what is known then.
        let _writing = {
            let mut book = self.book();
            let Some(key) = book.entries.get_key_value(uid).map(|(k, _)| k.clone()) else {
                return Ok(());
            };
            if !reconciled(&book) {
                return Ok(());
            }
            if !book.writing.insert(key.clone()) {
                if let Some(e) = book.entries.get_mut(uid) {
                    e.dirty = true;
                    e.urgent = true;
                }
                return Ok(());
            }
            Writing {
                writer: self,
                uid: key,
            }
        };
        // What is known now, read once this write holds its turn: a view taken before could
        // be older than what a write that just finished wrote.
        let Some(entry) = self.entry(uid) else {
            return Ok(());
        };
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
        // The URL as the engine runs it; not kept in the book, where it would be a second copy.
        let config = self.engine.config(uid);
        let facts = Facts {
            namespace: &entry.namespace,
            name: &entry.name,
            generation: entry.generation,
            url: config.as_ref().map_or("", |c| &*c.url),
            paused: entry.paused,
            disable_after: entry.disable_after,
            problem: entry.problem.as_deref(),
            state: state.as_ref(),
            last_attempt: entry.last_attempt.as_deref(),
            reenable_handled: entry.reenable_handled.as_deref(),
            shard,
            slowed: self.engine.slowed(uid),
        };
        // Computed from what the object shows, so that conditions keep their transition
        // times across restarts and shard moves. Just after a write the watch may not show
        // it yet: for a while the digest stops the same status being written (and announced)
        // twice. Only for a while: another replica may write the status after this one.
        let shown = entry.shown.as_ref();
        let previous = shown.map(Shown::as_previous);
        let (status, announcements) =
            subscription_status(&facts, previous.as_ref(), Timestamp::now());
        let digest = status_digest(&status);
        let just_written = entry
            .written
            .is_some_and(|(written, at)| written == digest && at.elapsed() < self.interval);
        if shown.is_some_and(|s| s.digest == digest) || just_written {
            return Ok(());
        }
        let api: Api<WebhookSubscription> = Api::namespaced(self.client.clone(), &entry.namespace);
        let patch = json!({
            "apiVersion": format!("{}/{}", crate::api::GROUP, crate::api::VERSION),
            "kind": "WebhookSubscription",
            // The uid makes the write conditional: a new object of the same name is not
            // given the old one's status.
            "metadata": {"name": &*entry.name, "uid": uid},
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
        self.mark(uid, |e| e.written = Some((digest, Instant::now())));
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
                    // Notices name subscriptions; the engine knows their uids.
                    let Ok(uid) = self.engine.uid_of(&namespace, &name) else {
                        continue;
                    };
                    if let Some(entry) = self.book().entries.get_mut(&*uid) {
                        entry.last_attempt = Some(Box::new(LastAttempt {
                            time: Time(
                                Timestamp::from_second(Timestamp::now().as_second())
                                    .unwrap_or_else(|_| Timestamp::now()),
                            ),
                            outcome: outcome.as_str().into(),
                            status_code,
                            latency_ms: Some(latency_ms),
                            message: (!message.is_empty()).then_some(message),
                        }));
                        entry.dirty = true;
                    }
                }
                Ok(Notice::Published { subscriptions, .. }) => {
                    let mut book = self.book();
                    for uid in subscriptions {
                        if let Some(entry) = book.entries.get_mut(uid.as_str()) {
                            entry.dirty = true;
                        }
                    }
                }
                Ok(
                    Notice::Disabled {
                        namespace, name, ..
                    }
                    | Notice::Slowed {
                        namespace, name, ..
                    }
                    | Notice::Enabled { namespace, name },
                ) => {
                    if let Ok(uid) = self.engine.uid_of(&namespace, &name)
                        && let Some(entry) = self.book().entries.get_mut(&*uid)
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
            let due: Vec<Arc<str>> = self
                .book()
                .entries
                .iter()
                .filter(|(uid, e)| {
                    e.dirty
                        && e.reconciled.is_some()
                        && self.engine.holds_shard_of(uid)
                        && (e.urgent
                            || e.written
                                .is_none_or(|(_, at)| now.duration_since(at) >= self.interval))
                })
                .map(|(uid, _)| uid.clone())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::delivery::SubscriptionConfig;
    use crate::store::sqlite::SqliteStore;

    fn object(uid: &str, name: &str) -> WebhookSubscription {
        let spec = serde_json::from_value(json!({
            "url": "http://127.0.0.1:9/hook",
            "eventTypes": ["*"],
            "signing": {"secretRef": {"name": "s", "key": "k"}},
        }))
        .unwrap();
        let mut obj = WebhookSubscription::new(name, spec);
        obj.metadata.namespace = Some("shop".into());
        obj.metadata.uid = Some(uid.into());
        obj
    }

    /// What the book keeps per subscription is not a second copy of what the engine keeps.
    #[tokio::test]
    async fn the_book_shares_uid_and_name_with_the_engine_and_keeps_one_namespace_copy() {
        let dir = std::env::temp_dir().join(format!("herald-book-{}", uuid::Uuid::now_v7()));
        std::fs::create_dir_all(&dir).unwrap();
        let engine = Engine::for_tests(Arc::new(SqliteStore::open(&dir).unwrap()));
        let nowhere = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let client = kube::Client::try_from(nowhere).unwrap();
        let writer = StatusWriter::new(client, engine.clone(), Duration::from_secs(5), None);
        for (uid, name) in [("uid-a", "a"), ("uid-b", "b")] {
            let obj = object(uid, name);
            writer.saw(&obj);
            let [uid, namespace, name] = writer.identity(uid, "shop", name);
            let secret = Ok(vec!["whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYX".into()]);
            let config = SubscriptionConfig::from_spec(
                uid.clone(),
                namespace.clone(),
                name.clone(),
                &obj.spec,
                secret,
            )
            .unwrap();
            engine.upsert(config).await.unwrap();
            let entry = Entry {
                namespace,
                name,
                reconciled: Some(1),
                ..Default::default()
            };
            writer.observe(uid, entry);
        }
        {
            let book = writer.book();
            let config = engine.config("uid-a").unwrap();
            let (uid, entry) = book.entries.get_key_value("uid-a").unwrap();
            assert!(Arc::ptr_eq(uid, &config.uid), "the uid is copied");
            assert!(Arc::ptr_eq(&entry.name, &config.name), "the name is copied");
            let other = &book.entries["uid-b"];
            assert!(Arc::ptr_eq(&entry.namespace, &other.namespace));
        }
        writer.forget("uid-a");
        assert_eq!(writer.book().namespaces.len(), 1, "shop still has uid-b");
        writer.forget("uid-b");
        assert!(
            writer.book().namespaces.is_empty(),
            "an empty namespace is kept"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}
