//! The Secret values reconciles read. The subscriptions of a namespace often name the same
//! Secret, and at start-up (or when thousands are created at once) reading it again for each
//! one made the API server's speed the limit. A value read here is reused by other
//! reconciles for a few seconds, and only while the Secret watch has delivered no change of
//! it since the read began; then it is dropped, so Secret values are not kept beyond that.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use k8s_openapi::ByteString;

/// A Secret's data, as read.
pub type SecretData = Arc<BTreeMap<String, ByteString>>;

/// How long a read serves other reconciles.
const REUSE_FOR: Duration = Duration::from_secs(5);

/// One Secret being read or recently read. No Debug: it holds secret values.
struct Slot {
    /// Changes the watch delivered; a read that began under an older count is not kept.
    changes: u64,
    read: Option<(SecretData, Instant)>,
    touched: Instant,
}

#[derive(Default)]
struct Slots {
    by_secret: HashMap<(String, String), Slot>,
    swept: Option<Instant>,
}

pub struct SecretReads {
    reuse_for: Duration,
    slots: Mutex<Slots>,
}

impl Default for SecretReads {
    fn default() -> Self {
        Self::reusing_for(REUSE_FOR)
    }
}

impl SecretReads {
    fn reusing_for(reuse_for: Duration) -> Self {
        Self {
            reuse_for,
            slots: Mutex::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The watch saw Secret `namespace/name` change (or listed it again): what was read of
    /// it before is not reused, nor is a read still on its way.
    pub fn changed(&self, namespace: &str, name: &str) {
        let mut slots = self.lock();
        // Only Secrets being read have a slot: the watch sees every Secret in scope.
        if let Some(slot) = slots
            .by_secret
            .get_mut(&(namespace.to_string(), name.to_string()))
        {
            slot.changes += 1;
            slot.read = None;
        }
    }

    /// The Secret's data: a recent read if there is one, else `fetch`'s answer (None when
    /// the Secret does not exist, which is not reused).
    pub async fn read<F>(
        &self,
        namespace: &str,
        name: &str,
        fetch: F,
    ) -> Result<Option<SecretData>, kube::Error>
    where
        F: Future<Output = Result<Option<SecretData>, kube::Error>>,
    {
        let key = (namespace.to_string(), name.to_string());
        let began = {
            let mut slots = self.lock();
            self.sweep(&mut slots);
            let now = Instant::now();
            let slot = slots.by_secret.entry(key.clone()).or_insert(Slot {
                changes: 0,
                read: None,
                touched: now,
            });
            slot.touched = now;
            if let Some((data, at)) = &slot.read
                && at.elapsed() < self.reuse_for
            {
                return Ok(Some(data.clone()));
            }
            slot.changes
        };
        let data = fetch.await?;
        if let Some(data) = &data {
            let mut slots = self.lock();
            if let Some(slot) = slots.by_secret.get_mut(&key)
                && slot.changes == began
            {
                slot.read = Some((data.clone(), Instant::now()));
            }
        }
        Ok(data)
    }

    /// Drops what has not been used for a while, also when no reconcile runs: until the
    /// process ends.
    pub async fn keep_swept(&self) {
        loop {
            tokio::time::sleep(self.reuse_for.max(Duration::from_secs(1))).await;
            let mut slots = self.lock();
            self.sweep(&mut slots);
        }
    }

    /// Drops what has not been used for a while, at most once per reuse period.
    fn sweep(&self, slots: &mut Slots) {
        if slots.swept.is_some_and(|at| at.elapsed() < self.reuse_for) {
            return;
        }
        slots.swept = Some(Instant::now());
        let reuse_for = self.reuse_for;
        slots
            .by_secret
            .retain(|_, slot| slot.touched.elapsed() < reuse_for);
    }

    #[cfg(test)]
    fn slots(&self) -> usize {
        self.lock().by_secret.len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    fn data(value: &str) -> SecretData {
        Arc::new(BTreeMap::from([(
            "k".to_string(),
            ByteString(value.as_bytes().to_vec()),
        )]))
    }

    fn value(read: Option<SecretData>) -> String {
        String::from_utf8(read.unwrap()["k"].0.clone()).unwrap()
    }

    #[tokio::test]
    async fn a_read_is_reused_until_the_secret_changes() {
        let reads = SecretReads::default();
        let fetches = AtomicU32::new(0);
        let fetch = |v: &'static str| {
            let fetches = &fetches;
            async move {
                fetches.fetch_add(1, Ordering::AcqRel);
                Ok(Some(data(v)))
            }
        };
        assert_eq!(
            value(reads.read("ns", "s", fetch("one")).await.unwrap()),
            "one"
        );
        assert_eq!(
            value(reads.read("ns", "s", fetch("two")).await.unwrap()),
            "one"
        );
        assert_eq!(fetches.load(Ordering::Acquire), 1, "read twice");

        // Another Secret, or the same name in another namespace, is another read.
        assert_eq!(value(reads.read("ns", "t", fetch("t")).await.unwrap()), "t");
        assert_eq!(
            value(reads.read("other", "s", fetch("o")).await.unwrap()),
            "o"
        );

        reads.changed("ns", "s");
        assert_eq!(
            value(reads.read("ns", "s", fetch("three")).await.unwrap()),
            "three",
            "a changed Secret was served from an older read"
        );
        assert_eq!(fetches.load(Ordering::Acquire), 4);
        // A change of a Secret nobody read leaves no trace.
        reads.changed("ns", "unread");
        assert_eq!(reads.slots(), 3);
    }

    #[tokio::test]
    async fn a_read_that_a_change_overtook_is_not_kept() {
        let reads = SecretReads::default();
        let stale = reads
            .read("ns", "s", async {
                // The Secret changes while this read is on its way.
                reads.changed("ns", "s");
                Ok(Some(data("old")))
            })
            .await
            .unwrap();
        assert_eq!(value(stale), "old", "the reconcile that read it uses it");
        let fresh = reads
            .read("ns", "s", async { Ok(Some(data("new"))) })
            .await
            .unwrap();
        assert_eq!(value(fresh), "new", "the overtaken read was kept");
    }

    #[tokio::test]
    async fn nothing_is_kept_past_the_reuse_period() {
        let reads = SecretReads::reusing_for(Duration::ZERO);
        reads
            .read("ns", "s", async { Ok(Some(data("one"))) })
            .await
            .unwrap();
        let again = reads
            .read("ns", "s", async { Ok(Some(data("two"))) })
            .await
            .unwrap();
        assert_eq!(value(again), "two");
        // A missing Secret is not remembered.
        let reads = SecretReads::default();
        assert!(
            reads
                .read("ns", "gone", async { Ok(None) })
                .await
                .unwrap()
                .is_none()
        );
        let back = reads
            .read("ns", "gone", async { Ok(Some(data("here"))) })
            .await
            .unwrap();
        assert_eq!(value(back), "here");
        // Every slot unused for a reuse period goes at the next read.
        let reads = SecretReads::reusing_for(Duration::ZERO);
        for name in ["a", "b", "c"] {
            reads
                .read("ns", name, async { Ok(Some(data(name))) })
                .await
                .unwrap();
        }
        assert_eq!(reads.slots(), 1, "slots were not swept");
    }
}
