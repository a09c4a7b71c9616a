//! Whether a kind of request comes in a stream: what tells its writers whether waiting a
//! moment could bring more into a statement ([`super::writing`]'s gathering of claims,
//! [`super::group_commit`]'s of publishes).
//!
//! With several replicas on one server each replica sees a share of the load, so each of
//! its statements carries a share of what one replica's would, and the server's fixed cost
//! of a statement is paid more often. Under load claims and publishes come every
//! millisecond or so, a few at a time, and a small batch that waits a moment shares that
//! cost with more. At a moderate pace the wait is all cost: with every request within
//! 10 ms of the last one counted a stream, an event published every 2 ms reached its
//! receiver at 3.4–3.7 ms at the median with one replica and 4.5–4.8 ms with three, against
//! 0.7–1.4 and 1.1–1.6 ms with the rule below (`cargo bench --bench scale_out`, three runs
//! each). So a batch waits only when the recent rate of requests says another is likely
//! within the wait ([`WORTH_WAITING`]): the rate counts each request taken and forgets
//! with time ([`MEMORY`]), so one after a quiet moment (an event on a quiet herald, a lane
//! woken after a pause) never waits.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How far back the rate looks: a request this long ago counts for 1/e of one now. Claims
/// come in bursts, one for each NOTIFY, a few milliseconds apart under load; the rate
/// spans several.
const MEMORY: Duration = Duration::from_millis(10);

/// A small batch waits when the rate expects at least this much of a request within its
/// wait. Three runs each of `cargo bench --bench scale_out`: at 0.6, three replicas under
/// full load joined as many a statement as they did waiting whenever a request came within
/// 10 ms of the last (0.38–0.41 statements an event against 0.40–0.41; 4,219–4,333
/// events/s against 4,149–4,222), where at 1.0 they waited less (0.50–0.52 statements an
/// event, 3,798–3,921 events/s); a publish every 2 ms waits for nothing at either (its
/// rate brings about 0.45 of one within the 1 ms wait).
const WORTH_WAITING: f64 = 0.6;

/// The requests taken so far, as a rate.
#[derive(Default)]
struct Taken {
    /// When the last request taken into a batch was asked for.
    at: Option<Instant>,
    /// Requests a second as of `at`, each weighted by how long ago it was asked.
    rate: f64,
}

pub(super) struct Stream {
    taken: Mutex<Taken>,
    /// How long a small batch waits at most, and how far back the rate looks (longer in a
    /// test that tells waiting from a slow machine).
    waits: Mutex<(Duration, Duration)>,
}

impl Stream {
    /// A stream whose small batches wait up to `gather_for`.
    pub(super) fn new(gather_for: Duration) -> Self {
        Self {
            taken: Mutex::default(),
            waits: Mutex::new((gather_for, MEMORY)),
        }
    }

    fn waits(&self) -> (Duration, Duration) {
        *self.waits.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How long a small batch waits at most, when [`Self::more_expected`].
    pub(super) fn gather_for(&self) -> Duration {
        self.waits().0
    }

    /// Whether, at the rate requests come, another is likely within the wait from `now` on
    /// ([`WORTH_WAITING`]), for a batch of `n` found queued (all but the first of them
    /// asked for since the batch before: a lone request after a quiet moment tells no
    /// rate).
    pub(super) fn more_expected(&self, now: Instant, n: usize) -> bool {
        let (gather_for, memory) = self.waits();
        let taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        let kept = taken.at.map_or(0.0, |before| {
            taken.rate * decay(now.saturating_duration_since(before), memory)
        });
        let rate = kept + n.saturating_sub(1) as f64 / memory.as_secs_f64();
        rate * gather_for.as_secs_f64() >= WORTH_WAITING
    }

    /// A batch of `n` requests, the last asked for at `at`, has been taken.
    pub(super) fn took(&self, at: Instant, n: usize) {
        let memory = self.waits().1;
        let mut taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        // A batch taken late (its requests asked for earlier) never moves the mark back.
        let at = taken.at.map_or(at, |before| before.max(at));
        let kept = taken
            .at
            .map_or(0.0, |before| taken.rate * decay(at - before, memory));
        taken.rate = kept + n as f64 / memory.as_secs_f64();
        taken.at = Some(at);
    }

    #[cfg(test)]
    pub(super) fn set_waits(&self, gather_for: Duration, memory: Duration) {
        *self.waits.lock().unwrap() = (gather_for, memory);
    }
}

/// What a rate keeps of itself after `elapsed`.
fn decay(elapsed: Duration, memory: Duration) -> f64 {
    (-elapsed.as_secs_f64() / memory.as_secs_f64()).exp()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_waits_only_while_the_rate_brings_another_within_the_wait() {
        let ms = Duration::from_millis;
        let stream = Stream::new(ms(1));
        let start = Instant::now();
        assert!(
            !stream.more_expected(start, 1),
            "the first request expected more with none before it"
        );
        // One request every 2 ms: about half a request within a 1 ms wait, less than
        // WORTH_WAITING.
        for i in 0..50 {
            stream.took(start + ms(2 * i), 1);
        }
        assert!(
            !stream.more_expected(start + ms(99), 1),
            "a batch waited at a request every 2 ms"
        );
        // Five a millisecond: a batch waits.
        for i in 0..50 {
            stream.took(start + ms(100) + ms(1) * i / 5, 1);
        }
        assert!(
            stream.more_expected(start + ms(110), 1),
            "a batch did not wait at five requests a millisecond"
        );
        // The same rate in batches of five, one batch a millisecond.
        let batches = Stream::new(ms(1));
        for i in 0..20 {
            batches.took(start + ms(i), 5);
        }
        assert!(batches.more_expected(start + ms(20), 1));
        // After a quiet moment the rate has gone.
        assert!(
            !stream.more_expected(start + ms(200), 1),
            "a request after a quiet moment waited"
        );
        // A burst found queued after it is a stream of its own: 11 more in 10 ms.
        assert!(stream.more_expected(start + ms(200), 12));
        // A batch taken late (its requests asked for earlier) never moves the mark back.
        stream.took(start + ms(300), 1);
        stream.took(start, 1);
        assert_eq!(stream.taken.lock().unwrap().at, Some(start + ms(300)));
    }
}
