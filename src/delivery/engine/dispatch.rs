//! The dispatcher: starts whatever the scheduler lets start, fires retry timers, and stops
//! starting anything for a graceful drain.

use std::cmp::Reverse;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::Engine;
use super::attempt::{Claiming, Slot};
use crate::delivery::clock::now_ms;

impl Engine {
    /// Runs the dispatcher until the process ends: starts what the scheduler allows, fires
    /// retry timers, prunes history now and then.
    pub fn spawn(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let engine = self.clone();
        let pruner = self.clone();
        tokio::spawn(crate::delivery::clock::watch_steps());
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
                    // A paced lane's timer is its pace's: it may start again.
                    inner.scheduler.unpace(&uid);
                    inner.scheduler.wake(&uid);
                }
                let mut starts = Vec::new();
                while let Some(uid) = inner.scheduler.start_next() {
                    let epoch = inner.scheduler.epoch(&uid);
                    match inner.subs.get(&uid) {
                        Some(config) => starts.push(Slot {
                            config: config.clone(),
                            epoch,
                        }),
                        None => inner.scheduler.release(&uid, ""),
                    }
                }
                (starts, inner.timers.peek().map(|Reverse((at, _))| *at))
            };
            for slot in starts {
                self.start_attempt(slot, Claiming::Next);
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
}
