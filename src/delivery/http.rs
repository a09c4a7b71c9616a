//! One signed POST per attempt, over a shared connection pool (reqwest with rustls).
//! Redirects are not followed; the egress guard checks IP-literal URLs here and resolved
//! names at connect time.

use std::error::Error as _;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use reqwest::header::{HeaderMap, HeaderName, HeaderValue, USER_AGENT};

use super::egress::{EgressPolicy, GuardedResolver, Refused};
use super::format::{self, Format};
use super::outcome::{Outcome, classify_status, parse_retry_after};
use crate::signing::Signer;
use crate::store::{Claimed, EXCERPT_BYTES, excerpt};

/// Headers herald adds to every attempt besides the signature's.
pub const EVENT_ID_HEADER: &str = "herald-event-id";
pub const EVENT_TYPE_HEADER: &str = "herald-event-type";
pub const ATTEMPT_HEADER: &str = "herald-attempt";

/// What one attempt needs to know about its subscription.
pub struct Target<'a> {
    pub url: &'a str,
    pub signer: &'a Signer,
    pub timeout: Duration,
    pub headers: &'a [(HeaderName, HeaderValue)],
    /// What the request carries, and the namespace (a CloudEvent's default source).
    pub format: Format,
    pub namespace: &'a str,
    /// The attempt's span, when its event came with a trace context: its `traceparent`
    /// and `tracestate` go out as headers.
    pub trace: Option<&'a crate::delivery::trace::AttemptSpan>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttemptResult {
    pub outcome: Outcome,
    pub status: Option<u16>,
    pub retry_after: Option<Duration>,
    pub latency: Duration,
    /// Response excerpt, or what went wrong.
    pub message: String,
    /// The egress guard refused the address: nothing was sent.
    pub refused: bool,
}

#[derive(Clone)]
pub struct HttpSender {
    client: reqwest::Client,
    egress: Arc<EgressPolicy>,
}

impl HttpSender {
    pub fn new(egress: EgressPolicy) -> anyhow::Result<Self> {
        Self::with_extra_roots(egress, Vec::new())
    }

    /// A sender that trusts `extra_roots` (CA certificates, DER) for HTTPS receivers, besides
    /// the system's roots that rustls-platform-verifier loads.
    pub fn with_extra_roots(
        egress: EgressPolicy,
        extra_roots: Vec<rustls_pki_types::CertificateDer<'static>>,
    ) -> anyhow::Result<Self> {
        // reqwest is built without a bundled crypto provider; use ring, as kube does.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let egress = Arc::new(egress);
        let extra_roots = extra_roots
            .iter()
            .map(|der| reqwest::Certificate::from_der(der))
            .collect::<Result<Vec<_>, _>>()?;
        let client = reqwest::Client::builder()
            .tls_certs_merge(extra_roots)
            .redirect(reqwest::redirect::Policy::none())
            .dns_resolver(Arc::new(GuardedResolver {
                policy: egress.clone(),
            }))
            .no_proxy()
            .tcp_nodelay(true)
            .pool_idle_timeout(Duration::from_secs(60))
            .connect_timeout(Duration::from_secs(10))
            .build()?;
        Ok(Self { client, egress })
    }

    pub async fn send(&self, target: &Target<'_>, claimed: &Claimed) -> AttemptResult {
        let started = Instant::now();
        let result = |outcome, status, retry_after, message: String| AttemptResult {
            outcome,
            status,
            retry_after,
            latency: started.elapsed(),
            message,
            refused: false,
        };

        // Checked when the subscription was read; a failure here would be a bug, and costs
        // this attempt only.
        let url = match reqwest::Url::parse(target.url) {
            Ok(url) => url,
            Err(e) => return result(Outcome::Terminal, None, None, format!("spec.url: {e}")),
        };
        if let Some(refused) = self.refused_literal(&url) {
            return AttemptResult {
                refused: true,
                ..result(Outcome::Terminal, None, None, refused.to_string())
            };
        }

        let now = crate::signing::unix_now();
        let rendered = format::render(target.format, target.namespace, &claimed.body);
        let mut headers = HeaderMap::with_capacity(8 + target.headers.len());
        for (name, value) in target.headers {
            headers.append(name.clone(), value.clone());
        }
        for (name, value) in target.signer.sign(&claimed.event_id, now, &rendered.body) {
            if let (Ok(name), Ok(value)) =
                (HeaderName::try_from(name), HeaderValue::try_from(value))
            {
                headers.insert(name, value);
            }
        }
        // The content type, and a CloudEvent's attributes in binary mode.
        for (name, value) in &rendered.headers {
            if let Ok(value) = HeaderValue::try_from(value.as_str()) {
                headers.insert(*name, value);
            }
        }
        headers.insert(
            USER_AGENT,
            HeaderValue::from_static(concat!("herald/", env!("CARGO_PKG_VERSION"))),
        );
        if let Ok(id) = HeaderValue::from_str(&claimed.event_id) {
            headers.insert(EVENT_ID_HEADER, id);
        }
        if let Ok(kind) = HeaderValue::from_str(&claimed.event_type) {
            headers.insert(EVENT_TYPE_HEADER, kind);
        }
        headers.insert(ATTEMPT_HEADER, HeaderValue::from(claimed.attempt));
        if let Some(trace) = target.trace {
            if let Ok(value) = HeaderValue::from_str(&trace.traceparent) {
                headers.insert("traceparent", value);
            }
            if let Some(Ok(value)) = trace.tracestate.as_deref().map(HeaderValue::from_str) {
                headers.insert("tracestate", value);
            }
        }

        let mut request = self
            .client
            .post(url)
            .headers(headers)
            .timeout(target.timeout)
            .body(rendered.body);

        // Out of descriptors is herald's own shortage, not the receiver's failure: the attempt
        // waits for a descriptor (within its timeout) instead of failing at once, so a process
        // at its limit queues its deliveries rather than count them against receivers.
        let sent = loop {
            let retry = request.try_clone();
            match request.send().await {
                Err(error) if out_of_descriptors(&error) && started.elapsed() < target.timeout => {
                    match retry {
                        Some(again) => request = again,
                        None => break Err(error),
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                sent => break sent,
            }
        };
        let mut response = match sent {
            Ok(response) => response,
            Err(error) => {
                return match egress_refusal(&error) {
                    Some(reason) => AttemptResult {
                        refused: true,
                        ..result(Outcome::Terminal, None, None, reason)
                    },
                    None => result(
                        Outcome::Transient,
                        None,
                        None,
                        describe(&error, target.timeout),
                    ),
                };
            }
        };
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, SystemTime::now()));

        // Only the excerpt is kept, so read no more than that.
        let mut body = Vec::new();
        let read_error = loop {
            if body.len() >= EXCERPT_BYTES {
                break None;
            }
            match response.chunk().await {
                Ok(Some(chunk)) => body.extend_from_slice(&chunk),
                Ok(None) => break None,
                Err(e) => break Some(e),
            }
        };
        let outcome = classify_status(status);
        let mut message = excerpt(&body);
        if let Some(e) = read_error
            && outcome == Outcome::Accepted
        {
            // The status is the receiver's acknowledgment; a broken body does not undo it.
            message = format!(
                "{message} (response body cut: {})",
                describe(&e, target.timeout)
            );
        }
        if (300..400).contains(&status) && message.is_empty() {
            message = "redirect not followed".into();
        }
        result(outcome, Some(status), retry_after, message)
    }

    fn refused_literal(&self, url: &reqwest::Url) -> Option<Refused> {
        let ip = match url.host()? {
            url::Host::Ipv4(v4) => std::net::IpAddr::V4(v4),
            url::Host::Ipv6(v6) => std::net::IpAddr::V6(v6),
            url::Host::Domain(_) => return None,
        };
        self.egress.check(ip).err()
    }
}

/// The guard's refusal, if that is why the connection failed.
fn egress_refusal(error: &reqwest::Error) -> Option<String> {
    let mut source = error.source();
    while let Some(e) = source {
        let text = e.to_string();
        if text.contains("egress refused") {
            return Some(text);
        }
        source = e.source();
    }
    None
}

/// The TLS error in `error`'s chain, if the handshake with the receiver failed.
fn tls_error(error: &reqwest::Error) -> Option<&rustls::Error> {
    let mut source = error.source();
    while let Some(e) = source {
        // rustls's error reaches reqwest wrapped in io::Errors (tokio-rustls, then
        // hyper-rustls), whose source() skips what they wrap: unwrap them one by one.
        let mut wrapped = e;
        loop {
            if let Some(tls) = wrapped.downcast_ref::<rustls::Error>() {
                return Some(tls);
            }
            match wrapped
                .downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
            {
                Some(inner) => wrapped = inner,
                None => break,
            }
        }
        source = e.source();
    }
    None
}

/// Why rustls refused a receiver's certificate, in words.
fn certificate_problem(error: &rustls::CertificateError) -> String {
    match error {
        rustls::CertificateError::UnknownIssuer => {
            "not issued by a CA herald trusts (UnknownIssuer; \
             --egress-ca-file adds a private CA)"
                .into()
        }
        rustls::CertificateError::NotValidForName => {
            "certificate not valid for the receiver's host name".into()
        }
        e => e.to_string(),
    }
}

/// A transport error in words, without anything secret (URLs carry no credentials: the
/// schema refuses user info).
///
/// A refused receiver certificate (a name it is not valid for, an untrusted or expired
/// issuer) says so first. Its attempt stays transient, like any other connect error, and
/// is retried on the subscription's schedule: certificates are fixed by the receiver's
/// owner (a renewal, the right certificate on a virtual host, cert-manager catching up)
/// without anything changing on herald's side, so a terminal outcome would dead-letter
/// events that a later attempt delivers. One that stays broken runs out of attempts and
/// counts towards `disableAfterConsecutiveFailures` like a receiver that is down.
/// Whether sending failed because this process (or the system) is out of file descriptors.
fn out_of_descriptors(error: &reqwest::Error) -> bool {
    let mut source = std::error::Error::source(error);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && matches!(io.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
        {
            return true;
        }
        source = e.source();
    }
    false
}

fn describe(error: &reqwest::Error, timeout: Duration) -> String {
    if error.is_timeout() {
        return format!("timed out after {}ms", timeout.as_millis());
    }
    if let Some(tls) = tls_error(error) {
        let text = match tls {
            rustls::Error::InvalidCertificate(e) => {
                format!("TLS certificate refused: {}", certificate_problem(e))
            }
            e => format!("TLS handshake failed: {e}"),
        };
        return text.chars().take(EXCERPT_BYTES).collect();
    }
    let mut text = if error.is_connect() {
        "connect error".to_string()
    } else {
        "transport error".to_string()
    };
    let mut source = error.source();
    while let Some(e) = source {
        text.push_str(": ");
        text.push_str(&e.to_string());
        source = e.source();
    }
    text.chars().take(EXCERPT_BYTES).collect()
}
