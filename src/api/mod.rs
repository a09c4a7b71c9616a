//! The Kubernetes API of herald: the `WebhookSubscription` and `WebhookQuota` custom
//! resources (group `herald.dev`, version `v1alpha1`) and the CRD manifests made from them.

pub mod conditions;
pub mod crdgen;
pub mod duration;
pub mod quota;
pub mod subscription;
pub mod validation;

pub use quota::{WebhookQuota, WebhookQuotaSpec, WebhookQuotaStatus};
pub use subscription::{
    DeliveryPolicy, LastAttempt, RetryPolicy, SecretKeyRef, SigningScheme, SigningSpec,
    SubscriptionCounters, WebhookSubscription, WebhookSubscriptionSpec, WebhookSubscriptionStatus,
};

/// The API group of every herald resource.
pub const GROUP: &str = "herald.dev";
/// The served and stored version.
pub const VERSION: &str = "v1alpha1";

/// Ensures a schema node carries the "x-kubernetes-list-type: map" markers keyed by
/// `type`, so that server-side apply merges conditions by type instead of replacing them.
pub(crate) fn conditions_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let mut schema =
        generator.subschema_for::<Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>>();
    let object = schema.ensure_object();
    object.insert("x-kubernetes-list-type".into(), "map".into());
    object.insert(
        "x-kubernetes-list-map-keys".into(),
        serde_json::json!(["type"]),
    );
    object.insert(
        "description".into(),
        "Current state of the object as metav1.Condition entries, one per type. `Ready` summarises the rest."
            .into(),
    );
    schema
}
