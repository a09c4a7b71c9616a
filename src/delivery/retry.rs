//! When to try again: exponential backoff with full jitter, bounded by attempts and by the
//! retry window, with Retry-After honoured up to a cap. Pure functions; the random draw is
//! passed in.

use std::time::Duration;

/// A subscription's retry limits, read from its spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryLimits {
    pub max_attempts: u32,
    pub max_duration: Duration,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    pub retry_after_cap: Duration,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    RetryAt { due_ms: i64 },
    GiveUp { reason: String },
}

/// The backoff ceiling after `attempts` attempts: min(maxBackoff, initial * 2^(attempts-1)).
pub fn ceiling(limits: &RetryLimits, attempts: u32) -> Duration {
    let doublings = attempts.saturating_sub(1).min(62);
    limits
        .initial_backoff
        .checked_mul(1u32.checked_shl(doublings.min(31)).unwrap_or(u32::MAX))
        .unwrap_or(Duration::MAX)
        .min(limits.max_backoff)
}

/// Decides the fate of a delivery whose attempt number `attempts` failed transiently.
/// `unit` is a uniform draw from [0, 1) for the full jitter.
pub fn after_transient_failure(
    limits: &RetryLimits,
    attempts: u32,
    window_start_ms: i64,
    now_ms: i64,
    retry_after: Option<Duration>,
    unit: f64,
) -> Decision {
    if attempts >= limits.max_attempts {
        return Decision::GiveUp {
            reason: format!("gave up after {attempts} attempts (maxAttempts)"),
        };
    }
    let delay = match retry_after {
        Some(asked) => asked.min(limits.retry_after_cap),
        None => ceiling(limits, attempts).mul_f64(unit.clamp(0.0, 1.0)),
    };
    let due_ms = now_ms.saturating_add(delay.as_millis().min(i64::MAX as u128) as i64);
    let window_end = window_start_ms
        .saturating_add(limits.max_duration.as_millis().min(i64::MAX as u128) as i64);
    if due_ms > window_end {
        return Decision::GiveUp {
            reason: format!(
                "gave up: the next attempt would start after the retry window of {}s (maxDuration)",
                limits.max_duration.as_secs()
            ),
        };
    }
    Decision::RetryAt { due_ms }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> RetryLimits {
        RetryLimits {
            max_attempts: 10,
            max_duration: Duration::from_secs(3600),
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(60),
            retry_after_cap: Duration::from_secs(120),
        }
    }

    #[test]
    fn ceiling_doubles_then_caps() {
        let l = limits();
        let ceilings: Vec<_> = (1..=8).map(|n| ceiling(&l, n).as_secs()).collect();
        assert_eq!(ceilings, [1, 2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(ceiling(&l, u32::MAX), Duration::from_secs(60));
    }

    #[test]
    fn full_jitter_stays_within_zero_and_the_ceiling() {
        let l = limits();
        for attempts in 1..=9 {
            let top = ceiling(&l, attempts).as_millis() as i64;
            for unit in [0.0, 0.25, 0.5, 0.999_999] {
                match after_transient_failure(&l, attempts, 0, 1000, None, unit) {
                    Decision::RetryAt { due_ms } => {
                        assert!(
                            due_ms >= 1000 && due_ms <= 1000 + top,
                            "{attempts} {unit} {due_ms}"
                        );
                    }
                    other => panic!("{other:?}"),
                }
            }
        }
        // The draw spreads: the lowest and the highest draw differ by almost the ceiling.
        let low = after_transient_failure(&l, 5, 0, 0, None, 0.0);
        let high = after_transient_failure(&l, 5, 0, 0, None, 0.999);
        assert_eq!(low, Decision::RetryAt { due_ms: 0 });
        assert_eq!(high, Decision::RetryAt { due_ms: 15_984 });
    }

    #[test]
    fn bounded_by_attempts_and_window() {
        let l = limits();
        assert!(matches!(
            after_transient_failure(&l, 10, 0, 0, None, 0.5),
            Decision::GiveUp { .. }
        ));
        // 59 minutes in, a retry up to 60 s later would pass the 1 h window.
        let now = 3_590_000;
        assert!(matches!(
            after_transient_failure(&l, 7, 0, now, None, 0.99),
            Decision::GiveUp { .. }
        ));
        assert!(matches!(
            after_transient_failure(&l, 7, 0, now, None, 0.1),
            Decision::RetryAt { .. }
        ));
    }

    #[test]
    fn retry_after_is_honoured_and_capped() {
        let l = limits();
        assert_eq!(
            after_transient_failure(&l, 1, 0, 1000, Some(Duration::from_secs(30)), 0.0),
            Decision::RetryAt { due_ms: 31_000 }
        );
        assert_eq!(
            after_transient_failure(&l, 1, 0, 1000, Some(Duration::from_secs(86_400)), 0.0),
            Decision::RetryAt { due_ms: 121_000 }
        );
    }
}
