//! `deliveries`: the namespace's attempt log as Kubernetes objects, newest first, for
//! `kubectl get deliveries` (a table), `-o yaml`, `--chunk-size` (`limit` and `continue`)
//! and `-w` (a watch that polls the log once a second). Each object is one attempt of an
//! event to a subscription, named `<subscription>-<log id>`; its `resourceVersion` is its
//! place in the log. Field selectors: `subscription`, `outcome` (Accepted, Transient,
//! Terminal, Gone), `status` (the receiver's HTTP status) and `state=dead` (with
//! `subscription`: the last attempt of each of its dead letters, which a replay sends again).

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::{Api, GROUP, GROUP_VERSION, Refused, bad_request, status};
use crate::delivery::engine::EngineError;
use crate::ingest::ApiError;
use crate::store::{AttemptHit, AttemptPage, AttemptSearch, StateFilter};

/// A list without `limit` returns at most this many, with a `continue` for the rest.
const UNLIMITED_LIST: usize = 10_000;
/// Most attempts one poll of a watch reads; more new ones than this in a second (or, with a
/// field selector, more than the store scans at once) ends the watch with 410 Expired, and
/// the client lists again (as after any expired watch).
const WATCH_PAGE: u32 = 1_000;
/// A watch without `timeoutSeconds` ends after this (clients start a new one).
const WATCH_DEFAULT: Duration = Duration::from_secs(30 * 60);

/// What a list or watch asks for.
struct ListOptions {
    subscription: Option<String>,
    outcomes: Option<Vec<String>>,
    status_code: Option<u16>,
    /// `state=dead`: the dead letters' last attempts rather than the log.
    dead: bool,
    /// A name from `metadata.name=` (kubectl sends it for `get NAME -w`).
    name: Option<String>,
    limit: Option<u32>,
    continue_from: Option<(i64, i64)>,
    watch: bool,
    resource_version: Option<i64>,
    timeout: Duration,
}

fn options(pairs: &[(String, String)]) -> Result<ListOptions, Refused> {
    let mut options = ListOptions {
        subscription: None,
        outcomes: None,
        status_code: None,
        dead: false,
        name: None,
        limit: None,
        continue_from: None,
        watch: false,
        resource_version: None,
        timeout: WATCH_DEFAULT,
    };
    for (key, value) in pairs {
        match key.as_str() {
            "fieldSelector" => field_selector(value, &mut options)?,
            "labelSelector" if value.is_empty() => {}
            "labelSelector" => {
                return Err(bad_request(
                    "deliveries have no labels: select them with a field selector (subscription, outcome, status, state)",
                ));
            }
            "limit" => {
                let limit: u32 = value
                    .parse()
                    .map_err(|_| bad_request("limit must be a number"))?;
                options.limit = (limit > 0).then_some(limit.min(1_000));
            }
            "continue" if value.is_empty() => {}
            "continue" => {
                options.continue_from = Some(
                    value
                        .split_once('.')
                        .and_then(|(rv, next)| Some((rv.parse().ok()?, next.parse().ok()?)))
                        .ok_or_else(|| bad_request("continue is not a token this API gave"))?,
                );
            }
            "watch" => options.watch = value == "true" || value == "1",
            "resourceVersion" if value.is_empty() || value == "0" => {}
            "resourceVersion" => {
                options.resource_version = Some(
                    value
                        .parse()
                        .map_err(|_| bad_request("resourceVersion is not one this API gave"))?,
                );
            }
            "timeoutSeconds" => {
                let seconds: u64 = value
                    .parse()
                    .map_err(|_| bad_request("timeoutSeconds must be a number"))?;
                options.timeout = Duration::from_secs(seconds.clamp(1, 3_600));
            }
            "allowWatchBookmarks"
            | "resourceVersionMatch"
            | "includeObject"
            | "pretty"
            | "sendInitialEvents" => {}
            other => return Err(bad_request(format!("unknown list option {other:?}"))),
        }
    }
    Ok(options)
}

/// `subscription=orders,outcome=Transient,status=503` (`==` too).
fn field_selector(selector: &str, options: &mut ListOptions) -> Result<(), Refused> {
    for term in selector.split(',').filter(|t| !t.is_empty()) {
        let (field, value) = term
            .split_once("==")
            .or_else(|| term.split_once('='))
            .filter(|(field, _)| !field.ends_with('!'))
            .ok_or_else(|| {
                bad_request(format!(
                    "field selector {term:?}: deliveries are selected with field=value"
                ))
            })?;
        match field.trim() {
            "subscription" => options.subscription = Some(value.trim().to_string()),
            "outcome" => {
                let outcome = ["Accepted", "Transient", "Terminal", "Gone"]
                    .into_iter()
                    .find(|known| known.eq_ignore_ascii_case(value.trim()))
                    .ok_or_else(|| {
                        bad_request(format!(
                            "outcome {value:?} is not Accepted, Transient, Terminal or Gone"
                        ))
                    })?;
                options.outcomes = Some(vec![outcome.to_string()]);
            }
            "status" => {
                options.status_code = Some(
                    value
                        .trim()
                        .parse()
                        .ok()
                        .filter(|code| (100..=599).contains(code))
                        .ok_or_else(|| {
                            bad_request(format!("status {value:?} is not an HTTP status code"))
                        })?,
                );
            }
            "state" if value.trim().eq_ignore_ascii_case("dead") => options.dead = true,
            "state" => {
                return Err(bad_request(format!(
                    "state {value:?}: deliveries are attempts, and state=dead selects the last attempt of each dead letter (pending deliveries: the WebhookSubscription's status counts them)"
                )));
            }
            "metadata.name" => options.name = Some(value.trim().to_string()),
            "metadata.namespace" => {}
            other => {
                return Err(bad_request(format!(
                    "field label not supported: {other} (deliveries are selected by subscription, outcome, status and state)"
                )));
            }
        }
    }
    Ok(())
}

/// An attempt as a Delivery object.
fn object(namespace: &str, id: i64, hit: &AttemptHit) -> Value {
    let attempt = &hit.attempt;
    let mut object = json!({
        "apiVersion": GROUP_VERSION,
        "kind": "Delivery",
        "metadata": {
            "name": format!("{}-{id}", hit.subscription),
            "namespace": namespace,
            "creationTimestamp": timestamp(attempt.at_ms),
            "resourceVersion": id.to_string(),
        },
        "subscription": hit.subscription,
        "eventId": hit.event_id,
        "eventType": hit.event_type,
        "outcome": attempt.outcome,
        "latencyMs": attempt.latency_ms,
        "message": attempt.message,
    });
    if let Some(code) = attempt.status_code {
        object["statusCode"] = code.into();
    }
    object
}

fn timestamp(ms: i64) -> String {
    k8s_openapi::jiff::Timestamp::from_millisecond(ms)
        .ok()
        .and_then(|t| t.round(k8s_openapi::jiff::Unit::Second).ok())
        .map(|t| t.to_string())
        .unwrap_or_default()
}

/// How long ago, as kubectl shows an age.
fn age(ms: i64) -> String {
    let now = crate::delivery::clock::now_ms();
    let seconds = (now - ms).max(0) / 1000;
    match seconds {
        0..=119 => format!("{seconds}s"),
        120..=10_799 => format!("{}m", seconds / 60),
        10_800..=172_799 => format!("{}h", seconds / 3600),
        _ => format!("{}d", seconds / 86_400),
    }
}

/// Whether the client asked for a Table (kubectl get's server-side printing).
fn wants_table(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("as=Table"))
}

fn columns() -> Value {
    let column = |name: &str, kind: &str, format: &str, description: &str| json!({"name": name, "type": kind, "format": format, "description": description, "priority": 0});
    json!([
        column(
            "Name",
            "string",
            "name",
            "The subscription and the attempt's place in the log"
        ),
        column("Subscription", "string", "", "The WebhookSubscription"),
        column("Event", "string", "", "The event id"),
        column("Type", "string", "", "The event type"),
        column(
            "Outcome",
            "string",
            "",
            "Accepted, Transient, Terminal or Gone"
        ),
        column("Status", "string", "", "The receiver's HTTP status"),
        column(
            "Latency",
            "string",
            "",
            "From the request's start to the answer's end"
        ),
        column("Age", "string", "", "Since the attempt ended"),
    ])
}

fn row(namespace: &str, id: i64, hit: &AttemptHit) -> Value {
    let attempt = &hit.attempt;
    json!({
        "cells": [
            format!("{}-{id}", hit.subscription),
            hit.subscription,
            hit.event_id,
            hit.event_type,
            attempt.outcome,
            attempt.status_code.map(|c| c.to_string()).unwrap_or_default(),
            format!("{}ms", attempt.latency_ms),
            age(attempt.at_ms),
        ],
        "object": {
            "kind": "PartialObjectMetadata",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": object(namespace, id, hit)["metadata"].clone(),
        },
    })
}

fn table(namespace: &str, rows: &[(i64, AttemptHit)], metadata: Value) -> Value {
    json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": metadata,
        "columnDefinitions": columns(),
        "rows": rows.iter().map(|(id, hit)| row(namespace, *id, hit)).collect::<Vec<_>>(),
    })
}

fn engine_error(e: EngineError) -> Refused {
    Refused::from(ApiError::from(e))
}

fn search(
    namespace: &str,
    options: &ListOptions,
    before: Option<i64>,
    limit: u32,
) -> AttemptSearch {
    AttemptSearch {
        namespace: namespace.to_string(),
        subscription: options.subscription.clone(),
        outcomes: options.outcomes.clone(),
        status_code: options.status_code,
        since_ms: None,
        until_ms: None,
        before,
        limit,
    }
}

/// The log id a Delivery's name ends with.
fn id_of(name: &str) -> Option<i64> {
    name.rsplit_once('-')?.1.parse().ok().filter(|id| *id > 0)
}

/// `GET .../namespaces/{namespace}/deliveries`: a page of the log, or a watch.
pub async fn list(
    State(api): State<Api>,
    Path(namespace): Path<String>,
    Query(pairs): Query<Vec<(String, String)>>,
    headers: HeaderMap,
) -> Result<Response, Refused> {
    let options = options(&pairs)?;
    let table = wants_table(&headers);
    if options.dead {
        return dead_letters(api, namespace, options, table).await;
    }
    if options.watch {
        return Ok(watch(api, namespace, options, table).await);
    }
    let wanted = options.limit.map_or(UNLIMITED_LIST, |l| l as usize);
    let (resource_version, mut before) = match options.continue_from {
        Some((rv, next)) => (Some(rv), Some(next)),
        None => (None, None),
    };
    let mut rows: Vec<(i64, AttemptHit)> = Vec::new();
    let mut more = false;
    loop {
        let room = (wanted - rows.len()).min(1_000) as u32;
        let AttemptPage {
            items, ids, next, ..
        } = api
            .engine
            .search(search(&namespace, &options, before, room))
            .await
            .map_err(engine_error)?;
        rows.extend(ids.into_iter().zip(items));
        before = next;
        if next.is_none() {
            break;
        }
        if rows.len() >= wanted || options.limit.is_some() {
            more = true;
            break;
        }
    }
    if let Some(name) = &options.name {
        rows.retain(|(id, hit)| format!("{}-{id}", hit.subscription) == *name);
    }
    // The list's version: the newest attempt it could have shown, so a watch from it sees
    // every later one.
    let resource_version = resource_version
        .or_else(|| rows.first().map(|(id, _)| *id))
        .unwrap_or(0);
    let mut metadata = json!({"resourceVersion": resource_version.to_string()});
    if more && let Some(next) = before {
        metadata["continue"] = format!("{resource_version}.{next}").into();
    }
    Ok(axum::Json(page(&namespace, &rows, metadata, table, None)).into_response())
}

/// `state=dead`: the last attempt of each of a subscription's dead letters, in one page (a
/// dead letter is named by its last attempt, so `get` finds it too).
async fn dead_letters(
    api: Api,
    namespace: String,
    options: ListOptions,
    table: bool,
) -> Result<Response, Refused> {
    let Some(subscription) = &options.subscription else {
        return Err(bad_request(
            "state=dead lists one subscription's dead letters: add subscription=NAME",
        ));
    };
    if options.watch || options.continue_from.is_some() {
        return Err(bad_request(
            "state=dead is one page of dead letters: it has no watch and no continue",
        ));
    }
    let limit = options.limit.unwrap_or(UNLIMITED_LIST as u32);
    let letters = api
        .engine
        .list(&namespace, subscription, StateFilter::Dead, limit)
        .await
        .map_err(engine_error)?;
    let mut rows: Vec<(i64, AttemptHit)> = letters
        .into_iter()
        .filter_map(|letter| {
            Some((
                letter.last_attempt_id?,
                AttemptHit {
                    subscription: subscription.clone(),
                    event_id: letter.event_id,
                    event_type: letter.event_type,
                    attempt: letter.last_attempt?,
                },
            ))
        })
        .filter(|(id, hit)| {
            options
                .outcomes
                .as_ref()
                .is_none_or(|o| o.contains(&hit.attempt.outcome))
                && options
                    .status_code
                    .is_none_or(|c| hit.attempt.status_code == Some(c))
                && options
                    .name
                    .as_ref()
                    .is_none_or(|n| *n == format!("{}-{id}", hit.subscription))
        })
        .collect();
    rows.sort_by_key(|(id, _)| std::cmp::Reverse(*id));
    let metadata = json!({"resourceVersion": rows.first().map_or(0, |(id, _)| *id).to_string()});
    Ok(axum::Json(page(&namespace, &rows, metadata, table, Some("Dead"))).into_response())
}

/// A list's answer: a Table, or a DeliveryList whose items carry `state` when it selected
/// by state.
fn page(
    namespace: &str,
    rows: &[(i64, AttemptHit)],
    metadata: Value,
    as_table: bool,
    state: Option<&str>,
) -> Value {
    if as_table {
        return table(namespace, rows, metadata);
    }
    let items: Vec<Value> = rows
        .iter()
        .map(|(id, hit)| {
            let mut object = object(namespace, *id, hit);
            if let Some(state) = state {
                object["state"] = state.into();
            }
            object
        })
        .collect();
    json!({
        "apiVersion": GROUP_VERSION,
        "kind": "DeliveryList",
        "metadata": metadata,
        "items": items,
    })
}

/// `GET .../namespaces/{namespace}/deliveries/{name}`
pub async fn get(
    State(api): State<Api>,
    Path((namespace, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, Refused> {
    let not_found = || {
        Refused::new(status(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("deliveries.{GROUP} {name:?} not found"),
            Some(json!({"name": name, "group": GROUP, "kind": "deliveries"})),
        ))
    };
    let id = id_of(&name).ok_or_else(not_found)?;
    let options = options(&[])?;
    let page = api
        .engine
        .search(search(&namespace, &options, Some(id.saturating_add(1)), 1))
        .await
        .map_err(engine_error)?;
    let found = page
        .ids
        .into_iter()
        .zip(page.items)
        .find(|(found, hit)| *found == id && format!("{}-{id}", hit.subscription) == name)
        .ok_or_else(not_found)?;
    let body = if wants_table(&headers) {
        table(
            &namespace,
            &[found],
            json!({"resourceVersion": id.to_string()}),
        )
    } else {
        object(&namespace, found.0, &found.1)
    };
    Ok(axum::Json(body).into_response())
}

/// A watch: once a second, the attempts logged after the last one sent, oldest first, as
/// `ADDED` events (attempts never change or go). Ends at `timeoutSeconds`, or with 410
/// Expired when more than [`WATCH_PAGE`] arrived between two looks.
async fn watch(api: Api, namespace: String, options: ListOptions, table: bool) -> Response {
    let started = tokio::time::Instant::now();
    let state = (api, namespace, options, None::<i64>, false);
    let events = futures::stream::unfold(
        state,
        move |(api, namespace, options, last, done)| async move {
            if done {
                return None;
            }
            let mut last = last;
            loop {
                if last.is_some() {
                    if started.elapsed() >= options.timeout {
                        return None;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                let page = match api
                    .engine
                    .search(search(&namespace, &options, None, WATCH_PAGE))
                    .await
                {
                    Ok(page) => page,
                    Err(EngineError::ReadBusy { .. }) => {
                        // Busy reading for this namespace: look again at the next tick.
                        last = last.or(options.resource_version).or(Some(0));
                        continue;
                    }
                    Err(e) => {
                        let line = watch_error(500, "InternalError", &e.to_string());
                        return Some((
                            Ok::<_, std::io::Error>(line),
                            (api, namespace, options, last, true),
                        ));
                    }
                };
                let newest = page.ids.first().copied().unwrap_or(0);
                let since = match last.or(options.resource_version) {
                    Some(since) => since,
                    // From "now" when no version was given.
                    None => {
                        last = Some(newest);
                        continue;
                    }
                };
                let mut fresh: Vec<(i64, AttemptHit)> = page
                    .ids
                    .into_iter()
                    .zip(page.items)
                    .filter(|(id, _)| *id > since)
                    .collect();
                // Attempts older than the page's cursor were not read: if some of them are
                // newer than `since`, this look cannot tell them all.
                if page.next.is_some_and(|next| next > since.saturating_add(1)) {
                    let line = watch_error(
                        410,
                        "Expired",
                        "too many attempts since this version: list again",
                    );
                    return Some((Ok(line), (api, namespace, options, last, true)));
                }
                if let Some(name) = &options.name {
                    fresh.retain(|(id, hit)| format!("{}-{id}", hit.subscription) == *name);
                }
                last = Some(newest.max(since));
                if fresh.is_empty() {
                    continue;
                }
                fresh.reverse();
                let mut lines = Vec::new();
                for (id, hit) in &fresh {
                    let object = if table {
                        self::table(
                            &namespace,
                            &[(*id, hit.clone())],
                            json!({"resourceVersion": id.to_string()}),
                        )
                    } else {
                        object(&namespace, *id, hit)
                    };
                    let mut line = serde_json::to_vec(&json!({"type": "ADDED", "object": object}))
                        .expect("JSON");
                    line.push(b'\n');
                    lines.extend(line);
                }
                return Some((
                    Ok(axum::body::Bytes::from(lines)),
                    (api, namespace, options, last, false),
                ));
            }
        },
    );
    Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(events))
        .expect("a response")
}

/// A watch's ERROR event.
fn watch_error(code: u16, reason: &str, message: &str) -> axum::body::Bytes {
    let event = json!({"type": "ERROR", "object": {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code,
    }});
    let mut line = serde_json::to_vec(&event).expect("JSON");
    line.push(b'\n');
    axum::body::Bytes::from(line)
}
