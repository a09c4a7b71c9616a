//! The ingest API (axum): producers publish events; operators list attempts, replay dead
//! letters and re-enable subscriptions. Every error is a JSON body
//! `{"error": {"code": ..., "message": ...}}`, and a refused request writes nothing.

pub mod auth;
pub mod cloudevents;
pub mod listener;
pub mod openapi;
mod parse_errors;

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{ConnectInfo, FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::value::RawValue;
use utoipa::IntoParams;

use crate::delivery::engine::{BatchEvent, Engine, EngineError, Origin};
use crate::store::{StateFilter, SubscriptionState};
use auth::{AccessRequest, AuthError, Authorizer, Verb};

/// Default largest accepted event body.
pub const DEFAULT_MAX_BODY: usize = 1024 * 1024;

#[derive(Clone)]
pub struct Api {
    pub engine: Arc<Engine>,
    pub auth: Arc<dyn Authorizer>,
    pub max_body: usize,
}

/// An API error: status, a stable code, a message for people.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    /// Seconds for a Retry-After header.
    retry_after: Option<u32>,
}

impl ApiError {
    /// The stable error code (`invalid_event`, `not_found`, ...).
    pub fn code(&self) -> &'static str {
        self.code
    }

    /// The HTTP status it is answered with.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The message for people.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Seconds the client should wait before trying again, when it is a busy refusal.
    pub fn retry_after(&self) -> Option<u32> {
        self.retry_after
    }

    pub(crate) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = Json(openapi::ErrorBody {
            error: openapi::ErrorDetail {
                code: self.code.to_string(),
                message: self.message,
            },
        });
        let mut response = (self.status, body).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, seconds.into());
        }
        response
    }
}

impl From<AuthError> for ApiError {
    fn from(e: AuthError) -> Self {
        match e {
            AuthError::Unauthenticated(m) => {
                Self::new(StatusCode::UNAUTHORIZED, "unauthenticated", m)
            }
            AuthError::Forbidden(m) => Self::new(StatusCode::FORBIDDEN, "forbidden", m),
            AuthError::Unavailable(m) => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "auth_unavailable", m)
            }
            AuthError::Throttled(m) => ApiError {
                retry_after: Some(1),
                ..Self::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "too_many_failed_authentications",
                    m,
                )
            },
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let message = e.to_string();
        match e {
            EngineError::NotFound(_) => Self::new(StatusCode::NOT_FOUND, "not_found", message),
            EngineError::QuotaExceeded { .. } | EngineError::StoredBytesExceeded { .. } => {
                Self::new(StatusCode::TOO_MANY_REQUESTS, "quota_exceeded", message)
            }
            EngineError::StoreReserve { .. } => ApiError {
                retry_after: Some(30),
                ..Self::new(
                    StatusCode::INSUFFICIENT_STORAGE,
                    "insufficient_storage",
                    message,
                )
            },
            EngineError::Disabled(_) => {
                Self::new(StatusCode::CONFLICT, "subscription_disabled", message)
            }
            EngineError::Busy { .. } => ApiError {
                retry_after: Some(1),
                ..Self::new(StatusCode::TOO_MANY_REQUESTS, "publish_busy", message)
            },
            EngineError::ReadBusy { retry_after, .. } => ApiError {
                retry_after: Some(retry_after),
                ..Self::new(StatusCode::TOO_MANY_REQUESTS, "read_busy", message)
            },
            EngineError::Store(_) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store_unavailable",
                message,
            ),
        }
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// axum's `Path`, with a JSON error instead of the framework's plain-text one.
struct Path<T>(T);

impl<T, S> FromRequestParts<S> for Path<T>
where
    T: serde::de::DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Path(value)| Path(value))
            .map_err(|e| bad_request("invalid_path", e.body_text()))
    }
}

/// axum's `Query`, with a JSON error instead of the framework's plain-text one.
struct Query<T>(T);

impl<T, S> FromRequestParts<S> for Query<T>
where
    T: serde::de::DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Query(value)| Query(value))
            .map_err(|e| bad_request("invalid_query", e.body_text()))
    }
}

pub fn router(api: Api) -> Router {
    Router::new()
        .route("/openapi.json", get(openapi::serve))
        .route("/v1/namespaces/{namespace}/events", post(publish))
        .route(
            "/v1/namespaces/{namespace}/events/batch",
            post(publish_batch),
        )
        .route("/v1/namespaces/{namespace}/attempts", get(search_attempts))
        .route(
            "/v1/namespaces/{namespace}/subscriptions/{name}",
            get(subscription_state),
        )
        .route(
            "/v1/namespaces/{namespace}/subscriptions/{name}/attempts",
            get(list_attempts),
        )
        .route(
            "/v1/namespaces/{namespace}/subscriptions/{name}/events/{event_id}/attempts",
            get(event_attempts),
        )
        .route(
            "/v1/namespaces/{namespace}/subscriptions/{name}/replay",
            post(replay),
        )
        .route(
            "/v1/namespaces/{namespace}/subscriptions/{name}/enable",
            post(enable),
        )
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "this route does not take that method",
            )
        })
        .with_state(api)
}

/// A call's namespace.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
struct InNamespace {
    /// A Kubernetes namespace name (an RFC 1123 label).
    #[param(
        min_length = 1,
        max_length = 63,
        pattern = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        example = "shop"
    )]
    namespace: String,
}

/// A call's subscription.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
struct OfSubscription {
    /// The subscription's namespace (an RFC 1123 label).
    #[param(
        min_length = 1,
        max_length = 63,
        pattern = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        example = "shop"
    )]
    namespace: String,
    /// The subscription's name (its WebhookSubscription's, or the standalone file's).
    #[param(min_length = 1, max_length = 253, example = "orders")]
    name: String,
}

/// One event's deliveries to a subscription.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
struct OfEvent {
    /// The subscription's namespace (an RFC 1123 label).
    #[param(
        min_length = 1,
        max_length = 63,
        pattern = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        example = "shop"
    )]
    namespace: String,
    /// The subscription's name.
    #[param(min_length = 1, max_length = 253, example = "orders")]
    name: String,
    /// The event's id.
    #[param(
        min_length = 1,
        max_length = 255,
        pattern = "^[!-~]+$",
        example = "evt-1"
    )]
    event_id: String,
}

/// A Kubernetes namespace name (RFC 1123 label).
fn check_namespace(namespace: &str) -> ApiResult<()> {
    let ok = !namespace.is_empty()
        && namespace.len() <= 63
        && namespace
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !namespace.starts_with('-')
        && !namespace.ends_with('-');
    ok.then_some(()).ok_or_else(|| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_namespace",
            format!("{namespace:?} is not a namespace name"),
        )
    })
}

/// The client's address, which the listener puts on every request as axum's
/// `ConnectInfo`; absent when the router is called directly (unit tests).
#[derive(Clone, Copy, Debug)]
struct Peer(Option<IpAddr>);

impl<S: Send + Sync> FromRequestParts<S> for Peer {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let peer = parts.extensions.get::<ConnectInfo<SocketAddr>>();
        Ok(Peer(peer.map(|info| info.0.ip())))
    }
}

async fn authorize(
    api: &Api,
    verb: Verb,
    namespace: &str,
    subscription: Option<&str>,
    headers: &HeaderMap,
    peer: Peer,
) -> ApiResult<()> {
    check_namespace(namespace)?;
    api.auth
        .authorize(&AccessRequest {
            verb,
            namespace,
            subscription,
            headers,
            peer: peer.0,
        })
        .await
        .map_err(ApiError::from)
}

/// An event to publish: `{"id"?, "type", "data"?}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"id": "evt-1", "type": "order.created", "data": {"order": 42}}))]
pub struct PublishRequest {
    /// The idempotency key: a repeated id in the namespace delivers nothing again and
    /// answers the first publish's figures. 1-255 visible ASCII characters; herald makes
    /// one when absent.
    #[schema(min_length = 1, max_length = 255, pattern = "^[!-~]+$")]
    pub id: Option<String>,
    /// What happened: subscriptions choose events by type. 1-253 characters of letters,
    /// digits and `_ . : / -`.
    #[serde(rename = "type")]
    #[schema(min_length = 1, max_length = 253, pattern = "^[A-Za-z0-9_.:/-]+$")]
    pub kind: String,
    /// Any JSON value, delivered byte for byte as written.
    #[schema(value_type = Option<serde_json::Value>)]
    pub data: Option<Box<RawValue>>,
    /// A published CloudEvent's source (see [`cloudevents`]).
    #[serde(skip)]
    pub source: Option<String>,
}

/// Decodes a publish body, refusing what `POST .../events` answers 400 to (`invalid_event`,
/// `invalid_type`, `invalid_id`). Pure, so it can be fuzzed without a server.
pub fn decode_event(bytes: &[u8]) -> Result<PublishRequest, ApiError> {
    let request: PublishRequest = serde_json::from_slice(bytes)
        .map_err(|e| bad_request("invalid_event", format!("the body must be a JSON object {{\"type\": string, \"id\"?: string, \"data\"?: any}}: {e}")))?;
    checked(request)
}

/// The rules every publish meets, however it was written (herald's body, a CloudEvent, a
/// WebhookEvent of the aggregated API).
pub(crate) fn checked(request: PublishRequest) -> Result<PublishRequest, ApiError> {
    if request.kind.is_empty()
        || request.kind.len() > 253
        || !request
            .kind
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.:/-".contains(&b))
    {
        return Err(bad_request(
            "invalid_type",
            "type must be 1-253 characters of letters, digits and _ . : / -",
        ));
    }
    if let Some(id) = &request.id {
        check_event_id(id)?;
    }
    // The data is delivered byte for byte as written, so it must be JSON that receivers can
    // read. The grammar alone, all that keeping it raw checks, also admits numbers beyond
    // any double (1e400), which serde_json, among others, refuses to read.
    if let Some(data) = &request.data
        && let Err(e) = serde_json::from_str::<serde_json::Value>(data.get())
    {
        return Err(bad_request(
            "invalid_event",
            format!("data is JSON that receivers cannot read: {e}"),
        ));
    }
    Ok(request)
}

/// An event id: 1-255 visible ASCII characters (400 `invalid_id` otherwise), so every id
/// herald stores is one.
fn check_event_id(id: &str) -> ApiResult<()> {
    if id.is_empty() || id.len() > 255 || !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(bad_request(
            "invalid_id",
            "id must be 1-255 visible ASCII characters",
        ));
    }
    Ok(())
}

/// Why a body could not be read: over the limit (`too_large`), or not a well-formed HTTP
/// body (a malformed chunk, a connection closed mid-body): 400 `invalid_body`.
pub(crate) fn body_error(e: axum::Error, too_large: ApiError) -> ApiError {
    let over_limit = std::error::Error::source(&e)
        .is_some_and(|source| source.is::<http_body_util::LengthLimitError>());
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(c) = cause {
        if let Some(timeout) = c.downcast_ref::<listener::BodyTimeout>() {
            return ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "body_timeout",
                timeout.to_string(),
            );
        }
        cause = c.source();
    }
    if over_limit {
        too_large
    } else {
        bad_request(
            "invalid_body",
            format!("the request body could not be read: {e}"),
        )
    }
}

fn bad_request(code: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, code, message)
}

/// Publishes an event: stored with a delivery for every subscription of the namespace
/// whose types match, and answered once that is committed. Also takes a CloudEvent, in
/// structured mode (`application/cloudevents+json`) or binary mode (`ce-*` headers).
#[utoipa::path(
    post,
    path = "/v1/namespaces/{namespace}/events",
    operation_id = "publish",
    tag = "events",
    params(InNamespace),
    request_body(content(
        (PublishRequest = "application/json"),
        (cloudevents::StructuredEvent = "application/cloudevents+json"),
    )),
    responses(
        (status = 202, description = "Stored (or a repeated id's first answer)", body = openapi::Published),
        openapi::Refusals,
        openapi::BodyRefusals,
    ),
)]
async fn publish(
    State(api): State<Api>,
    Path(InNamespace { namespace }): Path<InNamespace>,
    peer: Peer,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    authorize(&api, Verb::Publish, &namespace, None, &headers, peer).await?;
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("the event body is larger than {} bytes", api.max_body),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    // Read (and drop) a moderately oversized body before answering, so the producer gets
    // the 413 instead of a broken pipe; a far larger one just has its connection closed.
    let drain_limit = api.max_body.saturating_mul(4);
    if declared.is_some_and(|n| n > api.max_body) {
        if declared.is_some_and(|n| n <= drain_limit) {
            let _ = axum::body::to_bytes(body, drain_limit).await;
        }
        return Err(too_large());
    }
    let bytes = axum::body::to_bytes(body, api.max_body)
        .await
        .map_err(|e| body_error(e, too_large()))?;
    // A CloudEvent (structured: by its content type; binary: by its ce-specversion header),
    // or herald's own body.
    let request = match cloudevents::mode(&headers) {
        Some(mode) => cloudevents::decode(mode, &headers, &bytes).and_then(checked)?,
        None => decode_event(&bytes)?,
    };
    let null = RawValue::NULL;
    let data = request.data.as_deref().unwrap_or(null);
    // The producer's W3C trace context, when well formed (else none, as the spec asks).
    let header = |name| headers.get(name).and_then(|v| v.to_str().ok());
    let origin = Origin {
        source: request.source.as_deref(),
        trace: header("traceparent").and_then(|traceparent| {
            crate::delivery::trace::parse(traceparent, header("tracestate"))
        }),
    };
    let result = api
        .engine
        .publish(&namespace, request.id, &request.kind, &origin, data)
        .await?;
    Ok((
        StatusCode::ACCEPTED,
        Json(openapi::Published {
            id: result.event_id,
            matched: result.matched,
        }),
    )
        .into_response())
}

/// Most events one batch publishes.
pub const MAX_BATCH: usize = 1000;

/// `POST .../events/batch`: up to [`MAX_BATCH`] events.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct BatchRequest {
    /// Each an event as `POST .../events` takes it (a `PublishRequest`; herald's body, not
    /// a CloudEvent). One that is not is refused alone, in its result, as the others go on.
    #[schema(
        value_type = Vec<serde_json::Value>,
        min_items = 1,
        max_items = 1000,
        example = json!([{"id": "evt-2", "type": "order.created", "data": {"order": 43}}])
    )]
    events: Vec<Box<RawValue>>,
}

/// Publishes up to 1,000 events in one store transaction, answered together once it
/// commits, with a result per event in the request's order: accepted (or a repeated id's
/// first answer), or refused on its own (an invalid event, a quota it would pass) while
/// the others go on.
#[utoipa::path(
    post,
    path = "/v1/namespaces/{namespace}/events/batch",
    operation_id = "publishBatch",
    tag = "events",
    params(InNamespace),
    request_body(content = BatchRequest, content_type = "application/json"),
    responses(
        (status = 200, description = "A result per event", body = openapi::BatchPublished),
        openapi::Refusals,
        openapi::BodyRefusals,
    ),
)]
async fn publish_batch(
    State(api): State<Api>,
    Path(InNamespace { namespace }): Path<InNamespace>,
    peer: Peer,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<openapi::BatchPublished>> {
    authorize(&api, Verb::Publish, &namespace, None, &headers, peer).await?;
    let limit = api.max_body.saturating_mul(8);
    let bytes = axum::body::to_bytes(body, limit).await.map_err(|e| {
        body_error(
            e,
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                format!("a batch is at most {limit} bytes"),
            ),
        )
    })?;
    let request: BatchRequest = serde_json::from_slice(&bytes).map_err(|e| {
        bad_request(
            "invalid_batch",
            format!("the body must be {{\"events\": [event, ...]}}: {e}"),
        )
    })?;
    let results = publish_each(&api.engine, &namespace, &request.events, api.max_body).await?;
    Ok(Json(openapi::BatchPublished { results }))
}

impl From<ApiError> for openapi::BatchResult {
    fn from(e: ApiError) -> Self {
        openapi::BatchResult::Refused {
            status: e.status.as_u16(),
            error: openapi::ErrorDetail {
                code: e.code.to_string(),
                message: e.message,
            },
        }
    }
}

/// A batch's events checked one by one (1 to [`MAX_BATCH`] of them, each at most
/// `max_body`): the request each makes, or why it is refused alone.
pub(crate) fn decode_each(
    raw_events: &[Box<RawValue>],
    max_body: usize,
) -> Result<Vec<Result<PublishRequest, ApiError>>, ApiError> {
    if raw_events.is_empty() || raw_events.len() > MAX_BATCH {
        return Err(bad_request(
            "invalid_batch",
            format!(
                "a batch has 1 to {MAX_BATCH} events, not {}",
                raw_events.len()
            ),
        ));
    }
    // Each event decoded on its own: one that is not valid is refused alone.
    Ok(raw_events
        .iter()
        .map(|raw| {
            if raw.get().len() > max_body {
                return Err(ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "body_too_large",
                    format!("the event is larger than {} bytes", max_body),
                ));
            }
            decode_event(raw.get().as_bytes())
        })
        .collect::<Vec<_>>())
}

/// A batch's events published in one store transaction, with a result per event in the
/// given order; shared by the ingest API's `POST .../events/batch` and the aggregated API's
/// WebhookEventBatch. An event that is not valid, or that a quota refuses, is refused alone.
pub(crate) async fn publish_each(
    engine: &Arc<Engine>,
    namespace: &str,
    raw_events: &[Box<RawValue>],
    max_body: usize,
) -> Result<Vec<openapi::BatchResult>, ApiError> {
    let decoded = decode_each(raw_events, max_body)?;
    let null = RawValue::NULL;
    let events: Vec<BatchEvent> = decoded
        .iter()
        .filter_map(|d| d.as_ref().ok())
        .map(|event| BatchEvent {
            id: event.id.clone(),
            event_type: &event.kind,
            origin: Origin::default(),
            data: event.data.as_deref().unwrap_or(null),
        })
        .collect::<Vec<_>>();
    let mut published = engine.publish_batch(namespace, events).await?.into_iter();
    let results = decoded
        .into_iter()
        .map(|d| {
            let answer = d.and_then(|_| {
                published
                    .next()
                    .map(|r| r.map_err(ApiError::from))
                    .unwrap_or_else(|| {
                        Err(ApiError::new(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "internal",
                            "the batch answered fewer events than it was given",
                        ))
                    })
            });
            match answer {
                Ok(result) => openapi::BatchResult::Accepted {
                    id: result.event_id,
                    matched: result.matched,
                    duplicate: result.duplicate,
                },
                Err(e) => e.into(),
            }
        })
        .collect::<Vec<_>>();
    Ok(results)
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct ListQuery {
    /// Which deliveries: dead, pending or all (the default).
    #[param(value_type = Option<openapi::StateParam>)]
    state: Option<String>,
    /// At most this many (default 100; taken as 1 to 10,000).
    #[param(value_type = Option<u64>, minimum = 0, maximum = 4294967295_u64)]
    limit: Option<u32>,
}

/// A subscription's deliveries, newest event first, each with its last attempt.
#[utoipa::path(
    get,
    path = "/v1/namespaces/{namespace}/subscriptions/{name}/attempts",
    operation_id = "listDeliveries",
    tag = "attempts",
    params(OfSubscription, ListQuery),
    responses((status = 200, description = "The deliveries", body = openapi::Deliveries), openapi::Refusals),
)]
async fn list_attempts(
    State(api): State<Api>,
    Path(OfSubscription { namespace, name }): Path<OfSubscription>,
    Query(query): Query<ListQuery>,
    peer: Peer,
    headers: HeaderMap,
) -> ApiResult<Response> {
    authorize(&api, Verb::Read, &namespace, Some(&name), &headers, peer).await?;
    let filter = match query.state.as_deref().unwrap_or("all") {
        "dead" => StateFilter::Dead,
        "pending" => StateFilter::Pending,
        "all" => StateFilter::All,
        other => {
            return Err(bad_request(
                "invalid_state",
                format!("state {other:?} is not dead, pending or all"),
            ));
        }
    };
    let limit = query.limit.unwrap_or(100).clamp(1, 10_000);
    let items = api.engine.list(&namespace, &name, filter, limit).await?;
    // A page of up to 10,000 rows is written out on the blocking pool, not on the workers
    // that answer everyone's publishes.
    let body =
        tokio::task::spawn_blocking(move || serde_json::to_vec(&openapi::Deliveries { items }))
            .await
            .map_err(|e| {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
            })?
            .map_err(|e| {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
            })?;
    Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
}

/// Every attempt of one event to a subscription, oldest first.
#[utoipa::path(
    get,
    path = "/v1/namespaces/{namespace}/subscriptions/{name}/events/{event_id}/attempts",
    operation_id = "eventAttempts",
    tag = "attempts",
    params(OfEvent),
    responses((status = 200, description = "The attempts", body = openapi::Attempts), openapi::Refusals),
)]
async fn event_attempts(
    State(api): State<Api>,
    Path(OfEvent {
        namespace,
        name,
        event_id,
    }): Path<OfEvent>,
    peer: Peer,
    headers: HeaderMap,
) -> ApiResult<Json<openapi::Attempts>> {
    authorize(&api, Verb::Read, &namespace, Some(&name), &headers, peer).await?;
    check_event_id(&event_id)?;
    let items = api.engine.attempts(&namespace, &name, &event_id).await?;
    Ok(Json(openapi::Attempts { items }))
}

/// A subscription's counters and flags.
#[utoipa::path(
    get,
    path = "/v1/namespaces/{namespace}/subscriptions/{name}",
    operation_id = "subscriptionState",
    tag = "subscriptions",
    params(OfSubscription),
    responses((status = 200, description = "The subscription's state", body = SubscriptionState), openapi::Refusals),
)]
async fn subscription_state(
    State(api): State<Api>,
    Path(OfSubscription { namespace, name }): Path<OfSubscription>,
    peer: Peer,
    headers: HeaderMap,
) -> ApiResult<Json<SubscriptionState>> {
    authorize(&api, Verb::Read, &namespace, Some(&name), &headers, peer).await?;
    Ok(Json(api.engine.state(&namespace, &name).await?))
}

/// Which dead letters to deliver again (all of the subscription's when none is given).
#[derive(Deserialize, Default, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct ReplayRequest {
    /// Only these events.
    pub(crate) event_ids: Option<Vec<String>>,
    /// Only events published at or after this time (RFC 3339)...
    #[schema(format = DateTime)]
    pub(crate) since: Option<String>,
    /// ...and before this one.
    #[schema(format = DateTime)]
    pub(crate) until: Option<String>,
}

impl ReplayRequest {
    /// What the store re-queues; a time that is not RFC 3339, or a range that is empty, is
    /// refused (400 `invalid_replay`).
    pub(crate) fn selection(self) -> Result<crate::store::Replay, ApiError> {
        let (since_ms, until_ms) = time_range("invalid_replay", self.since, self.until)?;
        Ok(crate::store::Replay {
            event_ids: self.event_ids,
            since_ms,
            until_ms,
        })
    }
}

/// `since` and `until` (RFC 3339) as Unix ms; a time that is not RFC 3339, or a range that
/// is empty, is refused (400 with `code`).
fn time_range(
    code: &'static str,
    since: Option<String>,
    until: Option<String>,
) -> Result<(Option<i64>, Option<i64>), ApiError> {
    let at = |field: &str, text: Option<String>| -> Result<Option<i64>, ApiError> {
        text.map(|t| {
            t.parse::<k8s_openapi::jiff::Timestamp>()
                .map(|t| t.as_millisecond())
                .map_err(|e| {
                    bad_request(
                        code,
                        format!(
                            "{field} is not an RFC 3339 time ({:?}): {e}",
                            t.chars().take(64).collect::<String>()
                        ),
                    )
                })
        })
        .transpose()
    };
    let since_ms = at("since", since)?;
    let until_ms = at("until", until)?;
    if let (Some(since), Some(until)) = (since_ms, until_ms)
        && since >= until
    {
        return Err(bad_request(code, "since must be before until"));
    }
    Ok((since_ms, until_ms))
}

/// `GET .../attempts`: a search across the namespace's subscriptions.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct SearchQuery {
    /// Only this subscription's attempts.
    subscription: Option<String>,
    /// Outcomes, comma-separated (any case): accepted, transient, terminal, gone.
    outcome: Option<String>,
    /// Only attempts answered with this HTTP status.
    #[param(minimum = 100, maximum = 599)]
    status: Option<u16>,
    /// Only attempts at or after this time (RFC 3339)...
    #[param(format = DateTime)]
    since: Option<String>,
    /// ...and before this one.
    #[param(format = DateTime)]
    until: Option<String>,
    /// The `nextCursor` of the page before.
    cursor: Option<String>,
    /// At most this many (default 100; taken as 1 to 1,000).
    #[param(value_type = Option<u64>, minimum = 0, maximum = 4294967295_u64)]
    limit: Option<u32>,
}

impl SearchQuery {
    fn search(self, namespace: String) -> Result<crate::store::AttemptSearch, ApiError> {
        let outcomes = self
            .outcome
            .map(|list| {
                list.split(',')
                    .map(|o| {
                        ["Accepted", "Transient", "Terminal", "Gone"]
                            .into_iter()
                            .find(|known| known.eq_ignore_ascii_case(o.trim()))
                            .map(str::to_string)
                            .ok_or_else(|| {
                                bad_request(
                                    "invalid_search",
                                    format!(
                                        "outcome {:?} is not accepted, transient, terminal or gone",
                                        o.chars().take(64).collect::<String>()
                                    ),
                                )
                            })
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .transpose()?;
        if let Some(status) = self.status
            && !(100..=599).contains(&status)
        {
            return Err(bad_request(
                "invalid_search",
                format!("status {status} is not an HTTP status code"),
            ));
        }
        let before =
            self.cursor
                .map(|c| {
                    c.parse::<i64>().ok().filter(|id| *id > 0).ok_or_else(|| {
                        bad_request("invalid_cursor", "cursor is not one this API gave")
                    })
                })
                .transpose()?;
        let (since_ms, until_ms) = time_range("invalid_search", self.since, self.until)?;
        Ok(crate::store::AttemptSearch {
            namespace,
            subscription: self.subscription,
            outcomes,
            status_code: self.status,
            since_ms,
            until_ms,
            before,
            limit: self.limit.unwrap_or(100).clamp(1, 1_000),
        })
    }
}

/// Searches the attempts of the namespace's subscriptions, newest first, a page at a time.
#[utoipa::path(
    get,
    path = "/v1/namespaces/{namespace}/attempts",
    operation_id = "searchAttempts",
    tag = "attempts",
    params(InNamespace, SearchQuery),
    responses((status = 200, description = "A page of attempts", body = openapi::AttemptsFound), openapi::Refusals),
)]
async fn search_attempts(
    State(api): State<Api>,
    Path(InNamespace { namespace }): Path<InNamespace>,
    Query(query): Query<SearchQuery>,
    peer: Peer,
    headers: HeaderMap,
) -> ApiResult<Json<openapi::AttemptsFound>> {
    let subscription = query.subscription.clone();
    authorize(
        &api,
        Verb::Read,
        &namespace,
        subscription.as_deref(),
        &headers,
        peer,
    )
    .await?;
    let page = api.engine.search(query.search(namespace)?).await?;
    Ok(Json(openapi::AttemptsFound {
        items: page.items,
        next_cursor: page.next.map(|next| next.to_string()),
    }))
}

/// Delivers dead letters again: due now, their attempts counted afresh.
#[utoipa::path(
    post,
    path = "/v1/namespaces/{namespace}/subscriptions/{name}/replay",
    operation_id = "replay",
    tag = "subscriptions",
    params(OfSubscription),
    request_body(content = Option<ReplayRequest>, content_type = "application/json"),
    responses(
        (status = 200, description = "Due again", body = openapi::Replayed),
        openapi::Refusals,
        openapi::BodyRefusals,
    ),
)]
async fn replay(
    State(api): State<Api>,
    Path(OfSubscription { namespace, name }): Path<OfSubscription>,
    peer: Peer,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<openapi::Replayed>> {
    authorize(&api, Verb::Manage, &namespace, Some(&name), &headers, peer).await?;
    let bytes = axum::body::to_bytes(body, api.max_body)
        .await
        .map_err(|e| {
            body_error(
                e,
                ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "body_too_large",
                    "the replay request is too large",
                ),
            )
        })?;
    // No body, or `null`, selects every dead letter.
    let request: ReplayRequest = if bytes.iter().all(u8::is_ascii_whitespace) {
        ReplayRequest::default()
    } else {
        serde_json::from_slice::<Option<ReplayRequest>>(&bytes)
            .map_err(|e| {
                bad_request(
                    "invalid_replay",
                    format!(
                        "expected {{\"eventIds\"?: [string], \"since\"?: time, \"until\"?: time}}: {e}"
                    ),
                )
            })?
            .unwrap_or_default()
    };
    let replayed = api
        .engine
        .replay(&namespace, &name, request.selection()?)
        .await?;
    Ok(Json(openapi::Replayed { replayed }))
}

/// Re-enables a subscription its failures (or a 410 Gone) disabled: its lane sends again
/// and its failure count starts over.
#[utoipa::path(
    post,
    path = "/v1/namespaces/{namespace}/subscriptions/{name}/enable",
    operation_id = "enable",
    tag = "subscriptions",
    params(OfSubscription),
    responses((status = 200, description = "The subscription's state", body = SubscriptionState), openapi::Refusals),
)]
async fn enable(
    State(api): State<Api>,
    Path(OfSubscription { namespace, name }): Path<OfSubscription>,
    peer: Peer,
    headers: HeaderMap,
) -> ApiResult<Json<SubscriptionState>> {
    authorize(&api, Verb::Manage, &namespace, Some(&name), &headers, peer).await?;
    Ok(Json(api.engine.enable(&namespace, &name).await?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::delivery::Engine;
    use crate::store::testing::FaultyStore;

    async fn serve_broken() -> std::net::SocketAddr {
        let engine = Engine::for_tests(Arc::new(FaultyStore::broken()));
        let app = router(Api {
            engine,
            auth: Arc::new(auth::StaticToken(None)),
            max_body: DEFAULT_MAX_BODY,
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        address
    }

    /// Found by fuzzing (event_decode): data with a number beyond any double was accepted
    /// and relayed, and receivers that read JSON with serde_json refused every delivery.
    #[test]
    fn event_data_must_be_json_that_receivers_can_read() {
        for (data, why) in [
            // A lone surrogate is no character: the same class of JSON, readable by some.
            (r#""\ud800""#, "escape"),
            ("1e400", "number out of range"),
            ("[1,-1e999]", "number out of range"),
            (r#"{"n":11e7777}"#, "number out of range"),
        ] {
            let body = format!(r#"{{"type":"order.paid","data":{data}}}"#);
            let refused = decode_event(body.as_bytes()).expect_err(data);
            assert_eq!(refused.code(), "invalid_event", "{data}");
            assert!(refused.message.contains(why), "{data}: {}", refused.message);
        }
        for data in [
            "1e300",
            "1e-400",
            "-0",
            "12345678901234567890123",
            r#""\u00e9""#,
        ] {
            let body = format!(r#"{{"type":"order.paid","data":{data}}}"#);
            let event = decode_event(body.as_bytes()).expect(data);
            assert_eq!(event.data.unwrap().get(), data, "relayed as written");
        }
    }

    #[tokio::test]
    async fn framework_errors_are_json_too() {
        let address = serve_broken().await;
        let client = reqwest::Client::new();
        for (method, path, status, code) in [
            ("GET", "/v1/namespaces/ns/events", 405, "method_not_allowed"),
            (
                "GET",
                "/v1/namespaces/ns/subscriptions/s/attempts?limit=many",
                400,
                "invalid_query",
            ),
            (
                "GET",
                "/v1/namespaces/ns/subscriptions/%FF/attempts",
                400,
                "invalid_path",
            ),
            ("GET", "/elsewhere", 404, "not_found"),
        ] {
            let response = client
                .request(method.parse().unwrap(), format!("http://{address}{path}"))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status().as_u16(), status, "{method} {path}");
            let body: serde_json::Value = response.json().await.unwrap();
            assert_eq!(body["error"]["code"], code, "{method} {path}: {body}");
        }
    }

    #[tokio::test]
    async fn an_unavailable_store_answers_503_with_a_json_error() {
        let address = serve_broken().await;
        let response = reqwest::Client::new()
            .post(format!("http://{address}/v1/namespaces/ns/events"))
            .body(r#"{"type":"order.paid","data":{}}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 503);
        let body: serde_json::Value = response.json().await.unwrap();
        assert_eq!(body["error"]["code"], "store_unavailable");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("unavailable")
        );
    }
}
