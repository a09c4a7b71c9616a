//! The fence an attempt carries when replicas share the store. It is taken from this
//! replica's [`Ownership`] just before the claim and checked three times, each against a
//! different way to lose the shard:
//!
//! 1. by the store, inside the claim's statement: the lease epoch must be the shard's
//!    current one (another replica took the shard: the claim is refused);
//! 2. here, after the claim and before the send ([`Fence::holds`]): the hold may have ended
//!    while the claim was on its way (the process was paused, a renewal was late); the claim
//!    is then given back unsent;
//! 3. by the store, at completion (the token travels in [`crate::store::ClaimRef`]): an
//!    attempt whose delivery was claimed again meanwhile is kept in the history but changes
//!    nothing.
//!
//! With one replica there is no shard to lose and the fence always holds.

use std::sync::Arc;

use crate::delivery::shards::Ownership;
use crate::store::ShardFence;

#[derive(Clone)]
pub(super) enum Fence {
    /// One replica owns every subscription.
    Unshared,
    /// The shard's hold this attempt is claimed under.
    Held {
        ownership: Arc<Ownership>,
        token: ShardFence,
    },
}

/// This replica does not hold the subscription's shard now.
pub(super) struct NotHeld {
    pub shard: u32,
}

impl Fence {
    /// The fence for an attempt of `uid` now.
    pub(super) fn take(ownership: Option<&Arc<Ownership>>, uid: &str) -> Result<Fence, NotHeld> {
        let Some(ownership) = ownership else {
            return Ok(Fence::Unshared);
        };
        let shard = ownership.shard_of(uid);
        match ownership.fence(shard) {
            Some(token) => Ok(Fence::Held {
                ownership: ownership.clone(),
                token,
            }),
            None => Err(NotHeld { shard }),
        }
    }

    /// What the store checks in the claim and at completion.
    pub(super) fn token(&self) -> Option<ShardFence> {
        match self {
            Fence::Unshared => None,
            Fence::Held { token, .. } => Some(*token),
        }
    }

    /// Whether the hold the claim was made under still stands: checked before the send.
    pub(super) fn holds(&self) -> bool {
        match self {
            Fence::Unshared => true,
            Fence::Held { ownership, token } => ownership.fence(token.shard) == Some(*token),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn a_fence_holds_until_its_shard_is_revoked_lapses_or_changes_epoch() {
        assert!(Fence::take(None, "uid").is_ok_and(|f| f.holds() && f.token().is_none()));

        let ownership = Arc::new(Ownership::new(1));
        assert!(
            Fence::take(Some(&ownership), "uid").is_err(),
            "not held yet"
        );
        ownership.hold(0, 1, Instant::now() + Duration::from_secs(60));
        let Ok(fence) = Fence::take(Some(&ownership), "uid") else {
            panic!("held")
        };
        assert_eq!(fence.token(), Some(ShardFence { shard: 0, epoch: 1 }));
        assert!(fence.holds());

        // Taken again under a newer epoch (revoked, then granted anew): the old fence fails.
        ownership.revoke(0);
        assert!(!fence.holds());
        ownership.hold(0, 2, Instant::now() + Duration::from_secs(60));
        assert!(!fence.holds());
        assert!(Fence::take(Some(&ownership), "uid").is_ok_and(|f| f.holds()));

        // A hold past its deadline fails too, until renewed at the same epoch.
        let Ok(fence) = Fence::take(Some(&ownership), "uid") else {
            panic!("held")
        };
        ownership.hold(0, 2, Instant::now());
        assert!(!fence.holds());
        ownership.hold(0, 2, Instant::now() + Duration::from_secs(60));
        assert!(fence.holds());
    }
}
