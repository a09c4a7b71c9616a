//! The manifests in config/samples/ are what herald's types accept.

use herald::api::{WebhookQuota, WebhookSubscription};

#[test]
fn samples_deserialize_into_herald_types() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/samples");
    let mut kinds = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(&text).unwrap();
        for doc in docs {
            let kind = doc["kind"].as_str().unwrap().to_string();
            match kind.as_str() {
                "WebhookSubscription" => {
                    let sub: WebhookSubscription = serde_json::from_value(doc).unwrap();
                    assert!(sub.spec.matches("order.created"), "{}", path.display());
                }
                "WebhookQuota" => {
                    let quota: WebhookQuota = serde_json::from_value(doc).unwrap();
                    assert!(
                        quota.spec.max_in_flight >= herald::api::quota::MIN_NAMESPACE_IN_FLIGHT
                    );
                }
                // The producer's grant (config/samples/publisher.yaml).
                "Secret" | "ServiceAccount" | "Role" | "RoleBinding" => {}
                other => panic!("{}: unexpected kind {other}", path.display()),
            }
            kinds.push(kind);
        }
    }
    kinds.sort();
    assert_eq!(
        kinds,
        [
            "Role",
            "RoleBinding",
            "Secret",
            "ServiceAccount",
            "WebhookQuota",
            "WebhookSubscription"
        ]
    );
}
