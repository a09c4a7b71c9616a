//! A lane's pace: the rate its attempts may start at. A token bucket of
//! `spec.delivery.rateLimit` (events per second, burst), and a slow-down when the receiver
//! asks for one (429, 502, 504, the Standard Webhooks throttling advice): the pace halves,
//! from the configured rate or, without one, from the rate the lane was going at, and
//! comes back after [`SLOWED_FOR_MS`] without another such answer. Pure: the engine keeps one
//! per lane that has a limit or was slowed, and passes the clock in.

/// How long one answer asking to slow down holds the lane back.
pub const SLOWED_FOR_MS: i64 = 30_000;
/// The slowest a slow-down takes a lane, in attempts a second.
const FLOOR_PER_SECOND: f64 = 1.0;
/// The window the rate a lane went at is counted over, for a slow-down to halve it.
const WINDOW_MS: i64 = 1000;

/// A configured limit: attempts per second, and how many may start at once after a pause.
/// (Whole numbers: the engine keeps one per subscription.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateLimit {
    pub per_second: u32,
    pub burst: u32,
}

#[derive(Clone, Debug)]
pub struct Pace {
    limit: Option<RateLimit>,
    tokens: f64,
    /// When `tokens` was last brought up to date.
    at_ms: i64,
    /// Slowed down: the rate in force until `until_ms`.
    slowed: Option<(f64, i64)>,
    /// Attempts started in the current window, and in the one before it.
    window_start_ms: i64,
    this_window: u32,
    last_window: u32,
}

impl Pace {
    pub fn new(limit: Option<RateLimit>, now_ms: i64) -> Self {
        Self {
            limit,
            tokens: limit.map_or(0.0, |l| f64::from(l.burst)),
            at_ms: now_ms,
            slowed: None,
            window_start_ms: now_ms,
            this_window: 0,
            last_window: 0,
        }
    }

    /// A new configuration: the tokens held stay (within the new burst).
    pub fn set_limit(&mut self, limit: Option<RateLimit>, now_ms: i64) {
        self.refill(now_ms);
        self.limit = limit;
        self.tokens = self.tokens.min(self.burst(now_ms));
    }

    /// Nothing to enforce: no limit and not slowed (the engine may drop it).
    pub fn is_free(&self, now_ms: i64) -> bool {
        self.limit.is_none() && self.slowed_until(now_ms).is_none()
    }

    /// Until when a slow-down holds, and at what rate.
    pub fn slowed(&self, now_ms: i64) -> Option<(f64, i64)> {
        self.slowed.filter(|(_, until)| *until > now_ms)
    }

    fn slowed_until(&self, now_ms: i64) -> Option<i64> {
        self.slowed(now_ms).map(|(_, until)| until)
    }

    /// The rate in force (None: unlimited).
    fn rate(&self, now_ms: i64) -> Option<f64> {
        match (self.limit, self.slowed(now_ms)) {
            (Some(l), Some((slow, _))) => Some(f64::from(l.per_second).min(slow)),
            (Some(l), None) => Some(f64::from(l.per_second)),
            (None, Some((slow, _))) => Some(slow),
            (None, None) => None,
        }
    }

    fn burst(&self, now_ms: i64) -> f64 {
        match (self.limit, self.slowed(now_ms)) {
            (_, Some(_)) => 1.0,
            (Some(l), None) => f64::from(l.burst),
            (None, None) => 0.0,
        }
    }

    fn refill(&mut self, now_ms: i64) {
        let elapsed = (now_ms - self.at_ms).max(0) as f64 / 1000.0;
        self.at_ms = self.at_ms.max(now_ms);
        if let Some(rate) = self.rate(now_ms) {
            self.tokens = (self.tokens + elapsed * rate).min(self.burst(now_ms).max(1.0));
        }
        if now_ms - self.window_start_ms >= WINDOW_MS {
            let windows = (now_ms - self.window_start_ms) / WINDOW_MS;
            self.last_window = if windows == 1 { self.this_window } else { 0 };
            self.this_window = 0;
            self.window_start_ms += windows * WINDOW_MS;
        }
    }

    /// Whether an attempt may start now, without taking the token; otherwise when it may.
    pub fn ready(&mut self, now_ms: i64) -> Result<(), i64> {
        self.refill(now_ms);
        let Some(rate) = self.rate(now_ms) else {
            return Ok(());
        };
        if self.tokens >= 1.0 {
            return Ok(());
        }
        let wait_ms = ((1.0 - self.tokens) / rate * 1000.0).ceil() as i64;
        Err(now_ms + wait_ms.max(1))
    }

    /// Takes a token for an attempt starting now; otherwise says when one will be there.
    pub fn take(&mut self, now_ms: i64) -> Result<(), i64> {
        self.ready(now_ms)?;
        if self.rate(now_ms).is_some() {
            self.tokens -= 1.0;
        }
        self.this_window += 1;
        Ok(())
    }

    /// The receiver asked to slow down: the pace halves, from the rate in force or the rate
    /// the lane went at in the last second (`hint` when this pace has not counted one),
    /// whichever is lower, not below one per second, for [`SLOWED_FOR_MS`]. Returns the
    /// new rate.
    pub fn slow_down(&mut self, now_ms: i64, hint: f64) -> f64 {
        self.refill(now_ms);
        let counted = self.last_window.max(self.this_window);
        let observed = if counted == 0 {
            hint
        } else {
            f64::from(counted)
        }
        .max(FLOOR_PER_SECOND);
        let from = self
            .rate(now_ms)
            .map_or(observed, |rate| rate.min(observed));
        let rate = (from / 2.0).max(FLOOR_PER_SECOND);
        self.slowed = Some((rate, now_ms + SLOWED_FOR_MS));
        self.tokens = self.tokens.min(1.0);
        rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(per_second: u32, burst: u32) -> Option<RateLimit> {
        Some(RateLimit { per_second, burst })
    }

    /// Starts attempts as fast as the pace allows from 0 to `until` ms, asking at every
    /// millisecond; returns the start times.
    fn starts(pace: &mut Pace, from: i64, until: i64) -> Vec<i64> {
        (from..until).filter(|&t| pace.take(t).is_ok()).collect()
    }

    #[test]
    fn a_limit_allows_its_burst_then_its_rate() {
        let mut pace = Pace::new(limit(10, 5), 0);
        let started = starts(&mut pace, 0, 2000);
        // 5 at once, then one every 100 ms: 5 + 20 in two seconds.
        assert_eq!(started.iter().filter(|&&t| t == 0).count(), 1);
        assert_eq!(started.len(), 5 + 19, "{started:?}");
        assert!(started[..5].iter().all(|&t| t < 5), "{started:?}");
        for pair in started[5..].windows(2) {
            assert_eq!(pair[1] - pair[0], 100, "{started:?}");
        }
        // The refusal says when the next token is there.
        let mut pace = Pace::new(limit(4, 1), 0);
        pace.take(0).unwrap();
        assert_eq!(pace.take(10), Err(250));
        assert_eq!(pace.take(250), Ok(()));
    }

    #[test]
    fn without_a_limit_nothing_waits() {
        let mut pace = Pace::new(None, 0);
        assert_eq!(starts(&mut pace, 0, 100).len(), 100);
        assert!(pace.is_free(100));
    }

    #[test]
    fn a_slow_down_halves_the_pace_for_a_while() {
        let mut pace = Pace::new(limit(10, 10), 0);
        // At its limit for a second (the burst, then 10 a second).
        assert!(starts(&mut pace, 0, 1000).len() >= 10);
        assert_eq!(pace.slow_down(1000, 0.0), 5.0);
        let started = starts(&mut pace, 1000, 3000);
        assert!((9..=11).contains(&started.len()), "{started:?}");
        assert_eq!(pace.slow_down(3000, 0.0), 2.5);
        assert_eq!(pace.slowed(3001), Some((2.5, 3000 + SLOWED_FOR_MS)));
        // After the hold, the configured pace again.
        let from = 3000 + SLOWED_FOR_MS;
        assert!(pace.slowed(from).is_none());
        assert!(starts(&mut pace, from, from + 1000).len() >= 10);
    }

    #[test]
    fn an_unlimited_lane_is_slowed_from_the_rate_it_went_at() {
        let mut pace = Pace::new(None, 0);
        // 40 attempts in the first second.
        for t in 0..40 {
            pace.take(t * 25).unwrap();
        }
        assert_eq!(pace.slow_down(1000, 0.0), 20.0);
        let started = starts(&mut pace, 1000, 2000);
        assert!((19..=21).contains(&started.len()), "{started:?}");
        // Halving again and again stops at one a second.
        for _ in 0..10 {
            pace.slow_down(2000, 0.0);
        }
        assert_eq!(pace.slowed(2000).unwrap().0, FLOOR_PER_SECOND);
        assert!(!pace.is_free(2000));
        assert!(pace.is_free(2000 + SLOWED_FOR_MS));
        // A pace that counted nothing yet goes by the hint.
        assert_eq!(Pace::new(None, 0).slow_down(0, 64.0), 32.0);
    }
}
