//! Delivery throughput and latency, each against a reference measured in the same run.
//!
//! herald runs as its own process (standalone, durable SQLite store), delivering to 4
//! subscriptions of lane width 8 on one loopback receiver. The reference for throughput is
//! a bare reqwest POST loop with the same concurrency (32) against the same receiver, run
//! once before herald's runs and once after (their mean).
//! - drain: events already stored, released at once (subscriptions unpaused); time until the
//!   receiver has them all;
//! - publish: the same number published by 32 producers (each acknowledged only once
//!   durable), while herald delivers them;
//! - end to end: from the first publish to the last arrival;
//! - the same end to end, and latency at idle, through a forwarder with no store (this
//!   binary run as its own process; see [`Forwarder`]): the most any herald could reach in
//!   this harness, and herald's rate against it;
//! - where end to end waits: a publish's round trip (the producers over the rate), its
//!   mean time in the store (herald's own `herald_store_operation_duration_seconds`), and
//!   the rates the forwarder's round trip plus that time, or plus one `fdatasync` on the
//!   store's disk (back to back, or at the writer's pace: after its run of a group), would
//!   allow;
//! - latency at idle: one event at a time, from the start of the publish request to its
//!   arrival at the receiver (p50, p99), against one bare POST round trip;
//! - latency spaced 20 ms apart (the disk rests between events, as between a quiet
//!   producer's): on a quiet herald, and within a second after a burst; the reference is
//!   an fdatasync on the store's disk spaced alike, in the same run. Targets p50 ≤ 1.5 ms,
//!   p99 ≤ 5 ms;
//! - latency at half load: events published at a steady rate of half the end-to-end rate
//!   just measured (open loop: each publish starts at its time whatever the others do),
//!   publish → arrival p50 and p99, against the latency at idle.
//!
//! Run: `cargo bench --bench delivery_throughput` (`HERALD_BENCH_MODE=quick` for small
//! sizes; benches/common/mod.rs). Targets: end to end ≥ 0.5 × the bare loop; latency at
//! idle p50 ≤ 2 ms, p99 ≤ 10 ms.

#[path = "../tests/support/mod.rs"]
mod support;

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::response::IntoResponse;
use common::{Report, Target, cpu_seconds, ms, percentile, thousands};
use serde_json::{Value, json};
use support::herald::{Herald, lanes};
use support::receiver::Receiver;
use tokio::sync::Semaphore;

const CONCURRENCY: usize = 32;
const LANES: usize = 4;
const NS: &str = "bench";

fn manifests(receiver: &Receiver, paused: bool) -> Vec<Value> {
    lanes(receiver, NS, "bench", LANES, CONCURRENCY / LANES, paused)
}

/// Runs `n` jobs over `CONCURRENCY` workers.
async fn concurrently<F, Fut>(n: usize, job: F)
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let next = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let (next, job) = (next.clone(), job.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        return;
                    }
                    job(i).await;
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
}

/// 429 answers met by every publish so far.
static BUSY: AtomicUsize = AtomicUsize::new(0);

/// One event of lane `i % LANES`, published by `client` as a producer would: a 429
/// (`publish_busy`: the namespace already has its maximum of publishes waiting for the
/// store) is counted in BUSY and sent again after its Retry-After. Panics on any other
/// answer but 202.
async fn publish(client: &reqwest::Client, url: &str, id: String, i: usize) {
    let event = json!({"id": id, "type": format!("bench.{}", i % LANES), "data": {"i": i}});
    loop {
        let response = client.post(url).json(&event).send().await.unwrap();
        match response.status().as_u16() {
            202 => return,
            429 => {
                let after = response
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok()?.parse().ok())
                    .unwrap_or(1);
                BUSY.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_secs(after)).await;
            }
            status => panic!("publish of {id} answered {status}"),
        }
    }
}

/// Publishes `events` events to the server at `base` (herald or the forwarder), 32 at a time.
async fn publish_all(base: &str, events: usize, offset: usize) {
    let client = reqwest::Client::new();
    let url = format!("{base}/v1/namespaces/{NS}/events");
    concurrently(events, move |i| {
        let (client, url) = (client.clone(), url.clone());
        async move { publish(&client, &url, format!("evt-{}", i + offset), i + offset).await }
    })
    .await;
}

/// Waits until the receiver holds `count` hits; returns the last one's arrival time.
async fn last_arrival(receiver: &Receiver, what: &str, count: usize) -> Instant {
    receiver
        .wait_for(what, Duration::from_secs(300), |hits| {
            (hits.len() >= count).then(|| hits.iter().map(|h| h.at).max().unwrap())
        })
        .await
}

/// Publish → arrival, one event at a time, and the bare POST round trip for reference.
async fn latency_at_idle(
    base: &str,
    receiver: &Receiver,
    samples: usize,
) -> (Vec<Duration>, Vec<Duration>) {
    let client = reqwest::Client::new();
    let mut bare = Vec::with_capacity(samples);
    for _ in 0..samples {
        let started = Instant::now();
        client
            .post(receiver.url("/reference"))
            .body("{}")
            .send()
            .await
            .unwrap();
        bare.push(started.elapsed());
    }
    let url = format!("{base}/v1/namespaces/{NS}/events");
    let mut through = Vec::with_capacity(samples);
    for i in 0..samples {
        let before = receiver.count();
        let started = Instant::now();
        publish(&client, &url, format!("idle-{i}"), 0).await;
        let at = receiver
            .wait_for("the event", Duration::from_secs(10), |hits| {
                hits.get(before).map(|h| h.at)
            })
            .await;
        through.push(at - started);
    }
    (through, bare)
}

/// How long the spaced measures rest between events: long enough for the disk to rest
/// (an fsync after 3 ms of rest costs two to three times one right after another).
const SPACING: Duration = Duration::from_millis(20);

/// Publish → arrival, one event at a time with [`SPACING`] between them, as a quiet producer
/// publishes. With `burst`: in rounds, each `burst` events published 32 at a time and
/// delivered, then spaced events for the next second. `offset` keeps the ids apart from
/// other phases'.
async fn latency_spaced(
    base: &str,
    receiver: &Receiver,
    samples: usize,
    burst: Option<usize>,
    offset: usize,
) -> Vec<Duration> {
    let client = reqwest::Client::new();
    let url = format!("{base}/v1/namespaces/{NS}/events");
    let per_round = (Duration::from_secs(1).as_millis() / SPACING.as_millis()) as usize;
    let mut through = Vec::with_capacity(samples);
    let mut next_id = offset;
    while through.len() < samples {
        if let Some(burst) = burst {
            let before = receiver.count();
            publish_all(base, burst, next_id).await;
            next_id += burst;
            last_arrival(receiver, "the burst", before + burst).await;
        } else {
            tokio::time::sleep(SPACING).await;
        }
        let round = if burst.is_some() { per_round } else { samples };
        for _ in 0..round.min(samples - through.len()) {
            tokio::time::sleep(SPACING).await;
            let before = receiver.count();
            let started = Instant::now();
            publish(&client, &url, format!("evt-{next_id}"), next_id).await;
            next_id += 1;
            let at = receiver
                .wait_for("the event", Duration::from_secs(10), |hits| {
                    hits.get(before).map(|h| h.at)
                })
                .await;
            through.push(at - started);
        }
    }
    through
}

/// The floor of a durable publish on this disk: writing 512 bytes to a file in `dir` (the
/// store's folder) and `fdatasync`, with [`SPACING`] between them, as the spaced measures
/// rest.
async fn fsync_spaced(dir: &std::path::Path, samples: usize) -> Vec<Duration> {
    use std::io::Write;
    let path = dir.join("fsync-probe");
    let mut file = std::fs::File::create(&path).unwrap();
    let mut took = Vec::with_capacity(samples);
    for _ in 0..samples {
        tokio::time::sleep(SPACING).await;
        let started = Instant::now();
        file = tokio::task::spawn_blocking(move || {
            file.write_all(&[7u8; 512]).unwrap();
            file.sync_data().unwrap();
            file
        })
        .await
        .unwrap();
        took.push(started.elapsed());
    }
    let _ = std::fs::remove_file(path);
    took
}

/// How long herald's store writer works between two syncs under end-to-end load: the run
/// of one group of operations, 0.32–0.42 ms when timed inside the writer (an experiment,
/// 7 December).
const WRITER_RUN: Duration = Duration::from_micros(300);

/// What a sync costs on this disk: the mean time of `samples` writes of 512 bytes to a
/// file in `dir`, each followed by `fdatasync` and preceded by `pause` of work (a busy
/// wait) after the last sync returned. With no pause, the least a durable publish waits
/// when syncs follow each other; with [`WRITER_RUN`], a sync at the writer's pace. On some
/// disks a sync soon after another is much cheaper than one after even a short pause (on
/// this project's machine: 0.04 ms within 20 µs, 0.4–1 ms after 0.1 ms or more), so the
/// back-to-back figure alone understates what the writer waits.
async fn fsync_mean(dir: &std::path::Path, samples: usize, pause: Duration) -> Duration {
    use std::io::Write;
    let path = dir.join("fsync-probe-in-a-row");
    tokio::task::spawn_blocking(move || {
        let mut file = std::fs::File::create(&path).unwrap();
        let mut syncing = Duration::ZERO;
        for _ in 0..samples {
            let worked = Instant::now();
            while worked.elapsed() < pause {
                std::hint::spin_loop();
            }
            let started = Instant::now();
            file.write_all(&[7u8; 512]).unwrap();
            file.sync_data().unwrap();
            syncing += started.elapsed();
        }
        let _ = std::fs::remove_file(path);
        syncing / samples as u32
    })
    .await
    .unwrap()
}

/// (seconds, count) herald's store has spent on publishes so far.
async fn publish_in_store(herald: &Herald) -> (f64, f64) {
    let (name, label) = (
        "herald_store_operation_duration_seconds",
        "operation=\"publish\"",
    );
    (
        herald.metric(&format!("{name}_sum"), label).await,
        herald.metric(&format!("{name}_count"), label).await,
    )
}

/// Publishes `count` events at `rate` per second, each at its own time (open loop), and
/// returns each one's publish → arrival latency (from its first request, so a 429 and the
/// wait it asks for count in).
async fn latency_at_rate(
    herald: &Herald,
    receiver: &Receiver,
    rate: f64,
    count: usize,
) -> Vec<Duration> {
    let client = reqwest::Client::new();
    let url = format!("{}/v1/namespaces/{NS}/events", herald.base);
    let before = receiver.count();
    let start = tokio::time::Instant::now() + Duration::from_millis(20);
    let tasks: Vec<_> = (0..count)
        .map(|i| {
            let (client, url) = (client.clone(), url.clone());
            let at = start + Duration::from_secs_f64(i as f64 / rate);
            tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                let id = format!("paced-{i}");
                let sent = Instant::now();
                publish(&client, &url, id.clone(), i).await;
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
            Duration::from_secs(300),
            before,
            &sent,
        )
        .await
}

/// The reference: a bare reqwest loop of `events` POSTs, CONCURRENCY at once, to the same
/// receiver with a body of the size herald sends; requests per second.
async fn bare_loop(receiver: &Receiver, events: usize) -> f64 {
    let client = reqwest::Client::new();
    let url = receiver.url("/reference");
    let body = serde_json::to_vec(&json!({"id": "evt-00000", "type": "bench.0", "timestamp": "2026-01-01T00:00:00Z", "data": {"i": 0}})).unwrap();
    let started = Instant::now();
    concurrently(events, move |_| {
        let (client, url, body) = (client.clone(), url.clone(), body.clone());
        async move {
            let status = client.post(&url).body(body).send().await.unwrap().status();
            assert!(status.is_success());
        }
    })
    .await;
    rate(events, started.elapsed())
}

fn rate(n: usize, took: Duration) -> f64 {
    n as f64 / took.as_secs_f64()
}

/// Set in the environment of this benchmark's own binary to run it as the forwarder, the
/// value being where to forward to.
const FORWARD_TO: &str = "HERALD_BENCH_FORWARD_TO";

/// A second reference: the HTTP work herald cannot avoid, with nothing else. It serves
/// publishes like herald (parses the event, answers 202 at once, before anything is stored
/// or sent) and POSTs each on to the receiver, 32 at a time like herald's lanes; no store,
/// no signature, no matching. It runs as its own process, in this session, as herald does,
/// so its end-to-end rate is what any herald could reach in this harness on this machine.
struct Forwarder {
    child: Child,
    base: String,
}

impl Forwarder {
    fn start(to: &str) -> Self {
        let mut child = Command::new(std::env::current_exe().expect("this benchmark's path"))
            .env(FORWARD_TO, to)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting the forwarder");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("the forwarder's stdout"))
            .read_line(&mut line)
            .expect("reading the forwarder's address");
        let address = line.trim();
        assert!(!address.is_empty(), "the forwarder exited before serving");
        Self {
            child,
            base: format!("http://{address}"),
        }
    }

    fn pid(&self) -> String {
        self.child.id().to_string()
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The forwarder's process: serves until killed, after printing its address.
fn forward(to: String) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let client = reqwest::Client::new();
        let lanes = Arc::new(Semaphore::new(CONCURRENCY));
        let app = axum::Router::new().route(
            "/v1/namespaces/{namespace}/events",
            axum::routing::post(move |body: axum::body::Bytes| {
                let (client, lanes, to) = (client.clone(), lanes.clone(), to.clone());
                async move {
                    let Ok(Value::Object(mut event)) = serde_json::from_slice::<Value>(&body)
                    else {
                        return (StatusCode::BAD_REQUEST, "not a JSON object").into_response();
                    };
                    let id = event.get("id").cloned().unwrap_or(Value::Null);
                    event.insert("timestamp".into(), json!("2026-01-01T00:00:00Z"));
                    let delivery = serde_json::to_vec(&event).unwrap();
                    tokio::spawn(async move {
                        let _lane = lanes.acquire().await.unwrap();
                        let sent = client.post(&to).body(delivery).send().await;
                        assert!(sent.unwrap().status().is_success(), "the receiver refused");
                    });
                    (StatusCode::ACCEPTED, axum::Json(json!({"id": id}))).into_response()
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        println!("{}", listener.local_addr().unwrap());
        axum::serve(listener, app).await.unwrap();
    });
}

fn main() {
    if let Ok(to) = std::env::var(FORWARD_TO) {
        return forward(to);
    }
    let mut report = Report::new("delivery_throughput");
    let events: usize = report.mode.pick(2_000, 20_000);
    let samples: usize = report.mode.pick(100, 1_000);
    let paced_seconds: f64 = report.mode.pick(2.0, 10.0);
    report.param("events", events);
    report.param("concurrency", CONCURRENCY);
    report.param("lanes", LANES);
    report.param("latency_samples", samples);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let receiver = Receiver::start().await;

        let cpu = cpu_seconds("self");
        let bare_before = bare_loop(&receiver, events).await;
        let bare_cpu = (cpu_seconds("self") - cpu) / events as f64;

        // herald, drain only: events stored while paused, then released.
        let herald = Herald::start(
            &manifests(&receiver, true),
            &["--egress-allow", "127.0.0.0/8", "--metrics-listen", "127.0.0.1:0"],
        );
        publish_all(&herald.base, events, 0).await;
        let before = receiver.count();
        let started = Instant::now();
        herald.write_config(&manifests(&receiver, false));
        let last = last_arrival(&receiver, "the drained deliveries", before + events).await;
        let drain = rate(events, last - started);

        // herald, end to end: publish and deliver at once.
        let herald_pid = herald.pid().expect("herald is running").to_string();
        let cpu = (cpu_seconds(&herald_pid), cpu_seconds("self"));
        let in_store_before = publish_in_store(&herald).await;
        let before = receiver.count();
        let started = Instant::now();
        publish_all(&herald.base, events, events).await;
        let published = rate(events, started.elapsed());
        let last = last_arrival(&receiver, "the end-to-end deliveries", before + events).await;
        let end_to_end = rate(events, last - started);
        let herald_cpu = (cpu_seconds(&herald_pid) - cpu.0) / events as f64;
        let in_store = {
            let ((seconds, count), (seconds0, count0)) =
                (publish_in_store(&herald).await, in_store_before);
            Duration::from_secs_f64((seconds - seconds0) / (count - count0).max(1.0))
        };
        let generator_cpu = (cpu_seconds("self") - cpu.1) / events as f64;
        // The forwarder: the same publishes end to end, then one at a time, with no store.
        let forwarder = Forwarder::start(&receiver.url("/forwarded"));
        let forwarder_pid = forwarder.pid();
        let cpu = (cpu_seconds(&forwarder_pid), cpu_seconds("self"));
        let before = receiver.count();
        let started = Instant::now();
        publish_all(&forwarder.base, events, 2 * events).await;
        let last = last_arrival(&receiver, "the forwarded deliveries", before + events).await;
        let forwarded = rate(events, last - started);
        let forwarder_cpu = (cpu_seconds(&forwarder_pid) - cpu.0) / events as f64;
        let forwarded_generator_cpu = (cpu_seconds("self") - cpu.1) / events as f64;
        let (mut forwarder_idle, _) = latency_at_idle(&forwarder.base, &receiver, samples).await;
        let (f50, f99) = (
            percentile(&mut forwarder_idle, 0.50),
            percentile(&mut forwarder_idle, 0.99),
        );
        drop(forwarder);
        // The reference again after herald's runs: its mean stands for the machine during
        // them, whatever else the machine was doing.
        let bare_after = bare_loop(&receiver, events).await;
        let bare = (bare_before + bare_after) / 2.0;
        report.param("bare_loop_before_per_s", bare_before);
        report.param("bare_loop_after_per_s", bare_after);

        let (mut idle, mut bare_rtt) = latency_at_idle(&herald.base, &receiver, samples).await;
        let (p50, p99) = (percentile(&mut idle, 0.50), percentile(&mut idle, 0.99));
        let (r50, r99) = (percentile(&mut bare_rtt, 0.50), percentile(&mut bare_rtt, 0.99));

        // Spaced: a quiet herald, and within a second after a burst; the floor is one
        // fsync after the disk has rested, measured on the same disk in the same run.
        let burst = report.mode.pick(1_000, 5_000);
        report.param("spaced_ms", SPACING.as_millis() as f64);
        report.param("spaced_burst", burst);
        let mut quiet = latency_spaced(&herald.base, &receiver, samples, None, 10_000_000).await;
        let mut after_burst =
            latency_spaced(&herald.base, &receiver, samples, Some(burst), 20_000_000).await;
        let mut fsync = fsync_spaced(&herald.dir, samples).await;
        let fsync_in_a_row = fsync_mean(&herald.dir, samples, Duration::ZERO).await;
        let fsync_at_writer_pace = fsync_mean(&herald.dir, samples, WRITER_RUN).await;
        let (q50, q99) = (percentile(&mut quiet, 0.50), percentile(&mut quiet, 0.99));
        let (b50, b99) = (
            percentile(&mut after_burst, 0.50),
            percentile(&mut after_burst, 0.99),
        );
        let (s50, s99) = (percentile(&mut fsync, 0.50), percentile(&mut fsync, 0.99));

        let paced_rate = end_to_end / 2.0;
        let count = (paced_rate * paced_seconds).ceil() as usize;
        report.param("paced_rate_per_s", paced_rate);
        report.param("paced_events", count);
        let busy_before = BUSY.load(Ordering::Relaxed);
        let mut paced = latency_at_rate(&herald, &receiver, paced_rate, count).await;
        let (h50, h99) = (percentile(&mut paced, 0.50), percentile(&mut paced, 0.99));
        let busy = BUSY.load(Ordering::Relaxed);
        report.param("publish_busy_429_paced", busy - busy_before);
        report.param("publish_busy_429_total", busy);

        let n = thousands(events);
        let bare_name = format!(
            "bare reqwest POST loop, {CONCURRENCY} concurrent, same receiver (mean of one run before herald's and one after)"
        );
        report
            .add("throughput.drain", &format!("drain: {n} stored events released at once"), drain, "events/s")
            .reference(&bare_name, bare);
        report
            .add("throughput.publish", &format!("durable publish: {n} events, {CONCURRENCY} producers"), published, "events/s")
            .reference(&bare_name, bare);
        report
            .add("throughput.end_to_end", &format!("end to end: {n} events published and delivered"), end_to_end, "events/s")
            .reference(&bare_name, bare)
            .target(Target::RatioAtLeast(0.5));
        let forwarder_name = "end to end through the store-less forwarder, same run";
        report
            .add("throughput.forwarder", &format!("end to end through a forwarder with no store (each publish answered at once and POSTed on, {CONCURRENCY} at a time): {n} events"), forwarded, "events/s")
            .reference(&bare_name, bare);
        report
            .add("throughput.end_to_end_vs_forwarder", &format!("end to end: herald, {n} events"), end_to_end, "events/s")
            .reference(forwarder_name, forwarded);
        // Where the floor is: on a machine whose cores the reference loop already keeps busy,
        // the end-to-end rate cannot exceed the reference rate × (CPU per reference request)
        // / (CPU per delivered event, herald's and the load generator's together).
        let us = |seconds: f64| seconds * 1e6;
        report
            .add("cpu.end_to_end.herald", "CPU per event end to end: herald (publish, store, delivery)", us(herald_cpu), "µs")
            .reference("CPU per request of the bare loop (client and receiver together)", us(bare_cpu));
        report
            .add("cpu.end_to_end.generator", "CPU per event end to end: the load generator (32 producers and the receiver)", us(generator_cpu), "µs")
            .reference("CPU per request of the bare loop (client and receiver together)", us(bare_cpu));
        report
            .add("cpu.end_to_end.forwarder", "CPU per event end to end: the store-less forwarder", us(forwarder_cpu), "µs")
            .reference("CPU per request of the bare loop (client and receiver together)", us(bare_cpu));
        // The machine's ceiling: every core busy with herald and the load generator, nothing
        // waiting. Above it no change to how herald waits can go; only less CPU per event.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        report
            .add("throughput.end_to_end_ceiling", &format!("end to end ceiling on this machine: its {cores} cores over the CPU per event of herald and the load generator together (everything busy, nothing waiting)"), cores / (herald_cpu + generator_cpu), "events/s")
            .reference(forwarder_name, forwarded);
        // What 0.6 × the forwarder would leave herald: the cores over that rate, less what the
        // load generator spends per event at the forwarder's (higher) rate, its lowest.
        report
            .add("cpu.end_to_end.herald_budget", "CPU per event herald could spend at 0.6 × the forwarder's rate: the cores over that rate, less the load generator's CPU per event while it drove the forwarder", us(cores / (0.6 * forwarded) - forwarded_generator_cpu), "µs")
            .reference("herald's CPU per event end to end, same run", us(herald_cpu));
        // Where the wait is: with every producer always waiting on one publish, a publish's
        // round trip is the producers over the rate (Little's law). herald's adds the time a
        // publish spends in the store (queued, its transaction, the commit and its sync, and
        // the wait for a runtime worker to take the answer: the metric times the whole call)
        // to what the forwarder does. A durable store waits at least one sync a publish.
        let round_trip = |rate: f64| CONCURRENCY as f64 / rate;
        let secs = |d: Duration| d.as_secs_f64();
        report
            .add("wait.end_to_end.round_trip", &format!("a publish's round trip during end to end ({CONCURRENCY} producers over the rate)"), ms(Duration::from_secs_f64(round_trip(end_to_end))), "ms")
            .reference("the same through the store-less forwarder, same run", ms(Duration::from_secs_f64(round_trip(forwarded))));
        report
            .add("wait.end_to_end.in_store", "a publish's time in the store during end to end, mean (herald_store_operation_duration_seconds, operation publish: queued, run, committed and synced)", ms(in_store), "ms")
            .reference("fdatasync of 512 bytes on the store's disk, back to back, mean, same run", ms(fsync_in_a_row));
        report
            .add("throughput.end_to_end_store_bound", "end to end if herald did the forwarder's work and waited for its store as it does: producers over (the forwarder's round trip + a publish's time in the store)", CONCURRENCY as f64 / (round_trip(forwarded) + secs(in_store)), "events/s")
            .reference(forwarder_name, forwarded);
        report
            .add("throughput.end_to_end_sync_bound", "end to end if herald did the forwarder's work and its store waited for one sync only: producers over (the forwarder's round trip + one back-to-back fdatasync)", CONCURRENCY as f64 / (round_trip(forwarded) + secs(fsync_in_a_row)), "events/s")
            .reference(forwarder_name, forwarded);
        let pace = format!("{} ms", WRITER_RUN.as_secs_f64() * 1e3);
        report
            .add("wait.sync_at_writer_pace", &format!("fdatasync of 512 bytes on the store's disk, each after {pace} of work (as the store writer runs a group between its syncs), mean"), ms(fsync_at_writer_pace), "ms")
            .reference("the same back to back, mean, same run", ms(fsync_in_a_row));
        report
            .add("throughput.end_to_end_paced_sync_bound", &format!("end to end if herald did the forwarder's work and its store waited for one sync only, synced at the writer's pace: producers over (the forwarder's round trip + one fdatasync after {pace} of work)"), CONCURRENCY as f64 / (round_trip(forwarded) + secs(fsync_at_writer_pace)), "events/s")
            .reference(forwarder_name, forwarded);
        report
            .add("latency.idle.p50", &format!("latency at idle, publish → arrival p50 ({} events one at a time)", thousands(samples)), ms(p50), "ms")
            .reference("bare POST round trip p50", ms(r50))
            .target(Target::AtMost(2.0));
        report
            .add("latency.idle.p99", &format!("latency at idle, publish → arrival p99 ({} events one at a time)", thousands(samples)), ms(p99), "ms")
            .reference("bare POST round trip p99", ms(r99))
            .target(Target::AtMost(10.0));
        report
            .add("latency.idle_forwarder.p50", &format!("latency at idle through the store-less forwarder p50 ({} events one at a time)", thousands(samples)), ms(f50), "ms")
            .reference("bare POST round trip p50", ms(r50));
        report
            .add("latency.idle_forwarder.p99", &format!("latency at idle through the store-less forwarder p99 ({} events one at a time)", thousands(samples)), ms(f99), "ms")
            .reference("bare POST round trip p99", ms(r99));
        let spaced = SPACING.as_millis();
        let fsync_name = |q: &str| {
            format!("fdatasync of 512 bytes on the store's disk, {spaced} ms apart, {q}, same run")
        };
        report
            .add("latency.spaced_quiet.p50", &format!("latency spaced {spaced} ms apart on a quiet herald, publish → arrival p50 ({} events)", thousands(samples)), ms(q50), "ms")
            .reference(&fsync_name("p50"), ms(s50))
            .target(Target::AtMost(1.5));
        report
            .add("latency.spaced_quiet.p99", &format!("latency spaced {spaced} ms apart on a quiet herald, publish → arrival p99 ({} events)", thousands(samples)), ms(q99), "ms")
            .reference(&fsync_name("p99"), ms(s99))
            .target(Target::AtMost(5.0));
        report
            .add("latency.spaced_after_burst.p50", &format!("latency spaced {spaced} ms apart within a second after a burst of {} events, publish → arrival p50 ({} events)", thousands(burst), thousands(samples)), ms(b50), "ms")
            .reference(&fsync_name("p50"), ms(s50))
            .target(Target::AtMost(1.5));
        report
            .add("latency.spaced_after_burst.p99", &format!("latency spaced {spaced} ms apart within a second after a burst of {} events, publish → arrival p99 ({} events)", thousands(burst), thousands(samples)), ms(b99), "ms")
            .reference(&fsync_name("p99"), ms(s99))
            .target(Target::AtMost(5.0));
        let paced_label = format!(
            "publish → arrival at half the end-to-end rate ({} events at {paced_rate:.0}/s; {} answered 429 publish_busy and were sent again after Retry-After)",
            thousands(count),
            thousands(busy - busy_before)
        );
        report
            .add("latency.half_load.p50", &format!("{paced_label} p50"), ms(h50), "ms")
            .reference("latency at idle p50, same run", ms(p50));
        report
            .add("latency.half_load.p99", &format!("{paced_label} p99"), ms(h99), "ms")
            .reference("latency at idle p99, same run", ms(p99));
    });
    report.finish();
}
