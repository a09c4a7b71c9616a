//! Several replicas on one store: the shards this one holds, the new work other replicas
//! publish, and the pending counts taken again from the store.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::fence::Fence;
use super::{Engine, Notice};
use crate::delivery::shards::Ownership;
use crate::store::{NewWorkFeed, ShardFence};

/// With several replicas: how often each takes its count of pending attempts per namespace
/// from the store again.
pub(super) const PENDING_RECOUNT: Duration = Duration::from_secs(2);

/// The pause before the next recount: [`PENDING_RECOUNT`], or twenty times what the last
/// one took, so that counting a large backlog (1,000,000 pending on PostgreSQL: about
/// 230 ms, a scan of every unfinished delivery) keeps to a twentieth of the time.
pub(super) fn recount_wait(took: Duration) -> Duration {
    PENDING_RECOUNT.max(took.saturating_mul(20))
}

impl Engine {
    /// Shares the store with other replicas: from now on an attempt starts only for a shard
    /// `ownership` holds, under its lease epoch. Call before [`Engine::recover`].
    pub fn share_by_shards(&self, ownership: Arc<Ownership>) {
        let _ = self.ownership.set(ownership);
    }

    /// The subscription's shard, when replicas divide the subscriptions.
    pub fn shard_of(&self, uid: &str) -> Option<u32> {
        self.ownership.get().map(|o| o.shard_of(uid))
    }

    /// The shards of `targets` this replica holds now, each once, at the epochs it holds them.
    pub(super) fn held_shards_of(&self, targets: &[String]) -> Vec<ShardFence> {
        let mut held: Vec<ShardFence> = targets
            .iter()
            .filter_map(|uid| Fence::take(self.ownership.get(), uid).ok()?.token())
            .collect();
        held.sort_by_key(|f| (f.shard, f.epoch));
        held.dedup();
        held
    }

    /// Whether this replica may start attempts for the subscription now.
    pub fn holds_shard_of(&self, uid: &str) -> bool {
        Fence::take(self.ownership.get(), uid).is_ok()
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

    /// Shared by shards, other replicas publish too: wakes the lanes the store says got work,
    /// those it names and those matching an event it names, or, when notices may have been
    /// missed, every lane with unfinished work. Notices that arrive while this works are
    /// gathered by the feed and taken together next time.
    pub(super) async fn follow_new_work(self: Arc<Self>, feed: NewWorkFeed) {
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
            // What another replica published shows in the status this one writes (pending
            // attempts): a held lane, which no attempt marks, would otherwise keep showing
            // only the events that came through here.
            let mut published: HashMap<Arc<str>, Vec<String>> = HashMap::new();
            for uid in &uids {
                self.wake_for_work(&mut inner, uid);
                inner.states.remove(uid.as_str());
                if let Some(config) = inner.subs.get(uid.as_str())
                    && self.holds_shard_of(uid)
                {
                    published
                        .entry(config.namespace.clone())
                        .or_default()
                        .push(uid.clone());
                }
            }
            drop(inner);
            self.wakeup.notify_one();
            if self.notices.receiver_count() > 0 {
                for (namespace, subscriptions) in published {
                    let _ = self.notices.send(Notice::Published {
                        namespace: namespace.to_string(),
                        subscriptions,
                    });
                }
            }
        }
    }

    /// Shared by shards, a replica accepts events whose attempts other replicas finish (and
    /// finishes attempts for events others accepted), so its own count of each namespace's
    /// pending attempts would only drift: it is taken again from the store every
    /// [`PENDING_RECOUNT`], or longer when counting takes long (see [`recount_wait`]). The
    /// namespace's pending limit then holds across replicas to within what they accept in
    /// that time.
    pub(super) async fn recount_pending(self: Arc<Self>) {
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
}
