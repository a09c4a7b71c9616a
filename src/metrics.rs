//! Prometheus metrics, served on the health port's `/metrics`. Names and help follow the
//! Prometheus conventions (`_total` for counters, `_seconds` in base units). Labels are
//! bounded: a namespace, an outcome, an operation; never an event. Per-subscription labels
//! exist only behind `--metrics-subscription-labels`, as separate metrics.
//!
//! Counters and histograms are updated where things happen (one process-wide set, so the
//! engine, the store and the controller need no handle passed down); gauges that describe
//! state (pending and in-flight attempts, quota waits) are read from the engine when scraped.

use std::sync::LazyLock;
use std::sync::atomic::{AtomicBool, Ordering};

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

/// Latency buckets for attempts and store operations, in seconds: 0.5 ms to 60 s.
const BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];

pub struct Metrics {
    registry: Registry,
    pub attempts: IntCounterVec,
    pub attempt_duration: HistogramVec,
    pub dead_letters: IntCounterVec,
    pub auto_disabled: IntCounterVec,
    pub purged: IntCounterVec,
    pub published: IntCounterVec,
    pub store_duration: HistogramVec,
    pub reconciles: IntCounterVec,
    pub reconcile_duration: Histogram,
    pub status_writes: IntCounter,
    /// TokenReviews and SubjectAccessReviews herald sent, by answer.
    pub access_reviews: IntCounterVec,
    /// Ingest requests refused because their client address failed to authenticate too often.
    pub auth_throttled: IntCounter,
    /// With several replicas: 1 for each shard this replica holds, 0 for the others.
    pub shard_owned: IntGaugeVec,
    /// Only filled with --metrics-subscription-labels.
    pub subscription_attempts: IntCounterVec,
    subscription_labels: AtomicBool,
}

fn counter(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("a valid metric")
}

fn histogram(name: &str, help: &str, labels: &[&str]) -> HistogramVec {
    HistogramVec::new(
        HistogramOpts::new(name, help).buckets(BUCKETS.to_vec()),
        labels,
    )
    .expect("a valid metric")
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    let metrics = Metrics {
        registry: Registry::new(),
        attempts: counter(
            "herald_attempts_total",
            "Delivery attempts finished, by outcome: accepted (2xx), transient (retried), terminal (dead-lettered at once), gone (410: dead-lettered, and the subscription disabled) or refused (the egress guard stopped it before sending).",
            &["namespace", "outcome"],
        ),
        attempt_duration: histogram(
            "herald_attempt_duration_seconds",
            "Time from the start of a delivery attempt's request to the end of its response.",
            &["namespace"],
        ),
        dead_letters: counter(
            "herald_dead_letters_total",
            "Deliveries given up on and kept as dead letters.",
            &["namespace"],
        ),
        auto_disabled: counter(
            "herald_auto_disabled_total",
            "Subscriptions disabled after consecutive failed attempts, or at once by a 410 Gone.",
            &["namespace"],
        ),
        purged: counter(
            "herald_purged_attempts_total",
            "Pending attempts purged because their subscription was deleted.",
            &["namespace"],
        ),
        published: counter(
            "herald_events_published_total",
            "Events accepted by the ingest API (a repeated id counts once); events for a namespace where no subscription lives are counted under namespace=\"\".",
            &["namespace"],
        ),
        store_duration: histogram(
            "herald_store_operation_duration_seconds",
            "Time a store operation took, commit included.",
            &["operation"],
        ),
        reconciles: counter(
            "herald_reconcile_total",
            "Reconciles of WebhookSubscriptions, by result (ok or error).",
            &["result"],
        ),
        reconcile_duration: Histogram::with_opts(
            HistogramOpts::new(
                "herald_reconcile_duration_seconds",
                "Time one reconcile of a WebhookSubscription took.",
            )
            .buckets(BUCKETS.to_vec()),
        )
        .expect("a valid metric"),
        status_writes: IntCounter::new(
            "herald_status_writes_total",
            "Status writes made to WebhookSubscriptions.",
        )
        .expect("a valid metric"),
        access_reviews: counter(
            "herald_access_reviews_total",
            "Reviews herald asked the API server for (cluster mode): review=token (authenticated, unauthenticated, error) or subject_access (allowed, denied, error). Cached answers are not counted.",
            &["review", "result"],
        ),
        auth_throttled: IntCounter::new(
            "herald_auth_throttled_total",
            "Ingest requests answered 429 because their client address failed to authenticate too often (cluster mode).",
        )
        .expect("a valid metric"),
        shard_owned: IntGaugeVec::new(
            Opts::new(
                "herald_shard_owned",
                "1 for each shard this replica holds a Lease for and may deliver for (only with --shard-leases).",
            ),
            &["shard"],
        )
        .expect("a valid metric"),
        subscription_attempts: counter(
            "herald_subscription_attempts_total",
            "Delivery attempts finished per subscription, by outcome (only with --metrics-subscription-labels).",
            &["namespace", "subscription", "outcome"],
        ),
        subscription_labels: AtomicBool::new(false),
    };
    let registry = &metrics.registry;
    for collector in [
        Box::new(metrics.attempts.clone()) as Box<dyn prometheus::core::Collector>,
        Box::new(metrics.attempt_duration.clone()),
        Box::new(metrics.dead_letters.clone()),
        Box::new(metrics.auto_disabled.clone()),
        Box::new(metrics.purged.clone()),
        Box::new(metrics.published.clone()),
        Box::new(metrics.store_duration.clone()),
        Box::new(metrics.reconciles.clone()),
        Box::new(metrics.reconcile_duration.clone()),
        Box::new(metrics.status_writes.clone()),
        Box::new(metrics.access_reviews.clone()),
        Box::new(metrics.auth_throttled.clone()),
        Box::new(metrics.shard_owned.clone()),
    ] {
        registry
            .register(collector)
            .expect("metric names are unique");
    }
    metrics
});

/// herald's metrics.
pub fn get() -> &'static Metrics {
    &METRICS
}

impl Metrics {
    /// Adds per-subscription metrics (`--metrics-subscription-labels`).
    pub fn enable_subscription_labels(&self) {
        if !self.subscription_labels.swap(true, Ordering::AcqRel) {
            let _ = self
                .registry
                .register(Box::new(self.subscription_attempts.clone()));
        }
    }

    pub fn subscription_labels(&self) -> bool {
        self.subscription_labels.load(Ordering::Acquire)
    }
}

/// Every metric name herald can export (the snapshot gauges included), for checks such as
/// "every dashboard query names a real metric".
pub fn names() -> Vec<String> {
    use prometheus::core::Collector;
    let metrics = get();
    let mut names: Vec<String> = [
        &metrics.attempts as &dyn Collector,
        &metrics.attempt_duration,
        &metrics.dead_letters,
        &metrics.auto_disabled,
        &metrics.purged,
        &metrics.published,
        &metrics.store_duration,
        &metrics.reconciles,
        &metrics.reconcile_duration,
        &metrics.status_writes,
        &metrics.access_reviews,
        &metrics.auth_throttled,
        &metrics.shard_owned,
        &metrics.subscription_attempts,
    ]
    .iter()
    .flat_map(|c| c.desc().into_iter().map(|d| d.fq_name.clone()))
    .collect();
    names.extend(
        [
            "herald_pending_attempts",
            "herald_in_flight_attempts",
            "herald_quota_waits_total",
        ]
        .map(String::from),
    );
    names
}

/// State read at scrape time, per namespace.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// (namespace, pending attempts, attempts in flight, quota waits so far)
    pub namespaces: Vec<(String, u64, u64, u64)>,
}

/// The text exposition of every metric, with the snapshot's gauges.
pub fn render(snapshot: &Snapshot) -> String {
    let pending = IntGaugeVec::new(
        Opts::new(
            "herald_pending_attempts",
            "Attempts waiting in the store (due now or scheduled for retry).",
        ),
        &["namespace"],
    )
    .expect("a valid metric");
    let in_flight = IntGaugeVec::new(
        Opts::new("herald_in_flight_attempts", "Attempts on the wire now."),
        &["namespace"],
    )
    .expect("a valid metric");
    let waits = counter(
        "herald_quota_waits_total",
        "Times a subscription's attempt had to wait because its namespace was at its in-flight quota.",
        &["namespace"],
    );
    for (namespace, p, f, w) in &snapshot.namespaces {
        pending.with_label_values(&[namespace]).set(*p as i64);
        in_flight.with_label_values(&[namespace]).set(*f as i64);
        waits.with_label_values(&[namespace]).inc_by(*w);
    }
    let mut families = METRICS.registry.gather();
    families.extend(prometheus::core::Collector::collect(&pending));
    families.extend(prometheus::core::Collector::collect(&in_flight));
    families.extend(prometheus::core::Collector::collect(&waits));
    families.sort_by(|a, b| a.name().cmp(b.name()));
    let mut out = Vec::new();
    if let Err(e) = TextEncoder::new().encode(&families, &mut out) {
        tracing::warn!(error = %e, "encoding metrics");
    }
    String::from_utf8(out).unwrap_or_default()
}
