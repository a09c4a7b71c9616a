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
            .map_err(|errors| errors.to_string())?;
        openapi_bounds(spec)
    }
}

/// The schema's OpenAPI bounds that the CEL rules rely on and the API server enforces before
/// them (header count, value length and single-line values; the signature header's name).
/// Worded without values: a header value may be a credential.
fn openapi_bounds(spec: &WebhookSubscriptionSpec) -> Result<(), String> {
    const MAX_HEADERS: usize = 32;
    const MAX_VALUE: usize = 4096;
    let mut errors = Vec::new();
    if spec.headers.len() > MAX_HEADERS {
        errors.push(format!(
            "spec.headers: {} headers, at most {MAX_HEADERS}",
            spec.headers.len()
        ));
    }
    for (name, value) in &spec.headers {
        if value.len() > MAX_VALUE {
            errors.push(format!(
                "spec.headers.{name}: longer than {MAX_VALUE} characters"
            ));
        }
        if value.contains(['\r', '\n']) {
            errors.push(format!("spec.headers.{name}: must be a single line"));
        }
    }
    if let Some(header) = &spec.signing.header {
        let token = header
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&*+.^_|~-".contains(&b));
        if header.is_empty() || header.len() > 128 || !token {
            errors.push("spec.signing.header: must be an HTTP token of 1-128 characters".into());
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
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
        assert!(with(serde_json::json!({"signing": {"scheme": "stripe", "header": "X-Sig", "secretRef": {"name": "s", "key": "k"}}, "headers": {"x-route": "1"}})).is_ok());
        assert!(with(serde_json::json!({"headers": (0..32).map(|i| (format!("x-h{i}"), serde_json::json!("v".repeat(4096)))).collect::<serde_json::Map<_, _>>()})).is_ok());
        for bad in [
            serde_json::json!({"url": "ftp://example.com/"}),
            serde_json::json!({"url": "/relative/path"}),
            serde_json::json!({"url": "https://user:pw@example.com/"}),
            serde_json::json!({"delivery": {"timeout": "10m"}}),
            serde_json::json!({"delivery": {"retry": {"initialBackoff": "2h", "maxBackoff": "1h"}}}),
            serde_json::json!({"headers": {"Webhook-Signature": "x"}}),
            // Issue 9, defect 4: a signature header herald or HTTP framing owns.
            serde_json::json!({"signing": {"scheme": "stripe", "header": "Content-Type", "secretRef": {"name": "s", "key": "k"}}}),
            serde_json::json!({"signing": {"scheme": "stripe", "header": "content-length", "secretRef": {"name": "s", "key": "k"}}}),
            serde_json::json!({"signing": {"scheme": "stripe", "header": "Host", "secretRef": {"name": "s", "key": "k"}}}),
            serde_json::json!({"signing": {"scheme": "stripe", "header": "Transfer-Encoding", "secretRef": {"name": "s", "key": "k"}}}),
            serde_json::json!({"signing": {"scheme": "stripe", "header": "User-Agent", "secretRef": {"name": "s", "key": "k"}}}),
            serde_json::json!({"signing": {"scheme": "stripe", "header": "Herald-Event-Id", "secretRef": {"name": "s", "key": "k"}}}),
            serde_json::json!({"signing": {"scheme": "stripe", "header": "webhook-id", "secretRef": {"name": "s", "key": "k"}}}),
            serde_json::json!({"signing": {"scheme": "stripe", "header": "Connection", "secretRef": {"name": "s", "key": "k"}}}),
            // ... or one of the subscription's own static headers.
            serde_json::json!({"signing": {"scheme": "stripe", "header": "X-Sig", "secretRef": {"name": "s", "key": "k"}}, "headers": {"x-sig": "1"}}),
            // Hop-by-hop and framing headers in spec.headers.
            serde_json::json!({"headers": {"Content-Encoding": "gzip"}}),
            serde_json::json!({"headers": {"Upgrade": "h2c"}}),
            serde_json::json!({"headers": {"TE": "trailers"}}),
            serde_json::json!({"headers": {"Trailer": "x"}}),
            serde_json::json!({"headers": {"Keep-Alive": "timeout=5"}}),
            serde_json::json!({"headers": {"Proxy-Connection": "close"}}),
            serde_json::json!({"headers": {"Expect": "100-continue"}}),
            // The schema's OpenAPI bounds, which only an API server checked.
            serde_json::json!({"headers": (0..33).map(|i| (format!("x-h{i}"), serde_json::json!("v"))).collect::<serde_json::Map<_, _>>()}),
            serde_json::json!({"headers": {"x-long": "v".repeat(4097)}}),
            serde_json::json!({"headers": {"x-split": "a\r\nInjected: yes"}}),
            serde_json::json!({"headers": {"x-split": "a\nb"}}),
            serde_json::json!({"signing": {"scheme": "stripe", "header": "bad header", "secretRef": {"name": "s", "key": "k"}}}),
            serde_json::json!({"signing": {"scheme": "stripe", "header": "x".repeat(129), "secretRef": {"name": "s", "key": "k"}}}),
        ] {
            assert!(with(bad.clone()).is_err(), "{bad} passed");
        }
    }
}
