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
use futures::future::BoxFuture;
use kube::api::Api;
use tokio::sync::Notify;
use tokio::task::JoinSet;

use super::reconcile::{Context, reconcile};
use crate::api::WebhookSubscription;

/// A subscription: namespace and name.
pub type Key = (String, String);

/// How long a failed reconcile waits before its next try, doubling with each failure in a
/// row up to [`RETRY_AFTER_MAX`].
const RETRY_AFTER: Duration = Duration::from_secs(5);
const RETRY_AFTER_MAX: Duration = Duration::from_secs(300);

/// A reconcile still running after this is cancelled and retried: no object, however
/// written, holds one of the few workers every tenant shares. Its API requests have their
/// own, shorter timeout (`run::API_REQUEST_TIMEOUT`); this bounds the sum.
pub const RECONCILE_BUDGET: Duration = Duration::from_secs(60);

/// Objects kept waiting at most (a few KiB each); enough for the 16 reconciles at once to
/// read none while the queue is short.
pub const OBJECTS_HELD: usize = 1_024;

struct State {
    /// Keys to reconcile, with the newest object seen (None: read it when its turn comes).
    waiting: HashMap<Key, Option<Arc<WebhookSubscription>>>,
    /// The waiting keys not running, in the order they came.
    order: VecDeque<Key>,
    running: HashSet<Key>,
    /// Failures in a row per key, for the retry's backoff.
    failures: HashMap<Key, u32>,
    /// Objects in `waiting`, and how many may be.
    held: usize,
    held_limit: usize,
}

pub struct Queue {
    state: Mutex<State>,
    wake: Notify,
}

/// A queue's tables keep at least this many slots: below it, giving memory back is not worth
/// the reallocations.
const KEPT_CAPACITY: usize = 64;

impl State {
    /// Gives back what a burst grew: after thousands of creations at once the waiting keys
    /// drain, but their tables would keep their largest size (at 10,000 subscriptions
    /// created in a burst, about a megabyte, a tenth of a KiB per subscription) for the life
    /// of the process; so would the failures of an outage. Halved whenever a quarter or
    /// less is in use, so each reallocation is paid for by as many removals as it keeps
    /// slots.
    fn give_back(&mut self) {
        if let Some(to) = shrunk(self.waiting.len(), self.waiting.capacity()) {
            self.waiting.shrink_to(to);
        }
        if let Some(to) = shrunk(self.order.len(), self.order.capacity()) {
            self.order.shrink_to(to);
        }
        if let Some(to) = shrunk(self.failures.len(), self.failures.capacity()) {
            self.failures.shrink_to(to);
        }
    }
}

/// The capacity a table of `len` entries should shrink to, if it is worth it.
fn shrunk(len: usize, capacity: usize) -> Option<usize> {
    (capacity > KEPT_CAPACITY && len * 4 <= capacity).then(|| (len * 2).max(KEPT_CAPACITY))
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
                failures: HashMap::new(),
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
        state.failures.remove(key);
        if let Some(obj) = state.waiting.remove(key) {
            state.held -= usize::from(obj.is_some());
            state.order.retain(|k| k != key);
        }
        state.give_back();
    }

    /// The next key to reconcile, now marked running.
    fn next(&self) -> Option<(Key, Option<Arc<WebhookSubscription>>)> {
        let mut state = self.lock();
        let key = state.order.pop_front()?;
        let obj = state.waiting.remove(&key).flatten();
        state.held -= usize::from(obj.is_some());
        state.running.insert(key.clone());
        state.give_back();
        Some((key, obj))
    }

    /// The reconcile of `key` ended; on failure, how long to wait before the next try.
    fn finished(&self, key: &Key, failed: bool, backoff: Backoff) -> Option<Duration> {
        let mut state = self.lock();
        state.running.remove(key);
        if state.waiting.contains_key(key) {
            state.order.push_back(key.clone());
        }
        if !failed {
            state.failures.remove(key);
            state.give_back();
            return None;
        }
        let failures = state.failures.entry(key.clone()).or_default();
        *failures = failures.saturating_add(1);
        Some(backoff.after(*failures))
    }

    /// Reconciles what is asked for, `concurrency` at a time, until the process ends.
    pub async fn run(self: Arc<Self>, ctx: Arc<Context>, concurrency: usize) {
        let backoff = Backoff {
            first: RETRY_AFTER,
            max: RETRY_AFTER_MAX,
        };
        self.run_with(concurrency, RECONCILE_BUDGET, backoff, move |key, obj| {
            let ctx = ctx.clone();
            async move { reconcile_key(&key, obj, ctx).await }.boxed()
        })
        .await
    }

    /// [`Queue::run`] with the reconcile, its budget and the retry backoff given.
    async fn run_with<F>(
        self: Arc<Self>,
        concurrency: usize,
        budget: Duration,
        backoff: Backoff,
        reconcile: F,
    ) where
        F: Fn(Key, Option<Arc<WebhookSubscription>>) -> BoxFuture<'static, Result<(), String>>,
    {
        let mut tasks = JoinSet::new();
        loop {
            while tasks.len() < concurrency.max(1) {
                let Some((key, obj)) = self.next() else { break };
                let work = reconcile(key.clone(), obj);
                tasks.spawn(async move {
                    // A panic fails this reconcile, not the queue; so does running too long.
                    let work = std::panic::AssertUnwindSafe(work).catch_unwind();
                    let outcome = match tokio::time::timeout(budget, work).await {
                        Ok(Ok(outcome)) => outcome,
                        Ok(Err(_)) => Err("the reconcile panicked".to_string()),
                        Err(_) => Err(format!(
                            "the reconcile took longer than {}s and was cancelled",
                            budget.as_secs_f64()
                        )),
                    };
                    (key, outcome)
                });
            }
            tokio::select! {
                _ = self.wake.notified() => {}
                Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                    let Ok((key, outcome)) = done else { continue };
                    let retry = self.finished(&key, outcome.is_err(), backoff);
                    if let (Err(error), Some(after)) = (outcome, retry) {
                        tracing::warn!(namespace = %key.0, subscription = %key.1, %error, retry_in_seconds = after.as_secs_f64(), "reconcile failed; retrying");
                        let queue = self.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(after).await;
                            queue.push(key, None);
                        });
                    }
                }
            }
        }
    }
}

/// The wait before a failed reconcile's next try: `first`, doubled with each failure in a
/// row, at most `max`.
#[derive(Clone, Copy, Debug)]
struct Backoff {
    first: Duration,
    max: Duration,
}

impl Backoff {
    fn after(self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(16);
        self.first.saturating_mul(1 << doublings).min(self.max)
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

    const TEST_BACKOFF: Backoff = Backoff {
        first: Duration::from_millis(100),
        max: Duration::from_millis(400),
    };

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
        queue.finished(&running, false, TEST_BACKOFF);
        let (again, obj) = queue.next().unwrap();
        assert_eq!((again, generation(&obj)), (key("a"), Some(2)));
    }

    #[test]
    fn a_drained_burst_gives_its_tables_back() {
        let queue = Queue::default();
        for i in 0..10_000 {
            queue.push(key(&format!("s-{i}")), None);
        }
        let grown = queue.lock().waiting.capacity();
        assert!(grown >= 10_000, "{grown}");
        // Drained in order, each reconcile finishing before the next starts, as one worker
        // would; the last hundred stay waiting.
        for _ in 0..9_900 {
            let (k, _) = queue.next().unwrap();
            queue.finished(&k, false, TEST_BACKOFF);
        }
        let state = queue.lock();
        assert_eq!(state.waiting.len(), 100);
        // At most four times what is in use, not the burst's size.
        assert!(
            state.waiting.capacity() <= 400,
            "{}",
            state.waiting.capacity()
        );
        assert!(state.order.capacity() <= 400, "{}", state.order.capacity());
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

    #[test]
    fn retries_back_off_and_a_success_resets_them() {
        let delays: Vec<_> = (1..=5).map(|n| TEST_BACKOFF.after(n).as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 400, 400]);
        assert_eq!(
            Backoff {
                first: RETRY_AFTER,
                max: RETRY_AFTER_MAX
            }
            .after(u32::MAX),
            RETRY_AFTER_MAX
        );
        let queue = Queue::default();
        queue.push(key("a"), None);
        let (a, _) = queue.next().unwrap();
        assert_eq!(
            queue.finished(&a, true, TEST_BACKOFF),
            Some(Duration::from_millis(100))
        );
        queue.push(key("a"), None);
        let (a, _) = queue.next().unwrap();
        assert_eq!(
            queue.finished(&a, true, TEST_BACKOFF),
            Some(Duration::from_millis(200))
        );
        queue.push(key("a"), None);
        let (a, _) = queue.next().unwrap();
        assert_eq!(queue.finished(&a, false, TEST_BACKOFF), None);
        assert!(queue.lock().failures.is_empty());
    }

    /// Issue 24 item 1: reconciles that never end (a request with no answer) are cancelled at
    /// their budget and retried later, so they never hold every worker: another tenant's
    /// object is reconciled although more objects hang than there are workers.
    #[tokio::test]
    async fn hanging_reconciles_never_hold_every_worker() {
        use std::sync::atomic::{AtomicU32, Ordering};
        let queue = Arc::new(Queue::default());
        for i in 0..4 {
            queue.push(("evil".into(), format!("hang-{i}")), None);
        }
        queue.push(("other".into(), "orders".into()), None);
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
        let hangs = Arc::new(AtomicU32::new(0));
        let counted = hangs.clone();
        let runner = tokio::spawn(queue.clone().run_with(
            2,
            Duration::from_millis(100),
            TEST_BACKOFF,
            move |key: Key, _| {
                let done = done_tx.clone();
                let hangs = counted.clone();
                async move {
                    if key.0 == "evil" {
                        hangs.fetch_add(1, Ordering::Relaxed);
                        std::future::pending::<()>().await;
                    }
                    let _ = done.send(key);
                    Ok(())
                }
                .boxed()
            },
        ));
        let reconciled = tokio::time::timeout(Duration::from_secs(10), done_rx.recv())
            .await
            .expect("the other tenant's reconcile waited behind hanging ones");
        assert_eq!(reconciled, Some(("other".into(), "orders".into())));
        // The hanging ones were cancelled and are tried again with backoff.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while hangs.load(Ordering::Relaxed) <= 4 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no hanging reconcile was retried"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let failures = queue.lock().failures.values().copied().max();
        assert!(failures >= Some(1), "{failures:?}");
        runner.abort();
    }
}
