//! What an attempt's result means (sender-observed outcomes): accepted, transient (retry),
//! terminal (dead-letter at once) or gone (dead-letter, and disable the subscription).
//! Pure functions.

use std::time::{Duration, SystemTime};

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Outcome {
    /// 2xx: the receiver has the event.
    Accepted,
    /// 408, 425, 429, 5xx, timeouts and transport errors: try again later.
    Transient,
    /// 3xx (redirects are not followed), other 4xx, 1xx, a refused destination: retrying
    /// would not help.
    Terminal,
    /// 410: the receiver says the endpoint is gone for good (the Standard Webhooks spec), so
    /// no later event should be tried either.
    Gone,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Accepted => "Accepted",
            Self::Transient => "Transient",
            Self::Terminal => "Terminal",
            Self::Gone => "Gone",
        }
    }
}

/// Classifies an HTTP status code.
pub fn classify_status(status: u16) -> Outcome {
    match status {
        200..=299 => Outcome::Accepted,
        408 | 425 | 429 | 500..=599 => Outcome::Transient,
        410 => Outcome::Gone,
        _ => Outcome::Terminal,
    }
}

/// Parses a Retry-After value: delay-seconds or an HTTP date. A date in the past means
/// "now"; anything unparseable is ignored (None), as if the header were absent.
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // Saturate absurdly long values rather than fail; the cap applies anyway.
        return Some(Duration::from_secs(value.parse().unwrap_or(u64::MAX)));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_classes() {
        for s in [200, 201, 202, 204, 299] {
            assert_eq!(classify_status(s), Outcome::Accepted, "{s}");
        }
        for s in [408, 425, 429, 500, 502, 503, 504, 599] {
            assert_eq!(classify_status(s), Outcome::Transient, "{s}");
        }
        for s in [
            100, 101, 301, 302, 303, 307, 308, 400, 401, 403, 404, 409, 413, 422, 600,
        ] {
            assert_eq!(classify_status(s), Outcome::Terminal, "{s}");
        }
        assert_eq!(classify_status(410), Outcome::Gone);
    }

    #[test]
    fn retry_after_seconds_and_dates() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        assert_eq!(
            parse_retry_after("120", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(parse_retry_after(" 0 ", now), Some(Duration::ZERO));
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:51:37 GMT", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(
            parse_retry_after("999999999999999999999999", now),
            Some(Duration::from_secs(u64::MAX))
        );
        for bad in ["", "-5", "1.5", "soon", "Sun, 32 Nov 1994 08:49:37 GMT"] {
            assert_eq!(parse_retry_after(bad, now), None, "{bad:?}");
        }
    }

    /// The classes as documented on [`Outcome`], by the status's class digit; checked for
    /// every possible status code, not a sample.
    #[test]
    fn every_status_code_maps_to_its_documented_class() {
        for status in 0..=u16::MAX {
            let documented = match (status / 100, status) {
                (2, _) => Outcome::Accepted,
                (_, 408 | 425 | 429) | (5, _) => Outcome::Transient,
                (_, 410) => Outcome::Gone,
                // 1xx, 3xx (not followed), other 4xx, and anything outside 100..=599.
                _ => Outcome::Terminal,
            };
            assert_eq!(classify_status(status), documented, "{status}");
        }
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            /// delay-seconds: any run of digits is that many seconds, saturating.
            #[test]
            fn retry_after_seconds_are_read_exactly(
                seconds in proptest::num::u64::ANY,
                pad in "[ \t]{0,3}",
            ) {
                let now = std::time::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
                let value = format!("{pad}{seconds}{pad}");
                prop_assert_eq!(parse_retry_after(&value, now), Some(Duration::from_secs(seconds)));
            }

            /// An HTTP date is the time until it, or zero when it has passed.
            #[test]
            fn retry_after_dates_are_the_time_until_them(
                now_s in 0u64..=4_000_000_000,
                at_s in 0u64..=4_000_000_000,
            ) {
                let now = std::time::UNIX_EPOCH + Duration::from_secs(now_s);
                let at = std::time::UNIX_EPOCH + Duration::from_secs(at_s);
                let value = httpdate::fmt_http_date(at);
                prop_assert_eq!(
                    parse_retry_after(&value, now),
                    Some(Duration::from_secs(at_s.saturating_sub(now_s)))
                );
            }

            /// Any value at all: delay-seconds exactly when it is digits, else an HTTP date
            /// when it is one, else ignored; never a panic.
            #[test]
            fn any_retry_after_value_is_seconds_a_date_or_ignored(
                value in prop_oneof!["\\PC{0,40}", "[ 0-9a-zA-Z,:+-.]{0,32}"],
            ) {
                let now = std::time::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
                let trimmed = value.trim();
                let expected = if !trimmed.is_empty() && trimmed.bytes().all(|b| b.is_ascii_digit()) {
                    Some(Duration::from_secs(trimmed.parse().unwrap_or(u64::MAX)))
                } else {
                    httpdate::parse_http_date(trimmed)
                        .ok()
                        .map(|at| at.duration_since(now).unwrap_or(Duration::ZERO))
                };
                prop_assert_eq!(parse_retry_after(&value, now), expected);
            }
        }
    }
}
