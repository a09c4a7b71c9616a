//! The subscriptions the engine runs and their lanes: added, changed and removed (the
//! purge-and-fence), namespace quotas, replay and re-enabling, and recovery after a restart.

use std::sync::Arc;

use super::{Engine, EngineError, Inner, Notice};
use crate::delivery::SubscriptionConfig;
use crate::delivery::clock::now_ms;
use crate::store::{self, SubscriptionRecord, SubscriptionState};

impl Engine {
    /// Wakes `uid`'s lane for new work, unless waking could start nothing: the lane is
    /// unknown here, held (paused or without its secret: the store claims nothing for it,
    /// and its release from hold wakes it), or in a shard another replica holds (the store's
    /// notice wakes it there; taking the shard wakes it here). With a publish to 200
    /// subscriptions, half of them paused and half elsewhere, each once started an attempt
    /// that only found that out.
    pub(super) fn wake_for_work(&self, inner: &mut Inner, uid: &str) {
        if inner.subs.get(uid).is_some_and(|c| !c.held()) && self.holds_shard_of(uid) {
            inner.scheduler.wake(uid);
        }
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

    /// Adds or updates a subscription, and the lane that sends its dead letters to its sink
    /// (`spec.deadLetterSink`): without a sink now, a lane it had is held, its letters kept
    /// until a sink is set again. The sink's lane comes first, so that no attempt of the
    /// subscription dies with a sink configured and no lane yet to queue its letter on. A
    /// uid the store has tombstoned stays removed (both lanes are, together).
    pub async fn upsert(
        &self,
        config: SubscriptionConfig,
    ) -> Result<SubscriptionState, EngineError> {
        let sink = config.sink_lane().or_else(|| {
            self.config(&crate::delivery::sink_uid(&config.uid))
                .map(|lane| SubscriptionConfig {
                    paused: true,
                    ..(*lane).clone()
                })
        });
        if let Some(lane) = sink {
            self.upsert_lane(lane, false).await?;
        }
        self.upsert_lane(config, true).await
    }

    /// Adds or updates one lane; `named`: a subscription the API finds by name and a
    /// publish matches (not a dead-letter sink's lane).
    async fn upsert_lane(
        &self,
        mut config: SubscriptionConfig,
        named: bool,
    ) -> Result<SubscriptionState, EngineError> {
        let state = self
            .store
            .upsert_subscription(SubscriptionRecord {
                uid: config.uid.to_string(),
                namespace: config.namespace.to_string(),
                name: config.name.to_string(),
                paused: config.held(),
                disable_after: config.disable_after,
                strict_order: config.strict_order,
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
        if named {
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
        }
        // Only a lane that may have due work is woken: one released from hold, or one the
        // store had work for at recovery. A new or merely changed lane has nothing due that a
        // publish, a timer or recovery would not wake it for, and waking every lane would make
        // a start with 100,000 subscriptions ask the store 100,000 times for nothing.
        let held = config.held();
        let was_held = inner.subs.get(&uid).map(|old| old.held());
        let recovered = inner.recovered.remove(&*uid);
        if let Some(pace) = inner.paces.get_mut(&*uid) {
            pace.set_limit(config.rate_limit, crate::delivery::clock::now_ms());
        }
        inner.subs.insert(uid.clone(), config);
        if !held && (was_held == Some(true) || recovered) {
            inner.scheduler.wake(&uid);
        }
        drop(inner);
        self.wakeup.notify_one();
        Ok(state)
    }

    /// The purge-and-fence for a removed subscription of `namespace` and its dead-letter
    /// sink's lane: once this returns, no attempt for either starts again. Returns how many
    /// unfinished deliveries were purged.
    pub async fn remove(&self, namespace: &str, uid: &str) -> Result<u64, EngineError> {
        let purged = self.store.remove_subscription(uid).await?;
        crate::metrics::get()
            .purged
            .with_label_values(&[namespace])
            .inc_by(purged);
        let mut inner = self.lock();
        self.forget_lane(&mut inner, uid, purged);
        self.forget_lane(&mut inner, &crate::delivery::sink_uid(uid), 0);
        Ok(purged)
    }

    /// Drops a removed lane (that had `purged` deliveries purged) from the engine.
    fn forget_lane(&self, inner: &mut Inner, uid: &str, purged: u64) {
        inner.states.remove(uid);
        inner.paces.remove(uid);
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

    /// The config the engine runs for this uid.
    pub fn config(&self, uid: &str) -> Option<Arc<SubscriptionConfig>> {
        self.lock().subs.get(uid).cloned()
    }

    /// While the subscription's receiver has slowed it down: the pace in force (attempts a
    /// second) and until when (Unix ms).
    pub fn slowed(&self, uid: &str) -> Option<(f64, i64)> {
        let now = crate::delivery::clock::now_ms();
        self.lock().paces.get(uid).and_then(|p| p.slowed(now))
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

    /// Re-queues dead letters; refused while the subscription is disabled.
    pub async fn replay(
        &self,
        namespace: &str,
        name: &str,
        which: store::Replay,
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
        let replayed = self.store.replay(&uid, which, now_ms()).await?;
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
}
