//! The direct API's contract: an OpenAPI 3.1 document generated from the handlers' own
//! annotations and the types they read and write, served at `GET /openapi.json` and
//! checked in as `config/openapi/ingest.json` (a test fails when the two drift apart).

use std::sync::OnceLock;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{IntoResponses, Modify, OpenApi, ToSchema};

use crate::store::{AttemptHit, AttemptRecord, DeliveryState, DeliveryView, SubscriptionState};

/// Every error's body.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// A stable code a program can branch on (`invalid_event`, `quota_exceeded`, ...).
    pub code: String,
    /// What went wrong, for people.
    pub message: String,
}

/// What any call may be refused with, whatever it does (the body is always an
/// [`ErrorBody`]; 429 and 507 carry Retry-After).
#[derive(IntoResponses)]
#[allow(dead_code)]
pub enum Refusals {
    /// The path, the query or the body is not what this call takes.
    #[response(status = 400)]
    BadRequest(ErrorBody),
    /// No bearer token, or one that is not valid.
    #[response(status = 401)]
    Unauthenticated(ErrorBody),
    /// The token's holder may not do this here.
    #[response(status = 403)]
    Forbidden(ErrorBody),
    /// No such subscription (or event) in this namespace.
    #[response(status = 404)]
    NotFound(ErrorBody),
    /// Too many requests: too many failed authentications from this address, the
    /// namespace's publishes or reads busy, or its quota of pending deliveries or stored
    /// bytes reached. Retry-After says when to try again, when it can be known.
    #[response(status = 429, headers(("Retry-After" = u32, description = "seconds")))]
    TooMany(ErrorBody),
    /// The store or the authorizer cannot be reached just now; nothing was written.
    #[response(status = 503)]
    Unavailable(ErrorBody),
}

/// What a call with a body may also be refused with.
#[derive(IntoResponses)]
#[allow(dead_code)]
pub enum BodyRefusals {
    /// The body did not arrive within the listener's body timeout.
    #[response(status = 408)]
    BodyTimeout(ErrorBody),
    /// The subscription is disabled: re-enable it first.
    #[response(status = 409)]
    Disabled(ErrorBody),
    /// The body is larger than the largest accepted.
    #[response(status = 413)]
    TooLarge(ErrorBody),
    /// The store's disk is down to its reserve: nothing new is accepted until space is freed.
    #[response(status = 507, headers(("Retry-After" = u32, description = "seconds")))]
    InsufficientStorage(ErrorBody),
}

/// `POST .../events` (202): the event's id (the producer's, or one herald made) and how many
/// subscriptions got a delivery; a repeated id answers the first publish's figures.
#[derive(Debug, Serialize, ToSchema)]
pub struct Published {
    pub id: String,
    pub matched: u32,
}

/// `POST .../events/batch` (200): a result per event, in the request's order.
#[derive(Debug, Serialize, ToSchema)]
pub struct BatchPublished {
    pub results: Vec<BatchResult>,
}

/// One event's result in a batch.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum BatchResult {
    /// Stored (or, `duplicate`, a repeated id: the first publish's figures).
    Accepted {
        id: String,
        matched: u32,
        duplicate: bool,
    },
    /// Refused on its own: the status and error `POST .../events` would have answered.
    Refused { status: u16, error: ErrorDetail },
}

/// A subscription's deliveries, newest event first.
#[derive(Debug, Serialize, ToSchema)]
pub struct Deliveries {
    pub items: Vec<DeliveryView>,
}

/// Every attempt of one event to one subscription, oldest first.
#[derive(Debug, Serialize, ToSchema)]
pub struct Attempts {
    pub items: Vec<AttemptRecord>,
}

/// A page of a search of the namespace's attempts, newest first.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AttemptsFound {
    pub items: Vec<AttemptHit>,
    /// Pass as `cursor` for the next (older) page; absent on the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// `POST .../replay`: how many dead letters are due again.
#[derive(Debug, Serialize, ToSchema)]
pub struct Replayed {
    pub replayed: u64,
}

/// Which deliveries `GET .../subscriptions/{name}/attempts` lists.
#[derive(ToSchema)]
#[schema(rename_all = "lowercase")]
#[allow(dead_code)]
pub enum StateParam {
    Dead,
    Pending,
    All,
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "herald ingest API",
        description = "Publish events to a namespace's webhook subscriptions; read their \
            attempts, replay dead letters and re-enable subscriptions. Every error is a JSON \
            body {\"error\": {\"code\", \"message\"}}, and a refused request writes nothing.",
        license(name = "Apache-2.0"),
    ),
    paths(
        super::publish,
        super::publish_batch,
        super::search_attempts,
        super::subscription_state,
        super::list_attempts,
        super::event_attempts,
        super::replay,
        super::enable,
    ),
    components(schemas(DeliveryState, SubscriptionState, ErrorBody, ErrorDetail, StateParam)),
    modifiers(&BearerToken),
    security(("bearer" = [])),
)]
struct DirectApi;

/// Every call carries `Authorization: Bearer <token>`: the standalone token, or in cluster
/// mode a Kubernetes ServiceAccount token (checked by TokenReview, authorized by RBAC).
struct BearerToken;

impl Modify for BearerToken {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The document as JSON, the same bytes every time (what `config/openapi/ingest.json` holds,
/// with a final newline).
pub fn document() -> &'static str {
    static DOCUMENT: OnceLock<String> = OnceLock::new();
    DOCUMENT.get_or_init(|| {
        let mut openapi = DirectApi::openapi();
        // The crate's version would make every release a drift; the paths carry the version.
        openapi.info.version = "v1".into();
        let mut text = openapi
            .to_pretty_json()
            .expect("an OpenAPI document serializes");
        text.push('\n');
        text
    })
}

/// `GET /openapi.json`: the contract, to anyone (it holds nothing secret).
pub async fn serve() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], document()).into_response()
}
