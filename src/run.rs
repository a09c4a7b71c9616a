//! `herald run` and `herald receive`: the long-running commands.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use clap::Args;
use tracing_subscriber::EnvFilter;

use crate::api::SigningScheme;
use crate::cli::SchemeArg;
use crate::delivery::egress::EgressPolicy;
use crate::delivery::http::HttpSender;
use crate::delivery::{Engine, EngineConfig};
use crate::ingest::{self, auth::StaticToken};
use crate::signing::{DEFAULT_TOLERANCE, Signer};
use crate::store::sqlite::SqliteStore;

/// Every setting of `herald run`, with its default.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// Run without a cluster: subscriptions, quotas and secrets come from --config.
    #[arg(long)]
    standalone: bool,
    /// Folder of WebhookSubscription, WebhookQuota and Secret manifests (standalone mode).
    #[arg(long, env = "HERALD_CONFIG")]
    config: Option<PathBuf>,
    /// Where the embedded store keeps its database.
    #[arg(long, env = "HERALD_DATA_DIR", default_value = "./herald-data")]
    data_dir: PathBuf,
    /// Address of the ingest API. Port 0 picks a free port (see --ready-file).
    #[arg(long, env = "HERALD_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Bearer token producers must send (standalone mode); no token means no check.
    #[arg(long, env = "HERALD_PUBLISH_TOKEN", hide_env_values = true)]
    publish_token: Option<String>,
    /// CIDR the egress guard lets herald deliver to although it is private, loopback or
    /// otherwise special (repeatable; comma-separated in the environment variable).
    #[arg(
        long = "egress-allow",
        env = "HERALD_EGRESS_ALLOW",
        value_delimiter = ','
    )]
    egress_allow: Vec<ipnet::IpNet>,
    /// Attempts on the wire at once, over all namespaces.
    #[arg(long, env = "HERALD_MAX_IN_FLIGHT", default_value_t = 4096)]
    max_in_flight: u32,
    /// A namespace's attempts on the wire at once, where no WebhookQuota says otherwise
    /// (at least 16).
    #[arg(long, env = "HERALD_NAMESPACE_MAX_IN_FLIGHT", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(16..))]
    namespace_max_in_flight: u32,
    /// A namespace's pending attempts, where no WebhookQuota says otherwise.
    #[arg(
        long,
        env = "HERALD_NAMESPACE_MAX_PENDING",
        default_value_t = 1_000_000
    )]
    namespace_max_pending: u64,
    /// How long attempt history and finished deliveries are kept, in hours.
    #[arg(long, env = "HERALD_HISTORY_RETENTION_HOURS", default_value_t = 168)]
    history_retention_hours: u64,
    /// Largest accepted event body, in bytes.
    #[arg(long, env = "HERALD_MAX_BODY_BYTES", default_value_t = ingest::DEFAULT_MAX_BODY)]
    max_body_bytes: usize,
    /// Once serving, write the ingest API's address to this file (for scripts and tests).
    #[arg(long)]
    ready_file: Option<PathBuf>,
}

fn init_logging() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour only for a person at a terminal, never into log files.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    init_logging();
    if !args.standalone {
        anyhow::bail!(
            "only standalone mode exists yet: run `herald run --standalone --config DIR`"
        );
    }
    let config_dir = args
        .config
        .clone()
        .context("standalone mode needs --config DIR (a folder of manifests)")?;
    runtime()?.block_on(run_standalone(args, config_dir))
}

async fn run_standalone(args: RunArgs, config_dir: PathBuf) -> anyhow::Result<()> {
    let store = Arc::new(SqliteStore::open(&args.data_dir)?);
    let sender = HttpSender::new(EgressPolicy::new(args.egress_allow.clone()))?;
    let engine = Engine::new(
        store,
        sender,
        EngineConfig {
            max_in_flight: args.max_in_flight,
            namespace_max_in_flight: args.namespace_max_in_flight,
            namespace_max_pending: args.namespace_max_pending,
            history_retention: Duration::from_secs(args.history_retention_hours * 3600),
        },
    );

    // Configuration first, so that removals made while herald was down are purged before
    // anything is dispatched; then recovery; then delivery.
    let mut sync = crate::standalone::FolderSync::new(engine.clone(), config_dir.clone()).await?;
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
    tracing::info!(%address, data_dir = %args.data_dir.display(), config = %config_dir.display(), "herald is serving");
    if let Some(path) = &args.ready_file {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, address.to_string())?;
        std::fs::rename(&tmp, path)?;
    }
    let app = ingest::router(ingest::Api {
        engine,
        auth: Arc::new(StaticToken(args.publish_token.clone())),
        max_body: args.max_body_bytes,
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

async fn log_notices(engine: Arc<Engine>) {
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

#[derive(Args, Debug)]
pub struct ReceiveArgs {
    /// The subscription's signing secret.
    #[arg(long, env = "HERALD_SECRET", hide_env_values = true)]
    secret: String,
    #[arg(long, value_enum, default_value = "standard-webhooks")]
    scheme: SchemeArg,
    /// Header name of the stripe scheme.
    #[arg(long, default_value = crate::signing::stripe::DEFAULT_HEADER)]
    signature_header: String,
    #[arg(long, default_value = "127.0.0.1:9000")]
    listen: SocketAddr,
}

pub fn receive(args: ReceiveArgs) -> anyhow::Result<()> {
    init_logging();
    let scheme: SigningScheme = args.scheme.into();
    let signer = Arc::new(Signer::new(
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
