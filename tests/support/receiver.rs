//! Real HTTP receivers on 127.0.0.1 whose behaviour each test scripts per path: answer a
//! status (with Retry-After), follow a script, hang without ever answering, redirect, send a
//! large body; plus a listener that closes every connection. Every request is recorded with
//! its arrival time and whether its signature verified.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use herald::api::SigningScheme;
use herald::signing::Signer;
use tokio::sync::Notify;

pub const SECRET: &str = "whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYX";

#[derive(Clone, Debug)]
pub enum Behaviour {
    /// Answer this status.
    Status(u16),
    /// Answer the first request with this status and Retry-After header, then 204.
    RetryAfterOnce(u16, String),
    /// Answer the first request with this status and a Retry-After HTTP date this far
    /// ahead of the moment of the answer, then 204.
    RetryAfterDateOnce(u16, Duration),
    /// Answer these statuses in turn, then the last one forever.
    Script(Vec<u16>),
    /// Accept the request and never answer.
    Hang,
    /// Answer this status after holding the request this long.
    SlowStatus(Duration, u16),
    /// 302 to another path.
    Redirect(String),
    /// 200 with a body of this many bytes.
    BigBody(usize),
}

#[derive(Clone, Debug)]
pub struct Hit {
    pub path: String,
    pub headers: HashMap<String, String>,
    pub body: Vec<u8>,
    pub at: Instant,
    pub verified: bool,
    /// The status answered; None for a request held without an answer.
    pub answered: Option<u16>,
}

impl Hit {
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(String::as_str)
            .unwrap_or_default()
    }
}

struct Shared {
    behaviours: Mutex<HashMap<String, Behaviour>>,
    hits: Mutex<Vec<Hit>>,
    counters: Mutex<HashMap<String, usize>>,
    changed: Notify,
    signer: Signer,
}

#[derive(Clone)]
pub struct Receiver {
    pub base: String,
    shared: Arc<Shared>,
    /// HTTPS receivers: TLS handshakes that failed (the client refused the certificate).
    pub failed_handshakes: Arc<AtomicUsize>,
}

impl Receiver {
    /// Starts a receiver on a free loopback port; unknown paths answer 204.
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = listener.local_addr().unwrap();
        let (shared, app) = Self::app();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Self {
            base: format!("http://{addr}"),
            shared,
            failed_handshakes: Arc::default(),
        }
    }

    /// Starts a receiver that speaks HTTPS with `tls` on a free loopback port, at
    /// `https://localhost:PORT`; it behaves as [`Receiver::start`]'s.
    pub async fn start_tls(tls: Arc<rustls::ServerConfig>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (shared, app) = Self::app();
        let acceptor = tokio_rustls::TlsAcceptor::from(tls);
        let failed_handshakes = Arc::new(AtomicUsize::new(0));
        let failed = failed_handshakes.clone();
        tokio::spawn(async move {
            loop {
                let Ok((socket, _)) = listener.accept().await else {
                    return;
                };
                let (acceptor, app, failed) = (acceptor.clone(), app.clone(), failed.clone());
                tokio::spawn(async move {
                    let Ok(stream) = acceptor.accept(socket).await else {
                        failed.fetch_add(1, Ordering::SeqCst);
                        return;
                    };
                    let service = hyper_util::service::TowerToHyperService::new(app);
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self {
            base: format!("https://localhost:{port}"),
            shared,
            failed_handshakes,
        }
    }

    fn app() -> (Arc<Shared>, axum::Router) {
        let shared = Arc::new(Shared {
            behaviours: Mutex::new(HashMap::new()),
            hits: Mutex::new(Vec::new()),
            counters: Mutex::new(HashMap::new()),
            changed: Notify::new(),
            signer: Signer::new(SigningScheme::StandardWebhooks, &[SECRET], None).unwrap(),
        });
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(shared.clone());
        (shared, app)
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn set(&self, path: &str, behaviour: Behaviour) {
        self.shared
            .behaviours
            .lock()
            .unwrap()
            .insert(path.to_string(), behaviour);
    }

    pub fn hits(&self) -> Vec<Hit> {
        self.shared.hits.lock().unwrap().clone()
    }

    pub fn hits_for(&self, path: &str) -> Vec<Hit> {
        self.hits().into_iter().filter(|h| h.path == path).collect()
    }

    /// Number of requests received so far.
    pub fn count(&self) -> usize {
        self.shared.hits.lock().unwrap().len()
    }

    /// Waits until `done` holds for the recorded hits, or panics with `what` at the deadline.
    /// `done` runs under the lock, at most every few milliseconds, so waiting stays cheap
    /// however many requests arrive.
    pub async fn wait_until(
        &self,
        what: &str,
        deadline: Duration,
        done: impl Fn(&[Hit]) -> bool,
    ) -> Vec<Hit> {
        self.wait_for(what, deadline, |hits| done(hits).then(|| hits.to_vec()))
            .await
    }

    /// For each of `sent` (an event id and when its publish started), how long until it
    /// arrived (by its `webhook-id`), once the `sent.len()` hits after the first `before`
    /// have come, within `deadline`.
    #[allow(dead_code)] // the benchmarks only
    pub async fn arrivals(
        &self,
        what: &str,
        deadline: Duration,
        before: usize,
        sent: &[(String, Instant)],
    ) -> Vec<Duration> {
        let arrived: HashMap<String, Instant> = self
            .wait_for(what, deadline, |hits| {
                (hits.len() >= before + sent.len()).then(|| {
                    hits[before..]
                        .iter()
                        .map(|h| (h.header("webhook-id").to_string(), h.at))
                        .collect()
                })
            })
            .await;
        sent.iter()
            .map(|(id, at)| arrived[id.as_str()] - *at)
            .collect()
    }

    /// As [`Receiver::wait_until`], returning only what `found` picks out of the hits (for
    /// example one arrival time) instead of a copy of them all: what a benchmark that waits
    /// thousands of times among thousands of hits needs.
    pub async fn wait_for<T>(
        &self,
        what: &str,
        deadline: Duration,
        found: impl Fn(&[Hit]) -> Option<T>,
    ) -> T {
        let end = tokio::time::Instant::now() + deadline;
        loop {
            let notified = self.shared.changed.notified();
            if let Some(value) = found(&self.shared.hits.lock().unwrap()) {
                return value;
            }
            if tokio::time::timeout_at(end, notified).await.is_err() {
                let mut per_path: HashMap<String, usize> = HashMap::new();
                {
                    let hits = self.shared.hits.lock().unwrap();
                    if let Some(value) = found(&hits) {
                        return value;
                    }
                    for h in hits.iter() {
                        *per_path.entry(h.path.clone()).or_default() += 1;
                    }
                }
                panic!(
                    "timed out after {deadline:?} waiting for {what}; hits per path: {per_path:?}"
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

async fn handle(
    State(shared): State<Arc<Shared>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path().to_string();
    let pairs: Vec<(&str, &str)> = headers
        .iter()
        .filter_map(|(k, v)| Some((k.as_str(), v.to_str().ok()?)))
        .collect();
    let now = herald::signing::unix_now();
    let verified = shared
        .signer
        .verify(pairs.iter().copied(), &body, now, Duration::from_secs(300))
        .is_ok();
    let seen = {
        let mut counters = shared.counters.lock().unwrap();
        let n = counters.entry(path.clone()).or_default();
        *n += 1;
        *n
    };
    let at = Instant::now();
    let behaviour = shared.behaviours.lock().unwrap().get(&path).cloned();
    let status = |s: u16| StatusCode::from_u16(s).unwrap();
    let response = match behaviour.clone() {
        None => Some(StatusCode::NO_CONTENT.into_response()),
        Some(Behaviour::Status(s)) => Some(status(s).into_response()),
        Some(Behaviour::RetryAfterOnce(s, value)) if seen == 1 => {
            Some((status(s), [("retry-after", value)]).into_response())
        }
        Some(Behaviour::RetryAfterOnce(..)) => Some(StatusCode::NO_CONTENT.into_response()),
        Some(Behaviour::RetryAfterDateOnce(s, ahead)) if seen == 1 => {
            let date = httpdate::fmt_http_date(std::time::SystemTime::now() + ahead);
            Some((status(s), [("retry-after", date)]).into_response())
        }
        Some(Behaviour::RetryAfterDateOnce(..)) => Some(StatusCode::NO_CONTENT.into_response()),
        Some(Behaviour::Script(list)) => {
            Some(status(list[(seen - 1).min(list.len() - 1)]).into_response())
        }
        Some(Behaviour::Hang) => None,
        Some(Behaviour::SlowStatus(_, s)) => Some(status(s).into_response()),
        Some(Behaviour::Redirect(to)) => {
            Some((StatusCode::FOUND, [("location", to)]).into_response())
        }
        Some(Behaviour::BigBody(n)) => Some((StatusCode::OK, "x".repeat(n)).into_response()),
    };
    // Recorded before the answer leaves, with the status it carries.
    shared.hits.lock().unwrap().push(Hit {
        path,
        headers: pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        body: body.to_vec(),
        at,
        verified,
        answered: response.as_ref().map(|r| r.status().as_u16()),
    });
    shared.changed.notify_waiters();
    if let Some(Behaviour::SlowStatus(hold, _)) = behaviour {
        tokio::time::sleep(hold).await;
    }
    match response {
        Some(response) => response,
        None => std::future::pending().await,
    }
}

/// A listener that reads each request and closes the connection without answering.
pub async fn closing_listener() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let _ = tokio::io::AsyncReadExt::read(&mut socket, &mut buf).await;
                drop(socket);
            });
        }
    });
    format!("http://{addr}")
}
