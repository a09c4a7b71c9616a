//! Receivers over HTTPS, on 127.0.0.1 with certificates from a CA each test makes (rcgen):
//! herald verifies a receiver's certificate against the system's roots plus those of
//! `--egress-ca-file`, and checks it is valid for the URL's host. A certificate for another
//! name, or from a CA herald does not trust, is refused before anything is sent: the
//! attempt is a transient failure whose message names the reason, visible in the attempts
//! API, and a healthy subscription in the same herald keeps being delivered promptly.

mod support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::herald::{Herald, run_command, secret, subscription, transient_message};
use support::receiver::Receiver;
use support::tls::{Ca, Files};

const NS: &str = "shop";
/// How long a healthy delivery may take, publish to arrival, while another one fails.
const PROMPT: Duration = Duration::from_secs(2);
const ATTEMPTS: usize = 3;

/// herald with a "hook" subscription (event type `hook.*`) on `url`, retried quickly, and a
/// "healthy" one (`healthy.*`) on a plain receiver; loopback allowed, `args` added.
fn start(url: &str, healthy: &Receiver, args: &[&str]) -> Herald {
    let mut all = vec!["--egress-allow", "127.0.0.0/8"];
    all.extend_from_slice(args);
    Herald::start(
        &[
            secret(NS),
            subscription(
                NS,
                "hook",
                url,
                &["hook.*"],
                json!({"delivery": {"retry": {"maxAttempts": ATTEMPTS, "initialBackoff": "200ms", "maxBackoff": "200ms"}}}),
            ),
            subscription(
                NS,
                "healthy",
                &healthy.url("/healthy"),
                &["healthy.*"],
                json!({}),
            ),
        ],
        &all,
    )
}

async fn attempts(herald: &Herald, id: &str) -> Vec<Value> {
    herald.event_attempts(NS, "hook", id).await
}

/// Publishes one event to "hook" and, until it has settled, healthy events one after
/// another, each of which must arrive within [`PROMPT`]. Returns the hook's delivery.
async fn hook_settles_while_healthy_stays_prompt(herald: &Herald, healthy: &Receiver) -> Value {
    herald
        .publish(NS, json!({"id": "evt-1", "type": "hook.poke"}))
        .await;
    let end = Instant::now() + Duration::from_secs(60);
    let mut sent = 0;
    loop {
        let deliveries = herald.deliveries(NS, "hook", "all").await;
        let settled = deliveries
            .iter()
            .find(|d| d["state"] == "delivered" || d["state"] == "dead");
        if let Some(delivery) = settled
            && sent >= 3
        {
            return delivery.clone();
        }
        assert!(
            Instant::now() < end,
            "evt-1 did not settle:\n{}",
            herald.log()
        );
        herald
            .publish_promptly(
                NS,
                healthy,
                &format!("healthy-{sent}"),
                "healthy.ping",
                PROMPT,
            )
            .await;
        sent += 1;
        // Pacing, not synchronisation: a steady trickle of healthy events.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Asserts the hook's event was refused on every attempt for `reason`, transiently, with
/// nothing delivered, the delivery dead after its attempts, and no request reaching the
/// receiver's handler although herald did open connections to it.
async fn refused_for(herald: &Herald, healthy: &Receiver, receiver: &Receiver, reason: &str) {
    let delivery = hook_settles_while_healthy_stays_prompt(herald, healthy).await;
    assert_eq!(delivery["state"], "dead", "{delivery}");
    assert_eq!(delivery["attempts"], ATTEMPTS, "{delivery}");
    let last = delivery["lastAttempt"]["message"].as_str().unwrap();
    assert!(last.contains(reason), "{delivery}");
    let list = attempts(herald, "evt-1").await;
    assert_eq!(list.len(), ATTEMPTS, "{list:?}");
    for attempt in &list {
        // Transient: the receiver's owner can fix a certificate without herald changing.
        let message = transient_message(attempt);
        // The last attempt's message also says the delivery was given up.
        assert!(
            message.contains(&format!("TLS certificate refused: {reason}")),
            "{attempt}"
        );
    }
    assert!(
        receiver.hits().is_empty(),
        "a request reached a receiver whose certificate was refused"
    );
    assert!(
        receiver
            .failed_handshakes
            .load(std::sync::atomic::Ordering::SeqCst)
            >= ATTEMPTS,
        "herald never tried the receiver's handshake"
    );
}

/// A receiver whose certificate is for `localhost` and 127.0.0.1, issued by the CA given
/// with --egress-ca-file, gets its event over HTTPS, signed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_the_trusted_ca_for_the_right_name_is_delivered() {
    let ca = Ca::new("herald test CA");
    let files = Files::new();
    let ca_file = files.write("ca.pem", &ca.pem);
    let receiver =
        Receiver::start_tls(ca.leaf(&["localhost", "127.0.0.1"], 1).server_config()).await;
    let healthy = Receiver::start().await;
    let herald = start(
        &receiver.url("/hook"),
        &healthy,
        &["--egress-ca-file", ca_file.to_str().unwrap()],
    );
    let delivery = hook_settles_while_healthy_stays_prompt(&herald, &healthy).await;
    assert_eq!(delivery["state"], "delivered", "{delivery}");
    let list = attempts(&herald, "evt-1").await;
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(list[0]["outcome"], "Accepted");
    assert_eq!(list[0]["statusCode"], 204);
    let hits = receiver.hits_for("/hook");
    assert_eq!(hits.len(), 1);
    assert!(hits[0].verified, "the signature did not verify");
    assert_eq!(hits[0].header("webhook-id"), "evt-1");
    assert_eq!(
        receiver
            .failed_handshakes
            .load(std::sync::atomic::Ordering::SeqCst),
        0
    );
}

/// A certificate from the trusted CA but for another name is refused before anything is
/// sent, and the attempts say which name it was not valid for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_for_the_wrong_name_is_refused_with_the_reason() {
    let ca = Ca::new("herald test CA");
    let files = Files::new();
    let ca_file = files.write("ca.pem", &ca.pem);
    let receiver = Receiver::start_tls(ca.leaf(&["wrong.example.com"], 2).server_config()).await;
    let healthy = Receiver::start().await;
    let herald = start(
        &receiver.url("/hook"),
        &healthy,
        &["--egress-ca-file", ca_file.to_str().unwrap()],
    );
    refused_for(
        &herald,
        &healthy,
        &receiver,
        "certificate not valid for name \"localhost\"",
    )
    .await;
    let list = attempts(&herald, "evt-1").await;
    let message = list[0]["message"].as_str().unwrap();
    assert!(message.contains("wrong.example.com"), "{message}");
}

/// The same receiver as in the first test, but herald not given its CA: refused as
/// untrusted, with a hint at --egress-ca-file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_ca_file_the_receiver_is_refused_as_untrusted() {
    let ca = Ca::new("herald test CA");
    let receiver =
        Receiver::start_tls(ca.leaf(&["localhost", "127.0.0.1"], 3).server_config()).await;
    let healthy = Receiver::start().await;
    let herald = start(&receiver.url("/hook"), &healthy, &[]);
    refused_for(
        &herald,
        &healthy,
        &receiver,
        "not issued by a CA herald trusts (UnknownIssuer; --egress-ca-file adds a private CA)",
    )
    .await;
}

/// A CA file herald cannot use stops the start, with an error that names the file.
#[test]
fn an_unusable_ca_file_stops_the_start_and_names_the_file() {
    let files = Files::new();
    let leaf = Ca::new("herald test CA").leaf(&["localhost"], 4);
    for (name, text, problem) in [
        ("empty.pem", String::new(), "holds no PEM certificate"),
        (
            "key-only.pem",
            leaf.key_pem.clone(),
            "holds no PEM certificate",
        ),
        (
            "cut.pem",
            leaf.cert_pem[..leaf.cert_pem.len() / 2].to_string(),
            "a PEM section has no END line",
        ),
    ] {
        let path = files.write(name, &text);
        let status = run_command(&files.dir, &files.path("ready"))
            .args(["--standalone", "--config"])
            .arg(&files.dir)
            .arg("--egress-ca-file")
            .arg(&path)
            .status()
            .unwrap();
        let log = std::fs::read_to_string(files.path("herald.log")).unwrap();
        assert!(!status.success(), "{name}: herald started\n{log}");
        let expected = format!("{}: {problem}", path.display());
        assert!(log.contains(&expected), "{name}: no {expected:?} in\n{log}");
        assert!(!files.path("ready").exists(), "{name}: herald served");
        // The key file's content never reaches the log.
        let key_body = leaf.key_pem.lines().nth(1).unwrap();
        assert!(!log.contains(key_body), "{name}: key material logged");
    }
}
