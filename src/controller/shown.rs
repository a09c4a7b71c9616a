//! What herald keeps of the status each subscription shows, in place of the status itself.
//!
//! The next status is computed from the one shown (conditions keep their transition times
//! across restarts and shard moves; a write is skipped when nothing would change), so the
//! shown status must be at hand, but a whole `WebhookSubscriptionStatus` costs about 800
//! bytes, most of it condition messages herald rewrites anyway. [`Shown`] keeps a digest
//! of the whole (to compare) and of each condition only what a computation reads: the
//! status, the reason and the transition time of herald's own types, packed into a few
//! bytes; a condition that does not pack (another writer's type, an unknown reason) is kept
//! whole. The watch stream records it and drops the status from the cached object.

use std::hash::{Hash, Hasher};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

use crate::api::conditions::types;
use crate::api::{LastAttempt, SubscriptionCounters, WebhookSubscriptionStatus};

const TYPES: [&str; 3] = [types::READY, types::DISABLED, types::DEGRADED];
const STATUSES: [&str; 3] = ["True", "False", "Unknown"];
/// Reasons herald writes; another one is kept whole (correct, only bigger).
const REASONS: [&str; 12] = [
    "Active",
    "Paused",
    "AutoDisabled",
    "Gone",
    "SecretNotFound",
    "SecretKeyMissing",
    "InvalidSecret",
    "InvalidSpec",
    "Enabled",
    "DeliveryFailing",
    "Healthy",
    "Throttled",
];

#[derive(Clone, Debug, PartialEq)]
enum Kept {
    /// One of herald's condition types: indexes into the tables above, and the transition
    /// time in whole seconds (what the API server stores). Its message and generation are
    /// not kept: every status computation rewrites both.
    Packed {
        type_: u8,
        status: u8,
        reason: u8,
        since: i64,
    },
    Whole(Box<Condition>),
}

fn index(table: &[&str], value: &str) -> Option<u8> {
    table.iter().position(|t| *t == value).map(|i| i as u8)
}

impl Kept {
    fn of(c: &Condition) -> Self {
        let since = c.last_transition_time.0;
        match (
            index(&TYPES, &c.type_),
            index(&STATUSES, &c.status),
            index(&REASONS, &c.reason),
        ) {
            (Some(type_), Some(status), Some(reason)) if since.subsec_nanosecond() == 0 => {
                Kept::Packed {
                    type_,
                    status,
                    reason,
                    since: since.as_second(),
                }
            }
            _ => Kept::Whole(Box::new(c.clone())),
        }
    }

    fn condition(&self) -> Condition {
        match self {
            Kept::Packed {
                type_,
                status,
                reason,
                since,
            } => Condition {
                type_: TYPES[*type_ as usize].into(),
                status: STATUSES[*status as usize].into(),
                reason: REASONS[*reason as usize].into(),
                message: String::new(),
                observed_generation: None,
                last_transition_time: Time(Timestamp::from_second(*since).unwrap_or_default()),
            },
            Kept::Whole(c) => Condition::clone(c),
        }
    }
}

/// The status a subscription shows, as much of it as computing the next one needs.
#[derive(Clone, Debug, PartialEq)]
pub struct Shown {
    /// [`digest`] of the status as shown.
    pub digest: u64,
    conditions: Box<[Kept]>,
    pending_attempts: Option<u64>,
    dead_attempts: Option<u64>,
    counters: Option<SubscriptionCounters>,
    consecutive_failures: Option<u32>,
    pub reenable_handled: Option<Box<str>>,
    pub last_attempt: Option<Box<LastAttempt>>,
}

impl Shown {
    pub fn of(status: &WebhookSubscriptionStatus) -> Self {
        Shown {
            digest: digest(status),
            conditions: status.conditions.iter().map(Kept::of).collect(),
            pending_attempts: status.pending_attempts,
            dead_attempts: status.dead_attempts,
            counters: status.counters.clone(),
            consecutive_failures: status.consecutive_failures,
            reenable_handled: status.reenable_handled.as_deref().map(Box::from),
            last_attempt: status.last_attempt.clone().map(Box::new),
        }
    }

    /// A status to compute the next one from: the shown one, except for what every
    /// computation rewrites (herald's condition messages and generations, the observed
    /// generation, the shard).
    pub fn as_previous(&self) -> WebhookSubscriptionStatus {
        WebhookSubscriptionStatus {
            observed_generation: None,
            conditions: self.conditions.iter().map(Kept::condition).collect(),
            shard: None,
            pending_attempts: self.pending_attempts,
            last_attempt: self.last_attempt.as_deref().cloned(),
            counters: self.counters.clone(),
            consecutive_failures: self.consecutive_failures,
            dead_attempts: self.dead_attempts,
            reenable_handled: self.reenable_handled.as_deref().map(String::from),
        }
    }
}

/// Equal for equal statuses (their JSON is), whoever computed or read them.
pub fn digest(status: &WebhookSubscriptionStatus) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    serde_json::to_vec(status)
        .unwrap_or_default()
        .hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::conditions::{Announcement, Facts, Problem, subscription_status};
    use crate::store::SubscriptionState;

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + second).unwrap()
    }

    /// The status herald computes for these facts from `previous`, and its Events.
    fn next_with_events(
        previous: Option<&WebhookSubscriptionStatus>,
        state: Option<&SubscriptionState>,
        problem: Option<&Problem>,
        now: i64,
    ) -> (WebhookSubscriptionStatus, Vec<Announcement>) {
        let facts = Facts {
            namespace: "shop",
            name: "orders",
            generation: Some(2),
            url: "https://example.com/hook",
            paused: false,
            disable_after: 3,
            problem,
            state,
            last_attempt: None,
            reenable_handled: None,
            shard: None,
            slowed: None,
        };
        subscription_status(&facts, previous, at(now))
    }

    fn next(
        previous: Option<&WebhookSubscriptionStatus>,
        state: Option<&SubscriptionState>,
        problem: Option<&Problem>,
        now: i64,
    ) -> WebhookSubscriptionStatus {
        next_with_events(previous, state, problem, now).0
    }

    /// Through JSON, as the watch delivers it.
    fn as_read(status: &WebhookSubscriptionStatus) -> WebhookSubscriptionStatus {
        serde_json::from_slice(&serde_json::to_vec(status).unwrap()).unwrap()
    }

    #[test]
    fn the_next_status_is_the_same_from_what_is_kept_as_from_the_whole() {
        let healthy = SubscriptionState {
            live: true,
            delivered: 7,
            ..Default::default()
        };
        let disabled = SubscriptionState {
            live: true,
            disabled: true,
            consecutive_failures: 3,
            failed: 3,
            ..Default::default()
        };
        let missing = Problem::SecretNotFound("s".into());
        let mut foreign = as_read(&next(None, Some(&healthy), None, 0));
        foreign.conditions.insert(
            1,
            Condition {
                type_: "Audited".into(),
                status: "True".into(),
                reason: "PolicyChecked".into(),
                message: "checked by another controller".into(),
                observed_generation: Some(1),
                last_transition_time: Time(at(-50)),
            },
        );
        let shown: Vec<WebhookSubscriptionStatus> = vec![
            as_read(&next(None, Some(&healthy), None, 0)),
            as_read(&next(None, Some(&disabled), None, 10)),
            as_read(&next(None, None, Some(&missing), 20)),
            foreign,
        ];
        let facts: [(Option<&SubscriptionState>, Option<&Problem>); 4] = [
            (Some(&healthy), None),
            (Some(&disabled), None),
            (None, Some(&missing)),
            (None, None),
        ];
        for previous in &shown {
            let kept = Shown::of(previous);
            assert_eq!(kept.digest, digest(previous));
            for (state, problem) in facts {
                let (from_whole, events) = next_with_events(Some(previous), state, problem, 100);
                let from_kept = next_with_events(Some(&kept.as_previous()), state, problem, 100);
                assert_eq!(
                    from_kept,
                    (from_whole.clone(), events),
                    "shown: {previous:?}"
                );
                // The skipped write: what is shown compares equal to what would be written.
                assert_eq!(
                    digest(&from_whole) == kept.digest,
                    &from_whole == previous,
                    "shown: {previous:?}"
                );
            }
        }
    }

    #[test]
    fn herald_conditions_are_packed_and_others_kept_whole() {
        let mut status = as_read(&next(None, None, None, 0));
        let kept = Shown::of(&status);
        assert!(
            kept.conditions
                .iter()
                .all(|c| matches!(c, Kept::Packed { .. }))
        );
        status.conditions[0].reason = "SomethingNew".into();
        status.conditions[1].type_ = "Audited".into();
        let kept = Shown::of(&status);
        assert!(matches!(kept.conditions[0], Kept::Whole(_)));
        assert!(matches!(kept.conditions[1], Kept::Whole(_)));
        assert!(matches!(kept.conditions[2], Kept::Packed { .. }));
        assert_eq!(kept.as_previous().conditions[1], status.conditions[1]);
        assert_eq!(kept.as_previous().conditions[0], status.conditions[0]);
    }
}
