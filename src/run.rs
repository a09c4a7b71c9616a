//! `herald run` and `herald receive`: the long-running commands.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use tracing_subscriber::EnvFilter;

use crate::api::SigningScheme;
use crate::cli::{LogFormat, ReceiveArgs, RunArgs};
use crate::delivery::egress::EgressPolicy;
use crate::delivery::http::HttpSender;
use crate::delivery::{Engine, EngineConfig};
use crate::ingest::{self, auth::StaticToken};
use crate::signing::{DEFAULT_TOLERANCE, Signer};
use crate::store::Store;
use crate::store::postgres::PostgresStore;
use crate::store::sqlite::SqliteStore;
use crate::store::timed::Timed;

impl RunArgs {
    fn replica_identity(&self) -> String {
        self.replica_id
            .clone()
            .or_else(|| self.pod_name.clone())
            .unwrap_or_else(|| {
                let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .map(|h| h.trim().to_string())
                    .unwrap_or_else(|_| "herald".into());
                format!("{host}-{}", std::process::id())
            })
    }

    /// Which store herald uses, for logs (a URL without its password).
    fn store_description(&self) -> String {
        match &self.store {
            Some(url) => url.to_string(),
            None => format!("SQLite in {}", self.data_dir.display()),
        }
    }

    async fn engine(&self) -> anyhow::Result<Arc<Engine>> {
        let store: Arc<dyn Store> = match &self.store {
            Some(url) => {
                tracing::info!(store = %url, "connecting to the PostgreSQL store");
                let store = PostgresStore::connect(url.expose())
                    .await
                    .with_context(|| format!("the PostgreSQL store at {url}"))?;
                Arc::new(Timed(store))
            }
            None => {
                check_data_dir(&self.data_dir)?;
                Arc::new(Timed(SqliteStore::open(&self.data_dir)?))
            }
        };
        let extra_roots = match &self.egress_ca_file {
            Some(path) => {
                let roots = crate::tls::read_ca_certificates(path).context("--egress-ca-file")?;
                tracing::info!(file = %path.display(), certificates = roots.len(), "receivers' certificates may also be issued by these CAs");
                roots
            }
            None => Vec::new(),
        };
        let sender = HttpSender::with_extra_roots(
            EgressPolicy::new(self.egress_allow.clone())
                .with_cluster_ranges(self.cluster_cidr.clone()),
            extra_roots,
        )?;
        Ok(Engine::new(
            store,
            sender,
            EngineConfig {
                max_in_flight: self.max_in_flight,
                namespace_reserved_in_flight: self.namespace_reserved_in_flight,
                namespace_max_concurrent_publishes: self.namespace_max_concurrent_publishes,
                namespace_max_in_flight: self.namespace_max_in_flight,
                namespace_max_pending: self.namespace_max_pending,
                namespace_max_stored_bytes: self.namespace_max_stored_bytes,
                store_reserve_bytes: self.store_reserve_bytes,
                history_retention: Duration::from_secs(self.history_retention_hours * 3600),
            },
        ))
    }
}

impl RunArgs {
    /// The ingest listener's limits, its connection bound fitted to the descriptor limit.
    fn ingest_limits(&self) -> ingest::listener::Limits {
        ingest::listener::Limits {
            header_read: self.ingest_header_timeout,
            body_read: self.ingest_body_timeout,
            max_connections: usize::try_from(self.ingest_max_connections).unwrap_or(usize::MAX),
        }
        .fitted(self.max_in_flight)
    }

    /// How often the standalone config folder is polled (None: only on SIGHUP).
    fn config_poll(&self) -> Option<Duration> {
        (self.config_poll_ms > 0).then(|| Duration::from_millis(self.config_poll_ms))
    }

    /// The ingest API's TLS acceptor when --tls-cert-file and --tls-key-file are given: the
    /// pair is loaded (any problem stops the start) and its files watched for changes.
    fn ingest_tls(&self) -> anyhow::Result<Option<tokio_rustls::TlsAcceptor>> {
        let (Some(cert), Some(key)) = (&self.tls_cert_file, &self.tls_key_file) else {
            return Ok(None);
        };
        let tls = Arc::new(crate::tls::IngestTls::load(cert, key)?);
        let acceptor = tls.acceptor()?;
        tokio::spawn(tls.watch(self.ingest_tls_reload_interval));
        Ok(Some(acceptor))
    }
}

/// The ingest API's URL as logged and written to the ready file.
fn ingest_url(address: SocketAddr, tls: bool) -> String {
    if tls {
        format!("https://{address}")
    } else {
        format!("http://{address}")
    }
}

/// Logs go to standard error. The level comes from `level` (a tracing filter such as
/// `info` or `herald=debug`), else RUST_LOG, else info.
fn init_logging(format: LogFormat, level: Option<&str>) {
    let filter = level
        .and_then(|l| EnvFilter::try_new(l).ok())
        .or_else(|| EnvFilter::try_from_default_env().ok())
        .unwrap_or_else(|| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder.json().with_current_span(true).try_init(),
        // Colour only for a person at a terminal, never into log files.
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
    };
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    init_logging(args.log_format, args.log_level.as_deref());
    if args.metrics_subscription_labels {
        crate::metrics::get().enable_subscription_labels();
    }
    let nofile = ingest::listener::raise_nofile_limit();
    tracing::debug!(?nofile, "open-file limit");
    let spans = args.otlp_endpoint.as_ref().map(span_exporter).transpose()?;
    let ran = if args.standalone {
        let config_dir = args
            .config
            .clone()
            .context("standalone mode needs --config DIR (a folder of manifests)")?;
        runtime()?.block_on(run_standalone(args, config_dir))
    } else {
        runtime()?.block_on(run_cluster(args))
    };
    // The spans of the last attempts go out before the process ends.
    if let Some(provider) = spans
        && let Err(e) = provider.shutdown()
    {
        tracing::warn!(error = %e, "the last attempt spans could not be exported");
    }
    ran
}

/// Installs the tracer provider that exports attempt spans (see [`crate::delivery::trace`])
/// to `endpoint` over OTLP/HTTP, in batches on a thread of its own, each export bounded by
/// a timeout.
fn span_exporter(
    endpoint: &url::Url,
) -> anyhow::Result<opentelemetry_sdk::trace::SdkTracerProvider> {
    use opentelemetry_otlp::WithExportConfig;
    // The exporter's HTTP client is built here, and needs the TLS provider herald uses.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(endpoint.as_str())
        .with_timeout(Duration::from_secs(10))
        .build()
        .with_context(|| format!("the OTLP exporter for {endpoint}"))?;
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name("herald")
                .build(),
        )
        .build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    tracing::info!(%endpoint, "attempt spans exported over OTLP");
    Ok(provider)
}

/// Resolves on SIGTERM or SIGINT.
async fn terminated() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        Some(()) = async { match term.as_mut() { Some(t) => t.recv().await, None => std::future::pending().await } } => {}
    }
}

/// Ready for traffic once nothing is waited for.
#[derive(Default)]
pub struct Readiness {
    waiting: std::sync::Mutex<Vec<&'static str>>,
}

impl Readiness {
    fn waiting(&self) -> std::sync::MutexGuard<'_, Vec<&'static str>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn waiting_for(&self, what: &'static str) {
        self.waiting().push(what);
    }
    fn done(&self, what: &str) {
        self.waiting().retain(|w| *w != what);
    }
}

/// /healthz, /readyz and /metrics: what the metrics port serves.
fn metrics_router(readiness: Arc<Readiness>, engine: Arc<Engine>) -> axum::Router {
    let metrics_engine = engine.clone();
    health_router(readiness, engine).route(
        "/metrics",
        axum::routing::get(move || async move {
            (
                [(
                    axum::http::header::CONTENT_TYPE,
                    "text/plain; version=0.0.4; charset=utf-8",
                )],
                crate::metrics::render(&metrics_engine.metrics_snapshot()),
            )
        }),
    )
}

/// /healthz (the process serves) and /readyz (the store can commit and, in cluster mode,
/// every watch has its first full list, and every subscription listed has been reconciled).
fn health_router(readiness: Arc<Readiness>, engine: Arc<Engine>) -> axum::Router {
    axum::Router::new()
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .route(
            "/readyz",
            axum::routing::get(move || async move {
                let waiting = readiness.waiting().join(", ");
                if !engine.store_healthy().await {
                    (
                        StatusCode::SERVICE_UNAVAILABLE,
                        "not ready: the store cannot commit (disk full? PostgreSQL unreachable?)"
                            .to_string(),
                    )
                } else if waiting.is_empty() {
                    (StatusCode::OK, "ok".to_string())
                } else {
                    (
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("not ready: waiting for the first full list of {waiting}"),
                    )
                }
            }),
        )
}

/// Line 1: the ingest API (its address, or `https://` and its address when it serves TLS);
/// line 2, when served: the address of /healthz, /readyz and /metrics.
fn write_ready_file(path: &std::path::Path, lines: &[String]) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, lines.join("\n"))?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Every API request herald makes (reads, writes, reviews, Leases) fails after this without
/// an answer, and is retried by its caller; watches are exempt (a watch is quiet for minutes
/// by design, and kube's watcher has an idle timeout of its own).
pub const API_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Two clients of the same cluster: one for requests, each bounded by
/// [`API_REQUEST_TIMEOUT`], and one for watches.
async fn kube_clients(args: &RunArgs) -> anyhow::Result<(kube::Client, kube::Client)> {
    let config = kube_config(args).await?;
    let watches = kube::Client::try_from(config.clone())?;
    let mut requests = config;
    requests.read_timeout = Some(API_REQUEST_TIMEOUT);
    // Counted from each request, not from when its pooled connection went idle.
    requests.reset_reader_on_write = true;
    requests.write_timeout = requests.write_timeout.or(Some(API_REQUEST_TIMEOUT));
    requests.connect_timeout = requests.connect_timeout.or(Some(API_REQUEST_TIMEOUT));
    // kube retries a 429, 503 or 504 by itself up to 15 times with a backoff of up to
    // 1,000 s, past any per-request bound; herald's callers retry on their own terms (a
    // publish's review answers 503 at once, a reconcile is requeued).
    requests.default_retry = false;
    Ok((kube::Client::try_from(requests)?, watches))
}

async fn kube_config(args: &RunArgs) -> anyhow::Result<kube::Config> {
    let config = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?
        }
        None => kube::Config::infer().await.context(
            "no cluster credentials: pass --kubeconfig, set KUBECONFIG, or run in a pod",
        )?,
    };
    Ok(config)
}

async fn run_cluster(args: RunArgs) -> anyhow::Result<()> {
    use crate::controller::{
        access_review::KubeAuthorizer,
        reconcile::Context,
        shard_leases::{LeaseConfig, ShardLeases},
        status::StatusWriter,
        watch,
    };
    use crate::delivery::shards::Ownership;
    if args.shard_leases && args.store.is_none() {
        anyhow::bail!(
            "--shard-leases shares the store between replicas: it needs --store postgres://… (HERALD_STORE); the embedded SQLite store belongs to one process"
        );
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let tls = args.ingest_tls()?;
    let (client, watch_client) = kube_clients(&args).await?;
    let engine = args.engine().await?;
    let scope = watch::Scope(args.watch_namespaces.clone());
    let readiness = Arc::new(Readiness::default());
    readiness.waiting_for("subscriptions");
    readiness.waiting_for("quotas");

    // Health first, so a probe sees "not ready" rather than nothing while herald starts.
    let health_address = args.metrics_listen.unwrap_or(([0, 0, 0, 0], 9090).into());
    let health = tokio::net::TcpListener::bind(health_address)
        .await
        .with_context(|| format!("listening on {health_address}"))?;
    let health_address = health.local_addr()?;
    tokio::spawn(
        axum::serve(health, metrics_router(readiness.clone(), engine.clone())).into_future(),
    );

    // Subscriptions deleted while herald was down are purged before anything is dispatched;
    // until the API server answers, nothing is.
    let mut delay = Duration::from_millis(500);
    loop {
        match watch::purge_deleted_while_down(&client, &engine, &scope).await {
            Ok(removed) => {
                tracing::info!(removed, "start-up purge done");
                break;
            }
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "cannot list WebhookSubscriptions yet; nothing is dispatched until then");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(10));
            }
        }
    }
    let leases = args.shard_leases.then(|| {
        let ownership = Arc::new(Ownership::new(args.shards));
        engine.share_by_shards(ownership.clone());
        let seconds = args.shard_lease_seconds;
        let config = LeaseConfig {
            namespace: args.lease_namespace.clone(),
            identity: args.replica_identity(),
            duration: Duration::from_secs(seconds),
            renew_every: Duration::from_millis(seconds * 1000 / 3),
            margin: Duration::from_millis(seconds * 1000 / 3),
        };
        tracing::info!(identity = %config.identity, shards = args.shards, namespace = %config.namespace, "sharing the store: delivering only for shards this replica holds");
        Arc::new(ShardLeases::new(client.clone(), config, ownership, engine.clone()))
    });
    engine.recover().await?;
    engine.spawn();
    if let Some(leases) = &leases {
        let leases = leases.clone();
        tokio::spawn(async move { leases.run().await });
    }
    tokio::spawn(log_notices(engine.clone()));

    let status = StatusWriter::new(
        client.clone(),
        engine.clone(),
        Duration::from_secs(args.status_interval_seconds),
        args.pod_name.clone(),
    );
    status.spawn();
    let ctx = Arc::new(Context {
        client: client.clone(),
        engine: engine.clone(),
        status,
        secrets: Default::default(),
    });
    let scopes = if scope.0.is_empty() { 1 } else { scope.0.len() };
    let (subs_synced, subs_rx) = tokio::sync::mpsc::unbounded_channel();
    let (quotas_synced, quotas_rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(watch::run_subscriptions(
        ctx,
        watch_client.clone(),
        scope.clone(),
        16,
        subs_synced,
    ));
    tokio::spawn(watch::run_quotas(
        client.clone(),
        watch_client,
        engine.clone(),
        scope,
        quotas_synced,
    ));
    // Ready once every watch (one per watched namespace) has had its first full list.
    for (what, mut rx) in [("subscriptions", subs_rx), ("quotas", quotas_rx)] {
        let readiness = readiness.clone();
        tokio::spawn(async move {
            for _ in 0..scopes {
                if rx.recv().await.is_none() {
                    tracing::error!(what, "a watch stopped before its first full list");
                    return;
                }
            }
            tracing::info!(what, "watches have their first full list");
            readiness.done(what);
        });
    }

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    let address = listener.local_addr()?;
    let url = ingest_url(address, tls.is_some());
    tracing::info!(%address, %url, health = %health_address, store = %args.store_description(), "herald is serving (cluster mode)");
    let first = if tls.is_some() {
        url
    } else {
        address.to_string()
    };
    // The ready file: the ingest API, the health port, and the aggregated API when served.
    let mut ready_lines = vec![first, health_address.to_string()];
    let aggregated = match args.aggregated_listen {
        Some(address) => {
            let listener = tokio::net::TcpListener::bind(address)
                .await
                .with_context(|| format!("--aggregated-listen {address}"))?;
            let (Some(cert), Some(key)) = (
                &args.aggregated_tls_cert_file,
                &args.aggregated_tls_key_file,
            ) else {
                anyhow::bail!(
                    "--aggregated-listen needs --aggregated-tls-cert-file and --aggregated-tls-key-file"
                );
            };
            let tls = Arc::new(crate::tls::IngestTls::load_for(
                "aggregated",
                ["--aggregated-tls-cert-file", "--aggregated-tls-key-file"],
                cert,
                key,
            )?);
            tokio::spawn(tls.clone().watch(args.ingest_tls_reload_interval));
            ready_lines.push(format!("https://{}", listener.local_addr()?));
            Some(tokio::spawn(crate::aggregated::serve(
                listener,
                engine.clone(),
                args.max_body_bytes,
                client.clone(),
                tls.resolver(),
                args.ingest_limits(),
                terminated(),
            )))
        }
        None => None,
    };
    if let Some(path) = &args.ready_file {
        write_ready_file(path, &ready_lines)?;
    }
    let app = ingest::router(ingest::Api {
        engine: engine.clone(),
        auth: Arc::new(KubeAuthorizer::new(client, args.token_audience.clone())),
        max_body: args.max_body_bytes,
    });
    let limits = args.ingest_limits();
    // A graceful stop: take no more shards (those held stay renewed), drain, and only then
    // release the shards. Released first, another replica would take them, make the
    // attempts still on the wire due again, and send them a second time.
    let signalled = async {
        terminated().await;
        if let Some(leases) = &leases {
            leases.stop_taking();
        }
    };
    ingest::listener::serve(listener, app, limits, tls, signalled).await?;
    // Publishes in progress on the aggregated API finish before the engine drains.
    if let Some(aggregated) = aggregated {
        match aggregated.await {
            Ok(Err(e)) => tracing::warn!(error = %e, "the aggregated API stopped with an error"),
            Err(e) => tracing::warn!(error = %e, "the aggregated API's task failed"),
            Ok(Ok(())) => {}
        }
    }
    stop(&engine, args.shutdown_timeout_seconds).await;
    if let Some(leases) = &leases {
        leases.release_all().await;
    }
    Ok(())
}

/// The graceful stop after SIGTERM: no new attempt, those on the wire get the deadline.
async fn stop(engine: &Engine, timeout_seconds: u64) {
    tracing::info!(
        timeout_seconds,
        "stopping: no new attempts; waiting for those on the wire"
    );
    let left = engine.drain(Duration::from_secs(timeout_seconds)).await;
    if left > 0 {
        tracing::warn!(
            left,
            "attempts still on the wire at the deadline; they are made again after the next start"
        );
    }
    tracing::info!("stopped");
}

async fn run_standalone(args: RunArgs, config_dir: PathBuf) -> anyhow::Result<()> {
    if args.aggregated_listen.is_some() {
        anyhow::bail!(
            "--aggregated-listen serves behind a Kubernetes API server: it needs cluster mode, not --standalone"
        );
    }
    let tls = args.ingest_tls()?;
    let engine = args.engine().await?;

    // Configuration first, so that removals made while herald was down are purged before
    // anything is dispatched; then recovery; then delivery.
    let mut sync =
        crate::standalone::FolderSync::new(engine.clone(), config_dir.clone(), args.config_poll())
            .await?;
    sync.apply()
        .await
        .with_context(|| format!("loading {}", config_dir.display()))?;
    engine.recover().await?;
    engine.spawn();
    tokio::spawn(sync.watch());
    tokio::spawn(log_notices(engine.clone()));

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    let address = listener.local_addr()?;
    let url = ingest_url(address, tls.is_some());
    tracing::info!(%address, %url, store = %args.store_description(), config = %config_dir.display(), "herald is serving");
    ingest::listener::warn_if_exposed(address, args.publish_token.is_some());
    let readiness = Arc::new(Readiness::default());
    let mut announced = vec![if tls.is_some() {
        url
    } else {
        address.to_string()
    }];
    if let Some(health_address) = args.metrics_listen {
        let health = tokio::net::TcpListener::bind(health_address)
            .await
            .with_context(|| format!("listening on {health_address}"))?;
        announced.push(health.local_addr()?.to_string());
        tokio::spawn(
            axum::serve(health, metrics_router(readiness.clone(), engine.clone())).into_future(),
        );
    }
    if let Some(path) = &args.ready_file {
        write_ready_file(path, &announced)?;
    }
    // Standalone keeps /healthz and /readyz on the ingest port too, where it always had them.
    let app = ingest::router(ingest::Api {
        engine: engine.clone(),
        auth: Arc::new(StaticToken(args.publish_token.clone())),
        max_body: args.max_body_bytes,
    })
    .merge(health_router(readiness, engine.clone()));
    let limits = args.ingest_limits();
    ingest::listener::serve(listener, app, limits, tls, terminated()).await?;
    stop(&engine, args.shutdown_timeout_seconds).await;
    Ok(())
}

async fn log_notices(engine: Arc<Engine>) {
    // The level is fixed at start. Without attempt logging nothing listens, so the engine
    // does not build a notice per attempt only to wake this task for nothing.
    if !tracing::enabled!(target: "herald::attempts", tracing::Level::DEBUG) {
        return;
    }
    let mut notices = engine.notices();
    loop {
        match notices.recv().await {
            Ok(notice) => {
                if tracing::enabled!(target: "herald::attempts", tracing::Level::DEBUG) {
                    let line = serde_json::to_string(&notice).unwrap_or_default();
                    tracing::debug!(target: "herald::attempts", "{line}");
                }
            }
            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
            Err(_) => return,
        }
    }
}

pub fn receive(args: ReceiveArgs) -> anyhow::Result<()> {
    init_logging(LogFormat::Text, None);
    let scheme: SigningScheme = args.scheme.into();
    let signer = Arc::new(Signer::verifier(
        scheme,
        &[args.secret.as_str()],
        Some(&args.signature_header),
    )?);
    runtime()?.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.listen).await?;
        println!("listening on http://{}", listener.local_addr()?);
        let app = axum::Router::new().fallback(receive_one).with_state(signer);
        axum::serve(listener, app).await?;
        Ok(())
    })
}

async fn receive_one(
    State(signer): State<Arc<Signer>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> StatusCode {
    let pairs: Vec<(&str, &str)> = headers
        .iter()
        .filter_map(|(k, v)| Some((k.as_str(), v.to_str().ok()?)))
        .collect();
    let now = crate::signing::unix_now();
    let get = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_string()
    };
    match signer.verify(pairs.iter().copied(), &body, now, DEFAULT_TOLERANCE) {
        Ok(()) => {
            println!(
                "verified {} type={} attempt={} body={}",
                get(crate::delivery::http::EVENT_ID_HEADER),
                get(crate::delivery::http::EVENT_TYPE_HEADER),
                get(crate::delivery::http::ATTEMPT_HEADER),
                String::from_utf8_lossy(&body)
            );
            StatusCode::NO_CONTENT
        }
        Err(e) => {
            println!("rejected: {e}");
            StatusCode::UNAUTHORIZED
        }
    }
}

/// The embedded store's directory must exist, or be creatable, and be writable. SQLite's own
/// error ("unable to open database file") names neither the cause nor the cure; a container
/// with a read-only root filesystem and no volume at the data directory is the usual one.
fn check_data_dir(dir: &std::path::Path) -> anyhow::Result<()> {
    let cure = "mount a writable volume there (the Helm chart mounts its PersistentVolumeClaim) or pass --data-dir (HERALD_DATA_DIR)";
    std::fs::create_dir_all(dir).with_context(|| {
        format!(
            "the data directory {} cannot be created; {cure}",
            dir.display()
        )
    })?;
    let probe = dir.join(".herald-write-check");
    std::fs::write(&probe, b"").with_context(|| {
        format!(
            "the data directory {} is not writable; {cure}",
            dir.display()
        )
    })?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

#[cfg(test)]
mod data_dir_tests {
    #[test]
    fn a_data_directory_that_cannot_be_made_names_itself_the_cause_and_the_cure() {
        let tmp = std::env::temp_dir().join(format!("herald-data-dir-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        let file = tmp.join("a-file");
        std::fs::write(&file, b"").unwrap();
        let message = format!(
            "{:#}",
            super::check_data_dir(&file.join("data")).unwrap_err()
        );
        assert!(
            message.contains(&format!("{}/data", file.display())),
            "{message}"
        );
        assert!(
            message.contains("cannot be created") && message.contains("--data-dir"),
            "{message}"
        );
        assert!(message.contains("Not a directory"), "{message}");
        super::check_data_dir(&tmp.join("writable")).unwrap();
        assert!(!tmp.join("writable/.herald-write-check").exists());
        std::fs::remove_dir_all(&tmp).unwrap();
    }
}
