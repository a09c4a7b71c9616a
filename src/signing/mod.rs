//! Webhook signatures: HMAC-SHA256 or ed25519 in the Standard Webhooks scheme (the default)
//! and HMAC-SHA256 in a Stripe-compatible scheme. One signer per scheme, used by delivery and by the CLI alike.
//!
//! Every attempt is signed with every configured secret, so receivers can move from an old
//! secret to a new one without a gap. Verification compares in constant time and refuses
//! timestamps outside a tolerance (default five minutes) in either direction.

pub mod standard_webhooks;
pub mod stripe;

use std::fmt;
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

use crate::api::SigningScheme;

/// How far a signature's timestamp may lie from the verifier's clock.
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(5 * 60);

/// Why a signature was not accepted (or a secret not usable). Each malformed shape has its
/// own message; none of them panics.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SignatureError {
    #[error("missing header {0}")]
    MissingHeader(String),
    #[error("header {0} appears more than once")]
    DuplicateHeader(String),
    #[error("malformed {header} header: {reason}")]
    MalformedHeader { header: String, reason: String },
    #[error("timestamp {0:?} is not a Unix time in seconds")]
    InvalidTimestamp(String),
    #[error("timestamp is {0}s older than now, beyond the tolerance")]
    TimestampTooOld(u64),
    #[error("timestamp is {0}s in the future, beyond the tolerance")]
    TimestampTooNew(u64),
    #[error("{0} carries no v1 signature")]
    NoSignatures(String),
    #[error("no signature matches the secret(s)")]
    NoMatchingSignature,
    #[error("invalid secret: {0}")]
    InvalidSecret(String),
}

/// An HMAC key. Its bytes never appear in Debug output or logs.
#[derive(Clone)]
pub struct Key(Vec<u8>);

impl Key {
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<Self, SignatureError> {
        let bytes = bytes.into();
        if bytes.is_empty() {
            return Err(SignatureError::InvalidSecret("the secret is empty".into()));
        }
        Ok(Self(bytes))
    }

    /// HMAC-SHA256 of the concatenated parts.
    pub fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        for part in parts {
            mac.update(part);
        }
        mac.finalize().into_bytes().into()
    }

    /// Constant-time check of a candidate MAC against the MAC of `parts`.
    pub fn verify(&self, parts: &[&[u8]], candidate: &[u8]) -> bool {
        self.mac(parts).ct_eq(candidate).into()
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Key(<redacted>)")
    }
}

/// A signer for one subscription: its scheme and its secrets (current first).
#[derive(Clone, Debug)]
pub enum Signer {
    StandardWebhooks(standard_webhooks::Signer),
    Stripe(stripe::Signer),
}

/// A header to send: name and value.
pub type Header = (String, String);

impl Signer {
    /// Builds a signer from secret strings as they are stored in Secrets. `header` names
    /// the Stripe-style header (default [`stripe::DEFAULT_HEADER`]); Standard Webhooks
    /// header names are fixed.
    pub fn new(
        scheme: SigningScheme,
        secrets: &[impl AsRef<str>],
        header: Option<&str>,
    ) -> Result<Self, SignatureError> {
        if secrets.is_empty() {
            return Err(SignatureError::InvalidSecret("no secret given".into()));
        }
        Ok(match scheme {
            SigningScheme::StandardWebhooks => Self::StandardWebhooks(
                standard_webhooks::Signer::new(secrets.iter().map(AsRef::as_ref))?,
            ),
            SigningScheme::Stripe => Self::Stripe(stripe::Signer::new(
                secrets.iter().map(AsRef::as_ref),
                header.unwrap_or(stripe::DEFAULT_HEADER),
            )?),
        })
    }

    /// As [`Signer::new`] for a receiver: Standard Webhooks keys may also be public keys
    /// (`whpk_`), which verify `v1a` signatures and sign nothing.
    pub fn verifier(
        scheme: SigningScheme,
        secrets: &[impl AsRef<str>],
        header: Option<&str>,
    ) -> Result<Self, SignatureError> {
        match scheme {
            SigningScheme::StandardWebhooks => Ok(Self::StandardWebhooks(
                standard_webhooks::Signer::verifier(secrets.iter().map(AsRef::as_ref))?,
            )),
            SigningScheme::Stripe => Self::new(scheme, secrets, header),
        }
    }

    /// The public keys (`whpk_`) receivers verify its ed25519 signatures with.
    pub fn public_keys(&self) -> Vec<String> {
        match self {
            Self::StandardWebhooks(s) => s.public_keys(),
            Self::Stripe(_) => Vec::new(),
        }
    }

    /// The signature headers for one attempt. `id` is the event id, stable across retries.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> Vec<Header> {
        match self {
            Self::StandardWebhooks(s) => s.sign(id, timestamp, body),
            Self::Stripe(s) => s.sign(timestamp, body),
        }
    }

    /// Checks received headers against the body, the secrets and the clock.
    pub fn verify<'a>(
        &self,
        headers: impl IntoIterator<Item = (&'a str, &'a str)> + Clone,
        body: &[u8],
        now: i64,
        tolerance: Duration,
    ) -> Result<(), SignatureError> {
        match self {
            Self::StandardWebhooks(s) => s.verify(headers, body, now, tolerance),
            Self::Stripe(s) => s.verify(headers, body, now, tolerance),
        }
    }
}

/// The clock in Unix seconds, as signatures carry it.
pub fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or_default()
}

/// The single value of a header, looked up case-insensitively. A header sent twice is
/// refused rather than guessed at.
pub(crate) fn header<'a>(
    headers: impl IntoIterator<Item = (&'a str, &'a str)>,
    name: &str,
) -> Result<&'a str, SignatureError> {
    let mut found = None;
    for (key, value) in headers {
        if key.trim().eq_ignore_ascii_case(name) {
            if found.is_some() {
                return Err(SignatureError::DuplicateHeader(name.to_string()));
            }
            found = Some(value.trim());
        }
    }
    found.ok_or_else(|| SignatureError::MissingHeader(name.to_string()))
}

/// Parses a Unix timestamp in seconds: ASCII digits only, no sign, no padding tricks.
pub(crate) fn parse_timestamp(value: &str) -> Result<i64, SignatureError> {
    let invalid = || SignatureError::InvalidTimestamp(value.chars().take(32).collect());
    if value.is_empty() || value.len() > 12 || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid());
    }
    value.parse().map_err(|_| invalid())
}

/// Refuses a timestamp further than `tolerance` from `now`, in either direction.
pub(crate) fn check_timestamp(
    timestamp: i64,
    now: i64,
    tolerance: Duration,
) -> Result<(), SignatureError> {
    let tolerance = i64::try_from(tolerance.as_secs()).unwrap_or(i64::MAX);
    let age = now.saturating_sub(timestamp);
    if age > tolerance {
        return Err(SignatureError::TimestampTooOld(age.unsigned_abs()));
    }
    if age < -tolerance {
        return Err(SignatureError::TimestampTooNew(age.unsigned_abs()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_lookup_is_case_insensitive_and_refuses_duplicates() {
        let headers = [("Webhook-Id", " msg_1 "), ("other", "x")];
        assert_eq!(header(headers, "webhook-id").unwrap(), "msg_1");
        assert_eq!(
            header(headers, "webhook-signature"),
            Err(SignatureError::MissingHeader("webhook-signature".into()))
        );
        let twice = [("webhook-id", "a"), ("WEBHOOK-ID", "b")];
        assert_eq!(
            header(twice, "webhook-id"),
            Err(SignatureError::DuplicateHeader("webhook-id".into()))
        );
    }

    #[test]
    fn timestamps_must_be_plain_unsigned_integers() {
        assert_eq!(parse_timestamp("1614265330").unwrap(), 1614265330);
        for bad in [
            "",
            "-5",
            "+5",
            "1.5",
            "1e9",
            " 1",
            "abc",
            "99999999999999999999",
            "１２",
        ] {
            assert!(parse_timestamp(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn tolerance_applies_both_ways() {
        let tol = Duration::from_secs(300);
        assert!(check_timestamp(1000, 1300, tol).is_ok());
        assert!(check_timestamp(1300, 1000, tol).is_ok());
        assert_eq!(
            check_timestamp(1000, 1301, tol),
            Err(SignatureError::TimestampTooOld(301))
        );
        assert_eq!(
            check_timestamp(1301, 1000, tol),
            Err(SignatureError::TimestampTooNew(301))
        );
        assert!(check_timestamp(0, i64::MAX, tol).is_err());
    }

    #[test]
    fn keys_are_redacted_in_debug_output() {
        let key = Key::from_bytes(b"super-secret".to_vec()).unwrap();
        assert!(!format!("{key:?}").contains("super"));
        assert!(Key::from_bytes(Vec::new()).is_err());
    }

    #[test]
    fn a_signer_needs_a_secret() {
        let none: [&str; 0] = [];
        assert!(Signer::new(SigningScheme::Stripe, &none, None).is_err());
    }
}
