//! Writing Kubernetes Events (events.k8s.io/v1) on subscriptions.
//!
//! Not kube-runtime's `Recorder`: it keeps every Event it wrote for six minutes (to count
//! repeats as a series) and scans that cache on every write. herald announces a
//! subscription's transitions only (Ready, a problem, AutoDisabled, Purged, Reenabled), so
//! repeats are rare, while the cache held one whole Event per subscription after a mass
//! create (about 2 KiB each) and its scan made reconciling N new subscriptions O(N²).
//! Each Event here is created once and not kept.

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};

/// Who reports the Events: the controller's name and, when known, its pod.
pub struct EventWriter {
    client: kube::Client,
    controller: String,
    instance: String,
}

/// One Event to write about an object.
pub struct Note<'a> {
    pub warning: bool,
    pub reason: &'a str,
    pub action: &'a str,
    pub note: &'a str,
}

/// The Event for `note` about `regarding`, as of `now`. Its name is the object's name and
/// the time in nanoseconds (as `kubectl` and kube-runtime name theirs), so two Events about
/// one object never collide.
pub fn event(
    controller: &str,
    instance: &str,
    regarding: ObjectReference,
    note: &Note,
    now: Timestamp,
) -> Event {
    let object = regarding.name.as_deref().unwrap_or(controller);
    Event {
        metadata: ObjectMeta {
            name: Some(format!("{object}.{:x}", now.as_nanosecond())),
            namespace: regarding.namespace.clone(),
            ..Default::default()
        },
        event_time: Some(MicroTime(now)),
        action: Some(note.action.into()),
        reason: Some(note.reason.into()),
        // The API server refuses a note over 1 KiB.
        note: Some(note.note.chars().take(1000).collect()),
        type_: Some(if note.warning { "Warning" } else { "Normal" }.into()),
        reporting_controller: Some(controller.into()),
        reporting_instance: Some(instance.into()),
        regarding: Some(regarding),
        ..Default::default()
    }
}

impl EventWriter {
    /// `instance` defaults to the controller's name (the API server requires one).
    pub fn new(client: kube::Client, controller: &str, instance: Option<String>) -> Self {
        Self {
            client,
            controller: controller.into(),
            instance: instance.unwrap_or_else(|| controller.into()),
        }
    }

    /// Creates the Event in the object's namespace.
    pub async fn write(&self, regarding: ObjectReference, note: &Note<'_>) -> kube::Result<()> {
        let namespace = regarding
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let event = event(
            &self.controller,
            &self.instance,
            regarding,
            note,
            Timestamp::now(),
        );
        Api::<Event>::namespaced(self.client.clone(), &namespace)
            .create(&PostParams::default(), &event)
            .await
            .map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_names_its_object_reporter_and_kind() {
        let regarding = ObjectReference {
            namespace: Some("shop".into()),
            name: Some("orders".into()),
            uid: Some("u-1".into()),
            ..Default::default()
        };
        let note = Note {
            warning: true,
            reason: "SecretNotFound",
            action: "Reconcile",
            note: &"x".repeat(1500),
        };
        let now = Timestamp::from_second(1_700_000_000).unwrap();
        let e = event("herald", "herald-0", regarding, &note, now);
        assert_eq!(e.metadata.namespace.as_deref(), Some("shop"));
        assert_eq!(
            e.metadata.name.as_deref(),
            Some(format!("orders.{:x}", now.as_nanosecond()).as_str())
        );
        assert_eq!(e.type_.as_deref(), Some("Warning"));
        assert_eq!(e.reason.as_deref(), Some("SecretNotFound"));
        assert_eq!(e.reporting_controller.as_deref(), Some("herald"));
        assert_eq!(e.reporting_instance.as_deref(), Some("herald-0"));
        assert_eq!(e.note.map(|n| n.len()), Some(1000));
        assert_eq!(
            e.regarding.and_then(|r| r.uid).as_deref(),
            Some("u-1"),
            "the Event points at this object, not a namesake"
        );
        assert!(e.series.is_none(), "each Event stands alone");
    }
}
