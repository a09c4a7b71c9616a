//! The one place that turns facts into status conditions (metav1.Condition), following the
//! Kubernetes API conventions: `lastTransitionTime` moves only when `status` flips.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

/// Condition types herald writes.
pub mod types {
    /// Summary: deliveries for this object can start.
    pub const READY: &str = "Ready";
    /// Auto-disabled after consecutive failures, until re-enabled.
    pub const DISABLED: &str = "Disabled";
    /// Working, but recent attempts failed.
    pub const DEGRADED: &str = "Degraded";
}

/// A condition's status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    True,
    False,
    Unknown,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Status::True => "True",
            Status::False => "False",
            Status::Unknown => "Unknown",
        }
    }
}

/// Sets condition `type_` in `conditions` to the given facts. The transition time is kept
/// when the status does not change, so that a re-reconcile does not look like a flip.
pub fn set(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: Status,
    reason: &str,
    message: impl Into<String>,
    observed_generation: Option<i64>,
    now: Timestamp,
) {
    let message = message.into();
    let status = status.as_str();
    // metav1.Time has one-second resolution on the wire; keep exactly what the API server
    // will store, so a read-back compares equal.
    let now = Timestamp::from_second(now.as_second()).unwrap_or(now);
    match conditions.iter_mut().find(|c| c.type_ == type_) {
        Some(existing) => {
            if existing.status != status {
                existing.last_transition_time = Time(now);
            }
            existing.status = status.to_string();
            existing.reason = reason.to_string();
            existing.message = message;
            existing.observed_generation = observed_generation;
        }
        None => conditions.push(Condition {
            type_: type_.to_string(),
            status: status.to_string(),
            reason: reason.to_string(),
            message,
            observed_generation,
            last_transition_time: Time(now),
        }),
    }
}

/// The condition of a type, if present.
pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(secs).unwrap()
    }

    #[test]
    fn transition_time_moves_only_when_status_flips() {
        let mut conditions = Vec::new();
        set(
            &mut conditions,
            types::READY,
            Status::True,
            "Delivering",
            "ok",
            Some(1),
            at(100),
        );
        set(
            &mut conditions,
            types::READY,
            Status::True,
            "Delivering",
            "still ok",
            Some(2),
            at(200),
        );
        let ready = find(&conditions, types::READY).unwrap();
        assert_eq!(ready.last_transition_time, Time(at(100)));
        assert_eq!(ready.message, "still ok");
        assert_eq!(ready.observed_generation, Some(2));

        set(
            &mut conditions,
            types::READY,
            Status::False,
            "SecretMissing",
            "no secret",
            Some(2),
            at(300),
        );
        let ready = find(&conditions, types::READY).unwrap();
        assert_eq!(ready.last_transition_time, Time(at(300)));
        assert_eq!(ready.reason, "SecretMissing");
        assert_eq!(conditions.len(), 1);
    }

    #[test]
    fn transition_times_have_whole_seconds_like_the_api_server() {
        let mut conditions = Vec::new();
        let now = Timestamp::from_millisecond(1_700_000_000_789).unwrap();
        set(
            &mut conditions,
            types::READY,
            Status::True,
            "Delivering",
            "",
            None,
            now,
        );
        assert_eq!(conditions[0].last_transition_time, Time(at(1_700_000_000)));
    }

    #[test]
    fn conditions_of_different_types_coexist() {
        let mut conditions = Vec::new();
        set(
            &mut conditions,
            types::READY,
            Status::True,
            "Delivering",
            "",
            None,
            at(1),
        );
        set(
            &mut conditions,
            types::DISABLED,
            Status::False,
            "Enabled",
            "",
            None,
            at(1),
        );
        assert_eq!(conditions.len(), 2);
        assert!(find(&conditions, types::DEGRADED).is_none());
    }
}
