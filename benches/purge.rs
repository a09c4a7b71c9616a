//! Purge: removing a subscription with 1,000,000 pending deliveries (the fence's purge, one
//! transaction) against the design's 5 s, with the time it took to write those rows as the
//! reference from the same run. A control subscription's deliveries must survive.
//!
//! Run: `cargo bench --bench purge`. The rows are written straight into the store's tables
//! (publishing a million events through the API would take the bench's whole budget).

use std::time::Instant;

use herald::store::sqlite::SqliteStore;
use herald::store::{Store, SubscriptionRecord};

const PENDING: i64 = 1_000_000;

fn record(uid: &str) -> SubscriptionRecord {
    SubscriptionRecord {
        uid: uid.into(),
        namespace: "ns".into(),
        name: uid.into(),
        paused: false,
        disable_after: 0,
    }
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = std::env::temp_dir().join(format!("herald-purge-bench-{}", std::process::id()));
    runtime.block_on(async {
        {
            let store = SqliteStore::open(&dir).unwrap();
            store.upsert_subscription(record("target")).await.unwrap();
            store.upsert_subscription(record("control")).await.unwrap();
        }
        let mut conn = rusqlite::Connection::open(dir.join("herald.db")).unwrap();
        let started = Instant::now();
        let tx = conn.transaction().unwrap();
        {
            let mut event = tx
                .prepare("INSERT INTO events (namespace, event_id, event_type, body, published_ms, matched) VALUES ('ns', ?1, 'bench', x'7b7d', 0, 1)")
                .unwrap();
            let mut delivery = tx
                .prepare("INSERT INTO deliveries (event, sub_uid, state, due_ms, window_start_ms) VALUES (?1, ?2, 0, 0, 0)")
                .unwrap();
            for i in 0..PENDING {
                event.execute([format!("evt-{i}")]).unwrap();
                delivery.execute(rusqlite::params![i + 1, "target"]).unwrap();
                if i % 100 == 0 {
                    delivery.execute(rusqlite::params![i + 1, "control"]).unwrap();
                }
            }
        }
        tx.commit().unwrap();
        drop(conn);
        let seeded = started.elapsed();

        let store = SqliteStore::open(&dir).unwrap();
        let started = Instant::now();
        let purged = store.remove_subscription("target").await.unwrap();
        let purge = started.elapsed();
        let control = store.subscription_state("control").await.unwrap().unwrap().pending;
        assert_eq!(purged, PENDING as u64);
        assert_eq!(control, (PENDING as u64).div_ceil(100));
        println!("writing {PENDING} pending deliveries (reference): {seeded:.2?}");
        println!(
            "purge of {purged} pending deliveries: {purge:.2?} = {:.2} x the reference, {:.2} x the 5 s target",
            purge.as_secs_f64() / seeded.as_secs_f64(),
            purge.as_secs_f64() / 5.0
        );
        println!("control subscription keeps its {control} pending deliveries");
    });
    let _ = std::fs::remove_dir_all(dir);
}
