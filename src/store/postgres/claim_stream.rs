//! Whether this replica's claims come in a stream: what tells a claimer whether waiting a
//! moment could bring more claims into its statement ([`super::writing`]'s gathering).
//!
//! A lane claims on its own when its delivery came with neither its publish nor its
//! previous record: with several replicas, mostly after another replica's publish woke it.
//! Under load such claims come every millisecond or so, a few at a time, and a statement
//! each costs the server as much as one of many. A claim after a quiet moment (an event on
//! a quiet herald, a lane woken after a pause) must not wait: its delivery's first attempt
//! would wait with it.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a small batch of claims in a stream waits at most, by default.
const GATHER_FOR: Duration = Duration::from_millis(2);
/// Claims this close together are a stream, by default.
const WITHIN: Duration = Duration::from_millis(10);

pub(super) struct ClaimStream {
    /// When the last claim taken into a batch was asked for.
    last_taken: Mutex<Option<Instant>>,
    /// How long a small batch waits at most, and how close claims come in a stream (longer
    /// in a test that tells waiting from a slow machine).
    waits: Mutex<(Duration, Duration)>,
}

impl Default for ClaimStream {
    fn default() -> Self {
        Self {
            last_taken: Mutex::default(),
            waits: Mutex::new((GATHER_FOR, WITHIN)),
        }
    }
}

impl ClaimStream {
    /// How long a small batch waits at most, when [`Self::follows_closely`].
    pub(super) fn gather_for(&self) -> Duration {
        self.waits.lock().unwrap_or_else(|e| e.into_inner()).0
    }

    /// Whether a claim asked for at `at` came close after the last one taken before it.
    pub(super) fn follows_closely(&self, at: Instant) -> bool {
        let within = self.waits.lock().unwrap_or_else(|e| e.into_inner()).1;
        let taken = *self.last_taken.lock().unwrap_or_else(|e| e.into_inner());
        taken.is_some_and(|before| at.saturating_duration_since(before) < within)
    }

    /// A claim asked for at `at` has been taken into a batch.
    pub(super) fn took(&self, at: Instant) {
        let mut taken = self.last_taken.lock().unwrap_or_else(|e| e.into_inner());
        *taken = Some(taken.map_or(at, |before| before.max(at)));
    }

    #[cfg(test)]
    pub(super) fn set_waits(&self, gather_for: Duration, within: Duration) {
        *self.waits.lock().unwrap() = (gather_for, within);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_claims_close_after_the_last_taken_follow_it() {
        let stream = ClaimStream::default();
        stream.set_waits(GATHER_FOR, Duration::from_secs(1));
        let start = Instant::now();
        assert!(
            !stream.follows_closely(start),
            "the first claim followed none"
        );
        stream.took(start);
        assert!(stream.follows_closely(start + Duration::from_millis(500)));
        assert!(
            !stream.follows_closely(start + Duration::from_secs(2)),
            "a claim after a quiet moment counted as a stream"
        );
        // A batch taken late (its claims asked for earlier) never moves the mark back.
        stream.took(start + Duration::from_secs(2));
        stream.took(start);
        assert!(stream.follows_closely(start + Duration::from_millis(2_500)));
    }
}
