//! The direct API's contract, `config/openapi/ingest.json`: the checked-in document is what
//! the code generates, herald serves it at `/openapi.json`, and schemathesis (from PyPI,
//! nobody at herald wrote it) finds a running herald true to it: no 5xx, and every status,
//! content type, header and body an answer has is one the document gives.
//!
//! The drift test only reads. After changing the API, regenerate the file with
//! `cargo test --test openapi -- --ignored regenerate_openapi`.

mod support;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use serde_json::json;
use support::herald::{Herald, secret, subscription};
use support::receiver::Receiver;

const REGENERATE: &str = "cargo test --test openapi -- --ignored regenerate_openapi";
const TOKEN: &str = "s3cret";

fn checked_in() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("config/openapi/ingest.json")
}

#[test]
fn the_checked_in_document_is_what_the_code_generates() {
    let path = checked_in();
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}; run {REGENERATE}", path.display()));
    assert!(
        text == herald::ingest::openapi::document(),
        "{} drifted from the code; run {REGENERATE}",
        path.display()
    );
}

/// Writes the generated document. Ignored: run it on purpose after changing the API.
#[test]
#[ignore = "writes config/openapi/ingest.json; run it on purpose after changing the API"]
fn regenerate_openapi() {
    std::fs::write(checked_in(), herald::ingest::openapi::document()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_herald_true_to_its_document() {
    // The document's examples name these: its examples phase reaches a real subscription,
    // an event it got and one of its dead letters.
    let receiver = Receiver::start().await;
    receiver.set("/orders", support::receiver::Behaviour::Status(404));
    let hook = subscription(
        "shop",
        "orders",
        &receiver.url("/orders"),
        &["*"],
        json!({}),
    );
    let herald = Herald::start(
        &[secret("shop"), hook],
        &["--egress-allow", "127.0.0.0/8", "--publish-token", TOKEN],
    );
    herald
        .publish("shop", json!({"id": "evt-1", "type": "order.created"}))
        .await;
    herald
        .poll(
            "evt-1 dead-lettered",
            "/v1/namespaces/shop/subscriptions/orders/attempts?state=dead",
            Duration::from_secs(20),
            |status, body| status == 200 && body["items"].as_array().is_some_and(|i| i.len() == 1),
        )
        .await;

    // Served as checked in, to anyone.
    let served = reqwest::get(format!("{}/openapi.json", herald.base))
        .await
        .unwrap();
    assert_eq!(served.status(), 200);
    assert_eq!(
        served.text().await.unwrap(),
        herald::ingest::openapi::document()
    );

    let python = std::env::var("HERALD_PYTHON").unwrap_or_else(|_| "python3".into());
    let report = support::Scratch::new("schemathesis");
    let out = Command::new(&python)
        .args(["-m", "schemathesis.cli", "run"])
        .arg(checked_in())
        .args(["--url", &herald.base])
        .args(["--header", &format!("Authorization: Bearer {TOKEN}")])
        .args([
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,\
             response_headers_conformance,response_schema_conformance,negative_data_rejection,\
             unsupported_method,allow_header_conformance",
        ])
        .args(["--max-examples", "40", "--seed", "1", "--workers", "1"])
        .args(["--request-timeout", "10"])
        .arg("--report-dir")
        .arg(&*report)
        .env("SCHEMATHESIS_HOOKS", "")
        .current_dir(&*report)
        .output()
        .unwrap_or_else(|e| panic!("running {python} -m schemathesis.cli: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "schemathesis found herald untrue to its document (is the .venv of scripts/test on \
         PATH?):\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // It ran every operation, not none.
    assert!(stdout.contains("8 selected"), "{stdout}");
    println!("{stdout}");
}
