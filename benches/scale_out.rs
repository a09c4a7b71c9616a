//! Scale-out figures (cluster mode, against a real kube-apiserver and a real PostgreSQL),
//! each against a reference from the same run:
//! - end to end (from the first publish to the last arrival; 32 producers, 32 subscriptions
//!   in 4 namespaces) on PostgreSQL with one replica, against the embedded store;
//! - the same with three replicas, against one replica, and their CPU per delivered event
//!   (herald's processes and the PostgreSQL server's, from /proc), against one replica's;
//! - per event on PostgreSQL: the server's CPU, herald's CPU, the statements herald ran
//!   (pg_stat_statements) and the WAL written, and the ceiling per server core they project;
//! - publish → arrival on PostgreSQL, one and three replicas, of events published one at a
//!   time 2 ms apart (under way: the pace at which a batch no longer waits for more) and
//!   20 ms apart (each after a quiet moment), three replicas against one;
//! - herald's drain on PostgreSQL (events stored while every subscription is paused, then
//!   delivered once unpaused), against River's own burn-down benchmark (`river bench`, a
//!   job queue in Go nobody here wrote; scripts/river builds its CLI) on the same server.
//!
//! Needs the test control plane (`scripts/control-plane build`), PostgreSQL
//! (`scripts/postgres`) and Go (for River). Run: `cargo bench --bench scale_out`
//! (`HERALD_BENCH_MODE=quick`: 2,000 events a phase, 200 paced at each pace and 10,000
//! River jobs; full: 10,000, 1,000 and 50,000).

#[path = "../tests/support/mod.rs"]
mod support;

mod common;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Report, Target, ms, percentile, thousands};
use sqlx_core::connection::Connection;
use sqlx_core::executor::Executor;
use sqlx_postgres::PgConnection;
use support::control_plane::ControlPlane;
use support::cpu::Machine;
use support::operator::Operator;
use support::postgres::Postgres;
use support::receiver::Receiver;
use support::scale_out::{Load, cluster, replica, tenants, tokens, wait_for_holders};

const NAMESPACES: usize = 4;
const PER_NAMESPACE: usize = 8;
const WRITE_FLOOR: &str = "server CPU of a one-row UPDATE and its commit, one connection, same server: the least a write statement costs it";

/// What the PostgreSQL server does over a phase: its CPU (its processes, from /proc), the
/// statements it ran (pg_stat_statements, which scripts/postgres loads) and the WAL it
/// wrote.
struct ServerUse {
    cpu: Duration,
    wal_lsn: String,
}

/// Per event over a phase.
struct PerEvent {
    server_cpu_us: f64,
    statements: f64,
    wal_bytes: f64,
}

async fn connect(url: &str) -> PgConnection {
    PgConnection::connect(url)
        .await
        .expect("connecting to PostgreSQL")
}

impl ServerUse {
    /// Starts counting from now.
    async fn mark(pg: &Postgres) -> Self {
        let mut conn = connect(&pg.url).await;
        sqlx_core::query::query("SELECT pg_stat_statements_reset()")
            .execute(&mut conn)
            .await
            .unwrap();
        let wal_lsn: String =
            sqlx_core::query_scalar::query_scalar("SELECT pg_current_wal_lsn()::text")
                .fetch_one(&mut conn)
                .await
                .unwrap();
        Self {
            cpu: support::cpu::of_tree(pg.postmaster_pid().expect("the server runs")),
            wal_lsn,
        }
    }

    /// Per event since [`Self::mark`]; prints the statements that took most of the
    /// server's time.
    async fn per_event(self, pg: &Postgres, events: usize) -> PerEvent {
        let cpu = support::cpu::of_tree(pg.postmaster_pid().expect("the server runs")) - self.cpu;
        let mut conn = connect(&pg.url).await;
        let wal: f64 = sqlx_core::query_scalar::query_scalar(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::float8",
        )
        .bind(&self.wal_lsn)
        .fetch_one(&mut conn)
        .await
        .unwrap();
        // herald's statements, not this connection's.
        let rows: Vec<(i64, f64, i64, String)> = sqlx_core::query_as::query_as(
            "SELECT calls, total_exec_time, rows, left(regexp_replace(query, '\\s+', ' ', 'g'), 90)
             FROM pg_stat_statements
             WHERE query NOT LIKE '%pg_stat_statements%' AND query NOT LIKE '%pg_current_wal_lsn%'
             ORDER BY total_exec_time DESC",
        )
        .fetch_all(&mut conn)
        .await
        .unwrap();
        let n = events as f64;
        for (calls, ms, returned, query) in rows.iter().take(6) {
            println!(
                "    {:.2}/event, {:.0} µs/event executing, {:.2} rows a call: {query}",
                *calls as f64 / n,
                ms * 1e3 / n,
                *returned as f64 / (*calls).max(1) as f64
            );
        }
        PerEvent {
            server_cpu_us: cpu.as_secs_f64() * 1e6 / n,
            statements: rows.iter().map(|r| r.0).sum::<i64>() as f64 / n,
            wal_bytes: wal / n,
        }
    }
}

/// One phase's figures.
struct Phase {
    rate: f64,
    herald_cpu_us: f64,
    server: Option<PerEvent>,
    /// The machine's cores busy on average over the phase (everything on it: herald, the
    /// server, the load, the receiver, the control plane).
    busy_cores: f64,
}

impl Phase {
    /// herald's and the server's CPU per event, in µs.
    fn cpu_us(&self) -> f64 {
        self.herald_cpu_us + self.server.as_ref().map_or(0.0, |s| s.server_cpu_us)
    }
}

/// The store operations whose time a phase prints.
const TIMED: [&str; 3] = ["publish", "claim_next", "complete"];

/// (seconds, count) of each of [`TIMED`] so far, summed over the replicas
/// (`herald_store_operation_duration_seconds`).
async fn store_times(replicas: &[Operator]) -> Vec<(f64, f64)> {
    let mut times = Vec::new();
    for op in TIMED {
        let label = format!("operation=\"{op}\"");
        let (mut seconds, mut count) = (0.0, 0.0);
        for r in replicas {
            seconds += r
                .metric("herald_store_operation_duration_seconds_sum", &label)
                .await;
            count += r
                .metric("herald_store_operation_duration_seconds_count", &label)
                .await;
        }
        times.push((seconds, count));
    }
    times
}

/// Prints each store operation's mean time and count per event since `before`.
async fn print_store_times(replicas: &[Operator], before: &[(f64, f64)], events: usize) {
    let after = store_times(replicas).await;
    let parts: Vec<String> = TIMED
        .iter()
        .zip(after.iter().zip(before))
        .map(|(op, ((s, c), (s0, c0)))| {
            let n = (c - c0).max(1.0);
            format!(
                "{op} {:.2} ms ({:.2}/event)",
                (s - s0) * 1e3 / n,
                (c - c0) / events as f64
            )
        })
        .collect();
    println!("  herald's store operations, mean: {}", parts.join(", "));
}

fn herald_cpu(replicas: &[Operator]) -> Duration {
    replicas.iter().map(|r| support::cpu::of(r.pid())).sum()
}

/// Starts `count` replicas (on PostgreSQL, sharing the shards, or one on the embedded store).
async fn start(cp: &ControlPlane, pg: Option<&Postgres>, count: usize) -> Vec<Operator> {
    let mut replicas = Vec::new();
    for i in 0..count {
        replicas.push(match pg {
            Some(pg) => replica(cp, pg, &format!("replica-{i}")).await,
            None => Operator::start(cp, &[]).await,
        });
    }
    if pg.is_some() {
        wait_for_holders(cp, "shards spread", |h| {
            h.len() == 12 && h.values().collect::<HashSet<_>>().len() == count
        })
        .await;
    }
    replicas
}

async fn stop(cp: &ControlPlane, replicas: Vec<Operator>, shared: bool) {
    for mut r in replicas {
        r.terminate(Duration::from_secs(30));
    }
    if shared {
        wait_for_holders(cp, "leases released", |h| h.is_empty()).await;
    }
}

/// Publishes `events` (ids from `offset`) through `replicas` and waits until every one has
/// arrived: the rate from the first publish to the last arrival, and the CPU it took.
#[allow(clippy::too_many_arguments)]
async fn end_to_end(
    label: &str,
    replicas: &[Operator],
    pg: Option<&Postgres>,
    receiver: &Receiver,
    tokens: &std::collections::HashMap<String, String>,
    types: &[(String, String)],
    events: usize,
    offset: usize,
) -> Phase {
    let before = receiver.count();
    let herald_before = herald_cpu(replicas);
    let server_before = match pg {
        Some(pg) => Some(ServerUse::mark(pg).await),
        None => None,
    };
    let times_before = store_times(replicas).await;
    let machine = Machine::mark();
    let started = Instant::now();
    let load = Load::start_from(replicas, tokens.clone(), types.to_vec(), events, offset);
    assert_eq!(load.finish().await.len(), events);
    receiver
        .wait_until(label, Duration::from_secs(600), |h| {
            h.len() >= before + events
        })
        .await;
    let rate = events as f64 / started.elapsed().as_secs_f64();
    let busy_cores = machine.busy_cores();
    let herald_cpu_us = (herald_cpu(replicas) - herald_before).as_secs_f64() * 1e6 / events as f64;
    println!(
        "{label}: {rate:.0} events/s end to end; herald CPU {herald_cpu_us:.0} µs an event; {busy_cores:.2} cores busy; a publish answered in {:.2} ms on average (32 producers)",
        32e3 / rate
    );
    print_store_times(replicas, &times_before, events).await;
    let server = match (server_before, pg) {
        (Some(mark), Some(pg)) => Some(mark.per_event(pg, events).await),
        _ => None,
    };
    if let Some(s) = &server {
        println!(
            "  PostgreSQL per event: CPU {:.0} µs, {:.2} statements, WAL {:.0} bytes",
            s.server_cpu_us, s.statements, s.wal_bytes
        );
    }
    Phase {
        rate,
        herald_cpu_us,
        server,
        busy_cores,
    }
}

/// Events a second of the paced latency measures: one every 2 ms, under way (with every
/// request within 10 ms of the last one counted a stream, each batch waited 1 or 2 ms for
/// more; the store's rule now expects too few at this pace to wait), and one every 20 ms,
/// each after a quiet moment.
const PACES: [(f64, &str); 2] = [(500.0, "2 ms apart"), (50.0, "20 ms apart")];

/// Publish → arrival of `count` events (ids from `offset`) published at `rate` a second,
/// one at a time, round robin over `replicas`: what a user's first attempt waits for at that
/// pace. With several replicas most events reach one that does not hold their lane, and the
/// holder claims them when told (NOTIFY).
async fn latency_paced(
    replicas: &[Operator],
    receiver: &Receiver,
    tokens: &HashMap<String, String>,
    types: &[(String, String)],
    rate: f64,
    count: usize,
    offset: usize,
) -> Vec<Duration> {
    let client = reqwest::Client::new();
    let before = receiver.count();
    let start = tokio::time::Instant::now() + Duration::from_millis(20);
    let tasks: Vec<_> = (0..count)
        .map(|i| {
            let (ns, event_type) = types[i % types.len()].clone();
            let base = replicas[i % replicas.len()].base.clone();
            let (client, token) = (client.clone(), tokens[&ns].clone());
            let at = start + Duration::from_secs_f64(i as f64 / rate);
            tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                let id = format!("evt-{}", i + offset);
                let body = serde_json::json!({"id": id, "type": event_type, "data": {"i": i}});
                let sent = Instant::now();
                let status = client
                    .post(format!("{base}/v1/namespaces/{ns}/events"))
                    .bearer_auth(&token)
                    .json(&body)
                    .timeout(Duration::from_secs(10))
                    .send()
                    .await
                    .map(|r| r.status().as_u16());
                assert!(matches!(status, Ok(202)), "publishing {id}: {status:?}");
                (id, sent)
            })
        })
        .collect();
    let mut sent = Vec::with_capacity(count);
    for task in tasks {
        sent.push(task.await.unwrap());
    }
    receiver
        .arrivals(
            "the paced deliveries",
            Duration::from_secs(120),
            before,
            &sent,
        )
        .await
}

/// Sets `spec.paused` on every subscription and waits until herald says so in each one's
/// Ready condition (its shard's holder has seen it).
fn pause_all(cp: &ControlPlane, receiver: &Receiver, paused: bool) {
    let (mut manifests, _) = tenants(receiver, NAMESPACES, PER_NAMESPACE);
    manifests.retain(|m| m["kind"] == "WebhookSubscription");
    for m in &mut manifests {
        m["spec"]["paused"] = paused.into();
    }
    cp.apply(&manifests);
    if !paused {
        return;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = cp.kubectl_ok(&["get", "whsub", "-A", "-o", "json"]);
        let list: serde_json::Value = serde_json::from_str(&out).unwrap();
        let items = list["items"].as_array().cloned().unwrap_or_default();
        let shown = items
            .iter()
            .filter(|i| {
                i["status"]["conditions"].as_array().is_some_and(|c| {
                    c.iter()
                        .any(|c| c["type"] == "Ready" && c["reason"] == "Paused")
                })
            })
            .count();
        if shown == manifests.len() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{shown} of {} subscriptions show Paused",
            manifests.len()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The least a write statement costs the server: its CPU per one-row UPDATE and commit,
/// one connection, each statement its own transaction (prepared once, as herald's are;
/// synchronous_commit off, as herald's records and claims run).
async fn write_floor(pg: &Postgres, statements: i32) -> f64 {
    let mut conn = connect(&pg.url).await;
    for sql in [
        "SET synchronous_commit = off",
        "CREATE TABLE bench_write_floor (id integer PRIMARY KEY, v bigint NOT NULL)",
        "INSERT INTO bench_write_floor SELECT g, 0 FROM generate_series(1, 100) g",
    ] {
        conn.execute(sql).await.unwrap();
    }
    let update = "UPDATE bench_write_floor SET v = v + 1 WHERE id = $1";
    let before = support::cpu::of_tree(pg.postmaster_pid().expect("the server runs"));
    for i in 0..statements {
        sqlx_core::query::query(update)
            .bind(i % 100 + 1)
            .execute(&mut conn)
            .await
            .unwrap();
    }
    let cpu = support::cpu::of_tree(pg.postmaster_pid().expect("the server runs")) - before;
    conn.execute("DROP TABLE bench_write_floor").await.unwrap();
    cpu.as_secs_f64() * 1e6 / f64::from(statements)
}

/// River's `river bench` burn-down of `jobs` jobs in a database of its own on `pg`: jobs/s,
/// the server's use per job over the whole command (its inserts of the jobs included), and
/// the machine's cores busy meanwhile.
async fn river(pg: &Postgres, jobs: usize) -> (f64, PerEvent, f64) {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let built = Command::new(repo.join("scripts/river"))
        .arg("build")
        .output()
        .expect("running scripts/river build");
    assert!(
        built.status.success(),
        "scripts/river build failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let river = String::from_utf8_lossy(&built.stdout).trim().to_string();
    let mut conn = connect(&pg.url).await;
    sqlx_core::query::query("CREATE DATABASE river")
        .execute(&mut conn)
        .await
        .unwrap();
    let url = pg.url_of("river");
    let run = |args: &[&str]| {
        let out = Command::new(&river)
            .args(args)
            .args(["--database-url", &url])
            .output()
            .expect("running river");
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "river {args:?} failed:\n{text}");
        text
    };
    run(&["migrate-up"]);
    let server = ServerUse::mark(pg).await;
    let machine = Machine::mark();
    let out = run(&["bench", "--num-total-jobs", &jobs.to_string()]);
    let busy_cores = machine.busy_cores();
    let used = server.per_event(pg, jobs).await;
    // "bench: total jobs worked [ 50000 ], ..., overall job/sec [ 16579.6 ], running 3.0s"
    let rate = out
        .split("overall job/sec [")
        .nth(1)
        .and_then(|rest| rest.split(']').next())
        .and_then(|n| n.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no overall job/sec in river bench's output:\n{out}"));
    println!(
        "River: {} jobs burnt down at {rate:.0} jobs/s; {busy_cores:.2} cores busy (its inserts included)",
        thousands(jobs)
    );
    println!(
        "  PostgreSQL per job: CPU {:.0} µs, {:.2} statements, WAL {:.0} bytes (its inserts included)",
        used.server_cpu_us, used.statements, used.wal_bytes
    );
    (rate, used, busy_cores)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut report = Report::new("scale_out");
    let events = report.mode.pick(2_000, 10_000);
    let jobs = report.mode.pick(10_000, 50_000);
    report.param("events_per_phase", events);
    report.param("subscriptions", NAMESPACES * PER_NAMESPACE);
    report.param("producers", 32);
    report.param("river_jobs", jobs);
    let paced_count = report.mode.pick(200, 1_000);
    report.param("paced_events", paced_count);
    let Some((cp, pg, receiver, types)) = cluster(NAMESPACES, PER_NAMESPACE).await else {
        panic!("the scale-out benchmark needs the control plane and PostgreSQL");
    };
    let tokens = tokens(&cp, NAMESPACES);
    let mut offset = 0;
    let mut phases = Vec::new();
    // Per PostgreSQL phase, per pace of PACES: publish → arrival of each paced event.
    let mut paced: Vec<Vec<Vec<Duration>>> = Vec::new();
    for (label, shared, count) in [
        ("embedded store, 1 replica", false, 1),
        ("PostgreSQL, 1 replica", true, 1),
        ("PostgreSQL, 3 replicas", true, 3),
    ] {
        let pg = shared.then_some(&pg);
        let replicas = start(&cp, pg, count).await;
        let types = &types;
        phases.push(
            end_to_end(
                label, &replicas, pg, &receiver, &tokens, types, events, offset,
            )
            .await,
        );
        offset += events;
        if shared {
            let mut at_paces = Vec::new();
            for (rate, _) in PACES {
                at_paces.push(
                    latency_paced(
                        &replicas,
                        &receiver,
                        &tokens,
                        types,
                        rate,
                        paced_count,
                        offset,
                    )
                    .await,
                );
                offset += paced_count;
            }
            paced.push(at_paces);
        }
        stop(&cp, replicas, shared).await;
    }
    let [embedded, one, three] = <[Phase; 3]>::try_from(phases).ok().expect("three phases");

    // The drain: events stored while every subscription is paused; herald stopped, the
    // subscriptions unpaused, herald started again: it works the stored backlog off, as
    // River's burn-down works off jobs inserted before its client starts. (Unpaused live,
    // the lanes start one by one as kubectl's apply reaches each subscription, about 25 ms
    // apart here, and the drain would time kubectl.)
    let replicas = start(&cp, Some(&pg), 1).await;
    pause_all(&cp, &receiver, true);
    let before = receiver.count();
    let load = Load::start_from(&replicas, tokens.clone(), types.clone(), events, offset);
    assert_eq!(load.finish().await.len(), events);
    assert_eq!(receiver.count(), before, "deliveries while paused");
    stop(&cp, replicas, true).await;
    pause_all(&cp, &receiver, false);
    let server_before = ServerUse::mark(&pg).await;
    let machine = Machine::mark();
    let started = Instant::now();
    let replicas = start(&cp, Some(&pg), 1).await;
    receiver
        .wait_until("the drain", Duration::from_secs(600), |h| {
            h.len() >= before + events
        })
        .await;
    // From the first delivery to the last, as River's burn-down times its workers; herald's
    // start (its reconciles, the shards taken) is reported on its own.
    let drained: Vec<Instant> = receiver.hits()[before..].iter().map(|h| h.at).collect();
    let (first, last) = (
        *drained.iter().min().expect("deliveries"),
        *drained.iter().max().expect("deliveries"),
    );
    let drain_busy = machine.busy_cores();
    let unpaused = first.duration_since(started);
    let drain = (events - 1) as f64 / last.duration_since(first).as_secs_f64();
    println!(
        "PostgreSQL, 1 replica, drain: {drain:.0} events/s, the first {} ms after herald was started; herald CPU {:.0} µs an event (its start included); {drain_busy:.2} cores busy",
        unpaused.as_millis(),
        herald_cpu(&replicas).as_secs_f64() * 1e6 / events as f64
    );
    let drained_use = server_before.per_event(&pg, events).await;
    println!(
        "  PostgreSQL per event: CPU {:.0} µs, {:.2} statements, WAL {:.0} bytes",
        drained_use.server_cpu_us, drained_use.statements, drained_use.wal_bytes
    );
    stop(&cp, replicas, true).await;
    let (river, river_use, river_busy) = river(&pg, jobs).await;
    let floor = write_floor(&pg, report.mode.pick(2_000, 5_000)).await;

    let n = thousands(events);
    report
        .add(
            "scale_out.postgres_1",
            &format!("end to end on PostgreSQL, one replica ({n} events)"),
            one.rate,
            "events/s",
        )
        .reference("the embedded store, one replica", embedded.rate)
        .target(Target::RatioAtLeast(0.5));
    report
        .add(
            "scale_out.postgres_3",
            &format!("end to end on PostgreSQL, three replicas ({n} events)"),
            three.rate,
            "events/s",
        )
        .reference("one replica", one.rate)
        .target(Target::RatioAtLeast(1.0));
    report
        .add(
            "scale_out.cpu_3",
            "CPU per event with three replicas (herald's processes and the server's)",
            three.cpu_us(),
            "µs",
        )
        .reference("one replica", one.cpu_us())
        .target(Target::RatioAtMost(1.1));
    let [mut paced_one, mut paced_three] =
        <[Vec<Vec<Duration>>; 2]>::try_from(paced).expect("two PostgreSQL phases");
    let paced_n = thousands(paced_count);
    for (i, (rate, apart)) in PACES.iter().enumerate() {
        for (q, p) in [("p50", 0.5), ("p99", 0.99)] {
            let one_q = ms(percentile(&mut paced_one[i], p));
            let key = format!("scale_out.latency_{}_per_s", *rate as u32);
            report.add(
                &format!("{key}.postgres_1.{q}"),
                &format!(
                    "publish → arrival on PostgreSQL, one replica, {paced_n} events {apart}, {q}"
                ),
                one_q,
                "ms",
            );
            report
                .add(
                    &format!("{key}.postgres_3.{q}"),
                    &format!("publish → arrival on PostgreSQL, three replicas (publishes round robin), {paced_n} events {apart}, {q}"),
                    ms(percentile(&mut paced_three[i], p)),
                    "ms",
                )
                .reference("one replica, same pace", one_q);
        }
    }
    for (replicas, p) in [("1", &one), ("3", &three)] {
        let s = p.server.as_ref().expect("PostgreSQL figures");
        let with = if replicas == "1" {
            "one replica"
        } else {
            "three replicas"
        };
        report.add(
            &format!("scale_out.postgres_{replicas}.server_cpu"),
            &format!("PostgreSQL server CPU per event, {with}"),
            s.server_cpu_us,
            "µs",
        );
        report.add(
            &format!("scale_out.postgres_{replicas}.herald_cpu"),
            &format!("herald CPU per event, {with}"),
            p.herald_cpu_us,
            "µs",
        );
        report.add(
            &format!("scale_out.postgres_{replicas}.statements"),
            &format!("statements per event, {with} (pg_stat_statements)"),
            s.statements,
            "statements",
        );
        report.add(
            &format!("scale_out.postgres_{replicas}.wal"),
            &format!("WAL per event, {with}"),
            s.wal_bytes,
            "bytes",
        );
    }
    report.add(
        "scale_out.ceiling_per_server_core",
        "events a second one PostgreSQL core carries (1 s over the server's CPU per event, one replica): replicas on machines of their own are bounded by it",
        1e6 / one.server.as_ref().expect("PostgreSQL figures").server_cpu_us,
        "events/s",
    );
    // Each replica joins only its own statements, so the server's cost per event grows
    // with the replicas; what three cost it is the projection for several.
    report.add(
        "scale_out.ceiling_per_server_core_3",
        "events a second one PostgreSQL core carries with three replicas (1 s over the server's CPU per event then): what several replicas on machines of their own are bounded by",
        1e6 / three.server.as_ref().expect("PostgreSQL figures").server_cpu_us,
        "events/s",
    );
    // Three replicas on one machine each see a third of the load and join a third as much
    // into a statement, so they send more statements an event: what each added statement
    // costs the server, and what the CPU target leaves for one, against the least a write
    // statement costs it.
    let (s1, s3) = (
        one.server.as_ref().expect("PostgreSQL figures"),
        three.server.as_ref().expect("PostgreSQL figures"),
    );
    let added = s3.statements - s1.statements;
    let added_cpu = s3.server_cpu_us - s1.server_cpu_us;
    // In a short run the server's CPU per event moves more than three replicas add to it,
    // so the difference can come out at or below zero: then it measures noise, not the
    // added statements, and the figure is left out rather than reported as a cost.
    if added > 0.0 && added_cpu <= 0.0 {
        eprintln!(
            "note: three replicas cost the server {:.1} µs an event against one replica's {:.1} µs \
             (not more, within this run's noise); the CPU per added statement is left out",
            s3.server_cpu_us, s1.server_cpu_us
        );
    }
    if added > 0.0 && added_cpu > 0.0 {
        report
            .add(
                "scale_out.server_cpu_per_added_statement",
                "PostgreSQL server CPU per statement three replicas add ((server CPU per event, three replicas − one) / (statements per event, three − one))",
                added_cpu / added,
                "µs",
            )
            .reference(WRITE_FLOOR, floor);
        report
            .add(
                "scale_out.cpu_3.allowance_per_added_statement",
                "CPU the ≤ 1.1 × target leaves per statement three replicas add (0.1 × one replica's CPU per event / (statements per event, three replicas − one))",
                0.1 * one.cpu_us() / added,
                "µs",
            )
            .reference(WRITE_FLOOR, floor);
    }
    report
        .add(
            "scale_out.drain_postgres",
            &format!(
                "drain on PostgreSQL, one replica ({n} events stored while paused; first to last delivery)"
            ),
            drain,
            "events/s",
        )
        .reference(
            &format!(
                "River's `river bench` burn-down of {} jobs, same server",
                thousands(jobs)
            ),
            river,
        )
        .target(Target::RatioAtLeast(0.5));
    report
        .add(
            "scale_out.drain_postgres.server_cpu",
            "PostgreSQL server CPU per event, the drain",
            drained_use.server_cpu_us,
            "µs",
        )
        .reference(
            "per job of River's burn-down, its inserts included, same server",
            river_use.server_cpu_us,
        );
    report
        .add(
            "scale_out.drain_postgres.statements",
            "statements per event, the drain",
            drained_use.statements,
            "statements",
        )
        .reference("per job of River's burn-down", river_use.statements);
    report
        .add(
            "scale_out.drain_postgres.wal",
            "WAL per event, the drain",
            drained_use.wal_bytes,
            "bytes",
        )
        .reference("per job of River's burn-down", river_use.wal_bytes);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for (key, what, busy) in [
        (
            "embedded",
            "end to end, embedded store",
            embedded.busy_cores,
        ),
        (
            "postgres_1",
            "end to end, PostgreSQL, one replica",
            one.busy_cores,
        ),
        (
            "postgres_3",
            "end to end, PostgreSQL, three replicas",
            three.busy_cores,
        ),
        ("drain_postgres", "the drain on PostgreSQL", drain_busy),
        (
            "river",
            "River's burn-down (its inserts included)",
            river_busy,
        ),
    ] {
        report.add(
            &format!("scale_out.{key}.busy_cores"),
            &format!(
                "cores busy on average during {what}, of the machine's {cores} (everything on it)"
            ),
            busy,
            "cores",
        );
    }
    // The machine's ceilings: every core busy, at the CPU per event everything on it spent
    // (herald, the server, the receiver and producers). Waiting less cannot go above them.
    let ceiling = |rate: f64, busy: f64| rate * cores as f64 / busy;
    report
        .add(
            "scale_out.drain_postgres.ceiling",
            &format!("the drain's ceiling on this machine: its {cores} cores over the CPU per drained event of everything on it"),
            ceiling(drain, drain_busy),
            "events/s",
        )
        .reference(
            "River's burn-down, same server (as the drain's own target)",
            river,
        );
    report
        .add(
            "scale_out.postgres_3.ceiling",
            &format!("end to end ceiling on this machine with three replicas: its {cores} cores over the CPU per event of everything on it"),
            ceiling(three.rate, three.busy_cores),
            "events/s",
        )
        .reference("the same with one replica", ceiling(one.rate, one.busy_cores));
    report.add(
        "scale_out.drain_postgres.unpause",
        "from herald's start (the backlog stored, its subscriptions unpaused) to the drain's first delivery",
        unpaused.as_secs_f64() * 1e3,
        "ms",
    );
    report.finish();
}
