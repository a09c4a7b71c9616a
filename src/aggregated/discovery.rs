//! Discovery: what `kubectl api-resources` and every client's REST mapper read. The API
//! server's aggregator asks herald for these documents and merges them into its own.

use axum::Json;
use serde_json::{Value, json};

use super::{GROUP, GROUP_VERSION, VERSION};

fn version() -> Value {
    json!({"groupVersion": GROUP_VERSION, "version": VERSION})
}

fn api_group() -> Value {
    json!({
        "kind": "APIGroup",
        "apiVersion": "v1",
        "name": GROUP,
        "versions": [version()],
        "preferredVersion": version(),
    })
}

/// `GET /apis`
pub async fn group_list() -> Json<Value> {
    Json(json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [api_group()]}))
}

/// `GET /apis/delivery.herald.dev`
pub async fn group() -> Json<Value> {
    Json(api_group())
}

/// `GET /apis/delivery.herald.dev/v1alpha1`
pub async fn resources() -> Json<Value> {
    Json(json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": GROUP_VERSION,
        "resources": [{
            "name": "webhookevents",
            "singularName": "webhookevent",
            "namespaced": true,
            "kind": "WebhookEvent",
            "verbs": ["create"],
            "shortNames": ["whevent"],
            "categories": ["herald"],
        }, {
            "name": "webhookeventbatches",
            "singularName": "webhookeventbatch",
            "namespaced": true,
            "kind": "WebhookEventBatch",
            "verbs": ["create"],
            "categories": ["herald"],
        }, {
            "name": "deliveries",
            "singularName": "delivery",
            "namespaced": true,
            "kind": "Delivery",
            "verbs": ["get", "list", "watch"],
            "shortNames": ["whdel"],
            "categories": ["herald"],
        }, {
            "name": "replays",
            "singularName": "replay",
            "namespaced": true,
            "kind": "Replay",
            "verbs": ["create"],
        }, {
            "name": "enablements",
            "singularName": "enablement",
            "namespaced": true,
            "kind": "Enablement",
            "verbs": ["create"],
        }],
    }))
}

/// A created kind's schema, as `kubectl explain` shows it: the envelope every kind of the
/// group shares around its `spec` and `status`.
fn kind_schema(kind: &str, description: &str, spec: Value, status: Value) -> Value {
    json!({
        "type": "object",
        "description": description,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": GROUP_VERSION},
            "kind": {"type": "string", "description": kind},
            "metadata": {
                "type": "object",
                "description": "name (or generateName, a prefix herald completes) and namespace.",
                "x-kubernetes-preserve-unknown-fields": true,
            },
            "spec": spec,
            "status": status,
        },
    })
}

/// An event as the ingest API takes it (`spec` of a WebhookEvent, each of a batch's).
fn event_properties() -> Value {
    json!({
        "type": {"type": "string", "description": "The event type subscriptions choose events by: 1-253 characters of letters, digits and _ . : / -"},
        "data": {"description": "Any JSON value, delivered to receivers as written.", "x-kubernetes-preserve-unknown-fields": true},
    })
}

fn webhook_event_schema() -> Value {
    kind_schema(
        "WebhookEvent",
        "An event to deliver: creating one publishes it to every WebhookSubscription of its namespace whose eventTypes match, signed, with retries. Acknowledged once stored. The name is the event id, the idempotency key (1-255 visible ASCII characters): creating a name the namespace published before is refused AlreadyExists and delivers nothing again.",
        json!({
            "type": "object",
            "description": "What happened.",
            "required": ["type"],
            "properties": event_properties(),
        }),
        json!({
            "type": "object",
            "description": "Written by herald in the answer to the create.",
            "properties": {
                "matched": {"type": "integer", "format": "int32", "description": "The deliveries the event got: one per matching subscription."},
            },
        }),
    )
}

fn webhook_event_batch_schema() -> Value {
    let mut event = event_properties();
    event["id"] = json!({"type": "string", "description": "The event id, the idempotency key (herald makes one when absent)."});
    kind_schema(
        "WebhookEventBatch",
        "Up to 1,000 events published together: stored in one transaction and answered once it commits, with a result per event. Not kept, and the events are not echoed back: status.results names them.",
        json!({
            "type": "object",
            "required": ["events"],
            "properties": {
                "events": {
                    "type": "array",
                    "description": "1 to 1,000 events, each as POST .../events takes it. One that is not valid, or that a quota refuses, is refused alone.",
                    "items": {"type": "object", "required": ["type"], "properties": event},
                },
            },
        }),
        json!({
            "type": "object",
            "description": "Written by herald in the answer to the create.",
            "properties": {
                "accepted": {"type": "integer", "description": "Events stored now."},
                "duplicates": {"type": "integer", "description": "Ids published before: nothing is delivered again."},
                "refused": {"type": "integer", "description": "Events refused alone."},
                "results": {"type": "array", "description": "Per event, in order: {id, matched, duplicate}, or {status, error: {code, message}}.", "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}},
            },
        }),
    )
}

fn replay_schema() -> Value {
    kind_schema(
        "Replay",
        "Dead letters of a subscription delivered again: due now, their attempts counted afresh. Not kept: the answer says how many.",
        json!({
            "type": "object",
            "required": ["subscription"],
            "properties": {
                "subscription": {"type": "string", "description": "The WebhookSubscription whose dead letters to replay."},
                "eventIds": {"type": "array", "items": {"type": "string"}, "description": "Only these events."},
                "since": {"type": "string", "format": "date-time", "description": "Only events published at or after this time (RFC 3339)."},
                "until": {"type": "string", "format": "date-time", "description": "Only events published before this time."},
            },
        }),
        json!({"type": "object", "properties": {"replayed": {"type": "integer", "description": "Dead letters due again."}}}),
    )
}

fn enablement_schema() -> Value {
    kind_schema(
        "Enablement",
        "Re-enables a subscription its failures (or a 410 Gone) disabled: it sends again and its failure count starts over. Not kept: the answer is the subscription's state.",
        json!({
            "type": "object",
            "required": ["subscription"],
            "properties": {"subscription": {"type": "string", "description": "The WebhookSubscription to re-enable."}},
        }),
        json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true}),
    )
}

/// The kinds clients create: (kind, plural, schema).
fn created_kinds() -> [(&'static str, &'static str, Value); 4] {
    [
        ("WebhookEvent", "webhookevents", webhook_event_schema()),
        (
            "WebhookEventBatch",
            "webhookeventbatches",
            webhook_event_batch_schema(),
        ),
        ("Replay", "replays", replay_schema()),
        ("Enablement", "enablements", enablement_schema()),
    ]
}

/// The query parameters of a create, which kubectl looks for on the kind's PATCH (it sends
/// `fieldValidation` only where the document lists it).
fn parameters(item: bool) -> Value {
    let mut list = vec![
        json!({"name": "namespace", "in": "path", "required": true, "schema": {"type": "string"}}),
        json!({"name": "dryRun", "in": "query", "schema": {"type": "string"}, "description": "All: check without doing."}),
        json!({"name": "fieldManager", "in": "query", "schema": {"type": "string"}}),
        json!({"name": "fieldValidation", "in": "query", "schema": {"type": "string"}, "description": "Unknown fields are always refused."}),
    ];
    if item {
        list.push(
            json!({"name": "name", "in": "path", "required": true, "schema": {"type": "string"}}),
        );
    }
    Value::Array(list)
}

/// Swagger 2.0 gives a parameter its type directly rather than a schema.
fn v2_parameters(mut parameters: Value) -> Value {
    for parameter in parameters.as_array_mut().into_iter().flatten() {
        let schema = parameter["schema"].take();
        parameter["type"] = schema["type"].clone();
        parameter.as_object_mut().map(|p| p.remove("schema"));
    }
    parameters
}

/// Paths and schemas of the created kinds. Each has its create and a PATCH of one object
/// that is always refused 405 (nothing herald takes is changed afterwards): kubectl reads a
/// kind's PATCH parameters to learn that the server validates fields itself, and without
/// one validates on the client against a CRD the caller may not be allowed to read.
fn document(
    v2: bool,
) -> (
    serde_json::Map<String, Value>,
    serde_json::Map<String, Value>,
) {
    let (mut paths, mut schemas) = (serde_json::Map::new(), serde_json::Map::new());
    for (kind, plural, schema) in created_kinds() {
        let name = format!("dev.herald.delivery.{VERSION}.{kind}");
        let gvk = json!({"group": GROUP, "version": VERSION, "kind": kind});
        let reference = if v2 {
            json!({"$ref": format!("#/definitions/{name}")})
        } else {
            json!({"$ref": format!("#/components/schemas/{name}")})
        };
        let collection = format!("/apis/{GROUP}/{VERSION}/namespaces/{{namespace}}/{plural}");
        let mut create = json!({
            "operationId": format!("createDeliveryHeraldDevV1alpha1Namespaced{kind}"),
            "x-kubernetes-action": "post",
            "x-kubernetes-group-version-kind": gvk,
        });
        let mut patch = json!({
            "operationId": format!("patchDeliveryHeraldDevV1alpha1Namespaced{kind}"),
            "description": "Always refused (405): it is never changed once created.",
            "responses": {"405": {"description": "Never changed once created"}},
            "x-kubernetes-action": "patch",
            "x-kubernetes-group-version-kind": gvk,
        });
        if v2 {
            let mut list = v2_parameters(parameters(false));
            list.as_array_mut()
                .expect("a list")
                .push(json!({"name": "body", "in": "body", "required": true, "schema": reference}));
            create["parameters"] = list;
            create["consumes"] = json!(["application/json"]);
            create["produces"] = json!(["application/json"]);
            create["responses"] = json!({"201": {"description": "Created", "schema": reference}});
            patch["parameters"] = v2_parameters(parameters(true));
        } else {
            create["parameters"] = parameters(false);
            create["requestBody"] =
                json!({"required": true, "content": {"application/json": {"schema": reference}}});
            create["responses"] = json!({"201": {"description": "Created", "content": {"application/json": {"schema": reference}}}});
            patch["parameters"] = parameters(true);
        }
        paths.insert(collection.clone(), json!({"post": create}));
        paths.insert(format!("{collection}/{{name}}"), json!({"patch": patch}));
        let mut schema = schema;
        schema["x-kubernetes-group-version-kind"] = json!([gvk]);
        schemas.insert(name, schema);
    }
    (paths, schemas)
}

/// `GET /openapi/v3`: where the group-version's document is.
pub async fn openapi_v3_index() -> Json<Value> {
    Json(json!({"paths": {
        "apis/delivery.herald.dev/v1alpha1": {"serverRelativeURL": "/openapi/v3/apis/delivery.herald.dev/v1alpha1"},
    }}))
}

/// `GET /openapi/v3/apis/delivery.herald.dev/v1alpha1`
pub async fn openapi_v3() -> Json<Value> {
    let (paths, schemas) = document(false);
    Json(json!({
        "openapi": "3.0.0",
        "info": {"title": "herald", "version": VERSION},
        "paths": paths,
        "components": {"schemas": schemas},
    }))
}

/// `GET /openapi/v2`: the same for clients that still read Swagger 2.0.
pub async fn openapi_v2() -> Json<Value> {
    let (paths, definitions) = document(true);
    Json(json!({
        "swagger": "2.0",
        "info": {"title": "herald", "version": VERSION},
        "paths": paths,
        "definitions": definitions,
    }))
}
