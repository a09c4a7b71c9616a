//! Whether a kind of request comes in a stream: what tells its writers whether waiting a
//! moment could bring more into a statement ([`super::writing`]'s gathering of claims,
//! [`super::group_commit`]'s of publishes).
//!
//! With several replicas on one server each replica sees a share of the load, so each of
//! its statements carries a share of what one replica's would, and the server's fixed cost
//! of a statement is paid more often. Under load claims and publishes come every
//! millisecond or so, a few at a time. One that comes after a quiet moment (an event on a
//! quiet herald, a lane woken after a pause) must not wait: its delivery, or its producer,
//! would wait with it.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Requests this close together are a stream, by default.
const WITHIN: Duration = Duration::from_millis(10);

pub(super) struct Stream {
    /// When the last request taken into a batch was asked for.
    last_taken: Mutex<Option<Instant>>,
    /// How long a small batch waits at most, and how close requests come in a stream
    /// (longer in a test that tells waiting from a slow machine).
    waits: Mutex<(Duration, Duration)>,
}

impl Stream {
    /// A stream whose small batches wait up to `gather_for`.
    pub(super) fn new(gather_for: Duration) -> Self {
        Self {
            last_taken: Mutex::default(),
            waits: Mutex::new((gather_for, WITHIN)),
        }
    }

    /// How long a small batch waits at most, when [`Self::follows_closely`].
    pub(super) fn gather_for(&self) -> Duration {
        self.waits.lock().unwrap_or_else(|e| e.into_inner()).0
    }

    /// Whether a request asked for at `at` came close after the last one taken before it.
    pub(super) fn follows_closely(&self, at: Instant) -> bool {
        let within = self.waits.lock().unwrap_or_else(|e| e.into_inner()).1;
        let taken = *self.last_taken.lock().unwrap_or_else(|e| e.into_inner());
        taken.is_some_and(|before| at.saturating_duration_since(before) < within)
    }

    /// A request asked for at `at` has been taken into a batch.
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
    fn only_requests_close_after_the_last_taken_follow_it() {
        let stream = Stream::new(Duration::from_millis(2));
        stream.set_waits(Duration::from_millis(2), Duration::from_secs(1));
        let start = Instant::now();
        assert!(
            !stream.follows_closely(start),
            "the first request followed none"
        );
        stream.took(start);
        assert!(stream.follows_closely(start + Duration::from_millis(500)));
        assert!(
            !stream.follows_closely(start + Duration::from_secs(2)),
            "a request after a quiet moment counted as a stream"
        );
        // A batch taken late (its requests asked for earlier) never moves the mark back.
        stream.took(start + Duration::from_secs(2));
        stream.took(start);
        assert!(stream.follows_closely(start + Duration::from_millis(2_500)));
    }
}
