//! The ingest API over TLS (--tls-cert-file, --tls-key-file), against a real herald process
//! on 127.0.0.1 with certificates from a CA each test makes (rcgen), and clients that trust
//! only that CA: publishing works; a rotated pair is served to new connections; a
//! half-written, mismatched or broken pair keeps the previous certificate and is logged
//! with the file's name and never its content; plain HTTP to the port fails at once; the
//! handshake is bound by the header-read timeout and counts against the connection bound;
//! a bad pair at start stops herald.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::json;
use support::herald::{Herald, run_command, secret, subscription};
use support::receiver::Receiver;
use support::tls::{Ca, Files, Leaf, client_trusting};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const NS: &str = "shop";

/// Writes `leaf`'s certificate and key as `tls.crt` and `tls.key`.
fn write_pair(files: &Files, leaf: &Leaf) {
    files.write("tls.key", &leaf.key_pem);
    files.write("tls.crt", &leaf.cert_pem);
}

/// herald serving TLS with the pair in `files`, given as flags, looking at the files every
/// 100 ms; its API client trusts only `ca`.
fn start_tls(
    ca: &Ca,
    files: &Files,
    manifests: &[serde_json::Value],
    env: &[(&str, &str)],
) -> Herald {
    let (cert, key) = (files.path("tls.crt"), files.path("tls.key"));
    let mut env = env.to_vec();
    env.push(("HERALD_INGEST_TLS_RELOAD_INTERVAL", "100ms"));
    let mut herald = Herald::start_env(
        manifests,
        &[
            "--tls-cert-file",
            cert.to_str().unwrap(),
            "--tls-key-file",
            key.to_str().unwrap(),
        ],
        &env,
    );
    herald.use_client(client_trusting(ca));
    herald
}

fn address(herald: &Herald) -> String {
    herald
        .base
        .strip_prefix("https://")
        .unwrap_or_else(|| panic!("the ingest API is not https: {}", herald.base))
        .to_string()
}

/// A TLS client that trusts only `ca` and expects the name `localhost`.
fn connector(ca: &Ca) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der.clone()).unwrap();
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// A new TLS connection to `address`, as `localhost`, trusting only `ca`.
async fn tls_connect(address: &str, ca: &Ca) -> tokio_rustls::client::TlsStream<TcpStream> {
    let tcp = TcpStream::connect(address).await.unwrap();
    connector(ca)
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap()
}

/// The certificate herald presents to a new connection (verified against `ca`).
async fn presented(herald: &Herald, ca: &Ca) -> CertificateDer<'static> {
    let tls = tls_connect(&address(herald), ca).await;
    tls.get_ref().1.peer_certificates().unwrap()[0].clone()
}

/// A new CA, a pair from it in a new folder, and herald serving it with `env`.
fn serving(env: &[(&str, &str)]) -> (Ca, Files, Herald) {
    let ca = Ca::new("herald test CA");
    let files = Files::new();
    write_pair(&files, &ca.leaf(&["localhost", "127.0.0.1"], 10));
    let herald = start_tls(&ca, &files, &[secret(NS)], env);
    (ca, files, herald)
}

/// Polls new connections until herald presents `leaf`, or panics at the deadline.
async fn wait_presented(herald: &Herald, ca: &Ca, leaf: &Leaf, what: &str) {
    let end = Instant::now() + Duration::from_secs(30);
    while presented(herald, ca).await != leaf.der {
        assert!(
            Instant::now() < end,
            "herald never presented {what}:\n{}",
            herald.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Over TLS (files given by environment variable) herald announces https in its ready file
/// and log, accepts a publish, answers the API, and delivers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishing_over_tls_works_and_herald_says_https() {
    let ca = Ca::new("herald test CA");
    let files = Files::new();
    write_pair(&files, &ca.leaf(&["localhost", "127.0.0.1"], 10));
    let receiver = Receiver::start().await;
    let (cert, key) = (files.path("tls.crt"), files.path("tls.key"));
    let mut herald = Herald::start_env(
        &[
            secret(NS),
            subscription(NS, "hook", &receiver.url("/hook"), &["*"], json!({})),
        ],
        &["--egress-allow", "127.0.0.0/8"],
        &[
            ("HERALD_TLS_CERT_FILE", cert.to_str().unwrap()),
            ("HERALD_TLS_KEY_FILE", key.to_str().unwrap()),
        ],
    );
    herald.use_client(client_trusting(&ca));
    let url = format!("https://{}", address(&herald));
    assert!(
        herald.log().contains(&format!("url={url}")),
        "{}",
        herald.log()
    );
    herald
        .publish(NS, json!({"id": "evt-1", "type": "order.paid"}))
        .await;
    receiver
        .wait_until("evt-1", Duration::from_secs(30), |hits| hits.len() == 1)
        .await;
    let (status, body) = herald
        .get(&format!("/v1/namespaces/{NS}/subscriptions/hook"))
        .await;
    assert_eq!(status, 200, "{body}");
    // The same API in clear text is refused: a client that tries gets an error, no answer.
    let plain = reqwest::Client::new()
        .get(format!("http://{}/healthz", address(&herald)))
        .send()
        .await;
    assert!(plain.is_err(), "plain HTTP was answered: {plain:?}");
}

/// Rotation: new connections get a new pair once both files hold it; a half-written
/// (mismatched) pair and a broken key keep the certificate in force and are logged with the
/// file names, never with key material.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_pair_is_served_to_new_connections_and_a_broken_one_is_not() {
    let ca = Ca::new("herald test CA");
    let files = Files::new();
    let (first, second, third) = (
        ca.leaf(&["localhost", "127.0.0.1"], 10),
        ca.leaf(&["localhost", "127.0.0.1"], 11),
        ca.leaf(&["localhost", "127.0.0.1"], 12),
    );
    write_pair(&files, &first);
    let herald = start_tls(&ca, &files, &[secret(NS)], &[]);
    assert_eq!(presented(&herald, &ca).await, first.der);
    let cert_path = files.path("tls.crt").display().to_string();
    let key_path = files.path("tls.key").display().to_string();

    // Half written: the new certificate, the old key.
    files.write("tls.crt", &second.cert_pem);
    let mismatch =
        format!("the private key in {key_path} does not match the certificate in {cert_path}");
    herald.wait_log(&mismatch, 1, Duration::from_secs(30)).await;
    assert_eq!(
        presented(&herald, &ca).await,
        first.der,
        "a mismatched pair was used"
    );

    // Complete: new connections get the second certificate, and the API works on them.
    files.write("tls.key", &second.key_pem);
    wait_presented(&herald, &ca, &second, "the second certificate").await;
    herald
        .wait_log(
            "ingest TLS certificate reloaded",
            1,
            Duration::from_secs(30),
        )
        .await;
    let (status, body) = herald
        .post(
            &format!("/v1/namespaces/{NS}/events"),
            json!({"type": "order.paid"}),
        )
        .await;
    assert_eq!(status, 202, "{body}");

    // A broken key (cut short, and one that is not PEM at all) keeps the second one.
    let broken = format!("{key_path}: is not a readable PEM private key");
    let cut = &third.key_pem[..third.key_pem.len() / 2];
    for (text, complaint) in [
        (cut.to_string(), broken.clone()),
        (
            "not-a-key s3cr3t-material\n".to_string(),
            format!("{key_path}: holds no PEM private key"),
        ),
    ] {
        files.write("tls.key", &text);
        herald
            .wait_log(&complaint, 1, Duration::from_secs(30))
            .await;
        let now = presented(&herald, &ca).await;
        assert_eq!(now, second.der, "a broken key was used: {complaint}");
    }

    // A good pair again is taken up.
    write_pair(&files, &third);
    wait_presented(&herald, &ca, &third, "the third certificate").await;

    let log = herald.log();
    // Looked at every 100 ms, the cut key was seen several times but reported once.
    assert_eq!(
        log.matches(&broken).count(),
        1,
        "a failure is logged once:\n{log}"
    );
    for leaf in [&first, &second, &third] {
        let body = leaf.key_pem.lines().nth(1).unwrap();
        assert!(!log.contains(body), "key material in the log:\n{log}");
    }
    assert!(
        !log.contains("s3cr3t"),
        "a key file's content in the log:\n{log}"
    );
}

/// Reads until the peer closes; returns what arrived and how long it took, or panics after
/// `deadline`.
async fn read_until_closed(
    stream: &mut TcpStream,
    deadline: Duration,
    what: &str,
) -> (Vec<u8>, Duration) {
    let started = Instant::now();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(deadline, async {
        let mut buffer = [0u8; 4096];
        loop {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(n) => answer.extend_from_slice(&buffer[..n]),
            }
        }
    })
    .await;
    assert!(read.is_ok(), "{what}: still open after {deadline:?}");
    (answer, started.elapsed())
}

/// Plain HTTP to the TLS port is closed at once, without an HTTP answer, and the API still
/// serves TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http_to_the_tls_port_is_closed_at_once() {
    // A header-read timeout far beyond the deadline below: closing is not a timeout.
    let (_ca, _files, mut herald) = serving(&[("HERALD_INGEST_HEADER_TIMEOUT", "60s")]);
    let mut plain = TcpStream::connect(address(&herald)).await.unwrap();
    plain
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (answer, _) = read_until_closed(&mut plain, Duration::from_secs(20), "plain HTTP").await;
    assert!(!answer.starts_with(b"HTTP/"), "plain HTTP was answered");
    let (status, body) = herald.get("/healthz").await;
    assert_eq!((status, body), (200, serde_json::Value::Null));
    assert!(herald.running());
}

/// Inside TLS, hyper's own answer to a request it cannot parse has the JSON error shape, as
/// over plain TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unparseable_request_over_tls_gets_a_json_error() {
    let (ca, _files, herald) = serving(&[]);
    let mut tls = tls_connect(&address(&herald), &ca).await;
    tls.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), tls.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "no answer in 20s");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
    assert!(
        answer.contains("content-type: application/json"),
        "{answer}"
    );
    assert!(answer.contains("\"bad_request\""), "{answer}");
}

/// A client that connects and never starts the handshake, and one that completes it and
/// then sends nothing, are both cut at the header-read timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_tls_clients_are_cut_at_the_header_timeout() {
    let (ca, _files, herald) = serving(&[("HERALD_INGEST_HEADER_TIMEOUT", "1s")]);
    // Generous for a loaded machine, far below "never".
    let deadline = Duration::from_secs(15);
    let mut silent = TcpStream::connect(address(&herald)).await.unwrap();
    let mut idle = tls_connect(&address(&herald), &ca).await;
    let (_, took) =
        read_until_closed(&mut silent, deadline, "a client that never shakes hands").await;
    assert!(
        took >= Duration::from_millis(900),
        "closed after {took:?}, before the timeout"
    );
    let idle_closed = tokio::time::timeout(deadline, async {
        let mut buffer = [0u8; 64];
        loop {
            match idle.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(
        idle_closed.is_ok(),
        "an idle TLS connection is still open after {deadline:?}"
    );
    let (status, _) = herald.get("/healthz").await;
    assert_eq!(status, 200);
}

/// Connections still in their handshake count against the connection bound: with two
/// silent clients holding the only places herald says so, and serves the next TLS client
/// once they go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshakes_count_against_the_connection_bound() {
    let (ca, _files, herald) = serving(&[
        ("HERALD_INGEST_MAX_CONNECTIONS", "2"),
        ("HERALD_INGEST_HEADER_TIMEOUT", "60s"),
    ]);
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(TcpStream::connect(address(&herald)).await.unwrap());
    }
    herald
        .wait_log(
            "ingest connection limit reached",
            1,
            Duration::from_secs(20),
        )
        .await;
    // The next client waits in the kernel's backlog until a place frees.
    let next = tokio::spawn({
        let address = address(&herald);
        async move {
            let mut tls = tls_connect(&address, &ca).await;
            tls.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .await
                .unwrap();
            let mut answer = Vec::new();
            let _ = tls.read_to_end(&mut answer).await;
            String::from_utf8_lossy(&answer).into_owned()
        }
    });
    drop(held);
    let answer = tokio::time::timeout(Duration::from_secs(20), next)
        .await
        .expect("the waiting client was never served")
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

/// What `herald run` says and does when started with `args` and nothing else of note:
/// exits unsuccessfully; returns its log.
fn refused_start(files: &Files, args: &[&str]) -> String {
    let log_path = files.path("herald.log");
    let _ = std::fs::remove_file(&log_path);
    let status = run_command(&files.dir, &files.path("ready"))
        .args(["--standalone", "--config"])
        .arg(&files.dir)
        .args(args)
        .status()
        .unwrap();
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(!status.success(), "herald started with {args:?}:\n{log}");
    assert!(!files.path("ready").exists(), "herald served with {args:?}");
    log
}

/// A certificate without a key (or the reverse), and a key that does not match its
/// certificate, stop the start with an error that names the files and quotes no key.
#[test]
fn a_bad_pair_at_start_stops_herald_and_names_the_files() {
    let ca = Ca::new("herald test CA");
    let files = Files::new();
    let (one, other) = (
        ca.leaf(&["localhost", "127.0.0.1"], 10),
        ca.leaf(&["localhost", "127.0.0.1"], 11),
    );
    let cert = files.write("tls.crt", &one.cert_pem);
    let key = files.write("tls.key", &other.key_pem);
    let (cert, key) = (cert.to_str().unwrap(), key.to_str().unwrap());

    let log = refused_start(&files, &["--tls-cert-file", cert]);
    assert!(log.contains("--tls-key-file"), "{log}");
    let log = refused_start(&files, &["--tls-key-file", key]);
    assert!(log.contains("--tls-cert-file"), "{log}");

    let log = refused_start(&files, &["--tls-cert-file", cert, "--tls-key-file", key]);
    assert!(
        log.contains(&format!(
            "the private key in {key} does not match the certificate in {cert}"
        )),
        "{log}"
    );
    let body = other.key_pem.lines().nth(1).unwrap();
    assert!(!log.contains(body), "key material in the log:\n{log}");

    let missing = files.path("missing.key");
    let log = refused_start(
        &files,
        &[
            "--tls-cert-file",
            cert,
            "--tls-key-file",
            missing.to_str().unwrap(),
        ],
    );
    assert!(
        log.contains(&format!("reading --tls-key-file {}", missing.display())),
        "{log}"
    );
}
