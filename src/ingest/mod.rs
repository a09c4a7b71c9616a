//! The ingest API (axum): producers publish events; operators list attempts, replay dead
//! letters and re-enable subscriptions. Every error is a JSON body
//! `{"error": {"code": ..., "message": ...}}`, and a refused request writes nothing.

pub mod auth;
pub mod cloudevents;
pub mod listener;
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
use serde_json::json;
use serde_json::value::RawValue;

use crate::delivery::engine::{Engine, EngineError, Origin};
use crate::store::StateFilter;
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

    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
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
        let body = Json(json!({"error": {"code": self.code, "message": self.message}}));
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
        .route("/v1/namespaces/{namespace}/events", post(publish))
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

/// A publish request's body, decoded and checked: `{"id"?, "type", "data"?}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublishRequest {
    /// 1-255 visible ASCII characters when given.
    pub id: Option<String>,
    /// 1-253 characters of letters, digits and `_ . : / -`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Any JSON value, kept as the producer wrote it.
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

/// The rules every publish meets, however it was written (herald's body, a CloudEvent).
fn checked(request: PublishRequest) -> Result<PublishRequest, ApiError> {
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
    if let Some(id) = &request.id
        && (id.is_empty() || id.len() > 255 || !id.bytes().all(|b| b.is_ascii_graphic()))
    {
        return Err(bad_request(
            "invalid_id",
            "id must be 1-255 visible ASCII characters",
        ));
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

/// Why a body could not be read: over the limit (`too_large`), or not a well-formed HTTP
/// body (a malformed chunk, a connection closed mid-body): 400 `invalid_body`.
fn body_error(e: axum::Error, too_large: ApiError) -> ApiError {
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

async fn publish(
    State(api): State<Api>,
    Path(namespace): Path<String>,
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
        Json(json!({"id": result.event_id, "matched": result.matched})),
    )
        .into_response())
}

#[derive(Deserialize)]
struct ListQuery {
    state: Option<String>,
    limit: Option<u32>,
}

async fn list_attempts(
    State(api): State<Api>,
    Path((namespace, name)): Path<(String, String)>,
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
    #[derive(serde::Serialize)]
    struct Page {
        items: Vec<crate::store::DeliveryView>,
    }
    let body = tokio::task::spawn_blocking(move || serde_json::to_vec(&Page { items }))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
}

async fn event_attempts(
    State(api): State<Api>,
    Path((namespace, name, event_id)): Path<(String, String, String)>,
    peer: Peer,
    headers: HeaderMap,
) -> ApiResult<Json<serde_json::Value>> {
    authorize(&api, Verb::Read, &namespace, Some(&name), &headers, peer).await?;
    let items = api.engine.attempts(&namespace, &name, &event_id).await?;
    Ok(Json(json!({"items": items})))
}

async fn subscription_state(
    State(api): State<Api>,
    Path((namespace, name)): Path<(String, String)>,
    peer: Peer,
    headers: HeaderMap,
) -> ApiResult<Json<serde_json::Value>> {
    authorize(&api, Verb::Read, &namespace, Some(&name), &headers, peer).await?;
    let state = api.engine.state(&namespace, &name).await?;
    Ok(Json(serde_json::to_value(state).unwrap_or_default()))
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ReplayRequest {
    event_ids: Option<Vec<String>>,
    /// Only events published at or after this time (RFC 3339)...
    since: Option<String>,
    /// ...and before this one.
    until: Option<String>,
}

impl ReplayRequest {
    /// What the store re-queues; a time that is not RFC 3339, or a range that is empty, is
    /// refused (400 `invalid_replay`).
    fn selection(self) -> Result<crate::store::Replay, ApiError> {
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
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SearchQuery {
    subscription: Option<String>,
    /// Outcomes, comma-separated (any case): accepted, transient, terminal, gone.
    outcome: Option<String>,
    status: Option<u16>,
    since: Option<String>,
    until: Option<String>,
    /// The `nextCursor` of the page before.
    cursor: Option<String>,
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

async fn search_attempts(
    State(api): State<Api>,
    Path(namespace): Path<String>,
    Query(query): Query<SearchQuery>,
    peer: Peer,
    headers: HeaderMap,
) -> ApiResult<Json<serde_json::Value>> {
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
    let mut body = json!({"items": page.items});
    if let Some(next) = page.next {
        body["nextCursor"] = json!(next.to_string());
    }
    Ok(Json(body))
}

async fn replay(
    State(api): State<Api>,
    Path((namespace, name)): Path<(String, String)>,
    peer: Peer,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<serde_json::Value>> {
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
    let request: ReplayRequest = if bytes.iter().all(u8::is_ascii_whitespace) {
        ReplayRequest::default()
    } else {
        serde_json::from_slice(&bytes).map_err(|e| {
            bad_request(
                "invalid_replay",
                format!(
                    "expected {{\"eventIds\"?: [string], \"since\"?: time, \"until\"?: time}}: {e}"
                ),
            )
        })?
    };
    let replayed = api
        .engine
        .replay(&namespace, &name, request.selection()?)
        .await?;
    Ok(Json(json!({"replayed": replayed})))
}

async fn enable(
    State(api): State<Api>,
    Path((namespace, name)): Path<(String, String)>,
    peer: Peer,
    headers: HeaderMap,
) -> ApiResult<Json<serde_json::Value>> {
    authorize(&api, Verb::Manage, &namespace, Some(&name), &headers, peer).await?;
    let state = api.engine.enable(&namespace, &name).await?;
    Ok(Json(serde_json::to_value(state).unwrap_or_default()))
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
