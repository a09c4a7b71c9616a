//! The delivery engine: per-subscription lanes under namespace quotas and a global limit
//! ([`scheduler`]), attempts fenced in the store, signed POSTs ([`http`]) behind the egress
//! guard ([`egress`]), outcome classes ([`outcome`]) and retries ([`retry`]).

pub mod admission;
pub mod clock;
pub mod dead_letter;
pub mod egress;
pub mod engine;
pub mod format;
pub mod http;
pub mod outcome;
pub mod pace;
pub mod retry;
pub mod scheduler;
pub mod shards;
pub mod trace;

use std::sync::Arc;
use std::time::Duration;

use reqwest::header::{HeaderName, HeaderValue};

use sha2::{Digest, Sha256};

use crate::api::WebhookSubscriptionSpec;
use crate::signing::Signer;
use retry::RetryLimits;

pub use engine::{Engine, EngineConfig, Notice};

/// A subscription as the engine runs it: its spec, resolved and checked.
#[derive(Clone, Debug)]
pub struct SubscriptionConfig {
    /// Shared with the engine's indexes (and namespace names between subscriptions), so a
    /// subscription's identity is stored once however many maps know it.
    pub uid: Arc<str>,
    pub namespace: Arc<str>,
    pub name: Arc<str>,
    /// Checked at build time, kept as text (its serialization): a parsed URL is four times
    /// the size, and an attempt parses it again for next to nothing.
    pub url: Box<str>,
    pub event_types: Vec<String>,
    /// None when the secret could not be resolved; such a subscription is held like a
    /// paused one and its Ready condition says why.
    pub signer: Option<Signer>,
    pub not_ready: Option<String>,
    pub timeout: Duration,
    pub width: u32,
    /// `spec.delivery.ordering: strict`: the store claims only the oldest unsettled event.
    pub strict_order: bool,
    /// `spec.delivery.rateLimit`.
    pub rate_limit: Option<pace::RateLimit>,
    /// `spec.format`.
    pub format: format::Format,
    pub limits: RetryLimits,
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub paused: bool,
    pub disable_after: u32,
    /// `spec.deadLetterSink.url`, checked like `url` (a thin box: most subscriptions have
    /// none, and the config keeps to its size class).
    pub dead_letter_sink: Option<Box<String>>,
    /// This is the lane of a subscription's dead-letter sink (see
    /// [`SubscriptionConfig::sink_lane`]).
    pub is_sink_lane: bool,
}

/// An absolute http(s) URL with a host and no user info.
fn checked_url(field: &str, text: &str) -> Result<reqwest::Url, String> {
    let url = reqwest::Url::parse(text).map_err(|e| format!("{field}: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
        return Err(format!(
            "{field} must be an absolute http:// or https:// URL"
        ));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(format!("{field} must not carry user info"));
    }
    Ok(url)
}

pub use crate::store::{SINK_SUFFIX, sink_uid};

impl SubscriptionConfig {
    /// Builds the engine's view of a spec. `secrets` are the resolved secret values in the
    /// spec's order (current first), or the reason they could not be read.
    pub fn from_spec(
        uid: impl Into<Arc<str>>,
        namespace: impl Into<Arc<str>>,
        name: impl Into<Arc<str>>,
        spec: &WebhookSubscriptionSpec,
        secrets: Result<Vec<String>, String>,
    ) -> Result<Self, String> {
        let url = checked_url("spec.url", &spec.url)?;
        let dead_letter_sink = spec
            .dead_letter_sink
            .as_ref()
            .map(|sink| checked_url("spec.deadLetterSink.url", &sink.url))
            .transpose()?
            .map(|url| Box::new(url.to_string()));
        let mut headers = Vec::with_capacity(spec.headers.len());
        for (name, value) in &spec.headers {
            let name = HeaderName::try_from(name.as_str())
                .map_err(|_| format!("header name {name:?} is invalid"))?;
            if crate::api::subscription::RESERVED_HEADERS.contains(&name.as_str())
                || crate::api::subscription::FRAMING_HEADERS.contains(&name.as_str())
            {
                return Err(format!(
                    "header {name} is set by herald and cannot be overridden"
                ));
            }
            let value = HeaderValue::try_from(value.as_str())
                .map_err(|_| format!("header {name} has an invalid value"))?;
            headers.push((name, value));
        }
        if let Some(header) = &spec.signing.header {
            let lower = header.to_ascii_lowercase();
            let owned = lower != crate::signing::stripe::DEFAULT_HEADER.to_ascii_lowercase()
                && (crate::api::subscription::RESERVED_HEADERS.contains(&lower.as_str())
                    || crate::api::subscription::FRAMING_HEADERS.contains(&lower.as_str()));
            if owned || spec.headers.keys().any(|k| k.eq_ignore_ascii_case(header)) {
                return Err(format!(
                    "signing.header {header} names a header herald or HTTP framing sets, or one \
                     of spec.headers"
                ));
            }
        }
        let (signer, not_ready) = match secrets {
            Ok(secrets) => match Signer::new(
                spec.signing.scheme,
                &secrets,
                spec.signing.header.as_deref(),
            ) {
                Ok(signer) => (Some(signer), None),
                Err(e) => (None, Some(format!("signing secret unusable: {e}"))),
            },
            Err(reason) => (None, Some(reason)),
        };
        let delivery = &spec.delivery;
        let strict_order = delivery.ordering == crate::api::subscription::Ordering::Strict;
        Ok(Self {
            uid: uid.into(),
            namespace: namespace.into(),
            name: name.into(),
            url: url.as_str().into(),
            event_types: spec.event_types.clone(),
            signer,
            not_ready,
            timeout: delivery.timeout.get(),
            // Strict order: one attempt at a time, whatever maxInFlight says.
            width: if strict_order {
                1
            } else {
                delivery.max_in_flight.max(1)
            },
            strict_order,
            format: spec.format,
            rate_limit: delivery.rate_limit.as_ref().map(|l| pace::RateLimit {
                per_second: l.per_second.max(1),
                burst: l.burst.unwrap_or(l.per_second).max(1),
            }),
            limits: RetryLimits {
                max_attempts: delivery.retry.max_attempts.max(1),
                max_duration: delivery.retry.max_duration.get(),
                initial_backoff: delivery.retry.initial_backoff.get(),
                max_backoff: delivery.retry.max_backoff.get(),
                retry_after_cap: delivery.retry_after_cap.get(),
            },
            headers,
            paused: spec.paused,
            disable_after: spec.disable_after_consecutive_failures,
            dead_letter_sink,
            is_sink_lane: false,
        })
    }

    pub fn matches(&self, event_type: &str) -> bool {
        self.event_types
            .iter()
            .any(|pattern| crate::api::subscription::event_type_matches(pattern, event_type))
    }

    /// The lane that sends this subscription's dead letters to its sink, when it has one:
    /// the sink's URL, this subscription's signer, timeout, width and retry policy, none of
    /// its headers, order or rate limit, and never disabled. It matches no event type and is
    /// no object of its own: the API's names and status never show it.
    pub fn sink_lane(&self) -> Option<Self> {
        let url = self.dead_letter_sink.as_deref()?.as_str().into();
        Some(Self {
            uid: sink_uid(&self.uid).into(),
            namespace: self.namespace.clone(),
            name: format!("{}{SINK_SUFFIX}", self.name).into(),
            url,
            event_types: Vec::new(),
            signer: self.signer.clone(),
            not_ready: self.not_ready.clone(),
            timeout: self.timeout,
            width: self.width,
            strict_order: false,
            rate_limit: None,
            format: format::Format::default(),
            limits: self.limits.clone(),
            headers: Vec::new(),
            paused: self.paused,
            disable_after: 0,
            dead_letter_sink: None,
            is_sink_lane: true,
        })
    }

    /// Held: paused by spec or not deliverable.
    pub fn held(&self) -> bool {
        self.paused || self.signer.is_none()
    }
}

/// A digest of what the engine would run for a spec: the spec and its secret values, or why
/// they cannot be read. Fronts keep this (never the secrets) to skip unchanged upserts.
pub fn config_digest(spec: &WebhookSubscriptionSpec, secrets: Result<&[String], &str>) -> [u8; 32] {
    let mut hash = Sha256::new();
    hash.update(serde_json::to_vec(spec).unwrap_or_default());
    match secrets {
        Ok(values) => values.iter().for_each(|v| {
            hash.update(b"\0ok\0");
            hash.update(v.as_bytes());
        }),
        Err(reason) => {
            hash.update(b"\0err\0");
            hash.update(reason.as_bytes());
        }
    }
    hash.finalize().into()
}

#[cfg(test)]
mod tests {
    /// The engine keeps one config per subscription, 100,000 of them within a memory budget:
    /// with the Arc's counts it must fit the allocator's 320-byte size class (the next is
    /// 384).
    #[test]
    fn a_config_fits_its_size_class() {
        let size = std::mem::size_of::<super::SubscriptionConfig>();
        assert!(size + 16 <= 320, "SubscriptionConfig is {size} bytes");
    }
}
