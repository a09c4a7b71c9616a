//! Shards: which subscriptions this replica may start attempts for, when several replicas
//! share one store. Subscriptions hash onto a fixed number of virtual shards
//! ([`shard_of`]); a replica holds some of them, each under a lease epoch, until a deadline
//! on the monotonic clock. Something outside the engine (in cluster mode, the Lease loop in
//! `controller::shard_leases`) grants, renews and revokes; the engine only asks [`Ownership::fence`]
//! before every claim and passes the epoch to the store, which refuses a claim whose epoch is
//! no longer the shard's current one. So a replica that was paused, partitioned or slow to
//! renew stops on its own deadline, and the store stops it if it did not.

use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use crate::store::ShardFence;

/// The documented, stable shard of a subscription: FNV-1a (64-bit) of its uid, modulo the
/// number of shards. Every replica must run with the same number of shards.
pub fn shard_of(uid: &str, shards: u32) -> u32 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in uid.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    (hash % u64::from(shards.max(1))) as u32
}

#[derive(Clone, Copy, Debug)]
struct Held {
    epoch: i64,
    /// No attempt starts at or after this instant unless the hold is renewed first.
    until: Instant,
}

/// The shards this replica holds, each with its lease epoch and deadline.
#[derive(Debug)]
pub struct Ownership {
    shards: u32,
    held: Mutex<Vec<Option<Held>>>,
}

impl Ownership {
    pub fn new(shards: u32) -> Self {
        let shards = shards.max(1);
        Self {
            shards,
            held: Mutex::new(vec![None; shards as usize]),
        }
    }

    pub fn shards(&self) -> u32 {
        self.shards
    }

    pub fn shard_of(&self, uid: &str) -> u32 {
        shard_of(uid, self.shards)
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Option<Held>>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The fence for a claim in `shard`, if this replica holds it now.
    pub fn fence(&self, shard: u32) -> Option<ShardFence> {
        let held = self.lock().get(shard as usize).copied().flatten()?;
        (Instant::now() < held.until).then_some(ShardFence {
            shard,
            epoch: held.epoch,
        })
    }

    /// Holds `shard` at `epoch` until `until` (a grant, or a renewal of the same epoch).
    /// Returns whether the shard was not held under `epoch` just before (never, revoked, or
    /// past its deadline): attempts for it may have been refused meanwhile.
    pub fn hold(&self, shard: u32, epoch: i64, until: Instant) -> bool {
        let mut held = self.lock();
        let Some(slot) = held.get_mut(shard as usize) else {
            return false;
        };
        let was_held = slot.is_some_and(|h| h.epoch == epoch && Instant::now() < h.until);
        *slot = Some(Held { epoch, until });
        !was_held
    }

    /// Stops starting attempts for `shard` now.
    pub fn revoke(&self, shard: u32) {
        if let Some(slot) = self.lock().get_mut(shard as usize) {
            *slot = None;
        }
    }

    /// Shards granted and not revoked, with their epochs, including those whose deadline
    /// passed without a renewal: still this replica's to renew while its Lease is.
    pub fn granted(&self) -> Vec<(u32, i64)> {
        self.lock()
            .iter()
            .enumerate()
            .filter_map(|(shard, held)| held.map(|h| (shard as u32, h.epoch)))
            .collect()
    }

    /// Shards held now, with their epochs.
    pub fn held(&self) -> Vec<(u32, i64)> {
        let now = Instant::now();
        self.lock()
            .iter()
            .enumerate()
            .filter_map(|(shard, held)| {
                held.filter(|h| now < h.until)
                    .map(|h| (shard as u32, h.epoch))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_shard_hash_is_stable() {
        // Documented in the README: changing the hash moves every subscription.
        assert_eq!(shard_of("", 16), (0xcbf2_9ce4_8422_2325u64 % 16) as u32);
        assert_eq!(
            shard_of("a", 1 << 31),
            (0xaf63_dc4c_8601_ec8cu64 % (1 << 31)) as u32
        );
        assert_eq!(shard_of("anything", 1), 0);
        assert_eq!(shard_of("anything", 0), 0);
    }

    #[test]
    fn subscriptions_spread_over_the_shards() {
        let mut counts = [0u32; 8];
        for _ in 0..8000 {
            counts[shard_of(&uuid::Uuid::now_v7().to_string(), 8) as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (800..1200).contains(&c)),
            "{counts:?}"
        );
    }

    #[test]
    fn a_hold_ends_at_its_deadline_or_on_revoke() {
        let later = || Instant::now() + Duration::from_secs(60);
        let ownership = Ownership::new(4);
        assert!(ownership.fence(1).is_none());
        assert!(ownership.hold(1, 7, later()), "a new hold");
        assert_eq!(ownership.fence(1), Some(ShardFence { shard: 1, epoch: 7 }));
        assert_eq!(ownership.held(), vec![(1, 7)]);
        assert!(!ownership.hold(1, 7, later()), "a renewal in time");
        assert!(ownership.hold(1, 8, later()), "a new epoch");
        ownership.revoke(1);
        assert!(ownership.fence(1).is_none());
        assert!(ownership.granted().is_empty());
        ownership.hold(2, 3, Instant::now());
        assert!(
            ownership.fence(2).is_none(),
            "a hold past its deadline fences nothing"
        );
        assert!(ownership.held().is_empty());
        assert_eq!(ownership.granted(), vec![(2, 3)], "still to renew");
        assert!(
            ownership.hold(2, 3, later()),
            "a renewal after the deadline"
        );
        assert!(!ownership.hold(9, 1, later()));
        assert!(ownership.fence(9).is_none(), "no such shard");
    }
}
