//! The schema's CEL rules, checked client-side, for specs that do not pass through an API
//! server (standalone mode). The rules are compiled once from the very CRD herald installs,
//! so both paths enforce the same rules.

use kube::CustomResourceExt;
use kube::core::cel::{CompiledSchema, Validator, compile_schema};

use super::{WebhookSubscription, WebhookSubscriptionSpec, crdgen};

pub struct SubscriptionRules {
    compiled: CompiledSchema,
    validator: Validator,
}

impl SubscriptionRules {
    pub fn new() -> Self {
        let crd = crdgen::kubernetes_formats(WebhookSubscription::crd());
        let schema = crd
            .spec
            .versions
            .first()
            .and_then(|v| v.schema.as_ref())
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .map(|s| serde_json::to_value(s).expect("a CRD schema serialises"))
            .expect("the derived CRD has an openAPIV3Schema");
        Self {
            compiled: compile_schema(&schema),
            validator: Validator::new(),
        }
    }

    /// Every broken rule, as the API server would word it; Ok when the spec passes.
    pub fn check(&self, name: &str, spec: &WebhookSubscriptionSpec) -> Result<(), String> {
        let object = serde_json::to_value(WebhookSubscription::new(name, spec.clone()))
            .map_err(|e| e.to_string())?;
        self.validator
            .validate_compiled(&self.compiled, &object, None)
            .map_err(|errors| errors.to_string())
    }
}

impl Default for SubscriptionRules {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(patch: serde_json::Value) -> Result<(), String> {
        let mut spec = serde_json::json!({
            "url": "https://example.com/hook",
            "eventTypes": ["a.*"],
            "signing": {"secretRef": {"name": "s", "key": "k"}}
        });
        for (k, v) in patch.as_object().unwrap() {
            spec[k] = v.clone();
        }
        let spec: WebhookSubscriptionSpec = serde_json::from_value(spec).unwrap();
        SubscriptionRules::new().check("x", &spec)
    }

    #[test]
    fn the_schema_cel_rules_run_client_side_too() {
        // (The URL rule avoids getScheme(): kube-cel reports "" for any http://localhost URL,
        // unlike the API server.)
        assert!(with(serde_json::json!({})).is_ok());
        assert!(with(serde_json::json!({"url": "http://localhost:8080/x"})).is_ok());
        assert!(with(serde_json::json!({"url": "http://[::1]:8080/x"})).is_ok());
        for bad in [
            serde_json::json!({"url": "ftp://example.com/"}),
            serde_json::json!({"url": "/relative/path"}),
            serde_json::json!({"url": "https://user:pw@example.com/"}),
            serde_json::json!({"delivery": {"timeout": "10m"}}),
            serde_json::json!({"delivery": {"retry": {"initialBackoff": "2h", "maxBackoff": "1h"}}}),
            serde_json::json!({"headers": {"Webhook-Signature": "x"}}),
        ] {
            assert!(with(bad.clone()).is_err(), "{bad} passed");
        }
    }
}
