//! `replays` and `enablements`: the direct API's replay and re-enable, as creates the API
//! server authorizes (`create replays.delivery.herald.dev` in the namespace).
//!
//! ```yaml
//! apiVersion: delivery.herald.dev/v1alpha1
//! kind: Replay
//! metadata: {generateName: orders-}
//! spec: {subscription: orders, since: "2026-12-05T10:00:00Z"}   # eventIds, until too
//! ---
//! apiVersion: delivery.herald.dev/v1alpha1
//! kind: Enablement
//! metadata: {generateName: orders-}
//! spec: {subscription: orders}
//! ```
//!
//! Neither is kept: the answer (201) says what was done (`status.replayed`, or the
//! subscription's state), and the API server's audit log who did it.

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use super::{Api, GROUP_VERSION, Refused, created, dry_run, name_of};
use crate::ingest::{ApiError, ReplayRequest, body_error};

/// Largest replay or enablement body.
const MAX_BODY: usize = 256 * 1024;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ReplaySpec {
    subscription: String,
    event_ids: Option<Vec<String>>,
    since: Option<String>,
    until: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EnablementSpec {
    subscription: String,
}

async fn read(body: Body) -> Result<axum::body::Bytes, Refused> {
    let too_large = ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        "the request is too large",
    );
    axum::body::to_bytes(body, MAX_BODY)
        .await
        .map_err(|e| Refused::from(body_error(e, too_large)))
}

fn answer(
    kind: &str,
    namespace: &str,
    name: String,
    spec: serde_json::Value,
    status: serde_json::Value,
) -> Response {
    let body = json!({
        "apiVersion": GROUP_VERSION,
        "kind": kind,
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
        "status": status,
    });
    (StatusCode::CREATED, axum::Json(body)).into_response()
}

/// `POST .../namespaces/{namespace}/replays`: dead letters of the subscription due again.
pub async fn create_replay(
    State(api): State<Api>,
    Path(namespace): Path<String>,
    Query(pairs): Query<Vec<(String, String)>>,
    body: Body,
) -> Result<Response, Refused> {
    let dry = dry_run(&pairs)?;
    let object = created::<ReplaySpec>(&read(body).await?, "Replay", &namespace)?;
    let spec = object.spec;
    let name = name_of(&object.metadata).unwrap_or_else(|| spec.subscription.clone());
    let echo = json!({"subscription": spec.subscription, "eventIds": spec.event_ids, "since": spec.since, "until": spec.until});
    let selection = ReplayRequest {
        event_ids: spec.event_ids,
        since: spec.since,
        until: spec.until,
    }
    .selection()
    .map_err(Refused::from)?;
    if dry {
        return Ok(answer("Replay", &namespace, name, echo, json!({})));
    }
    let replayed = api
        .engine
        .replay(&namespace, &spec.subscription, selection)
        .await
        .map_err(|e| Refused::from(ApiError::from(e)))?;
    Ok(answer(
        "Replay",
        &namespace,
        name,
        echo,
        json!({"replayed": replayed}),
    ))
}

/// `POST .../namespaces/{namespace}/enablements`: the subscription sends again.
pub async fn create_enablement(
    State(api): State<Api>,
    Path(namespace): Path<String>,
    Query(pairs): Query<Vec<(String, String)>>,
    body: Body,
) -> Result<Response, Refused> {
    let dry = dry_run(&pairs)?;
    let object = created::<EnablementSpec>(&read(body).await?, "Enablement", &namespace)?;
    let subscription = object.spec.subscription;
    let name = name_of(&object.metadata).unwrap_or_else(|| subscription.clone());
    let echo = json!({"subscription": subscription});
    if dry {
        return Ok(answer("Enablement", &namespace, name, echo, json!({})));
    }
    let state = api
        .engine
        .enable(&namespace, &subscription)
        .await
        .map_err(|e| Refused::from(ApiError::from(e)))?;
    let state = serde_json::to_value(state).unwrap_or_default();
    Ok(answer("Enablement", &namespace, name, echo, state))
}
