//! Which subscriptions to reconcile, and when: at most one reconcile per object at a time, a
//! bounded number at once, the newest object wins, a failed one is tried again after 5 s.
//!
//! Herald's own in place of kube-runtime's Controller, which reconciles from a cache holding
//! every object (about 1.4 KiB per subscription even trimmed). Here a reconcile takes the
//! object the watch event carried; one triggered otherwise (a referenced Secret changed, a
//! retry) reads it from the API server. Nothing is kept for an object that is not waiting,
//! and at most [`OBJECTS_HELD`] objects wait at once: in a burst of creations, when the
//! API server is slower to take herald's writes than to create objects, tens of thousands
//! of keys may wait, and the ones beyond that bound read their object when their turn comes.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::FutureExt;
use kube::api::Api;
use tokio::sync::Notify;
use tokio::task::JoinSet;

use super::reconcile::{Context, reconcile};
use crate::api::WebhookSubscription;

/// A subscription: namespace and name.
pub type Key = (String, String);

/// How long a failed reconcile waits before the next try.
const RETRY_AFTER: Duration = Duration::from_secs(5);

/// Objects kept waiting at most (a few KiB each); enough for the 16 reconciles at once to
/// read none while the queue is short.
pub const OBJECTS_HELD: usize = 1_024;

struct State {
    /// Keys to reconcile, with the newest object seen (None: read it when its turn comes).
    waiting: HashMap<Key, Option<Arc<WebhookSubscription>>>,
    /// The waiting keys not running, in the order they came.
    order: VecDeque<Key>,
    running: HashSet<Key>,
    /// Objects in `waiting`, and how many may be.
    held: usize,
    held_limit: usize,
}

pub struct Queue {
    state: Mutex<State>,
    wake: Notify,
}

impl Default for Queue {
    fn default() -> Self {
        Self::holding(OBJECTS_HELD)
    }
}

impl Queue {
    /// A queue keeping at most `limit` waiting objects.
    fn holding(limit: usize) -> Self {
        Self {
            state: Mutex::new(State {
                waiting: HashMap::new(),
                order: VecDeque::new(),
                running: HashSet::new(),
                held: 0,
                held_limit: limit,
            }),
            wake: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Asks for a reconcile of `key`, with the object as the watch delivered it if known. An
    /// object replaces an older one waiting; None leaves a waiting object in place. Past the
    /// bound on objects held, a new one is dropped and read again at its turn.
    pub fn push(&self, key: Key, obj: Option<Arc<WebhookSubscription>>) {
        let mut state = self.lock();
        let state = &mut *state;
        let queued = state.waiting.contains_key(&key);
        let slot = state.waiting.entry(key.clone()).or_default();
        if obj.is_some() && (slot.is_some() || state.held < state.held_limit) {
            if slot.is_none() {
                state.held += 1;
            }
            *slot = obj;
        }
        if !queued && !state.running.contains(&key) {
            state.order.push_back(key);
        }
        self.wake.notify_one();
    }

    /// The object is gone: nothing waits for it any more.
    pub fn remove(&self, key: &Key) {
        let mut state = self.lock();
        if let Some(obj) = state.waiting.remove(key) {
            state.held -= usize::from(obj.is_some());
            state.order.retain(|k| k != key);
        }
    }

    /// The next key to reconcile, now marked running.
    fn next(&self) -> Option<(Key, Option<Arc<WebhookSubscription>>)> {
        let mut state = self.lock();
        let key = state.order.pop_front()?;
        let obj = state.waiting.remove(&key).flatten();
        state.held -= usize::from(obj.is_some());
        state.running.insert(key.clone());
        Some((key, obj))
    }

    fn finished(&self, key: &Key) {
        let mut state = self.lock();
        state.running.remove(key);
        if state.waiting.contains_key(key) {
            state.order.push_back(key.clone());
        }
    }

    /// Reconciles what is asked for, `concurrency` at a time, until the process ends.
    pub async fn run(self: Arc<Self>, ctx: Arc<Context>, concurrency: usize) {
        let mut tasks = JoinSet::new();
        loop {
            while tasks.len() < concurrency.max(1) {
                let Some((key, obj)) = self.next() else { break };
                let ctx = ctx.clone();
                tasks.spawn(async move {
                    // A panic fails this reconcile, not the queue.
                    let outcome = std::panic::AssertUnwindSafe(reconcile_key(&key, obj, ctx))
                        .catch_unwind()
                        .await
                        .unwrap_or_else(|_| Err("the reconcile panicked".to_string()));
                    (key, outcome)
                });
            }
            tokio::select! {
                _ = self.wake.notified() => {}
                Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                    let Ok((key, outcome)) = done else { continue };
                    self.finished(&key);
                    if let Err(error) = outcome {
                        tracing::warn!(namespace = %key.0, subscription = %key.1, %error, "reconcile failed; retrying in 5s");
                        let queue = self.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(RETRY_AFTER).await;
                            queue.push(key, None);
                        });
                    }
                }
            }
        }
    }
}

async fn reconcile_key(
    key: &Key,
    obj: Option<Arc<WebhookSubscription>>,
    ctx: Arc<Context>,
) -> Result<(), String> {
    let obj = match obj {
        Some(obj) => obj,
        None => {
            let api: Api<WebhookSubscription> = Api::namespaced(ctx.client.clone(), &key.0);
            match api.get_opt(&key.1).await.map_err(|e| e.to_string())? {
                Some(obj) => {
                    ctx.status.saw(&obj);
                    Arc::new(obj)
                }
                // Gone: its Delete event says so to the watch.
                None => return Ok(()),
            }
        }
    };
    reconcile(obj, ctx)
        .await
        .map(drop)
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> Key {
        ("shop".into(), name.into())
    }

    fn object(name: &str, generation: i64) -> Arc<WebhookSubscription> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "apiVersion": "herald.dev/v1alpha1", "kind": "WebhookSubscription",
                "metadata": {"name": name, "namespace": "shop", "generation": generation},
                "spec": {"url": "https://example.com/hook", "eventTypes": ["*"],
                         "signing": {"secretRef": {"name": "s", "key": "k"}}},
            }))
            .unwrap(),
        )
    }

    fn generation(obj: &Option<Arc<WebhookSubscription>>) -> Option<i64> {
        obj.as_ref().and_then(|o| o.metadata.generation)
    }

    #[test]
    fn keys_come_in_order_once_each_with_the_newest_object() {
        let queue = Queue::default();
        queue.push(key("a"), Some(object("a", 1)));
        queue.push(key("b"), None);
        queue.push(key("a"), Some(object("a", 2)));
        // A trigger without an object keeps the object waiting.
        queue.push(key("a"), None);
        let (first, obj) = queue.next().unwrap();
        assert_eq!((first, generation(&obj)), (key("a"), Some(2)));
        let (second, obj) = queue.next().unwrap();
        assert_eq!((second, generation(&obj)), (key("b"), None));
        assert!(queue.next().is_none());
    }

    #[test]
    fn a_running_key_waits_for_its_reconcile_to_finish() {
        let queue = Queue::default();
        queue.push(key("a"), Some(object("a", 1)));
        let (running, _) = queue.next().unwrap();
        queue.push(key("a"), Some(object("a", 2)));
        queue.push(key("b"), None);
        // Not "a" again while it runs.
        assert_eq!(queue.next().unwrap().0, key("b"));
        assert!(queue.next().is_none());
        queue.finished(&running);
        let (again, obj) = queue.next().unwrap();
        assert_eq!((again, generation(&obj)), (key("a"), Some(2)));
    }

    #[test]
    fn a_removed_key_is_not_reconciled() {
        let queue = Queue::default();
        queue.push(key("a"), Some(object("a", 1)));
        queue.push(key("b"), None);
        queue.remove(&key("a"));
        assert_eq!(queue.next().unwrap().0, key("b"));
        assert!(queue.next().is_none());
        assert!(queue.lock().waiting.is_empty());
        assert_eq!(queue.lock().held, 0);
    }

    #[test]
    fn past_the_bound_keys_wait_without_their_object() {
        let queue = Queue::holding(2);
        queue.push(key("a"), Some(object("a", 1)));
        queue.push(key("b"), Some(object("b", 1)));
        queue.push(key("c"), Some(object("c", 1)));
        // A newer object of one held replaces it, bound or not.
        queue.push(key("a"), Some(object("a", 2)));
        let taken: Vec<_> = std::iter::from_fn(|| queue.next())
            .map(|(key, obj)| (key.1, generation(&obj)))
            .collect();
        assert_eq!(
            taken,
            [
                ("a".into(), Some(2)),
                ("b".into(), Some(1)),
                ("c".into(), None)
            ]
        );
        // Taking them freed the bound.
        queue.push(key("d"), Some(object("d", 1)));
        assert_eq!(generation(&queue.next().unwrap().1), Some(1));
    }
}
