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
//!
//! `webhookeventbatches`: up to 1,000 events in one create, stored in one transaction and
//! answered together once it commits, as `POST .../events/batch`, with a result per event
//! in `status.results` (accepted, a repeated id's first answer, or refused on its own).
//!
//! ```yaml
//! apiVersion: delivery.herald.dev/v1alpha1
//! kind: WebhookEventBatch
//! metadata: {generateName: orders-}
//! spec:
//!   events:
//!   - {id: evt-1, type: order.created, data: {order: 42}}
//!   - {type: order.paid}
//! ```

use axum::body::Body;
use axum::extract::{Extension, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use serde_json::value::RawValue;

use super::front_proxy::Identity;
use super::{Api, GROUP, GROUP_VERSION, Refused, created, dry_run, name_of, status, suffix};
use crate::delivery::engine::Origin;
use crate::ingest::openapi::BatchResult;
use crate::ingest::{ApiError, PublishRequest, body_error, checked, decode_each, publish_each};

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
    let dry_run = dry_run(&options)?;
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
    let id = name_of(&event.metadata);
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchSpec {
    /// Each as `POST .../events` takes it: `{id?, type, data?}`.
    events: Vec<Box<RawValue>>,
}

/// `POST /apis/delivery.herald.dev/v1alpha1/namespaces/{namespace}/webhookeventbatches`
pub async fn create_batch(
    State(api): State<Api>,
    Path(namespace): Path<String>,
    Query(options): Query<Vec<(String, String)>>,
    Extension(identity): Extension<Identity>,
    body: Body,
) -> Result<Response, Refused> {
    let dry_run = dry_run(&options)?;
    let limit = api.max_body.saturating_mul(8);
    let too_large = ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        format!("a batch is at most {limit} bytes"),
    );
    let bytes = axum::body::to_bytes(body, limit.saturating_add(ENVELOPE_ROOM))
        .await
        .map_err(|e| Refused::from(body_error(e, too_large)))?;
    let batch = created::<BatchSpec>(&bytes, "WebhookEventBatch", &namespace)?;
    // Not kept: the name only labels the answer (and the audit log's line).
    let name = name_of(&batch.metadata).unwrap_or_else(|| format!("batch-{}", suffix()));
    let results: Vec<serde_json::Value> = if dry_run {
        decode_each(&batch.spec.events, api.max_body)
            .map_err(Refused::from)?
            .into_iter()
            .map(|checked| match checked {
                Ok(request) => json!({"id": request.id, "valid": true}),
                Err(e) => json!(BatchResult::from(e)),
            })
            .collect()
    } else {
        publish_each(&api.engine, &namespace, &batch.spec.events, api.max_body)
            .await
            .map_err(Refused::from)?
            .into_iter()
            .map(|result| json!(result))
            .collect()
    };
    let count = |f: &dyn Fn(&serde_json::Value) -> bool| results.iter().filter(|r| f(r)).count();
    let status = json!({
        "accepted": count(&|r| r["duplicate"] == false),
        "duplicates": count(&|r| r["duplicate"] == true),
        "refused": count(&|r| r.get("error").is_some()),
        "results": results,
    });
    tracing::debug!(namespace, user = %identity.user, events = batch.spec.events.len(), dry_run, "a batch through the aggregated API");
    // The events are not echoed back (up to 1,000 of them): the results name them.
    let answer = json!({
        "apiVersion": GROUP_VERSION,
        "kind": "WebhookEventBatch",
        "metadata": {"name": name, "namespace": namespace, "creationTimestamp": now()},
        "status": status,
    });
    Ok((StatusCode::CREATED, axum::Json(answer)).into_response())
}

fn now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .round(k8s_openapi::jiff::Unit::Second)
        .map(|t| t.to_string())
        .unwrap_or_default()
}
