//! One path for every attempt: claim → fence → send → decide → record → release. An attempt
//! begins in one of two ways, which meet once the delivery is claimed: dispatched by the
//! scheduler, it claims its lane's next due delivery itself; started with a publish (an
//! idle lane under its namespace's floor, see [`Scheduler::start_idle`]), the publish's
//! transaction made the claim. After a delivery, while nobody waits for its slot
//! ([`Scheduler::may_go_on`]), the record also claims the lane's next due delivery and the
//! attempt goes round again with it, so a lane with a backlog needs one store call per
//! delivery.
//!
//! [`Scheduler::may_go_on`]: crate::delivery::scheduler::Scheduler::may_go_on
//! [`Scheduler::start_idle`]: crate::delivery::scheduler::Scheduler::start_idle

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tracing::Instrument;

use super::fence::{Fence, NotHeld};
use super::{Engine, Notice};
use crate::delivery::clock::now_ms;
use crate::delivery::http::{AttemptResult, Target};
use crate::delivery::outcome::Outcome;
use crate::delivery::retry::{self, Decision};
use crate::delivery::{SubscriptionConfig, dead_letter, format, trace};
use crate::store::{self, AttemptRecord, Claim, Claimed, Completion, Next};

/// A slot of a lane, taken from the scheduler, that one attempt runs in.
pub(super) struct Slot {
    pub config: Arc<SubscriptionConfig>,
    /// The lane's wake count when the slot was taken: a lane whose shard is not held here,
    /// or whose claim is given back unsent, rests only while no wake came after it.
    pub epoch: u64,
}

/// How the attempt's delivery is claimed.
pub(super) enum Claiming {
    /// The lane's next due delivery, claimed by the attempt (dispatched by the scheduler).
    Next,
    /// Claimed by its publish's transaction under `fence`, taken then.
    WithPublish { claimed: Claimed, fence: Fence },
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
    /// Runs one attempt in `slot` as its own task, counted for [`Engine::drain`].
    pub(super) fn start_attempt(self: &Arc<Self>, slot: Slot, claiming: Claiming) {
        self.running.fetch_add(1, Ordering::AcqRel);
        let engine = self.clone();
        tokio::spawn(async move { engine.attempt(slot, claiming).await });
    }

    async fn attempt(self: Arc<Self>, slot: Slot, claiming: Claiming) {
        let _running = Running(&self);
        let mut config = slot.config.clone();

        // Claim.
        let (mut claimed, fence) = match claiming {
            Claiming::Next => match self.claim(&slot).await {
                Some(claimed) => claimed,
                None => return,
            },
            Claiming::WithPublish { claimed, fence } => (claimed, fence),
        };
        // Removed or held (paused, disabled) while the claim was on its way: not sent, as
        // after a record below. A removal that returned has forgotten the lane, so no
        // attempt it did not see starts after it.
        match self.current(&config.uid) {
            Some(latest) => config = latest,
            None => {
                self.unclaim(&config, &claimed, &fence).await;
                self.rest(&config, slot.epoch);
                return;
            }
        }

        loop {
            // Fence: nothing is sent once stopping, or when the shard's hold ended while the
            // claim was on its way (the process was paused, the renewal was late); the
            // delivery is due again, for whoever holds the shard.
            if !fence.holds() || self.stopping.load(Ordering::Acquire) {
                self.unclaim(&config, &claimed, &fence).await;
                self.rest(&config, slot.epoch);
                return;
            }

            // Send. One span per attempt: who and which event, never the secret or the
            // payload.
            let span = tracing::info_span!(
                "attempt",
                namespace = %config.namespace,
                subscription = %config.name,
                event_id = %claimed.event_id,
                attempt = claimed.attempt,
            );
            let started_ms = now_ms();
            let result = self.send(&config, &claimed).instrument(span.clone()).await;

            // Decide.
            let now = now_ms();
            let (next, message) = decide(&config, &claimed, &result, now);
            if let Some(status @ (429 | 502 | 504)) = result.status {
                self.slow_down(&config, status, &result, now);
            }
            let record = AttemptRecord {
                at_ms: now,
                outcome: result.outcome.as_str().to_string(),
                status_code: result.status,
                latency_ms: result.latency.as_millis() as u64,
                message: store::excerpt(message.as_bytes()),
            };

            // Record. After a delivery, the lane's next due delivery is claimed with the
            // record when the lane may go on in this slot (no one waits for it). A wake
            // before the record (a publish, a timer, a replay) is for work committed before
            // it, which the record's answer covers.
            let (go_on, epoch) = self.before_record(&config, next);
            let (completion, following) = self
                .record(&config, &claimed, &record, next, go_on)
                .instrument(span.clone())
                .await;
            span.in_scope(|| {
                tracing::debug!(
                    outcome = result.outcome.as_str(),
                    status = result.status,
                    latency_ms = record.latency_ms,
                    next = ?next,
                    "attempt finished"
                )
            });
            record_metrics(&config, &result, next, completion.as_ref().ok());

            // Release, unless going on.
            let latest = self.release(&config, epoch, next, &completion, following.is_some());
            self.tell(
                &config, &claimed, started_ms, &result, next, record, completion,
            );

            let Some(following) = following else {
                return;
            };
            match latest {
                Some(latest) => {
                    config = latest;
                    claimed = following;
                }
                // Removed or held while the record was made: not sent.
                None => {
                    self.unclaim(&config, &following, &fence).await;
                    self.rest(&config, slot.epoch);
                    return;
                }
            }
        }
    }

    /// The receiver answered `status` (429, 502, 504): the lane's pace halves for a while,
    /// and listeners (the status writer) hear of it. Without a pace yet, the lane is taken
    /// to have gone at its width over this answer's latency.
    fn slow_down(
        &self,
        config: &SubscriptionConfig,
        status: u16,
        result: &AttemptResult,
        now: i64,
    ) {
        let hint = f64::from(config.width) / result.latency.as_secs_f64().max(0.001);
        let (per_second, until_ms) = self.lock().slow_down(config, now, hint);
        tracing::info!(namespace = %config.namespace, subscription = %config.name, status, per_second, "the receiver asked to slow down: attempts paced");
        let _ = self.notices.send(Notice::Slowed {
            namespace: config.namespace.to_string(),
            name: config.name.to_string(),
            status_code: status,
            per_second,
            until_ms,
        });
    }

    /// Before an attempt's record: whether it may go on to the lane's next delivery in its
    /// slot (after a delivery, [`crate::delivery::scheduler::Scheduler::may_go_on`]), and
    /// the lane's wake count, as of which the record's answer rests the lane.
    fn before_record(&self, config: &SubscriptionConfig, next: Next) -> (bool, u64) {
        let mut inner = self.lock();
        let go_on = next == Next::Delivered
            && !self.stopping.load(Ordering::Acquire)
            && inner.scheduler.may_go_on(&config.uid)
            && inner.take_pace(config, now_ms()).is_ok();
        (go_on, inner.scheduler.epoch(&config.uid))
    }

    /// Counts a recorded attempt (pending, retry timer) and, unless the attempt goes on
    /// (`going_on`), gives its slot back. The completion said when the lane's next delivery
    /// is due: the lane claims again at once only if one is due now, and otherwise rests
    /// with a timer for it, unless something woke it after wake count `epoch`, taken before
    /// the record (that wake may be for work the completion did not see). Not recorded, it
    /// claims to find out. Returns the configuration the lane runs now, unless it is gone
    /// or held.
    fn release(
        &self,
        config: &SubscriptionConfig,
        epoch: u64,
        next: Next,
        completion: &store::Result<Completion>,
        going_on: bool,
    ) -> Option<Arc<SubscriptionConfig>> {
        let uid = &*config.uid;
        let mut inner = self.lock();
        inner.states.remove(uid);
        let due_now = match completion {
            Ok(done) if done.recorded => {
                match next {
                    Next::Retry { due_ms } => inner.add_timer(uid, due_ms),
                    Next::Delivered | Next::DeadLetter | Next::Gone => {
                        inner.pending_sub(&config.namespace, 1)
                    }
                }
                // Its letter waits for the sink's lane.
                if done.letter_queued {
                    *inner
                        .pending
                        .entry(config.namespace.to_string())
                        .or_default() += 1;
                    self.wake_for_work(&mut inner, &crate::delivery::sink_uid(uid));
                }
                match done.next_due_ms {
                    Some(at) if at > now_ms() => {
                        inner.add_timer(uid, at);
                        false
                    }
                    Some(_) => true,
                    None => false,
                }
            }
            Ok(_) => {
                tracing::info!(
                    namespace = %config.namespace,
                    subscription = %config.name,
                    "the attempt's outcome was not applied: its delivery was removed, or claimed again meanwhile (a shard take-over); it is kept in the history"
                );
                true
            }
            Err(e) => {
                tracing::error!(error = %e, "recording an attempt failed while stopping; it is made again after the next start");
                true
            }
        };
        let latest = inner.subs.get(uid).filter(|c| !c.held()).cloned();
        if !going_on {
            if due_now {
                inner.scheduler.wake(uid);
            } else {
                inner.scheduler.idle(uid, epoch);
            }
            inner.scheduler.release(uid, &config.namespace);
            drop(inner);
            self.wakeup.notify_one();
        }
        latest
    }

    /// The configuration lane `uid` runs now, unless it is removed or held.
    fn current(&self, uid: &str) -> Option<Arc<SubscriptionConfig>> {
        self.lock().subs.get(uid).filter(|c| !c.held()).cloned()
    }

    /// Gives the slot back after a claim that was not sent: the lane rests unless woken since
    /// the slot was taken.
    fn rest(&self, config: &SubscriptionConfig, epoch: u64) {
        let mut inner = self.lock();
        inner.scheduler.idle(&config.uid, epoch);
        inner.scheduler.release(&config.uid, &config.namespace);
        drop(inner);
        self.wakeup.notify_one();
    }

    /// Claims the lane's next due delivery under a fence taken now. None when there is
    /// nothing to send: stopping, the shard is not held here, nothing is due (a timer is set
    /// for what is due later), or the store failed (tried again in a second); the slot has
    /// then been given back.
    async fn claim(&self, slot: &Slot) -> Option<(Claimed, Fence)> {
        let config = &slot.config;
        let uid = &*config.uid;
        let rest = |epoch: u64, next_due_ms: Option<i64>| {
            let mut inner = self.lock();
            inner.scheduler.idle(uid, epoch);
            inner.scheduler.release(uid, &config.namespace);
            if let Some(at) = next_due_ms {
                inner.add_timer(uid, at);
            }
            drop(inner);
            self.wakeup.notify_one();
        };
        if self.stopping.load(Ordering::Acquire) {
            self.lock().scheduler.release(uid, &config.namespace);
            return None;
        }
        let fence = match Fence::take(self.ownership.get(), uid) {
            Ok(fence) => fence,
            // Not this replica's shard (now): the lane rests until the shard is taken.
            Err(NotHeld { shard }) => {
                tracing::debug!(
                    target: "herald::shards",
                    namespace = %config.namespace,
                    subscription = %config.name,
                    shard,
                    "due work in a shard this replica does not hold: not started"
                );
                rest(slot.epoch, None);
                return None;
            }
        };
        // The lane's pace (a rate limit, a slow-down) first: when it allows nothing now, the
        // lane waits for it without asking the store anything, however often it is woken.
        let epoch = {
            let mut inner = self.lock();
            if let Err(at) = inner.take_pace(config, now_ms()) {
                inner.scheduler.pace(uid);
                inner.scheduler.release(uid, &config.namespace);
                inner.add_timer(uid, at);
                drop(inner);
                self.wakeup.notify_one();
                return None;
            }
            // A wake before the claim is for work committed before it, which its answer
            // covers.
            inner.scheduler.epoch(uid)
        };
        let claim = match fence.token() {
            None => self.store.claim_next(uid, now_ms()).await,
            Some(token) => self.store.claim_fenced(uid, now_ms(), token).await,
        };
        match claim {
            Ok(Claim::Claimed(claimed)) => Some((claimed, fence)),
            Ok(Claim::Idle { next_due_ms }) => {
                rest(epoch, next_due_ms);
                None
            }
            Err(e) => {
                tracing::warn!(error = %e, subscription = %config.name, namespace = %config.namespace, "claim failed; retrying in 1s");
                let mut inner = self.lock();
                inner.scheduler.release(uid, &config.namespace);
                inner.add_timer(uid, now_ms() + 1000);
                drop(inner);
                self.wakeup.notify_one();
                None
            }
        }
    }

    /// Gives back a claim that must not be sent, retrying while the store cannot take it
    /// (as a record is retried): left in flight, the delivery would wait for the next
    /// take-over or start if the hold only lapsed and comes back.
    async fn unclaim(&self, config: &SubscriptionConfig, claimed: &Claimed, fence: &Fence) {
        let mut backoff = Duration::from_millis(100);
        loop {
            match self
                .store
                .unclaim(claimed.delivery_id, claimed.attempt)
                .await
            {
                Ok(undone) => {
                    match fence.token().filter(|_| !fence.holds()) {
                        Some(token) => tracing::debug!(
                            target: "herald::shards",
                            namespace = %config.namespace,
                            subscription = %config.name,
                            shard = token.shard,
                            epoch = token.epoch,
                            undone,
                            "the shard's hold ended during the claim: not started"
                        ),
                        None => tracing::debug!(
                            namespace = %config.namespace,
                            subscription = %config.name,
                            undone,
                            "stopping, or the lane removed or held, during the claim: not started"
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

    /// The signed POST.
    async fn send(&self, config: &SubscriptionConfig, claimed: &Claimed) -> AttemptResult {
        match &config.signer {
            Some(signer) => {
                // A span for an event that came with a trace context, a child of its.
                let trace = format::may_be_traced(&claimed.body)
                    .then(|| trace::stored(&claimed.body))
                    .flatten()
                    .map(|parent| {
                        trace::AttemptSpan::start(
                            &parent,
                            &config.namespace,
                            &config.name,
                            &claimed.event_id,
                            claimed.attempt,
                        )
                    });
                let target = Target {
                    url: &config.url,
                    signer,
                    timeout: config.timeout,
                    headers: &config.headers,
                    format: config.format,
                    namespace: &config.namespace,
                    trace: trace.as_ref(),
                };
                let result = self.sender.send(&target, claimed).await;
                if let Some(span) = trace {
                    span.end(
                        result.outcome.as_str(),
                        result.status,
                        result.outcome != Outcome::Accepted,
                    );
                }
                result
            }
            // The store holds a subscription without a signer as paused; this is a race
            // with a configuration change. Nothing was sent: try again later.
            None => AttemptResult {
                outcome: Outcome::Transient,
                status: None,
                retry_after: None,
                latency: Duration::ZERO,
                message: config.not_ready.clone().unwrap_or_default(),
                refused: false,
            },
        }
    }

    /// Records the attempt and what follows it, and with `go_on` claims the lane's next
    /// due delivery in the same round trip. Recording is not lost work: while the store
    /// cannot commit (a full disk) the record is retried, holding the lane's slot, so the
    /// delivery never stays "in flight" until a restart (and is not sent again because of
    /// it). Gives up only once stopping. A retried record claims nothing: the first try
    /// may have claimed a delivery whose answer was lost.
    async fn record(
        &self,
        config: &SubscriptionConfig,
        claimed: &Claimed,
        record: &AttemptRecord,
        next: Next,
        go_on: bool,
    ) -> (store::Result<Completion>, Option<Claimed>) {
        let mut then_claim = go_on.then(now_ms);
        let mut backoff = Duration::from_millis(100);
        // A death with a sink queues its letter in the same transaction.
        let letter = (next.is_dead() && config.dead_letter_sink.is_some())
            .then(|| dead_letter::letter(config, claimed, record));
        loop {
            let recorded = match &letter {
                Some(letter) => self
                    .store
                    .complete_dead_letter(
                        claimed.claim_ref(),
                        record.clone(),
                        next,
                        letter.clone(),
                        crate::delivery::sink_uid(&config.uid),
                    )
                    .await
                    .map(|completion| (completion, None)),
                None => {
                    self.store
                        .complete_and_claim(claimed.claim_ref(), record.clone(), next, then_claim)
                        .await
                }
            };
            match recorded {
                Ok((completion, following)) => return (Ok(completion), following),
                Err(e) if !self.stopping.load(Ordering::Acquire) => {
                    tracing::error!(error = %e, namespace = %config.namespace, subscription = %config.name, event_id = %claimed.event_id, retry_in_ms = backoff.as_millis() as u64, "recording an attempt failed; retrying the record");
                    then_claim = None;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
                Err(e) => return (Err(e), None),
            }
        }
    }

    /// Tells listeners (logs, status writers) how the attempt ended. The attempt notice is
    /// built only for a listener (in standalone mode there is none unless attempts are
    /// logged): it copies names, the event id and the message.
    #[allow(clippy::too_many_arguments)]
    fn tell(
        &self,
        config: &SubscriptionConfig,
        claimed: &Claimed,
        started_ms: i64,
        result: &AttemptResult,
        next: Next,
        record: AttemptRecord,
        completion: store::Result<Completion>,
    ) {
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
                    Next::DeadLetter | Next::Gone => "dead-letter",
                },
                message: record.message,
            });
        }
        if let Ok(done) = completion
            && done.disabled_now
        {
            if next == Next::Gone {
                tracing::warn!(namespace = %config.namespace, subscription = %config.name, "subscription disabled: the receiver answered 410 Gone");
            } else {
                tracing::warn!(namespace = %config.namespace, subscription = %config.name, failures = done.consecutive_failures, "subscription disabled after consecutive failures");
            }
            let _ = self.notices.send(Notice::Disabled {
                namespace: config.namespace.to_string(),
                name: config.name.to_string(),
                consecutive_failures: done.consecutive_failures,
            });
        }
    }
}

/// What follows an attempt's result, and the message its record keeps.
fn decide(
    config: &SubscriptionConfig,
    claimed: &Claimed,
    result: &AttemptResult,
    now_ms: i64,
) -> (Next, String) {
    match result.outcome {
        Outcome::Accepted => (Next::Delivered, result.message.clone()),
        Outcome::Terminal => (Next::DeadLetter, result.message.clone()),
        // A dead-letter sink that is gone drops the letter; nothing disables its lane.
        Outcome::Gone if config.is_sink_lane => (Next::DeadLetter, result.message.clone()),
        Outcome::Gone => (Next::Gone, result.message.clone()),
        Outcome::Transient => match retry::after_transient_failure(
            &config.limits,
            claimed.attempt,
            claimed.window_start_ms,
            now_ms,
            result.retry_after,
            rand::random::<f64>(),
        ) {
            Decision::RetryAt { due_ms } => (Next::Retry { due_ms }, result.message.clone()),
            Decision::GiveUp { reason } => (
                Next::DeadLetter,
                format!("{reason}; last: {}", result.message),
            ),
        },
    }
}

/// Counts a finished attempt in herald's metrics.
fn record_metrics(
    config: &SubscriptionConfig,
    result: &AttemptResult,
    next: Next,
    completion: Option<&Completion>,
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
            Outcome::Gone => "gone",
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
        if done.recorded && next.is_dead() {
            metrics.dead_letters.with_label_values(&[namespace]).inc();
        }
        if done.disabled_now {
            metrics.auto_disabled.with_label_values(&[namespace]).inc();
        }
    }
}
