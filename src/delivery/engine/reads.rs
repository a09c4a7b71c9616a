//! Reads through the API (a subscription's state, its deliveries, an event's attempts),
//! served beside the writing path and bounded per namespace in number and in rows.

use std::time::Duration;

use super::{Engine, EngineError};
use crate::store::{
    AttemptPage, AttemptRecord, AttemptSearch, DeliveryView, StateFilter, SubscriptionState,
};

/// Reads through the API (a subscription's state, its deliveries, an event's attempts) one
/// namespace may have in progress at once; more are answered 429 `read_busy` at once. Reads
/// run beside the writing path, not in it, and this keeps one tenant's from taking every
/// reader.
pub const READS_PER_NAMESPACE: u32 = 2;
/// Rows a namespace may read through the API a second (a read costs the rows it returned,
/// a search at least a tenth of those it read, and any read at least 1), beyond a burst of [`READ_ROWS_BURST`]: what answering reads costs
/// herald (the rows, their JSON) is bounded per namespace, whatever size of page it asks
/// for. A read is admitted while the namespace's budget is not spent, and charged when it
/// has been answered; once spent (a read may overdraw it by its page): 429 `read_busy`,
/// with the seconds until it refills in `Retry-After`.
pub const READ_ROWS_PER_SECOND: f64 = 1_000.0;
/// One second's worth: a read is admitted while any budget is left, so a page of any size
/// (up to 10,000) still goes through, overdrawing it.
pub const READ_ROWS_BURST: f64 = 1_000.0;
/// Rows of the attempt log a search reads for the cost of one row returned: a page that
/// reads the whole [`crate::store::SEARCH_SCAN_ROWS`] and finds nothing costs a second of
/// its namespace's budget, not nothing.
pub const SCANNED_ROWS_PER_ROW: u32 = 10;
/// What a search page is charged, in rows returned.
fn search_cost(page: &AttemptPage) -> usize {
    page.items
        .len()
        .max((page.scanned / SCANNED_ROWS_PER_ROW) as usize)
}

/// How long a subscription's state (its counters and the counts of its backlog, which cost
/// in proportion to the backlog) read through the API is answered again without asking the
/// store.
pub const STATE_TTL: Duration = Duration::from_secs(1);

/// A read admitted into its namespace until dropped, which charges its rows.
struct ReadAdmitted<'a> {
    engine: &'a Engine,
    namespace: &'a str,
    rows: usize,
}

impl ReadAdmitted<'_> {
    fn returned(&mut self, rows: usize) {
        self.rows = rows.max(1);
    }
}

impl Drop for ReadAdmitted<'_> {
    fn drop(&mut self) {
        let mut inner = self.engine.lock();
        inner.reads.leave(self.namespace);
        if let Some((tokens, _)) = inner.read_budgets.get_mut(self.namespace) {
            *tokens -= self.rows as f64;
        }
    }
}

impl Engine {
    /// Admits one read through the API into `namespace` until the guard drops, which
    /// charges the rows it [`ReadAdmitted::returned`] (see [`READS_PER_NAMESPACE`] and
    /// [`READ_ROWS_PER_SECOND`]).
    fn admit_read<'a>(&'a self, namespace: &'a str) -> Result<ReadAdmitted<'a>, EngineError> {
        let mut inner = self.lock();
        let now = std::time::Instant::now();
        let (tokens, at) = inner
            .read_budgets
            .entry(namespace.to_string())
            .or_insert((READ_ROWS_BURST, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * READ_ROWS_PER_SECOND)
            .min(READ_ROWS_BURST);
        *at = now;
        if *tokens <= 0.0 {
            let wait = (-*tokens / READ_ROWS_PER_SECOND).ceil().max(1.0) as u32;
            return Err(EngineError::ReadBusy {
                namespace: namespace.to_string(),
                why: format!(
                    "has read more than {READ_ROWS_PER_SECOND} rows a second through the API"
                ),
                retry_after: wait,
            });
        }
        if !inner.reads.enter(namespace) {
            return Err(EngineError::ReadBusy {
                namespace: namespace.to_string(),
                why: format!("already has {READS_PER_NAMESPACE} reads in progress"),
                retry_after: 1,
            });
        }
        Ok(ReadAdmitted {
            engine: self,
            namespace,
            rows: 1,
        })
    }

    pub async fn list(
        &self,
        namespace: &str,
        name: &str,
        filter: StateFilter,
        limit: u32,
    ) -> Result<Vec<DeliveryView>, EngineError> {
        let uid = self.uid_of(namespace, name)?;
        let mut admitted = self.admit_read(namespace)?;
        let page = self.store.list_deliveries(&uid, filter, limit).await?;
        admitted.returned(page.len());
        Ok(page)
    }

    pub async fn attempts(
        &self,
        namespace: &str,
        name: &str,
        event_id: &str,
    ) -> Result<Vec<AttemptRecord>, EngineError> {
        let uid = self.uid_of(namespace, name)?;
        let mut admitted = self.admit_read(namespace)?;
        let attempts = self.store.attempts(&uid, event_id).await?;
        admitted.returned(attempts.len());
        Ok(attempts)
    }

    /// Attempts across a namespace's subscriptions, newest first, a page at a time (see
    /// [`crate::store::SEARCH_SCAN_ROWS`]).
    pub async fn search(&self, search: AttemptSearch) -> Result<AttemptPage, EngineError> {
        let namespace = search.namespace.clone();
        let mut admitted = self.admit_read(&namespace)?;
        let page = self.store.search_attempts(search).await?;
        admitted.returned(search_cost(&page));
        Ok(page)
    }

    /// A subscription's state as the API shows it: while nothing this replica does changes
    /// it (a publish to it, an attempt's end, a replay, re-enabling), read from the store at
    /// most once per [`STATE_TTL`], so that however often a resting backlog is asked about,
    /// it is counted about once a second.
    pub async fn state(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<SubscriptionState, EngineError> {
        let uid = self.uid_of(namespace, name)?;
        let now = std::time::Instant::now();
        if let Some((at, state)) = self.lock().states.get(&uid)
            && now.duration_since(*at) < STATE_TTL
        {
            return Ok(state.clone());
        }
        let _admitted = self.admit_read(namespace)?;
        let state = self
            .store
            .subscription_state(&uid)
            .await?
            .unwrap_or_default();
        let mut inner = self.lock();
        if inner.states.len() >= 4 * inner.subs.len().max(1024) {
            inner
                .states
                .retain(|_, (at, _)| now.duration_since(*at) < STATE_TTL);
        }
        inner.states.insert(uid, (now, state.clone()));
        Ok(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_search_costs_what_it_read_not_only_what_it_found() {
        let empty = AttemptPage {
            items: Vec::new(),
            ids: Vec::new(),
            next: Some(1),
            scanned: 10_000,
        };
        assert_eq!(search_cost(&empty), 1_000);
        let hit = crate::store::AttemptHit {
            subscription: "s".into(),
            event_id: "e".into(),
            event_type: "t".into(),
            attempt: AttemptRecord {
                at_ms: 0,
                outcome: "Accepted".into(),
                status_code: Some(200),
                latency_ms: 1,
                message: String::new(),
            },
        };
        let full = AttemptPage {
            items: vec![hit; 100],
            ids: (1..=100).collect(),
            next: None,
            scanned: 120,
        };
        assert_eq!(search_cost(&full), 100);
    }
}
