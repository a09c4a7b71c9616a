//! Claims on PostgreSQL, joined: the next due delivery of many lanes in one statement.
//!
//! A lane whose delivery was neither claimed with its publish nor with its previous record
//! claims on its own ([`crate::store::Store::claim_next`], `claim_fenced`): with several
//! replicas, most lanes whose publish reached another replica (measured: 0.62 claims an
//! event with three replicas, each a statement of its own). Here concurrent claims are
//! joined as records are ([`super::completions`]): a few claimers each take what is queued
//! and claim it in one statement, each claim under its own fence, answering each once the
//! statement returns ([`Joined`]). A claim after a quiet moment, or at a moderate pace,
//! waits for nothing; under load one waits up to 2 ms for more ([`super::stream`]: with
//! three replicas, 4.6 claims a statement against 2.8, and 0.11 claim statements an event
//! against 0.21). A statement claims at most once per subscription (a lane's claims follow
//! its order).

use futures::future::BoxFuture;
use sqlx_core::executor::Executor;
use sqlx_core::query::query;
use sqlx_core::row::Row;
use sqlx_postgres::PgPool;

use super::writing::{Joined, Statement};
use super::{Claim, Claimed, Error, OP_TIMEOUT, ShardFence, shard_number};

/// Claimers working at once.
pub(super) const CLAIMERS: usize = 2;
/// How long a small batch of claims under load waits for more at most.
pub(super) const GATHER_FOR: std::time::Duration = std::time::Duration::from_millis(2);
/// How long a claimer's statement waits for a row lock before its claims go one at a time
/// (set on the claimers' connections).
pub(super) const LOCK_TIMEOUT: &str = "250ms";

/// Claims, per lane (`n`: its place in the batch; a later claim of the same subscription is
/// left for the next statement), the next due delivery, fenced by liveness and, with shard
/// leases, by the lane's lease epoch.
///
/// The locks in the order every statement takes them: the subscription rows (`sub`, FOR KEY
/// SHARE, in uid order, only while live, enabled and unpaused: a removal in progress makes
/// the claim wait, then see the tombstone), then the shards' owner rows at the claims'
/// epochs (`owner`, FOR SHARE, in shard order: a take-over in progress makes it wait, then
/// see the new epoch), all of them before any delivery (`fenced` counts `owner` whole
/// first), then per lane its next due delivery, `FOR UPDATE SKIP LOCKED`: one another
/// claimer is taking is left to it. Under strict order only the lane's oldest waiting
/// delivery, and none while one is in flight.
///
/// Per claim: the delivery claimed, or the lane's next due time (none while paused,
/// disabled or removed, and under strict order none while one is in flight). One statement
/// sees one snapshot: a delivery skipped because another claimer held it still counts as
/// due, and its lane looks again, finding it gone.
pub(super) const CLAIM: &str = "
    WITH input AS (
        SELECT * FROM unnest($1::text[], $2::bigint[], $3::integer[], $4::bigint[])
            WITH ORDINALITY AS i(uid, now_ms, shard, epoch, n)
    ), first AS MATERIALIZED (
        SELECT DISTINCT ON (uid) * FROM input ORDER BY uid, n
    ), sub AS MATERIALIZED (
        SELECT s.uid, s.strict_order, s.shard FROM subscriptions s
        WHERE s.uid IN (SELECT uid FROM first) AND s.live AND NOT s.paused AND NOT s.disabled
        ORDER BY s.uid
        FOR KEY SHARE
    ), owner AS MATERIALIZED (
        SELECT o.shard, o.epoch FROM shard_owners o
        WHERE (o.shard, o.epoch) IN (SELECT f.shard, f.epoch FROM first f
                                     JOIN sub ON sub.uid = f.uid AND sub.shard = f.shard
                                     WHERE f.epoch IS NOT NULL)
        ORDER BY o.shard
        FOR SHARE
    ), fenced AS MATERIALIZED (
        SELECT f.n, f.uid, f.now_ms, sub.strict_order
        FROM first f JOIN sub ON sub.uid = f.uid
        WHERE (SELECT count(*) FROM owner) >= 0
          AND (f.epoch IS NULL
               OR sub.shard = f.shard
                  AND EXISTS (SELECT 1 FROM owner o
                              WHERE o.shard = f.shard AND o.epoch = f.epoch))
    ), next AS MATERIALIZED (
        SELECT f.n, d.id
        FROM fenced f CROSS JOIN LATERAL (
            SELECT id FROM deliveries
            WHERE sub_uid = f.uid AND state = 0 AND due_ms <= f.now_ms
              AND (NOT f.strict_order
                   OR id = (SELECT min(id) FROM deliveries
                            WHERE sub_uid = f.uid AND state = 0 AND strict)
                      AND NOT EXISTS (SELECT 1 FROM deliveries
                                      WHERE sub_uid = f.uid AND state = 1))
            ORDER BY due_ms, id
            LIMIT 1
            FOR UPDATE SKIP LOCKED
        ) d
    ), claimed AS (
        UPDATE deliveries d SET state = 1, attempts = d.attempts + 1
        FROM next, events e
        WHERE d.id = next.id AND e.id = d.event
        RETURNING next.n, d.id, e.event_id, e.event_type, e.body, d.attempts,
                  d.window_start_ms
    )
    SELECT i.n,
           f.n IS NOT NULL,
           c.id, c.event_id, c.event_type, c.body, c.attempts, c.window_start_ms,
           CASE
               WHEN f.n IS NULL OR c.id IS NOT NULL OR sub.uid IS NULL THEN NULL
               WHEN NOT sub.strict_order THEN
                   (SELECT min(due_ms) FROM deliveries WHERE sub_uid = sub.uid AND state = 0)
               WHEN NOT EXISTS (SELECT 1 FROM deliveries
                                WHERE sub_uid = sub.uid AND state = 1)
               THEN (SELECT due_ms FROM deliveries
                     WHERE sub_uid = sub.uid AND state = 0 AND strict
                     ORDER BY id LIMIT 1)
           END
    FROM input i
    LEFT JOIN first f ON f.n = i.n
    LEFT JOIN sub ON sub.uid = f.uid
    LEFT JOIN claimed c ON c.n = i.n
    ORDER BY i.n";

/// One lane's claim: its next delivery due by `now_ms`, under `fence` when shards are
/// leased.
pub(super) struct Request {
    pub uid: String,
    pub now_ms: i64,
    pub fence: Option<ShardFence>,
}

/// The claim queue and its claimers.
pub(super) type Claims = Joined<Lanes>;

/// Claims of lanes, as [`Joined`] writes them.
pub(super) enum Lanes {}

impl Statement for Lanes {
    type Request = Request;
    type Answer = Claim;
    const MAX_BATCH: usize = 256;

    fn write<'a>(
        pool: &'a PgPool,
        requests: &'a [&'a Request],
    ) -> BoxFuture<'a, std::result::Result<Vec<Option<Claim>>, sqlx_core::Error>> {
        Box::pin(write(pool, requests))
    }

    fn write_one<'a>(
        pool: &'a PgPool,
        request: &'a Request,
    ) -> BoxFuture<'a, std::result::Result<Claim, sqlx_core::Error>> {
        Box::pin(write_one(pool, request))
    }

    fn timed_out() -> Error {
        Error::Unavailable(format!(
            "PostgreSQL did not answer the claim within {}s",
            OP_TIMEOUT.as_secs()
        ))
    }

    /// A lane that gave up waiting sends nothing: its claim is given back.
    fn unwanted(pool: &PgPool, claim: Claim) {
        let Claim::Claimed(c) = claim else {
            return;
        };
        let pool = pool.clone();
        tokio::spawn(async move {
            let undone =
                tokio::time::timeout(OP_TIMEOUT, unclaim(&pool, c.delivery_id, c.attempt)).await;
            if !matches!(undone, Ok(Ok(_))) {
                tracing::warn!(
                    "giving back a claim nobody waited for failed; it is due again at its shard's next take-over"
                );
            }
        });
    }
}

/// Claims `requests` in one statement (see [`CLAIM`]) on `executor`: per request its claim,
/// or None where a claim of the same subscription came earlier in `requests` (the caller
/// claims it in a later statement).
async fn write<'e>(
    executor: impl Executor<'e, Database = sqlx_postgres::Postgres>,
    requests: &[&Request],
) -> std::result::Result<Vec<Option<Claim>>, sqlx_core::Error> {
    let rows = query(CLAIM)
        .bind(requests.iter().map(|r| r.uid.as_str()).collect::<Vec<_>>())
        .bind(requests.iter().map(|r| r.now_ms).collect::<Vec<_>>())
        .bind(
            requests
                .iter()
                .map(|r| r.fence.map(|f| shard_number(f.shard)))
                .collect::<Vec<_>>(),
        )
        .bind(
            requests
                .iter()
                .map(|r| r.fence.map(|f| f.epoch))
                .collect::<Vec<_>>(),
        )
        .fetch_all(executor)
        .await?;
    let mut answers: Vec<Option<Claim>> = (0..requests.len()).map(|_| None).collect();
    for row in rows {
        let place = (row.try_get::<i64, _>(0)? - 1) as usize;
        let Some(request) = requests.get(place) else {
            continue;
        };
        if !row.try_get::<bool, _>(1)? {
            continue;
        }
        answers[place] = Some(match row.try_get::<Option<i64>, _>(2)? {
            Some(delivery_id) => Claim::Claimed(Claimed {
                delivery_id,
                subscription_uid: request.uid.clone(),
                event_id: row.try_get(3)?,
                event_type: row.try_get(4)?,
                body: row.try_get(5)?,
                attempt: row.try_get::<i32, _>(6)?.max(0) as u32,
                window_start_ms: row.try_get(7)?,
                fence: request.fence,
            }),
            None => Claim::Idle {
                next_due_ms: row.try_get(8)?,
            },
        });
    }
    Ok(answers)
}

/// Claims for one lane (see [`write`]) on `executor`.
pub(super) async fn write_one<'e>(
    executor: impl Executor<'e, Database = sqlx_postgres::Postgres>,
    request: &Request,
) -> std::result::Result<Claim, sqlx_core::Error> {
    write(executor, &[request])
        .await?
        .pop()
        .flatten()
        .ok_or_else(|| sqlx_core::Error::Protocol("a claim returned no answer for it".into()))
}

/// Makes a claimed delivery due again, its attempt not counted, while it is still in flight
/// under that claim (`attempt`): a take-over or a later claim has changed state or attempts
/// since, and then this matches nothing. Whether it matched.
pub(super) async fn unclaim(
    pool: &PgPool,
    delivery_id: i64,
    attempt: u32,
) -> std::result::Result<bool, sqlx_core::Error> {
    let undone = query(
        "UPDATE deliveries SET state = 0, attempts = attempts - 1
         WHERE id = $1 AND state = 1 AND attempts = $2",
    )
    .bind(delivery_id)
    .bind(attempt.min(i32::MAX as u32) as i32)
    .execute(pool)
    .await?
    .rows_affected();
    Ok(undone == 1)
}
