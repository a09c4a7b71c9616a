//! Who may publish and read. The ingest API asks an [`Authorizer`]; standalone mode uses a
//! static bearer token, and the operator plugs in Kubernetes TokenReview and
//! SubjectAccessReview.

use async_trait::async_trait;
use axum::http::HeaderMap;
use std::net::IpAddr;
use subtle::ConstantTimeEq;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verb {
    /// POST events into a namespace.
    Publish,
    /// Read a subscription's attempts (with none named: every subscription's of the namespace).
    Read,
    /// Replay dead letters or re-enable a subscription.
    Manage,
}

pub struct AccessRequest<'a> {
    pub verb: Verb,
    pub namespace: &'a str,
    pub subscription: Option<&'a str>,
    pub headers: &'a HeaderMap,
    /// The client's address, when the listener knows it: failed authentications are
    /// limited per address.
    pub peer: Option<IpAddr>,
}

#[derive(Clone, Debug, thiserror::Error)]
pub enum AuthError {
    #[error("{0}")]
    Unauthenticated(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("authorization is unavailable: {0}")]
    Unavailable(String),
    /// Too many failed authentications from this client address just now.
    #[error("{0}")]
    Throttled(String),
}

#[async_trait]
pub trait Authorizer: Send + Sync + 'static {
    async fn authorize(&self, request: &AccessRequest<'_>) -> Result<(), AuthError>;
}

/// The bearer token of an `Authorization: Bearer <token>` header.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers
        .get(axum::http::header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Standalone mode: when a token is configured, every API call must carry it.
pub struct StaticToken(pub Option<String>);

#[async_trait]
impl Authorizer for StaticToken {
    async fn authorize(&self, request: &AccessRequest<'_>) -> Result<(), AuthError> {
        let Some(expected) = &self.0 else {
            return Ok(());
        };
        match bearer(request.headers) {
            None => Err(AuthError::Unauthenticated(
                "a bearer token is required".into(),
            )),
            Some(token) if bool::from(token.as_bytes().ct_eq(expected.as_bytes())) => Ok(()),
            Some(_) => Err(AuthError::Unauthenticated(
                "the bearer token is not valid".into(),
            )),
        }
    }
}
