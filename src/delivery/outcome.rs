//! What an attempt's result means (sender-observed outcomes): accepted, transient (retry)
//! or terminal (dead-letter at once). Pure functions.

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
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Accepted => "Accepted",
            Self::Transient => "Transient",
            Self::Terminal => "Terminal",
        }
    }
}

/// Classifies an HTTP status code.
pub fn classify_status(status: u16) -> Outcome {
    match status {
        200..=299 => Outcome::Accepted,
        408 | 425 | 429 | 500..=599 => Outcome::Transient,
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
            100, 101, 301, 302, 303, 307, 308, 400, 401, 403, 404, 409, 410, 413, 422, 600,
        ] {
            assert_eq!(classify_status(s), Outcome::Terminal, "{s}");
        }
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
}
