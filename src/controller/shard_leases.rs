//! Shard Leases: how replicas sharing one store divide the shards between them.
//!
//! Every replica renews a member Lease (`herald-member-<identity>`) so the others can count
//! it, and holds a balanced share (the number of shards over the live members, rounded up)
//! of the shard Leases `herald-shard-<n>`, all in herald's own namespace. Every write is a
//! replace with the Lease's resourceVersion, so two replicas can never both take one Lease.
//!
//! - Taking a shard (free, released, or expired: renewTime + leaseDurationSeconds has passed)
//!   increments `leaseTransitions`; that number is the shard's epoch. The taker records it
//!   in the store (`Store::take_shard`) before it starts any attempt, and every claim
//!   carries it, so the store refuses a claim from a replica that lost the shard.
//! - A held shard is renewed every `renew_every`; the replica starts attempts for it only
//!   until `duration - margin` after the start of its last successful write. A replica that
//!   cannot renew (API server unreachable, process paused) therefore stops before anyone can
//!   take the shard, with `margin` to spare for clock skew between nodes. A round late
//!   enough to pass that deadline still renews the shard if its Lease is this replica's at
//!   the same epoch, and wakes the shard's lanes (those that tried meanwhile rested).
//! - Above its share (a replica joined), a replica stops starting attempts for its extra
//!   shards first and then releases their Leases.
//! - A graceful stop first stops taking shards ([`ShardLeases::stop_taking`]: rounds go on
//!   renewing the membership and the held shards, and neither take nor rebalance), then the
//!   engine drains, and only then are all Leases released ([`ShardLeases::release_all`]).
//!   Released before the drain, another replica would take the shards, make the attempts
//!   still on the wire due again and send them a second time.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, PostParams};

use crate::delivery::Engine;
use crate::delivery::shards::Ownership;

/// Label on every Lease herald manages here: `member` or `shard`.
const ROLE_LABEL: &str = "herald.dev/lease";

/// How long the releases at the end of a graceful stop may take in all (the chart's
/// terminationGracePeriodSeconds leaves room for it after the drain); what is not released
/// by then expires instead.
pub const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);
/// Reads and writes of one Lease at a graceful stop, while its writes conflict.
const RELEASE_ATTEMPTS: usize = 3;

#[derive(Clone, Debug)]
pub struct LeaseConfig {
    /// herald's own namespace, where the Leases live.
    pub namespace: String,
    /// This replica's identity (unique among replicas; the pod name in a cluster).
    pub identity: String,
    pub duration: Duration,
    pub renew_every: Duration,
    /// How long before its Lease could be taken a replica stops starting attempts.
    pub margin: Duration,
}

pub fn shard_lease_name(shard: u32) -> String {
    format!("herald-shard-{shard}")
}

fn member_lease_name(identity: &str) -> String {
    let safe: String = identity
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    format!("herald-member-{}", safe.trim_matches(['-', '.']))
}

/// Whether nobody holds the Lease now (never held, released, or not renewed in time).
fn is_free(lease: &Lease, now: Timestamp) -> bool {
    let Some(spec) = &lease.spec else { return true };
    let holder = spec.holder_identity.as_deref().unwrap_or("");
    if holder.is_empty() {
        return true;
    }
    let (Some(renewed), Some(seconds)) = (&spec.renew_time, spec.lease_duration_seconds) else {
        return true;
    };
    let expires = renewed.0.as_millisecond() + i64::from(seconds) * 1000;
    expires <= now.as_millisecond()
}

fn holder(lease: &Lease) -> &str {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.as_deref())
        .unwrap_or("")
}

fn epoch(lease: &Lease) -> i64 {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.lease_transitions)
        .map_or(0, i64::from)
}

/// The share of `shards` each of `members` live replicas should hold: rounded up, so that
/// every shard has room with an owner.
pub fn fair_share(shards: u32, members: usize) -> usize {
    (shards as usize).div_ceil(members.max(1))
}

pub struct ShardLeases {
    api: Api<Lease>,
    config: LeaseConfig,
    ownership: Arc<Ownership>,
    engine: Arc<Engine>,
    /// Set by [`ShardLeases::stop_taking`].
    stopping: AtomicBool,
}

impl ShardLeases {
    pub fn new(
        client: kube::Client,
        config: LeaseConfig,
        ownership: Arc<Ownership>,
        engine: Arc<Engine>,
    ) -> Self {
        Self {
            api: Api::namespaced(client, &config.namespace),
            config,
            ownership,
            engine,
            stopping: AtomicBool::new(false),
        }
    }

    /// The first step of a graceful stop: from now on rounds renew the membership and the
    /// held shards (so nobody takes them while their attempts drain) but take no shard and
    /// release none for rebalancing; [`ShardLeases::release_all`] ends the hold.
    pub fn stop_taking(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    fn lease_duration_seconds(&self) -> i32 {
        self.config.duration.as_secs().clamp(1, i32::MAX as u64) as i32
    }

    fn labelled(&self, name: String, role: &str) -> ObjectMeta {
        ObjectMeta {
            name: Some(name),
            namespace: Some(self.config.namespace.clone()),
            labels: Some(BTreeMap::from([
                (ROLE_LABEL.to_string(), role.to_string()),
                (
                    "app.kubernetes.io/managed-by".to_string(),
                    "herald".to_string(),
                ),
            ])),
            ..Default::default()
        }
    }

    /// Until `until` this replica may start attempts under a write begun at `started`.
    fn valid_until(&self, started: Instant) -> Instant {
        started + self.config.duration.saturating_sub(self.config.margin)
    }

    /// Runs forever: one round every `renew_every`.
    pub async fn run(&self) {
        let mut every = tokio::time::interval(self.config.renew_every);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            if let Err(e) = self.round().await {
                tracing::warn!(error = %e, "shard leases: this round failed; held shards stop at their deadline unless a later round renews them");
            }
            self.publish_metrics();
        }
    }

    fn publish_metrics(&self) {
        let held = self.ownership.held();
        let metrics = crate::metrics::get();
        for shard in 0..self.ownership.shards() {
            let owned = held.iter().any(|(s, _)| *s == shard);
            metrics
                .shard_owned
                .with_label_values(&[&shard.to_string()])
                .set(i64::from(owned));
        }
    }

    /// One round: renew membership and held shards, then release or take to the fair share.
    pub async fn round(&self) -> Result<(), kube::Error> {
        let started = Instant::now();
        let now = Timestamp::now();
        self.renew_membership(now).await?;
        let leases = self
            .api
            .list(&ListParams::default().labels(ROLE_LABEL))
            .await?;
        let mut members = 0;
        let mut shards: BTreeMap<u32, Lease> = BTreeMap::new();
        for lease in leases.items {
            let role = lease
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(ROLE_LABEL))
                .cloned()
                .unwrap_or_default();
            let name = lease.metadata.name.clone().unwrap_or_default();
            match role.as_str() {
                "member" if !is_free(&lease, now) => members += 1,
                "shard" => {
                    if let Some(shard) = name
                        .strip_prefix("herald-shard-")
                        .and_then(|n| n.parse::<u32>().ok())
                        .filter(|s| *s < self.ownership.shards())
                    {
                        shards.insert(shard, lease);
                    }
                }
                _ => {}
            }
        }
        let share = fair_share(self.ownership.shards(), members.max(1));

        // Renew what this replica holds, also a hold whose deadline passed (a slow round):
        // while the Lease is still this replica's at the same epoch no one else took it. A
        // shard whose Lease changed hands is lost. The renewals go out together, so that a
        // slow API server delays the round by one write, not one per shard.
        let mut renewals = Vec::new();
        for (shard, held_epoch) in self.ownership.granted() {
            match shards.get(&shard) {
                Some(lease)
                    if holder(lease) == self.config.identity && epoch(lease) == held_epoch =>
                {
                    let mut renewed = lease.clone();
                    if let Some(spec) = renewed.spec.as_mut() {
                        spec.renew_time = Some(MicroTime(now));
                        spec.lease_duration_seconds = Some(self.lease_duration_seconds());
                    }
                    renewals.push(async move {
                        let name = shard_lease_name(shard);
                        let written = self
                            .api
                            .replace(&name, &PostParams::default(), &renewed)
                            .await;
                        (shard, held_epoch, written)
                    });
                }
                _ => {
                    tracing::warn!(shard, "shard lease: lost to another replica; stopping");
                    self.ownership.revoke(shard);
                }
            }
        }
        let mut held: Vec<u32> = Vec::new();
        for (shard, held_epoch, written) in futures::future::join_all(renewals).await {
            match written {
                Ok(lease) => {
                    if self
                        .engine
                        .hold_shard(shard, held_epoch, self.valid_until(started))
                    {
                        tracing::warn!(
                            shard,
                            "shard lease: renewed after its deadline had passed (a slow round); no attempt started for it meanwhile"
                        );
                    }
                    shards.insert(shard, lease);
                    held.push(shard);
                }
                Err(kube::Error::Api(e)) if e.code == 409 => {
                    tracing::warn!(shard, "shard lease: renewal conflicted; stopping");
                    self.ownership.revoke(shard);
                }
                // Unknown: keep the shard until its deadline, renew next round.
                Err(e) => {
                    tracing::warn!(shard, error = %e, "shard lease: renewal failed");
                    held.push(shard);
                }
            }
        }

        // Stopping: keep what is held until the drain has ended, take nothing.
        if self.stopping() {
            return Ok(());
        }

        // Above the share: stop starting attempts first, then release.
        while held.len() > share {
            let Some(shard) = held.pop() else { break };
            self.ownership.revoke(shard);
            if let Some(lease) = shards.get(&shard) {
                let mut released = lease.clone();
                if let Some(spec) = released.spec.as_mut() {
                    spec.holder_identity = None;
                    spec.renew_time = None;
                }
                match self
                    .api
                    .replace(&shard_lease_name(shard), &PostParams::default(), &released)
                    .await
                {
                    Ok(_) => tracing::info!(shard, "shard lease: released for rebalancing"),
                    Err(e) => {
                        tracing::warn!(shard, error = %e, "shard lease: release failed; it expires instead")
                    }
                }
            }
        }

        // Below the share: take free shards, starting at a place of this replica's own so
        // that replicas starting together rarely contend.
        if held.len() < share {
            let n = self.ownership.shards();
            let offset = crate::delivery::shards::shard_of(&self.config.identity, n);
            for i in 0..n {
                if held.len() >= share {
                    break;
                }
                let shard = (offset + i) % n;
                if held.contains(&shard) {
                    continue;
                }
                let taken = match shards.get(&shard) {
                    Some(lease) if is_free(lease, now) => self.take(shard, lease, now).await,
                    Some(_) => None,
                    None => self.create(shard, now).await,
                };
                if let Some(epoch) = taken {
                    // The history says when the taking was recorded: a round that began
                    // before the process was paused would otherwise date it before the pause.
                    let recorded_ms = Timestamp::now().as_millisecond();
                    match self
                        .engine
                        .store()
                        .take_shard(shard, &self.config.identity, epoch, recorded_ms)
                        .await
                    {
                        Ok(true) => {
                            self.engine
                                .hold_shard(shard, epoch, self.valid_until(started));
                            tracing::info!(shard, epoch, "shard lease: taken");
                            held.push(shard);
                        }
                        Ok(false) => tracing::error!(
                            shard,
                            epoch,
                            "shard lease: the store records a newer epoch for this shard than its Lease (was the Lease deleted?); not delivering for it"
                        ),
                        Err(e) => {
                            tracing::warn!(shard, error = %e, "shard lease: cannot record the taking in the store")
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Takes a free Lease: returns the new epoch, or None if another replica was faster.
    async fn take(&self, shard: u32, lease: &Lease, now: Timestamp) -> Option<i64> {
        let mut taken = lease.clone();
        let epoch = epoch(lease) + 1;
        let spec = taken.spec.get_or_insert_with(LeaseSpec::default);
        spec.holder_identity = Some(self.config.identity.clone());
        spec.acquire_time = Some(MicroTime(now));
        spec.renew_time = Some(MicroTime(now));
        spec.lease_duration_seconds = Some(self.lease_duration_seconds());
        spec.lease_transitions = Some(i32::try_from(epoch).ok()?);
        match self
            .api
            .replace(&shard_lease_name(shard), &PostParams::default(), &taken)
            .await
        {
            Ok(_) => Some(epoch),
            Err(kube::Error::Api(e)) if e.code == 409 => None,
            Err(e) => {
                tracing::warn!(shard, error = %e, "shard lease: taking failed");
                None
            }
        }
    }

    async fn create(&self, shard: u32, now: Timestamp) -> Option<i64> {
        let lease = Lease {
            metadata: self.labelled(shard_lease_name(shard), "shard"),
            spec: Some(LeaseSpec {
                holder_identity: Some(self.config.identity.clone()),
                acquire_time: Some(MicroTime(now)),
                renew_time: Some(MicroTime(now)),
                lease_duration_seconds: Some(self.lease_duration_seconds()),
                lease_transitions: Some(1),
                ..Default::default()
            }),
        };
        match self.api.create(&PostParams::default(), &lease).await {
            Ok(_) => Some(1),
            Err(kube::Error::Api(e)) if e.code == 409 => None,
            Err(e) => {
                tracing::warn!(shard, error = %e, "shard lease: creating failed");
                None
            }
        }
    }

    async fn renew_membership(&self, now: Timestamp) -> Result<(), kube::Error> {
        let name = member_lease_name(&self.config.identity);
        let spec = LeaseSpec {
            holder_identity: Some(self.config.identity.clone()),
            renew_time: Some(MicroTime(now)),
            lease_duration_seconds: Some(self.lease_duration_seconds()),
            ..Default::default()
        };
        match self.api.get_opt(&name).await? {
            Some(mut lease) => {
                lease.spec = Some(spec);
                self.api
                    .replace(&name, &PostParams::default(), &lease)
                    .await?;
            }
            None => {
                let lease = Lease {
                    metadata: self.labelled(name, "member"),
                    spec: Some(spec),
                };
                self.api.create(&PostParams::default(), &lease).await?;
            }
        }
        Ok(())
    }

    /// The end of a graceful stop, after the drain: stops starting attempts, then releases
    /// every held shard and the membership, so that the others take over at once rather than
    /// after the Leases expire. The releases go out together and take at most
    /// [`RELEASE_TIMEOUT`] in all.
    pub async fn release_all(&self) {
        self.stop_taking();
        let held = self.ownership.granted();
        for (shard, _) in &held {
            self.ownership.revoke(*shard);
        }
        let releases = held.into_iter().map(|(shard, _)| async move {
            let name = shard_lease_name(shard);
            // A renewal round still on its way when the stop came may write the Lease after
            // it was read here: on that conflict it is read again and released then.
            for _ in 0..RELEASE_ATTEMPTS {
                let Ok(Some(mut lease)) = self.api.get_opt(&name).await else {
                    return;
                };
                if holder(&lease) != self.config.identity {
                    return;
                }
                if let Some(spec) = lease.spec.as_mut() {
                    spec.holder_identity = None;
                    spec.renew_time = None;
                }
                match self
                    .api
                    .replace(&name, &PostParams::default(), &lease)
                    .await
                {
                    Ok(_) => {
                        tracing::info!(shard, "shard lease: released");
                        return;
                    }
                    Err(kube::Error::Api(e)) if e.code == 409 => continue,
                    Err(e) => {
                        tracing::warn!(shard, error = %e, "shard lease: release failed; it expires instead");
                        return;
                    }
                }
            }
            tracing::warn!(
                shard,
                "shard lease: release kept conflicting with another write; it expires instead"
            );
        });
        let member = async {
            let _ = self
                .api
                .delete(
                    &member_lease_name(&self.config.identity),
                    &Default::default(),
                )
                .await;
        };
        let all = futures::future::join(futures::future::join_all(releases), member);
        if tokio::time::timeout(RELEASE_TIMEOUT, all).await.is_err() {
            tracing::warn!(
                timeout_seconds = RELEASE_TIMEOUT.as_secs(),
                "shard leases: not all released in time; the rest expire instead"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: Option<&str>, renewed_ms_ago: Option<i64>, seconds: i32) -> Lease {
        let now = Timestamp::now().as_millisecond();
        Lease {
            metadata: ObjectMeta::default(),
            spec: Some(LeaseSpec {
                holder_identity: holder.map(str::to_string),
                renew_time: renewed_ms_ago
                    .map(|ago| MicroTime(Timestamp::from_millisecond(now - ago).unwrap())),
                lease_duration_seconds: Some(seconds),
                lease_transitions: Some(4),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn a_lease_is_free_when_released_or_not_renewed_in_time() {
        let now = Timestamp::now();
        assert!(!is_free(&lease(Some("a"), Some(1_000), 15), now));
        assert!(is_free(&lease(Some("a"), Some(16_000), 15), now));
        assert!(is_free(&lease(None, Some(1_000), 15), now));
        assert!(is_free(&lease(Some(""), Some(1_000), 15), now));
        assert!(is_free(&lease(Some("a"), None, 15), now));
        assert_eq!(epoch(&lease(Some("a"), None, 15)), 4);
    }

    #[test]
    fn shares_round_up() {
        assert_eq!(fair_share(16, 1), 16);
        assert_eq!(fair_share(16, 3), 6);
        assert_eq!(fair_share(16, 0), 16);
        assert_eq!(fair_share(3, 5), 1);
    }

    #[test]
    fn member_lease_names_are_valid_object_names() {
        assert_eq!(
            member_lease_name("herald-7f9c-x2"),
            "herald-member-herald-7f9c-x2"
        );
        assert_eq!(member_lease_name("Node_A:1"), "herald-member-node-a-1");
    }
}
