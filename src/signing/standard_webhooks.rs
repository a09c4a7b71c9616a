//! Standard Webhooks v1 (symmetric): `webhook-signature: v1,<base64(HMAC-SHA256(key,
//! "{id}.{timestamp}.{body}"))>`, with the secret given as `whsec_<base64 key>`.

use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;

use super::{Header, Key, SignatureError, check_timestamp, header, parse_timestamp};

pub const ID_HEADER: &str = "webhook-id";
pub const TIMESTAMP_HEADER: &str = "webhook-timestamp";
pub const SIGNATURE_HEADER: &str = "webhook-signature";
/// The prefix Standard Webhooks secrets carry; optional on input, as in the reference
/// libraries.
pub const SECRET_PREFIX: &str = "whsec_";

/// Signs and verifies with one or more keys (the first is current, the rest are being
/// rotated in or out).
#[derive(Clone, Debug)]
pub struct Signer {
    keys: Vec<Key>,
}

impl Signer {
    pub fn new<'a>(secrets: impl IntoIterator<Item = &'a str>) -> Result<Self, SignatureError> {
        let keys = secrets
            .into_iter()
            .map(parse_secret)
            .collect::<Result<Vec<_>, _>>()?;
        if keys.is_empty() {
            return Err(SignatureError::InvalidSecret("no secret given".into()));
        }
        Ok(Self { keys })
    }

    /// `v1,<sig>` for each key, space-separated, in key order.
    pub fn signature(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        let timestamp = timestamp.to_string();
        let parts = signed_content(id, &timestamp, body);
        self.keys
            .iter()
            .map(|key| format!("v1,{}", BASE64.encode(key.mac(&parts))))
            .collect::<Vec<_>>()
            .join(" ")
    }

    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> Vec<Header> {
        vec![
            (ID_HEADER.into(), id.into()),
            (TIMESTAMP_HEADER.into(), timestamp.to_string()),
            (SIGNATURE_HEADER.into(), self.signature(id, timestamp, body)),
        ]
    }

    /// Accepts when any `v1` entry matches any key and the timestamp is within tolerance.
    /// Entries of other versions (`v1a`, `v2`) are skipped, as the specification says.
    pub fn verify<'a>(
        &self,
        headers: impl IntoIterator<Item = (&'a str, &'a str)> + Clone,
        body: &[u8],
        now: i64,
        tolerance: Duration,
    ) -> Result<(), SignatureError> {
        let id = header(headers.clone(), ID_HEADER)?;
        if id.is_empty() {
            return Err(malformed(ID_HEADER, "empty"));
        }
        let timestamp_text = header(headers.clone(), TIMESTAMP_HEADER)?;
        let timestamp = parse_timestamp(timestamp_text)?;
        let signatures = header(headers, SIGNATURE_HEADER)?;

        let mut candidates = Vec::new();
        for entry in signatures.split(' ').filter(|e| !e.is_empty()) {
            let Some((version, signature)) = entry.split_once(',') else {
                return Err(malformed(
                    SIGNATURE_HEADER,
                    "an entry is not of the form <version>,<signature>",
                ));
            };
            if version != "v1" {
                continue;
            }
            let decoded = BASE64
                .decode(signature)
                .map_err(|_| malformed(SIGNATURE_HEADER, "a v1 signature is not valid base64"))?;
            candidates.push(decoded);
        }
        if candidates.is_empty() {
            return Err(SignatureError::NoSignatures(SIGNATURE_HEADER.into()));
        }

        let parts = signed_content(id, timestamp_text, body);
        let matched = self
            .keys
            .iter()
            .any(|key| candidates.iter().any(|c| key.verify(&parts, c)));
        if !matched {
            return Err(SignatureError::NoMatchingSignature);
        }
        check_timestamp(timestamp, now, tolerance)
    }
}

/// `whsec_<base64>` (or bare base64) into key bytes.
pub fn parse_secret(secret: &str) -> Result<Key, SignatureError> {
    let encoded = secret
        .trim()
        .strip_prefix(SECRET_PREFIX)
        .unwrap_or(secret.trim());
    let bytes = BASE64.decode(encoded).map_err(|_| {
        SignatureError::InvalidSecret(format!(
            "a Standard Webhooks secret is {SECRET_PREFIX}<base64>; this one is not valid base64"
        ))
    })?;
    Key::from_bytes(bytes)
}

/// A fresh random secret in the `whsec_` form (24 bytes, as the reference libraries make).
pub fn generate_secret(random: [u8; 24]) -> String {
    format!("{SECRET_PREFIX}{}", BASE64.encode(random))
}

fn signed_content<'a>(id: &'a str, timestamp: &'a str, body: &'a [u8]) -> [&'a [u8]; 5] {
    [id.as_bytes(), b".", timestamp.as_bytes(), b".", body]
}

fn malformed(header: &str, reason: &str) -> SignatureError {
    SignatureError::MalformedHeader {
        header: header.into(),
        reason: reason.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The vector published with the Standard Webhooks specification's reference libraries.
    const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const TIMESTAMP: i64 = 1614265330;
    const BODY: &[u8] = br#"{"test": 2432232314}"#;
    const EXPECTED: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
    const TOL: Duration = super::super::DEFAULT_TOLERANCE;

    fn signer() -> Signer {
        Signer::new([SECRET]).unwrap()
    }

    fn headers<'a>(id: &'a str, ts: &'a str, sig: &'a str) -> [(&'a str, &'a str); 3] {
        [
            (ID_HEADER, id),
            (TIMESTAMP_HEADER, ts),
            (SIGNATURE_HEADER, sig),
        ]
    }

    #[test]
    fn published_vector_signs_exactly() {
        assert_eq!(signer().signature(ID, TIMESTAMP, BODY), EXPECTED);
        // Same key without the prefix.
        let bare = Signer::new(["MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"]).unwrap();
        assert_eq!(bare.signature(ID, TIMESTAMP, BODY), EXPECTED);
    }

    #[test]
    fn published_vector_verifies_and_its_one_bit_flip_does_not() {
        let ts = TIMESTAMP.to_string();
        signer()
            .verify(headers(ID, &ts, EXPECTED), BODY, TIMESTAMP, TOL)
            .unwrap();
        let flipped = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OA=";
        assert_eq!(
            signer().verify(headers(ID, &ts, flipped), BODY, TIMESTAMP, TOL),
            Err(SignatureError::NoMatchingSignature)
        );
    }

    #[test]
    fn round_trip_and_every_tampering_fails() {
        let s = signer();
        let sig = s.signature(ID, TIMESTAMP, BODY);
        let ts = TIMESTAMP.to_string();
        s.verify(headers(ID, &ts, &sig), BODY, TIMESTAMP + 10, TOL)
            .unwrap();

        let no_match = Err(SignatureError::NoMatchingSignature);
        assert_eq!(
            s.verify(
                headers(ID, &ts, &sig),
                b"{\"test\": 2432232315}",
                TIMESTAMP,
                TOL
            ),
            no_match
        );
        assert_eq!(
            s.verify(headers("msg_other", &ts, &sig), BODY, TIMESTAMP, TOL),
            no_match
        );
        let later = (TIMESTAMP + 1).to_string();
        assert_eq!(
            s.verify(headers(ID, &later, &sig), BODY, TIMESTAMP, TOL),
            no_match
        );
        let other = Signer::new([generate_secret([7; 24]).as_str()]).unwrap();
        assert_eq!(
            other.verify(headers(ID, &ts, &sig), BODY, TIMESTAMP, TOL),
            no_match
        );
    }

    #[test]
    fn timestamps_outside_tolerance_fail_even_with_a_good_signature() {
        let s = signer();
        let sig = s.signature(ID, TIMESTAMP, BODY);
        let ts = TIMESTAMP.to_string();
        assert!(matches!(
            s.verify(headers(ID, &ts, &sig), BODY, TIMESTAMP + 301, TOL),
            Err(SignatureError::TimestampTooOld(301))
        ));
        assert!(matches!(
            s.verify(headers(ID, &ts, &sig), BODY, TIMESTAMP - 301, TOL),
            Err(SignatureError::TimestampTooNew(301))
        ));
    }

    #[test]
    fn rotation_signs_with_every_key_and_either_key_verifies() {
        let new = generate_secret([1; 24]);
        let both = Signer::new([new.as_str(), SECRET]).unwrap();
        let sig = both.signature(ID, TIMESTAMP, BODY);
        assert_eq!(sig.split(' ').count(), 2);
        assert!(sig.ends_with(EXPECTED));
        let ts = TIMESTAMP.to_string();
        signer()
            .verify(headers(ID, &ts, &sig), BODY, TIMESTAMP, TOL)
            .unwrap();
        Signer::new([new.as_str()])
            .unwrap()
            .verify(headers(ID, &ts, &sig), BODY, TIMESTAMP, TOL)
            .unwrap();
    }

    #[test]
    fn other_versions_are_skipped() {
        let ts = TIMESTAMP.to_string();
        let sig = format!("v1a,AAAA v2,{} {EXPECTED}", &EXPECTED[3..]);
        signer()
            .verify(headers(ID, &ts, &sig), BODY, TIMESTAMP, TOL)
            .unwrap();
        assert_eq!(
            signer().verify(
                headers(ID, &ts, &format!("v2,{}", &EXPECTED[3..])),
                BODY,
                TIMESTAMP,
                TOL
            ),
            Err(SignatureError::NoSignatures(SIGNATURE_HEADER.into()))
        );
    }

    #[test]
    fn malformed_headers_fail_cleanly() {
        let s = signer();
        let ts = TIMESTAMP.to_string();
        let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
            (
                vec![(TIMESTAMP_HEADER, &ts), (SIGNATURE_HEADER, EXPECTED)],
                "missing id",
            ),
            (
                vec![(ID_HEADER, ID), (SIGNATURE_HEADER, EXPECTED)],
                "missing timestamp",
            ),
            (
                vec![(ID_HEADER, ID), (TIMESTAMP_HEADER, &ts)],
                "missing signature",
            ),
            (headers("", &ts, EXPECTED).to_vec(), "empty id"),
            (
                headers(ID, "hello", EXPECTED).to_vec(),
                "non-numeric timestamp",
            ),
            (
                headers(ID, "-1614265330", EXPECTED).to_vec(),
                "negative timestamp",
            ),
            (
                headers(ID, "1614265330.5", EXPECTED).to_vec(),
                "fractional timestamp",
            ),
            (headers(ID, &ts, "").to_vec(), "empty signature"),
            (headers(ID, &ts, "   ").to_vec(), "blank signature"),
            (headers(ID, &ts, "v1").to_vec(), "no comma"),
            (
                headers(ID, &ts, "g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=").to_vec(),
                "no version",
            ),
            (headers(ID, &ts, "v1,not base64!").to_vec(), "bad base64"),
            (headers(ID, &ts, "v1,").to_vec(), "empty v1"),
            (headers(ID, &ts, "v1,AAAA").to_vec(), "short v1"),
            (headers(ID, &ts, "v1,,,,").to_vec(), "commas"),
            (
                headers(
                    ID,
                    &ts,
                    "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=AAAA",
                )
                .to_vec(),
                "long v1",
            ),
            (headers(ID, &ts, "ü,ü").to_vec(), "non-ascii"),
        ];
        for (h, what) in cases {
            assert!(
                s.verify(h, BODY, TIMESTAMP, TOL).is_err(),
                "{what} was accepted"
            );
        }
        let twice = [
            (ID_HEADER, ID),
            (TIMESTAMP_HEADER, ts.as_str()),
            (SIGNATURE_HEADER, EXPECTED),
            ("Webhook-Signature", EXPECTED),
        ];
        assert_eq!(
            s.verify(twice, BODY, TIMESTAMP, TOL),
            Err(SignatureError::DuplicateHeader(SIGNATURE_HEADER.into()))
        );
    }

    #[test]
    fn bad_secrets_are_refused() {
        assert!(Signer::new(["whsec_not base64"]).is_err());
        assert!(Signer::new(["whsec_"]).is_err());
        assert!(Signer::new(std::iter::empty()).is_err());
    }
}
