//! Issue 9 (hardening), secret hygiene: herald standalone at the most verbose log level, in
//! JSON, through deliveries under both signing schemes, a rotation with
//! additionalSecretRefs, config mistakes next to secrets (a YAML syntax error in a Secret,
//! undecodable Secret data, secrets pasted into spec.signing.scheme and delivery.timeout), a
//! wrong publish token, the attempt history and /metrics. Then no log line, no API answer,
//! no /metrics output, not the process's command line and no file under herald's data
//! folder holds any secret in raw, base64 (standard and URL-safe, with and without padding,
//! at any alignment) or hex form, nor the key bytes of a whsec_ secret in any of those forms.

mod support;

use std::path::Path;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
use herald::api::SigningScheme;
use herald::signing::Signer;
use serde_json::{Value, json};
use support::herald::{Herald, subscription};
use support::receiver::{Behaviour, Hit, Receiver};

const NS: &str = "vault";
/// Standard Webhooks secrets: the one in use, the one rotated to, one only ever in a broken
/// manifest.
const SW_OLD: &str = "whsec_7b+IRl8Dre0pqxTCVufYUFZ5GjhDIMQ0lWhy1yyIa8s=";
const SW_NEW: &str = "whsec_j64WZgLSHMH7Rwx52TkBPmVnqQQqRAgr/mXXI8tiL0o=";
const SW_BROKEN: &str = "whsec_WBUbikyJET7OeVIWuyyxOLvna81lCcKo";
/// A Stripe-scheme key (the HMAC key as is).
const STRIPE: &str = "rk_hygiene_aBhnoCru0ftOsgHYdbyXJZBFwTXpKVeB";
/// The publish token, and a wrong one a producer might send.
const TOKEN: &str = "hpt_Pog9WzGx93JxiQskS14qbd8Zlq8khMja";
const WRONG_TOKEN: &str = "hpt_Pog9WzGx93JxiQskS14qbd8Zlq8khMjX";

/// Every form of `secret` that must appear nowhere.
fn forms(secret: &str) -> Vec<(String, Vec<u8>)> {
    let mut keys = vec![("raw", secret.as_bytes().to_vec())];
    if let Some(encoded) = secret.strip_prefix("whsec_") {
        keys.push(("key bytes", STANDARD.decode(encoded).unwrap()));
        keys.push(("key after whsec_", encoded.as_bytes().to_vec()));
    }
    let mut out = Vec::new();
    for (what, bytes) in keys {
        out.push((what.to_string(), bytes.clone()));
        out.push((format!("{what} hex"), hex::encode(&bytes).into_bytes()));
        out.push((
            format!("{what} HEX"),
            hex::encode_upper(&bytes).into_bytes(),
        ));
        for (name, engine) in [
            ("base64", &STANDARD),
            ("base64 unpadded", &STANDARD_NO_PAD),
            ("base64url", &URL_SAFE),
            ("base64url unpadded", &URL_SAFE_NO_PAD),
        ] {
            out.push((format!("{what} {name}"), engine.encode(&bytes).into_bytes()));
            // Embedded in something longer, its base64 starts at any of three alignments:
            // search the characters that depend on the secret's bytes alone.
            for shift in 1..3 {
                let mut shifted = vec![0u8; shift];
                shifted.extend_from_slice(&bytes);
                let text = engine.encode(&shifted);
                let middle = &text[4..text.trim_end_matches('=').len() - 4];
                out.push((
                    format!("{what} {name} at offset {shift}"),
                    middle.as_bytes().to_vec(),
                ));
            }
        }
    }
    out
}

/// The names of the forms of any secret found in `haystack`.
fn leaks(haystack: &[u8]) -> Vec<String> {
    let mut found = Vec::new();
    for secret in [SW_OLD, SW_NEW, SW_BROKEN, STRIPE, TOKEN, WRONG_TOKEN] {
        for (what, needle) in forms(secret) {
            if haystack
                .windows(needle.len())
                .any(|w| w == needle.as_slice())
            {
                found.push(format!("{secret} ({what})"));
            }
        }
    }
    found
}

fn secret_manifest(name: &str, string_data: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": NS},
        "stringData": string_data,
    })
}

/// The folder at a rotation step: `sw` signs with `primary` plus `additional`.
fn manifests(receiver: &Receiver, keys: Value, primary: &str, additional: &[&str]) -> Vec<Value> {
    let refs: Vec<Value> = additional
        .iter()
        .map(|k| json!({"name": "sw-secret", "key": k}))
        .collect();
    vec![
        secret_manifest("sw-secret", keys),
        secret_manifest("stripe-secret", json!({"key": STRIPE})),
        subscription(
            NS,
            "sw",
            &receiver.url("/sw"),
            &["order.*"],
            json!({"signing": {
                "secretRef": {"name": "sw-secret", "key": primary},
                "additionalSecretRefs": refs,
            }}),
        ),
        subscription(
            NS,
            "stripe",
            &receiver.url("/stripe"),
            &["order.*"],
            json!({"signing": {"scheme": "stripe", "secretRef": {"name": "stripe-secret", "key": "key"}}}),
        ),
        subscription(
            NS,
            "failing",
            &receiver.url("/failing"),
            &["order.*"],
            json!({
                "signing": {"secretRef": {"name": "sw-secret", "key": primary}},
                "delivery": {"retry": {"maxAttempts": 2, "initialBackoff": "10ms", "maxBackoff": "10ms"}},
            }),
        ),
    ]
}

fn verifies(hit: &Hit, scheme: SigningScheme, secret: &str) -> bool {
    Signer::new(scheme, &[secret], None)
        .unwrap()
        .verify(
            hit.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            &hit.body,
            herald::signing::unix_now(),
            Duration::from_secs(300),
        )
        .is_ok()
}

/// Every answer herald gave, as text.
struct Transcript {
    http: reqwest::Client,
    answers: Vec<String>,
}

impl Transcript {
    async fn call(&mut self, method: &str, url: &str, token: &str, body: Option<Value>) -> u16 {
        let mut request = match method {
            "POST" => self.http.post(url),
            _ => self.http.get(url),
        };
        if !token.is_empty() {
            request = request.bearer_auth(token);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        self.answers
            .push(format!("{method} {url} -> {status}: {text}"));
        status
    }
}

/// Publishes one event and waits until `sw` and `stripe` have it; returns their hits.
async fn deliver(
    herald: &Herald,
    transcript: &mut Transcript,
    receiver: &Receiver,
    id: &str,
) -> (Hit, Hit) {
    let url = format!("{}/v1/namespaces/{NS}/events", herald.base);
    let event = json!({"id": id, "type": "order.paid", "data": {"amount": 7}});
    assert_eq!(transcript.call("POST", &url, TOKEN, Some(event)).await, 202);
    let hits = receiver
        .wait_until(
            &format!("{id} at /sw and /stripe"),
            Duration::from_secs(30),
            |hits| {
                ["/sw", "/stripe"].iter().all(|p| {
                    hits.iter()
                        .any(|h| h.path == *p && h.header("herald-event-id") == id)
                })
            },
        )
        .await;
    let find = |path: &str| {
        hits.iter()
            .find(|h| h.path == path && h.header("herald-event-id") == id)
            .unwrap()
            .clone()
    };
    (find("/sw"), find("/stripe"))
}

/// Writes the folder, signals herald and waits for the outcome to be logged `applied` or
/// not.
async fn reconfigure(herald: &Herald, applied: bool, change: impl FnOnce()) {
    let needle = if applied {
        "\"configuration applied\""
    } else {
        "\"configuration not applied; keeping the last one\""
    };
    let before = herald.log().matches(needle).count();
    change();
    herald.hangup();
    herald
        .wait_log(needle, before + 1, Duration::from_secs(30))
        .await;
}

/// Every file under `dir`, recursively.
fn files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(files(&path));
        } else {
            out.push(path);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_reaches_logs_answers_metrics_or_the_store() {
    let receiver = Receiver::start().await;
    receiver.set("/failing", Behaviour::Status(500));
    let mut herald = Herald::start_env(
        &manifests(&receiver, json!({"current": SW_OLD}), "current", &[]),
        &[
            "--egress-allow",
            "127.0.0.0/8",
            "--log-level",
            "trace",
            "--log-format",
            "json",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        // The token by environment, as documented: a flag shows in the process list.
        // No polling: each change is applied once, on SIGHUP.
        &[
            ("HERALD_PUBLISH_TOKEN", TOKEN),
            ("HERALD_CONFIG_POLL_MS", "0"),
        ],
    );
    let mut transcript = Transcript {
        http: reqwest::Client::new(),
        answers: Vec::new(),
    };
    let api = |path: &str| format!("{}/v1/namespaces/{NS}{path}", herald.base);

    // Deliveries under both schemes.
    for i in 0..3 {
        let (sw, stripe) = deliver(&herald, &mut transcript, &receiver, &format!("a-{i}")).await;
        assert!(verifies(&sw, SigningScheme::StandardWebhooks, SW_OLD));
        assert!(verifies(&stripe, SigningScheme::Stripe, STRIPE));
    }

    // Rotation: the new secret alongside, then in front, then alone.
    let both = json!({"current": SW_OLD, "next": SW_NEW});
    reconfigure(&herald, true, || {
        herald.write_files(&manifests(&receiver, both.clone(), "current", &["next"]))
    })
    .await;
    let (sw, _) = deliver(&herald, &mut transcript, &receiver, "b-0").await;
    assert!(verifies(&sw, SigningScheme::StandardWebhooks, SW_OLD));
    assert!(verifies(&sw, SigningScheme::StandardWebhooks, SW_NEW));
    reconfigure(&herald, true, || {
        herald.write_files(&manifests(&receiver, both.clone(), "next", &["current"]))
    })
    .await;
    deliver(&herald, &mut transcript, &receiver, "b-1").await;
    reconfigure(&herald, true, || {
        herald.write_files(&manifests(&receiver, json!({"next": SW_NEW}), "next", &[]))
    })
    .await;
    let (sw, _) = deliver(&herald, &mut transcript, &receiver, "b-2").await;
    assert!(verifies(&sw, SigningScheme::StandardWebhooks, SW_NEW));
    assert!(!verifies(&sw, SigningScheme::StandardWebhooks, SW_OLD));

    // Config mistakes next to secrets, each refused, then taken away.
    let sub_head = format!(
        "apiVersion: herald.dev/v1alpha1\nkind: WebhookSubscription\nmetadata: {{name: typo, namespace: {NS}}}\nspec:\n  url: {}\n  eventTypes: ['*']\n",
        receiver.url("/typo")
    );
    let mistakes = [
        // A YAML syntax error in a Secret manifest.
        format!(
            "apiVersion: v1\nkind: Secret\nmetadata: {{name: typo, namespace: {NS}}}\nstringData:\n  k: \"{SW_BROKEN}\"\n  other: {TOKEN}\n  j: [unclosed\n"
        ),
        format!(
            "apiVersion: v1\nkind: Secret\nmetadata: {{name: typo, namespace: {NS}}}\nstringData:\n  k: \"{SW_BROKEN}\n"
        ),
        // Data that is not base64.
        format!(
            "apiVersion: v1\nkind: Secret\nmetadata: {{name: typo, namespace: {NS}}}\ndata:\n  k: \"{STRIPE}!!\"\n"
        ),
        // Secrets pasted into the wrong fields.
        format!(
            "{sub_head}  signing: {{secretRef: {{name: sw-secret, key: next}}, scheme: \"{SW_NEW}\"}}\n"
        ),
        format!(
            "{sub_head}  signing: {{secretRef: {{name: sw-secret, key: next}}}}\n  delivery: {{timeout: \"{STRIPE}\"}}\n"
        ),
        format!("{sub_head}  signing: {{secretRef: \"{SW_NEW}\"}}\n"),
        format!(
            "{sub_head}  signing: {{secretRef: {{name: sw-secret, key: next}}}}\n  headers: {{X-Token: [\"{TOKEN}\"]}}\n"
        ),
    ];
    let mistake = herald.dir.join("config").join("mistake.yaml");
    for text in &mistakes {
        reconfigure(&herald, false, || herald.write_text("mistake.yaml", text)).await;
        reconfigure(&herald, true, || std::fs::remove_file(&mistake).unwrap()).await;
    }
    deliver(&herald, &mut transcript, &receiver, "c-0").await;

    // A wrong publish token, and none, on every route.
    for token in [WRONG_TOKEN, ""] {
        let event = json!({"id": "d-0", "type": "order.paid"});
        let url = api("/events");
        assert_eq!(transcript.call("POST", &url, token, Some(event)).await, 401);
        assert_eq!(
            transcript
                .call("GET", &api("/subscriptions/sw/attempts"), token, None)
                .await,
            401
        );
    }

    // The attempt history, subscription states, replay and enable answers.
    herald
        .poll(
            "the failing deliveries to be dead",
            &format!("/v1/namespaces/{NS}/subscriptions/failing/attempts?state=dead"),
            Duration::from_secs(30),
            |status, body| status == 200 && body["items"].as_array().is_some_and(|i| !i.is_empty()),
        )
        .await;
    let ids = ["a-0", "a-1", "a-2", "b-0", "b-1", "b-2", "c-0"];
    for name in ["sw", "stripe", "failing"] {
        let base = format!("/subscriptions/{name}");
        for path in [
            base.clone(),
            format!("{base}/attempts?state=all"),
            format!("{base}/attempts?state=dead"),
        ] {
            assert_eq!(transcript.call("GET", &api(&path), TOKEN, None).await, 200);
        }
        for id in ids {
            let path = api(&format!("{base}/events/{id}/attempts"));
            assert_eq!(transcript.call("GET", &path, TOKEN, None).await, 200);
        }
    }
    let replay = api("/subscriptions/failing/replay");
    transcript
        .call("POST", &replay, TOKEN, Some(json!({})))
        .await;
    let enable = api("/subscriptions/failing/enable");
    transcript.call("POST", &enable, TOKEN, None).await;

    // /metrics and the health endpoints.
    let metrics = herald.metrics.clone().expect("--metrics-listen");
    for path in ["/metrics", "/healthz", "/readyz"] {
        let status = transcript
            .call("GET", &format!("{metrics}{path}"), "", None)
            .await;
        assert_eq!(status, 200, "{path}");
    }
    assert!(
        transcript
            .answers
            .iter()
            .any(|a| a.contains("herald_attempts_total")),
        "no metrics scraped"
    );

    // The process list shows no secret: the token came by environment.
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", herald.pid().unwrap())).unwrap();
    assert!(!cmdline.is_empty());
    // Everything is on disk: stop herald as a crash would, so nothing is tidied first.
    herald.kill();
    let log = herald.log();
    assert!(
        log.lines().count() > 100
            && log.contains("\"level\":\"TRACE\"")
            && log.contains("configuration not applied"),
        "the scenario did not log at trace level:\n{log}"
    );
    let mut found = Vec::new();
    for line in log.lines() {
        for leak in leaks(line.as_bytes()) {
            found.push(format!("log: {leak} in {line}"));
        }
    }
    for answer in &transcript.answers {
        for leak in leaks(answer.as_bytes()) {
            found.push(format!("answer: {leak} in {answer}"));
        }
    }
    for leak in leaks(&cmdline) {
        found.push(format!("process list: {leak}"));
    }
    let stored = files(&herald.data_dir());
    assert!(!stored.is_empty());
    for file in stored {
        for leak in leaks(&std::fs::read(&file).unwrap()) {
            found.push(format!("store: {leak} in {}", file.display()));
        }
    }
    assert!(found.is_empty(), "secrets leaked:\n{}", found.join("\n"));
}
