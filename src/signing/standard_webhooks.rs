//! Standard Webhooks v1 (symmetric): `webhook-signature: v1,<base64(HMAC-SHA256(key,
//! "{id}.{timestamp}.{body}"))>`, with the secret given as `whsec_<base64 key>`; and v1a
//! (asymmetric, as Svix ships it): `v1a,<base64(ed25519 signature of the same content)>`,
//! signed with a private key `whsk_<base64>` and verified with the public key
//! `whpk_<base64>`, so a receiver holds nothing that can forge.

use std::fmt;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use ed25519_dalek::{Signature, Signer as _, SigningKey, VerifyingKey};

use super::{Header, Key, SignatureError, check_timestamp, header, parse_timestamp};

pub const ID_HEADER: &str = "webhook-id";
pub const TIMESTAMP_HEADER: &str = "webhook-timestamp";
pub const SIGNATURE_HEADER: &str = "webhook-signature";
/// The prefix Standard Webhooks secrets carry; optional on input, as in the reference
/// libraries.
pub const SECRET_PREFIX: &str = "whsec_";
/// The prefix of an ed25519 private key (the 32-byte seed, or the seed and the public key:
/// 64 bytes, as libsodium keeps it).
pub const PRIVATE_KEY_PREFIX: &str = "whsk_";
/// The prefix of an ed25519 public key (32 bytes).
pub const PUBLIC_KEY_PREFIX: &str = "whpk_";

/// One key of the scheme. The ed25519 keys are boxed: a VerifyingKey is about 200 bytes
/// (its decompressed point), and every subscription keeps a signer, 100,000 of them within
/// a memory budget; unboxed, every HMAC key paid for the largest variant.
#[derive(Clone)]
enum SchemeKey {
    /// `whsec_`: signs and verifies v1.
    Hmac(Key),
    /// `whsk_`: signs v1a, and verifies it with its public half.
    Private(Box<SigningKey>),
    /// `whpk_`: verifies v1a only.
    Public(Box<VerifyingKey>),
}

impl fmt::Debug for SchemeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Hmac(key) => key.fmt(f),
            Self::Private(_) => f.write_str("Ed25519PrivateKey(<redacted>)"),
            Self::Public(key) => write!(f, "Ed25519PublicKey({})", public_key_text(key)),
        }
    }
}

/// Signs and verifies with one or more keys (the first is current, the rest are being
/// rotated in or out).
#[derive(Clone, Debug)]
pub struct Signer {
    keys: Vec<SchemeKey>,
}

impl Signer {
    /// A signer: every key must be able to sign (`whsec_` or `whsk_`).
    pub fn new<'a>(secrets: impl IntoIterator<Item = &'a str>) -> Result<Self, SignatureError> {
        let signer = Self::verifier(secrets)?;
        if signer
            .keys
            .iter()
            .any(|k| matches!(k, SchemeKey::Public(_)))
        {
            return Err(SignatureError::InvalidSecret(format!(
                "a public key ({PUBLIC_KEY_PREFIX}) cannot sign; the Secret must hold the private \
                 key ({PRIVATE_KEY_PREFIX}), and receivers the public one"
            )));
        }
        Ok(signer)
    }

    /// A verifier, which may also hold public keys (`whpk_`).
    pub fn verifier<'a>(
        secrets: impl IntoIterator<Item = &'a str>,
    ) -> Result<Self, SignatureError> {
        let keys = secrets
            .into_iter()
            .map(parse_key)
            .collect::<Result<Vec<_>, _>>()?;
        if keys.is_empty() {
            return Err(SignatureError::InvalidSecret("no secret given".into()));
        }
        Ok(Self { keys })
    }

    /// The public keys (`whpk_`) of its ed25519 keys, for receivers; never anything secret.
    pub fn public_keys(&self) -> Vec<String> {
        self.keys
            .iter()
            .filter_map(|key| match key {
                SchemeKey::Hmac(_) => None,
                SchemeKey::Private(key) => Some(public_key_text(&key.verifying_key())),
                SchemeKey::Public(key) => Some(public_key_text(key)),
            })
            .collect()
    }

    /// `v1,<sig>` or `v1a,<sig>` for each key that signs, space-separated, in key order.
    pub fn signature(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        let timestamp = timestamp.to_string();
        let parts = signed_content(id, &timestamp, body);
        self.keys
            .iter()
            .filter_map(|key| match key {
                SchemeKey::Hmac(key) => Some(format!("v1,{}", BASE64.encode(key.mac(&parts)))),
                SchemeKey::Private(key) => Some(format!(
                    "v1a,{}",
                    BASE64.encode(key.sign(&parts.concat()).to_bytes())
                )),
                SchemeKey::Public(_) => None,
            })
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

    /// Accepts when any `v1` entry matches an HMAC key, or any `v1a` entry verifies under an
    /// ed25519 key, and the timestamp is within tolerance. Entries of other versions are
    /// skipped, as the specification says.
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
        let mut asymmetric = Vec::new();
        for entry in signatures.split(' ').filter(|e| !e.is_empty()) {
            let Some((version, signature)) = entry.split_once(',') else {
                return Err(malformed(
                    SIGNATURE_HEADER,
                    "an entry is not of the form <version>,<signature>",
                ));
            };
            match version {
                "v1" => candidates.push(BASE64.decode(signature).map_err(|_| {
                    malformed(SIGNATURE_HEADER, "a v1 signature is not valid base64")
                })?),
                // One that is not 64 bytes of base64 is skipped, as before v1a was known
                // here: it must not refuse a valid v1 beside it.
                "v1a" => asymmetric.extend(BASE64.decode(signature).ok().and_then(|b| {
                    <[u8; 64]>::try_from(b.as_slice())
                        .ok()
                        .map(|b| Signature::from_bytes(&b))
                })),
                _ => {}
            }
        }
        if candidates.is_empty() && asymmetric.is_empty() {
            return Err(SignatureError::NoSignatures(SIGNATURE_HEADER.into()));
        }

        let parts = signed_content(id, timestamp_text, body);
        let content = parts.concat();
        let ed25519 = |key: &VerifyingKey| {
            asymmetric
                .iter()
                .any(|s| key.verify_strict(&content, s).is_ok())
        };
        let matched = self.keys.iter().any(|key| match key {
            SchemeKey::Hmac(key) => candidates.iter().any(|c| key.verify(&parts, c)),
            SchemeKey::Private(key) => ed25519(&key.verifying_key()),
            SchemeKey::Public(key) => ed25519(key),
        });
        if !matched {
            return Err(SignatureError::NoMatchingSignature);
        }
        check_timestamp(timestamp, now, tolerance)
    }
}

/// `whsk_` (a private key), `whpk_` (a public key), or else an HMAC secret.
fn parse_key(secret: &str) -> Result<SchemeKey, SignatureError> {
    let trimmed = secret.trim();
    let decode = |encoded: &str, what: &str| {
        BASE64
            .decode(encoded)
            .map_err(|_| SignatureError::InvalidSecret(format!("{what} is not valid base64")))
    };
    if let Some(encoded) = trimmed.strip_prefix(PRIVATE_KEY_PREFIX) {
        let bytes = decode(encoded, "a private key (whsk_)")?;
        let seed: [u8; 32] = bytes
            .get(..32)
            .filter(|_| matches!(bytes.len(), 32 | 64))
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| {
                SignatureError::InvalidSecret(
                    "a private key (whsk_) is 32 bytes (the seed) or 64 (seed and public key)"
                        .into(),
                )
            })?;
        let key = SigningKey::from_bytes(&seed);
        if bytes.len() == 64 && bytes[32..] != key.verifying_key().to_bytes() {
            return Err(SignatureError::InvalidSecret(
                "a private key's (whsk_) last 32 bytes are not its public key".into(),
            ));
        }
        return Ok(SchemeKey::Private(Box::new(key)));
    }
    if let Some(encoded) = trimmed.strip_prefix(PUBLIC_KEY_PREFIX) {
        let bytes = decode(encoded, "a public key (whpk_)")?;
        return <[u8; 32]>::try_from(bytes.as_slice())
            .ok()
            .and_then(|b| VerifyingKey::from_bytes(&b).ok())
            .map(|key| SchemeKey::Public(Box::new(key)))
            .ok_or_else(|| {
                SignatureError::InvalidSecret(
                    "a public key (whpk_) is 32 bytes of a valid ed25519 point".into(),
                )
            });
    }
    parse_secret(trimmed).map(SchemeKey::Hmac)
}

fn public_key_text(key: &VerifyingKey) -> String {
    format!("{PUBLIC_KEY_PREFIX}{}", BASE64.encode(key.to_bytes()))
}

/// A fresh ed25519 private key (`whsk_`, the 32-byte seed) from random bytes.
pub fn generate_private_key(seed: [u8; 32]) -> String {
    format!("{PRIVATE_KEY_PREFIX}{}", BASE64.encode(seed))
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

    /// Every subscription keeps a signer (100,000 within a memory budget): a key is no
    /// larger than an HMAC key's vector, whatever the scheme's largest key.
    #[test]
    fn a_key_is_as_small_as_an_hmac_key() {
        let size = std::mem::size_of::<SchemeKey>();
        assert!(size <= 32, "SchemeKey is {size} bytes");
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

    // RFC 8032, section 7.1, TEST 2: a seed and its public key.
    const RFC_SEED: &str = "4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb";
    const RFC_PUBLIC: &str = "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c";

    fn hex_key(prefix: &str, hex_text: &str) -> String {
        format!("{prefix}{}", BASE64.encode(hex::decode(hex_text).unwrap()))
    }

    #[test]
    fn an_ed25519_private_key_gives_the_rfc_public_key_and_hides_itself() {
        let private = hex_key(PRIVATE_KEY_PREFIX, RFC_SEED);
        let public = hex_key(PUBLIC_KEY_PREFIX, RFC_PUBLIC);
        let signer = Signer::new([private.as_str()]).unwrap();
        assert_eq!(signer.public_keys(), [public.as_str()]);
        // The libsodium form (seed, then public key) is the same key.
        let long = hex_key(PRIVATE_KEY_PREFIX, &format!("{RFC_SEED}{RFC_PUBLIC}"));
        assert_eq!(
            Signer::new([long.as_str()]).unwrap().public_keys(),
            [public]
        );
        let shown = format!("{signer:?}");
        assert!(!shown.contains(&private[5..15]), "{shown}");
        assert!(shown.contains("redacted"), "{shown}");
    }

    /// v1a: signed with the private key, verified with the public key alone; a body, id or
    /// timestamp changed, another key, or a mangled signature fails.
    #[test]
    fn v1a_signs_with_the_private_key_and_verifies_with_the_public_one() {
        let private = hex_key(PRIVATE_KEY_PREFIX, RFC_SEED);
        let public = hex_key(PUBLIC_KEY_PREFIX, RFC_PUBLIC);
        let sender = Signer::new([private.as_str()]).unwrap();
        let sig = sender.signature(ID, TIMESTAMP, BODY);
        assert!(sig.starts_with("v1a,") && !sig.contains(' '), "{sig}");
        let receiver = Signer::verifier([public.as_str()]).unwrap();
        let ts = TIMESTAMP.to_string();
        receiver
            .verify(headers(ID, &ts, &sig), BODY, TIMESTAMP, TOL)
            .unwrap();
        let no_match = Err(SignatureError::NoMatchingSignature);
        assert_eq!(
            receiver.verify(headers(ID, &ts, &sig), b"{}", TIMESTAMP, TOL),
            no_match
        );
        assert_eq!(
            receiver.verify(headers("msg_other", &ts, &sig), BODY, TIMESTAMP, TOL),
            no_match
        );
        let other = Signer::new([generate_private_key([9; 32]).as_str()]).unwrap();
        let other_public = other.public_keys();
        assert_eq!(
            Signer::verifier([other_public[0].as_str()])
                .unwrap()
                .verify(headers(ID, &ts, &sig), BODY, TIMESTAMP, TOL),
            no_match
        );
        // An HMAC secret does not accept a v1a signature, nor a public key a v1 one.
        assert_eq!(
            signer().verify(headers(ID, &ts, &sig), BODY, TIMESTAMP, TOL),
            no_match
        );
        assert_eq!(
            receiver.verify(headers(ID, &ts, EXPECTED), BODY, TIMESTAMP, TOL),
            no_match
        );
        assert_eq!(
            receiver.verify(headers(ID, &ts, "v1a,AAAA"), BODY, TIMESTAMP, TOL),
            Err(SignatureError::NoSignatures(SIGNATURE_HEADER.into()))
        );
    }

    /// Moving from HMAC to ed25519 (or between two ed25519 keys): both signatures go out,
    /// and a receiver holding either key accepts.
    #[test]
    fn rotation_mixes_v1_and_v1a() {
        let private = generate_private_key([3; 32]);
        let both = Signer::new([SECRET, private.as_str()]).unwrap();
        let sig = both.signature(ID, TIMESTAMP, BODY);
        let entries: Vec<&str> = sig
            .split(' ')
            .map(|e| e.split(',').next().unwrap())
            .collect();
        assert_eq!(entries, ["v1", "v1a"]);
        let ts = TIMESTAMP.to_string();
        signer()
            .verify(headers(ID, &ts, &sig), BODY, TIMESTAMP, TOL)
            .unwrap();
        let public = both.public_keys();
        Signer::verifier([public[0].as_str()])
            .unwrap()
            .verify(headers(ID, &ts, &sig), BODY, TIMESTAMP, TOL)
            .unwrap();
    }

    #[test]
    fn bad_ed25519_keys_are_refused() {
        let public = hex_key(PUBLIC_KEY_PREFIX, RFC_PUBLIC);
        let refused = Signer::new([public.as_str()]).unwrap_err().to_string();
        assert!(refused.contains("cannot sign"), "{refused}");
        for bad in [
            "whsk_not base64".to_string(),
            hex_key(PRIVATE_KEY_PREFIX, "00ff"),
            hex_key(PRIVATE_KEY_PREFIX, &format!("{RFC_SEED}{RFC_SEED}")),
            hex_key(PUBLIC_KEY_PREFIX, "00ff"),
        ] {
            assert!(Signer::verifier([bad.as_str()]).is_err(), "{bad}");
        }
    }
}
