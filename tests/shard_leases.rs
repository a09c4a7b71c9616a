//! Shard Leases against a real kube-apiserver: replicas (here three in one process, each
//! with its own identity, ownership and engine, sharing one store) divide the shards
//! evenly, take over a stopped replica's shards after its Lease expires, and never hold
//! one shard at the same time, checked both from their own views (sampled every 20 ms)
//! and from the epochs recorded in the store.

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use herald::controller::shard_leases::{LeaseConfig, ShardLeases};
use herald::delivery::egress::EgressPolicy;
use herald::delivery::http::HttpSender;
use herald::delivery::shards::Ownership;
use herald::delivery::{Engine, EngineConfig};
use herald::store::Store;
use herald::store::sqlite::SqliteStore;
use support::control_plane::ControlPlane;

const SHARDS: u32 = 8;
const NAMESPACE: &str = "herald-system";

struct Replica {
    identity: String,
    ownership: Arc<Ownership>,
    task: tokio::task::JoinHandle<()>,
}

fn engine(store: Arc<dyn Store>) -> Arc<Engine> {
    Engine::new(
        store,
        HttpSender::new(EgressPolicy::new(vec!["127.0.0.0/8".parse().unwrap()])).unwrap(),
        EngineConfig::small(),
    )
}

async fn start(client: &kube::Client, store: Arc<dyn Store>, identity: &str) -> Replica {
    let ownership = Arc::new(Ownership::new(SHARDS));
    let engine = engine(store);
    engine.share_by_shards(ownership.clone());
    let leases = ShardLeases::new(
        client.clone(),
        LeaseConfig {
            namespace: NAMESPACE.into(),
            identity: identity.into(),
            duration: Duration::from_secs(3),
            renew_every: Duration::from_secs(1),
            margin: Duration::from_secs(1),
        },
        ownership.clone(),
        engine,
    );
    Replica {
        identity: identity.into(),
        ownership,
        task: tokio::spawn(async move { leases.run().await }),
    }
}

/// Who holds each shard now, by the replicas' own views; panics if two hold one.
fn holders(replicas: &[&Replica]) -> BTreeMap<u32, String> {
    let mut holders = BTreeMap::new();
    for replica in replicas {
        for (shard, _) in replica.ownership.held() {
            if let Some(other) = holders.insert(shard, replica.identity.clone()) {
                panic!(
                    "shard {shard} held by {other} and {} at once",
                    replica.identity
                );
            }
        }
    }
    holders
}

/// Samples the views until `done` holds or `deadline` passes; panics on a double holding.
async fn until(
    replicas: &[&Replica],
    deadline: Duration,
    what: &str,
    done: impl Fn(&BTreeMap<u32, String>) -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        let now = holders(replicas);
        if done(&now) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < deadline,
            "{what}: not within {deadline:?}; holders {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn counts(holders: &BTreeMap<u32, String>) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for holder in holders.values() {
        *counts.entry(holder.clone()).or_default() += 1;
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_shards_evenly_and_take_over_without_overlap() {
    let Some(cp) = ControlPlane::start() else {
        return;
    };
    cp.kubectl_ok(&["create", "namespace", NAMESPACE]);
    let client = cp.client().await;
    let dir = std::env::temp_dir().join(format!("herald-leases-{}", uuid::Uuid::now_v7()));
    let store: Arc<dyn Store> = Arc::new(SqliteStore::open(&dir).unwrap());

    let a = start(&client, store.clone(), "replica-a").await;
    until(
        &[&a],
        Duration::from_secs(20),
        "one replica takes every shard",
        |h| h.len() == SHARDS as usize,
    )
    .await;

    let b = start(&client, store.clone(), "replica-b").await;
    let c = start(&client, store.clone(), "replica-c").await;
    let balanced = |h: &BTreeMap<u32, String>| {
        let counts = counts(h);
        h.len() == SHARDS as usize && counts.len() == 3 && counts.values().all(|&n| n <= 3)
    };
    let took = until(
        &[&a, &b, &c],
        Duration::from_secs(30),
        "three replicas balance",
        balanced,
    )
    .await;
    eprintln!("rebalanced over three replicas in {took:?}");

    // replica-c stops renewing (as if killed): the others take its shards once its Lease
    // expires, and not before its own deadline has stopped it.
    c.task.abort();
    let c_shards: Vec<u32> = c.ownership.held().into_iter().map(|(s, _)| s).collect();
    assert!(!c_shards.is_empty());
    let takeover = until(
        &[&a, &b, &c],
        Duration::from_secs(30),
        "two replicas take over",
        |h| {
            let counts = counts(h);
            h.len() == SHARDS as usize && !counts.contains_key("replica-c")
        },
    )
    .await;
    eprintln!("shards {c_shards:?} of the stopped replica taken over in {takeover:?}");

    // The store saw every taking, with epochs rising per shard and never one epoch twice.
    let history = store.shard_history().await.unwrap();
    let mut last: BTreeMap<u32, i64> = BTreeMap::new();
    for taking in &history {
        if let Some(previous) = last.insert(taking.shard, taking.epoch) {
            assert!(
                taking.epoch > previous,
                "epochs of shard {} went {previous} then {}",
                taking.shard,
                taking.epoch
            );
        }
    }
    for shard in &c_shards {
        let takers: Vec<&str> = history
            .iter()
            .filter(|t| t.shard == *shard)
            .map(|t| t.holder.as_str())
            .collect();
        assert_eq!(
            takers.last().copied().map(|h| h != "replica-c"),
            Some(true),
            "shard {shard}: {takers:?}"
        );
    }
    a.task.abort();
    b.task.abort();
    drop(store);
    let _ = std::fs::remove_dir_all(dir);
}
