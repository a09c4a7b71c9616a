//! The ingest API's listener: HTTP/1.1 connections with a header-read timeout (which also
//! ends a connection that sends nothing and an idle keep-alive connection: hyper starts it
//! whenever it waits for a request's head), a deadline for reading each request's body,
//! and a bound on connections open at once. At the bound herald stops accepting (new
//! connections wait in the kernel's backlog) and says so in the log, so the descriptors held
//! by producers can never take those the store, the configuration watcher and the attempts
//! to receivers need. Also: raising the soft `RLIMIT_NOFILE` to the hard limit at start.
//!
//! Its settings are `herald run`'s `--ingest-*` flags ([`crate::cli::RunArgs`]). Over TLS the
//! handshake, too, must finish within the header-read timeout, and holds a place under the
//! connection bound while it runs.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{ConnectInfo, Request};
use axum::response::Response;
use futures::StreamExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use super::parse_errors::JsonParseErrors;

/// Limits of the ingest listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// A request's head must arrive within this (and an idle connection closes after it).
    pub header_read: Duration,
    /// A request's body must arrive within this, from the moment its head did.
    pub body_read: Duration,
    /// Connections open at once.
    pub max_connections: usize,
}

/// Descriptors kept apart from producers' connections: the store, the configuration
/// folder, the health listener, logs, DNS.
const RESERVED_DESCRIPTORS: u64 = 256;

impl Limits {
    /// These limits with the connection bound lowered so that producers' connections,
    /// `max_in_flight` attempts to receivers and [`RESERVED_DESCRIPTORS`] fit the
    /// descriptor limit together.
    pub fn fitted(mut self, max_in_flight: u32) -> Self {
        if let Some(nofile) = nofile_limit() {
            let room = nofile.saturating_sub(u64::from(max_in_flight) + RESERVED_DESCRIPTORS);
            let fits = usize::try_from(room).unwrap_or(usize::MAX).max(16);
            if fits < self.max_connections {
                tracing::warn!(
                    nofile,
                    max_in_flight,
                    max_connections = fits,
                    "the descriptor limit is low: ingest connections are bounded lower to leave room for attempts and the store"
                );
                self.max_connections = fits;
            }
        }
        self
    }
}

/// The soft `RLIMIT_NOFILE`.
fn nofile_limit() -> Option<u64> {
    rlimit::getrlimit(rlimit::Resource::NOFILE)
        .ok()
        .map(|(soft, _)| soft)
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (herald holds a descriptor per
/// attempt on the wire and per producer connection). Returns the soft limit in force.
pub fn raise_nofile_limit() -> Option<u64> {
    let (soft, hard) = rlimit::getrlimit(rlimit::Resource::NOFILE).ok()?;
    if soft >= hard {
        return Some(soft);
    }
    match rlimit::setrlimit(rlimit::Resource::NOFILE, hard, hard) {
        Ok(()) => Some(hard),
        Err(e) => {
            tracing::warn!(soft, hard, error = %e, "cannot raise the open-file limit to the hard limit");
            Some(soft)
        }
    }
}

/// A request body that did not arrive within [`Limits::body_read`].
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {0:?}")]
pub struct BodyTimeout(pub Duration);

/// Gives the request's body a deadline: past it, reading the body fails with
/// [`BodyTimeout`] (the handler answers 408).
fn with_body_deadline(request: Request, limit: Duration) -> Request {
    let deadline = tokio::time::Instant::now() + limit;
    let (parts, body) = request.into_parts();
    let stream = body.into_data_stream();
    let timed = futures::stream::unfold(Some(stream), move |state| async move {
        let mut stream = state?;
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(Some(item)) => Some((item, Some(stream))),
            Ok(None) => None,
            Err(_) => Some((Err(axum::Error::new(BodyTimeout(limit))), None)),
        }
    });
    Request::from_parts(parts, Body::from_stream(timed))
}

/// The leaf certificate a TLS client authenticated with (verified by the acceptor's client
/// verifier), as a request extension.
#[derive(Clone, Debug)]
pub struct ClientCertificate(pub Arc<rustls_pki_types::CertificateDer<'static>>);

/// Serves `app` on `listener` with `limits` until `shutdown` resolves, then lets the
/// requests in progress finish. With `tls`, every connection is a TLS one: its handshake
/// holds a place under the connection bound and must finish within the header-read
/// timeout, after which the request timeouts apply as over plain TCP.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let body_read = limits.body_read;
    // One service per connection, so every request carries its client's address (axum's
    // `ConnectInfo`): failed authentications are limited per address.
    // The client's TLS certificate, when it showed one, rides along too (the aggregated
    // API reads the API server's front-proxy name from it).
    let service = move |peer: SocketAddr, certificate: Option<ClientCertificate>| {
        let app = app.clone();
        hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            let app = app.clone();
            let certificate = certificate.clone();
            async move {
                let mut request = with_body_deadline(request.map(Body::new), body_read);
                request.extensions_mut().insert(ConnectInfo(peer));
                if let Some(certificate) = certificate {
                    request.extensions_mut().insert(certificate);
                }
                let response: Response = tower_call(app, request).await;
                Ok::<_, Infallible>(response)
            }
        })
    };
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read)
        .keep_alive(true);
    let connections = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    tokio::pin!(shutdown);
    let mut full = false;
    loop {
        let permit = match connections.clone().try_acquire_owned() {
            Ok(permit) => {
                full = false;
                permit
            }
            Err(_) => {
                if !full {
                    tracing::warn!(
                        max_connections = limits.max_connections,
                        "ingest connection limit reached: new connections wait until one closes (--ingest-max-connections)"
                    );
                    full = true;
                }
                tokio::select! {
                    permit = connections.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
                    () = &mut shutdown => break,
                }
            }
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors (EMFILE) or a connection reset before accept: wait a
                    // moment rather than spin; the connections in progress free descriptors.
                    tracing::warn!(error = %e, "accepting an ingest connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let Some(tls) = &tls else {
            let io = TokioIo::new(JsonParseErrors::new(stream));
            let connection = http.serve_connection(io, service(peer, None));
            let connection = graceful.watch(connection);
            tokio::spawn(async move {
                let _ = connection.await;
                drop(permit);
            });
            continue;
        };
        // The handshake runs in the connection's task, never in this loop, so a client that
        // stays silent holds only its own place, and only until the header-read timeout.
        let handshake = tls.accept(stream);
        let (http, service, watcher) = (http.clone(), service.clone(), graceful.watcher());
        let handshake_timeout = limits.header_read;
        tokio::spawn(async move {
            match tokio::time::timeout(handshake_timeout, handshake).await {
                Ok(Ok(stream)) => {
                    let certificate = stream
                        .get_ref()
                        .1
                        .peer_certificates()
                        .and_then(|chain| chain.first())
                        .map(|leaf| ClientCertificate(Arc::new(leaf.clone().into_owned())));
                    let service = service(peer, certificate);
                    // Inside TLS: hyper's parse-error answers are rewritten before encryption.
                    let io = TokioIo::new(JsonParseErrors::new(stream));
                    let connection = http.serve_connection(io, service);
                    let _ = watcher.watch(connection).await;
                }
                Ok(Err(e)) => tracing::debug!(error = %e, "ingest TLS handshake failed"),
                Err(_) => tracing::debug!(
                    timeout = ?handshake_timeout,
                    "ingest TLS handshake did not finish in time"
                ),
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

async fn tower_call(app: Router, request: Request) -> Response {
    use tower::ServiceExt;
    match app.oneshot(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// Whether an ingest API on `address` without a token is open to others than this machine.
pub fn exposed_without_auth(address: std::net::SocketAddr, token: bool) -> bool {
    !token && !address.ip().is_loopback()
}

/// Warns loudly at start when the API listens beyond loopback with no authentication.
pub fn warn_if_exposed(address: std::net::SocketAddr, token: bool) {
    if exposed_without_auth(address, token) {
        tracing::warn!(%address, "THE INGEST API IS OPEN: it listens beyond loopback and no --publish-token (HERALD_PUBLISH_TOKEN) is set, so anyone who can reach it may publish, read attempts, replay and re-enable");
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_open_api_is_one_beyond_loopback_without_a_token() {
        let open = |a: &str, token| super::exposed_without_auth(a.parse().unwrap(), token);
        assert!(open("0.0.0.0:8080", false));
        assert!(open("[::]:8080", false));
        assert!(open("10.1.2.3:8080", false));
        assert!(!open("0.0.0.0:8080", true));
        assert!(!open("127.0.0.1:8080", false));
        assert!(!open("[::1]:8080", false));
    }
}
