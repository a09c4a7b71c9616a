//! Purge: removing a subscription with 1,000,000 pending deliveries (the fence's purge, one
//! transaction) against the design's 5 s, with the time it took to write those rows (one
//! transaction of plain INSERTs into the same store) as the reference from the same run. A
//! control subscription's deliveries must survive.
//!
//! Run: `cargo bench --bench purge` (`HERALD_BENCH_MODE=quick`: 10,000 pending; see
//! benches/common/mod.rs for `HERALD_BENCH_OUT`). The rows are written straight into the
//! store's tables (publishing a million events through the API would take the bench's
//! whole budget).

mod common;

use common::{Report, Target, seed_pending, thousands};
use herald::store::sqlite::SqliteStore;
use herald::store::{Store, SubscriptionRecord};

fn record(uid: &str) -> SubscriptionRecord {
    SubscriptionRecord {
        uid: uid.into(),
        namespace: "ns".into(),
        name: uid.into(),
        paused: false,
        disable_after: 0,
        shard: 0,
        strict_order: false,
    }
}

fn main() {
    let mut report = Report::new("purge");
    let pending: u64 = report.mode.pick(10_000, 1_000_000);
    report.param("pending", pending);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = std::env::temp_dir().join(format!("herald-purge-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    runtime.block_on(async {
        {
            let store = SqliteStore::open(&dir).unwrap();
            store.upsert_subscription(record("target")).await.unwrap();
            store.upsert_subscription(record("control")).await.unwrap();
        }
        let seeded = seed_pending(
            &dir.join("herald.db"),
            "ns",
            pending,
            &[("target", 1), ("control", 100)],
        );

        let store = SqliteStore::open(&dir).unwrap();
        let started = std::time::Instant::now();
        let purged = store.remove_subscription("target").await.unwrap();
        let purge = started.elapsed();
        let control = store
            .subscription_state("control")
            .await
            .unwrap()
            .unwrap()
            .pending;
        assert_eq!(purged, pending);
        assert_eq!(control, pending.div_ceil(100));
        println!("control subscription keeps its {control} pending deliveries");
        report
            .add(
                "purge.time",
                &format!(
                    "purge of {} pending deliveries (one transaction)",
                    thousands(pending)
                ),
                purge.as_secs_f64(),
                "s",
            )
            .reference(
                &format!(
                    "writing those rows ({} events, {} deliveries) in one transaction of INSERTs",
                    thousands(pending),
                    thousands(pending + pending.div_ceil(100))
                ),
                seeded.as_secs_f64(),
            )
            .target(Target::AtMost(5.0));
    });
    let _ = std::fs::remove_dir_all(dir);
    report.finish();
}
