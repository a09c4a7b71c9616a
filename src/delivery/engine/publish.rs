//! Publishing: fair admission per namespace, the quota checks and the reservation they
//! take (held until the store answers), and idle lanes started with their publish, whose
//! deliveries it claims in the same transaction.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::value::RawValue;

use super::attempt::{Claiming, Slot};
use super::fence::Fence;
use super::{Engine, EngineError, Notice, UNROUTED_NAMESPACE};
use crate::delivery::clock::now_ms;
use crate::delivery::format::Envelope;
use crate::delivery::trace;
use crate::store::{self, NewEvent, PublishResult, ShardFence};

/// How often each namespace's stored bytes are taken from the store again (pruning frees
/// them, other replicas add theirs), or twenty times what the last count took.
const STORED_RECOUNT: Duration = Duration::from_secs(10);

/// Where a published event comes from, beyond its body.
#[derive(Clone, Debug, Default)]
pub struct Origin<'a> {
    /// A published CloudEvent's `source`, kept for CloudEvents receivers.
    pub source: Option<&'a str>,
    /// The producer's trace context (its `traceparent` and `tracestate` headers), kept with
    /// the event for every attempt.
    pub trace: Option<trace::Parent>,
}

/// One event of a batch (see [`Engine::publish_batch`]).
#[derive(Clone, Debug)]
pub struct BatchEvent<'a> {
    pub id: Option<String>,
    pub event_type: &'a str,
    pub origin: Origin<'a>,
    pub data: &'a RawValue,
}

/// A namespace's turn at the door (fair admission), left on drop.
struct Admitted<'a>(&'a Engine, &'a str);

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        self.0.lock().admission.leave(self.1);
    }
}

/// An event made ready to store: its id, whether the producer gave it, and the body every
/// attempt sends.
struct Prepared {
    event: NewEvent,
    given: bool,
}

/// Pending attempts and stored bytes counted for publishes before the store has them;
/// whatever the store did not write (a duplicate id, a subscription removed meanwhile, a
/// failed write, a cancelled request) is given back on drop.
struct Reservation<'a> {
    engine: &'a Engine,
    namespace: &'a str,
    count: u64,
    bytes: u64,
}

impl<'a> Reservation<'a> {
    /// Nothing reserved yet.
    fn none(engine: &'a Engine, namespace: &'a str) -> Self {
        Self {
            engine,
            namespace,
            count: 0,
            bytes: 0,
        }
    }

    /// What the store wrote for one publish (`body_bytes` its body) stays counted.
    fn written(&mut self, body_bytes: u64, result: &PublishResult) {
        self.count -= (result.targets.len() as u64).min(self.count);
        if !result.duplicate {
            let written = store::stored_cost(body_bytes, result.targets.len() as u64);
            self.bytes -= written.min(self.bytes);
        }
    }
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

impl Engine {
    /// Fair admission: a flood from one namespace waits at the door, not in the store's
    /// queue ahead of everyone else.
    fn admit<'a>(&'a self, namespace: &'a str) -> Result<Admitted<'a>, EngineError> {
        let mut inner = self.lock();
        if !inner.admission.enter(namespace) {
            return Err(EngineError::Busy {
                namespace: namespace.to_string(),
                limit: inner.admission.limit(),
            });
        }
        Ok(Admitted(self, namespace))
    }

    /// The event as stored: its id (the producer's, or a new one) and its envelope.
    fn prepare(
        namespace: &str,
        id: Option<String>,
        event_type: &str,
        origin: &Origin<'_>,
        data: &RawValue,
    ) -> Result<Prepared, EngineError> {
        let given = id.is_some();
        let event_id = id.unwrap_or_else(|| format!("evt_{}", uuid::Uuid::now_v7().simple()));
        let published_ms = now_ms();
        let timestamp = k8s_openapi::jiff::Timestamp::from_millisecond(published_ms)
            .map(|t| t.to_string())
            .unwrap_or_default();
        let traceparent = origin.trace.as_ref().map(|t| trace::header(&t.context));
        let body = serde_json::to_vec(&Envelope {
            id: event_id.as_str().into(),
            kind: event_type.into(),
            timestamp: timestamp.as_str().into(),
            source: origin.source.map(Into::into),
            traceparent: traceparent.as_deref().map(Into::into),
            tracestate: origin
                .trace
                .as_ref()
                .and_then(|t| t.tracestate.as_deref())
                .map(Into::into),
            data,
        })
        .map_err(|e| store::Error::Backend(e.to_string()))?;
        Ok(Prepared {
            event: NewEvent {
                namespace: namespace.to_string(),
                event_id,
                event_type: event_type.to_string(),
                body,
                published_ms,
            },
            given,
        })
    }

    /// The quota checks for one event, and if it passes them, its pending attempts and
    /// stored bytes added to `reservation`: one step under the lock, so concurrent
    /// publishes cannot pass a limit together. Returns its targets and whether a
    /// subscription of this engine lives in the namespace.
    fn reserve(
        &self,
        inner: &mut super::Inner,
        reservation: &mut Reservation<'_>,
        event: &NewEvent,
        free: Option<u64>,
    ) -> Result<(Vec<String>, bool), EngineError> {
        let namespace = event.namespace.as_str();
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
            .filter(|uid| {
                inner
                    .subs
                    .get(*uid)
                    .is_some_and(|c| c.matches(&event.event_type))
            })
            .map(|uid| uid.to_string())
            .collect();
        let limit = inner
            .pending_limits
            .get(namespace)
            .copied()
            .unwrap_or(self.config.namespace_max_pending);
        let pending = inner.pending.get(namespace).copied().unwrap_or(0);
        let more = targets.len() as u64;
        let bytes = store::stored_cost(event.body.len() as u64, more);
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
            && free
                < reserve
                    .saturating_add(bytes)
                    .saturating_add(reservation.bytes)
        {
            Err(EngineError::StoreReserve { free, reserve })
        } else {
            if more > 0 {
                *inner.pending.entry(namespace.to_string()).or_default() += more;
            }
            *inner.stored.entry(namespace.to_string()).or_default() += bytes;
            reservation.count += more;
            reservation.bytes += bytes;
            Ok((targets, routed))
        }
    }

    /// What follows a store's answer to a publish: the metric, and the lanes it gave work
    /// woken (except those `started` with it, woken by their attempt's end).
    fn after_publish(
        &self,
        namespace: &str,
        routed: bool,
        result: &PublishResult,
        started: &[Arc<str>],
    ) {
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
            for uid in &result.targets {
                inner.states.remove(uid.as_str());
                if !started.iter().any(|s| **s == **uid) {
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
    }

    /// Accepts up to a batch of events in one store transaction: each as [`Engine::publish`]
    /// would, answered together once that commits. Each event meets the quotas in turn: one
    /// that would pass a limit is refused (its answer that error) and the rest go on. The
    /// whole batch is refused only at the door (the namespace busy) or when the store fails,
    /// and then nothing of it was written.
    pub async fn publish_batch(
        self: &Arc<Self>,
        namespace: &str,
        events: Vec<BatchEvent<'_>>,
    ) -> Result<Vec<Result<PublishResult, EngineError>>, EngineError> {
        let _admitted = self.admit(namespace)?;
        let free = self.store.free_bytes();
        let mut reservation = Reservation::none(self, namespace);
        let mut answers: Vec<Option<Result<PublishResult, EngineError>>> = Vec::new();
        // Per event accepted: its place in the answers, whether it is routed, its body's size.
        let mut accepted: Vec<(usize, bool, u64)> = Vec::new();
        let mut writes = Vec::new();
        let mut refused_ids = Vec::new();
        for (n, item) in events.into_iter().enumerate() {
            let prepared =
                Self::prepare(namespace, item.id, item.event_type, &item.origin, item.data)?;
            let reserved = {
                let mut inner = self.lock();
                self.reserve(&mut inner, &mut reservation, &prepared.event, free)
            };
            match reserved {
                Ok((targets, routed)) => {
                    accepted.push((n, routed, prepared.event.body.len() as u64));
                    writes.push((prepared.event, targets));
                    answers.push(None);
                }
                Err(refusal) => {
                    if prepared.given {
                        refused_ids.push((n, prepared.event.event_id));
                    }
                    answers.push(Some(Err(refusal)));
                }
            }
        }
        // A producer retrying an accepted event gets its first answer, as from a publish.
        for (n, event_id) in refused_ids {
            if let Some(first) = self.store.published(namespace, &event_id).await? {
                answers[n] = Some(Ok(first));
            }
        }
        if !writes.is_empty() {
            let results = self.store.publish_batch(writes).await?;
            for ((n, routed, body_bytes), result) in accepted.into_iter().zip(results) {
                reservation.written(body_bytes, &result);
                self.after_publish(namespace, routed, &result, &[]);
                answers[n] = Some(Ok(result));
            }
        }
        drop(reservation);
        Ok(answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(store::Error::Backend("no answer".into()).into())))
            .collect())
    }

    /// Accepts an event: stored with one pending delivery per matching subscription before
    /// this returns. A repeated `id` returns the first answer and delivers nothing again.
    pub async fn publish(
        self: &Arc<Self>,
        namespace: &str,
        id: Option<String>,
        event_type: &str,
        origin: &Origin<'_>,
        data: &RawValue,
    ) -> Result<PublishResult, EngineError> {
        let _admitted = self.admit(namespace)?;
        let Prepared { event, given } = Self::prepare(namespace, id, event_type, origin, data)?;
        let body_bytes = event.body.len() as u64;
        // Looked at before the lock: at most one statvfs per 250 ms, never under it.
        let free = self.store.free_bytes();
        let mut reservation = Reservation::none(self, namespace);
        let admitted = {
            let mut inner = self.lock();
            self.reserve(&mut inner, &mut reservation, &event, free)
        };
        let (targets, routed) = match admitted {
            Ok(admitted) => admitted,
            Err(refusal) => {
                // A producer retrying an accepted event gets its first answer: the id is
                // looked up before the quota refuses.
                if given
                    && let Some(first) = self.store.published(namespace, &event.event_id).await?
                {
                    return Ok(first);
                }
                return Err(refusal);
            }
        };
        let published_ms = event.published_ms;
        // Idle lanes start with the publish, which claims their delivery. Nothing between
        // taking their slots and the task that gives back what is not claimed can fail.
        let started: Vec<(Slot, Fence)> =
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
                        let fence = Fence::take(self.ownership.get(), uid).ok()?;
                        let config = config.clone();
                        // A lane its pace holds back is woken as usual instead.
                        inner.pace_ready(&config, published_ms).ok()?;
                        inner.scheduler.start_idle(uid).then(|| {
                            let _ = inner.take_pace(&config, published_ms);
                            let slot = Slot {
                                config: config.clone(),
                                epoch: inner.scheduler.epoch(uid),
                            };
                            (slot, fence)
                        })
                    })
                    .collect()
            };
        let started_uids: Vec<Arc<str>> = started
            .iter()
            .map(|(slot, _)| slot.config.uid.clone())
            .collect();
        // The lanes of shards held here are woken here (after_publish): other replicas need
        // no notice of them.
        let held = self.held_shards_of(&targets);
        let result = if !started.is_empty() {
            // Its own task, so that it runs to the end even if the caller goes away: the
            // claims committed with the publish are attempts only this task starts.
            let engine = self.clone();
            tokio::spawn(async move {
                engine
                    .publish_and_start(event, targets, started, held)
                    .await
            })
            .await
            .map_err(|e| store::Error::Backend(format!("the publish stopped: {e}")))??
        } else if !held.is_empty() {
            self.store
                .publish_and_claim(event, targets, Vec::new(), held)
                .await?
                .0
        } else {
            self.store.publish(event, targets).await?
        };
        // What the store wrote stays counted; the rest is released when `reservation` drops.
        reservation.written(body_bytes, &result);
        drop(reservation);
        self.after_publish(namespace, routed, &result, &started_uids);
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
        started: Vec<(Slot, Fence)>,
        held: Vec<ShardFence>,
    ) -> store::Result<PublishResult> {
        let claims = started
            .iter()
            .map(|(slot, fence)| (slot.config.uid.to_string(), fence.token()))
            .collect();
        let (result, mut claimed) = match self
            .store
            .publish_and_claim(event, targets, claims, held)
            .await
        {
            Ok((result, claimed)) => (Ok(result), claimed),
            Err(e) => (Err(e), Vec::new()),
        };
        let mut unclaimed = Vec::new();
        for (slot, fence) in started {
            match claimed
                .iter()
                .position(|c| c.subscription_uid == *slot.config.uid)
            {
                Some(i) => {
                    let claimed = claimed.swap_remove(i);
                    self.start_attempt(slot, Claiming::WithPublish { claimed, fence });
                }
                None => unclaimed.push(slot.config),
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

    /// Takes what each namespace's stored events count from the store now and then (see
    /// [`STORED_RECOUNT`]). Between counts, publishes this process accepts are added as they
    /// are written; what is being published at the moment of a count may be missed by it
    /// until the next.
    pub(super) async fn recount_stored(self: Arc<Self>) {
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
}
