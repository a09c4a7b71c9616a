//! The engine: keeps the live subscriptions, asks the lane scheduler what may start, runs
//! each attempt as its own task, and wakes lanes when events arrive or retries fall due.
//! Pending work stays in the store; memory holds one small entry per subscription and one
//! per attempt on the wire. One lock (`Inner`) guards what the rooms below share:
//!
//! - `registry`: the subscriptions the engine runs, their lanes, and what changes them
//!   (upsert, remove, quotas, replay, re-enable, recovery after a restart);
//! - `publish`: admission of a publish (fair entry, quotas and the reservation held until
//!   the store answers), and idle lanes started with it;
//! - `dispatch`: the dispatcher (what the scheduler lets start, retry timers) and the
//!   graceful drain;
//! - `attempt`: one path for every attempt: claim, fence, send, decide, record, release;
//! - `fence`: the token an attempt carries from its claim to its record when replicas
//!   share the store;
//! - `replicas`: holding shards, following other replicas' new work, recounting;
//! - `reads`: reads through the API, bounded per namespace.

mod attempt;
mod dispatch;
mod fence;
mod publish;
mod reads;
mod registry;
mod replicas;
#[cfg(test)]
mod tests;

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use serde::Serialize;
use tokio::sync::{Notify, broadcast};

use super::SubscriptionConfig;
use super::admission::Admission;
use super::http::HttpSender;
use super::outcome::Outcome;
use super::pace::Pace;
use super::scheduler::Scheduler;
use super::shards::Ownership;
use crate::store::{self, Store, SubscriptionRecord, SubscriptionState};

pub use publish::{BatchEvent, Origin};
pub use reads::{READ_ROWS_BURST, READ_ROWS_PER_SECOND, READS_PER_NAMESPACE, STATE_TTL};

/// Engine-wide limits; every default is in `herald run --help`.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// The shared pool of attempts beyond each namespace's reserved floor.
    pub max_in_flight: u32,
    /// Attempts every namespace may start whatever the pool holds (capped by its quota).
    pub namespace_reserved_in_flight: u32,
    /// Publishes of one namespace waiting for the store at once; more answer 429.
    pub namespace_max_concurrent_publishes: u32,
    pub namespace_max_in_flight: u32,
    pub namespace_max_pending: u64,
    /// What a namespace's stored events may count ([`store::stored_cost`]) where no
    /// WebhookQuota says otherwise.
    pub namespace_max_stored_bytes: u64,
    /// Free space the store's disk keeps: no publish, of any namespace, is accepted into it,
    /// so that deliveries, their history and status can still be written however the
    /// namespaces' budgets add up (only where the store can tell its free space).
    pub store_reserve_bytes: u64,
    pub history_retention: Duration,
}

impl EngineConfig {
    /// Small limits for tests: 16 attempts at once, 100 pending per namespace, history
    /// kept a minute.
    pub fn small() -> Self {
        Self {
            max_in_flight: 16,
            namespace_reserved_in_flight: 16,
            namespace_max_concurrent_publishes: 64,
            namespace_max_in_flight: 16,
            namespace_max_pending: 100,
            namespace_max_stored_bytes: 1 << 40,
            store_reserve_bytes: 0,
            history_retention: Duration::from_secs(60),
        }
    }
}

/// The `namespace` label of `herald_events_published_total` for events published where no
/// subscription lives: one series for all of them, so the registry stays bounded by the
/// namespaces that hold subscriptions.
pub const UNROUTED_NAMESPACE: &str = "";

/// What happened, for logs and status writers.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum Notice {
    #[serde(rename_all = "camelCase")]
    Attempt {
        namespace: String,
        name: String,
        event_id: String,
        attempt: u32,
        /// When the request started (Unix ms): the line is written once the result is
        /// recorded, which may be much later (a slow store, a paused process).
        started_ms: i64,
        outcome: Outcome,
        status_code: Option<u16>,
        latency_ms: u64,
        next: &'static str,
        message: String,
    },
    /// A disabled subscription was re-enabled.
    #[serde(rename_all = "camelCase")]
    Enabled { namespace: String, name: String },
    /// An event was stored with a pending delivery for each of these subscriptions.
    #[serde(rename_all = "camelCase")]
    Published {
        namespace: String,
        subscriptions: Vec<String>,
    },
    #[serde(rename_all = "camelCase")]
    Disabled {
        namespace: String,
        name: String,
        consecutive_failures: u32,
    },
    /// The receiver asked to slow down (429, 502, 504): attempts start at most
    /// `per_second` a second until `until_ms` (Unix ms).
    #[serde(rename_all = "camelCase")]
    Slowed {
        namespace: String,
        name: String,
        status_code: u16,
        per_second: f64,
        until_ms: i64,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("no subscription {0}")]
    NotFound(String),
    #[error(
        "namespace {namespace} has {pending} pending attempts; {more} more would pass its limit of {limit}"
    )]
    QuotaExceeded {
        namespace: String,
        pending: u64,
        more: u64,
        limit: u64,
    },
    #[error(
        "namespace {namespace} stores {stored} bytes of events; this one ({more} bytes) would pass its maxStoredBytes of {limit}"
    )]
    StoredBytesExceeded {
        namespace: String,
        stored: u64,
        more: u64,
        limit: u64,
    },
    #[error(
        "the store's disk has {free} bytes free; herald keeps {reserve} of them for delivering what it holds, and accepts no event into them"
    )]
    StoreReserve { free: u64, reserve: u64 },
    #[error("subscription {0} is disabled; re-enable it first")]
    Disabled(String),
    #[error(
        "namespace {namespace} already has {limit} publishes waiting for the store; try again shortly"
    )]
    Busy { namespace: String, limit: u32 },
    #[error("namespace {namespace} {why}; try again in {retry_after}s")]
    ReadBusy {
        namespace: String,
        why: String,
        retry_after: u32,
    },
    #[error(transparent)]
    Store(#[from] store::Error),
}

/// Per subscription the maps below hold the uid, namespace and name of its config (shared
/// `Arc<str>`s, namespace names once per namespace), never copies.
struct Inner {
    scheduler: Scheduler,
    subs: HashMap<Arc<str>, Arc<SubscriptionConfig>>,
    by_namespace: HashMap<Arc<str>, BTreeSet<Arc<str>>>,
    /// namespace → name → uid.
    by_name: HashMap<Arc<str>, HashMap<Arc<str>, Arc<str>>>,
    timers: BinaryHeap<Reverse<(i64, String)>>,
    timer_at: HashMap<String, i64>,
    pending: HashMap<String, u64>,
    /// Subscriptions the store held pending work for at [`Engine::recover`] that had no lane
    /// yet (the operator adds lanes after recovering): woken when their lane is added.
    recovered: HashSet<String>,
    /// Per-namespace pending limits from WebhookQuota objects.
    pending_limits: HashMap<String, u64>,
    /// What each namespace's stored events count ([`store::stored_cost`]): the store's
    /// count at the last recount, plus what this process accepted since.
    stored: HashMap<String, u64>,
    /// Per-namespace byte budgets from WebhookQuota objects.
    stored_limits: HashMap<String, u64>,
    /// Publishes in progress per namespace (fair admission).
    admission: Admission,
    /// Reads through the API in progress per namespace ([`READS_PER_NAMESPACE`]).
    reads: Admission,
    /// Rows each namespace may still read through the API, and when that was reckoned
    /// ([`READ_ROWS_PER_SECOND`]).
    read_budgets: HashMap<String, (f64, std::time::Instant)>,
    /// Subscription states read through the API, by uid, for [`STATE_TTL`].
    states: HashMap<Arc<str>, (std::time::Instant, SubscriptionState)>,
    /// The paces of lanes with a rate limit or slowed down by their receiver; a lane with
    /// neither has none (and no cost).
    paces: HashMap<Arc<str>, Pace>,
}

impl Inner {
    /// Whether the lane's pace lets an attempt start now; otherwise when it will.
    fn pace_ready(&mut self, config: &SubscriptionConfig, now: i64) -> Result<(), i64> {
        match self.paces.get_mut(&*config.uid) {
            Some(pace) => pace.ready(now),
            None => Ok(()),
        }
    }

    /// Takes an attempt's start from the lane's pace; otherwise says when one will be there.
    fn take_pace(&mut self, config: &SubscriptionConfig, now: i64) -> Result<(), i64> {
        let pace = match self.paces.get_mut(&*config.uid) {
            Some(pace) => pace,
            None if config.rate_limit.is_some() => self
                .paces
                .entry(config.uid.clone())
                .or_insert_with(|| Pace::new(config.rate_limit, now)),
            None => return Ok(()),
        };
        let taken = pace.take(now);
        if config.rate_limit.is_none() && pace.is_free(now) {
            self.paces.remove(&*config.uid);
        }
        taken
    }

    /// The receiver asked the lane to slow down; returns the pace in force (attempts a
    /// second) and until when. `hint`: the rate the lane may have gone at, for a lane whose
    /// pace counted nothing yet.
    fn slow_down(&mut self, config: &SubscriptionConfig, now: i64, hint: f64) -> (f64, i64) {
        let pace = self
            .paces
            .entry(config.uid.clone())
            .or_insert_with(|| Pace::new(config.rate_limit, now));
        let rate = pace.slow_down(now, hint);
        (rate, now + crate::delivery::pace::SLOWED_FOR_MS)
    }

    fn add_timer(&mut self, uid: &str, at: i64) {
        if self.timer_at.get(uid).is_some_and(|&t| t <= at) {
            return;
        }
        self.timer_at.insert(uid.to_string(), at);
        self.timers.push(Reverse((at, uid.to_string())));
    }

    fn pending_sub(&mut self, namespace: &str, n: u64) {
        if let Some(p) = self.pending.get_mut(namespace) {
            *p = p.saturating_sub(n);
        }
    }
}

pub struct Engine {
    store: Arc<dyn Store>,
    sender: HttpSender,
    config: EngineConfig,
    inner: Mutex<Inner>,
    wakeup: Notify,
    notices: broadcast::Sender<Notice>,
    /// Set by [`Engine::drain`]: no new attempt starts.
    stopping: AtomicBool,
    /// Attempt tasks running, and a signal when one ends.
    running: AtomicUsize,
    finished: Notify,
    /// With several replicas: the shards this one may start attempts for.
    ownership: OnceLock<Arc<Ownership>>,
}

impl Engine {
    pub fn new(store: Arc<dyn Store>, sender: HttpSender, config: EngineConfig) -> Arc<Self> {
        let (notices, _) = broadcast::channel(4096);
        Arc::new(Self {
            store,
            sender,
            inner: Mutex::new(Inner {
                scheduler: Scheduler::new(
                    config.max_in_flight,
                    config.namespace_max_in_flight,
                    config.namespace_reserved_in_flight,
                ),
                subs: HashMap::new(),
                by_namespace: HashMap::new(),
                by_name: HashMap::new(),
                timers: BinaryHeap::new(),
                timer_at: HashMap::new(),
                pending: HashMap::new(),
                recovered: HashSet::new(),
                pending_limits: HashMap::new(),
                stored: HashMap::new(),
                stored_limits: HashMap::new(),
                admission: Admission::new(config.namespace_max_concurrent_publishes),
                reads: Admission::new(READS_PER_NAMESPACE),
                read_budgets: HashMap::new(),
                states: HashMap::new(),
                paces: HashMap::new(),
            }),
            config,
            wakeup: Notify::new(),
            notices,
            stopping: AtomicBool::new(false),
            running: AtomicUsize::new(0),
            finished: Notify::new(),
            ownership: OnceLock::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock is a bug; keep serving rather than poison forever.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Whether the store can commit (for /readyz): false after a write failed for want of
    /// space or I/O, until a synced commit succeeds again.
    /// Answers within a second (a probe's usual timeout): a store that cannot commit in that
    /// time counts as not healthy.
    pub async fn store_healthy(&self) -> bool {
        tokio::time::timeout(Duration::from_secs(1), self.store.check_writable())
            .await
            .is_ok_and(|r| r.is_ok())
    }

    pub fn notices(&self) -> broadcast::Receiver<Notice> {
        self.notices.subscribe()
    }

    /// Subscriptions the store holds as live, to match a configuration after a restart.
    pub async fn stored_subscriptions(&self) -> Result<Vec<SubscriptionRecord>, EngineError> {
        // Not the lanes of dead-letter sinks: the engine keeps those with their subscription.
        Ok(self
            .store
            .live_subscriptions()
            .await?
            .into_iter()
            .filter(|s| !s.uid.ends_with(crate::delivery::SINK_SUFFIX))
            .collect())
    }

    /// An engine for unit tests: small limits, egress to loopback only.
    #[cfg(test)]
    pub(crate) fn for_tests(store: Arc<dyn Store>) -> Arc<Self> {
        Self::new(
            store,
            HttpSender::new(crate::delivery::egress::EgressPolicy::new(vec![
                "127.0.0.0/8".parse().unwrap(),
            ]))
            .unwrap(),
            EngineConfig::small(),
        )
    }

    /// Pending and in-flight attempts and quota waits per namespace, for `/metrics`.
    pub fn metrics_snapshot(&self) -> crate::metrics::Snapshot {
        let inner = self.lock();
        let mut namespaces: HashMap<&str, (u64, u64, u64)> = HashMap::new();
        for (namespace, pending) in &inner.pending {
            namespaces.entry(namespace).or_default().0 = *pending;
        }
        for (namespace, in_flight, waits) in inner.scheduler.namespace_stats() {
            let entry = namespaces.entry(namespace).or_default();
            entry.1 = in_flight as u64;
            entry.2 = waits;
        }
        crate::metrics::Snapshot {
            namespaces: namespaces
                .into_iter()
                .map(|(ns, (p, f, w))| (ns.to_string(), p, f, w))
                .collect(),
        }
    }
}
