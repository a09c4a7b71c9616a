//! Attempt records on PostgreSQL, joined: the completions of many lanes in one statement.
//!
//! Every delivery's record ([`crate::store::Store::complete_and_claim`]) is one statement of several parts
//! (the subscription's row, the shard's fence, the delivery, its history, the counters, the
//! lane's next claim). Setting up that statement and its transaction costs the server about
//! as much as running it, and a record per event was most of the server's work. Here
//! concurrent records are joined as publishes are ([`super::group_commit`]): a few recorders
//! each take what is queued and record it in one statement, each record under its own claim
//! and fence, answering each once the statement returns ([`Joined`]). A small batch waits
//! up to 2 ms for the records of attempts claimed moments ago and still on the wire
//! ([`super::writing::GATHER_UP_TO`], [`super::on_wire`]); a lone record waits for nothing.
//!
//! One statement is written at a time while it goes well (measured with three recorders
//! going at once: 3.3 records a statement end to end and 0.33 ms of server CPU per event;
//! waiting: 10 records and 0.26 ms). A statement records at most one attempt per
//! subscription (the counters and the lane's next claim follow one attempt at a time).

use futures::future::BoxFuture;
use sqlx_core::executor::Executor;
use sqlx_core::query::query;
use sqlx_core::row::Row;
use sqlx_postgres::PgPool;

use super::writing::{Joined, Statement};
use super::{
    AttemptRecord, ClaimRef, Claimed, Completion, DeliveryState, Error, Next, OP_TIMEOUT,
    shard_number, superseded_message,
};

/// Recorders working at once: while one statement runs, the next batch gathers and another
/// may be sent.
pub(super) const RECORDERS: usize = 3;
/// How long a recorder's statement waits for a row lock before its records go one at a
/// time (set on the recorders' connections, so that a batch is one round trip).
pub(super) const LOCK_TIMEOUT: &str = "250ms";

/// Records attempts, each under its claim (see [`crate::store::Store::complete_and_claim`]), at most one
/// per subscription (`n`: its place in the batch; a later one of the same subscription is
/// left for the next statement and answered `deferred`).
///
/// Per attempt, as for one: the subscription row first (`sub`, FOR NO KEY UPDATE, in uid
/// order for every batch, so two batches never wait for each other in a cycle; it returns
/// the row as it is once a pause or removal in progress has committed), then, for a fenced
/// claim, the shard's owner row while at the claim's epoch (`owner`, FOR SHARE, in shard
/// order: a take-over in progress makes it wait, then see the new epoch), then the
/// deliveries, in the order claims, removals and take-overs take them. A delivery moves on
/// only while in flight under its claim (same attempt number): one purged meanwhile is
/// gone, and a stale claim's attempt (a take-over made it due again, or another replica
/// claimed it since) is history only. `moved` finds it by its key alone: naming its
/// subscription too (which `target` read from the same row, and which never changes) made
/// the planner walk the lane index past the lane's earlier in-flight entries instead. A
/// 410 Gone disables the subscription whatever its threshold; `disabled_now` compares with
/// the row `sub` locked. After a delivery, with
/// `then_claim`, the lane's next due delivery is claimed (`following`, `claimed`: the rules
/// of a claim, the fence held through `moved`). The last column is the lane's next due time,
/// none when a delivery was claimed here (the lane goes on with it); one statement sees one
/// snapshot, so a retry scheduled here is not among it.
pub(super) const RECORD: &str = "
    WITH input AS (
        SELECT * FROM unnest($1::bigint[], $2::smallint[], $3::bigint[], $4::bigint[],
                             $5::bigint[], $6::text[], $7::integer[], $8::bigint[], $9::text[],
                             $10::boolean[], $11::boolean[], $12::integer[], $13::integer[],
                             $14::bigint[], $15::text[], $16::bigint[], $17::boolean[])
            WITH ORDINALITY AS i(delivery, state, due_ms, finished_ms, at_ms, outcome,
                                 status_code, latency_ms, message, ok, dead, attempt, shard,
                                 epoch, stale_message, then_claim, gone, n)
    ), target AS MATERIALIZED (
        SELECT DISTINCT ON (d.sub_uid) i.*, d.sub_uid
        FROM input i JOIN deliveries d ON d.id = i.delivery
        ORDER BY d.sub_uid, i.n
    ), sub AS MATERIALIZED (
        SELECT s.uid, s.live AND NOT s.paused AND NOT s.disabled AS active,
               s.disabled AS was_disabled, s.strict_order
        FROM subscriptions s
        WHERE s.uid IN (SELECT sub_uid FROM target)
        ORDER BY s.uid
        FOR NO KEY UPDATE
    ), owner AS MATERIALIZED (
        SELECT o.shard, o.epoch FROM shard_owners o
        WHERE (o.shard, o.epoch) IN (SELECT t.shard, t.epoch FROM target t
                                     JOIN sub ON sub.uid = t.sub_uid
                                     WHERE t.shard IS NOT NULL)
        ORDER BY o.shard
        FOR SHARE
    ), moved AS (
        UPDATE deliveries d SET state = t.state, due_ms = t.due_ms, finished_ms = t.finished_ms
        FROM target t JOIN sub ON sub.uid = t.sub_uid
        WHERE d.id = t.delivery AND d.state = 1 AND d.attempts = t.attempt
          AND (t.shard IS NULL
               OR EXISTS (SELECT 1 FROM owner o WHERE o.shard = t.shard AND o.epoch = t.epoch))
        RETURNING d.id, d.sub_uid
    ), logged AS (
        INSERT INTO attempt_log (delivery, at_ms, outcome, status_code, latency_ms, message)
        SELECT t.delivery, t.at_ms, t.outcome, t.status_code, t.latency_ms,
               CASE WHEN EXISTS (SELECT 1 FROM moved m WHERE m.id = t.delivery)
                    THEN t.message ELSE t.stale_message END
        FROM target t JOIN sub ON sub.uid = t.sub_uid
        ORDER BY t.n
    ), counted AS (
        UPDATE subscriptions s SET
            consecutive_failures = CASE WHEN t.ok THEN 0 ELSE s.consecutive_failures + 1 END,
            delivered = s.delivered + CASE WHEN t.ok THEN 1 ELSE 0 END,
            failed = s.failed + CASE WHEN t.ok THEN 0 ELSE 1 END,
            dead_lettered = s.dead_lettered + CASE WHEN t.dead THEN 1 ELSE 0 END,
            disabled = s.disabled OR t.gone OR (NOT t.ok AND s.disable_after > 0
                                      AND s.consecutive_failures + 1 >= s.disable_after),
            gone = s.gone OR t.gone
        FROM moved JOIN target t ON t.delivery = moved.id JOIN sub ON sub.uid = moved.sub_uid
        WHERE s.uid = moved.sub_uid AND s.live
        RETURNING s.uid, s.consecutive_failures, s.disabled AND NOT sub.was_disabled AS disabled_now
    ), following AS MATERIALIZED (
        SELECT next.id
        FROM target t JOIN sub ON sub.uid = t.sub_uid
        CROSS JOIN LATERAL (
            SELECT d.id FROM deliveries d
            WHERE d.sub_uid = t.sub_uid AND d.state = 0 AND d.due_ms <= t.then_claim
              AND (NOT sub.strict_order
                   OR d.id = (SELECT min(o.id) FROM deliveries o
                              WHERE o.sub_uid = t.sub_uid AND o.state = 0 AND o.strict)
                      AND NOT EXISTS (SELECT 1 FROM deliveries f
                                      WHERE f.sub_uid = t.sub_uid AND f.state = 1
                                        AND f.id <> t.delivery))
            ORDER BY d.due_ms, d.id
            LIMIT 1
            FOR UPDATE SKIP LOCKED
        ) next
        WHERE t.then_claim IS NOT NULL AND t.ok AND sub.active
          AND EXISTS (SELECT 1 FROM moved m WHERE m.id = t.delivery)
    ), claimed AS (
        UPDATE deliveries d SET state = 1, attempts = d.attempts + 1
        FROM following, events e
        WHERE d.id = following.id AND e.id = d.event
        RETURNING d.id, e.event_id, e.event_type, e.body, d.attempts, d.window_start_ms,
                  d.sub_uid
    )
    SELECT i.n,
           t.n IS NOT NULL OR NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.id = i.delivery),
           EXISTS (SELECT 1 FROM moved m WHERE m.id = i.delivery),
           coalesce(c.consecutive_failures, 0),
           coalesce(c.disabled_now, false),
           CASE
               WHEN t.n IS NULL OR NOT coalesce(sub.active, false)
                    OR coalesce(c.disabled_now, false)
               THEN NULL
               -- The lane goes on with the delivery claimed here; its record says what
               -- is due after it.
               WHEN cl.id IS NOT NULL THEN NULL
               WHEN NOT sub.strict_order THEN
                   (SELECT min(d.due_ms) FROM deliveries d
                    WHERE d.sub_uid = sub.uid AND d.state = 0)
               -- Strict: a retry stays the oldest; one still on the wire holds the lane;
               -- else the oldest waiting one's.
               WHEN t.state = 0 AND EXISTS (SELECT 1 FROM moved m WHERE m.id = t.delivery)
               THEN t.due_ms
               WHEN EXISTS (SELECT 1 FROM deliveries d
                            WHERE d.sub_uid = sub.uid AND d.state = 1
                              AND d.id <> t.delivery)
               THEN NULL
               ELSE (SELECT d.due_ms FROM deliveries d
                     WHERE d.sub_uid = sub.uid AND d.state = 0 AND d.strict
                     ORDER BY d.id LIMIT 1)
           END,
           cl.id, cl.event_id, cl.event_type, cl.body, cl.attempts, cl.window_start_ms,
           cl.sub_uid
    FROM input i
    LEFT JOIN target t ON t.n = i.n
    LEFT JOIN sub ON sub.uid = t.sub_uid
    LEFT JOIN counted c ON c.uid = t.sub_uid
    LEFT JOIN claimed cl ON cl.sub_uid = t.sub_uid
    ORDER BY i.n";

/// One attempt to record.
pub(super) struct Record {
    pub claim: ClaimRef,
    pub attempt: AttemptRecord,
    pub next: Next,
    pub then_claim: Option<i64>,
}

/// What recording an attempt gave: the completion and the lane's next delivery, claimed.
pub(super) type Recorded = (Completion, Option<Claimed>);

/// The record queue and its recorders.
pub(super) type Completions = Joined<Records>;

/// Attempt records, as [`Joined`] writes them. A lane that gave up waiting for its record
/// retries it, which then finds its claim spent and is kept as history only.
pub(super) enum Records {}

impl Statement for Records {
    type Request = Record;
    type Answer = Recorded;
    const MAX_BATCH: usize = 128;

    fn write<'a>(
        pool: &'a PgPool,
        requests: &'a [&'a Record],
    ) -> BoxFuture<'a, std::result::Result<Vec<Option<Recorded>>, sqlx_core::Error>> {
        Box::pin(write(pool, requests))
    }

    fn write_one<'a>(
        pool: &'a PgPool,
        request: &'a Record,
    ) -> BoxFuture<'a, std::result::Result<Recorded, sqlx_core::Error>> {
        Box::pin(write_one(pool, request))
    }

    fn timed_out() -> Error {
        Error::Unavailable(format!(
            "PostgreSQL did not record the attempt within {}s",
            OP_TIMEOUT.as_secs()
        ))
    }
}

/// Records `records` in one statement (see [`RECORD`]) on `executor` (a pool, or a
/// transaction that does more): per record what it gave, or None where a record of the
/// same subscription came earlier in `records` (the caller records it in a later
/// statement).
pub(super) async fn write<'e>(
    executor: impl Executor<'e, Database = sqlx_postgres::Postgres>,
    records: &[&Record],
) -> std::result::Result<Vec<Option<Recorded>>, sqlx_core::Error> {
    let n = records.len();
    let mut delivery = Vec::with_capacity(n);
    let mut state = Vec::with_capacity(n);
    let mut due_ms = Vec::with_capacity(n);
    let mut finished_ms = Vec::with_capacity(n);
    let mut at_ms = Vec::with_capacity(n);
    let mut outcome = Vec::with_capacity(n);
    let mut status_code = Vec::with_capacity(n);
    let mut latency_ms = Vec::with_capacity(n);
    let mut message = Vec::with_capacity(n);
    let mut ok = Vec::with_capacity(n);
    let mut dead = Vec::with_capacity(n);
    let mut attempt = Vec::with_capacity(n);
    let mut shard = Vec::with_capacity(n);
    let mut epoch = Vec::with_capacity(n);
    let mut stale_message = Vec::with_capacity(n);
    let mut then_claim = Vec::with_capacity(n);
    let mut gone = Vec::with_capacity(n);
    for record in records {
        let (to, due) = match record.next {
            Next::Delivered => (DeliveryState::Delivered, record.attempt.at_ms),
            Next::Retry { due_ms } => (DeliveryState::Pending, due_ms),
            Next::DeadLetter | Next::Gone => (DeliveryState::Dead, record.attempt.at_ms),
        };
        delivery.push(record.claim.delivery_id);
        state.push(to.code() as i16);
        due_ms.push(due);
        finished_ms.push((to != DeliveryState::Pending).then_some(record.attempt.at_ms));
        at_ms.push(record.attempt.at_ms);
        outcome.push(record.attempt.outcome.as_str());
        status_code.push(record.attempt.status_code.map(i32::from));
        latency_ms.push(record.attempt.latency_ms.min(i64::MAX as u64) as i64);
        message.push(record.attempt.message.as_str());
        ok.push(record.next == Next::Delivered);
        dead.push(record.next.is_dead());
        attempt.push(record.claim.attempt.min(i32::MAX as u32) as i32);
        shard.push(record.claim.fence.map(|f| shard_number(f.shard)));
        epoch.push(record.claim.fence.map(|f| f.epoch));
        stale_message.push(superseded_message(&record.attempt.message));
        then_claim.push(record.then_claim);
        gone.push(record.next == Next::Gone);
    }
    let rows = query(RECORD)
        .bind(delivery)
        .bind(state)
        .bind(due_ms)
        .bind(finished_ms)
        .bind(at_ms)
        .bind(outcome)
        .bind(status_code)
        .bind(latency_ms)
        .bind(message)
        .bind(ok)
        .bind(dead)
        .bind(attempt)
        .bind(shard)
        .bind(epoch)
        .bind(stale_message)
        .bind(then_claim)
        .bind(gone)
        .fetch_all(executor)
        .await?;
    let mut answers: Vec<Option<Recorded>> = (0..n).map(|_| None).collect();
    for row in rows {
        let place = (row.try_get::<i64, _>(0)? - 1) as usize;
        let Some(record) = records.get(place) else {
            continue;
        };
        if !row.try_get::<bool, _>(1)? {
            continue;
        }
        let completion = Completion {
            recorded: row.try_get(2)?,
            consecutive_failures: row.try_get::<i32, _>(3)?.max(0) as u32,
            disabled_now: row.try_get(4)?,
            next_due_ms: row.try_get(5)?,
            letter_queued: false,
        };
        let following = match row.try_get::<Option<i64>, _>(6)? {
            None => None,
            Some(delivery_id) => Some(Claimed {
                delivery_id,
                subscription_uid: row.try_get(12)?,
                event_id: row.try_get(7)?,
                event_type: row.try_get(8)?,
                body: row.try_get(9)?,
                attempt: row.try_get::<i32, _>(10)?.max(0) as u32,
                window_start_ms: row.try_get(11)?,
                fence: record.claim.fence,
            }),
        };
        answers[place] = Some((completion, following));
    }
    Ok(answers)
}

/// Records one attempt (see [`write`]) on `executor`.
pub(super) async fn write_one<'e>(
    executor: impl Executor<'e, Database = sqlx_postgres::Postgres>,
    record: &Record,
) -> std::result::Result<Recorded, sqlx_core::Error> {
    write(executor, &[record])
        .await?
        .pop()
        .flatten()
        .ok_or_else(|| {
            sqlx_core::Error::Protocol("recording an attempt returned no answer for it".into())
        })
}
