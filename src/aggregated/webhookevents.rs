//! `webhookevents`: creating one publishes it, with the same rules, quotas and
//! acknowledgement after commit as `POST /v1/namespaces/{ns}/events` of the ingest API.
//!
//! ```yaml
//! apiVersion: delivery.herald.dev/v1alpha1
//! kind: WebhookEvent
//! metadata: {name: evt-1, namespace: shop}   # the name is the event id
//! spec: {type: order.created, data: {order: 42}}
//! ```
//!
//! The name is the idempotency key: creating a name the namespace has published before
//! delivers nothing again and is answered 409 `AlreadyExists`, as any Kubernetes create of
//! an existing name is. Without a name (or with `generateName`) herald makes one. The
//! answer is the object with `status.matched`, the deliveries the event got.

use axum::body::Body;
use axum::extract::{Extension, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use serde_json::value::RawValue;

use super::front_proxy::Identity;
use super::{Api, GROUP, GROUP_VERSION, Refused, bad_request, created, status};
use crate::delivery::engine::Origin;
use crate::ingest::{ApiError, PublishRequest, body_error, checked};

/// Room for the object around the event's data (apiVersion, kind, metadata, spec).
const ENVELOPE_ROOM: usize = 64 * 1024;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Spec {
    #[serde(rename = "type")]
    kind: String,
    data: Option<Box<RawValue>>,
}

/// `POST /apis/delivery.herald.dev/v1alpha1/namespaces/{namespace}/webhookevents`
pub async fn create(
    State(api): State<Api>,
    Path(namespace): Path<String>,
    Query(options): Query<Vec<(String, String)>>,
    Extension(identity): Extension<Identity>,
    body: Body,
) -> Result<Response, Refused> {
    let dry_run = match dry_run_values(&options)?.as_slice() {
        [] => false,
        ["All"] => true,
        _ => return Err(bad_request("dryRun may only be \"All\"")),
    };
    let too_large = ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        format!("the event data is larger than {} bytes", api.max_body),
    );
    let bytes = axum::body::to_bytes(body, api.max_body.saturating_add(ENVELOPE_ROOM))
        .await
        .map_err(|e| Refused::from(body_error(e, too_large)))?;
    let event = created::<Spec>(&bytes, "WebhookEvent", &namespace)?;
    if event
        .spec
        .data
        .as_ref()
        .is_some_and(|d| d.get().len() > api.max_body)
    {
        return Err(Refused::from(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("the event data is larger than {} bytes", api.max_body),
        )));
    }
    let id = match (event.metadata.name, event.metadata.generate_name) {
        (Some(name), _) => Some(name),
        (None, Some(prefix)) => Some(format!("{prefix}{}", suffix())),
        (None, None) => None,
    };
    let request = checked(PublishRequest {
        id,
        kind: event.spec.kind,
        data: event.spec.data,
        source: None,
    })
    .map_err(Refused::from)?;
    let data = request.data.as_deref().unwrap_or(RawValue::NULL);
    let object = |name: &str| {
        json!({
            "apiVersion": GROUP_VERSION,
            "kind": "WebhookEvent",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "creationTimestamp": now(),
            },
            "spec": {"type": request.kind, "data": data},
        })
    };
    if dry_run {
        let name = request.id.clone().unwrap_or_default();
        return Ok((StatusCode::CREATED, axum::Json(object(&name))).into_response());
    }
    let origin = Origin {
        source: None,
        trace: None,
    };
    let result = api
        .engine
        .publish(&namespace, request.id.clone(), &request.kind, &origin, data)
        .await
        .map_err(|e| Refused::from(ApiError::from(e)))?;
    if result.duplicate {
        return Err(Refused::new(status(
            StatusCode::CONFLICT,
            "AlreadyExists",
            &format!(
                "webhookevents.{GROUP} {:?} already exists: the namespace published this id before (it matched {} subscriptions then)",
                result.event_id, result.matched
            ),
            Some(json!({"name": result.event_id, "group": GROUP, "kind": "webhookevents"})),
        )));
    }
    tracing::debug!(namespace, user = %identity.user, id = %result.event_id, "published through the aggregated API");
    let mut answer = object(&result.event_id);
    answer["status"] = json!({"matched": result.matched});
    Ok((StatusCode::CREATED, axum::Json(answer)).into_response())
}

/// The `dryRun` values of a create's query. kubectl also sends `fieldManager` (herald
/// keeps no managed fields) and `fieldValidation` (herald always refuses unknown fields, as
/// `Strict` asks).
fn dry_run_values(pairs: &[(String, String)]) -> Result<Vec<&str>, Refused> {
    let mut dry_run = Vec::new();
    for (key, value) in pairs {
        match key.as_str() {
            "dryRun" => dry_run.push(value.as_str()),
            "fieldManager" | "fieldValidation" | "pretty" => {}
            other => return Err(bad_request(format!("unknown create option {other:?}"))),
        }
    }
    Ok(dry_run)
}

/// Five characters for `generateName`, as the API server adds.
pub(crate) fn suffix() -> String {
    let simple = uuid::Uuid::now_v7().simple().to_string();
    simple[simple.len() - 5..].to_string()
}

fn now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .round(k8s_openapi::jiff::Unit::Second)
        .map(|t| t.to_string())
        .unwrap_or_default()
}
