//! `WebhookSubscription`: one receiver URL, the event types it wants, how to sign and how
//! hard to try. Spec is what the tenant asks for; status is what herald observed.
// kube's printcolumn(...) entries repeat `type_ = ...` by design; clippy mistakes that for
// a duplicated attribute.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::duration::{Duration, literal};

/// Header names herald sets itself; a static header may not override them.
pub const RESERVED_HEADERS: &[&str] = &[
    "content-type",
    "content-length",
    "host",
    "transfer-encoding",
    "connection",
    "user-agent",
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
    "herald-signature",
    "herald-event-id",
    "herald-event-type",
    "herald-attempt",
];

/// Hop-by-hop and framing headers (beyond those in [`RESERVED_HEADERS`]): set statically they
/// would make a request unframed, mis-encoded or upgraded, so neither `spec.headers` nor
/// `signing.header` may name them.
pub const FRAMING_HEADERS: &[&str] = &[
    "content-encoding",
    "upgrade",
    "te",
    "trailer",
    "keep-alive",
    "proxy-connection",
    "expect",
];

/// A webhook subscription: herald POSTs every event published in this namespace whose type
/// matches `eventTypes` to `url`, signed with the referenced secret, retrying transient
/// failures and dead-lettering the rest.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "herald.dev",
    version = "v1alpha1",
    kind = "WebhookSubscription",
    plural = "webhooksubscriptions",
    singular = "webhooksubscription",
    shortname = "whsub",
    category = "herald",
    namespaced,
    status = "WebhookSubscriptionStatus",
    derive = "PartialEq",
    doc = "A webhook subscription: herald POSTs each matching event of this namespace to spec.url, signed, with retries and dead-lettering.",
    printcolumn(name = "URL", type_ = "string", json_path = ".spec.url"),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Pending",
        type_ = "integer",
        json_path = ".status.pendingAttempts"
    ),
    printcolumn(
        name = "Last Status",
        type_ = "string",
        json_path = ".status.lastAttempt.outcome"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.signing.header) || !has(self.headers) || !self.headers.exists(k, k.lowerAscii() == self.signing.header.lowerAscii())").message("signing.header must not also be one of spec.headers"))]
pub struct WebhookSubscriptionSpec {
    /// The receiver's URL. herald POSTs each event here. Must be an absolute http or https
    /// URL without user info; private and loopback addresses are refused at delivery time
    /// unless the operator's egress allow-list opens them.
    #[schemars(length(min = 1, max = 2048))]
    #[x_kube(
        validation = Rule::new("(self.startsWith('http://') || self.startsWith('https://')) && isURL(self) && url(self).getHostname() != ''").message("must be an absolute http:// or https:// URL with a host"),
        validation = Rule::new("!self.contains('@')").message("must not carry user info (user:password@); put credentials in a signing secret instead")
    )]
    pub url: String,

    /// Event types this subscription receives: exact names ("invoice.paid"), prefix globs
    /// ending in ".*" ("invoice.*" matches "invoice.paid" and "invoice.line.added"), or "*"
    /// for every event of the namespace.
    #[schemars(
        length(min = 1, max = 64),
        inner(
            length(min = 1, max = 253),
            regex(pattern = r"^(\*|[A-Za-z0-9_][A-Za-z0-9_.:/-]*(\.\*)?)$")
        )
    )]
    pub event_types: Vec<String>,

    /// How each delivery is signed.
    pub signing: SigningSpec,

    /// Timeouts, lane width and retry policy.
    #[serde(default)]
    pub delivery: DeliveryPolicy,

    /// What each request carries: json (default: herald's envelope {"id", "type",
    /// "timestamp", "data"}), or a CloudEvent (CloudEvents 1.0): cloudevents-binary (the
    /// attributes as ce-* headers, the data as the body) or cloudevents-structured (one
    /// application/cloudevents+json document). Every request is signed over the body it
    /// carries.
    #[serde(default, skip_serializing_if = "is_default")]
    pub format: Format,

    /// Static, non-secret headers added to every request (for example a routing key). Names
    /// herald sets itself (content-type, webhook-*, herald-*, host, ...) and hop-by-hop or
    /// framing headers (connection, transfer-encoding, content-encoding, upgrade, te,
    /// trailer, keep-alive, proxy-connection, expect) are refused. Do not
    /// put credentials here: specs are readable by anyone who can read the object.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "headers_schema")]
    #[x_kube(
        validation = Rule::new("self.all(k, k.matches('^[A-Za-z0-9!#$%&*+.^_|~-]+$'))").message("header names must be HTTP tokens"),
        validation = Rule::new("self.all(k, !(k.lowerAscii() in ['content-type', 'content-length', 'host', 'transfer-encoding', 'connection', 'user-agent', 'webhook-id', 'webhook-timestamp', 'webhook-signature', 'herald-signature', 'herald-event-id', 'herald-event-type', 'herald-attempt', 'content-encoding', 'upgrade', 'te', 'trailer', 'keep-alive', 'proxy-connection', 'expect']))").message("headers herald sets itself, hop-by-hop and framing headers cannot be set")
    )]
    pub headers: BTreeMap<String, String>,

    /// Where dead letters also go (Knative's deadLetterSink): each event this subscription
    /// dead-letters (retries exhausted, a terminal answer, 410 Gone) is POSTed there too,
    /// signed with this subscription's secret, as an event of type herald.dead_letter whose
    /// data holds the subscription, the event (id, type, data), why it died and the last
    /// attempt. The letter is queued in the same transaction that records the death, and
    /// sent on a lane of its own with the same retry policy and egress guard: a failing
    /// sink never holds the subscription back, and its own dead letters stay listed in its
    /// history (subscription "<name>/dead-letter-sink"). Removing this field holds letters
    /// not yet sent until a sink is set again; deleting the subscription purges them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter_sink: Option<DeadLetterSink>,

    /// Stop starting new attempts while true. Events published meanwhile are kept as pending
    /// attempts and delivered once unpaused.
    #[serde(default)]
    pub paused: bool,

    /// After this many consecutive failed attempts the subscription is disabled (condition
    /// Disabled=True, reason AutoDisabled, a Kubernetes Event) until it is re-enabled. 0 never
    /// disables. Whatever this says, a receiver answering 410 Gone disables it at once
    /// (reason Gone): the Standard Webhooks meaning of 410 is that the endpoint is gone.
    #[serde(default = "default_disable_after")]
    #[schemars(range(min = 0, max = 100000))]
    pub disable_after_consecutive_failures: u32,
}

/// Where a subscription's dead letters are also sent.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterSink {
    /// An absolute http or https URL without user info, under the same egress guard as
    /// spec.url.
    #[schemars(length(min = 1, max = 2048))]
    #[x_kube(
        validation = Rule::new("(self.startsWith('http://') || self.startsWith('https://')) && isURL(self) && url(self).getHostname() != ''").message("must be an absolute http:// or https:// URL with a host"),
        validation = Rule::new("!self.contains('@')").message("must not carry user info (user:password@); put credentials in a signing secret instead")
    )]
    pub url: String,
}

/// At most 32 headers of one line each; bounded so the CEL rules above stay cheap.
fn headers_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "maxProperties": 32,
        "additionalProperties": {
            "type": "string",
            "maxLength": 4096,
            "pattern": "^[^\\r\\n]*$",
        },
    })
}

fn default_disable_after() -> u32 {
    100
}

/// The signature scheme of every request.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum SigningScheme {
    /// Standard Webhooks: headers webhook-id, webhook-timestamp and webhook-signature
    /// ("v1,<base64 HMAC-SHA256 of id.timestamp.body>") with a secret "whsec_<base64>", or
    /// with an ed25519 private key "whsk_<base64 of a 32-byte seed>" ("v1a,<base64
    /// signature of id.timestamp.body>"), which receivers verify with its public key
    /// "whpk_..." (herald public-key prints it), so nothing they hold can forge.
    #[default]
    StandardWebhooks,
    /// Stripe-compatible: one header (default Herald-Signature) "t=<unix>,v1=<hex HMAC-SHA256
    /// of t.body>"; the secret string is the HMAC key as is.
    Stripe,
}

/// Signing settings. Every attempt is signed; secrets are read from Secrets in the
/// subscription's namespace and never logged.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SigningSpec {
    /// standard-webhooks (default) or stripe.
    #[serde(default)]
    pub scheme: SigningScheme,

    /// The Secret key holding the current signing secret.
    pub secret_ref: SecretKeyRef,

    /// Further secrets to sign with at the same time, while receivers move from an old
    /// secret to a new one: each request carries one signature per secret.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 4))]
    pub additional_secret_refs: Vec<SecretKeyRef>,

    /// Header name for the stripe scheme (default Herald-Signature). Ignored by
    /// standard-webhooks, whose header names are fixed. It may not name a header herald sets
    /// itself (content-type, content-length, host, user-agent, webhook-*, the other
    /// herald-* headers) or a hop-by-hop or framing header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 128),
        regex(pattern = r"^[A-Za-z0-9!#$%&*+.^_|~-]+$")
    )]
    #[x_kube(
        validation = Rule::new("!(self.lowerAscii() in ['content-type', 'content-length', 'host', 'transfer-encoding', 'connection', 'user-agent', 'webhook-id', 'webhook-timestamp', 'webhook-signature', 'herald-event-id', 'herald-event-type', 'herald-attempt', 'content-encoding', 'upgrade', 'te', 'trailer', 'keep-alive', 'proxy-connection', 'expect'])").message("must not name a header herald sets itself, or a hop-by-hop or framing header")
    )]
    pub header: Option<String>,
}

/// A key of a Secret in the subscription's own namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// Name of the Secret, in the subscription's namespace: a DNS-1123 subdomain, as every
    /// Secret's name is.
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    )]
    pub name: String,
    /// Key within the Secret's data (letters, digits, '-', '_' and '.', as Secret keys are).
    #[schemars(length(min = 1, max = 253), regex(pattern = r"^[-._a-zA-Z0-9]+$"))]
    pub key: String,
}

impl SecretKeyRef {
    /// Why this reference cannot name a Secret, if it cannot. The schema refuses such a
    /// reference; this check is for objects stored before it did, and for standalone mode.
    /// herald puts the name in the path of its Secret read, so it is checked before any
    /// request ("?watch=true" in a name once turned that read into a watch).
    pub fn problem(&self) -> Option<String> {
        if !is_dns_subdomain(&self.name) {
            return Some(format!(
                "secret name {:?} is not a valid Secret name (a DNS-1123 subdomain: at most 253 lowercase letters, digits, '-' and '.')",
                self.name.chars().take(64).collect::<String>()
            ));
        }
        let key_ok = !self.key.is_empty()
            && self.key.len() <= 253
            && self
                .key
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b));
        (!key_ok).then(|| {
            format!(
                "secret key {:?} of Secret {} is not a valid Secret key (letters, digits, '-', '_' and '.')",
                self.key.chars().take(64).collect::<String>(),
                self.name
            )
        })
    }
}

/// A DNS-1123 subdomain: labels of lowercase letters, digits and '-', starting and ending
/// with a letter or digit, joined by '.', at most 253 characters in all.
pub fn is_dns_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            let bytes = label.as_bytes();
            let edge = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
            bytes.first().is_some_and(edge)
                && bytes.last().is_some_and(edge)
                && bytes.iter().all(|b| edge(b) || *b == b'-')
        })
}

/// How attempts are made.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryPolicy {
    /// Per-attempt timeout, from connect to the end of the response (default 10s, at most
    /// 5m). A timeout is a transient failure.
    #[serde(default = "default_timeout")]
    #[x_kube(validation = Rule::new("duration(self) >= duration('100ms') && duration(self) <= duration('5m')").message("must be between 100ms and 5m"))]
    pub timeout: Duration,

    /// Lane width: how many attempts to this subscription may be on the wire at once. With 1
    /// (the default) attempts are made one at a time and first attempts in publish order; a
    /// delivery waiting for a retry does not hold back later events, so after a failure
    /// events may arrive out of publish order.
    #[serde(default = "default_max_in_flight")]
    #[schemars(range(min = 1, max = 256))]
    pub max_in_flight: u32,

    /// When and how often to try again after a transient failure: exponential backoff with
    /// full jitter (the n-th retry waits a random time up to min(maxBackoff,
    /// initialBackoff * 2^(n-1))), bounded by maxAttempts and maxDuration; then the event is
    /// dead-lettered.
    #[serde(default)]
    pub retry: RetryPolicy,

    /// Upper bound on a receiver's Retry-After (seconds or HTTP date); a longer one is
    /// cut to this (default 1h).
    #[serde(default = "default_retry_after_cap")]
    #[x_kube(validation = Rule::new("duration(self) <= duration('72h')").message("must be at most 72h"))]
    pub retry_after_cap: Duration,

    /// unordered (default) or strict. Strict: events are attempted one at a time in publish
    /// order, and a later event is not attempted while an earlier one waits for a retry, so
    /// a receiver sees them in order (an event retried and then delivered is followed by the
    /// next one only). An event dead-lettered ends its wait: the lane moves on to the next
    /// one, and replaying a dead letter puts it first again. The cost: maxInFlight is 1
    /// whatever it says, and one failing event holds back every later one for as long as
    /// its retries last (maxAttempts, maxDuration).
    #[serde(default)]
    pub ordering: Ordering,

    /// At most this many attempts a second start towards the receiver (with a burst), on
    /// whichever replica delivers; events beyond it wait in the store. It composes with
    /// maxInFlight (both hold). Whether set or not, a receiver answering 429, 502 or 504
    /// slows the subscription down: its pace halves for 30s (condition Degraded, reason
    /// Throttled, says so).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RateLimit>,
}

/// Attempts per second towards a receiver.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RateLimit {
    /// Attempts a second, on average.
    #[schemars(range(min = 1, max = 100000))]
    pub per_second: u32,
    /// How many may start at once after a quiet spell (default: perSecond).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100000))]
    pub burst: Option<u32>,
}

/// What a request carries.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Format {
    /// herald's JSON envelope.
    #[default]
    Json,
    /// A CloudEvent in binary mode.
    CloudeventsBinary,
    /// A CloudEvent in structured mode.
    CloudeventsStructured,
}

fn is_default<T: Default + PartialEq>(value: &T) -> bool {
    *value == T::default()
}

/// The order in which a subscription's events are attempted.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Ordering {
    /// First attempts in publish order; a retry waits without holding back later events.
    #[default]
    Unordered,
    /// Publish order, each event settled (delivered or dead-lettered) before the next starts.
    Strict,
}

impl Default for DeliveryPolicy {
    fn default() -> Self {
        Self {
            timeout: default_timeout(),
            max_in_flight: default_max_in_flight(),
            retry: RetryPolicy::default(),
            retry_after_cap: default_retry_after_cap(),
            ordering: Ordering::default(),
            rate_limit: None,
        }
    }
}

fn default_timeout() -> Duration {
    literal("10s")
}
fn default_max_in_flight() -> u32 {
    1
}
fn default_retry_after_cap() -> Duration {
    literal("1h")
}

/// Exponential backoff with full jitter: the n-th retry waits a random time between 0 and
/// min(maxBackoff, initialBackoff * 2^(n-1)), bounded by maxAttempts and maxDuration.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("duration(self.initialBackoff) <= duration(self.maxBackoff)").message("initialBackoff must not exceed maxBackoff"))]
pub struct RetryPolicy {
    /// Total attempts per event, the first included (default 20). 1 means never retry.
    #[serde(default = "default_max_attempts")]
    #[schemars(range(min = 1, max = 1000))]
    pub max_attempts: u32,

    /// No retry starts later than this after the event was published (default 72h); then
    /// the attempt is dead-lettered.
    #[serde(default = "default_max_duration")]
    #[x_kube(validation = Rule::new("duration(self) >= duration('1s') && duration(self) <= duration('720h')").message("must be between 1s and 720h"))]
    pub max_duration: Duration,

    /// Backoff ceiling of the first retry (default 1s).
    #[serde(default = "default_initial_backoff")]
    #[x_kube(validation = Rule::new("duration(self) >= duration('10ms') && duration(self) <= duration('24h')").message("must be between 10ms and 24h"))]
    pub initial_backoff: Duration,

    /// Largest backoff ceiling of any retry (default 1h).
    #[serde(default = "default_max_backoff")]
    #[x_kube(validation = Rule::new("duration(self) >= duration('10ms') && duration(self) <= duration('72h')").message("must be between 10ms and 72h"))]
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: default_max_attempts(),
            max_duration: default_max_duration(),
            initial_backoff: default_initial_backoff(),
            max_backoff: default_max_backoff(),
        }
    }
}

fn default_max_attempts() -> u32 {
    20
}
fn default_max_duration() -> Duration {
    literal("72h")
}
fn default_initial_backoff() -> Duration {
    literal("1s")
}
fn default_max_backoff() -> Duration {
    literal("1h")
}

/// What herald observed about the subscription.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WebhookSubscriptionStatus {
    /// The spec generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Ready (deliveries can start), Disabled (after consecutive failures, reason
    /// AutoDisabled, or at once after a 410 Gone, reason Gone), Degraded (recent transient
    /// failures) and the reasons behind them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "super::conditions_schema")]
    pub conditions: Vec<Condition>,

    /// The virtual shard the subscription hashes onto; the replica that owns it delivers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<u32>,

    /// Attempts waiting to start (due now or scheduled for retry).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_attempts: Option<u64>,

    /// The most recent finished attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_attempt: Option<LastAttempt>,

    /// Running totals since the subscription was created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counters: Option<SubscriptionCounters>,

    /// Failed attempts since the last success; reaching spec.disableAfterConsecutiveFailures
    /// disables the subscription.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consecutive_failures: Option<u32>,

    /// Dead letters kept for this subscription (given up on and not replayed yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_attempts: Option<u64>,

    /// The value of the `herald.dev/reenable` annotation herald last acted on. Setting the
    /// annotation to a different value re-enables an auto-disabled subscription.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reenable_handled: Option<String>,
}

/// One finished attempt, summarised.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LastAttempt {
    /// When the attempt finished.
    pub time: Time,
    /// Accepted, Transient, Terminal or Gone.
    pub outcome: String,
    /// The receiver's HTTP status, absent when no response arrived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_code: Option<u16>,
    /// From the start of the request to the end of the response, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<u64>,
    /// What happened, for a person (for example "connect timeout after 10s").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Running totals of attempts.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SubscriptionCounters {
    /// Attempts the receiver accepted (2xx).
    #[serde(default)]
    pub delivered: u64,
    /// Attempts that failed, transient or terminal.
    #[serde(default)]
    pub failed: u64,
    /// Events given up on and kept as dead letters.
    #[serde(default)]
    pub dead_lettered: u64,
}

impl WebhookSubscriptionSpec {
    /// Whether an event type is selected by `eventTypes`.
    pub fn matches(&self, event_type: &str) -> bool {
        self.event_types
            .iter()
            .any(|pattern| event_type_matches(pattern, event_type))
    }

    /// Every Secret this spec names, current first.
    pub fn secret_refs(&self) -> impl Iterator<Item = &SecretKeyRef> {
        std::iter::once(&self.signing.secret_ref).chain(&self.signing.additional_secret_refs)
    }

    /// The first reference that cannot name a Secret ([`SecretKeyRef::problem`]).
    pub fn secret_ref_problem(&self) -> Option<String> {
        self.secret_refs().find_map(SecretKeyRef::problem)
    }

    /// The signing secrets' values, current first, by the rule both configuration sources
    /// follow: every reference is a valid Secret name and key, names a Secret that exists
    /// and has that key, and the value is UTF-8 text. `find(name, key)` looks one up (a
    /// cluster's Secrets as read, or a folder's Secret manifests); the first reference that
    /// fails says why.
    pub fn secret_values<'a>(
        &self,
        mut find: impl FnMut(&str, &str) -> SecretLookup<'a>,
    ) -> Result<Vec<String>, SecretProblem> {
        if let Some(why) = self.secret_ref_problem() {
            return Err(SecretProblem::InvalidRef(why));
        }
        self.secret_refs()
            .map(|r| match find(&r.name, &r.key) {
                SecretLookup::NoSecret => Err(SecretProblem::NotFound(r.name.clone())),
                SecretLookup::NoKey => {
                    Err(SecretProblem::KeyMissing(r.name.clone(), r.key.clone()))
                }
                SecretLookup::Value(bytes) => String::from_utf8(bytes.to_vec())
                    .map_err(|_| SecretProblem::NotText(r.name.clone(), r.key.clone())),
            })
            .collect()
    }
}

/// What looking up one secret reference found.
pub enum SecretLookup<'a> {
    NoSecret,
    NoKey,
    Value(&'a [u8]),
}

/// Why a subscription's signing secrets cannot be read, the same in a cluster and in a
/// folder ([`WebhookSubscriptionSpec::secret_values`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SecretProblem {
    /// A reference that cannot name a Secret ([`SecretKeyRef::problem`]).
    InvalidRef(String),
    /// The Secret of this name does not exist.
    NotFound(String),
    /// The Secret (name) has no such key.
    KeyMissing(String, String),
    /// The value under the key (Secret name, key) is not UTF-8 text.
    NotText(String, String),
}

impl SecretProblem {
    /// In words, for a Secret of `namespace`; never with a value.
    pub fn message(&self, namespace: &str) -> String {
        match self {
            SecretProblem::InvalidRef(why) => why.clone(),
            SecretProblem::NotFound(name) => format!("Secret {namespace}/{name} not found"),
            SecretProblem::KeyMissing(name, key) => {
                format!("Secret {namespace}/{name} has no key {key:?}")
            }
            SecretProblem::NotText(name, key) => {
                format!("key {key:?} of Secret {namespace}/{name} is not UTF-8 text")
            }
        }
    }
}

/// One `eventTypes` entry against one event type: "*" matches all, "a.*" matches every type
/// starting with "a." (not "a" itself), anything else must be equal.
pub fn event_type_matches(pattern: &str, event_type: &str) -> bool {
    if pattern == "*" {
        return true;
    }
    match pattern.strip_suffix('*') {
        Some(prefix) if prefix.ends_with('.') => {
            event_type.len() > prefix.len() && event_type.starts_with(prefix)
        }
        _ => pattern == event_type,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one secret rule of both configuration sources: current first, the first failing
    /// reference says why, and a value that is not text is refused (a folder's Secret used
    /// to be read with the bad bytes replaced, and signed with a secret nobody wrote).
    #[test]
    fn secret_values_follow_one_rule() {
        let spec: WebhookSubscriptionSpec = serde_json::from_value(serde_json::json!({
            "url": "https://example.com/hook",
            "eventTypes": ["*"],
            "signing": {
                "secretRef": {"name": "new", "key": "k"},
                "additionalSecretRefs": [{"name": "old", "key": "k"}],
            },
        }))
        .unwrap();
        let found = |new: SecretLookup<'static>, old: SecretLookup<'static>| {
            let (mut new, mut old) = (Some(new), Some(old));
            spec.secret_values(move |name, _| match name {
                "new" => new.take().unwrap(),
                _ => old.take().unwrap(),
            })
        };
        assert_eq!(
            found(SecretLookup::Value(b"a"), SecretLookup::Value(b"b")),
            Ok(vec!["a".to_string(), "b".to_string()])
        );
        assert_eq!(
            found(SecretLookup::Value(b"a"), SecretLookup::NoSecret),
            Err(SecretProblem::NotFound("old".into()))
        );
        assert_eq!(
            found(SecretLookup::NoKey, SecretLookup::NoSecret),
            Err(SecretProblem::KeyMissing("new".into(), "k".into()))
        );
        let not_text = found(SecretLookup::Value(b"\xff"), SecretLookup::Value(b"b"));
        assert_eq!(
            not_text,
            Err(SecretProblem::NotText("new".into(), "k".into()))
        );
        assert_eq!(
            not_text.unwrap_err().message("shop"),
            "key \"k\" of Secret shop/new is not UTF-8 text"
        );

        let mut bad = spec.clone();
        bad.signing.secret_ref.name = "?watch=true".into();
        let asked = std::cell::Cell::new(false);
        let refused = bad.secret_values(|_, _| {
            asked.set(true);
            SecretLookup::NoSecret
        });
        assert!(matches!(refused, Err(SecretProblem::InvalidRef(_))));
        assert!(!asked.get(), "an invalid name was looked up");
    }

    /// Issue 24 item 1: a name that is no Secret name never reaches a request path.
    #[test]
    fn secret_references_must_be_secret_names() {
        for good in ["s", "orders-secret", "a.b-c.d9", &"a".repeat(253)] {
            assert!(is_dns_subdomain(good), "{good:?} refused");
        }
        for bad in [
            "",
            "?watch=true&timeoutSeconds=600",
            "../secrets",
            "a/b",
            "A",
            "-a",
            "a-",
            "a..b",
            ".a",
            "a b",
            "a%2Fb",
            &"a".repeat(254),
        ] {
            assert!(!is_dns_subdomain(bad), "{bad:?} accepted");
        }
        let reference = |name: &str, key: &str| SecretKeyRef {
            name: name.into(),
            key: key.into(),
        };
        assert_eq!(reference("s", "signing.key_1-a").problem(), None);
        assert!(reference("?watch=true", "k").problem().is_some());
        assert!(reference("s", "a/b").problem().is_some());
        let mut spec: WebhookSubscriptionSpec = serde_json::from_value(serde_json::json!({
            "url": "https://example.com/h", "eventTypes": ["*"],
            "signing": {"secretRef": {"name": "s", "key": "k"},
                        "additionalSecretRefs": [{"name": "old", "key": "k"}]},
        }))
        .unwrap();
        assert_eq!(spec.secret_ref_problem(), None);
        spec.signing.additional_secret_refs[0].name = "?watch=true".into();
        assert!(spec.secret_ref_problem().unwrap().contains("?watch=true"));
    }

    #[test]
    fn globs_match_by_prefix_and_exact_names_match_exactly() {
        assert!(event_type_matches("*", "anything"));
        assert!(event_type_matches("invoice.*", "invoice.paid"));
        assert!(event_type_matches("invoice.*", "invoice.line.added"));
        assert!(!event_type_matches("invoice.*", "invoice"));
        assert!(!event_type_matches("invoice.*", "invoice."));
        assert!(!event_type_matches("invoice.*", "invoices.paid"));
        assert!(event_type_matches("invoice.paid", "invoice.paid"));
        assert!(!event_type_matches("invoice.paid", "invoice.paid.late"));
        assert!(!event_type_matches("invoice.paid", "invoice.*"));
    }

    #[test]
    fn a_minimal_manifest_gets_every_default() {
        let spec: WebhookSubscriptionSpec = serde_json::from_value(serde_json::json!({
            "url": "https://example.com/hook",
            "eventTypes": ["invoice.*"],
            "signing": {"secretRef": {"name": "s", "key": "k"}}
        }))
        .unwrap();
        assert_eq!(spec.signing.scheme, SigningScheme::StandardWebhooks);
        assert_eq!(spec.delivery, DeliveryPolicy::default());
        assert_eq!(
            spec.delivery.retry.max_duration.get(),
            std::time::Duration::from_secs(72 * 3600)
        );
        assert_eq!(spec.delivery.max_in_flight, 1);
        assert!(!spec.paused);
        assert!(spec.matches("invoice.paid"));
        assert!(!spec.matches("customer.created"));
    }

    #[test]
    fn durations_read_kubernetes_style_strings() {
        let policy: RetryPolicy = serde_json::from_value(serde_json::json!({
            "maxDuration": "1h30m", "initialBackoff": "250ms", "maxBackoff": "5m"
        }))
        .unwrap();
        assert_eq!(
            policy.max_duration.get(),
            std::time::Duration::from_secs(5400)
        );
        assert_eq!(
            policy.initial_backoff.get(),
            std::time::Duration::from_millis(250)
        );
        assert_eq!(policy.max_attempts, 20);
    }

    #[test]
    fn reserved_header_list_matches_the_schema_rule() {
        let crd = serde_json::to_string(&<WebhookSubscription as kube::CustomResourceExt>::crd())
            .unwrap();
        let rules: Vec<&str> = crd.split("\"rule\":").skip(1).collect();
        let headers_rule = rules
            .iter()
            .find(|r| r.contains("self.all(k, !(k.lowerAscii() in"))
            .expect("the spec.headers rule");
        let signing_rule = rules
            .iter()
            .find(|r| r.starts_with("\"!(self.lowerAscii() in"))
            .expect("the signing.header rule");
        for name in RESERVED_HEADERS.iter().chain(FRAMING_HEADERS) {
            assert!(
                headers_rule.contains(&format!("'{name}'")),
                "{name} missing from the spec.headers rule"
            );
            // Herald-Signature is the stripe scheme's default, which it may name.
            if *name != "herald-signature" {
                assert!(
                    signing_rule.contains(&format!("'{name}'")),
                    "{name} missing from the signing.header rule"
                );
            }
        }
    }
}
