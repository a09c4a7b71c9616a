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

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        /// Milliseconds between `low` and `high`, log-uniform: small values as often as
        /// large ones, so that boundaries are hit at every scale.
        fn millis(low: u64, high: u64) -> impl Strategy<Value = u64> {
            (0.0f64..=1.0).prop_map(move |f| {
                ((low as f64) * (high as f64 / low as f64).powf(f)).round() as u64
            })
        }

        /// Limits as the schema allows them: initialBackoff and maxBackoff 10ms..72h with
        /// initial <= max, maxDuration 1s..720h, maxAttempts 1..1000, the cap up to 72h.
        fn limits() -> impl Strategy<Value = RetryLimits> {
            (
                prop_oneof![1u32..=10, 1u32..=1000],
                millis(1_000, 720 * 3_600_000),
                millis(10, 24 * 3_600_000),
                millis(10, 72 * 3_600_000),
                prop_oneof![Just(0u64), millis(1, 72 * 3_600_000)],
            )
                .prop_map(|(max_attempts, duration, a, b, cap)| RetryLimits {
                    max_attempts,
                    max_duration: Duration::from_millis(duration),
                    initial_backoff: Duration::from_millis(a.min(b)),
                    max_backoff: Duration::from_millis(a.max(b)),
                    retry_after_cap: Duration::from_millis(cap),
                })
        }

        /// The documented ceiling, computed without shifts: min(max, initial * 2^(n-1)).
        fn documented_ceiling(limits: &RetryLimits, attempts: u32) -> u128 {
            let mut ceiling = limits.initial_backoff.as_nanos();
            for _ in 1..attempts {
                ceiling *= 2;
                if ceiling >= limits.max_backoff.as_nanos() {
                    break;
                }
            }
            ceiling.min(limits.max_backoff.as_nanos())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            #[test]
            fn the_ceiling_is_the_documented_one_and_never_shrinks(
                limits in limits(),
                attempts in 1u32..=u32::MAX,
            ) {
                let c = ceiling(&limits, attempts);
                prop_assert_eq!(c.as_nanos(), documented_ceiling(&limits, attempts));
                prop_assert!(c <= limits.max_backoff);
                prop_assert!(c >= limits.initial_backoff);
                prop_assert!(ceiling(&limits, attempts.saturating_add(1)) >= c);
            }

            /// Every delay lies within [0, ceiling] (jitter) or is the capped Retry-After,
            /// no retry starts after the window, and giving up happens exactly when the
            /// attempts are spent or the next start would pass the window.
            #[test]
            fn every_delay_is_within_its_ceiling_and_the_window(
                limits in limits(),
                attempts in 1u32..=1100,
                window_start in -1_000_000_000i64..=4_000_000_000_000,
                // Where in the window the failure happens: anywhere, or within two delays
                // of its end.
                near_end in proptest::bool::ANY,
                position in 0.0f64..=1.2,
                retry_after in proptest::option::of(prop_oneof![millis(1, 100_000_000), 0u64..=u64::MAX / 2_000]),
                unit in 0.0f64..1.0,
            ) {
                let asked = retry_after.map(Duration::from_millis);
                let duration = limits.max_duration.as_millis() as f64;
                let delay_top = match asked {
                    Some(a) => a.min(limits.retry_after_cap),
                    None => ceiling(&limits, attempts),
                }
                .as_millis() as f64;
                let elapsed = if near_end {
                    (duration - position * 2.0 * delay_top).max(0.0)
                } else {
                    position * duration
                };
                let now = window_start + elapsed as i64;
                let decision =
                    after_transient_failure(&limits, attempts, window_start, now, asked, unit);
                let window_end = window_start + limits.max_duration.as_millis() as i64;
                let top = match asked {
                    Some(a) => a.min(limits.retry_after_cap).as_millis() as i64,
                    None => ceiling(&limits, attempts).as_millis() as i64,
                };
                match decision {
                    Decision::RetryAt { due_ms } => {
                        prop_assert!(attempts < limits.max_attempts);
                        prop_assert!(due_ms >= now && due_ms <= now + top);
                        if asked.is_some() {
                            prop_assert_eq!(due_ms, now + top);
                        }
                        prop_assert!(due_ms <= window_end);
                    }
                    Decision::GiveUp { .. } => {
                        // Only when spent, or when this draw's delay passes the window.
                        let delay = match asked {
                            Some(_) => top,
                            None => ceiling(&limits, attempts).mul_f64(unit).as_millis() as i64,
                        };
                        let spent = attempts >= limits.max_attempts;
                        prop_assert!(spent || now + delay > window_end);
                    }
                }
            }

            /// A whole delivery that always fails: at most maxAttempts attempts, none starting
            /// after maxDuration from the publish, each wait within its ceiling.
            #[test]
            fn a_delivery_that_always_fails_stays_within_max_duration(
                limits in limits(),
                published in 0i64..=4_000_000_000_000,
                draws in proptest::collection::vec(
                    (0.0f64..1.0, millis(1, 300_000), proptest::option::of(millis(1, 100_000_000))),
                    1..=1000,
                ),
            ) {
                let window_end = published + limits.max_duration.as_millis() as i64;
                let mut start = published;
                let mut attempts = 0u32;
                for (unit, took, retry_after) in draws {
                    attempts += 1;
                    prop_assert!(start <= window_end, "attempt {} starts after the window", attempts);
                    prop_assert!(attempts <= limits.max_attempts);
                    let ended = start + took as i64;
                    match after_transient_failure(&limits, attempts, published, ended, retry_after.map(Duration::from_millis), unit) {
                        Decision::RetryAt { due_ms } => {
                            prop_assert!(due_ms >= ended);
                            start = due_ms;
                        }
                        Decision::GiveUp { .. } => break,
                    }
                }
            }
        }
    }
}
