//! The attempts this replica's lanes have claimed and not yet recorded, by when each was
//! claimed: what tells a recorder whether waiting a moment could bring more records into
//! its statement ([`super::writing`]'s gathering).
//!
//! A lane whose record is in a batch can send nothing more until that record returns, so a
//! batch can only grow with the records of other attempts already on the wire. Only those
//! claimed moments ago count: an attempt that has been out longer (a slow or dead receiver)
//! is not waited for, so no receiver holds other lanes' records back for longer than that.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// An attempt not recorded this long after its claim is forgotten (a lane that stopped
/// without recording it; recording it later changes nothing here).
const FORGET_AFTER: Duration = Duration::from_secs(600);

/// How long a small batch waits at most, by default.
const GATHER_FOR: Duration = Duration::from_millis(2);
/// The attempts a small batch waits for, by default: those claimed this recently.
const CLAIMED_WITHIN: Duration = Duration::from_millis(10);

pub(super) struct OnWire {
    claimed: Mutex<HashMap<(i64, u32), Instant>>,
    /// How long a small batch waits at most, and for attempts claimed how recently (longer
    /// in a test that tells waiting from a slow machine).
    waits: Mutex<(Duration, Duration)>,
}

impl Default for OnWire {
    fn default() -> Self {
        Self {
            claimed: Mutex::default(),
            waits: Mutex::new((GATHER_FOR, CLAIMED_WITHIN)),
        }
    }
}

impl OnWire {
    /// How long a small batch waits at most.
    pub(super) fn gather_for(&self) -> Duration {
        self.waits.lock().unwrap_or_else(|e| e.into_inner()).0
    }

    /// Whether a small batch may still grow: an attempt claimed moments ago is unrecorded.
    pub(super) fn any_recent(&self) -> bool {
        let within = self.waits.lock().unwrap_or_else(|e| e.into_inner()).1;
        self.any_since(within)
    }

    #[cfg(test)]
    pub(super) fn set_waits(&self, gather_for: Duration, claimed_within: Duration) {
        *self.waits.lock().unwrap() = (gather_for, claimed_within);
    }

    /// A lane has been handed this attempt.
    pub(super) fn claimed(&self, delivery: i64, attempt: u32) {
        self.lock().insert((delivery, attempt), Instant::now());
    }

    /// The attempt's record has been handed to the store (or its claim given back).
    pub(super) fn recorded(&self, delivery: i64, attempt: u32) {
        self.lock().remove(&(delivery, attempt));
    }

    /// Whether an attempt claimed within `within` is still unrecorded.
    fn any_since(&self, within: Duration) -> bool {
        let now = Instant::now();
        let mut claimed = self.lock();
        let mut any = false;
        claimed.retain(|_, at| {
            let age = now.saturating_duration_since(*at);
            any |= age < within;
            age < FORGET_AFTER
        });
        any
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(i64, u32), Instant>> {
        // A panic elsewhere while holding it leaves a map that is still a map.
        self.claimed.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_recent_unrecorded_attempts_count() {
        let on_wire = OnWire::default();
        assert!(!on_wire.any_since(Duration::from_secs(1)));
        on_wire.claimed(1, 1);
        assert!(on_wire.any_since(Duration::from_secs(1)));
        std::thread::sleep(Duration::from_millis(20));
        assert!(
            !on_wire.any_since(Duration::from_millis(10)),
            "an attempt out longer than asked still counted"
        );
        assert!(on_wire.any_since(Duration::from_secs(1)));
        on_wire.recorded(1, 1);
        assert!(!on_wire.any_since(Duration::from_secs(1)));
    }
}
