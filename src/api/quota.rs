//! `WebhookQuota`: a namespace's share of herald's delivery capacity. Like ResourceQuota it
//! is meant to be written by cluster admins only (the chart's RBAC gives tenants read access).
//!
//! One quota per namespace is in force: the oldest. Age is `metadata.creationTimestamp`
//! (ties broken by name). In standalone mode, where manifests rarely carry one, a quota with
//! a creationTimestamp counts as older than any without; those without are ordered by the
//! file they are in (the folder's files in name order), then by name. Later quotas are
//! ignored; in a cluster they get Ready=False with reason Superseded, in standalone mode
//! (which writes no status) each read of the folder logs them as superseded.
// kube's printcolumn(...) entries repeat `type_ = ...` by design; clippy mistakes that for
// a duplicated attribute.
#![allow(clippy::duplicated_attributes)]

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The RFC 0215 §A.2 floor: at least this many unanswered attempts may be outstanding in one
/// namespace, so that eight dead receivers never stop a ninth subscription's delivery.
pub const MIN_NAMESPACE_IN_FLIGHT: u32 = 16;

/// Limits for the namespace it lives in. Only one quota per namespace is honoured: the
/// oldest; later ones get the condition Ready=False with reason Superseded.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "herald.dev",
    version = "v1alpha1",
    kind = "WebhookQuota",
    plural = "webhookquotas",
    singular = "webhookquota",
    shortname = "whquota",
    category = "herald",
    namespaced,
    status = "WebhookQuotaStatus",
    derive = "PartialEq",
    doc = "Delivery capacity of one namespace: how many attempts may be on the wire at once and how many may wait.",
    printcolumn(name = "In-Flight", type_ = "integer", json_path = ".spec.maxInFlight"),
    printcolumn(
        name = "Max Pending",
        type_ = "integer",
        json_path = ".spec.maxPendingAttempts"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct WebhookQuotaSpec {
    /// Attempts of this namespace that may be on the wire at once, across all its
    /// subscriptions (default 64, never below 16 so that dead receivers cannot block the
    /// namespace's healthy subscriptions). Waiting attempts beyond it are scheduled fairly
    /// against other namespaces.
    #[serde(default = "default_max_in_flight")]
    #[schemars(range(min = MIN_NAMESPACE_IN_FLIGHT, max = 100000))]
    pub max_in_flight: u32,

    /// Attempts of this namespace that may wait in the store at once. Publishing an event
    /// that would exceed it is refused with 429 and nothing is written (default 1000000).
    #[serde(default = "default_max_pending")]
    #[schemars(range(min = 1, max = 1000000000))]
    pub max_pending_attempts: u64,

    /// Bytes this namespace's stored events may count: each event its body (kept, for
    /// replays and the history, until it is pruned after the history retention) plus 512
    /// for its row and indexes, and 256 for each of its deliveries with their history; an
    /// event that matched nothing counts 512. Publishing an event that would exceed it is
    /// refused with 429 `quota_exceeded` and nothing is written. Absent: herald's default
    /// (the chart's `defaultQuota.maxStoredBytes`, 256 MiB unless set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 65536))]
    pub max_stored_bytes: Option<u64>,
}

fn default_max_in_flight() -> u32 {
    64
}
fn default_max_pending() -> u64 {
    1_000_000
}

impl Default for WebhookQuotaSpec {
    fn default() -> Self {
        Self {
            max_in_flight: default_max_in_flight(),
            max_pending_attempts: default_max_pending(),
            max_stored_bytes: None,
        }
    }
}

/// What herald observed about the quota.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WebhookQuotaStatus {
    /// The spec generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Ready=True when this quota is the one in force for its namespace.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "super::conditions_schema")]
    pub conditions: Vec<Condition>,
    /// Attempts of the namespace on the wire when status was last written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_flight: Option<u32>,
    /// Attempts of the namespace waiting in the store when status was last written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_attempts: Option<u64>,
}

/// Which of a namespace's quotas is in force, the rule both configuration sources follow:
/// the oldest. Each quota is given as its creation time and what orders quotas created at
/// the same time or without one (in a cluster its name; in a folder its file's place, then
/// its name). A quota with a creation time is older than any without (not yet persisted,
/// or a manifest that carries none). Returns the index of the one in force.
pub fn in_force<T: Ord, K: Ord>(quotas: &[(Option<T>, K)]) -> Option<usize> {
    (0..quotas.len()).min_by(|&a, &b| {
        let (ta, ka) = &quotas[a];
        let (tb, kb) = &quotas[b];
        (ta.is_none(), ta, ka).cmp(&(tb.is_none(), tb, kb))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_quota_wins_then_the_name() {
        let quotas = [
            (Some(20), "b"),
            (Some(10), "z"),
            (None, "a"),
            (Some(10), "c"),
        ];
        assert_eq!(in_force(&quotas), Some(3));
        assert_eq!(in_force::<i64, &str>(&[]), None);
        assert_eq!(in_force::<i64, _>(&[(None, "x"), (None, "a")]), Some(1));
        // In a folder: the file's place before the name.
        assert_eq!(
            in_force::<i64, _>(&[(None, (1, "a")), (None, (0, "z"))]),
            Some(1)
        );
    }
}
