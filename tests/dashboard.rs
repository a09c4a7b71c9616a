//! The Grafana dashboard shipped with the chart queries only metrics herald exports.

use std::collections::BTreeSet;

use serde_json::Value;

fn exprs(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                match (key.as_str(), v) {
                    ("expr" | "query", Value::String(text)) => out.push(text.clone()),
                    _ => exprs(v, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| exprs(v, out)),
        _ => {}
    }
}

#[test]
fn every_dashboard_query_names_an_exported_metric() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/charts/herald/dashboards/herald.json"
    );
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut queries = Vec::new();
    exprs(&dashboard, &mut queries);
    assert!(
        queries.len() >= 8,
        "the dashboard has only {} queries",
        queries.len()
    );
    let exported: BTreeSet<String> = herald::metrics::names().into_iter().collect();
    let mut used = BTreeSet::new();
    for query in &queries {
        let mut rest = query.as_str();
        while let Some(start) = rest.find("herald_") {
            let name: String = rest[start..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            rest = &rest[start + name.len()..];
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .filter(|base| exported.contains(*base))
                .unwrap_or(&name)
                .to_string();
            assert!(
                exported.contains(&base),
                "the dashboard queries {name}, which herald does not export ({query})"
            );
            used.insert(base);
        }
    }
    // The panels the issue asks for: outcomes, latency, backlog, in flight against quota,
    // dead letters and disabled subscriptions.
    for needed in [
        "herald_attempts_total",
        "herald_attempt_duration_seconds",
        "herald_pending_attempts",
        "herald_in_flight_attempts",
        "herald_quota_waits_total",
        "herald_dead_letters_total",
        "herald_auto_disabled_total",
    ] {
        assert!(used.contains(needed), "no panel shows {needed}");
    }
}
