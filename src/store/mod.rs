//! The store: events, one delivery per (event, subscription), attempt history, and the
//! subscription rows that fence every attempt. Pending work lives here, not in memory.
//!
//! Backends implement [`Store`]; the embedded SQLite backend ([`sqlite`]) is the default,
//! PostgreSQL ([`postgres`]) is for several replicas sharing one database. Every backend runs
//! the same test suite ([`suite`]).
//!
//! The B1 fence: [`Store::claim_next`] marks a delivery in flight only if its subscription
//! row is live, enabled and unpaused, in the same transaction. [`Store::remove_subscription`]
//! purges the subscription's unfinished deliveries and tombstones its row in one
//! transaction, so once it returns no claim for that subscription can ever succeed again:
//! not from a lane that still has it in memory, not from a retry timer, not after a restart,
//! and not from a stale cache that upserts it again.

pub mod postgres;
pub mod sqlite;
#[cfg(test)]
pub(crate) mod suite;
/// A real PostgreSQL server per test (`scripts/postgres`), shared with the integration tests.
#[cfg(test)]
#[path = "../../tests/support/postgres.rs"]
pub(crate) mod test_postgres;
#[cfg(test)]
pub(crate) mod testing;
pub mod timed;

use std::collections::HashSet;

use async_trait::async_trait;
use serde::Serialize;

/// Responses longer than this are cut in the attempt history.
pub const EXCERPT_BYTES: usize = 512;

/// What a stored event counts against its namespace's byte budget besides its body (which
/// is kept, for replays and the history, until the event is pruned): its row, id, type and
/// index entries. An event that matched no subscription keeps no body and counts only this.
pub const EVENT_OVERHEAD_BYTES: u64 = 512;
/// What each of its deliveries counts, with a few attempts' history.
pub const DELIVERY_OVERHEAD_BYTES: u64 = 256;

/// The bytes an event counts against its namespace's budget (see [`EVENT_OVERHEAD_BYTES`]).
pub fn stored_cost(body_bytes: u64, deliveries: u64) -> u64 {
    match deliveries {
        0 => EVENT_OVERHEAD_BYTES,
        n => body_bytes + EVENT_OVERHEAD_BYTES + n * DELIVERY_OVERHEAD_BYTES,
    }
}

/// How the history marks an attempt whose claim was no longer current when it ended.
pub const SUPERSEDED: &str = "superseded: the delivery was claimed again while this attempt was on the wire, so its outcome was not applied; ";

/// The history message of an attempt whose claim was stale.
pub(crate) fn superseded_message(message: &str) -> String {
    excerpt(format!("{SUPERSEDED}{message}").as_bytes())
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the store is unavailable: {0}")]
    Unavailable(String),
    #[error("store error: {0}")]
    Backend(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What the store knows of a subscription. `uid` is the Kubernetes object's uid (or, in
/// standalone mode, one made when the subscription first appeared).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubscriptionRecord {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    /// Paused by spec, or not deliverable (its secret is missing): no claim succeeds.
    pub paused: bool,
    /// Disable after this many consecutive failures; 0 never.
    pub disable_after: u32,
    /// Its shard (`delivery::shards::shard_of`; 0 with one replica).
    pub shard: u32,
    /// Claims take only its oldest unsettled delivery, and only while none is in flight
    /// and that one is due (`spec.delivery.ordering: strict`).
    pub strict_order: bool,
}

/// A claim's proof of shard ownership: the lease epoch under which this replica holds the
/// shard. The store refuses the claim unless it is the shard's current epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardFence {
    pub shard: u32,
    pub epoch: i64,
}

/// Counters and flags kept with the subscription row.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SubscriptionState {
    pub live: bool,
    pub disabled: bool,
    /// Disabled because its receiver answered 410 Gone (rather than after
    /// consecutive failures); cleared by a re-enable.
    pub gone: bool,
    pub consecutive_failures: u32,
    pub delivered: u64,
    pub failed: u64,
    pub dead_lettered: u64,
    pub pending: u64,
    /// Dead letters kept (not replayed).
    pub dead: u64,
}

/// An event to store, with the body every attempt will send (built once, so retries send
/// the same bytes under the same id).
#[derive(Clone, Debug)]
pub struct NewEvent {
    pub namespace: String,
    pub event_id: String,
    pub event_type: String,
    pub body: Vec<u8>,
    pub published_ms: i64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublishResult {
    pub event_id: String,
    /// Deliveries created (or, for a repeated id, created the first time).
    pub matched: u32,
    /// The id had been published before; nothing new was written.
    pub duplicate: bool,
    /// Subscriptions that got a delivery now (empty for a duplicate).
    pub targets: Vec<String>,
}

/// A delivery claimed for one attempt.
#[derive(Clone, Debug)]
pub struct Claimed {
    pub delivery_id: i64,
    pub subscription_uid: String,
    pub event_id: String,
    pub event_type: String,
    pub body: Vec<u8>,
    /// 1 for the first attempt.
    pub attempt: u32,
    /// Start of the retry window (publish time, or replay time).
    pub window_start_ms: i64,
    /// The shard epoch the claim was fenced by (None: an unfenced claim).
    pub fence: Option<ShardFence>,
}

impl Claimed {
    /// What the attempt's completion carries to prove its claim is still current.
    pub fn claim_ref(&self) -> ClaimRef {
        ClaimRef {
            delivery_id: self.delivery_id,
            attempt: self.attempt,
            fence: self.fence,
        }
    }
}

/// The claim an attempt ran under. [`Store::complete`] moves the delivery on only while it
/// is still in flight under this claim: same attempt number and, for a fenced claim, the
/// shard still at that epoch. A take-over (which makes the delivery due again) or a later
/// claim by another replica makes it stale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClaimRef {
    pub delivery_id: i64,
    /// The claim's attempt number ([`Claimed::attempt`]).
    pub attempt: u32,
    pub fence: Option<ShardFence>,
}

#[derive(Clone, Debug)]
pub enum Claim {
    Claimed(Claimed),
    /// Nothing due now; the earliest pending delivery is due then (None: nothing pending,
    /// or the subscription is paused, disabled or gone).
    Idle {
        next_due_ms: Option<i64>,
    },
}

/// How an attempt ended, for the history.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AttemptRecord {
    /// When the attempt ended, Unix milliseconds.
    pub at_ms: i64,
    /// Accepted, Transient, Terminal or Gone.
    pub outcome: String,
    /// The receiver's HTTP status, when it answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status_code: Option<u16>,
    /// From the request's start to the answer's end (or the failure).
    pub latency_ms: u64,
    /// The start of the response body (at most `EXCERPT_BYTES`, 512 bytes) or what went
    /// wrong.
    pub message: String,
}

/// What happens to the delivery after an attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    Delivered,
    Retry {
        due_ms: i64,
    },
    DeadLetter,
    /// Dead-letter it, and disable the subscription at once whatever its threshold: the
    /// receiver answered 410 Gone. [`SubscriptionState::gone`] says so until re-enabled.
    Gone,
}

impl Next {
    /// The delivery ends dead-lettered.
    pub fn is_dead(self) -> bool {
        matches!(self, Self::DeadLetter | Self::Gone)
    }
}

/// What got new due work in a store several processes share, since it was last taken from
/// the [`NewWorkFeed`]: notices coalesced.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NewWork {
    /// Subscriptions named one by one.
    pub subscriptions: HashSet<String>,
    /// (namespace, event type) of events published to more subscriptions than a notice can
    /// name: every subscription of the namespace that matches the type got work.
    pub events: HashSet<(String, String)>,
    /// Notices may have been missed (a reconnect, or more than the feed holds): look at
    /// everything.
    pub unknown: bool,
}

impl NewWork {
    fn is_empty(&self) -> bool {
        !self.unknown && self.subscriptions.is_empty() && self.events.is_empty()
    }
}

/// Most subscriptions and events a [`NewWorkFeed`] holds before it says
/// [`NewWork::unknown`] instead: however far its reader falls behind, the feed stays small.
pub const NEW_WORK_HELD: usize = 10_000;

struct FeedState {
    work: NewWork,
    reader_gone: bool,
}

/// Notices of new work, coalesced and bounded: the listener adds as they come, the reader
/// takes everything gathered since its last look. A reader slower than the notices never
/// meets a queue of them, only one batch (an unbounded channel of notices once grew without
/// bound, each a full rescan).
pub struct NewWorkFeed {
    state: std::sync::Arc<(std::sync::Mutex<FeedState>, tokio::sync::Notify)>,
}

/// The listening side of a [`NewWorkFeed`].
#[derive(Clone)]
pub struct NewWorkNotices {
    state: std::sync::Arc<(std::sync::Mutex<FeedState>, tokio::sync::Notify)>,
}

/// A new feed and its listening side.
pub fn new_work_feed() -> (NewWorkNotices, NewWorkFeed) {
    let state = std::sync::Arc::new((
        std::sync::Mutex::new(FeedState {
            work: NewWork::default(),
            reader_gone: false,
        }),
        tokio::sync::Notify::new(),
    ));
    (
        NewWorkNotices {
            state: state.clone(),
        },
        NewWorkFeed { state },
    )
}

impl NewWorkFeed {
    /// Waits until something was noticed, then takes all of it.
    pub async fn next(&self) -> NewWork {
        loop {
            let notified = self.state.1.notified();
            {
                let mut state = self.state.0.lock().unwrap_or_else(|e| e.into_inner());
                if !state.work.is_empty() {
                    return std::mem::take(&mut state.work);
                }
            }
            notified.await;
        }
    }
}

impl Drop for NewWorkFeed {
    fn drop(&mut self) {
        self.state
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .reader_gone = true;
    }
}

impl NewWorkNotices {
    /// Adds to what the reader will take; false once the reader is gone.
    fn add(&self, add: impl FnOnce(&mut NewWork)) -> bool {
        let mut state = self.state.0.lock().unwrap_or_else(|e| e.into_inner());
        if state.reader_gone {
            return false;
        }
        let work = &mut state.work;
        if !work.unknown {
            add(work);
            if work.subscriptions.len() + work.events.len() > NEW_WORK_HELD {
                *work = NewWork {
                    unknown: true,
                    ..NewWork::default()
                };
            }
        }
        drop(state);
        self.state.1.notify_one();
        true
    }

    pub fn subscriptions<'a>(&self, uids: impl IntoIterator<Item = &'a str>) -> bool {
        self.add(|work| {
            work.subscriptions
                .extend(uids.into_iter().map(str::to_string))
        })
    }

    pub fn event(&self, namespace: &str, event_type: &str) -> bool {
        self.add(|work| {
            work.events
                .insert((namespace.to_string(), event_type.to_string()));
        })
    }

    pub fn unknown(&self) -> bool {
        self.add(|work| work.unknown = true)
    }
}

/// One recorded taking of a shard.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ShardTaking {
    pub shard: u32,
    pub epoch: i64,
    pub holder: String,
    pub at_ms: i64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Completion {
    /// Whether the attempt moved its delivery on. False when the delivery was purged while
    /// the attempt was on the wire, or when its claim was no longer current (a take-over, a
    /// later claim): then the attempt is kept in the history only.
    pub recorded: bool,
    /// This completion disabled the subscription.
    pub disabled_now: bool,
    pub consecutive_failures: u32,
    /// When recorded: the earliest due time of the subscription's deliveries waiting to be
    /// claimed, as the completion saw them (None: none waits, the subscription is paused,
    /// disabled or gone, or [`Store::complete_and_claim`] claimed the next one, with which
    /// the lane goes on, learning what is due after it from that one's record). The lane
    /// then asks for its next claim only when one is due, rather than once more after every
    /// attempt to find out. A retry this completion scheduled may or may not be among them.
    pub next_due_ms: Option<i64>,
    /// [`Store::complete_dead_letter`] only: the letter was queued on the sink's lane (the
    /// death was recorded, the lane is live and the letter's id was not stored before).
    pub letter_queued: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum DeliveryState {
    Pending,
    InFlight,
    Delivered,
    Dead,
}

impl DeliveryState {
    pub(crate) fn code(self) -> i64 {
        match self {
            Self::Pending => 0,
            Self::InFlight => 1,
            Self::Delivered => 2,
            Self::Dead => 3,
        }
    }

    pub(crate) fn from_code(code: i64) -> Self {
        match code {
            0 => Self::Pending,
            1 => Self::InFlight,
            2 => Self::Delivered,
            _ => Self::Dead,
        }
    }
}

/// Which dead letters a replay re-queues: all, or those of the given event ids, and of
/// events published within `[since_ms, until_ms)` (Unix ms), each bound when given.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Replay {
    pub event_ids: Option<Vec<String>>,
    pub since_ms: Option<i64>,
    pub until_ms: Option<i64>,
}

impl Replay {
    /// Those of these event ids.
    pub fn events(ids: Vec<String>) -> Self {
        Self {
            event_ids: Some(ids),
            ..Self::default()
        }
    }
}

/// Most rows of the attempt log one search reads, newest first, whatever it finds: a search
/// for something rare costs this much per page at most, and its page may then hold fewer
/// items than asked for (even none) with a cursor to read on from. (Small in unit tests, so
/// that the store suite pages through the bound.)
pub const SEARCH_SCAN_ROWS: u32 = if cfg!(test) { 16 } else { 10_000 };

/// Which attempts a search lists, across the subscriptions of one namespace, newest first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AttemptSearch {
    pub namespace: String,
    /// Only this subscription's (by name).
    pub subscription: Option<String>,
    /// Only attempts whose outcome is one of these ([`AttemptRecord::outcome`]).
    pub outcomes: Option<Vec<String>>,
    pub status_code: Option<u16>,
    /// Only attempts made within `[since_ms, until_ms)` (Unix ms), each bound when given.
    pub since_ms: Option<i64>,
    pub until_ms: Option<i64>,
    /// The cursor: only attempts older than this one (a [`AttemptPage::next`]).
    pub before: Option<i64>,
    pub limit: u32,
}

/// One attempt a search found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AttemptHit {
    pub subscription: String,
    pub event_id: String,
    pub event_type: String,
    #[serde(flatten)]
    pub attempt: AttemptRecord,
}

/// A page of a search, and where the next one starts (None: nothing older is left).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AttemptPage {
    pub items: Vec<AttemptHit>,
    /// Each item's place in the attempt log (its id, larger for later attempts), in the
    /// items' order.
    pub ids: Vec<i64>,
    pub next: Option<i64>,
    /// Rows of the log the page read: what it cost, however few it found.
    pub scanned: u32,
}

impl AttemptPage {
    /// The page from what a search read: `hits` (each with its log id, newest first, at
    /// most `limit`) out of `scanned` rows of the log, the oldest of which was `oldest`.
    pub(crate) fn of(
        hits: Vec<(i64, AttemptHit)>,
        limit: u32,
        scanned: u32,
        oldest: Option<i64>,
    ) -> Self {
        let next = if hits.len() >= limit as usize {
            hits.last().map(|(id, _)| *id)
        } else if scanned >= SEARCH_SCAN_ROWS {
            oldest
        } else {
            None
        };
        let (ids, items) = hits.into_iter().unzip();
        Self {
            items,
            ids,
            next,
            scanned,
        }
    }
}

/// What the uid and name of a dead-letter sink's lane end with.
pub const SINK_SUFFIX: &str = "/dead-letter-sink";

/// The uid of the lane that sends `uid`'s dead letters to its sink. A uid never holds '/'
/// (a Kubernetes UID or a UUID), nor ',' or ':' (which store notices use).
pub fn sink_uid(uid: &str) -> String {
    format!("{uid}{SINK_SUFFIX}")
}

/// Which deliveries to list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateFilter {
    Pending,
    Dead,
    All,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryView {
    pub event_id: String,
    pub event_type: String,
    pub state: DeliveryState,
    /// Attempts made so far.
    pub attempts: u32,
    /// When the event was published, Unix milliseconds.
    pub published_ms: i64,
    /// When the next attempt is due, Unix milliseconds (pending deliveries only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_due_ms: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_attempt: Option<AttemptRecord>,
    /// The last attempt's place in the attempt log ([`AttemptPage::ids`]): how the
    /// aggregated API names it.
    #[serde(skip)]
    #[schema(ignore)]
    pub last_attempt_id: Option<i64>,
}

#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Creates or updates a live subscription. A tombstoned uid stays dead; returns its
    /// state either way.
    async fn upsert_subscription(&self, sub: SubscriptionRecord) -> Result<SubscriptionState>;

    /// The purge-and-fence: deletes every unfinished delivery of the subscription and of its
    /// dead-letter sink's lane ([`sink_uid`]) and tombstones both, in one transaction.
    /// Returns the number of deliveries purged.
    async fn remove_subscription(&self, uid: &str) -> Result<u64>;

    /// Disables or re-enables (which also resets the consecutive-failure count).
    async fn set_disabled(&self, uid: &str, disabled: bool) -> Result<SubscriptionState>;

    async fn subscription_state(&self, uid: &str) -> Result<Option<SubscriptionState>>;

    /// Every live subscription, to match a configuration to what the store holds after a
    /// restart.
    async fn live_subscriptions(&self) -> Result<Vec<SubscriptionRecord>>;

    /// Stores the event and one pending delivery per live target, atomically; an event id
    /// already published in the namespace writes nothing and returns the first answer.
    async fn publish(&self, event: NewEvent, targets: Vec<String>) -> Result<PublishResult>;

    /// Publishes several events in one transaction, each as [`Store::publish`] would (an id
    /// published before, or earlier in the batch, writes nothing and answers the first
    /// publish's figures): all of them committed, or on an error none. Answers in
    /// `publishes`' order.
    async fn publish_batch(
        &self,
        publishes: Vec<(NewEvent, Vec<String>)>,
    ) -> Result<Vec<PublishResult>>;

    /// [`Store::publish`], and in the same transaction, for each `(uid, fence)` of `claims`
    /// that got a delivery now, the claim [`Store::claim_next`] (or with a fence
    /// [`Store::claim_fenced`]) would make at the event's publish time. The engine asks this
    /// for lanes it started with the publish, so that an idle lane's first attempt costs no
    /// claim of its own. A store that cannot do both in one transaction claims nothing, and
    /// the engine then wakes those lanes as usual.
    ///
    /// `held`: shards the publishing replica holds (at those epochs) and whose lanes it
    /// wakes itself once the publish returns. A store that tells other replicas of new work
    /// need not tell them of deliveries in a shard whose owner is still at the epoch given
    /// here when the publish commits: whoever takes the shard after that wakes all its lanes.
    async fn publish_and_claim(
        &self,
        event: NewEvent,
        targets: Vec<String>,
        claims: Vec<(String, Option<ShardFence>)>,
        held: Vec<ShardFence>,
    ) -> Result<(PublishResult, Vec<Claimed>)> {
        let _ = (claims, held);
        Ok((self.publish(event, targets).await?, Vec::new()))
    }

    /// Whether [`Store::publish_and_claim`] claims: if not, the engine asks it for nothing.
    fn claims_with_publish(&self) -> bool {
        false
    }

    /// Ok while the store can commit; after a write failed for want of space or I/O, Ok only
    /// once a synced commit succeeds again (for /readyz).
    async fn check_writable(&self) -> Result<()> {
        Ok(())
    }

    /// The first answer to an event id already published in the namespace (as a duplicate
    /// publish would return it), without writing anything.
    async fn published(&self, namespace: &str, event_id: &str) -> Result<Option<PublishResult>>;

    /// The fence: claims the subscription's next due delivery if the subscription is live,
    /// enabled and unpaused, in one transaction.
    async fn claim_next(&self, uid: &str, now_ms: i64) -> Result<Claim>;

    /// As [`Store::claim_next`], and only while `fence.epoch` is the shard's current epoch
    /// (see [`Store::take_shard`]), in the same transaction.
    async fn claim_fenced(&self, uid: &str, now_ms: i64, fence: ShardFence) -> Result<Claim> {
        let _ = (uid, now_ms, fence);
        Err(Error::Backend("this store does not fence by shard".into()))
    }

    /// Undoes a fenced claim whose attempt was never sent (the replica lost the shard between
    /// claim and send): the delivery is due again and the claim's attempt is not counted.
    /// Only while the delivery is still in flight under that claim (`attempt` is the claim's
    /// attempt number): one that a take-over made due again, or that another replica claimed
    /// since, is left alone. Returns whether the claim was undone.
    async fn unclaim(&self, delivery_id: i64, attempt: u32) -> Result<bool> {
        let _ = (delivery_id, attempt);
        Err(Error::Backend("this store does not fence by shard".into()))
    }

    /// Records that `holder` took `shard` at lease `epoch`, if that epoch is newer than the
    /// one recorded: from then on only claims with this epoch succeed, and the shard's
    /// attempts that were in flight under an older epoch are due again (their replica may be
    /// gone; if it was only paused, its late completions are stale and only kept as history).
    /// Every taking is kept in the shard history. Returns whether it was recorded.
    async fn take_shard(&self, shard: u32, holder: &str, epoch: i64, now_ms: i64) -> Result<bool> {
        let _ = (shard, holder, epoch, now_ms);
        Err(Error::Backend("this store does not fence by shard".into()))
    }

    /// With several processes sharing the store: what other processes (and this one) gave
    /// new due work, as their commits happen, coalesced. None for a store only one process
    /// uses. After [`NewWork::unknown`] some notices may have been missed.
    fn new_work(&self) -> Option<NewWorkFeed> {
        None
    }

    /// Every recorded taking of a shard, oldest first.
    async fn shard_history(&self) -> Result<Vec<ShardTaking>> {
        Err(Error::Backend("this store does not fence by shard".into()))
    }

    /// Records an attempt and moves its delivery on, only while the delivery is in flight
    /// under `claim` (see [`ClaimRef`]). A stale claim's attempt is kept in the history (its
    /// message says it was superseded) and changes neither the delivery nor the counters; a
    /// delivery purged meanwhile stays gone.
    ///
    /// With `then_claim` (the time now), when the attempt delivered its event and was
    /// recorded, the subscription's next due delivery is claimed in the same round trip, by
    /// the rules of a claim ([`Store::claim_fenced`]: live, not paused, not disabled, under
    /// the same fence): a lane with a backlog goes from one delivery to the next without a
    /// claim of its own.
    async fn complete_and_claim(
        &self,
        claim: ClaimRef,
        attempt: AttemptRecord,
        next: Next,
        then_claim: Option<i64>,
    ) -> Result<(Completion, Option<Claimed>)>;

    /// [`Store::complete_and_claim`] without the claim.
    async fn complete(
        &self,
        claim: ClaimRef,
        attempt: AttemptRecord,
        next: Next,
    ) -> Result<Completion> {
        Ok(self.complete_and_claim(claim, attempt, next, None).await?.0)
    }

    /// [`Store::complete`] of an attempt after which its delivery is dead (`next` is
    /// [`Next::DeadLetter`] or [`Next::Gone`]) and, when it is recorded, the publish of
    /// `letter` to the lane `sink` (which sends dead letters to the subscription's sink), in
    /// the same transaction: a letter is queued exactly when a death is recorded. A publish
    /// of an id already stored writes nothing (a record retried after its answer was lost),
    /// nor does one to a lane that is not live; [`Completion::letter_queued`] says which.
    async fn complete_dead_letter(
        &self,
        claim: ClaimRef,
        attempt: AttemptRecord,
        next: Next,
        letter: NewEvent,
        sink: String,
    ) -> Result<Completion>;

    /// After a restart: deliveries that were on the wire become due again (at least once).
    async fn recover_in_flight(&self, now_ms: i64) -> Result<u64>;

    /// Live subscriptions with unfinished deliveries: (uid, namespace, count).
    async fn pending_by_subscription(&self) -> Result<Vec<(String, String, u64)>>;

    /// What each namespace's stored events count against its byte budget ([`stored_cost`]
    /// of every event kept), by namespace.
    async fn stored_bytes(&self) -> Result<Vec<(String, u64)>>;

    /// Free space left where the store keeps its data, when the store can tell (the
    /// embedded store; a PostgreSQL server's disk is not herald's to see).
    fn free_bytes(&self) -> Option<u64> {
        None
    }

    async fn list_deliveries(
        &self,
        uid: &str,
        filter: StateFilter,
        limit: u32,
    ) -> Result<Vec<DeliveryView>>;

    /// Attempt history of one event's delivery to one subscription, oldest first.
    async fn attempts(&self, uid: &str, event_id: &str) -> Result<Vec<AttemptRecord>>;

    /// Attempts of a namespace's subscriptions that `search` selects, newest first, a page
    /// at a time (see [`SEARCH_SCAN_ROWS`]).
    async fn search_attempts(&self, search: AttemptSearch) -> Result<AttemptPage>;

    /// Re-queues the dead letters `which` selects with a fresh retry budget. Returns how
    /// many.
    async fn replay(&self, uid: &str, which: Replay, now_ms: i64) -> Result<u64>;

    /// Drops history, finished deliveries and unreferenced events older than the cutoff.
    async fn prune(&self, older_than_ms: i64) -> Result<u64>;
}

/// Cuts a response body to the history excerpt, on a character boundary.
pub fn excerpt(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(&body[..body.len().min(EXCERPT_BYTES)]);
    let mut text = text.into_owned();
    while text.len() > EXCERPT_BYTES {
        text.pop();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn new_work_is_gathered_and_bounded() {
        let (notices, feed) = new_work_feed();
        assert!(notices.subscriptions(["a", "b"]));
        assert!(notices.subscriptions(["b", "c"]));
        assert!(notices.event("shop", "order.created"));
        let work = feed.next().await;
        assert_eq!(
            work.subscriptions,
            ["a", "b", "c"].map(String::from).into_iter().collect()
        );
        assert_eq!(work.events.len(), 1);
        assert!(!work.unknown);
        // More than the feed holds: one "look at everything", and nothing more kept.
        let many: Vec<String> = (0..=NEW_WORK_HELD).map(|i| i.to_string()).collect();
        assert!(notices.subscriptions(many.iter().map(String::as_str)));
        assert!(notices.subscriptions(["d"]));
        let work = feed.next().await;
        assert!(work.unknown && work.subscriptions.is_empty(), "{work:?}");
        // A reader that is gone stops the listener.
        drop(feed);
        assert!(!notices.unknown());
    }

    #[test]
    fn excerpt_is_at_most_512_bytes_on_a_char_boundary() {
        assert_eq!(super::excerpt(b"short"), "short");
        let long = "é".repeat(600);
        let cut = super::excerpt(long.as_bytes());
        assert!(cut.len() <= super::EXCERPT_BYTES);
        assert!(cut.chars().all(|c| c == 'é' || c == '\u{FFFD}'));
    }
}
