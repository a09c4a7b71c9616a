//! herald's scheduling clock: Unix milliseconds that follow the monotonic clock.
//!
//! Backoff delays, retry deadlines (`maxDuration`), due times and history retention are
//! computed from this clock, so a step of the system clock while herald runs (an NTP
//! correction, an operator's `date -s`) neither fires every waiting retry at once and gives
//! up on deliveries whose `maxDuration` seems to have passed (a step forwards) nor stalls
//! retries for as long as the clock went back (a step backwards). It reads the wall clock
//! once, at start; afterwards only elapsed monotonic time moves it. Signature timestamps
//! are not taken from here: receivers compare them with their own wall clocks, so they
//! follow the system clock (see `signing`).
//!
//! A step is noticed (within [`WATCH_EVERY`]) and logged with the offset between the two
//! clocks: recorded attempt times are off by that much until herald restarts, when it reads
//! the wall clock again (a step across a restart is like herald having been down that long).

use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

static ANCHOR: OnceLock<(Instant, i64)> = OnceLock::new();

/// How often the system clock is compared with herald's.
pub const WATCH_EVERY: Duration = Duration::from_secs(1);
/// A difference larger than this between the two clocks' advances is a step.
const STEP: i64 = 1_000;

fn wall_ms() -> i64 {
    match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_millis() as i64,
        // A clock before 1970 is no clock to schedule by; 0 keeps the arithmetic defined.
        Err(_) => 0,
    }
}

fn anchor() -> (Instant, i64) {
    *ANCHOR.get_or_init(|| (Instant::now(), wall_ms()))
}

/// Now, in Unix milliseconds on herald's scheduling clock.
pub fn now_ms() -> i64 {
    let (at, wall) = anchor();
    wall.saturating_add(at.elapsed().as_millis() as i64)
}

/// How far the system clock is ahead of herald's (negative: behind), in milliseconds.
pub fn offset_ms() -> i64 {
    let herald = now_ms();
    wall_ms() - herald
}

/// Logs every step of the system clock until the process ends.
pub async fn watch_steps() {
    let mut last = offset_ms();
    let mut every = tokio::time::interval(WATCH_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let offset = offset_ms();
        if let Some(step) = stepped(last, offset) {
            tracing::warn!(
                step_ms = step,
                offset_ms = offset,
                "the system clock stepped; backoff and retry deadlines keep herald's own clock, signature timestamps follow the system clock, recorded attempt times differ from it by offset_ms until restart"
            );
            last = offset;
        }
    }
}

/// The step between two readings of the offset, if it is one.
fn stepped(last: i64, now: i64) -> Option<i64> {
    let step = now - last;
    (step.abs() > STEP).then_some(step)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_starts_at_the_wall_clock_and_never_goes_back() {
        let first = now_ms();
        assert!((first - wall_ms()).abs() < 1_000);
        let mut last = first;
        for _ in 0..1_000 {
            let now = now_ms();
            assert!(now >= last);
            last = now;
        }
    }

    #[test]
    fn only_a_change_beyond_a_second_is_a_step() {
        assert_eq!(stepped(0, 999), None);
        assert_eq!(stepped(5, -900), None);
        assert_eq!(stepped(0, 3_600_000), Some(3_600_000));
        assert_eq!(stepped(3_600_000, -1), Some(-3_600_001));
    }
}
