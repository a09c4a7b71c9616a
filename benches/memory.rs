//! herald's memory in standalone mode, each figure against a reference from the same run.
//!
//! - Idle subscriptions: herald started on 100,000 subscriptions (100 namespaces of 1,000,
//!   active, no event ever matches them) against herald started on none: VmRSS and VmHWM
//!   (peak) from /proc once the ready file is written and /readyz answers, and the time from
//!   the process's start to its ready file.
//! - Backlog: herald started on one subscription with 1,000,000 pending deliveries against
//!   the same with 10,000; each delivers 10,000 to a fast loopback receiver and then its
//!   memory is read. Pending attempts live in the store, so the ratio should stay near 1;
//!   the drain rates of the two runs are compared too. The pending rows are written straight
//!   into the store while herald is stopped (publishing a million events through the API
//!   would take the bench's whole budget).
//!
//! Run: `cargo bench --bench memory` (`HERALD_BENCH_MODE=quick`: 1,000 subscriptions,
//! 10,000 against 1,000 pending; benches/common/mod.rs). Targets: ≤ 200 MB with 100,000
//! subscriptions, start-up to serving within 10 s, RSS with 1,000,000 pending ≤ 1.2 × RSS
//! with 10,000.

#[path = "../tests/support/mod.rs"]
mod support;

mod common;

use std::time::{Duration, Instant};

use common::{Memory, Report, Target, memory, seed_pending, thousands};
use serde_json::json;
use support::herald::{Herald, idle_subscriptions, secret, subscription};
use support::receiver::Receiver;

const EGRESS: &[&str] = &["--egress-allow", "127.0.0.0/8"];
const PER_NAMESPACE: usize = 1_000;
/// The backlog's subscription's lane width.
const LANE_WIDTH: usize = 8;

/// herald's memory once it serves: its ready file is written and /readyz answers 200.
async fn serving(herald: &Herald) -> Memory {
    let (status, body) = herald.get("/readyz").await;
    assert_eq!(status, 200, "/readyz: {body}");
    memory(herald.pid().unwrap())
}

/// Start-up time and memory of herald on `count` idle subscriptions.
async fn idle_run(receiver: &Receiver, count: usize) -> (Duration, Memory) {
    let manifests = idle_subscriptions(count, PER_NAMESPACE, &receiver.url("/idle"));
    let herald = Herald::start(&manifests, EGRESS);
    let memory = serving(&herald).await;
    eprintln!(
        "{count} subscriptions: serving after {:.2?}, {memory:?}",
        herald.started_in
    );
    (herald.started_in, memory)
}

/// herald restarted on one subscription with `pending` deliveries in its store; its memory
/// once `delivered` of them have arrived, and the rate at which they did.
async fn backlog_run(pending: u64, delivered: usize) -> (Memory, f64) {
    let receiver = Receiver::start().await;
    let manifests = vec![
        secret("backlog"),
        subscription(
            "backlog",
            "drain",
            &receiver.url("/drain"),
            &["seeded"],
            json!({"delivery": {"maxInFlight": LANE_WIDTH}}),
        ),
    ];
    let mut herald = Herald::start(&manifests, EGRESS);
    herald.kill();
    let db = herald.data_dir().join("herald.db");
    let uid: String = rusqlite::Connection::open(&db)
        .unwrap()
        .query_row(
            "SELECT uid FROM subscriptions WHERE namespace = 'backlog' AND name = 'drain'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    let seeded = seed_pending(&db, "backlog", pending, &[(&uid, 1)]);
    eprintln!("{pending} pending deliveries written in {seeded:.2?}");
    herald.restart();
    let ready = Instant::now();
    let last = receiver
        .wait_for(
            &format!("{delivered} of {pending} pending deliveries"),
            Duration::from_secs(300),
            |hits| (hits.len() >= delivered).then(|| hits.iter().map(|h| h.at).max().unwrap()),
        )
        .await;
    let memory = memory(herald.pid().unwrap());
    let rate = delivered as f64 / (last - ready).as_secs_f64();
    eprintln!("{pending} pending: {delivered} delivered at {rate:.0}/s, {memory:?}");
    (memory, rate)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut report = Report::new("memory");
    let subscriptions = report.mode.pick(1_000, 100_000);
    let (small, large) = report.mode.pick((1_000, 10_000), (10_000, 1_000_000));
    report.param("subscriptions", subscriptions);
    report.param("subscriptions_per_namespace", PER_NAMESPACE);
    report.param("pending_small", small);
    report.param("pending_large", large);

    let receiver = Receiver::start().await;
    let (start_none, none) = idle_run(&receiver, 0).await;
    let (start_many, many) = idle_run(&receiver, subscriptions).await;
    let subs = thousands(subscriptions);
    report.memory(
        "memory.standalone",
        &format!("{subs} idle subscriptions, standalone, once serving"),
        many,
        "no subscription, same run",
        none,
        Some(Target::AtMost(200.0)),
    );
    report
        .add(
            "startup.standalone",
            &format!("start-up to serving (ready file) with {subs} subscriptions, standalone"),
            start_many.as_secs_f64(),
            "s",
        )
        .reference(
            "start-up with no subscription, same run",
            start_none.as_secs_f64(),
        )
        .target(Target::AtMost(10.0));

    let (few, few_rate) = backlog_run(small, small as usize).await;
    let (lots, lots_rate) = backlog_run(large, small as usize).await;
    let (small_n, large_n) = (thousands(small), thousands(large));
    report.memory(
        "memory.pending",
        &format!("{large_n} pending deliveries, after delivering {small_n} of them"),
        lots,
        &format!("{small_n} pending, after delivering them all, same run"),
        few,
        Some(Target::RatioAtMost(1.2)),
    );
    report
        .add(
            "throughput.backlog_drain",
            &format!("delivering the first {small_n} of {large_n} pending (one subscription, lane width {LANE_WIDTH})"),
            lots_rate,
            "events/s",
        )
        .reference(&format!("the same with {small_n} pending, same run"), few_rate);
    report.finish();
}
