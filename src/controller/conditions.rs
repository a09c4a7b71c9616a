//! Pure decisions of the controller: from what herald knows of a subscription (its spec, the
//! secret lookup, the store's counters) to the status it should show and the Kubernetes
//! Events a person should see. No I/O here; every reconcile path and the status flusher call
//! [`subscription_status`], so there is one way conditions are computed.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;

use crate::api::conditions::{self, Status, types};
use crate::api::{LastAttempt, SubscriptionCounters, WebhookSubscriptionStatus};
use crate::store::SubscriptionState;

/// The annotation a person sets (to any new value) to re-enable an auto-disabled
/// subscription with kubectl alone.
pub const REENABLE_ANNOTATION: &str = "herald.dev/reenable";

/// Why a subscription cannot deliver, as found while reconciling it. Messages never carry
/// a secret's value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Problem {
    /// A referenced Secret does not exist (its name).
    SecretNotFound(String),
    /// A referenced Secret lacks the key (secret name, key).
    SecretKeyMissing(String, String),
    /// The secret's value is not usable for the scheme.
    InvalidSecret(String),
    /// The spec passed the schema but herald cannot run it (for example a header value).
    InvalidSpec(String),
}

impl Problem {
    fn reason(&self) -> &'static str {
        match self {
            Problem::SecretNotFound(_) => "SecretNotFound",
            Problem::SecretKeyMissing(..) => "SecretKeyMissing",
            Problem::InvalidSecret(_) => "InvalidSecret",
            Problem::InvalidSpec(_) => "InvalidSpec",
        }
    }

    fn message(&self, namespace: &str) -> String {
        match self {
            Problem::SecretNotFound(name) => format!(
                "Secret {namespace}/{name} does not exist; create it (kubectl create secret generic {name} -n {namespace} --from-literal=KEY=whsec_...). Events are kept until then."
            ),
            Problem::SecretKeyMissing(name, key) => format!(
                "Secret {namespace}/{name} has no key {key:?}; add it or fix spec.signing. Events are kept until then."
            ),
            Problem::InvalidSecret(why) => format!(
                "the signing secret cannot be used: {why}. Fix the Secret's value; events are kept until then."
            ),
            Problem::InvalidSpec(why) => format!("the spec cannot be run: {why}. Fix the spec."),
        }
    }
}

/// Everything the status is computed from.
#[derive(Clone, Debug)]
pub struct Facts<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub generation: Option<i64>,
    pub url: &'a str,
    pub paused: bool,
    pub disable_after: u32,
    pub problem: Option<&'a Problem>,
    /// The store's view; None while it could not be read (counters are then kept).
    pub state: Option<&'a SubscriptionState>,
    pub last_attempt: Option<&'a LastAttempt>,
    pub reenable_handled: Option<&'a str>,
    /// Its shard, when replicas divide the subscriptions (`--shard-leases`).
    pub shard: Option<u32>,
    /// Slowed down by its receiver (429, 502, 504): attempts a second, until (Unix ms).
    pub slowed: Option<(f64, i64)>,
}

/// A Kubernetes Event to record for the object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Announcement {
    pub warning: bool,
    pub reason: &'static str,
    pub note: String,
}

/// The status the object should show, and the Events its change deserves. `previous` is the
/// status last written (its conditions keep their transition times unless they flip).
pub fn subscription_status(
    facts: &Facts<'_>,
    previous: Option<&WebhookSubscriptionStatus>,
    now: Timestamp,
) -> (WebhookSubscriptionStatus, Vec<Announcement>) {
    let mut conditions: Vec<Condition> = previous.map(|p| p.conditions.clone()).unwrap_or_default();
    let generation = facts.generation;
    let disabled = facts.state.is_some_and(|s| s.disabled);
    // Disabled by a 410 Gone rather than by its threshold.
    let gone = disabled && facts.state.is_some_and(|s| s.gone);
    let failures = facts
        .state
        .map(|s| s.consecutive_failures)
        .or(previous.and_then(|p| p.consecutive_failures))
        .unwrap_or(0);
    let last_error = facts
        .last_attempt
        .and_then(|a| a.message.clone())
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| "unknown".into());
    let reenable_hint = format!(
        "kubectl annotate webhooksubscription {} -n {} {REENABLE_ANNOTATION}=\"$(date +%s)\" --overwrite",
        facts.name, facts.namespace
    );

    let (ready, reason, message) = if let Some(problem) = facts.problem {
        (
            Status::False,
            problem.reason(),
            problem.message(facts.namespace),
        )
    } else if gone {
        (
            Status::False,
            "Gone",
            format!(
                "disabled: the receiver answered 410 Gone (the endpoint is gone for good); events are kept. Point spec.url at a live receiver or fix it, then re-enable: {reenable_hint}"
            ),
        )
    } else if disabled {
        (
            Status::False,
            "AutoDisabled",
            format!(
                "disabled after {failures} consecutive failed attempts (last error: {last_error}); events are kept. Fix the receiver, then re-enable: {reenable_hint}"
            ),
        )
    } else if facts.paused {
        (
            Status::False,
            "Paused",
            "spec.paused is true: no attempt starts and events are kept; set spec.paused to false to deliver them".to_string(),
        )
    } else {
        (
            Status::True,
            "Active",
            match facts.url {
                "" => "deliveries can start".to_string(),
                url => format!("deliveries to {url} can start"),
            },
        )
    };
    let was =
        |t: &str| conditions::find(&conditions, t).map(|c| (c.status.clone(), c.reason.clone()));
    let ready_before = was(types::READY);
    let disabled_before = was(types::DISABLED);
    conditions::set(
        &mut conditions,
        types::READY,
        ready,
        reason,
        message.clone(),
        generation,
        now,
    );
    if gone {
        conditions::set(
            &mut conditions,
            types::DISABLED,
            Status::True,
            "Gone",
            format!("the receiver answered 410 Gone; re-enable with: {reenable_hint}"),
            generation,
            now,
        );
    } else if disabled {
        conditions::set(
            &mut conditions,
            types::DISABLED,
            Status::True,
            "AutoDisabled",
            format!(
                "{failures} consecutive failed attempts reached spec.disableAfterConsecutiveFailures ({}); re-enable with: {reenable_hint}",
                facts.disable_after
            ),
            generation,
            now,
        );
    } else {
        conditions::set(
            &mut conditions,
            types::DISABLED,
            Status::False,
            "Enabled",
            "attempts start as events arrive",
            generation,
            now,
        );
    }
    if let Some((per_second, until_ms)) = facts.slowed {
        let until = Timestamp::from_millisecond(until_ms)
            .map(|t| t.to_string())
            .unwrap_or_default();
        conditions::set(
            &mut conditions,
            types::DEGRADED,
            Status::True,
            "Throttled",
            format!(
                "the receiver asked to slow down (429, 502 or 504): attempts start at most {per_second:.1} a second until {until}; events wait in the store"
            ),
            generation,
            now,
        );
    } else if failures > 0 {
        conditions::set(
            &mut conditions,
            types::DEGRADED,
            Status::True,
            "DeliveryFailing",
            format!("{failures} consecutive failed attempts; last error: {last_error}"),
            generation,
            now,
        );
    } else {
        conditions::set(
            &mut conditions,
            types::DEGRADED,
            Status::False,
            "Healthy",
            "no failed attempt since the last success",
            generation,
            now,
        );
    }

    let mut announce = Vec::new();
    let ready_now = ready == Status::True;
    match &ready_before {
        Some((status, _)) if status == "True" && ready_now => {}
        _ if ready_now => announce.push(Announcement {
            warning: false,
            reason: "Ready",
            note: message.clone(),
        }),
        Some((_, old_reason)) if old_reason == reason => {}
        // AutoDisabled and Gone are announced once, below, from the Disabled condition.
        _ if reason == "AutoDisabled" || reason == "Gone" => {}
        _ => announce.push(Announcement {
            warning: reason != "Paused",
            reason: match reason {
                "SecretNotFound" => "SecretNotFound",
                "SecretKeyMissing" => "SecretKeyMissing",
                "InvalidSecret" => "InvalidSecret",
                "InvalidSpec" => "InvalidSpec",
                _ => "Paused",
            },
            note: message.clone(),
        }),
    }
    if disabled && disabled_before.is_none_or(|(s, _)| s != "True") {
        announce.push(Announcement {
            warning: true,
            reason: if gone { "Gone" } else { "AutoDisabled" },
            note: message,
        });
    }

    let previous = previous.cloned().unwrap_or_default();
    let status = WebhookSubscriptionStatus {
        observed_generation: generation,
        conditions,
        shard: facts.shard,
        pending_attempts: facts.state.map(|s| s.pending).or(previous.pending_attempts),
        dead_attempts: facts.state.map(|s| s.dead).or(previous.dead_attempts),
        last_attempt: facts.last_attempt.cloned().or(previous.last_attempt),
        counters: facts
            .state
            .map(|s| SubscriptionCounters {
                delivered: s.delivered,
                failed: s.failed,
                dead_lettered: s.dead_lettered,
            })
            .or(previous.counters),
        consecutive_failures: Some(failures),
        reenable_handled: facts
            .reenable_handled
            .map(str::to_string)
            .or(previous.reenable_handled),
    };
    (status, announce)
}

/// Whether the annotation asks for a re-enable herald has not acted on yet.
pub fn reenable_requested<'a>(
    annotation: Option<&'a str>,
    handled: Option<&str>,
) -> Option<&'a str> {
    annotation.filter(|value| Some(*value) != handled)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(secs).unwrap()
    }

    struct Fixture {
        problem: Option<Problem>,
        state: Option<SubscriptionState>,
        paused: bool,
        last: Option<LastAttempt>,
        generation: i64,
        slowed: Option<(f64, i64)>,
    }

    impl Fixture {
        fn healthy() -> Self {
            Self {
                problem: None,
                state: Some(SubscriptionState {
                    live: true,
                    ..Default::default()
                }),
                paused: false,
                last: None,
                generation: 1,
                slowed: None,
            }
        }
        fn with_problem(mut self, p: Problem) -> Self {
            self.problem = Some(p);
            self
        }
        fn disabled(mut self, failures: u32) -> Self {
            let state = self.state.get_or_insert_with(Default::default);
            state.disabled = true;
            state.consecutive_failures = failures;
            self.last = Some(LastAttempt {
                time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at(5)),
                outcome: "Transient".into(),
                status_code: Some(500),
                latency_ms: Some(3),
                message: Some("HTTP 500".into()),
            });
            self
        }
        fn failing(mut self, failures: u32) -> Self {
            self.state
                .get_or_insert_with(Default::default)
                .consecutive_failures = failures;
            self
        }
        fn paused(mut self) -> Self {
            self.paused = true;
            self
        }
        fn status(
            &self,
            previous: Option<&WebhookSubscriptionStatus>,
            now: i64,
        ) -> (WebhookSubscriptionStatus, Vec<Announcement>) {
            subscription_status(
                &Facts {
                    namespace: "shop",
                    name: "orders",
                    generation: Some(self.generation),
                    url: "https://example.com/hook",
                    paused: self.paused,
                    disable_after: 3,
                    problem: self.problem.as_ref(),
                    state: self.state.as_ref(),
                    last_attempt: self.last.as_ref(),
                    reenable_handled: None,
                    shard: None,
                    slowed: self.slowed,
                },
                previous,
                at(now),
            )
        }
    }

    fn ready(status: &WebhookSubscriptionStatus) -> (&str, &str) {
        let c = conditions::find(&status.conditions, types::READY).unwrap();
        (c.status.as_str(), c.reason.as_str())
    }

    #[test]
    fn a_healthy_subscription_is_ready_and_announced_once() {
        let (first, events) = Fixture::healthy().status(None, 10);
        assert_eq!(ready(&first), ("True", "Active"));
        assert_eq!(first.observed_generation, Some(1));
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].reason, "Ready");
        assert!(!events[0].warning);
        let (again, events) = Fixture::healthy().status(Some(&first), 20);
        assert!(events.is_empty(), "{events:?}");
        assert_eq!(again, first, "nothing changed, so nothing to write");
    }

    #[test]
    fn secret_problems_say_what_is_wrong_and_warn_once() {
        for (problem, reason) in [
            (Problem::SecretNotFound("s".into()), "SecretNotFound"),
            (
                Problem::SecretKeyMissing("s".into(), "k".into()),
                "SecretKeyMissing",
            ),
            (Problem::InvalidSecret("not base64".into()), "InvalidSecret"),
            (Problem::InvalidSpec("bad header".into()), "InvalidSpec"),
        ] {
            let fixture = Fixture::healthy().with_problem(problem);
            let (status, events) = fixture.status(None, 10);
            assert_eq!(ready(&status), ("False", reason));
            assert_eq!(events.len(), 1);
            assert_eq!(events[0].reason, reason);
            assert!(events[0].warning);
            let (_, again) = fixture.status(Some(&status), 11);
            assert!(again.is_empty(), "{reason} announced twice");
        }
        let (status, _) = Fixture::healthy()
            .with_problem(Problem::SecretNotFound("hook-secret".into()))
            .status(None, 10);
        let message = &conditions::find(&status.conditions, types::READY)
            .unwrap()
            .message;
        assert!(message.contains("shop/hook-secret"), "{message}");
    }

    #[test]
    fn a_fixed_secret_makes_it_ready_with_a_new_transition_time() {
        let (broken, _) = Fixture::healthy()
            .with_problem(Problem::SecretNotFound("s".into()))
            .status(None, 10);
        let (fixed, events) = Fixture::healthy().status(Some(&broken), 50);
        assert_eq!(ready(&fixed), ("True", "Active"));
        assert_eq!(events[0].reason, "Ready");
        let c = conditions::find(&fixed.conditions, types::READY).unwrap();
        assert_eq!(c.last_transition_time.0, at(50));
        // Disabled stayed False: its transition time did not move.
        let d = conditions::find(&fixed.conditions, types::DISABLED).unwrap();
        assert_eq!(d.last_transition_time.0, at(10));
    }

    #[test]
    fn auto_disable_names_the_failures_the_last_error_and_the_way_back() {
        let (before, _) = Fixture::healthy().status(None, 1);
        let (status, events) = Fixture::healthy().disabled(3).status(Some(&before), 9);
        assert_eq!(ready(&status), ("False", "AutoDisabled"));
        let message = &conditions::find(&status.conditions, types::READY)
            .unwrap()
            .message;
        assert!(message.contains("3 consecutive"), "{message}");
        assert!(message.contains("HTTP 500"), "{message}");
        assert!(message.contains(REENABLE_ANNOTATION), "{message}");
        let disabled = conditions::find(&status.conditions, types::DISABLED).unwrap();
        assert_eq!(disabled.status, "True");
        assert_eq!(
            events.iter().map(|e| e.reason).collect::<Vec<_>>(),
            ["AutoDisabled"]
        );
        assert_eq!(status.consecutive_failures, Some(3));
        let (_, again) = Fixture::healthy().disabled(3).status(Some(&status), 12);
        assert!(again.is_empty());
    }

    /// A 410 Gone disables it with a reason of its own, announced once; re-enabled, it is
    /// Active again.
    #[test]
    fn gone_says_so_once_and_how_to_come_back() {
        let (before, _) = Fixture::healthy().status(None, 1);
        let mut gone = Fixture::healthy().disabled(1);
        gone.state.as_mut().unwrap().gone = true;
        let (status, events) = gone.status(Some(&before), 9);
        assert_eq!(ready(&status), ("False", "Gone"));
        let message = &conditions::find(&status.conditions, types::READY)
            .unwrap()
            .message;
        assert!(message.contains("410 Gone"), "{message}");
        assert!(message.contains(REENABLE_ANNOTATION), "{message}");
        let disabled = conditions::find(&status.conditions, types::DISABLED).unwrap();
        assert_eq!(
            (disabled.status.as_str(), disabled.reason.as_str()),
            ("True", "Gone")
        );
        let announced: Vec<_> = events.iter().map(|e| (e.reason, e.warning)).collect();
        assert_eq!(announced, [("Gone", true)]);
        let (status, again) = gone.status(Some(&status), 12);
        assert!(again.is_empty(), "{again:?}");
        let (back, events) = Fixture::healthy().status(Some(&status), 20);
        assert_eq!(ready(&back), ("True", "Active"));
        assert_eq!(events[0].reason, "Ready");
    }

    /// A receiver that asked to slow down shows as Degraded, reason Throttled, with the
    /// pace and until when; Ready stays True.
    #[test]
    fn a_slowed_subscription_says_so_and_stays_ready() {
        let mut slowed = Fixture::healthy().failing(1);
        slowed.slowed = Some((2.5, 60_000));
        let (status, _) = slowed.status(None, 30);
        assert_eq!(ready(&status), ("True", "Active"));
        let degraded = conditions::find(&status.conditions, types::DEGRADED).unwrap();
        assert_eq!(
            (degraded.status.as_str(), degraded.reason.as_str()),
            ("True", "Throttled")
        );
        assert!(
            degraded.message.contains("2.5 a second"),
            "{}",
            degraded.message
        );
        assert!(
            degraded.message.contains("1970-01-01T00:01:00"),
            "{}",
            degraded.message
        );
    }

    #[test]
    fn failures_below_the_threshold_degrade_but_keep_it_ready() {
        let (status, _) = Fixture::healthy().failing(2).status(None, 1);
        assert_eq!(ready(&status), ("True", "Active"));
        let degraded = conditions::find(&status.conditions, types::DEGRADED).unwrap();
        assert_eq!(
            (degraded.status.as_str(), degraded.reason.as_str()),
            ("True", "DeliveryFailing")
        );
        let (healthy, _) = Fixture::healthy().status(Some(&status), 2);
        let degraded = conditions::find(&healthy.conditions, types::DEGRADED).unwrap();
        assert_eq!(degraded.status, "False");
    }

    #[test]
    fn paused_is_not_ready_and_not_a_warning() {
        let (status, events) = Fixture::healthy().paused().status(None, 1);
        assert_eq!(ready(&status), ("False", "Paused"));
        assert_eq!(events.len(), 1);
        assert!(!events[0].warning);
    }

    #[test]
    fn counters_come_from_the_store_and_survive_a_store_outage() {
        let mut fixture = Fixture::healthy();
        let state = fixture.state.as_mut().unwrap();
        state.pending = 7;
        state.dead = 2;
        state.delivered = 40;
        let (status, _) = fixture.status(None, 1);
        assert_eq!(status.pending_attempts, Some(7));
        assert_eq!(status.dead_attempts, Some(2));
        assert_eq!(status.counters.as_ref().unwrap().delivered, 40);
        fixture.state = None;
        let (kept, _) = fixture.status(Some(&status), 2);
        assert_eq!(kept.pending_attempts, Some(7));
        assert_eq!(kept.counters, status.counters);
    }

    #[test]
    fn reenable_is_requested_by_a_new_annotation_value_only() {
        assert_eq!(reenable_requested(Some("1"), None), Some("1"));
        assert_eq!(reenable_requested(Some("1"), Some("1")), None);
        assert_eq!(reenable_requested(Some("2"), Some("1")), Some("2"));
        assert_eq!(reenable_requested(None, Some("1")), None);
    }
}
