//! The engine: keeps the live subscriptions, asks the lane scheduler what may start, runs
//! each attempt as its own task (claim in the store, POST, record), and wakes lanes when
//! events arrive or retries fall due. Pending work stays in the store; memory holds one
//! small entry per subscription and one per attempt on the wire.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use super::clock::now_ms;

use serde::Serialize;
use serde_json::value::RawValue;
use tokio::sync::{Notify, broadcast};
use tracing::Instrument;

use super::SubscriptionConfig;
use super::admission::Admission;
use super::http::{HttpSender, Target};
use super::outcome::Outcome;
use super::retry::{self, Decision};
use super::scheduler::Scheduler;
use super::shards::Ownership;
use crate::store::{
    self, AttemptRecord, Claim, Claimed, DeliveryView, NewEvent, NewWorkFeed, Next, PublishResult,
    ShardFence, StateFilter, Store, SubscriptionRecord, SubscriptionState,
};

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

/// The `namespace` label of `herald_events_published_total` for events published where no
/// subscription lives: one series for all of them, so the registry stays bounded by the
/// namespaces that hold subscriptions.
pub const UNROUTED_NAMESPACE: &str = "";

/// With several replicas: how often each takes its count of pending attempts per namespace
/// from the store again.
const PENDING_RECOUNT: Duration = Duration::from_secs(2);

/// The pause before the next recount: [`PENDING_RECOUNT`], or twenty times what the last
/// one took, so that counting a large backlog (1,000,000 pending on PostgreSQL: about
/// 230 ms, a scan of every unfinished delivery) keeps to a twentieth of the time.
fn recount_wait(took: Duration) -> Duration {
    PENDING_RECOUNT.max(took.saturating_mul(20))
}

/// How often each namespace's stored bytes are taken from the store again (pruning frees
/// them, other replicas add theirs), or twenty times what the last count took.
const STORED_RECOUNT: Duration = Duration::from_secs(10);

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
}

/// Reads through the API (a subscription's state, its deliveries, an event's attempts) one
/// namespace may have in progress at once; more are answered 429 `read_busy` at once. Reads
/// run beside the writing path, not in it, and this keeps one tenant's from taking every
/// reader.
pub const READS_PER_NAMESPACE: u32 = 2;
/// Rows a namespace may read through the API a second (a read costs the rows it returned,
/// and at least 1), beyond a burst of [`READ_ROWS_BURST`]: what answering reads costs
/// herald (the rows, their JSON) is bounded per namespace, whatever size of page it asks
/// for. A read is admitted while the namespace's budget is not spent, and charged when it
/// has been answered; once spent (a read may overdraw it by its page): 429 `read_busy`,
/// with the seconds until it refills in `Retry-After`.
pub const READ_ROWS_PER_SECOND: f64 = 1_000.0;
/// One second's worth: a read is admitted while any budget is left, so a page of any size
/// (up to 10,000) still goes through, overdrawing it.
pub const READ_ROWS_BURST: f64 = 1_000.0;
/// How long a subscription's state (its counters and the counts of its backlog, which cost
/// in proportion to the backlog) read through the API is answered again without asking the
/// store.
pub const STATE_TTL: Duration = Duration::from_secs(1);

impl Inner {
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

/// A lane started with a publish.
struct Prestart {
    config: Arc<SubscriptionConfig>,
    /// With several replicas: the shard's hold its claim is fenced by.
    fenced: Option<(Arc<Ownership>, ShardFence)>,
    /// The lane's wake count when it started: unchanged at the attempt's end, the lane
    /// rests instead of asking the store for more.
    epoch: u64,
}

/// A read admitted into its namespace until dropped, which charges its rows.
struct ReadAdmitted<'a> {
    engine: &'a Engine,
    namespace: &'a str,
    rows: usize,
}

impl ReadAdmitted<'_> {
    fn returned(&mut self, rows: usize) {
        self.rows = rows.max(1);
    }
}

impl Drop for ReadAdmitted<'_> {
    fn drop(&mut self) {
        let mut inner = self.engine.lock();
        inner.reads.leave(self.namespace);
        if let Some((tokens, _)) = inner.read_budgets.get_mut(self.namespace) {
            *tokens -= self.rows as f64;
        }
    }
}

/// Counts an attempt task for [`Engine::drain`] until it ends, however it ends.
struct Running<'a>(&'a Engine);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::AcqRel);
        self.0.finished.notify_waiters();
    }
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

    /// Shares the store with other replicas: from now on an attempt starts only for a shard
    /// `ownership` holds, under its lease epoch. Call before [`Engine::recover`].
    pub fn share_by_shards(&self, ownership: Arc<Ownership>) {
        let _ = self.ownership.set(ownership);
    }

    /// The subscription's shard, when replicas divide the subscriptions.
    pub fn shard_of(&self, uid: &str) -> Option<u32> {
        self.ownership.get().map(|o| o.shard_of(uid))
    }

    /// Whether this replica may start attempts for the subscription now.
    pub fn holds_shard_of(&self, uid: &str) -> bool {
        self.ownership
            .get()
            .is_none_or(|o| o.fence(o.shard_of(uid)).is_some())
    }

    /// Wakes `uid`'s lane for new work, unless waking could start nothing: the lane is
    /// unknown here, held (paused or without its secret: the store claims nothing for it,
    /// and its release from hold wakes it), or in a shard another replica holds (the store's
    /// notice wakes it there; taking the shard wakes it here). With a publish to 200
    /// subscriptions, half of them paused and half elsewhere, each once started an attempt
    /// that only found that out.
    fn wake_for_work(&self, inner: &mut Inner, uid: &str) {
        if inner.subs.get(uid).is_some_and(|c| !c.held()) && self.holds_shard_of(uid) {
            inner.scheduler.wake(uid);
        }
    }

    /// This replica holds `shard` at `epoch` until `until`: taken (and recorded in the
    /// store), or renewed. A lane that found its shard not held rested, so when the hold is
    /// new, or renews one whose deadline had passed, the shard's lanes wake (returns true).
    pub fn hold_shard(&self, shard: u32, epoch: i64, until: std::time::Instant) -> bool {
        let Some(ownership) = self.ownership.get() else {
            return false;
        };
        if !ownership.hold(shard, epoch, until) {
            return false;
        }
        let mut inner = self.lock();
        let uids: Vec<Arc<str>> = inner
            .subs
            .keys()
            .filter(|uid| ownership.shard_of(uid) == shard)
            .cloned()
            .collect();
        for uid in uids {
            inner.scheduler.wake(&uid);
        }
        drop(inner);
        self.wakeup.notify_one();
        true
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
        Ok(self.store.live_subscriptions().await?)
    }

    /// After a restart and before dispatching: attempts that were on the wire become due
    /// again, and lanes with pending work are woken.
    pub async fn recover(&self) -> Result<(), EngineError> {
        // Shared by shards, attempts on the wire may be another replica's: those of a shard
        // become due again when it is taken (Store::take_shard), not at this start.
        let recovered = match self.ownership.get() {
            Some(_) => 0,
            None => self.store.recover_in_flight(now_ms()).await?,
        };
        if recovered > 0 {
            tracing::info!(
                recovered,
                "attempts interrupted by the last stop are due again"
            );
        }
        let pending = self.store.pending_by_subscription().await?;
        let mut inner = self.lock();
        inner.pending.clear();
        for (uid, namespace, count) in pending {
            *inner.pending.entry(namespace).or_default() += count;
            if inner.subs.contains_key(uid.as_str()) {
                inner.scheduler.wake(&uid);
            } else {
                inner.recovered.insert(uid);
            }
        }
        drop(inner);
        self.wakeup.notify_one();
        Ok(())
    }

    /// Adds or updates a subscription. A uid the store has tombstoned stays removed.
    pub async fn upsert(
        &self,
        mut config: SubscriptionConfig,
    ) -> Result<SubscriptionState, EngineError> {
        let state = self
            .store
            .upsert_subscription(SubscriptionRecord {
                uid: config.uid.to_string(),
                namespace: config.namespace.to_string(),
                name: config.name.to_string(),
                paused: config.held(),
                disable_after: config.disable_after,
                shard: self.ownership.get().map_or(0, |o| o.shard_of(&config.uid)),
            })
            .await?;
        if !state.live {
            return Ok(state);
        }
        let mut inner = self.lock();
        // One copy of each namespace name, and of the uid and name the previous config of
        // this subscription had.
        if let Some((namespace, _)) = inner.by_namespace.get_key_value(&*config.namespace) {
            config.namespace = namespace.clone();
        }
        if let Some((uid, old)) = inner.subs.get_key_value(&*config.uid) {
            config.uid = uid.clone();
            if old.name == config.name {
                config.name = old.name.clone();
            }
        }
        let config = Arc::new(config);
        let uid = config.uid.clone();
        inner
            .scheduler
            .upsert_lane(&uid, &config.namespace, config.width);
        inner
            .by_namespace
            .entry(config.namespace.clone())
            .or_default()
            .insert(uid.clone());
        inner
            .by_name
            .entry(config.namespace.clone())
            .or_default()
            .insert(config.name.clone(), uid.clone());
        // Only a lane that may have due work is woken: one released from hold, or one the
        // store had work for at recovery. A new or merely changed lane has nothing due that a
        // publish, a timer or recovery would not wake it for, and waking every lane would make
        // a start with 100,000 subscriptions ask the store 100,000 times for nothing.
        let held = config.held();
        let was_held = inner.subs.get(&uid).map(|old| old.held());
        let recovered = inner.recovered.remove(&*uid);
        inner.subs.insert(uid.clone(), config);
        if !held && (was_held == Some(true) || recovered) {
            inner.scheduler.wake(&uid);
        }
        drop(inner);
        self.wakeup.notify_one();
        Ok(state)
    }

    /// The purge-and-fence for a removed subscription of `namespace`: once this returns, no
    /// attempt for it starts again. Returns how many unfinished deliveries were purged.
    pub async fn remove(&self, namespace: &str, uid: &str) -> Result<u64, EngineError> {
        let purged = self.store.remove_subscription(uid).await?;
        crate::metrics::get()
            .purged
            .with_label_values(&[namespace])
            .inc_by(purged);
        let mut inner = self.lock();
        inner.states.remove(uid);
        if let Some(config) = inner.subs.remove(uid) {
            if let Some(names) = inner.by_name.get_mut(&config.namespace) {
                names.remove(&config.name);
                if names.is_empty() {
                    inner.by_name.remove(&config.namespace);
                }
            }
            if let Some(set) = inner.by_namespace.get_mut(&config.namespace) {
                set.remove(uid);
                if set.is_empty() {
                    inner.by_namespace.remove(&config.namespace);
                }
            }
            inner.pending_sub(&config.namespace, purged);
        }
        inner.scheduler.remove_lane(uid);
        inner.timer_at.remove(uid);
        Ok(purged)
    }

    /// Sets (or with None clears) a namespace's quota.
    pub fn set_quota(
        &self,
        namespace: &str,
        max_in_flight: Option<u32>,
        max_pending: Option<u64>,
        max_stored_bytes: Option<u64>,
    ) {
        let mut inner = self.lock();
        inner.scheduler.set_namespace_limit(
            namespace,
            max_in_flight.map(|n| n.max(crate::api::quota::MIN_NAMESPACE_IN_FLIGHT)),
        );
        match max_pending {
            Some(limit) => inner.pending_limits.insert(namespace.to_string(), limit),
            None => inner.pending_limits.remove(namespace),
        };
        match max_stored_bytes {
            Some(limit) => inner.stored_limits.insert(namespace.to_string(), limit),
            None => inner.stored_limits.remove(namespace),
        };
        drop(inner);
        self.wakeup.notify_one();
    }

    pub fn subscription(&self, namespace: &str, name: &str) -> Option<Arc<SubscriptionConfig>> {
        let inner = self.lock();
        let uid = inner.by_name.get(namespace)?.get(name)?;
        inner.subs.get(uid).cloned()
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
            EngineConfig {
                max_in_flight: 16,
                namespace_reserved_in_flight: 16,
                namespace_max_concurrent_publishes: 64,
                namespace_max_in_flight: 16,
                namespace_max_pending: 100,
                namespace_max_stored_bytes: 1 << 40,
                store_reserve_bytes: 0,
                history_retention: Duration::from_secs(60),
            },
        )
    }

    /// The config the engine runs for this uid.
    pub fn config(&self, uid: &str) -> Option<Arc<SubscriptionConfig>> {
        self.lock().subs.get(uid).cloned()
    }

    pub fn subscriptions(&self) -> Vec<Arc<SubscriptionConfig>> {
        self.lock().subs.values().cloned().collect()
    }

    /// The uid of the subscription of this name the engine runs.
    pub fn uid_of(&self, namespace: &str, name: &str) -> Result<Arc<str>, EngineError> {
        self.subscription(namespace, name)
            .map(|c| c.uid.clone())
            .ok_or_else(|| EngineError::NotFound(format!("{namespace}/{name}")))
    }

    /// Accepts an event: stored with one pending delivery per matching subscription before
    /// this returns. A repeated `id` returns the first answer and delivers nothing again.
    pub async fn publish(
        self: &Arc<Self>,
        namespace: &str,
        id: Option<String>,
        event_type: &str,
        data: &RawValue,
    ) -> Result<PublishResult, EngineError> {
        // Fair admission first: a flood from one namespace waits at the door, not in the
        // store's queue ahead of everyone else.
        struct Admitted<'a>(&'a Engine, &'a str);
        impl Drop for Admitted<'_> {
            fn drop(&mut self) {
                self.0.lock().admission.leave(self.1);
            }
        }
        let _admitted = {
            let mut inner = self.lock();
            if !inner.admission.enter(namespace) {
                return Err(EngineError::Busy {
                    namespace: namespace.to_string(),
                    limit: inner.admission.limit(),
                });
            }
            Admitted(self, namespace)
        };
        let given = id.is_some();
        let event_id = id.unwrap_or_else(|| format!("evt_{}", uuid::Uuid::now_v7().simple()));
        #[derive(Serialize)]
        struct Envelope<'a> {
            id: &'a str,
            #[serde(rename = "type")]
            kind: &'a str,
            timestamp: String,
            data: &'a RawValue,
        }
        let published_ms = now_ms();
        let body = serde_json::to_vec(&Envelope {
            id: &event_id,
            kind: event_type,
            timestamp: k8s_openapi::jiff::Timestamp::from_millisecond(published_ms)
                .map(|t| t.to_string())
                .unwrap_or_default(),
            data,
        })
        .map_err(|e| store::Error::Backend(e.to_string()))?;
        let body_bytes = body.len() as u64;
        // Looked at before the lock: at most one statvfs per 250 ms, never under it.
        let free = self.store.free_bytes();
        /// Pending attempts and stored bytes counted for a publish before the store has them;
        /// whatever the store did not write (a duplicate id, a subscription removed
        /// meanwhile, a failed write, a cancelled request) is given back on drop.
        struct Reservation<'a> {
            engine: &'a Engine,
            namespace: &'a str,
            count: u64,
            bytes: u64,
        }
        impl Drop for Reservation<'_> {
            fn drop(&mut self) {
                if self.count > 0 || self.bytes > 0 {
                    let mut inner = self.engine.lock();
                    inner.pending_sub(self.namespace, self.count);
                    if let Some(stored) = inner.stored.get_mut(self.namespace) {
                        *stored = stored.saturating_sub(self.bytes);
                    }
                }
            }
        }
        // The quota checks and the reservation are one step under the lock, so concurrent
        // publishes cannot pass a limit together.
        let admitted = {
            let mut inner = self.lock();
            // A namespace no subscription of this engine lives in is not a metric label:
            // anyone allowed to publish anywhere could grow the registry without bound.
            let routed = inner
                .by_namespace
                .get(namespace)
                .is_some_and(|s| !s.is_empty());
            let targets: Vec<String> = inner
                .by_namespace
                .get(namespace)
                .into_iter()
                .flatten()
                .filter(|uid| inner.subs.get(*uid).is_some_and(|c| c.matches(event_type)))
                .map(|uid| uid.to_string())
                .collect();
            let limit = inner
                .pending_limits
                .get(namespace)
                .copied()
                .unwrap_or(self.config.namespace_max_pending);
            let pending = inner.pending.get(namespace).copied().unwrap_or(0);
            let more = targets.len() as u64;
            let bytes = store::stored_cost(body_bytes, more);
            let stored = inner.stored.get(namespace).copied().unwrap_or(0);
            let stored_limit = inner
                .stored_limits
                .get(namespace)
                .copied()
                .unwrap_or(self.config.namespace_max_stored_bytes);
            let reserve = self.config.store_reserve_bytes;
            if pending + more > limit {
                Err(EngineError::QuotaExceeded {
                    namespace: namespace.to_string(),
                    pending,
                    more,
                    limit,
                })
            } else if stored + bytes > stored_limit {
                Err(EngineError::StoredBytesExceeded {
                    namespace: namespace.to_string(),
                    stored,
                    more: bytes,
                    limit: stored_limit,
                })
            } else if let Some(free) = free
                && free < reserve.saturating_add(bytes)
            {
                Err(EngineError::StoreReserve { free, reserve })
            } else {
                if more > 0 {
                    *inner.pending.entry(namespace.to_string()).or_default() += more;
                }
                *inner.stored.entry(namespace.to_string()).or_default() += bytes;
                let reservation = Reservation {
                    engine: self,
                    namespace,
                    count: more,
                    bytes,
                };
                Ok((targets, reservation, routed))
            }
        };
        let (targets, mut reservation, routed) = match admitted {
            Ok(admitted) => admitted,
            Err(refusal) => {
                // A producer retrying an accepted event gets its first answer: the id is
                // looked up before the quota refuses.
                if given && let Some(first) = self.store.published(namespace, &event_id).await? {
                    return Ok(first);
                }
                return Err(refusal);
            }
        };
        let event = NewEvent {
            namespace: namespace.to_string(),
            event_id,
            event_type: event_type.to_string(),
            body,
            published_ms,
        };
        // Idle lanes start with the publish, which claims their delivery. Nothing between
        // taking their slots and the task that gives back what is not claimed can fail.
        let started: Vec<Prestart> =
            if self.stopping.load(Ordering::Acquire) || !self.store.claims_with_publish() {
                Vec::new()
            } else {
                let mut guard = self.lock();
                let inner = &mut *guard;
                targets
                    .iter()
                    .filter_map(|uid| {
                        // Paused, or no secret: the store would claim nothing.
                        let config = inner
                            .subs
                            .get(uid.as_str())
                            .filter(|c| !c.paused && c.signer.is_some())?;
                        let fence = match self.ownership.get() {
                            None => None,
                            Some(o) => Some((o.clone(), o.fence(o.shard_of(uid))?)),
                        };
                        inner.scheduler.start_idle(uid).then(|| Prestart {
                            config: config.clone(),
                            fenced: fence,
                            epoch: inner.scheduler.epoch(uid),
                        })
                    })
                    .collect()
            };
        let started_uids: Vec<Arc<str>> = started.iter().map(|p| p.config.uid.clone()).collect();
        let result = if started.is_empty() {
            self.store.publish(event, targets).await?
        } else {
            // Its own task, so that it runs to the end even if the caller goes away: the
            // claims committed with the publish are attempts only this task starts.
            let engine = self.clone();
            tokio::spawn(async move { engine.publish_and_start(event, targets, started).await })
                .await
                .map_err(|e| store::Error::Backend(format!("the publish stopped: {e}")))??
        };
        // What the store wrote stays counted; the rest is released when `reservation` drops.
        reservation.count -= (result.targets.len() as u64).min(reservation.count);
        if !result.duplicate {
            let written = store::stored_cost(body_bytes, result.targets.len() as u64);
            reservation.bytes -= written.min(reservation.bytes);
        }
        drop(reservation);
        if !result.duplicate {
            let label = if routed {
                namespace
            } else {
                UNROUTED_NAMESPACE
            };
            crate::metrics::get()
                .published
                .with_label_values(&[label])
                .inc();
        }
        if !result.targets.is_empty() {
            let mut inner = self.lock();
            // A lane started with the publish is woken by its attempt's end.
            for uid in &result.targets {
                inner.states.remove(uid.as_str());
                if !started_uids.iter().any(|s| **s == **uid) {
                    self.wake_for_work(&mut inner, uid);
                }
            }
            drop(inner);
            self.wakeup.notify_one();
            if self.notices.receiver_count() > 0 {
                let _ = self.notices.send(Notice::Published {
                    namespace: namespace.to_string(),
                    subscriptions: result.targets.clone(),
                });
            }
        }
        Ok(result)
    }

    /// Publishes, claiming in the same transaction the deliveries of the lanes `started`
    /// (their slots already taken), and starts an attempt for each claim. A lane whose
    /// claim the store did not make (it claims nothing, the event was a duplicate, the
    /// subscription is paused or gone, the write failed) gives its slot back and is woken
    /// to claim as usual.
    async fn publish_and_start(
        self: Arc<Self>,
        event: NewEvent,
        targets: Vec<String>,
        started: Vec<Prestart>,
    ) -> store::Result<PublishResult> {
        let claims = started
            .iter()
            .map(|p| (p.config.uid.to_string(), p.fenced.as_ref().map(|(_, f)| *f)))
            .collect();
        let (result, mut claimed) = match self.store.publish_and_claim(event, targets, claims).await
        {
            Ok((result, claimed)) => (Ok(result), claimed),
            Err(e) => (Err(e), Vec::new()),
        };
        let mut unclaimed = Vec::new();
        for started in started {
            match claimed
                .iter()
                .position(|c| c.subscription_uid == *started.config.uid)
            {
                Some(i) => {
                    let claim = claimed.swap_remove(i);
                    self.running.fetch_add(1, Ordering::AcqRel);
                    let engine = self.clone();
                    tokio::spawn(async move { engine.attempt_claimed(started, claim).await });
                }
                None => unclaimed.push(started.config),
            }
        }
        if !unclaimed.is_empty() {
            let mut inner = self.lock();
            for config in &unclaimed {
                inner.scheduler.release(&config.uid, &config.namespace);
                inner.scheduler.wake(&config.uid);
            }
            drop(inner);
            self.wakeup.notify_one();
        }
        result
    }

    /// Admits one read through the API into `namespace` until the guard drops, which
    /// charges the rows it [`ReadAdmitted::returned`] (see [`READS_PER_NAMESPACE`] and
    /// [`READ_ROWS_PER_SECOND`]).
    fn admit_read<'a>(&'a self, namespace: &'a str) -> Result<ReadAdmitted<'a>, EngineError> {
        let mut inner = self.lock();
        let now = std::time::Instant::now();
        let (tokens, at) = inner
            .read_budgets
            .entry(namespace.to_string())
            .or_insert((READ_ROWS_BURST, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * READ_ROWS_PER_SECOND)
            .min(READ_ROWS_BURST);
        *at = now;
        if *tokens <= 0.0 {
            let wait = (-*tokens / READ_ROWS_PER_SECOND).ceil().max(1.0) as u32;
            return Err(EngineError::ReadBusy {
                namespace: namespace.to_string(),
                why: format!(
                    "has read more than {READ_ROWS_PER_SECOND} rows a second through the API"
                ),
                retry_after: wait,
            });
        }
        if !inner.reads.enter(namespace) {
            return Err(EngineError::ReadBusy {
                namespace: namespace.to_string(),
                why: format!("already has {READS_PER_NAMESPACE} reads in progress"),
                retry_after: 1,
            });
        }
        Ok(ReadAdmitted {
            engine: self,
            namespace,
            rows: 1,
        })
    }

    pub async fn list(
        &self,
        namespace: &str,
        name: &str,
        filter: StateFilter,
        limit: u32,
    ) -> Result<Vec<DeliveryView>, EngineError> {
        let uid = self.uid_of(namespace, name)?;
        let mut admitted = self.admit_read(namespace)?;
        let page = self.store.list_deliveries(&uid, filter, limit).await?;
        admitted.returned(page.len());
        Ok(page)
    }

    pub async fn attempts(
        &self,
        namespace: &str,
        name: &str,
        event_id: &str,
    ) -> Result<Vec<AttemptRecord>, EngineError> {
        let uid = self.uid_of(namespace, name)?;
        let mut admitted = self.admit_read(namespace)?;
        let attempts = self.store.attempts(&uid, event_id).await?;
        admitted.returned(attempts.len());
        Ok(attempts)
    }

    /// Re-queues dead letters; refused while the subscription is disabled.
    pub async fn replay(
        &self,
        namespace: &str,
        name: &str,
        event_ids: Option<Vec<String>>,
    ) -> Result<u64, EngineError> {
        let uid = self.uid_of(namespace, name)?;
        let state = self
            .store
            .subscription_state(&uid)
            .await?
            .unwrap_or_default();
        if state.disabled {
            return Err(EngineError::Disabled(format!("{namespace}/{name}")));
        }
        let replayed = self.store.replay(&uid, event_ids, now_ms()).await?;
        let mut inner = self.lock();
        inner.states.remove(&uid);
        *inner.pending.entry(namespace.to_string()).or_default() += replayed;
        inner.scheduler.wake(&uid);
        drop(inner);
        self.wakeup.notify_one();
        Ok(replayed)
    }

    /// Re-enables an auto-disabled subscription.
    pub async fn enable(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<SubscriptionState, EngineError> {
        let uid = self.uid_of(namespace, name)?;
        let state = self.store.set_disabled(&uid, false).await?;
        let mut inner = self.lock();
        inner.states.remove(&uid);
        inner.scheduler.wake(&uid);
        drop(inner);
        self.wakeup.notify_one();
        let _ = self.notices.send(Notice::Enabled {
            namespace: namespace.to_string(),
            name: name.to_string(),
        });
        Ok(state)
    }

    /// A subscription's state as the API shows it: while nothing this replica does changes
    /// it (a publish to it, an attempt's end, a replay, re-enabling), read from the store at
    /// most once per [`STATE_TTL`], so that however often a resting backlog is asked about,
    /// it is counted about once a second.
    pub async fn state(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<SubscriptionState, EngineError> {
        let uid = self.uid_of(namespace, name)?;
        let now = std::time::Instant::now();
        if let Some((at, state)) = self.lock().states.get(&uid)
            && now.duration_since(*at) < STATE_TTL
        {
            return Ok(state.clone());
        }
        let _admitted = self.admit_read(namespace)?;
        let state = self
            .store
            .subscription_state(&uid)
            .await?
            .unwrap_or_default();
        let mut inner = self.lock();
        if inner.states.len() >= 4 * inner.subs.len().max(1024) {
            inner
                .states
                .retain(|_, (at, _)| now.duration_since(*at) < STATE_TTL);
        }
        inner.states.insert(uid, (now, state.clone()));
        Ok(state)
    }

    /// Runs the dispatcher until the process ends: starts what the scheduler allows, fires
    /// retry timers, prunes history now and then.
    pub fn spawn(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let engine = self.clone();
        let pruner = self.clone();
        tokio::spawn(super::clock::watch_steps());
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_secs(600));
            loop {
                every.tick().await;
                let cutoff = now_ms() - pruner.config.history_retention.as_millis() as i64;
                if let Err(e) = pruner.store.prune(cutoff).await {
                    tracing::warn!(error = %e, "pruning attempt history failed");
                }
            }
        });
        tokio::spawn(self.clone().recount_stored());
        if self.ownership.get().is_some() {
            if let Some(work) = self.store.new_work() {
                tokio::spawn(self.clone().follow_new_work(work));
            }
            tokio::spawn(self.clone().recount_pending());
        }
        tokio::spawn(async move { engine.dispatch().await })
    }

    /// Shared by shards, other replicas publish too: wakes the lanes the store says got work,
    /// those it names and those matching an event it names, or, when notices may have been
    /// missed, every lane with unfinished work. Notices that arrive while this works are
    /// gathered by the feed and taken together next time.
    async fn follow_new_work(self: Arc<Self>, feed: NewWorkFeed) {
        loop {
            let work = feed.next().await;
            let mut uids: Vec<String> = work.subscriptions.into_iter().collect();
            if work.unknown {
                match self.store.pending_by_subscription().await {
                    Ok(pending) => uids.extend(pending.into_iter().map(|(uid, _, _)| uid)),
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot list unfinished work after missing notices");
                    }
                }
            }
            let mut inner = self.lock();
            for (namespace, event_type) in &work.events {
                let matching: Vec<String> = inner
                    .by_namespace
                    .get(namespace.as_str())
                    .into_iter()
                    .flatten()
                    .filter(|uid| inner.subs.get(*uid).is_some_and(|c| c.matches(event_type)))
                    .map(|uid| uid.to_string())
                    .collect();
                uids.extend(matching);
            }
            for uid in &uids {
                self.wake_for_work(&mut inner, uid);
            }
            self.wakeup.notify_one();
        }
    }

    /// Shared by shards, a replica accepts events whose attempts other replicas finish (and
    /// finishes attempts for events others accepted), so its own count of each namespace's
    /// pending attempts would only drift: it is taken again from the store every
    /// [`PENDING_RECOUNT`], or longer when counting takes long (see [`recount_wait`]). The
    /// namespace's pending limit then holds across replicas to within what they accept in
    /// that time.
    async fn recount_pending(self: Arc<Self>) {
        let mut wait = Duration::ZERO;
        loop {
            tokio::time::sleep(wait).await;
            let started = std::time::Instant::now();
            let result = self.store.pending_by_subscription().await;
            wait = recount_wait(started.elapsed());
            let pending = match result {
                Ok(pending) => pending,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot recount pending attempts");
                    continue;
                }
            };
            let mut counted: HashMap<String, u64> = HashMap::new();
            for (_, namespace, count) in pending {
                *counted.entry(namespace).or_default() += count;
            }
            self.lock().pending = counted;
        }
    }

    /// Takes what each namespace's stored events count from the store now and then (see
    /// [`STORED_RECOUNT`]). Between counts, publishes this process accepts are added as they
    /// are written; what is being published at the moment of a count may be missed by it
    /// until the next.
    async fn recount_stored(self: Arc<Self>) {
        let mut wait = Duration::ZERO;
        loop {
            tokio::time::sleep(wait).await;
            let started = std::time::Instant::now();
            let result = self.store.stored_bytes().await;
            wait = STORED_RECOUNT.max(started.elapsed().saturating_mul(20));
            match result {
                Ok(counted) => self.lock().stored = counted.into_iter().collect(),
                Err(e) => tracing::warn!(error = %e, "cannot count stored bytes per namespace"),
            }
        }
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

    /// For a graceful stop: no attempt starts from now on; waits until those on the wire
    /// have finished and been recorded, or `deadline` passes. Returns how many were still
    /// running (they are recovered as due at the next start).
    pub async fn drain(&self, deadline: Duration) -> usize {
        self.stopping.store(true, Ordering::Release);
        self.wakeup.notify_one();
        let end = tokio::time::Instant::now() + deadline;
        loop {
            let finished = self.finished.notified();
            let running = self.running.load(Ordering::Acquire);
            if running == 0 {
                return 0;
            }
            if tokio::time::timeout_at(end, finished).await.is_err() {
                return self.running.load(Ordering::Acquire);
            }
        }
    }

    async fn dispatch(self: Arc<Self>) {
        loop {
            if self.stopping.load(Ordering::Acquire) {
                return;
            }
            let notified = self.wakeup.notified();
            let (starts, next_timer) = {
                let mut inner = self.lock();
                let now = now_ms();
                while inner
                    .timers
                    .peek()
                    .is_some_and(|Reverse((at, _))| *at <= now)
                {
                    let Some(Reverse((at, uid))) = inner.timers.pop() else {
                        break;
                    };
                    if inner.timer_at.get(&uid) == Some(&at) {
                        inner.timer_at.remove(&uid);
                    }
                    inner.scheduler.wake(&uid);
                }
                let mut starts = Vec::new();
                while let Some(uid) = inner.scheduler.start_next() {
                    let epoch = inner.scheduler.epoch(&uid);
                    match inner.subs.get(&uid) {
                        Some(config) => starts.push((config.clone(), epoch)),
                        None => inner.scheduler.release(&uid, ""),
                    }
                }
                (starts, inner.timers.peek().map(|Reverse((at, _))| *at))
            };
            for (config, epoch) in starts {
                self.running.fetch_add(1, Ordering::AcqRel);
                let engine = self.clone();
                tokio::spawn(async move { engine.attempt(config, epoch).await });
            }
            match next_timer {
                Some(at) => {
                    let wait = Duration::from_millis((at - now_ms()).max(0) as u64);
                    tokio::select! {
                        _ = notified => {}
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
                None => notified.await,
            }
        }
    }

    /// Gives back a claim whose shard this replica no longer holds, retrying while the store
    /// cannot take it (as a record is retried): left in flight, the delivery would wait for the
    /// next take-over or start if the hold only lapsed and comes back.
    async fn unclaim(
        &self,
        config: &SubscriptionConfig,
        claimed: &Claimed,
        fence: Option<ShardFence>,
    ) {
        let mut backoff = Duration::from_millis(100);
        loop {
            match self
                .store
                .unclaim(claimed.delivery_id, claimed.attempt)
                .await
            {
                Ok(undone) => {
                    match fence {
                        Some(fence) => tracing::debug!(
                            target: "herald::shards",
                            namespace = %config.namespace,
                            subscription = %config.name,
                            shard = fence.shard,
                            epoch = fence.epoch,
                            undone,
                            "the shard's hold ended during the claim: not started"
                        ),
                        None => tracing::debug!(
                            namespace = %config.namespace,
                            subscription = %config.name,
                            undone,
                            "stopping during the claim: not started"
                        ),
                    }
                    return;
                }
                Err(e) if !self.stopping.load(Ordering::Acquire) => {
                    tracing::warn!(error = %e, namespace = %config.namespace, subscription = %config.name, retry_in_ms = backoff.as_millis() as u64, "giving back a claim failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
                Err(e) => {
                    tracing::error!(error = %e, "giving back a claim failed while stopping; it is due again after the next start");
                    return;
                }
            }
        }
    }

    /// One slot of a lane: claim the next due delivery (the fence), send it, record it.
    async fn attempt(self: Arc<Self>, config: Arc<SubscriptionConfig>, epoch: u64) {
        let _running = Running(&self);
        let uid = &*config.uid;
        if self.stopping.load(Ordering::Acquire) {
            self.lock().scheduler.release(uid, &config.namespace);
            return;
        }
        let mut fenced = None;
        let claim = match self.ownership.get() {
            None => self.store.claim_next(uid, now_ms()).await,
            Some(ownership) => match ownership.fence(ownership.shard_of(uid)) {
                Some(fence) => {
                    fenced = Some((ownership, fence));
                    self.store.claim_fenced(uid, now_ms(), fence).await
                }
                // Not this replica's shard (now): the lane rests until the shard is taken.
                None => {
                    tracing::debug!(
                        target: "herald::shards",
                        namespace = %config.namespace,
                        subscription = %config.name,
                        shard = ownership.shard_of(uid),
                        "due work in a shard this replica does not hold: not started"
                    );
                    Ok(Claim::Idle { next_due_ms: None })
                }
            },
        };
        let claim = match (claim, fenced) {
            // The store let the claim through under this epoch, but the hold may have ended
            // while the claim was on its way (the process was paused, the renewal was late):
            // then nothing is sent, and the delivery is due again for whoever holds the shard.
            (Ok(Claim::Claimed(claimed)), Some((ownership, fence)))
                if ownership.fence(fence.shard) != Some(fence) =>
            {
                self.unclaim(&config, &claimed, Some(fence)).await;
                Ok(Claim::Idle { next_due_ms: None })
            }
            (claim, _) => claim,
        };
        let claimed = match claim {
            Ok(Claim::Claimed(claimed)) => claimed,
            Ok(Claim::Idle { next_due_ms }) => {
                let mut inner = self.lock();
                inner.scheduler.idle(uid, epoch);
                inner.scheduler.release(uid, &config.namespace);
                if let Some(at) = next_due_ms {
                    inner.add_timer(uid, at);
                }
                drop(inner);
                self.wakeup.notify_one();
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, subscription = %config.name, namespace = %config.namespace, "claim failed; retrying in 1s");
                let mut inner = self.lock();
                inner.scheduler.release(uid, &config.namespace);
                inner.add_timer(uid, now_ms() + 1000);
                drop(inner);
                self.wakeup.notify_one();
                return;
            }
        };
        self.send_and_record(&config, claimed, None).await;
    }

    /// An attempt whose delivery was claimed with its publish (its lane's slot taken then).
    async fn attempt_claimed(self: Arc<Self>, started: Prestart, claimed: Claimed) {
        let _running = Running(&self);
        let Prestart {
            config,
            fenced,
            epoch,
        } = started;
        // As after any claim: nothing is sent once stopping, or when the shard's hold ended
        // while the publish was being committed; the delivery is due again.
        let lost = fenced
            .as_ref()
            .is_some_and(|(ownership, fence)| ownership.fence(fence.shard) != Some(*fence));
        if lost || self.stopping.load(Ordering::Acquire) {
            let fence = fenced.map(|(_, fence)| fence);
            self.unclaim(&config, &claimed, fence).await;
            self.lock()
                .scheduler
                .release(&config.uid, &config.namespace);
            self.wakeup.notify_one();
            return;
        }
        self.send_and_record(&config, claimed, Some(epoch)).await;
    }

    /// Sends a claimed delivery, records the result, and gives the lane's slot back. The
    /// lane is then woken to claim what else is due, unless it was started with a publish
    /// at wake count `rest_at` and nothing woke it since: it had nothing else due then,
    /// and whatever is due later has its timer.
    async fn send_and_record(
        &self,
        config: &Arc<SubscriptionConfig>,
        claimed: Claimed,
        rest_at: Option<u64>,
    ) {
        let uid = &*config.uid;
        // One span per attempt: who and which event, never the secret or the payload.
        let span = tracing::info_span!(
            "attempt",
            namespace = %config.namespace,
            subscription = %config.name,
            event_id = %claimed.event_id,
            attempt = claimed.attempt,
        );
        let started_ms = now_ms();
        let result = match &config.signer {
            Some(signer) => {
                let target = Target {
                    url: &config.url,
                    signer,
                    timeout: config.timeout,
                    headers: &config.headers,
                };
                self.sender
                    .send(&target, &claimed)
                    .instrument(span.clone())
                    .await
            }
            // The store holds a subscription without a signer as paused; this is a race
            // with a configuration change. Nothing was sent: try again later.
            None => super::http::AttemptResult {
                outcome: Outcome::Transient,
                status: None,
                retry_after: None,
                latency: Duration::ZERO,
                message: config.not_ready.clone().unwrap_or_default(),
                refused: false,
            },
        };

        let now = now_ms();
        let mut message = result.message.clone();
        let next = match result.outcome {
            Outcome::Accepted => Next::Delivered,
            Outcome::Terminal => Next::DeadLetter,
            Outcome::Transient => match retry::after_transient_failure(
                &config.limits,
                claimed.attempt,
                claimed.window_start_ms,
                now,
                result.retry_after,
                rand::random::<f64>(),
            ) {
                Decision::RetryAt { due_ms } => Next::Retry { due_ms },
                Decision::GiveUp { reason } => {
                    message = format!("{reason}; last: {message}");
                    Next::DeadLetter
                }
            },
        };
        let record = AttemptRecord {
            at_ms: now,
            outcome: result.outcome.as_str().to_string(),
            status_code: result.status,
            latency_ms: result.latency.as_millis() as u64,
            message: store::excerpt(message.as_bytes()),
        };
        // Recording is not lost work: while the store cannot commit (a full disk) the record
        // is retried, holding the lane's slot, so the delivery never stays "in flight" until
        // a restart (and is not sent again because of it).
        let mut backoff = Duration::from_millis(100);
        let completion = loop {
            match self
                .store
                .complete(claimed.claim_ref(), record.clone(), next)
                .instrument(span.clone())
                .await
            {
                Err(e) if !self.stopping.load(Ordering::Acquire) => {
                    tracing::error!(error = %e, namespace = %config.namespace, subscription = %config.name, event_id = %claimed.event_id, retry_in_ms = backoff.as_millis() as u64, "recording an attempt failed; retrying the record");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
                done => break done,
            }
        };
        span.in_scope(|| {
            tracing::debug!(
                outcome = result.outcome.as_str(),
                status = result.status,
                latency_ms = record.latency_ms,
                next = ?next,
                "attempt finished"
            )
        });

        record_metrics(config, &result, next, completion.as_ref().ok());
        let mut inner = self.lock();
        inner.states.remove(uid);
        inner.scheduler.release(uid, &config.namespace);
        match &completion {
            Ok(done) if done.recorded => match next {
                Next::Retry { due_ms } => inner.add_timer(uid, due_ms),
                Next::Delivered | Next::DeadLetter => inner.pending_sub(&config.namespace, 1),
            },
            Ok(_) => span.in_scope(|| {
                tracing::info!(
                    "the attempt's outcome was not applied: its delivery was removed, or claimed again meanwhile (a shard take-over); it is kept in the history"
                )
            }),
            Err(e) => {
                tracing::error!(error = %e, "recording an attempt failed while stopping; it is made again after the next start");
            }
        }
        if rest_at != Some(inner.scheduler.epoch(uid)) {
            inner.scheduler.wake(uid);
        }
        drop(inner);
        self.wakeup.notify_one();

        // Built only for a listener (in standalone mode there is none unless attempts are
        // logged): it copies names, the event id and the message.
        if self.notices.receiver_count() > 0 {
            let _ = self.notices.send(Notice::Attempt {
                namespace: config.namespace.to_string(),
                name: config.name.to_string(),
                event_id: claimed.event_id.clone(),
                attempt: claimed.attempt,
                started_ms,
                outcome: result.outcome,
                status_code: result.status,
                latency_ms: record.latency_ms,
                next: match next {
                    Next::Delivered => "delivered",
                    Next::Retry { .. } => "retry",
                    Next::DeadLetter => "dead-letter",
                },
                message: record.message,
            });
        }
        if let Ok(done) = completion
            && done.disabled_now
        {
            tracing::warn!(namespace = %config.namespace, subscription = %config.name, failures = done.consecutive_failures, "subscription disabled after consecutive failures");
            let _ = self.notices.send(Notice::Disabled {
                namespace: config.namespace.to_string(),
                name: config.name.to_string(),
                consecutive_failures: done.consecutive_failures,
            });
        }
    }
}

/// Counts a finished attempt in herald's metrics.
fn record_metrics(
    config: &SubscriptionConfig,
    result: &super::http::AttemptResult,
    next: Next,
    completion: Option<&store::Completion>,
) {
    let metrics = crate::metrics::get();
    let namespace = &*config.namespace;
    let outcome = if result.refused {
        "refused"
    } else {
        match result.outcome {
            Outcome::Accepted => "accepted",
            Outcome::Transient => "transient",
            Outcome::Terminal => "terminal",
        }
    };
    metrics
        .attempts
        .with_label_values(&[namespace, outcome])
        .inc();
    if metrics.subscription_labels() {
        metrics
            .subscription_attempts
            .with_label_values(&[namespace, &*config.name, outcome])
            .inc();
    }
    if !result.refused && config.signer.is_some() {
        metrics
            .attempt_duration
            .with_label_values(&[namespace])
            .observe(result.latency.as_secs_f64());
    }
    if let Some(done) = completion {
        if done.recorded && next == Next::DeadLetter {
            metrics.dead_letters.with_label_values(&[namespace]).inc();
        }
        if done.disabled_now {
            metrics.auto_disabled.with_label_values(&[namespace]).inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sqlite::SqliteStore;
    use crate::store::*;
    use async_trait::async_trait;
    use std::sync::atomic::AtomicU32;

    /// The SQLite store, with faults: `complete` fails a given number of times (a full disk),
    /// and a fenced claim can end the replica's hold of the shard while it is on its way (a
    /// pause, a late renewal).
    /// With `claim_with_publish` it claims with a publish as SQLite does (and counts those
    /// claims); without, it says it cannot, as the PostgreSQL store does.
    struct FaultyStore {
        inner: SqliteStore,
        failures: AtomicU32,
        lapse_during_claim: Mutex<Option<Arc<Ownership>>>,
        claim_with_publish: bool,
        claimed_with_publish: AtomicU32,
        claims_next: AtomicU32,
        /// Free space it reports (u64::MAX: the real folder's).
        free: std::sync::atomic::AtomicU64,
    }

    impl FaultyStore {
        fn new(dir: &std::path::Path, failures: u32, lapse: Option<Arc<Ownership>>) -> Self {
            Self {
                inner: SqliteStore::open(dir).unwrap(),
                failures: AtomicU32::new(failures),
                lapse_during_claim: Mutex::new(lapse),
                claim_with_publish: false,
                claimed_with_publish: AtomicU32::new(0),
                claims_next: AtomicU32::new(0),
                free: std::sync::atomic::AtomicU64::new(u64::MAX),
            }
        }

        fn lapse(&self, fence: ShardFence) {
            if let Some(ownership) = self.lapse_during_claim.lock().unwrap().take() {
                ownership.hold(fence.shard, fence.epoch, std::time::Instant::now());
            }
        }
    }

    #[async_trait]
    impl Store for FaultyStore {
        async fn upsert_subscription(
            &self,
            s: SubscriptionRecord,
        ) -> store::Result<SubscriptionState> {
            self.inner.upsert_subscription(s).await
        }
        async fn remove_subscription(&self, uid: &str) -> store::Result<u64> {
            self.inner.remove_subscription(uid).await
        }
        async fn set_disabled(&self, uid: &str, d: bool) -> store::Result<SubscriptionState> {
            self.inner.set_disabled(uid, d).await
        }
        async fn subscription_state(&self, uid: &str) -> store::Result<Option<SubscriptionState>> {
            self.inner.subscription_state(uid).await
        }
        async fn live_subscriptions(&self) -> store::Result<Vec<SubscriptionRecord>> {
            self.inner.live_subscriptions().await
        }
        async fn publish(&self, e: NewEvent, t: Vec<String>) -> store::Result<PublishResult> {
            self.inner.publish(e, t).await
        }
        async fn publish_and_claim(
            &self,
            e: NewEvent,
            t: Vec<String>,
            claims: Vec<(String, Option<ShardFence>)>,
        ) -> store::Result<(PublishResult, Vec<Claimed>)> {
            assert!(
                self.claim_with_publish,
                "asked to claim by a store that says it cannot"
            );
            let fences: Vec<ShardFence> = claims.iter().filter_map(|(_, f)| *f).collect();
            let (result, claimed) = self.inner.publish_and_claim(e, t, claims).await?;
            self.claimed_with_publish
                .fetch_add(claimed.len() as u32, Ordering::AcqRel);
            if !claimed.is_empty()
                && let Some(fence) = fences.first()
            {
                self.lapse(*fence);
            }
            Ok((result, claimed))
        }
        fn claims_with_publish(&self) -> bool {
            self.claim_with_publish
        }
        async fn published(&self, ns: &str, id: &str) -> store::Result<Option<PublishResult>> {
            self.inner.published(ns, id).await
        }
        async fn claim_next(&self, uid: &str, now: i64) -> store::Result<Claim> {
            self.claims_next.fetch_add(1, Ordering::AcqRel);
            self.inner.claim_next(uid, now).await
        }
        async fn claim_fenced(&self, uid: &str, now: i64, f: ShardFence) -> store::Result<Claim> {
            let claim = self.inner.claim_fenced(uid, now, f).await;
            if matches!(claim, Ok(Claim::Claimed(_))) {
                self.lapse(f);
            }
            claim
        }
        async fn unclaim(&self, id: i64, attempt: u32) -> store::Result<bool> {
            self.inner.unclaim(id, attempt).await
        }
        async fn take_shard(&self, s: u32, h: &str, e: i64, now: i64) -> store::Result<bool> {
            self.inner.take_shard(s, h, e, now).await
        }
        async fn complete(
            &self,
            c: ClaimRef,
            a: AttemptRecord,
            n: Next,
        ) -> store::Result<Completion> {
            if self
                .failures
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |f| f.checked_sub(1))
                .is_ok()
            {
                return Err(store::Error::Unavailable("database or disk is full".into()));
            }
            self.inner.complete(c, a, n).await
        }
        async fn recover_in_flight(&self, now: i64) -> store::Result<u64> {
            self.inner.recover_in_flight(now).await
        }
        async fn pending_by_subscription(&self) -> store::Result<Vec<(String, String, u64)>> {
            self.inner.pending_by_subscription().await
        }
        async fn stored_bytes(&self) -> store::Result<Vec<(String, u64)>> {
            self.inner.stored_bytes().await
        }
        fn free_bytes(&self) -> Option<u64> {
            match self.free.load(Ordering::SeqCst) {
                u64::MAX => self.inner.free_bytes(),
                free => Some(free),
            }
        }
        async fn list_deliveries(
            &self,
            uid: &str,
            f: StateFilter,
            l: u32,
        ) -> store::Result<Vec<DeliveryView>> {
            self.inner.list_deliveries(uid, f, l).await
        }
        async fn attempts(&self, uid: &str, id: &str) -> store::Result<Vec<AttemptRecord>> {
            self.inner.attempts(uid, id).await
        }
        async fn replay(
            &self,
            uid: &str,
            ids: Option<Vec<String>>,
            now: i64,
        ) -> store::Result<u64> {
            self.inner.replay(uid, ids, now).await
        }
        async fn prune(&self, before: i64) -> store::Result<u64> {
            self.inner.prune(before).await
        }
    }

    /// A receiver on 127.0.0.1 that answers 204 and counts what it received.
    async fn counting_receiver() -> (std::net::SocketAddr, Arc<AtomicU32>) {
        let hits = Arc::new(AtomicU32::new(0));
        let counted = hits.clone();
        let app = axum::Router::new().fallback(move || {
            counted.fetch_add(1, Ordering::AcqRel);
            async { axum::http::StatusCode::NO_CONTENT }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (address, hits)
    }

    fn test_engine(store: Arc<dyn Store>) -> Arc<Engine> {
        Engine::for_tests(store)
    }

    /// Subscription `ns/hook` (uid-1), every event type, to `address`.
    fn hook(address: std::net::SocketAddr) -> SubscriptionConfig {
        let spec: crate::api::WebhookSubscriptionSpec = serde_json::from_value(serde_json::json!({
            "url": format!("http://{address}/hook"),
            "eventTypes": ["*"],
            "signing": {"secretRef": {"name": "s", "key": "k"}},
        }))
        .unwrap();
        SubscriptionConfig::from_spec(
            "uid-1",
            "ns",
            "hook",
            &spec,
            Ok(vec!["whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYX".into()]),
        )
        .unwrap()
    }

    async fn publish(engine: &Arc<Engine>, id: &str) {
        let data = RawValue::from_string("{}".into()).unwrap();
        engine
            .publish("ns", Some(id.into()), "t", &data)
            .await
            .unwrap();
    }

    /// Polls until `ns/hook`'s first delivery is delivered; panics after `within`.
    async fn wait_delivered(engine: &Engine, within: Duration, what: &str) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let list = engine
                .list("ns", "hook", StateFilter::All, 10)
                .await
                .unwrap();
            if list.len() == 1 && list[0].state == DeliveryState::Delivered {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: the delivery never left {:?}",
                list.first().map(|d| d.state)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    #[test]
    fn a_slow_recount_is_made_less_often() {
        assert_eq!(recount_wait(Duration::from_millis(5)), PENDING_RECOUNT);
        assert_eq!(
            recount_wait(Duration::from_millis(230)),
            Duration::from_millis(4600)
        );
    }

    /// Issue 9, defect 7: an attempt whose record cannot be committed (a full disk) is
    /// recorded once the store commits again, without a restart and without a second POST.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_record_is_retried_not_left_in_flight() {
        let (address, hits) = counting_receiver().await;
        let dir = std::env::temp_dir().join(format!("herald-engine-{}", uuid::Uuid::now_v7()));
        let store = Arc::new(FaultyStore::new(&dir, 3, None));
        let engine = test_engine(store.clone());
        engine.upsert(hook(address)).await.unwrap();
        engine.recover().await.unwrap();
        engine.spawn();
        publish(&engine, "evt-1").await;

        wait_delivered(&engine, Duration::from_secs(30), "records failing").await;
        assert_eq!(store.failures.load(Ordering::Acquire), 0);
        assert_eq!(hits.load(Ordering::Acquire), 1, "sent again");
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A running engine delivering `hook(address)`, sharing work by `ownership` (one shard),
    /// that has taken shard 0 at epoch 1 and holds it for a minute.
    async fn holding_the_only_shard(
        store: Arc<dyn Store>,
        ownership: Arc<Ownership>,
        address: std::net::SocketAddr,
    ) -> Arc<Engine> {
        let engine = test_engine(store.clone());
        engine.share_by_shards(ownership);
        engine.upsert(hook(address)).await.unwrap();
        engine.recover().await.unwrap();
        engine.spawn();
        assert!(store.take_shard(0, "me", 1, now_ms()).await.unwrap());
        engine.hold_shard(0, 1, std::time::Instant::now() + Duration::from_secs(60));
        engine
    }

    /// A lane that found its shard's hold past its deadline (a slow Lease round) rests; the
    /// renewal of that hold at the same epoch must wake it, or its due work waits for the
    /// next publish (found by the scale-out test: 10 acknowledged events never delivered).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lane_refused_during_a_lapsed_hold_starts_once_the_hold_is_renewed() {
        let (address, hits) = counting_receiver().await;
        let dir = std::env::temp_dir().join(format!("herald-engine-{}", uuid::Uuid::now_v7()));
        let store = Arc::new(SqliteStore::open(&dir).unwrap());
        let engine = holding_the_only_shard(store, Arc::new(Ownership::new(1)), address).await;
        let later = || std::time::Instant::now() + Duration::from_secs(60);
        // The round that should have renewed it came late: the hold lapses.
        engine.hold_shard(0, 1, std::time::Instant::now());

        publish(&engine, "evt-1").await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while engine.lock().scheduler.wants("uid-1") {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the lane never rested"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(hits.load(Ordering::Acquire), 0, "sent while not held");

        engine.hold_shard(0, 1, later());
        wait_delivered(&engine, Duration::from_secs(10), "after the renewal").await;
        assert_eq!(hits.load(Ordering::Acquire), 1);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// The store let a fenced claim through, but the hold ended while the claim was on its
    /// way (found by the scale-out test: a replica resumed from SIGSTOP sent an attempt for a
    /// shard another replica had taken). Nothing is sent; the delivery is due again, its
    /// claim not counted as an attempt, and goes out once the shard is held again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_that_outlives_its_hold_is_given_back_unsent() {
        claim_outlives_its_hold(false).await;
    }

    /// The same when the claim was made with the publish (an idle lane).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_made_with_its_publish_that_outlives_its_hold_is_given_back_unsent() {
        claim_outlives_its_hold(true).await;
    }

    async fn claim_outlives_its_hold(claim_with_publish: bool) {
        let (address, hits) = counting_receiver().await;
        let dir = std::env::temp_dir().join(format!("herald-engine-{}", uuid::Uuid::now_v7()));
        let ownership = Arc::new(Ownership::new(1));
        let mut store = FaultyStore::new(&dir, 0, Some(ownership.clone()));
        store.claim_with_publish = claim_with_publish;
        let store = Arc::new(store);
        let engine = holding_the_only_shard(store.clone(), ownership, address).await;
        let later = || std::time::Instant::now() + Duration::from_secs(60);
        // Taking the shard woke the lane: it finds nothing and rests before the publish.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while engine.lock().scheduler.wants("uid-1") || engine.lock().scheduler.in_flight() > 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the lane never rested"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }

        publish(&engine, "evt-1").await;
        assert_eq!(
            store.claimed_with_publish.load(Ordering::Acquire),
            u32::from(claim_with_publish)
        );
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while store.lapse_during_claim.lock().unwrap().is_some()
            || engine.lock().scheduler.wants("uid-1")
            || engine.lock().scheduler.in_flight() > 0
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the lane never rested"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(hits.load(Ordering::Acquire), 0, "sent after the hold ended");
        let list = engine
            .list("ns", "hook", StateFilter::All, 10)
            .await
            .unwrap();
        assert_eq!(
            (list[0].state, list[0].attempts),
            (DeliveryState::Pending, 0),
            "the claim was not given back"
        );

        engine.hold_shard(0, 1, later());
        wait_delivered(&engine, Duration::from_secs(10), "after the renewal").await;
        assert_eq!(hits.load(Ordering::Acquire), 1);
        let list = engine
            .list("ns", "hook", StateFilter::All, 10)
            .await
            .unwrap();
        assert_eq!(list[0].attempts, 1, "the unsent claim was counted");
        let _ = std::fs::remove_dir_all(dir);
    }

    /// An idle lane's delivery is claimed in its publish's transaction and sent at once, and
    /// the lane then rests without a claim of its own; a repeated publish of the same id
    /// claims nothing and gives the lane's slot back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_idle_lane_is_claimed_with_its_publish() {
        let (address, hits) = counting_receiver().await;
        let dir = std::env::temp_dir().join(format!("herald-engine-{}", uuid::Uuid::now_v7()));
        let mut store = FaultyStore::new(&dir, 0, None);
        store.claim_with_publish = true;
        let store = Arc::new(store);
        let engine = test_engine(store.clone());
        engine.upsert(hook(address)).await.unwrap();
        engine.recover().await.unwrap();
        engine.spawn();

        let rests = |what: &'static str| {
            let engine = engine.clone();
            async move {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                while engine.lock().scheduler.in_flight() > 0
                    || engine.lock().scheduler.wants("uid-1")
                {
                    assert!(tokio::time::Instant::now() < deadline, "{what}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        };
        rests("the lane never rested after its start").await;
        let claims_before = store.claims_next.load(Ordering::Acquire);

        publish(&engine, "evt-1").await;
        assert_eq!(store.claimed_with_publish.load(Ordering::Acquire), 1);
        wait_delivered(&engine, Duration::from_secs(10), "claimed with its publish").await;
        rests("the lane never came to rest").await;
        assert_eq!(
            store.claims_next.load(Ordering::Acquire),
            claims_before,
            "the lane asked the store for more after its only delivery"
        );

        publish(&engine, "evt-1").await;
        assert_eq!(store.claimed_with_publish.load(Ordering::Acquire), 1);
        rests("the repeated publish left the lane's slot taken").await;
        assert_eq!(hits.load(Ordering::Acquire), 1);
        let list = engine
            .list("ns", "hook", StateFilter::All, 10)
            .await
            .unwrap();
        assert_eq!((list.len(), list[0].attempts), (1, 1));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Issue 24 item 10: publishing into namespaces without a subscription does not add a
    /// metric series per namespace; a namespace with one keeps its own.
    #[tokio::test]
    async fn namespaces_without_subscriptions_share_one_published_series() {
        let dir = std::env::temp_dir().join(format!("herald-engine-{}", uuid::Uuid::now_v7()));
        let engine = test_engine(Arc::new(SqliteStore::open(&dir).unwrap()));
        engine
            .upsert(hook("127.0.0.1:9".parse().unwrap()))
            .await
            .unwrap();
        let data = RawValue::from_string("{}".into()).unwrap();
        for i in 0..50 {
            engine
                .publish(&format!("nobody-{i}"), None, "t", &data)
                .await
                .unwrap();
        }
        publish(&engine, "evt-1").await;
        let text = crate::metrics::render(&Default::default());
        let series: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("herald_events_published_total{"))
            .collect();
        assert!(
            !series.iter().any(|l| l.contains("namespace=\"nobody-")),
            "a series per namespace without a subscription: {series:?}"
        );
        assert!(
            series.iter().any(|l| l.contains("namespace=\"ns\"")),
            "{series:?}"
        );
        assert!(
            series
                .iter()
                .any(|l| l.contains(&format!("namespace=\"{UNROUTED_NAMESPACE}\""))),
            "{series:?}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Issue 24 item 4: a namespace's byte budget refuses its own publishes and writes
    /// nothing; what is counted as events are written agrees with the store's count; the
    /// disk's reserve refuses every namespace's publishes while free space is within it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn byte_budgets_and_the_disk_reserve_refuse_publishes() {
        let dir = std::env::temp_dir().join(format!("herald-engine-{}", uuid::Uuid::now_v7()));
        let store = Arc::new(FaultyStore::new(&dir, 0, None));
        let engine = test_engine(store.clone());
        engine
            .upsert(hook("127.0.0.1:9".parse().unwrap()))
            .await
            .unwrap();
        let data = RawValue::from_string(format!("{{\"pad\":\"{}\"}}", "x".repeat(1000))).unwrap();
        // Room for three such events (each about 1,100 bytes of body, 512 and 256).
        engine.set_quota("ns", None, None, Some(6_000));
        let mut accepted = 0;
        let refusal = loop {
            match engine.publish("ns", None, "t", &data).await {
                Ok(_) => accepted += 1,
                Err(e) => break e,
            }
            assert!(accepted < 10, "the byte budget never refused");
        };
        assert_eq!(accepted, 3);
        assert!(
            matches!(
                &refusal,
                EngineError::StoredBytesExceeded { limit: 6_000, .. }
            ),
            "{refusal:?}"
        );
        assert!(
            refusal.to_string().contains("maxStoredBytes of 6000"),
            "{refusal}"
        );
        assert_eq!(
            store.stored_bytes().await.unwrap(),
            vec![("ns".to_string(), engine.lock().stored["ns"])],
            "the count kept as events were written and the store's count differ"
        );
        // Other namespaces are not held to ns's budget.
        engine.publish("other", None, "t", &data).await.unwrap();

        // 1 MiB free against a reserve of 64 MiB: nothing is accepted, from anyone.
        let engine = Engine::new(
            store.clone(),
            HttpSender::new(crate::delivery::egress::EgressPolicy::default()).unwrap(),
            EngineConfig {
                store_reserve_bytes: 64 << 20,
                ..engine.config.clone()
            },
        );
        store.free.store(1 << 20, Ordering::SeqCst);
        for namespace in ["ns", "other", "third"] {
            let refusal = engine
                .publish(namespace, None, "t", &data)
                .await
                .unwrap_err();
            assert!(
                matches!(refusal, EngineError::StoreReserve { .. }),
                "{refusal:?}"
            );
        }
        store.free.store(1 << 30, Ordering::SeqCst);
        engine.publish("third", None, "t", &data).await.unwrap();
        let _ = std::fs::remove_dir_all(dir);
    }
}
