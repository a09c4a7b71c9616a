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
            "name": "deliveries",
            "singularName": "delivery",
            "namespaced": true,
            "kind": "Delivery",
            "verbs": ["get", "list", "watch"],
            "shortNames": ["whdel"],
            "categories": ["herald"],
        }],
    }))
}

/// The WebhookEvent's schema, as `kubectl explain` shows it.
fn webhook_event_schema() -> Value {
    json!({
        "type": "object",
        "description": "An event to deliver: creating one publishes it to every WebhookSubscription of its namespace whose eventTypes match, signed, with retries. Acknowledged once stored; creating a name the namespace published before is refused AlreadyExists and delivers nothing again.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "delivery.herald.dev/v1alpha1"},
            "kind": {"type": "string", "description": "WebhookEvent"},
            "metadata": {
                "type": "object",
                "description": "name is the event id, the idempotency key (1-255 visible ASCII characters); generateName, a prefix herald completes; namespace, where it is published.",
                "x-kubernetes-preserve-unknown-fields": true,
            },
            "spec": {
                "type": "object",
                "description": "What happened.",
                "required": ["type"],
                "properties": {
                    "type": {"type": "string", "description": "The event type subscriptions choose events by: 1-253 characters of letters, digits and _ . : / -"},
                    "data": {"description": "Any JSON value, delivered to receivers as written.", "x-kubernetes-preserve-unknown-fields": true},
                },
            },
            "status": {
                "type": "object",
                "description": "Written by herald in the answer to the create.",
                "properties": {
                    "matched": {"type": "integer", "format": "int32", "description": "The deliveries the event got: one per matching subscription."},
                },
            },
        },
        "x-kubernetes-group-version-kind": [{"group": GROUP, "version": VERSION, "kind": "WebhookEvent"}],
    })
}

const SCHEMA_NAME: &str = "dev.herald.delivery.v1alpha1.WebhookEvent";
const EVENTS_PATH: &str = "/apis/delivery.herald.dev/v1alpha1/namespaces/{namespace}/webhookevents";

/// The create operation, with the query parameters kubectl looks for (it sends
/// `fieldValidation` only where the document lists it).
fn create_parameters() -> Value {
    json!([
        {"name": "namespace", "in": "path", "required": true, "schema": {"type": "string"}},
        {"name": "dryRun", "in": "query", "schema": {"type": "string"}, "description": "All: check without publishing."},
        {"name": "fieldManager", "in": "query", "schema": {"type": "string"}},
        {"name": "fieldValidation", "in": "query", "schema": {"type": "string"}, "description": "Unknown fields are always refused."},
    ])
}

/// An event's own path: only PATCH is documented, always refused (a published event never
/// changes); it is there because kubectl reads a resource's PATCH parameters to learn that
/// the server validates fields itself, and otherwise validates on the client against a
/// CRD it may not be allowed to read.
const EVENT_PATH: &str =
    "/apis/delivery.herald.dev/v1alpha1/namespaces/{namespace}/webhookevents/{name}";

fn patch_parameters() -> Value {
    let mut parameters = create_parameters();
    parameters.as_array_mut().expect("a list").push(
        json!({"name": "name", "in": "path", "required": true, "schema": {"type": "string"}}),
    );
    parameters
}

/// `GET /openapi/v3`: where the group-version's document is.
pub async fn openapi_v3_index() -> Json<Value> {
    Json(json!({"paths": {
        "apis/delivery.herald.dev/v1alpha1": {"serverRelativeURL": "/openapi/v3/apis/delivery.herald.dev/v1alpha1"},
    }}))
}

/// `GET /openapi/v3/apis/delivery.herald.dev/v1alpha1`
pub async fn openapi_v3() -> Json<Value> {
    let reference = json!({"$ref": format!("#/components/schemas/{SCHEMA_NAME}")});
    Json(json!({
        "openapi": "3.0.0",
        "info": {"title": "herald", "version": VERSION},
        "paths": {EVENTS_PATH: {"post": {
            "operationId": "createDeliveryHeraldDevV1alpha1NamespacedWebhookEvent",
            "parameters": create_parameters(),
            "requestBody": {"required": true, "content": {"application/json": {"schema": reference}}},
            "responses": {"201": {"description": "Published", "content": {"application/json": {"schema": reference}}}},
            "x-kubernetes-action": "post",
            "x-kubernetes-group-version-kind": {"group": GROUP, "version": VERSION, "kind": "WebhookEvent"},
        }}, EVENT_PATH: {"patch": {
            "operationId": "patchDeliveryHeraldDevV1alpha1NamespacedWebhookEvent",
            "description": "Always refused (405): a published event never changes.",
            "parameters": patch_parameters(),
            "responses": {"405": {"description": "A published event never changes"}},
            "x-kubernetes-action": "patch",
            "x-kubernetes-group-version-kind": {"group": GROUP, "version": VERSION, "kind": "WebhookEvent"},
        }}},
        "components": {"schemas": {SCHEMA_NAME: webhook_event_schema()}},
    }))
}

/// `GET /openapi/v2`: the same schema for clients that still read Swagger 2.0.
pub async fn openapi_v2() -> Json<Value> {
    let reference = json!({"$ref": format!("#/definitions/{SCHEMA_NAME}")});
    // Swagger 2.0 gives a parameter its type directly rather than a schema.
    let v2 = |mut parameters: Value| {
        for parameter in parameters.as_array_mut().into_iter().flatten() {
            let schema = parameter["schema"].take();
            parameter["type"] = schema["type"].clone();
            parameter.as_object_mut().map(|p| p.remove("schema"));
        }
        parameters
    };
    let mut parameters = v2(create_parameters());
    parameters
        .as_array_mut()
        .expect("a list")
        .push(json!({"name": "body", "in": "body", "required": true, "schema": reference}));
    Json(json!({
        "swagger": "2.0",
        "info": {"title": "herald", "version": VERSION},
        "paths": {EVENTS_PATH: {"post": {
            "operationId": "createDeliveryHeraldDevV1alpha1NamespacedWebhookEvent",
            "consumes": ["application/json"],
            "produces": ["application/json"],
            "parameters": parameters,
            "responses": {"201": {"description": "Published", "schema": reference}},
            "x-kubernetes-action": "post",
            "x-kubernetes-group-version-kind": {"group": GROUP, "version": VERSION, "kind": "WebhookEvent"},
        }}, EVENT_PATH: {"patch": {
            "operationId": "patchDeliveryHeraldDevV1alpha1NamespacedWebhookEvent",
            "description": "Always refused (405): a published event never changes.",
            "parameters": v2(patch_parameters()),
            "responses": {"405": {"description": "A published event never changes"}},
            "x-kubernetes-action": "patch",
            "x-kubernetes-group-version-kind": {"group": GROUP, "version": VERSION, "kind": "WebhookEvent"},
        }}},
        "definitions": {SCHEMA_NAME: webhook_event_schema()},
    }))
}
