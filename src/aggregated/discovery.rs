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
        }],
    }))
}
