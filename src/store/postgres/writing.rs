//! One statement at a time while it goes well, for the joined writers ([`super::group_commit`]'s
//! committers, [`super::completions`]' recorders).
//!
//! A writer holding work waits for the statement before it to return, and what is queued
//! meanwhile joins its batch: batches grow with the load instead of being split between
//! writers that each start at once with the little queued so far, and the server's cost of
//! a statement (setting up its plan, its transaction) is shared by more rows. On two cores
//! writers going side by side gained nothing that waiting lost. A statement that has not
//! returned within [`OVERLAP_AFTER`] (a row lock held by a removal purging its backlog, a
//! slow server) no longer holds the next one back, so one subscription's wait delays the
//! others by that much at most.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

/// How long a writer with work waits for the statement before it to return before writing
/// its own beside it (in tests long enough to tell the wait from a slow machine).
pub(super) const OVERLAP_AFTER: Duration = if cfg!(test) {
    Duration::from_secs(1)
} else {
    Duration::from_millis(10)
};

/// One kind of writer's statements being written, and a signal each time one returns.
#[derive(Default)]
pub(super) struct Writing {
    statements: AtomicUsize,
    returned: Notify,
}

impl Writing {
    /// Statements being written now.
    #[cfg(test)]
    pub(super) fn statements(&self) -> usize {
        self.statements.load(Ordering::Acquire)
    }

    /// Waits until no statement is being written, or `at_most`.
    pub(super) async fn wait_for_none(&self, at_most: Duration) {
        let deadline = tokio::time::Instant::now() + at_most;
        loop {
            // Made before the count is read: a return in between still wakes it.
            let returned = self.returned.notified();
            if self.statements.load(Ordering::Acquire) == 0 {
                return;
            }
            if tokio::time::timeout_at(deadline, returned).await.is_err() {
                return;
            }
        }
    }

    /// Counts a statement as written until the guard drops.
    pub(super) fn start(self: &Arc<Self>) -> WritingGuard {
        self.statements.fetch_add(1, Ordering::AcqRel);
        WritingGuard(self.clone())
    }
}

pub(super) struct WritingGuard(Arc<Writing>);

impl Drop for WritingGuard {
    fn drop(&mut self) {
        self.0.statements.fetch_sub(1, Ordering::AcqRel);
        self.0.returned.notify_waiters();
    }
}
