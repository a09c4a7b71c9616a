//! A [`Store`] wrapper that times every operation into
//! `herald_store_operation_duration_seconds{operation}`, for any backend.

use std::future::Future;

use async_trait::async_trait;

use super::*;

pub struct Timed<S>(pub S);

async fn timed<T>(operation: &str, work: impl Future<Output = T>) -> T {
    let timer = crate::metrics::get()
        .store_duration
        .with_label_values(&[operation])
        .start_timer();
    let out = work.await;
    timer.observe_duration();
    out
}

#[async_trait]
impl<S: Store> Store for Timed<S> {
    async fn upsert_subscription(&self, sub: SubscriptionRecord) -> Result<SubscriptionState> {
        timed("upsert_subscription", self.0.upsert_subscription(sub)).await
    }
    async fn remove_subscription(&self, uid: &str) -> Result<u64> {
        timed("remove_subscription", self.0.remove_subscription(uid)).await
    }
    async fn set_disabled(&self, uid: &str, disabled: bool) -> Result<SubscriptionState> {
        timed("set_disabled", self.0.set_disabled(uid, disabled)).await
    }
    async fn subscription_state(&self, uid: &str) -> Result<Option<SubscriptionState>> {
        timed("subscription_state", self.0.subscription_state(uid)).await
    }
    async fn live_subscriptions(&self) -> Result<Vec<SubscriptionRecord>> {
        timed("live_subscriptions", self.0.live_subscriptions()).await
    }
    async fn publish(&self, event: NewEvent, targets: Vec<String>) -> Result<PublishResult> {
        timed("publish", self.0.publish(event, targets)).await
    }
    async fn publish_batch(
        &self,
        publishes: Vec<(NewEvent, Vec<String>)>,
    ) -> Result<Vec<PublishResult>> {
        timed("publish_batch", self.0.publish_batch(publishes)).await
    }
    async fn publish_and_claim(
        &self,
        event: NewEvent,
        targets: Vec<String>,
        claims: Vec<(String, Option<ShardFence>)>,
        held: Vec<ShardFence>,
    ) -> Result<(PublishResult, Vec<Claimed>)> {
        timed(
            "publish",
            self.0.publish_and_claim(event, targets, claims, held),
        )
        .await
    }
    fn claims_with_publish(&self) -> bool {
        self.0.claims_with_publish()
    }
    async fn check_writable(&self) -> Result<()> {
        timed("check_writable", self.0.check_writable()).await
    }
    async fn published(&self, namespace: &str, event_id: &str) -> Result<Option<PublishResult>> {
        timed("published", self.0.published(namespace, event_id)).await
    }
    async fn claim_next(&self, uid: &str, now_ms: i64) -> Result<Claim> {
        timed("claim_next", self.0.claim_next(uid, now_ms)).await
    }
    async fn claim_fenced(&self, uid: &str, now_ms: i64, fence: ShardFence) -> Result<Claim> {
        timed("claim_next", self.0.claim_fenced(uid, now_ms, fence)).await
    }
    async fn unclaim(&self, delivery_id: i64, attempt: u32) -> Result<bool> {
        timed("unclaim", self.0.unclaim(delivery_id, attempt)).await
    }
    async fn take_shard(&self, shard: u32, holder: &str, epoch: i64, now_ms: i64) -> Result<bool> {
        timed(
            "take_shard",
            self.0.take_shard(shard, holder, epoch, now_ms),
        )
        .await
    }
    async fn shard_history(&self) -> Result<Vec<ShardTaking>> {
        self.0.shard_history().await
    }
    fn new_work(&self) -> Option<NewWorkFeed> {
        self.0.new_work()
    }
    async fn complete_and_claim(
        &self,
        claim: ClaimRef,
        attempt: AttemptRecord,
        next: Next,
        then_claim: Option<i64>,
    ) -> Result<(Completion, Option<Claimed>)> {
        timed(
            "complete",
            self.0.complete_and_claim(claim, attempt, next, then_claim),
        )
        .await
    }
    async fn complete_dead_letter(
        &self,
        claim: ClaimRef,
        attempt: AttemptRecord,
        next: Next,
        letter: NewEvent,
        sink: String,
    ) -> Result<Completion> {
        timed(
            "complete_dead_letter",
            self.0
                .complete_dead_letter(claim, attempt, next, letter, sink),
        )
        .await
    }
    async fn recover_in_flight(&self, now_ms: i64) -> Result<u64> {
        timed("recover_in_flight", self.0.recover_in_flight(now_ms)).await
    }
    async fn pending_by_subscription(&self) -> Result<Vec<(String, String, u64)>> {
        timed("pending_by_subscription", self.0.pending_by_subscription()).await
    }
    async fn stored_bytes(&self) -> Result<Vec<(String, u64)>> {
        timed("stored_bytes", self.0.stored_bytes()).await
    }
    fn free_bytes(&self) -> Option<u64> {
        self.0.free_bytes()
    }
    async fn list_deliveries(
        &self,
        uid: &str,
        filter: StateFilter,
        limit: u32,
    ) -> Result<Vec<DeliveryView>> {
        timed(
            "list_deliveries",
            self.0.list_deliveries(uid, filter, limit),
        )
        .await
    }
    async fn attempts(&self, uid: &str, event_id: &str) -> Result<Vec<AttemptRecord>> {
        timed("attempts", self.0.attempts(uid, event_id)).await
    }
    async fn search_attempts(&self, search: AttemptSearch) -> Result<AttemptPage> {
        timed("search_attempts", self.0.search_attempts(search)).await
    }
    async fn replay(&self, uid: &str, which: Replay, now_ms: i64) -> Result<u64> {
        timed("replay", self.0.replay(uid, which, now_ms)).await
    }
    async fn prune(&self, older_than_ms: i64) -> Result<u64> {
        timed("prune", self.0.prune(older_than_ms)).await
    }
}
