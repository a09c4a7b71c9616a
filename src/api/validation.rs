//! The schema's CEL rules, checked client-side, for specs that do not pass through an API
//! server (standalone mode). The rules are compiled once from the very CRD herald installs,
//! so both paths enforce the same rules.

use kube::CustomResourceExt;
use kube::core::cel::{CompiledSchema, ValidationErrors, Validator, compile_schema};

use super::{WebhookSubscription, WebhookSubscriptionSpec, crdgen};

pub struct SubscriptionRules {
    /// The spec's schema: the object's root and its other fields hold no rule (a test says
    /// so), and checking the spec alone spares converting the whole object at each level.
    spec: CompiledSchema,
    validator: Validator,
}

impl SubscriptionRules {
    pub fn new() -> Self {
        let spec = object_schema()
            .pointer("/properties/spec")
            .cloned()
            .expect("the CRD's schema has a spec");
        Self {
            spec: compile_schema(&without_plain_nodes(spec)),
            validator: Validator::new(),
        }
    }

    /// Every broken rule, as the API server would word it; Ok when the spec passes.
    pub fn check(&self, spec: &WebhookSubscriptionSpec) -> Result<(), String> {
        let value = serde_json::to_value(spec).map_err(|e| e.to_string())?;
        self.validator
            .validate_compiled(&self.spec, &value, None)
            .map_err(|errors| {
                // Paths as the API server gives them, from the object's root.
                let errors: Vec<_> = errors
                    .into_iter()
                    .map(|mut error| {
                        error.field_path = match error.field_path.as_str() {
                            "" => "spec".to_string(),
                            // (A rule's fieldPath starts with a dot.)
                            path => format!("spec.{}", path.trim_start_matches('.')),
                        };
                        error
                    })
                    .collect();
                ValidationErrors::from(errors).to_string()
            })?;
        openapi_bounds(spec)
    }
}

/// The CRD's openAPIV3Schema, as JSON.
fn object_schema() -> serde_json::Value {
    let crd = crdgen::kubernetes_formats(WebhookSubscription::crd());
    crd.spec
        .versions
        .first()
        .and_then(|v| v.schema.as_ref())
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .map(|s| serde_json::to_value(s).expect("a CRD schema serialises"))
        .expect("the derived CRD has an openAPIV3Schema")
}

/// The schema without the nodes that can change no rule's verdict: those whose subtree holds
/// no rule, no default, no format and no map. kube-cel converts each node it walks, with
/// its whole subtree, into CEL values, and many of a spec's nodes (event types, the signing
/// reference) hold no rule: pruned, a check costs a quarter to a third less. A pruned node
/// still reaches the rules above it, converted without its schema, which for such a node
/// gives the same values.
fn without_plain_nodes(mut schema: serde_json::Value) -> serde_json::Value {
    prune(&mut schema);
    schema
}

/// Prunes the plain nodes below `node`; true when `node` itself is plain.
fn prune(node: &mut serde_json::Value) -> bool {
    const MATTERS: [&str; 9] = [
        "x-kubernetes-validations",
        "default",
        "format",
        "additionalProperties",
        "x-kubernetes-embedded-resource",
        "x-kubernetes-preserve-unknown-fields",
        "allOf",
        "oneOf",
        "anyOf",
    ];
    let Some(object) = node.as_object_mut() else {
        return true;
    };
    let mut plain = !MATTERS.iter().any(|key| object.contains_key(*key));
    if let Some(properties) = object.get_mut("properties").and_then(|p| p.as_object_mut()) {
        properties.retain(|_, child| !prune(child));
        plain &= properties.is_empty();
    }
    if let Some(items) = object.get_mut("items") {
        if prune(items) {
            object.remove("items");
        } else {
            plain = false;
        }
    }
    plain
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
    errors.extend(
        spec.secret_ref_problem()
            .map(|why| format!("spec.signing: {why}")),
    );
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

    fn spec(patch: &serde_json::Value) -> WebhookSubscriptionSpec {
        let mut spec = serde_json::json!({
            "url": "https://example.com/hook",
            "eventTypes": ["a.*"],
            "signing": {"secretRef": {"name": "s", "key": "k"}}
        });
        for (k, v) in patch.as_object().unwrap() {
            spec[k] = v.clone();
        }
        serde_json::from_value(spec).unwrap()
    }

    fn with(patch: serde_json::Value) -> Result<(), String> {
        SubscriptionRules::new().check(&spec(&patch))
    }

    /// Changes to a valid spec that keep it valid.
    fn good() -> Vec<serde_json::Value> {
        vec![
            serde_json::json!({}),
            serde_json::json!({"url": "http://localhost:8080/x"}),
            serde_json::json!({"url": "http://[::1]:8080/x"}),
            serde_json::json!({"signing": {"scheme": "stripe", "header": "X-Sig", "secretRef": {"name": "s", "key": "k"}}, "headers": {"x-route": "1"}}),
            serde_json::json!({"headers": (0..32).map(|i| (format!("x-h{i}"), serde_json::json!("v".repeat(4096)))).collect::<serde_json::Map<_, _>>()}),
            serde_json::json!({"delivery": {"timeout": "5m", "retry": {"initialBackoff": "1s", "maxBackoff": "2h"}}}),
        ]
    }

    /// Changes to a valid spec that break a rule.
    fn bad() -> Vec<serde_json::Value> {
        vec![
            serde_json::json!({"url": "ftp://example.com/"}),
            serde_json::json!({"url": "/relative/path"}),
            serde_json::json!({"url": "https://user:pw@example.com/"}),
            serde_json::json!({"delivery": {"timeout": "10m"}}),
            serde_json::json!({"delivery": {"retry": {"initialBackoff": "2h", "maxBackoff": "1h"}}}),
            serde_json::json!({"headers": {"Webhook-Signature": "x"}}),
            // Issue 24 item 1: a Secret name that would change the path of herald's read.
            serde_json::json!({"signing": {"secretRef": {"name": "?watch=true&timeoutSeconds=600", "key": "k"}}}),
            serde_json::json!({"signing": {"secretRef": {"name": "s", "key": "k"}, "additionalSecretRefs": [{"name": "a/b", "key": "k"}]}}),
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
        ]
    }

    #[test]
    fn the_schema_cel_rules_run_client_side_too() {
        // (The URL rule avoids getScheme(): kube-cel reports "" for any http://localhost URL,
        // unlike the API server.)
        for good in good() {
            assert!(with(good.clone()).is_ok(), "{good} refused");
        }
        for bad in bad() {
            assert!(with(bad.clone()).is_err(), "{bad} passed");
        }
        let e = with(serde_json::json!({"url": "ftp://example.com/"})).unwrap_err();
        assert!(e.contains("spec.url: must be an absolute"), "{e}");
    }

    /// Checking the spec alone is checking the object: nothing else in it holds a rule.
    #[test]
    fn only_the_spec_holds_rules() {
        fn rules(node: &serde_json::Value) -> usize {
            match node {
                serde_json::Value::Object(map) => map
                    .iter()
                    .map(|(k, v)| usize::from(k == "x-kubernetes-validations") + rules(v))
                    .sum(),
                serde_json::Value::Array(list) => list.iter().map(rules).sum(),
                _ => 0,
            }
        }
        let mut object = object_schema();
        let in_spec = rules(&object["properties"]["spec"]);
        assert!(in_spec >= 10, "{in_spec} rules in the spec");
        object["properties"].as_object_mut().unwrap().remove("spec");
        assert_eq!(rules(&object), 0, "a rule outside the spec");
    }

    /// Pruning the nodes that hold no rule changes no verdict and no message.
    #[test]
    fn the_pruned_schema_gives_the_whole_schemas_verdicts() {
        let whole = object_schema()["properties"]["spec"].clone();
        let pruned = without_plain_nodes(whole.clone());
        assert_ne!(pruned, whole, "nothing pruned");
        assert!(
            pruned.pointer("/properties/eventTypes").is_none(),
            "{pruned}"
        );
        let whole = compile_schema(&whole);
        let pruned = compile_schema(&pruned);
        let validator = Validator::new();
        for patch in good().into_iter().chain(bad()) {
            let value = serde_json::to_value(spec(&patch)).unwrap();
            let verdict = |schema| {
                validator
                    .validate_compiled(schema, &value, None)
                    .map_err(|e| e.to_string())
            };
            assert_eq!(verdict(&pruned), verdict(&whole), "{patch}");
        }
    }
}
