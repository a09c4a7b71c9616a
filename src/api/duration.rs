//! Durations in specs: Kubernetes-style strings ("250ms", "30s", "5m", "72h", "1h30m").
//! The text a user wrote is kept, so `kubectl get -o yaml` shows "72h" and not "259200s".

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The schema pattern; the API server refuses anything else before herald sees it.
pub const PATTERN: &str = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$";

#[derive(Clone, PartialEq, Eq)]
pub struct Duration {
    text: String,
    value: std::time::Duration,
}

impl Duration {
    pub fn get(&self) -> std::time::Duration {
        self.value
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not a duration such as 250ms, 30s, 5m, 72h or 1h30m")]
pub struct ParseDurationError(String);

impl FromStr for Duration {
    type Err = ParseDurationError;

    /// Hand-parsed with checked arithmetic: general-purpose parsers panic on overflow, and a
    /// spec must never be able to panic herald.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let invalid = || ParseDurationError(text.chars().take(40).collect());
        if text.is_empty() || text.len() > 32 {
            return Err(invalid());
        }
        let mut nanos: u128 = 0;
        let mut rest = text;
        while !rest.is_empty() {
            let number_len = rest
                .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                .ok_or_else(invalid)?;
            let (number, tail) = rest.split_at(number_len);
            let (unit_nanos, unit_len) = if tail.starts_with("ms") {
                (1_000_000u128, 2)
            } else if tail.starts_with('s') {
                (1_000_000_000, 1)
            } else if tail.starts_with('m') {
                (60_000_000_000, 1)
            } else if tail.starts_with('h') {
                (3_600_000_000_000, 1)
            } else {
                return Err(invalid());
            };
            let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
            if whole.is_empty()
                || (number.contains('.') && fraction.is_empty())
                || fraction.contains('.')
            {
                return Err(invalid());
            }
            let whole: u128 = whole.parse().map_err(|_| invalid())?;
            let mut part = whole.checked_mul(unit_nanos).ok_or_else(invalid)?;
            let mut scale = unit_nanos;
            for digit in fraction.bytes().take(18) {
                scale /= 10;
                // Checked too: a whole part just under u128::MAX nanoseconds plus its
                // fraction overflows ("94522879700260684295381835.9h" is 29 characters).
                part = part
                    .checked_add(u128::from(digit - b'0') * scale)
                    .ok_or_else(invalid)?;
            }
            nanos = nanos.checked_add(part).ok_or_else(invalid)?;
            rest = &tail[unit_len..];
        }
        let secs = u64::try_from(nanos / 1_000_000_000).map_err(|_| invalid())?;
        let value = std::time::Duration::new(secs, (nanos % 1_000_000_000) as u32);
        Ok(Self {
            text: text.to_string(),
            value,
        })
    }
}

impl fmt::Debug for Duration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.text)
    }
}

impl fmt::Display for Duration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl Serialize for Duration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.text)
    }
}

impl<'de> Deserialize<'de> for Duration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = Cow::<str>::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl schemars::JsonSchema for Duration {
    fn schema_name() -> Cow<'static, str> {
        "Duration".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "maxLength": 32,
            "pattern": PATTERN,
        })
    }
}

/// A duration from a literal known to be valid (defaults).
pub(crate) fn literal(text: &str) -> Duration {
    text.parse()
        .expect("duration literals in herald's source are valid")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration as Std;

    #[test]
    fn parses_kubernetes_style_and_keeps_the_text() {
        let d: Duration = "1h30m".parse().unwrap();
        assert_eq!(d.get(), Std::from_secs(5400));
        assert_eq!(serde_json::to_string(&d).unwrap(), "\"1h30m\"");
        assert_eq!(
            "250ms".parse::<Duration>().unwrap().get(),
            Std::from_millis(250)
        );
        assert_eq!(
            "1.5s".parse::<Duration>().unwrap().get(),
            Std::from_millis(1500)
        );
        assert_eq!(
            "72h".parse::<Duration>().unwrap().get(),
            Std::from_secs(72 * 3600)
        );
    }

    #[test]
    fn refuses_what_the_schema_refuses() {
        for bad in [
            "",
            "10",
            "-5s",
            "5 s",
            "5d",
            "1us",
            "5ns",
            "abc",
            "s",
            "1h-30m",
            "99999999999999999999999999999h",
            // Issue 24 item 11: within the schema's 32 characters and pattern, these
            // overflowed u128 in the fraction (a panic in debug builds, a wrap in release).
            "94522879700260684295381835.9h",
            "94522879700260684295381835.99h",
            "5671372782015641057722910123.99m",
            // The sum of two parts overflows.
            "94522879700260684295381835h1h",
            // Fits u128 nanoseconds, not u64 seconds.
            "340282366920938463463374607s",
            "1.s",
            ".5s",
            "1..5s",
            "1.2.3s",
            "5sm",
            "ms",
        ] {
            assert!(bad.parse::<Duration>().is_err(), "{bad:?} accepted");
            assert!(serde_json::from_str::<Duration>(&format!("{bad:?}")).is_err());
        }
    }

    /// The overflowing inputs above are ones the API server lets through: they match the
    /// schema's pattern and length, so only the parser stands between them and a panic.
    #[test]
    fn overflowing_durations_pass_the_schema_and_are_refused_here() {
        let pattern = regex::Regex::new(PATTERN).unwrap();
        for text in [
            "94522879700260684295381835.9h",
            "5671372782015641057722910123.99m",
        ] {
            assert!(
                text.len() <= 32 && pattern.is_match(text),
                "{text} is not schema-valid"
            );
            assert!(text.parse::<Duration>().is_err(), "{text} accepted");
        }
    }
}
