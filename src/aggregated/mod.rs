//! The aggregated API: herald served behind the Kubernetes API server as the group
//! `delivery.herald.dev/v1alpha1` (an `APIService`), so producers publish with their own
//! kubeconfig (`kubectl create -f event.yaml`, any client-go program), authorized by the
//! API server's RBAC and recorded in its audit log. A front like the ingest API: it knows
//! the engine, never the store or the controller.
//!
//! - [`front_proxy`]: only the API server may call (its front-proxy client certificate),
//!   and it names the caller.
//! - [`discovery`]: the group, its version and resources, as `kubectl api-resources` reads
//!   them.
//! - [`webhookevents`]: `create` publishes (one event, or a batch of up to 1,000).
//! - [`replays`]: replaying dead letters and re-enabling a subscription, as creates.
//! - [`deliveries`]: the attempt log, listed (as a table for kubectl), paged and watched.
//!
//! Errors are Kubernetes `Status` objects, so kubectl prints them as it prints its own.

pub mod deliveries;
pub mod discovery;
pub mod front_proxy;
pub mod replays;
pub mod webhookevents;

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::json;

use crate::delivery::engine::Engine;
use crate::ingest::ApiError;
use crate::ingest::listener::ClientCertificate;
use front_proxy::Trust;

/// The API group and version herald serves.
pub const GROUP: &str = "delivery.herald.dev";
pub const VERSION: &str = "v1alpha1";
pub const GROUP_VERSION: &str = "delivery.herald.dev/v1alpha1";

#[derive(Clone)]
pub struct Api {
    pub engine: Arc<Engine>,
    pub trust: Arc<Trust>,
    /// Largest event data, as on the ingest API.
    pub max_body: usize,
}

/// The routes of the group. Discovery answers any caller the TLS acceptor let in (the API
/// server asks for it in the name of its own aggregator, and it holds nothing secret);
/// resources need the user the front proxy names.
pub fn router(api: Api) -> Router {
    let resources = Router::new()
        .route(
            "/apis/delivery.herald.dev/v1alpha1/namespaces/{namespace}/webhookevents",
            post(webhookevents::create),
        )
        .route(
            "/apis/delivery.herald.dev/v1alpha1/namespaces/{namespace}/webhookevents/{name}",
            any(write_once),
        )
        .route(
            "/apis/delivery.herald.dev/v1alpha1/namespaces/{namespace}/webhookeventbatches",
            post(webhookevents::create_batch),
        )
        .route(
            "/apis/delivery.herald.dev/v1alpha1/namespaces/{namespace}/webhookeventbatches/{name}",
            any(write_once),
        )
        .route(
            "/apis/delivery.herald.dev/v1alpha1/namespaces/{namespace}/replays/{name}",
            any(write_once),
        )
        .route(
            "/apis/delivery.herald.dev/v1alpha1/namespaces/{namespace}/enablements/{name}",
            any(write_once),
        )
        .route(
            "/apis/delivery.herald.dev/v1alpha1/namespaces/{namespace}/deliveries",
            get(deliveries::list),
        )
        .route(
            "/apis/delivery.herald.dev/v1alpha1/namespaces/{namespace}/replays",
            post(replays::create_replay),
        )
        .route(
            "/apis/delivery.herald.dev/v1alpha1/namespaces/{namespace}/enablements",
            post(replays::create_enablement),
        )
        .route(
            "/apis/delivery.herald.dev/v1alpha1/namespaces/{namespace}/deliveries/{name}",
            get(deliveries::get),
        )
        .route_layer(axum::middleware::from_fn_with_state(
            api.clone(),
            require_user,
        ));
    Router::new()
        .route("/apis", get(discovery::group_list))
        .route("/apis/delivery.herald.dev", get(discovery::group))
        .route(
            "/apis/delivery.herald.dev/v1alpha1",
            get(discovery::resources),
        )
        .route("/openapi/v2", get(discovery::openapi_v2))
        .route("/openapi/v3", get(discovery::openapi_v3_index))
        .route(
            "/openapi/v3/apis/delivery.herald.dev/v1alpha1",
            get(discovery::openapi_v3),
        )
        .merge(resources)
        .fallback(not_found)
        .with_state(api)
}

/// Lets through a request the front proxy made and named a user for; the user rides on as
/// an extension.
async fn require_user(State(api): State<Api>, mut request: Request, next: Next) -> Response {
    let certificate = request
        .extensions()
        .get::<ClientCertificate>()
        .map(|c| c.0.clone());
    match api
        .trust
        .front_proxy()
        .identity(certificate.as_deref(), request.headers())
    {
        Ok(identity) => {
            request.extensions_mut().insert(identity);
            next.run(request).await
        }
        Err(refusal) => status(
            StatusCode::UNAUTHORIZED,
            "Unauthorized",
            &refusal.to_string(),
            None,
        ),
    }
}

/// Anything but a create on one object of a created kind (an event, a replay, an
/// enablement): none is kept to be read, changed or deleted (a published event's
/// deliveries are what changes).
pub async fn write_once() -> Refused {
    Refused::new(status(
        StatusCode::METHOD_NOT_ALLOWED,
        "MethodNotAllowed",
        "write-once: once created it cannot be read, changed or deleted here",
        None,
    ))
}

async fn not_found() -> Response {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        "the server could not find the requested resource",
        None,
    )
}

/// A Kubernetes `Status` answer.
pub(crate) fn status(
    code: StatusCode,
    reason: &str,
    message: &str,
    details: Option<serde_json::Value>,
) -> Response {
    let mut body = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    });
    if let Some(details) = details {
        body["details"] = details;
    }
    (code, axum::Json(body)).into_response()
}

/// The `Status` reason Kubernetes clients know for an HTTP status.
fn reason(code: StatusCode) -> &'static str {
    match code.as_u16() {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        405 => "MethodNotAllowed",
        408 => "Timeout",
        409 => "Conflict",
        413 => "RequestEntityTooLarge",
        415 => "UnsupportedMediaType",
        422 => "Invalid",
        429 => "TooManyRequests",
        503 => "ServiceUnavailable",
        _ => "InternalError",
    }
}

/// An ingest refusal as a `Status`: the same HTTP status, herald's stable code as the
/// cause's reason, and `retryAfterSeconds` when the refusal is a busy one (client-go waits
/// that long before it tries again).
impl From<ApiError> for Refused {
    fn from(e: ApiError) -> Self {
        let mut details = json!({
            "group": GROUP,
            "causes": [{"reason": e.code(), "message": e.message()}],
        });
        if let Some(seconds) = e.retry_after() {
            details["retryAfterSeconds"] = seconds.into();
        }
        let mut response = status(e.status(), reason(e.status()), e.message(), Some(details));
        if let Some(seconds) = e.retry_after() {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, seconds.into());
        }
        Refused::new(response)
    }
}

/// A created object as clients send it: `apiVersion`, `kind`, `metadata`, `spec` (a
/// `status` is ignored, as a create ignores it).
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct Created<S> {
    api_version: Option<String>,
    kind: Option<String>,
    #[serde(default)]
    pub metadata: ObjectMeta,
    pub spec: S,
    #[serde(default)]
    #[allow(dead_code)]
    status: Option<serde::de::IgnoredAny>,
}

pub(crate) fn bad_request(message: impl Into<String>) -> Refused {
    Refused::new(status(
        StatusCode::BAD_REQUEST,
        "BadRequest",
        &message.into(),
        None,
    ))
}

/// Decodes a create's body as a `kind` of this group, in `namespace` when it names one.
pub(crate) fn created<S: serde::de::DeserializeOwned>(
    bytes: &[u8],
    kind: &str,
    namespace: &str,
) -> Result<Created<S>, Refused> {
    let object: Created<S> = serde_json::from_slice(bytes)
        .map_err(|e| bad_request(format!("the body is not a {kind}: {e}")))?;
    if object
        .api_version
        .as_deref()
        .is_some_and(|v| v != GROUP_VERSION)
        || object.kind.as_deref().is_some_and(|k| k != kind)
    {
        return Err(bad_request(format!(
            "the body must be a {GROUP_VERSION} {kind}"
        )));
    }
    if object
        .metadata
        .namespace
        .as_deref()
        .is_some_and(|ns| ns != namespace)
    {
        return Err(bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        ));
    }
    Ok(object)
}

/// A create's `dryRun`: `All` checks without doing, and nothing else is a dry run. Other
/// options kubectl sends are taken: `fieldManager` (herald keeps no managed fields),
/// `fieldValidation` (unknown fields are always refused, as `Strict` asks), `pretty`.
pub(crate) fn dry_run(pairs: &[(String, String)]) -> Result<bool, Refused> {
    let mut dry = false;
    for (key, value) in pairs {
        match (key.as_str(), value.as_str()) {
            ("dryRun", "All") => dry = true,
            ("dryRun", _) => return Err(bad_request("dryRun may only be \"All\"")),
            ("fieldManager" | "fieldValidation" | "pretty", _) => {}
            (other, _) => return Err(bad_request(format!("unknown create option {other:?}"))),
        }
    }
    Ok(dry)
}

/// A created object's name: its own, or its `generateName` finished with five characters
/// (as the API server finishes one), or None.
pub(crate) fn name_of(meta: &ObjectMeta) -> Option<String> {
    match (&meta.name, &meta.generate_name) {
        (Some(name), _) => Some(name.clone()),
        (None, Some(prefix)) => Some(format!("{prefix}{}", suffix())),
        (None, None) => None,
    }
}

/// Five characters for `generateName`, as the API server adds.
pub(crate) fn suffix() -> String {
    let simple = uuid::Uuid::now_v7().simple().to_string();
    simple[simple.len() - 5..].to_string()
}

/// A refusal, already a `Status` answer (boxed: results carrying it stay small).
pub struct Refused(Box<Response>);

impl Refused {
    pub fn new(response: Response) -> Self {
        Self(Box::new(response))
    }
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        *self.0
    }
}

/// Serves the aggregated API on `listener` until `shutdown`, then lets the requests in
/// progress finish. It first reads the API server's front-proxy settings, retrying until
/// they are there and usable (connections wait in the backlog meanwhile, and the API
/// server answers 503 for the group), and then follows their changes every minute.
pub async fn serve(
    listener: tokio::net::TcpListener,
    engine: Arc<Engine>,
    max_body: usize,
    client: kube::Client,
    certificate: Arc<dyn rustls::server::ResolvesServerCert>,
    limits: crate::ingest::listener::Limits,
    shutdown: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    tokio::pin!(shutdown);
    let mut delay = std::time::Duration::from_millis(500);
    let (trust, acceptor) = loop {
        let ready = front_proxy::FrontProxy::read(&client)
            .await
            .and_then(Trust::new)
            .and_then(|trust| Ok((trust.clone(), trust.acceptor(certificate.clone())?)));
        match ready {
            Ok(ready) => break ready,
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "the aggregated API waits for the API server's front-proxy settings")
            }
        }
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = &mut shutdown => return Ok(()),
        }
        delay = (delay * 2).min(std::time::Duration::from_secs(10));
    };
    tokio::spawn(front_proxy::follow(
        trust.clone(),
        client,
        std::time::Duration::from_secs(60),
    ));
    tracing::info!(address = ?listener.local_addr().ok(), "the aggregated API ({GROUP_VERSION}) is serving");
    let app = router(Api {
        engine,
        trust,
        max_body,
    });
    crate::ingest::listener::serve(listener, app, limits, Some(acceptor), shutdown).await
}
