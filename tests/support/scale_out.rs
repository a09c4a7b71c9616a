//! The scale-out harness tests/scale_out.rs and benches/scale_out.rs share: tenants with
//! producers and subscriptions on the control plane, herald replicas sharing one
//! PostgreSQL and dividing shards through Leases, and a load of 32 producers.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::control_plane::ControlPlane;
use super::herald::{producer, secret, subscription};
use super::operator::Operator;
use super::postgres::Postgres;
use super::receiver::Receiver;

pub const LEASES: &str = "herald-system";
pub const SHARDS: &str = "12";
pub const LEASE_SECONDS: &str = "6";

pub fn namespace(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
}

/// `herald run` flags of one replica sharing `pg`.
pub fn replica_args<'a>(pg: &'a Postgres, id: &'a str) -> Vec<&'a str> {
    vec![
        "--store",
        &pg.url,
        "--shard-leases",
        "--shards",
        SHARDS,
        "--shard-lease-seconds",
        LEASE_SECONDS,
        "--lease-namespace",
        LEASES,
        "--replica-id",
        id,
        "--status-interval-seconds",
        "1",
    ]
}

pub async fn replica(cp: &ControlPlane, pg: &Postgres, id: &str) -> Operator {
    // Lanes woken in shards not held are logged, for a failure's message.
    let logged = ["--log-level", "info,herald::shards=debug"];
    Operator::start(cp, &[replica_args(pg, id), logged.to_vec()].concat()).await
}

/// Waits until the shard Leases' holders satisfy `done`; how long that took.
pub async fn wait_for_holders(
    cp: &ControlPlane,
    what: &str,
    done: impl Fn(&BTreeMap<u32, String>) -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        let holders = shard_holders(cp);
        if done(&holders) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{what}: {holders:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Holder of every shard Lease that is held and not expired, by shard.
pub fn shard_holders(cp: &ControlPlane) -> BTreeMap<u32, String> {
    let out = cp.kubectl_ok(&[
        "get",
        "leases",
        "-n",
        LEASES,
        "-l",
        "herald.dev/lease=shard",
        "-o",
        "json",
    ]);
    let list: Value = serde_json::from_str(&out).unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let mut holders = BTreeMap::new();
    for lease in list["items"].as_array().unwrap() {
        let name = lease["metadata"]["name"].as_str().unwrap();
        let shard: u32 = name.trim_start_matches("herald-shard-").parse().unwrap();
        let holder = lease["spec"]["holderIdentity"].as_str().unwrap_or("");
        let renewed = lease["spec"]["renewTime"]
            .as_str()
            .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())
            .map_or(0, |t| t.as_millisecond());
        let seconds = lease["spec"]["leaseDurationSeconds"].as_i64().unwrap_or(0);
        if !holder.is_empty() && renewed + seconds * 1000 > now {
            holders.insert(shard, holder.to_string());
        }
    }
    holders
}

/// What every test here starts from: the control plane, PostgreSQL, herald's Lease
/// namespace, a receiver, and [`tenants`] applied (none when `namespaces` is 0).
pub async fn cluster(
    namespaces: usize,
    per_namespace: usize,
) -> Option<(ControlPlane, Postgres, Receiver, Vec<(String, String)>)> {
    let cp = ControlPlane::start()?;
    let pg = Postgres::start()?;
    cp.apply(&[namespace(LEASES)]);
    let receiver = Receiver::start().await;
    let (manifests, types) = tenants(&receiver, namespaces, per_namespace);
    if !manifests.is_empty() {
        cp.apply(&manifests);
    }
    Some((cp, pg, receiver, types))
}

/// Subscriptions: `per_namespace` in each of `namespaces`, each matching one event type of
/// its own and posting to a path of its own.
pub fn tenants(
    receiver: &Receiver,
    namespaces: usize,
    per_namespace: usize,
) -> (Vec<Value>, Vec<(String, String)>) {
    let mut manifests = Vec::new();
    let mut types = Vec::new();
    for n in 0..namespaces {
        let ns = format!("t{n}");
        manifests.push(namespace(&ns));
        manifests.push(secret(&ns));
        manifests.extend(producer(&ns));
        for s in 0..per_namespace {
            let event_type = format!("e.{n}.{s}");
            manifests.push(subscription(
                &ns,
                &format!("s{s}"),
                &receiver.url(&format!("/{ns}/s{s}")),
                &[&event_type],
                json!({"delivery": {"retry": {
                    "initialBackoff": "100ms", "maxBackoff": "1s", "maxAttempts": 100
                }}}),
            ));
            types.push((ns.clone(), event_type));
        }
    }
    (manifests, types)
}

/// Every subscription's status once each has been written by its shard's holder.
pub async fn statuses_written(
    cp: &ControlPlane,
    expected: usize,
    deadline: Duration,
) -> Vec<Value> {
    let start = Instant::now();
    loop {
        let out = cp.kubectl_ok(&["get", "whsub", "-A", "-o", "json"]);
        let items: Value = serde_json::from_str(&out).unwrap();
        let items = items["items"].as_array().unwrap().clone();
        let done = items
            .iter()
            .filter(|i| i["status"]["shard"].is_u64() && i["status"]["pendingAttempts"] == 0)
            .count();
        if done == expected {
            return items;
        }
        assert!(
            start.elapsed() < deadline,
            "statuses: {done} of {expected} written with nothing pending"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

pub fn tokens(cp: &ControlPlane, namespaces: usize) -> HashMap<String, String> {
    (0..namespaces)
        .map(|n| (format!("t{n}"), cp.token(&format!("t{n}"), "producer")))
        .collect()
}

/// 32 producers publishing `events` events, round robin over the replicas in `bases`; an
/// answer other than 202 is retried on the next replica (the event id makes it idempotent).
pub struct Load {
    bases: Arc<Mutex<Vec<String>>>,
    acknowledged: Arc<Mutex<HashSet<String>>>,
    /// Every answer other than 202, by status (0: no answer).
    refused: Arc<Mutex<BTreeMap<u16, usize>>>,
    producers: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    pub fn start(
        replicas: &[Operator],
        tokens: HashMap<String, String>,
        types: Vec<(String, String)>,
        events: usize,
    ) -> Self {
        Self::start_from(replicas, tokens, types, events, 0)
    }

    /// As [`Load::start`], with event ids from `offset` on.
    pub fn start_from(
        replicas: &[Operator],
        tokens: HashMap<String, String>,
        types: Vec<(String, String)>,
        events: usize,
        offset: usize,
    ) -> Self {
        let bases: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(
            replicas.iter().map(|r| r.base.clone()).collect(),
        ));
        let acknowledged: Arc<Mutex<HashSet<String>>> = Arc::default();
        let refused: Arc<Mutex<BTreeMap<u16, usize>>> = Arc::default();
        let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let http = reqwest::Client::new();
        let (tokens, types) = (Arc::new(tokens), Arc::new(types));
        let producers = (0..32)
            .map(|p| {
                let (bases, acknowledged, refused, next, http, tokens, types) = (
                    bases.clone(),
                    acknowledged.clone(),
                    refused.clone(),
                    next.clone(),
                    http.clone(),
                    tokens.clone(),
                    types.clone(),
                );
                tokio::spawn(async move {
                    let mut turn = p;
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if i >= events {
                            return;
                        }
                        let (ns, event_type) = &types[i % types.len()];
                        let id = format!("evt-{}", i + offset);
                        let body = json!({"id": id, "type": event_type, "data": {"i": i}});
                        for attempt in 0.. {
                            assert!(attempt < 600, "event {id} never acknowledged");
                            let base = {
                                let bases = bases.lock().unwrap();
                                turn += 1;
                                bases[turn % bases.len()].clone()
                            };
                            let answer = http
                                .post(format!("{base}/v1/namespaces/{ns}/events"))
                                .bearer_auth(&tokens[ns])
                                .json(&body)
                                .timeout(Duration::from_secs(10))
                                .send()
                                .await;
                            let status = answer.as_ref().map_or(0, |r| r.status().as_u16());
                            if status == 202 {
                                acknowledged.lock().unwrap().insert(id.clone());
                                break;
                            }
                            *refused.lock().unwrap().entry(status).or_default() += 1;
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                })
            })
            .collect();
        Self {
            bases,
            acknowledged,
            refused,
            producers,
        }
    }

    /// Stops sending to this replica.
    pub fn without(&self, replica: &Operator) {
        self.bases.lock().unwrap().retain(|b| *b != replica.base);
    }

    /// Sends to this replica too.
    pub fn with(&self, replica: &Operator) {
        self.bases.lock().unwrap().push(replica.base.clone());
    }

    /// How many events have been acknowledged so far.
    pub fn acknowledged(&self) -> usize {
        self.acknowledged.lock().unwrap().len()
    }

    /// Answers other than 202 so far, by status (0: no answer).
    pub fn refused(&self) -> BTreeMap<u16, usize> {
        self.refused.lock().unwrap().clone()
    }

    /// Waits for every producer; the acknowledged event ids.
    pub async fn finish(self) -> HashSet<String> {
        for producer in self.producers {
            producer.await.unwrap();
        }
        self.acknowledged.lock().unwrap().clone()
    }
}
