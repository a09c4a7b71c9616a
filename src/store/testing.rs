//! The one test double of the store, for unit tests of what sits on it (the engine, the
//! HTTP front): the real SQLite store in a temporary folder, with faults switched on by the
//! test. End-to-end tests use the real stores only.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use super::sqlite::SqliteStore;
use super::*;
use crate::delivery::shards::Ownership;

/// The SQLite store, with faults:
/// - `down`: every operation fails, as when the disk is gone;
/// - `failures`: `complete` fails that many times (a full disk);
/// - `lapse_during_claim`: a fenced claim (alone, with its publish or with a completion)
///   ends the replica's hold of the shard while it is on its way (a pause, a late renewal);
/// - `free`: the free space it reports (u64::MAX: the real folder's).
/// - `claim_gate`: the next claim that claims something says so on the first channel and
///   answers only once the second one fires (what the engine does meanwhile, the test does).
///
/// `upserted` lists the uids of subscription upserts, in order.
///
/// With `claim_with_publish` it claims with a publish as SQLite does (and counts those
/// claims); without, it says it cannot, as the PostgreSQL store does.
pub struct FaultyStore {
    inner: SqliteStore,
    dir: PathBuf,
    pub down: AtomicBool,
    pub failures: AtomicU32,
    pub lapse_during_claim: Mutex<Option<Arc<Ownership>>>,
    pub claim_with_publish: bool,
    pub claimed_with_publish: AtomicU32,
    pub claims_next: AtomicU32,
    pub claimed_with_completion: AtomicU32,
    pub free: AtomicU64,
    pub upserted: Mutex<Vec<String>>,
    #[allow(clippy::type_complexity)]
    pub claim_gate: Mutex<
        Option<(
            tokio::sync::oneshot::Sender<()>,
            tokio::sync::oneshot::Receiver<()>,
        )>,
    >,
}

impl FaultyStore {
    /// A store in a new temporary folder, removed when the store is dropped.
    pub fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("herald-store-{}", uuid::Uuid::now_v7()));
        Self {
            inner: SqliteStore::open(&dir).unwrap(),
            dir,
            down: AtomicBool::new(false),
            failures: AtomicU32::new(0),
            lapse_during_claim: Mutex::new(None),
            claim_with_publish: false,
            claimed_with_publish: AtomicU32::new(0),
            claims_next: AtomicU32::new(0),
            claimed_with_completion: AtomicU32::new(0),
            free: AtomicU64::new(u64::MAX),
            upserted: Mutex::default(),
            claim_gate: Mutex::default(),
        }
    }

    /// A store whose disk is gone: every operation fails.
    pub fn broken() -> Self {
        let store = Self::new();
        store.down.store(true, Ordering::SeqCst);
        store
    }

    fn up(&self) -> Result<()> {
        if self.down.load(Ordering::SeqCst) {
            return Err(Error::Unavailable("disk I/O error".into()));
        }
        Ok(())
    }

    fn lapse(&self, fence: ShardFence) {
        if let Some(ownership) = self.lapse_during_claim.lock().unwrap().take() {
            ownership.hold(fence.shard, fence.epoch, std::time::Instant::now());
        }
    }
}

impl Default for FaultyStore {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for FaultyStore {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[async_trait]
impl Store for FaultyStore {
    async fn upsert_subscription(&self, s: SubscriptionRecord) -> Result<SubscriptionState> {
        self.up()?;
        self.upserted.lock().unwrap().push(s.uid.clone());
        self.inner.upsert_subscription(s).await
    }
    async fn remove_subscription(&self, uid: &str) -> Result<u64> {
        self.up()?;
        self.inner.remove_subscription(uid).await
    }
    async fn set_disabled(&self, uid: &str, d: bool) -> Result<SubscriptionState> {
        self.up()?;
        self.inner.set_disabled(uid, d).await
    }
    async fn subscription_state(&self, uid: &str) -> Result<Option<SubscriptionState>> {
        self.up()?;
        self.inner.subscription_state(uid).await
    }
    async fn live_subscriptions(&self) -> Result<Vec<SubscriptionRecord>> {
        self.up()?;
        self.inner.live_subscriptions().await
    }
    async fn publish(&self, e: NewEvent, t: Vec<String>) -> Result<PublishResult> {
        self.up()?;
        self.inner.publish(e, t).await
    }
    async fn publish_batch(
        &self,
        publishes: Vec<(NewEvent, Vec<String>)>,
    ) -> Result<Vec<PublishResult>> {
        self.up()?;
        self.inner.publish_batch(publishes).await
    }
    async fn publish_and_claim(
        &self,
        e: NewEvent,
        t: Vec<String>,
        claims: Vec<(String, Option<ShardFence>)>,
        held: Vec<ShardFence>,
    ) -> Result<(PublishResult, Vec<Claimed>)> {
        assert!(
            self.claim_with_publish || claims.is_empty(),
            "asked to claim by a store that says it cannot"
        );
        self.up()?;
        let fences: Vec<ShardFence> = claims.iter().filter_map(|(_, f)| *f).collect();
        let (result, claimed) = self.inner.publish_and_claim(e, t, claims, held).await?;
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
    async fn check_writable(&self) -> Result<()> {
        self.up()?;
        self.inner.check_writable().await
    }
    async fn published(&self, ns: &str, id: &str) -> Result<Option<PublishResult>> {
        self.up()?;
        self.inner.published(ns, id).await
    }
    async fn claim_next(&self, uid: &str, now: i64) -> Result<Claim> {
        self.up()?;
        self.claims_next.fetch_add(1, Ordering::AcqRel);
        let claim = self.inner.claim_next(uid, now).await;
        if matches!(claim, Ok(Claim::Claimed(_))) {
            let gate = self.claim_gate.lock().unwrap().take();
            if let Some((reached, go)) = gate {
                let _ = reached.send(());
                let _ = go.await;
            }
        }
        claim
    }
    async fn claim_fenced(&self, uid: &str, now: i64, f: ShardFence) -> Result<Claim> {
        self.up()?;
        let claim = self.inner.claim_fenced(uid, now, f).await;
        if matches!(claim, Ok(Claim::Claimed(_))) {
            self.lapse(f);
        }
        claim
    }
    async fn unclaim(&self, id: i64, attempt: u32) -> Result<bool> {
        self.up()?;
        self.inner.unclaim(id, attempt).await
    }
    async fn take_shard(&self, s: u32, h: &str, e: i64, now: i64) -> Result<bool> {
        self.up()?;
        self.inner.take_shard(s, h, e, now).await
    }
    async fn complete_and_claim(
        &self,
        c: ClaimRef,
        a: AttemptRecord,
        n: Next,
        then_claim: Option<i64>,
    ) -> Result<(Completion, Option<Claimed>)> {
        self.up()?;
        if self
            .failures
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |f| f.checked_sub(1))
            .is_ok()
        {
            return Err(Error::Unavailable("database or disk is full".into()));
        }
        let (completion, claimed) = self.inner.complete_and_claim(c, a, n, then_claim).await?;
        if claimed.is_some() {
            self.claimed_with_completion.fetch_add(1, Ordering::AcqRel);
            if let Some(fence) = c.fence {
                self.lapse(fence);
            }
        }
        Ok((completion, claimed))
    }
    async fn complete_dead_letter(
        &self,
        c: ClaimRef,
        a: AttemptRecord,
        n: Next,
        letter: NewEvent,
        sink: String,
    ) -> Result<Completion> {
        self.up()?;
        self.inner.complete_dead_letter(c, a, n, letter, sink).await
    }
    async fn recover_in_flight(&self, now: i64) -> Result<u64> {
        self.up()?;
        self.inner.recover_in_flight(now).await
    }
    async fn pending_by_subscription(&self) -> Result<Vec<(String, String, u64)>> {
        self.up()?;
        self.inner.pending_by_subscription().await
    }
    async fn stored_bytes(&self) -> Result<Vec<(String, u64)>> {
        self.up()?;
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
    ) -> Result<Vec<DeliveryView>> {
        self.up()?;
        self.inner.list_deliveries(uid, f, l).await
    }
    async fn attempts(&self, uid: &str, id: &str) -> Result<Vec<AttemptRecord>> {
        self.up()?;
        self.inner.attempts(uid, id).await
    }
    async fn search_attempts(&self, search: AttemptSearch) -> Result<AttemptPage> {
        self.up()?;
        self.inner.search_attempts(search).await
    }
    async fn replay(&self, uid: &str, which: Replay, now: i64) -> Result<u64> {
        self.up()?;
        self.inner.replay(uid, which, now).await
    }
    async fn prune(&self, before: i64) -> Result<u64> {
        self.up()?;
        self.inner.prune(before).await
    }
}
