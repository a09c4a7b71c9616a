//! The `herald` command line: one binary, one subcommand per job, and every setting each
//! takes (flags and their environment variables), read here and handed down; nothing below
//! reads the environment. What the subcommands do is in [`crate::commands`] and
//! [`crate::run`].

use std::io::Read;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::api::SigningScheme;
use crate::ingest;
use crate::signing::{DEFAULT_TOLERANCE, Signer};

#[derive(Parser, Debug)]
#[command(
    name = "herald",
    version,
    about = "Delivers signed webhooks from Kubernetes"
)]
pub struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// Print every CustomResourceDefinition as YAML (what crds/ holds).
    Crds,
    /// Print the ingest API's OpenAPI 3.1 document (what GET /openapi.json serves).
    Openapi,
    /// Print the signature headers herald would send for a body, one `Name: value` a line.
    Sign(SignArgs),
    /// Check a received request's signature headers; exit 0 when valid, 1 with the reason.
    Verify(VerifyArgs),
    /// Print the public key (`whpk_...`) of an ed25519 private key (`whsk_...`), for
    /// receivers.
    PublicKey(PublicKeyArgs),
    /// Run herald: the delivery engine and the ingest API.
    Run(Box<RunArgs>),
    /// A small receiver for trying herald out: verifies each delivery and prints it.
    Receive(ReceiveArgs),
    /// The kubectl plugin (`kubectl herald ...`): installed as `kubectl-herald` on PATH
    /// (a copy or a link of this binary), it runs these over the aggregated API with the
    /// kubeconfig's credentials.
    #[command(subcommand)]
    Kubectl(PluginCommand),
}

/// `kubectl herald`: exit 0 done, 1 refused (the answer says why), 2 bad usage, 3 the API
/// server or herald unavailable.
#[derive(Subcommand, Debug)]
pub(crate) enum PluginCommand {
    /// Publish an event: `kubectl herald publish -n shop --type order.created --data @order.json`.
    /// An id published before is no error (it is reported, nothing is delivered again).
    Publish(PublishArgs),
    /// A subscription's attempts, newest first: `kubectl herald deliveries whsub/orders --state dead`.
    Deliveries(DeliveriesArgs),
    /// Deliver a subscription's dead letters again: `kubectl herald replay whsub/orders --since 1h`.
    Replay(ReplayArgs),
    /// Re-enable a subscription its failures (or a 410 Gone) disabled.
    Enable(EnableArgs),
    /// One line per subscription of the namespace: Ready, pending, dead, last status, latency.
    Status(StatusArgs),
}

#[derive(Args, Debug, Clone)]
pub(crate) struct PluginCommon {
    /// The namespace (default: the kubeconfig context's).
    #[arg(short = 'n', long)]
    pub(crate) namespace: Option<String>,
    /// Output: a table for people (default), or the objects as json or yaml.
    #[arg(short = 'o', long, value_enum)]
    pub(crate) output: Option<OutputFormat>,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OutputFormat {
    Json,
    Yaml,
}

#[derive(Args, Debug)]
pub(crate) struct PublishArgs {
    #[command(flatten)]
    pub(crate) common: PluginCommon,
    /// The event type.
    #[arg(long = "type")]
    pub(crate) event_type: String,
    /// The event's data: JSON, or @FILE to read it from a file (@- for standard input).
    #[arg(long)]
    pub(crate) data: Option<String>,
    /// The event id, the idempotency key (default: herald makes one).
    #[arg(long)]
    pub(crate) id: Option<String>,
}

#[derive(Args, Debug)]
pub(crate) struct DeliveriesArgs {
    #[command(flatten)]
    pub(crate) common: PluginCommon,
    /// The subscription: whsub/NAME (or NAME).
    pub(crate) subscription: String,
    /// Only attempts with this outcome: accepted, transient, terminal or gone.
    #[arg(long)]
    pub(crate) outcome: Option<String>,
    /// `dead`: the last attempt of each dead letter (what `replay` sends again).
    #[arg(long, value_parser = ["dead"])]
    pub(crate) state: Option<String>,
    /// At most this many (newest first).
    #[arg(long, default_value_t = 50)]
    pub(crate) limit: u32,
}

#[derive(Args, Debug)]
pub(crate) struct ReplayArgs {
    #[command(flatten)]
    pub(crate) common: PluginCommon,
    /// The subscription: whsub/NAME (or NAME).
    pub(crate) subscription: String,
    /// Only dead letters of events published this long ago or later (30m, 1h, 2d) or since
    /// this RFC 3339 time.
    #[arg(long)]
    pub(crate) since: Option<String>,
    /// Only these events (repeatable).
    #[arg(long = "event-id")]
    pub(crate) event_ids: Vec<String>,
}

#[derive(Args, Debug)]
pub(crate) struct EnableArgs {
    #[command(flatten)]
    pub(crate) common: PluginCommon,
    /// The subscription: whsub/NAME (or NAME).
    pub(crate) subscription: String,
}

#[derive(Args, Debug)]
pub(crate) struct StatusArgs {
    #[command(flatten)]
    pub(crate) common: PluginCommon,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
pub(crate) enum SchemeArg {
    StandardWebhooks,
    Stripe,
}

impl From<SchemeArg> for SigningScheme {
    fn from(value: SchemeArg) -> Self {
        match value {
            SchemeArg::StandardWebhooks => SigningScheme::StandardWebhooks,
            SchemeArg::Stripe => SigningScheme::Stripe,
        }
    }
}

#[derive(clap::Args, Debug)]
pub(crate) struct SchemeArgs {
    /// Signature scheme.
    #[arg(long, value_enum, default_value = "standard-webhooks")]
    pub(crate) scheme: SchemeArg,
    /// Signing secret (`whsec_...`, or an ed25519 private key `whsk_...`; to verify, its
    /// public key `whpk_...` will do); repeat it while rotating (each adds a signature).
    #[arg(
        long = "secret",
        required = true,
        env = "HERALD_SECRET",
        hide_env_values = true
    )]
    pub(crate) secrets: Vec<String>,
    /// Header name of the stripe scheme.
    #[arg(long, default_value = crate::signing::stripe::DEFAULT_HEADER)]
    pub(crate) signature_header: String,
    /// The request body, or - for standard input.
    #[arg(long)]
    pub(crate) body_file: PathBuf,
}

impl SchemeArgs {
    pub(crate) fn signer(&self) -> anyhow::Result<Signer> {
        Ok(Signer::new(
            self.scheme.into(),
            &self.secrets,
            Some(&self.signature_header),
        )?)
    }

    /// A verifier, which may hold public keys (`whpk_`).
    pub(crate) fn verifier(&self) -> anyhow::Result<Signer> {
        Ok(Signer::verifier(
            self.scheme.into(),
            &self.secrets,
            Some(&self.signature_header),
        )?)
    }

    pub(crate) fn body(&self) -> anyhow::Result<Vec<u8>> {
        let mut body = Vec::new();
        if self.body_file.as_os_str() == "-" {
            std::io::stdin().read_to_end(&mut body)?;
        } else {
            body = std::fs::read(&self.body_file)
                .with_context(|| format!("reading {}", self.body_file.display()))?;
        }
        Ok(body)
    }
}

#[derive(clap::Args, Debug)]
pub(crate) struct SignArgs {
    #[command(flatten)]
    pub(crate) scheme: SchemeArgs,
    /// The event id (webhook-id).
    #[arg(long)]
    pub(crate) id: String,
    /// Unix time in seconds; now when omitted.
    #[arg(long)]
    pub(crate) timestamp: Option<i64>,
}

#[derive(clap::Args, Debug)]
pub(crate) struct VerifyArgs {
    #[command(flatten)]
    pub(crate) scheme: SchemeArgs,
    /// A received header as `Name: value`; repeat for each.
    #[arg(long = "header", value_parser = parse_header)]
    pub(crate) headers: Vec<(String, String)>,
    /// The verifier's clock as Unix seconds; the system clock when omitted.
    #[arg(long)]
    pub(crate) now: Option<i64>,
    /// Largest accepted distance between the signature's timestamp and now, in seconds.
    #[arg(long, default_value_t = DEFAULT_TOLERANCE.as_secs())]
    pub(crate) tolerance: u64,
}

#[derive(clap::Args, Debug)]
pub(crate) struct PublicKeyArgs {
    /// The private key, `whsk_<base64 of 32 random bytes>`.
    #[arg(long, env = "HERALD_SECRET", hide_env_values = true)]
    pub(crate) secret: String,
}

fn parse_header(raw: &str) -> Result<(String, String), String> {
    let (name, value) = raw
        .split_once(':')
        .ok_or_else(|| format!("{raw:?} is not of the form 'Name: value'"))?;
    Ok((name.trim().to_string(), value.trim().to_string()))
}

/// Every setting of `herald run`, with its default.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// Run without a cluster: subscriptions, quotas and secrets come from --config. Without
    /// it herald runs as the operator: it watches WebhookSubscriptions and WebhookQuotas in
    /// the cluster and authorizes API calls with TokenReview and SubjectAccessReview.
    #[arg(long)]
    pub(crate) standalone: bool,
    /// Cluster credentials (cluster mode); without it KUBECONFIG, then the in-cluster
    /// ServiceAccount.
    #[arg(long, env = "HERALD_KUBECONFIG")]
    pub(crate) kubeconfig: Option<PathBuf>,
    /// Watch only this namespace (repeatable; comma-separated in the environment
    /// variable). Default: every namespace.
    #[arg(
        long = "watch-namespace",
        env = "HERALD_WATCH_NAMESPACE",
        value_delimiter = ','
    )]
    pub(crate) watch_namespaces: Vec<String>,
    /// Address of /healthz and /readyz (and /metrics), apart from the ingest API so that
    /// producers never reach them. Default 0.0.0.0:9090 in cluster mode; off in standalone
    /// mode unless given.
    #[arg(long, env = "HERALD_METRICS_LISTEN")]
    pub(crate) metrics_listen: Option<SocketAddr>,
    /// On SIGTERM or SIGINT: stop starting attempts, and give those on the wire this many
    /// seconds to finish before exiting (keep it below the pod's grace period).
    #[arg(long, env = "HERALD_SHUTDOWN_TIMEOUT_SECONDS", default_value_t = 25)]
    pub(crate) shutdown_timeout_seconds: u64,
    /// Cluster mode: a subscription's status is written at most once per this many seconds
    /// while deliveries run (an auto-disable shows within a second).
    #[arg(long, env = "HERALD_STATUS_INTERVAL_SECONDS", default_value_t = 5,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) status_interval_seconds: u64,
    /// Folder of WebhookSubscription, WebhookQuota and Secret manifests (standalone mode).
    #[arg(long, env = "HERALD_CONFIG")]
    pub(crate) config: Option<PathBuf>,
    /// Where the embedded store keeps its database (unless --store is given).
    #[arg(long, env = "HERALD_DATA_DIR", default_value = "./herald-data")]
    pub(crate) data_dir: PathBuf,
    /// The store as a PostgreSQL URL (postgres://USER:PASSWORD@HOST:PORT/DATABASE, with
    /// ?sslmode=verify-full&sslrootcert=FILE for TLS), for several replicas sharing one
    /// database; the schema is created or migrated at start. Without it, the embedded
    /// SQLite store in --data-dir. Prefer the environment variable: a flag is visible in the
    /// process list. The password is never logged.
    #[arg(long, env = "HERALD_STORE", hide_env_values = true, value_parser = StoreUrl::parse)]
    pub(crate) store: Option<StoreUrl>,
    /// Address of the ingest API. Port 0 picks a free port (see --ready-file).
    #[arg(long, env = "HERALD_LISTEN", default_value = "127.0.0.1:8080")]
    pub(crate) listen: SocketAddr,
    /// Bearer token every API call must carry in standalone mode: publishing, reading
    /// attempts, replay and enable (/healthz and /readyz need none). No token means no
    /// check. Prefer the environment variable: a flag shows in the process list. Cluster
    /// mode ignores it and asks Kubernetes (TokenReview, SubjectAccessReview).
    #[arg(long, env = "HERALD_PUBLISH_TOKEN", hide_env_values = true)]
    pub(crate) publish_token: Option<String>,
    /// The audience a producer's ServiceAccount token must be issued for (cluster mode:
    /// `kubectl create token NAME --audience herald`), so a token meant for the API server
    /// or another service cannot be replayed to herald, nor herald's to them.
    #[arg(long, env = "HERALD_TOKEN_AUDIENCE", default_value = crate::controller::access_review::DEFAULT_AUDIENCE)]
    pub(crate) token_audience: String,
    /// CIDR the egress guard lets herald deliver to although it is private, loopback or
    /// otherwise special (repeatable; comma-separated in the environment variable).
    #[arg(
        long = "egress-allow",
        env = "HERALD_EGRESS_ALLOW",
        value_delimiter = ','
    )]
    pub(crate) egress_allow: Vec<ipnet::IpNet>,
    /// The cluster's pod and service CIDRs (repeatable; comma-separated in the environment
    /// variable): refused like private addresses unless --egress-allow opens them. Needed on
    /// IPv6 clusters, whose ranges are often global addresses the guard cannot tell apart.
    #[arg(
        long = "cluster-cidr",
        env = "HERALD_CLUSTER_CIDRS",
        value_delimiter = ','
    )]
    pub(crate) cluster_cidr: Vec<ipnet::IpNet>,
    /// PEM file of CA certificates (it may hold several) herald trusts for HTTPS receivers,
    /// besides the system's roots: for receivers whose certificates a private CA issues.
    /// Read at start.
    #[arg(long, env = "HERALD_EGRESS_CA_FILE")]
    pub(crate) egress_ca_file: Option<PathBuf>,
    /// Export a span per attempt of every event published with a W3C `traceparent` header
    /// (a child of the producer's span) over OTLP/HTTP (protobuf) to this collector: its
    /// base URL (http://collector:4318, to which /v1/traces is added) or the full traces
    /// URL. Without it, attempts still carry the producer's trace context on.
    #[arg(long, env = "HERALD_OTLP_ENDPOINT", value_parser = otlp_traces_url)]
    pub(crate) otlp_endpoint: Option<url::Url>,
    /// Serve the ingest API over HTTPS with this PEM certificate chain (with
    /// --tls-key-file). Both files are looked at every 5 s (--ingest-tls-reload-interval)
    /// and a changed pair is used for new connections; a pair that cannot be used keeps the
    /// previous one and is logged. /healthz, /readyz and /metrics on --metrics-listen stay
    /// plain HTTP.
    #[arg(long, env = "HERALD_TLS_CERT_FILE", requires = "tls_key_file")]
    pub(crate) tls_cert_file: Option<PathBuf>,
    /// The PEM private key of --tls-cert-file (PKCS#8, RSA or EC). It must match the
    /// certificate, or herald does not start.
    #[arg(long, env = "HERALD_TLS_KEY_FILE", requires = "tls_cert_file")]
    pub(crate) tls_key_file: Option<PathBuf>,
    /// Serve the aggregated API (`delivery.herald.dev/v1alpha1`: publish with `kubectl
    /// create` of a WebhookEvent) on this address, behind the API server's APIService.
    /// Cluster mode only; needs --aggregated-tls-cert-file and --aggregated-tls-key-file.
    /// Only the API server's front proxy may connect: a client certificate of the
    /// request-header CA that the ConfigMap kube-system/extension-apiserver-authentication
    /// names (re-read every minute).
    #[arg(long, env = "HERALD_AGGREGATED_LISTEN", requires_all = ["aggregated_tls_cert_file", "aggregated_tls_key_file"])]
    pub(crate) aggregated_listen: Option<SocketAddr>,
    /// The aggregated API's serving certificate (PEM chain), whose CA the APIService's
    /// caBundle holds; reloaded like --tls-cert-file.
    #[arg(
        long,
        env = "HERALD_AGGREGATED_TLS_CERT_FILE",
        requires = "aggregated_listen"
    )]
    pub(crate) aggregated_tls_cert_file: Option<PathBuf>,
    /// The PEM private key of --aggregated-tls-cert-file.
    #[arg(
        long,
        env = "HERALD_AGGREGATED_TLS_KEY_FILE",
        requires = "aggregated_listen"
    )]
    pub(crate) aggregated_tls_key_file: Option<PathBuf>,
    /// The shared pool: attempts on the wire beyond each namespace's reserved floor, over
    /// all namespaces. Attempts on the wire are at most this plus
    /// --namespace-reserved-in-flight × namespaces with attempts on the wire.
    #[arg(long, env = "HERALD_MAX_IN_FLIGHT", default_value_t = 4096)]
    pub(crate) max_in_flight: u32,
    /// Attempts every namespace may start whatever other namespaces hold (its floor outside
    /// the shared pool, capped by its own quota; RFC 0215 asks for at least 8).
    #[arg(long, env = "HERALD_NAMESPACE_RESERVED_IN_FLIGHT", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(8..))]
    pub(crate) namespace_reserved_in_flight: u32,
    /// Publishes of one namespace waiting for the store at once; more are answered 429
    /// publish_busy with Retry-After: 1 at once, so one producer's flood cannot starve
    /// other namespaces' publishing and delivery.
    #[arg(long, env = "HERALD_NAMESPACE_MAX_CONCURRENT_PUBLISHES", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) namespace_max_concurrent_publishes: u32,
    /// A namespace's attempts on the wire at once, where no WebhookQuota says otherwise
    /// (at least 16).
    #[arg(long, env = "HERALD_NAMESPACE_MAX_IN_FLIGHT", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(16..))]
    pub(crate) namespace_max_in_flight: u32,
    /// A namespace's pending attempts, where no WebhookQuota says otherwise.
    #[arg(
        long,
        env = "HERALD_NAMESPACE_MAX_PENDING",
        default_value_t = 1_000_000
    )]
    pub(crate) namespace_max_pending: u64,
    /// What a namespace's stored events may count, in bytes, where no WebhookQuota says
    /// otherwise: each event its body (kept until pruned) plus 512, and 256 per delivery.
    /// Publishing past it is refused with 429 quota_exceeded.
    #[arg(
        long,
        env = "HERALD_NAMESPACE_MAX_STORED_BYTES",
        default_value_t = 256 * 1024 * 1024
    )]
    pub(crate) namespace_max_stored_bytes: u64,
    /// Free space the embedded store's disk keeps for delivering what it holds: no publish
    /// of any namespace is accepted into it (507 insufficient_storage), so deliveries, their
    /// history and status can still be written however the namespaces' budgets add up.
    #[arg(
        long,
        env = "HERALD_STORE_RESERVE_BYTES",
        default_value_t = 64 * 1024 * 1024
    )]
    pub(crate) store_reserve_bytes: u64,
    /// How long attempt history, delivered deliveries and the ids of finished events are
    /// kept, in hours (a repeated event id is recognised for this long). Dead letters are
    /// kept until replayed or their subscription is removed; their history is pruned.
    #[arg(long, env = "HERALD_HISTORY_RETENTION_HOURS", default_value_t = 168)]
    pub(crate) history_retention_hours: u64,
    /// Largest accepted event body, in bytes.
    #[arg(long, env = "HERALD_MAX_BODY_BYTES", default_value_t = ingest::DEFAULT_MAX_BODY)]
    pub(crate) max_body_bytes: usize,
    /// Log format: text or json.
    #[arg(long, env = "HERALD_LOG_FORMAT", value_enum, default_value = "text")]
    pub(crate) log_format: LogFormat,
    /// Log level or filter (for example info, debug, herald=debug,kube=warn); else RUST_LOG,
    /// else info. Secrets and payloads are never logged at any level.
    #[arg(long, env = "HERALD_LOG_LEVEL")]
    pub(crate) log_level: Option<String>,
    /// Also export herald_subscription_attempts_total with a subscription label (one series
    /// per subscription and outcome: mind the cardinality).
    #[arg(long, env = "HERALD_METRICS_SUBSCRIPTION_LABELS")]
    pub(crate) metrics_subscription_labels: bool,
    /// Cluster mode with several replicas sharing one store: deliver only for the shards this
    /// replica holds through Leases in --lease-namespace (see the README's "Scaling out").
    #[arg(long, env = "HERALD_SHARD_LEASES")]
    pub(crate) shard_leases: bool,
    /// Virtual shards subscriptions hash onto (FNV-1a of the uid, modulo this); every
    /// replica must use the same number.
    #[arg(long, env = "HERALD_SHARDS", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub(crate) shards: u32,
    /// herald's own namespace, where shard Leases live (the chart sets it).
    #[arg(long, env = "HERALD_LEASE_NAMESPACE", default_value = "herald-system")]
    pub(crate) lease_namespace: String,
    /// This replica's identity in the Leases; default POD_NAME, else the host name and
    /// process id.
    #[arg(long, env = "HERALD_REPLICA_ID")]
    pub(crate) replica_id: Option<String>,
    /// A shard Lease lasts this many seconds unless renewed (every third of it); a replica
    /// stops starting attempts for a shard a third of it before its Lease could be taken.
    #[arg(long, env = "HERALD_SHARD_LEASE_SECONDS", default_value_t = 15,
          value_parser = clap::value_parser!(u64).range(3..=3600))]
    pub(crate) shard_lease_seconds: u64,
    /// A request's head must arrive within this, on the ingest API (an idle keep-alive
    /// connection closes after it too; over TLS, the handshake must finish within it).
    #[arg(long, env = "HERALD_INGEST_HEADER_TIMEOUT", default_value = "10s", value_parser = duration)]
    pub(crate) ingest_header_timeout: Duration,
    /// A request's body must arrive within this, from the moment its head did.
    #[arg(long, env = "HERALD_INGEST_BODY_TIMEOUT", default_value = "30s", value_parser = duration)]
    pub(crate) ingest_body_timeout: Duration,
    /// Ingest connections open at once; at the bound new ones wait in the kernel's backlog.
    /// Lowered at start to fit the descriptor limit beside --max-in-flight.
    #[arg(long, env = "HERALD_INGEST_MAX_CONNECTIONS", default_value_t = 1024,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) ingest_max_connections: u64,
    /// How often the files of --tls-cert-file and --tls-key-file are looked at for changes.
    #[arg(long, env = "HERALD_INGEST_TLS_RELOAD_INTERVAL", default_value = "5s", value_parser = duration)]
    pub(crate) ingest_tls_reload_interval: Duration,
    /// Standalone mode: how often the --config folder is looked at for changes, in
    /// milliseconds (0: never; only SIGHUP reloads it).
    #[arg(long, env = "HERALD_CONFIG_POLL_MS", default_value_t = 1000)]
    pub(crate) config_poll_ms: u64,
    /// The pod's name (the chart sets POD_NAME from the downward API): the default replica
    /// identity, and the instance that Events name as their reporter.
    #[arg(long, env = "POD_NAME", hide = true)]
    pub(crate) pod_name: Option<String>,
    /// Once serving, write the ingest API's address to this file (for scripts and tests;
    /// `https://ADDRESS` when it serves TLS); a second line holds the address of /healthz,
    /// /readyz and /metrics when served.
    #[arg(long)]
    pub(crate) ready_file: Option<PathBuf>,
}

/// How log lines are written.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// One line of text per event.
    #[default]
    Text,
    /// One JSON object per event, with the fields of its spans (for log collectors).
    Json,
}

#[derive(Args, Debug)]
pub struct ReceiveArgs {
    /// The subscription's signing secret (for ed25519, its public key `whpk_...` will do).
    #[arg(long, env = "HERALD_SECRET", hide_env_values = true)]
    pub(crate) secret: String,
    #[arg(long, value_enum, default_value = "standard-webhooks")]
    pub(crate) scheme: SchemeArg,
    /// Header name of the stripe scheme.
    #[arg(long, default_value = crate::signing::stripe::DEFAULT_HEADER)]
    pub(crate) signature_header: String,
    #[arg(long, default_value = "127.0.0.1:9000")]
    pub(crate) listen: SocketAddr,
}

/// A duration such as `250ms` or `10s`, at least a millisecond.
fn duration(text: &str) -> Result<Duration, String> {
    let parsed: crate::api::duration::Duration = text.trim().parse().map_err(|e| format!("{e}"))?;
    Ok(parsed.get().max(Duration::from_millis(1)))
}

/// `--store` / `HERALD_STORE`: a `postgres://` (or `postgresql://`) URL. It may carry a
/// password, so it shows (Display and Debug alike) with the password replaced; only
/// [`StoreUrl::expose`] gives the URL itself, to connect with.
#[derive(Clone)]
pub struct StoreUrl(String);

impl StoreUrl {
    pub(crate) fn parse(raw: &str) -> Result<Self, String> {
        let parsed = url::Url::parse(raw).map_err(|e| format!("not a URL ({e})"))?;
        match parsed.scheme() {
            "postgres" | "postgresql" => Ok(Self(raw.to_string())),
            other => Err(format!(
                "unsupported store {other:?}: give a postgres:// URL, or leave --store out for the embedded store in --data-dir"
            )),
        }
    }

    /// The URL with its password, to connect with; never log it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&crate::store::postgres::redact_url(&self.0))
    }
}

impl std::fmt::Debug for StoreUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StoreUrl({self})")
    }
}

/// An OTLP/HTTP endpoint: a base URL gets the traces path.
fn otlp_traces_url(text: &str) -> Result<url::Url, String> {
    let mut url = url::Url::parse(text).map_err(|e| e.to_string())?;
    if !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
        return Err("must be an http:// or https:// URL".into());
    }
    if url.path() == "/" {
        url.set_path("/v1/traces");
    }
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_url_never_shows_its_password() {
        let url = StoreUrl::parse("postgres://herald:hunter2@db:5432/herald").unwrap();
        assert_eq!(url.expose(), "postgres://herald:hunter2@db:5432/herald");
        for shown in [url.to_string(), format!("{url:?}")] {
            assert!(!shown.contains("hunter2"), "{shown}");
            assert!(shown.contains("db:5432/herald"), "{shown}");
        }
        let err = StoreUrl::parse("mysql://u:secretpw@db/x").unwrap_err();
        assert!(!err.contains("secretpw"), "{err}");
        assert!(StoreUrl::parse("not a url").is_err());
    }

    #[test]
    fn store_flag_and_environment_select_postgres() {
        let cli = Cli::try_parse_from([
            "herald",
            "run",
            "--store",
            "postgresql://h:pw@127.0.0.1/herald",
        ])
        .unwrap();
        let Command::Run(args) = cli.command else {
            panic!("not run")
        };
        assert_eq!(
            args.store.as_ref().map(StoreUrl::expose),
            Some("postgresql://h:pw@127.0.0.1/herald")
        );
        assert!(!format!("{args:?}").contains(":pw@"));
        assert!(Cli::try_parse_from(["herald", "run", "--store", "sqlite:///x"]).is_err());
    }

    #[test]
    fn an_otlp_base_url_gets_the_traces_path() {
        assert_eq!(
            super::otlp_traces_url("http://collector:4318")
                .unwrap()
                .as_str(),
            "http://collector:4318/v1/traces"
        );
        assert_eq!(
            super::otlp_traces_url("https://c.example/otlp/v1/traces")
                .unwrap()
                .as_str(),
            "https://c.example/otlp/v1/traces"
        );
        assert!(super::otlp_traces_url("collector:4318").is_err());
        assert!(super::otlp_traces_url("ftp://c/").is_err());
    }
}
