//! The fuzz targets' bodies, one function per input surface. Each takes the raw bytes a
//! fuzzer produces, feeds them to herald and panics when a property does not hold (a panic
//! inside herald is a finding as well).
//!
//! Two harnesses run these same functions: the cargo-fuzz crate around this file
//! (`tests/fuzz/fuzz_targets/*.rs`, libFuzzer on nightly, `scripts/fuzz`) and the property
//! tests on stable (`tests/fuzz_properties.rs`, which includes this file as a module).
//! Nothing here depends on either harness.

use std::sync::LazyLock;
use std::time::{Duration, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use herald::api::duration::{Duration as SpecDuration, PATTERN as DURATION_PATTERN};
use herald::api::subscription::event_type_matches;
use herald::delivery::SubscriptionConfig;
use herald::delivery::outcome::parse_retry_after;
use herald::ingest::decode_event;
use herald::signing::{DEFAULT_TOLERANCE, SignatureError, standard_webhooks, stripe};
use herald::standalone::{Loader, Manifests, quotas_in_force};
use serde_json::Value;

/// A target's body: the fuzzer's bytes in, a panic when a property fails.
pub type Target = fn(&[u8]);

/// Every target by name, for harnesses that run them all (names as in `fuzz_targets/`).
pub const TARGETS: &[(&str, Target)] = &[
    ("standard_webhooks", standard_webhooks),
    ("stripe", stripe),
    ("event_decode", event_decode),
    ("duration", duration),
    ("event_type", event_type),
    ("manifests", manifests),
    ("retry_after", retry_after),
];

/// Splits a fuzzer's bytes into the pieces a target needs. Short inputs read as zeros and
/// empty strings, so every input is usable.
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Self { data }
    }

    pub fn byte(&mut self) -> u8 {
        let (first, rest) = self.data.split_first().unwrap_or((&0, &[]));
        self.data = rest;
        *first
    }

    pub fn u64(&mut self) -> u64 {
        let mut bytes = [0u8; 8];
        for b in &mut bytes {
            *b = self.byte();
        }
        u64::from_le_bytes(bytes)
    }

    /// A piece of up to 63 bytes, its length given by the first byte (modulo 64, so that
    /// random bytes leave most of an input to the last piece, often a body).
    pub fn bytes(&mut self) -> &'a [u8] {
        let len = usize::from(self.byte() % 64).min(self.data.len());
        let (piece, rest) = self.data.split_at(len);
        self.data = rest;
        piece
    }

    pub fn text(&mut self) -> String {
        String::from_utf8_lossy(self.bytes()).into_owned()
    }

    pub fn rest(self) -> &'a [u8] {
        self.data
    }
}

/// An event id as herald sends it: 1-255 visible ASCII characters (what the ingest API
/// accepts), made from arbitrary bytes.
fn event_id(raw: &[u8]) -> String {
    let id: String = raw.iter().map(|b| char::from(b'!' + b % 94)).collect();
    if id.is_empty() { "evt".into() } else { id }
}

/// A clock `skew` seconds from `timestamp`; the tolerance is five minutes.
fn skewed(timestamp: i64, skew: u8) -> i64 {
    timestamp + i64::from(skew) * 600 / 255 - 300
}

/// A Standard Webhooks secret for key bytes: `whsec_` and their base64.
fn whsec(key: &[u8]) -> String {
    format!("{}{}", standard_webhooks::SECRET_PREFIX, BASE64.encode(key))
}

/// Whether two HMAC keys of at most 64 bytes are the same key: HMAC pads short keys with
/// zero bytes, so "k" and "k\0" sign alike.
fn same_hmac_key(a: &[u8], b: &[u8]) -> bool {
    let trim = |k: &[u8]| k.len() - k.iter().rev().take_while(|&&b| b == 0).count();
    a[..trim(a)] == b[..trim(b)]
}

/// Flips one bit of `bytes` at a position chosen by `at` (nothing when empty).
fn flip(bytes: &mut [u8], at: u64) {
    if !bytes.is_empty() {
        let i = (at % bytes.len() as u64) as usize;
        bytes[i] ^= 1 << (at % 8);
    }
}

/// Standard Webhooks: sign → verify accepts (with every rotated key alone, within the
/// tolerance, refused outside it); a foreign key never verifies; a duplicated header is
/// refused; and whatever the headers and body are changed to, verification succeeds only
/// if the signed content (`id.timestamp.body`) is exactly the one that was signed.
pub fn standard_webhooks(data: &[u8]) {
    let mut input = Input::new(data);
    let key = input.bytes().to_vec();
    let rotated = input.bytes().to_vec();
    let id = event_id(input.bytes());
    let timestamp = (input.u64() % 1_000_000_000_000) as i64;
    let now = skewed(timestamp, input.byte());
    let flags = input.byte();
    let (alt_id, alt_timestamp, alt_signature) = (input.text(), input.text(), input.text());
    let (alt_secret, at) = (input.text(), input.u64());
    let body = input.rest();

    // Any secret text: refused or usable, never a panic.
    if let Ok(signer) = standard_webhooks::Signer::new([alt_secret.as_str()]) {
        let headers = signer.sign(&id, timestamp, body);
        let pairs: Vec<(&str, &str)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            signer.verify(pairs, body, timestamp, DEFAULT_TOLERANCE),
            Ok(())
        );
    }

    let key = if key.is_empty() { vec![0] } else { key };
    let secrets: Vec<String> = [&key, &rotated]
        .into_iter()
        .filter(|k| !k.is_empty())
        .map(|k| whsec(k))
        .collect();
    let signer = standard_webhooks::Signer::new(secrets.iter().map(String::as_str))
        .expect("whsec_ + base64 of a non-empty key is a valid secret");
    let headers = signer.sign(&id, timestamp, body);
    let value = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .expect("sign() sends the header")
    };
    let (id_sent, timestamp_sent, signature) = (
        value(standard_webhooks::ID_HEADER),
        value(standard_webhooks::TIMESTAMP_HEADER),
        value(standard_webhooks::SIGNATURE_HEADER),
    );
    let verify = |signer: &standard_webhooks::Signer,
                  (id, timestamp, signature): (&str, &str, &str),
                  body: &[u8],
                  now: i64| {
        signer.verify(
            [
                (standard_webhooks::ID_HEADER, id),
                (standard_webhooks::TIMESTAMP_HEADER, timestamp),
                (standard_webhooks::SIGNATURE_HEADER, signature),
            ],
            body,
            now,
            DEFAULT_TOLERANCE,
        )
    };
    let sent = (
        id_sent.as_str(),
        timestamp_sent.as_str(),
        signature.as_str(),
    );

    // Round trip, with every secret alone (rotation), and the tolerance both ways.
    assert_eq!(verify(&signer, sent, body, now), Ok(()), "sign → verify");
    for secret in &secrets {
        let alone = standard_webhooks::Signer::new([secret.as_str()]).unwrap();
        assert_eq!(
            verify(&alone, sent, body, now),
            Ok(()),
            "a rotated key alone"
        );
    }
    assert!(matches!(
        verify(&signer, sent, body, timestamp + 301),
        Err(SignatureError::TimestampTooOld(301))
    ));
    assert!(matches!(
        verify(&signer, sent, body, timestamp - 301),
        Err(SignatureError::TimestampTooNew(301))
    ));

    // A key that is neither of the signing keys.
    let mut foreign = key.clone();
    foreign.push(0x5a);
    if !same_hmac_key(&foreign, &rotated) {
        let other = standard_webhooks::Signer::new([whsec(&foreign).as_str()]).unwrap();
        assert_eq!(
            verify(&other, sent, body, now),
            Err(SignatureError::NoMatchingSignature),
            "a foreign key"
        );
    }

    // A header sent twice is refused, whichever it is.
    let twice = [
        (standard_webhooks::ID_HEADER, sent.0),
        (standard_webhooks::TIMESTAMP_HEADER, sent.1),
        (standard_webhooks::SIGNATURE_HEADER, sent.2),
        (
            ["Webhook-Id", "Webhook-Timestamp", "WEBHOOK-SIGNATURE"][usize::from(flags % 3)],
            sent.2,
        ),
    ];
    assert!(matches!(
        signer.verify(twice, body, now, DEFAULT_TOLERANCE),
        Err(SignatureError::DuplicateHeader(_))
    ));

    // Tampering: replace or edit any of the parts; acceptance means the same signed content.
    let mut tampered_signature = signature.clone().into_bytes();
    if flags & 8 != 0 {
        flip(&mut tampered_signature, at);
    }
    let tampered_signature = String::from_utf8_lossy(&tampered_signature).into_owned();
    let mut tampered_body = body.to_vec();
    if flags & 16 != 0 {
        flip(&mut tampered_body, at >> 8);
    }
    if flags & 32 != 0 {
        tampered_body.extend_from_slice(alt_id.as_bytes());
    }
    let tampered = (
        if flags & 1 != 0 { &alt_id } else { &id_sent },
        if flags & 2 != 0 {
            &alt_timestamp
        } else {
            &timestamp_sent
        },
        if flags & 4 != 0 {
            &alt_signature
        } else {
            &tampered_signature
        },
    );
    let result = verify(
        &signer,
        (tampered.0, tampered.1, tampered.2),
        &tampered_body,
        now,
    );
    let content = |id: &str, timestamp: &str, body: &[u8]| {
        [
            id.trim().as_bytes(),
            b".",
            timestamp.trim().as_bytes(),
            b".",
            body,
        ]
        .concat()
        .escape_ascii()
        .to_string()
    };
    if result.is_ok() {
        assert_eq!(
            content(tampered.0, tampered.1, &tampered_body),
            content(&id_sent, &timestamp_sent, body),
            "a tampered request verified with other signed content"
        );
    }
    if flags & 0x3f == 0 {
        assert_eq!(result, Ok(()), "nothing was tampered with");
    }
}

/// The Stripe-compatible scheme: sign → verify accepts (rotated keys alone, within the
/// tolerance); a foreign secret never verifies; header names are accepted exactly when they
/// are HTTP tokens; and whatever the header value and body are changed to, verification
/// succeeds only for the signed body and the signed timestamp.
pub fn stripe(data: &[u8]) {
    let mut input = Input::new(data);
    let secret = input.text();
    let rotated = input.text();
    let header_choice = input.text();
    let timestamp = (input.u64() % 1_000_000_000_000) as i64;
    let now = skewed(timestamp, input.byte());
    let flags = input.byte();
    let alt_value = input.text();
    let at = input.u64();
    let body = input.rest();

    let token = !header_choice.is_empty()
        && header_choice
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
    let chosen = stripe::Signer::new(["s"], &header_choice);
    assert_eq!(
        chosen.is_ok(),
        token,
        "header name {header_choice:?}: accepted exactly when it is an HTTP token"
    );
    let header = if token {
        header_choice.as_str()
    } else {
        stripe::DEFAULT_HEADER
    };

    let secret = if secret.is_empty() {
        "s".into()
    } else {
        secret
    };
    let secrets: Vec<&str> = [secret.as_str(), rotated.as_str()]
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect();
    let signer = stripe::Signer::new(secrets.iter().copied(), header).unwrap();
    let signed = signer.sign(timestamp, body);
    assert_eq!(signed.len(), 1);
    let value = signed[0].1.clone();
    let verify = |signer: &stripe::Signer, value: &str, body: &[u8], now: i64, tolerance| {
        signer.verify([(header, value)], body, now, tolerance)
    };

    assert_eq!(
        verify(&signer, &value, body, now, DEFAULT_TOLERANCE),
        Ok(())
    );
    for secret in &secrets {
        let alone = stripe::Signer::new([*secret], header).unwrap();
        assert_eq!(
            verify(&alone, &value, body, now, DEFAULT_TOLERANCE),
            Ok(()),
            "a rotated secret alone"
        );
    }
    assert!(matches!(
        verify(&signer, &value, body, timestamp + 301, DEFAULT_TOLERANCE),
        Err(SignatureError::TimestampTooOld(301))
    ));
    // The header name is matched without regard to case.
    let lower = header.to_ascii_lowercase();
    assert_eq!(
        signer.verify(
            [(lower.as_str(), value.as_str())],
            body,
            now,
            DEFAULT_TOLERANCE
        ),
        Ok(())
    );
    let foreign = format!("{secret}\u{1}");
    if !same_hmac_key(foreign.as_bytes(), rotated.as_bytes()) {
        let other = stripe::Signer::new([foreign.as_str()], header).unwrap();
        assert_eq!(
            verify(&other, &value, body, now, DEFAULT_TOLERANCE),
            Err(SignatureError::NoMatchingSignature),
            "a foreign secret"
        );
    }

    let mut tampered_value = value.clone().into_bytes();
    if flags & 1 != 0 {
        flip(&mut tampered_value, at);
    }
    let mut tampered_value = String::from_utf8_lossy(&tampered_value).into_owned();
    if flags & 2 != 0 {
        tampered_value = alt_value.clone();
    }
    if flags & 4 != 0 {
        let at = (at as usize >> 16) % (tampered_value.len() + 1);
        if tampered_value.is_char_boundary(at) {
            tampered_value.insert_str(at, &alt_value);
        }
    }
    let mut tampered_body = body.to_vec();
    if flags & 8 != 0 {
        flip(&mut tampered_body, at >> 8);
    }
    let result = verify(
        &signer,
        &tampered_value,
        &tampered_body,
        now,
        DEFAULT_TOLERANCE,
    );
    if result.is_ok() {
        assert_eq!(
            tampered_body.escape_ascii().to_string(),
            body.escape_ascii().to_string(),
            "a tampered body verified"
        );
        // Tolerance zero at the signed time: the accepted timestamp is the signed one.
        assert_eq!(
            verify(&signer, &tampered_value, body, timestamp, Duration::ZERO),
            Ok(()),
            "a tampered timestamp verified"
        );
    }
    if flags & 0x0f == 0 {
        assert_eq!(result, Ok(()), "nothing was tampered with");
    }
}

/// The publish body decoder: an accepted event has a type and id as the API documents them,
/// data that any JSON reader takes, and decodes again to the same event when re-encoded.
pub fn event_decode(data: &[u8]) {
    let Ok(event) = decode_event(data) else {
        return;
    };
    let kind_ok = |kind: &str| {
        (1..=253).contains(&kind.len())
            && kind
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.:/-".contains(&b))
    };
    assert!(kind_ok(&event.kind), "accepted type {:?}", event.kind);
    if let Some(id) = &event.id {
        assert!(
            (1..=255).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic()),
            "accepted id {id:?}"
        );
    }
    let data_value = event.data.as_ref().map(|raw| {
        serde_json::from_str::<Value>(raw.get())
            .unwrap_or_else(|e| panic!("accepted data that serde_json cannot read ({e}): {raw}"))
    });
    // As herald delivers it: the data as written, embedded in an envelope that a receiver
    // reads.
    let envelope = format!(
        r#"{{"id":{},"type":{},"data":{}}}"#,
        serde_json::to_string(&event.id).unwrap(),
        serde_json::to_string(&event.kind).unwrap(),
        event.data.as_ref().map_or("null", |raw| raw.get()),
    );
    let reread: Value = serde_json::from_str(&envelope)
        .unwrap_or_else(|e| panic!("the envelope is not JSON ({e}): {envelope}"));
    assert_eq!(reread["data"], data_value.clone().unwrap_or(Value::Null));
    // The envelope is itself a publish body (without a timestamp): it decodes to the same
    // event, the data byte for byte as the producer wrote it.
    let again = decode_event(envelope.as_bytes())
        .unwrap_or_else(|e| panic!("a re-encoded accepted event is refused: {}", e.code()));
    assert_eq!(again.kind, event.kind);
    assert_eq!(again.id, event.id);
    assert_eq!(
        again.data.as_ref().map(|raw| raw.get()),
        event.data.as_ref().map(|raw| raw.get())
    );
}

/// Spec durations: herald accepts exactly what the CRD's pattern accepts (within 32
/// characters), except values too large for a `std::time::Duration`; an accepted value is
/// the one written (to a nanosecond per fraction digit) and survives format → parse and a
/// JSON round trip unchanged.
pub fn duration(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    static SCHEMA: LazyLock<regex::Regex> =
        LazyLock::new(|| regex::Regex::new(DURATION_PATTERN).unwrap());
    let schema_ok = text.len() <= 32 && SCHEMA.is_match(text);
    match text.parse::<SpecDuration>() {
        Ok(parsed) => {
            assert!(schema_ok, "{text:?} parsed but the schema refuses it");
            let exact = exact_nanos(text);
            let got = parsed.get().as_nanos() as f64;
            let slack = 9.0 * text.len() as f64 + exact * 1e-12;
            assert!(
                got <= exact + exact * 1e-12 && exact - got <= slack,
                "{text:?} parsed as {got} ns, written {exact} ns"
            );
            let again: SpecDuration = parsed.to_string().parse().unwrap();
            assert_eq!(again, parsed, "format → parse");
            assert_eq!(again.get(), parsed.get());
            let json = serde_json::to_string(&parsed).unwrap();
            let back: SpecDuration = serde_json::from_str(&json).unwrap();
            assert_eq!(back, parsed, "JSON round trip");
            assert_eq!(back.as_str(), text, "the text written is kept");
        }
        Err(_) if schema_ok => {
            // Only values past what a Duration holds (u64 seconds) may be refused.
            let exact = exact_nanos(text);
            assert!(
                exact >= u64::MAX as f64 * 1e9 * (1.0 - 1e-9),
                "{text:?} is valid by the schema ({exact} ns) but refused"
            );
        }
        Err(_) => {}
    }
}

/// The nanoseconds a duration text says, computed apart from herald's parser (as f64: exact
/// enough for the checks above).
fn exact_nanos(text: &str) -> f64 {
    static PARTS: LazyLock<regex::Regex> =
        LazyLock::new(|| regex::Regex::new(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)").unwrap());
    PARTS
        .captures_iter(text)
        .map(|c| {
            let number: f64 = c[1].parse().unwrap();
            let unit = match &c[2] {
                "ms" => 1e6,
                "s" => 1e9,
                "m" => 60e9,
                _ => 3600e9,
            };
            number * unit
        })
        .sum()
}

/// `eventTypes` entries: "*" matches every type; "p.*" exactly the types that start with
/// "p." and go on; anything else only itself. A glob's matches stay matches when extended.
pub fn event_type(data: &[u8]) {
    let mut input = Input::new(data);
    let pattern = input.text();
    let suffix = input.text();
    let event_type = String::from_utf8_lossy(input.rest()).into_owned();
    let matches = event_type_matches(&pattern, &event_type);
    let expected = if pattern == "*" {
        true
    } else if let Some(prefix) = pattern.strip_suffix(".*") {
        let dotted = format!("{prefix}.");
        event_type.starts_with(&dotted) && event_type.len() > dotted.len()
    } else {
        pattern == event_type
    };
    assert_eq!(matches, expected, "{pattern:?} against {event_type:?}");
    assert!(event_type_matches(&pattern, &pattern) || pattern.ends_with(".*"));
    if matches && pattern.ends_with(".*") {
        let longer = format!("{event_type}{suffix}");
        assert!(
            event_type_matches(&pattern, &longer),
            "{pattern:?} against {longer:?}"
        );
    }
}

/// A secret planted in manifest text: every `$S` in the fuzzer's text becomes this value.
pub const PLANTED_SECRET: &str = "whsec_cGxhbnRlZC1zZWNyZXQtdmFsdWU";

thread_local! {
    static LOADER: std::cell::RefCell<Loader> = std::cell::RefCell::new(Loader::new());
}

/// The standalone manifest loader on arbitrary text: it never panics; no error and no
/// `Debug` output shows a Secret's value or a value written in a field (the planted secret,
/// wherever the text puts it as a value); accepted quotas keep the 16-attempt floor; accepted
/// subscriptions survive a JSON round trip, still pass the schema's rules, and build an
/// engine configuration or refuse without quoting a value.
pub fn manifests(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let text = text.replace("$S", PLANTED_SECRET);
    let planted_as_value = planted_only_as_values(&text);
    let result = LOADER.with(|loader| {
        let mut loader = loader.borrow_mut();
        let result = loader.add_text("fuzz.yaml", 0, &text);
        let manifests = loader.take();
        result.map(|()| manifests)
    });
    let manifests = match result {
        Err(e) => {
            let message = format!("{e:#}");
            if planted_as_value {
                assert!(
                    !message.contains(PLANTED_SECRET)
                        && !message.contains(&PLANTED_SECRET["whsec_".len()..]),
                    "the error quotes a value: {message}"
                );
            }
            return;
        }
        Ok(manifests) => manifests,
    };

    // Debug output shows Secrets by key only: their values change nothing in it.
    let shown = format!("{manifests:?}");
    let mut blanked = Manifests {
        subscriptions: manifests.subscriptions.clone(),
        quotas: manifests.quotas.clone(),
        secrets: manifests.secrets.clone(),
        files: manifests.files,
    };
    for values in blanked.secrets.values_mut() {
        for value in values.values_mut() {
            value.clear();
        }
    }
    assert_eq!(
        shown,
        format!("{blanked:?}"),
        "Debug shows a Secret's value"
    );

    for quota in manifests.quotas.values() {
        assert!(quota.spec.max_in_flight >= 16, "a quota below the floor");
    }
    let (in_force, superseded) = quotas_in_force(&manifests.quotas);
    assert_eq!(in_force.len() + superseded.len(), manifests.quotas.len());

    for ((namespace, name), spec) in &manifests.subscriptions {
        let json = serde_json::to_value(spec).expect("a spec serialises");
        let back = serde_json::from_value(json.clone())
            .unwrap_or_else(|e| panic!("an accepted spec does not read back ({e}): {json}"));
        assert_eq!(spec, &back, "JSON round trip of {json}");
        LOADER.with(|loader| {
            let mut loader = loader.borrow_mut();
            let document = serde_json::json!({
                "kind": "WebhookSubscription",
                "metadata": {"name": name, "namespace": namespace},
                "spec": json,
            });
            let again = loader.add_text("again.json", 0, &document.to_string());
            loader.take();
            if let Err(e) = again {
                panic!("an accepted spec is refused when read back: {e:#}");
            }
        });
        let secrets: Vec<String> = std::iter::once(&spec.signing.secret_ref)
            .chain(&spec.signing.additional_secret_refs)
            .filter_map(|r| {
                manifests
                    .secrets
                    .get(&(namespace.clone(), r.name.clone()))
                    .and_then(|values| values.get(&r.key))
                    .map(|value| String::from_utf8_lossy(value).into_owned())
            })
            .collect();
        let config = SubscriptionConfig::from_spec(
            "uid",
            namespace.clone(),
            name.clone(),
            spec,
            Ok(secrets),
        );
        if let (Err(e), true) = (config, planted_as_value) {
            assert!(!e.contains(PLANTED_SECRET), "the error quotes a value: {e}");
        }
    }
}

/// Whether the planted secret stands only where the text gives a field's value (`key:
/// value` or a list item), never as a key, a name, a namespace or a kind (errors name
/// those), and there are no anchors that could copy it elsewhere. Judged on the text, and on
/// the documents when the text parses (a quoted scalar may span lines).
fn planted_only_as_values(text: &str) -> bool {
    if text.contains('&') {
        return false;
    }
    // A key holding it, or a kind, name or namespace at any depth holding it (a quoted
    // scalar spanning lines hides from the line-by-line judgement below which key it is under).
    fn names_it(value: &Value) -> bool {
        match value {
            Value::Object(map) => map.iter().any(|(k, v)| {
                k.contains(PLANTED_SECRET)
                    || (["kind", "name", "namespace"].contains(&k.as_str())
                        && v.to_string().contains(PLANTED_SECRET))
                    || names_it(v)
            }),
            Value::Array(items) => items.iter().any(names_it),
            _ => false,
        }
    }
    match serde_saphyr::from_multiple::<Value>(text) {
        Ok(docs) if docs.iter().any(names_it) => return false,
        Ok(_) => {}
        // Unparsed, a quoted scalar or an explicit key may span lines and hold the secret in
        // a key, which errors name (a duplicate key): only plain text is judged line by line.
        Err(_) if text.contains(['"', '\'', '?']) => return false,
        Err(_) => {}
    }
    text.match_indices(PLANTED_SECRET).all(|(at, _)| {
        let line = text[..at].rsplit('\n').next().unwrap_or_default();
        let line = line.strip_suffix(['"', '\'']).unwrap_or(line);
        let Some(key) = line.strip_suffix(": ") else {
            return line.trim_start() == "- ";
        };
        let key = key.trim_end().trim_end_matches(['"', '\'']);
        let word = key
            .rsplit(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .next()
            .unwrap_or_default();
        !word.is_empty()
            && !key.contains(['?', '\\', '*'])
            && !["kind", "name", "namespace"].contains(&word)
    })
}

/// `Retry-After`: delay-seconds exactly when the value is digits (saturating); otherwise the
/// time until an HTTP date, zero when it has passed, or ignored; the later the clock, the
/// shorter a date's delay.
pub fn retry_after(data: &[u8]) {
    let mut input = Input::new(data);
    let now_secs = input.u64() % 20_000_000_000;
    let later = input.u64() % 1_000_000_000;
    let value = String::from_utf8_lossy(input.rest()).into_owned();
    let now = UNIX_EPOCH + Duration::from_secs(now_secs);
    let got = parse_retry_after(&value, now);
    let trimmed = value.trim();
    if !trimmed.is_empty() && trimmed.bytes().all(|b| b.is_ascii_digit()) {
        let seconds = trimmed.parse().unwrap_or(u64::MAX);
        assert_eq!(got, Some(Duration::from_secs(seconds)), "{value:?}");
        return;
    }
    match httpdate::parse_http_date(trimmed) {
        Ok(at) => {
            let until = at.duration_since(now).unwrap_or(Duration::ZERO);
            assert_eq!(got, Some(until), "{value:?}");
            let after = now + Duration::from_secs(later);
            assert_eq!(
                parse_retry_after(&value, after),
                Some(until.saturating_sub(Duration::from_secs(later))),
                "{value:?} read {later}s later"
            );
            // The date as herald would print it reads the same.
            let printed = httpdate::fmt_http_date(at);
            assert_eq!(parse_retry_after(&printed, now), got, "{printed}");
        }
        Err(_) => assert_eq!(got, None, "{value:?} is neither seconds nor a date"),
    }
}
