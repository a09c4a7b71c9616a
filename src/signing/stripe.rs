//! The Stripe-compatible scheme: one header `t=<unix>,v1=<hex(HMAC-SHA256(secret,
//! "{t}.{body}"))>`, the secret string used as the HMAC key as is, so Stripe's own libraries
//! verify herald's requests with only the header name changed.

use std::time::Duration;

use super::{Header, Key, SignatureError, check_timestamp, header, parse_timestamp};

/// The header herald sends unless the subscription names another.
pub const DEFAULT_HEADER: &str = "Herald-Signature";

#[derive(Clone, Debug)]
pub struct Signer {
    keys: Vec<Key>,
    header: String,
}

impl Signer {
    pub fn new<'a>(
        secrets: impl IntoIterator<Item = &'a str>,
        header: &str,
    ) -> Result<Self, SignatureError> {
        let keys = secrets
            .into_iter()
            .map(|s| Key::from_bytes(s.as_bytes().to_vec()))
            .collect::<Result<Vec<_>, _>>()?;
        if keys.is_empty() {
            return Err(SignatureError::InvalidSecret("no secret given".into()));
        }
        if header.is_empty() || !header.bytes().all(is_token_byte) {
            return Err(SignatureError::InvalidSecret(format!(
                "{header:?} is not a valid header name"
            )));
        }
        Ok(Self {
            keys,
            header: header.into(),
        })
    }

    pub fn header_name(&self) -> &str {
        &self.header
    }

    /// `t=<timestamp>,v1=<hex>` with one `v1` per key, in key order.
    pub fn signature(&self, timestamp: i64, body: &[u8]) -> String {
        let t = timestamp.to_string();
        let mut value = format!("t={t}");
        for key in &self.keys {
            value.push_str(",v1=");
            value.push_str(&hex::encode(key.mac(&[t.as_bytes(), b".", body])));
        }
        value
    }

    pub fn sign(&self, timestamp: i64, body: &[u8]) -> Vec<Header> {
        vec![(self.header.clone(), self.signature(timestamp, body))]
    }

    /// Accepts when any `v1` matches any key and `t` is within tolerance. Other schemes in
    /// the header (`v0`) are ignored, as Stripe's libraries do.
    pub fn verify<'a>(
        &self,
        headers: impl IntoIterator<Item = (&'a str, &'a str)>,
        body: &[u8],
        now: i64,
        tolerance: Duration,
    ) -> Result<(), SignatureError> {
        let value = header(headers, &self.header)?;
        let malformed = |reason: &str| SignatureError::MalformedHeader {
            header: self.header.clone(),
            reason: reason.into(),
        };
        let mut timestamp = None;
        let mut candidates = Vec::new();
        for item in value.split(',') {
            let Some((key, val)) = item.trim().split_once('=') else {
                return Err(malformed("an item is not of the form key=value"));
            };
            match key {
                "t" if timestamp.is_some() => return Err(malformed("t appears more than once")),
                "t" => timestamp = Some(val),
                "v1" => candidates
                    .push(hex::decode(val).map_err(|_| malformed("a v1 signature is not hex"))?),
                _ => {}
            }
        }
        let timestamp_text = timestamp.ok_or_else(|| malformed("no t= timestamp"))?;
        let timestamp = parse_timestamp(timestamp_text)?;
        if candidates.is_empty() {
            return Err(SignatureError::NoSignatures(self.header.clone()));
        }
        let parts: [&[u8]; 3] = [timestamp_text.as_bytes(), b".", body];
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

/// RFC 9110 token characters, the only ones allowed in a header name.
fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "whsec_test_secret";
    const TS: i64 = 1700000000;
    const BODY: &[u8] = br#"{"id":"evt_1","type":"invoice.paid"}"#;
    const TOL: Duration = super::super::DEFAULT_TOLERANCE;

    fn signer() -> Signer {
        Signer::new([SECRET], DEFAULT_HEADER).unwrap()
    }

    fn with(value: &str) -> [(&str, &str); 1] {
        [(DEFAULT_HEADER, value)]
    }

    #[test]
    fn signature_is_hex_hmac_of_timestamp_dot_body() {
        // Independent computation, with the hmac and sha2 crates directly (not the code
        // under test's Key::mac): HMAC-SHA256("whsec_test_secret", "1700000000.{body}").
        use hmac::{Hmac, Mac};
        let mut mac = Hmac::<sha2::Sha256>::new_from_slice(SECRET.as_bytes()).unwrap();
        mac.update(b"1700000000.");
        mac.update(BODY);
        let computed = hex::encode(mac.finalize().into_bytes());
        // The same value from outside Rust:
        // printf '%s' '1700000000.{"id":"evt_1","type":"invoice.paid"}' \
        //   | openssl dgst -sha256 -hmac whsec_test_secret
        assert_eq!(
            computed,
            "46dc069361a7691082640523fa33fe5d6c8c88d5f5e257cdf8cf11539d166595"
        );
        assert_eq!(
            signer().signature(TS, BODY),
            format!("t=1700000000,v1={computed}")
        );
    }

    #[test]
    fn round_trip_and_every_tampering_fails() {
        let s = signer();
        let sig = s.signature(TS, BODY);
        s.verify(with(&sig), BODY, TS + 299, TOL).unwrap();
        // A differently cased header name is the same header.
        s.verify([("herald-signature", sig.as_str())], BODY, TS, TOL)
            .unwrap();

        let no_match = Err(SignatureError::NoMatchingSignature);
        assert_eq!(s.verify(with(&sig), b"{}", TS, TOL), no_match);
        let moved = sig.replace("t=1700000000", "t=1700000001");
        assert_eq!(s.verify(with(&moved), BODY, TS, TOL), no_match);
        let other = Signer::new(["another"], DEFAULT_HEADER).unwrap();
        assert_eq!(other.verify(with(&sig), BODY, TS, TOL), no_match);
        assert!(matches!(
            s.verify(with(&sig), BODY, TS + 301, TOL),
            Err(SignatureError::TimestampTooOld(_))
        ));
        assert!(matches!(
            s.verify(with(&sig), BODY, TS - 301, TOL),
            Err(SignatureError::TimestampTooNew(_))
        ));
    }

    #[test]
    fn rotation_emits_one_v1_per_secret() {
        let both = Signer::new(["new-secret", SECRET], DEFAULT_HEADER).unwrap();
        let sig = both.signature(TS, BODY);
        assert_eq!(sig.matches("v1=").count(), 2);
        signer().verify(with(&sig), BODY, TS, TOL).unwrap();
        Signer::new(["new-secret"], DEFAULT_HEADER)
            .unwrap()
            .verify(with(&sig), BODY, TS, TOL)
            .unwrap();
    }

    #[test]
    fn v0_and_unknown_schemes_are_ignored() {
        let sig = signer().signature(TS, BODY);
        let mixed = sig.replace(",v1=", ",v0=deadbeef,x=1,v1=");
        signer().verify(with(&mixed), BODY, TS, TOL).unwrap();
        assert_eq!(
            signer().verify(with("t=1700000000,v0=deadbeef"), BODY, TS, TOL),
            Err(SignatureError::NoSignatures(DEFAULT_HEADER.into()))
        );
    }

    #[test]
    fn configurable_header_name() {
        let s = Signer::new([SECRET], "X-Acme-Signature").unwrap();
        let headers = s.sign(TS, BODY);
        assert_eq!(headers[0].0, "X-Acme-Signature");
        s.verify([("x-acme-signature", headers[0].1.as_str())], BODY, TS, TOL)
            .unwrap();
        assert!(Signer::new([SECRET], "bad header").is_err());
        assert!(Signer::new([SECRET], "").is_err());
        assert!(Signer::new([""], DEFAULT_HEADER).is_err());
    }

    #[test]
    fn malformed_headers_fail_cleanly() {
        let s = signer();
        let good = s.signature(TS, BODY);
        let v1 = good.split(",v1=").nth(1).unwrap().to_string();
        let cases = [
            String::new(),
            "garbage".into(),
            ",".into(),
            "t=".into(),
            format!("v1={v1}"),
            format!("t=abc,v1={v1}"),
            format!("t=-1700000000,v1={v1}"),
            format!("t=1700000000,t=1700000000,v1={v1}"),
            "t=1700000000".into(),
            "t=1700000000,v1=".into(),
            "t=1700000000,v1=zz".into(),
            "t=1700000000,v1=abc".into(),
            format!("t=1700000000,v1={v1}00"),
            format!("t=1700000000;v1={v1}"),
            format!("t=1700000000,,v1={v1}"),
            "t=1700000000,v1=é".into(),
        ];
        for value in &cases {
            assert!(
                s.verify(with(value), BODY, TS, TOL).is_err(),
                "{value:?} was accepted"
            );
        }
        assert_eq!(
            s.verify([("other", good.as_str())], BODY, TS, TOL),
            Err(SignatureError::MissingHeader(DEFAULT_HEADER.into()))
        );
    }
}
