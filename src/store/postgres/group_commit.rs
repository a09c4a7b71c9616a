//! Group commit for publishes on PostgreSQL.
//!
//! A publish is acknowledged only after a synchronous commit, and every publish NOTIFYs
//! the replicas. PostgreSQL runs the commits of notifying transactions one at a time (it
//! holds one lock for the whole database from the notify queue's write to the end of the
//! commit, its WAL flush included), so one transaction a publish caps a server at one
//! publish per flush, however many replicas or producers there are (measured: 1,698
//! events/s with one replica, fewer with three). Here concurrent publishes are joined: a
//! few committers each take whatever publishes are queued, write them in one transaction
//! with one NOTIFY, and answer each once that commit returns. A lone publish waits for
//! nothing: a committer that is free takes it at once. While a commit goes well the next
//! committer waits for it ([`super::writing`]), so what is queued meanwhile joins one batch.
//! A small batch of publishes under load waits up to 1 ms for more ([`GATHER_FOR`]).
//!
//! The NOTIFY stays inside the publish's transaction. Sending it after the commit, in a
//! transaction of its own committed without waiting for its flush, frees the lock at
//! once, but three replicas gained nothing from it (1,589 and 1,363 events/s against
//! 1,663 and 1,600, alternated runs of `cargo bench --bench scale_out`): their end to end
//! is bound by the cores, not by that lock. And a process stopped between the two would
//! lose the notice for work it had committed.
//!
//! One publish's failure never fails the others joined with it: a batch the server refuses
//! (or that waited too long for a row lock) is written again one publish at a time, each
//! in a task of its own. A server that cannot be reached fails the batch and everything
//! queued behind it at once, as fast as a lone publish would fail.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx_core::query::query;
use sqlx_core::query_scalar::query_scalar;
use sqlx_core::row::Row;
use sqlx_postgres::{PgConnection, PgPool};
use tokio::sync::{Mutex, mpsc, oneshot};

use super::stream::Stream;
use super::writing::{GATHER_UP_TO, OVERLAP_AFTER, Writing};
use super::{
    Claimed, Error, NewEvent, OP_TIMEOUT, PublishResult, Result, ShardFence, classify,
    first_answer, is_unavailable, shard_number,
};

/// Committers working at once. Their commits queue behind the notify lock in any case;
/// more than one lets a batch be written while the one before it is being flushed.
pub(super) const COMMITTERS: usize = 3;
/// How long a small batch (fewer than [`GATHER_UP_TO`]) waits for more at most, when the
/// rate publishes come at makes another likely within the wait ([`Stream`]). With three
/// replicas on one server a replica's commits carried 5.6 publishes against one replica's
/// 14; the wait made the server's CPU an event 10% less (219, 215, 213 → 194, 194, 194 µs
/// in three runs each way, the publish's answer 7.2–7.5 ms on average either way). A
/// publish after a quiet moment, or at a moderate pace, waits for nothing.
const GATHER_FOR: Duration = Duration::from_millis(1);
/// Publishes in one transaction at most, and their bodies' bytes.
const MAX_BATCH: usize = 256;
const MAX_BATCH_BYTES: usize = 8 << 20;
/// Publishes waiting for a committer; beyond it a publish waits to be queued (within its
/// deadline).
const QUEUE: usize = 4096;
/// How long a committer's transaction waits for a subscription row (set on the committers'
/// connections, so that a batch costs no statement to say so). Publishes wait for what
/// holds one `FOR UPDATE` (a pause, briefly; a removal, as long as it purges the backlog):
/// beyond this the batch is written again one publish at a time, each in a task of its
/// own, so that only the publish to that subscription waits, and no committer.
pub(super) const LOCK_TIMEOUT: &str = "250ms";
/// How long claims a publish may have committed unanswered are offered back (see
/// [`give_back`]).
const GIVE_BACK_FOR: std::time::Duration = std::time::Duration::from_secs(600);
/// A NOTIFY payload must stay under 8,000 bytes.
const PAYLOAD_BYTES: i64 = 7000;

/// A batch of publishes in one statement: per publish (`n`, its place in the batch) the live
/// targets (held FOR KEY SHARE, in one order for every batch, so that a removal waits for
/// this commit and then purges what it created), the event (nothing if the id exists: ON
/// CONFLICT waits for a concurrent publish of the same id to finish), and a delivery per
/// live target, made in the batch's order so that a lane's deliveries keep their
/// publishes' order. An event that matches nothing keeps its id (a repeat stays
/// idempotent) but not its body: nothing will ever send it. One row per publish written;
/// none for an id that existed. A batch never holds the same id twice (see [`write`]).
///
/// A delivery is made already claimed (in flight, its first attempt) where the publish
/// asked for its subscription's claim (`asked`: the engine started that lane with the
/// publish) and a claim at the publish's time would take it: the subscription is enabled
/// and unpaused, for a fenced claim its shard's owner row is at the claim's epoch (`owner`,
/// FOR SHARE, in shard order, after the subscription rows and before any delivery, as
/// every claim locks), nothing of the lane is due before it (in the statement's snapshot
/// and earlier in the batch), and the subscription does not keep strict order (whose claim
/// must also see every delivery committed meanwhile: those lanes claim as usual). That is
/// the claim without a statement of its own, and one row version fewer.
///
/// The NOTIFY goes with it (`payloads`, `noticed`): the subscriptions given a delivery this
/// batch did not claim, except those in a shard the publishing replica holds (`held`, its
/// owner row at that epoch, locked with the others until the commit: that replica wakes
/// the lane itself, and whoever takes the shard afterwards wakes all its lanes), each
/// named once, as few payloads of at most `$12` bytes as they
/// fit in, and per publish to more than one payload names (`wide`) its namespace and type
/// instead (`e:<namespace>:<type>`). A notice is delivered only once the work is
/// committed; a claimed lane's attempt is started by its publish, and a notice would only
/// send its holder to claim again after it. Computed from every delivery made, so after
/// every lock the statement takes: only then does it lift the lock timeout, since the
/// commit waits for PostgreSQL's notify lock (notifying commits go one at a time, each
/// with its flush) and that wait must not fail it.
///
/// The statement is its own transaction (no BEGIN, no COMMIT: one round trip), so its
/// answer comes with its commit. Should that answer be lost, what it claimed is kept under
/// the batch's key (`$13`, in `publish_claims`, see [`give_back_unanswered`]); keys of
/// batches answered since are deleted (`$14`).
pub(super) const PUBLISH: &str = "
    WITH input AS (
        SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::bigint[])
            WITH ORDINALITY AS i(namespace, event_id, event_type, body, published_ms, n)
    ), live AS MATERIALIZED (
        SELECT t.n, s.uid, s.strict_order, s.paused, s.disabled, s.shard
        FROM unnest($6::bigint[], $7::text[]) AS t(n, uid)
        JOIN input i ON i.n = t.n
        JOIN subscriptions s ON s.uid = t.uid AND s.live AND s.namespace = i.namespace
        ORDER BY s.uid
        FOR KEY SHARE OF s
    ), asked AS (
        SELECT * FROM unnest($8::bigint[], $9::text[], $10::integer[], $11::bigint[])
            AS a(n, uid, shard, epoch)
    ), held AS (
        SELECT * FROM unnest($15::integer[], $16::bigint[]) AS h(shard, epoch)
    ), owner AS MATERIALIZED (
        SELECT o.shard, o.epoch FROM shard_owners o
        WHERE (o.shard, o.epoch) IN (SELECT a.shard, a.epoch FROM asked a
                                     JOIN live l ON l.n = a.n AND l.uid = a.uid
                                     WHERE a.epoch IS NOT NULL
                                     UNION ALL
                                     SELECT h.shard, h.epoch FROM held h
                                     WHERE h.shard IN (SELECT shard FROM live))
        ORDER BY o.shard
        FOR SHARE
    ), claiming AS MATERIALIZED (
        SELECT l.n, l.uid
        FROM live l
        JOIN asked a ON a.n = l.n AND a.uid = l.uid
        JOIN input i ON i.n = l.n
        WHERE NOT l.paused AND NOT l.disabled AND NOT l.strict_order
          AND (a.epoch IS NULL
               OR l.shard = a.shard
                  AND EXISTS (SELECT 1 FROM owner o
                              WHERE o.shard = a.shard AND o.epoch = a.epoch))
          AND NOT EXISTS (SELECT 1 FROM live e WHERE e.uid = l.uid AND e.n < l.n)
          AND NOT EXISTS (SELECT 1 FROM deliveries d
                          WHERE d.sub_uid = l.uid AND d.state = 0
                            AND d.due_ms <= i.published_ms)
    ), ev AS (
        INSERT INTO events (namespace, event_id, event_type, body, published_ms, matched)
        SELECT i.namespace, i.event_id, i.event_type,
               CASE WHEN m.c IS NULL THEN ''::bytea ELSE i.body END, i.published_ms,
               coalesce(m.c, 0)
        FROM input i LEFT JOIN (SELECT n, count(*) AS c FROM live GROUP BY n) m ON m.n = i.n
        ORDER BY i.n
        ON CONFLICT (namespace, event_id) DO NOTHING
        RETURNING id, namespace, event_id
    ), written AS (
        SELECT i.n, ev.id, i.published_ms
        FROM ev JOIN input i ON i.namespace = ev.namespace AND i.event_id = ev.event_id
    ), made AS (
        INSERT INTO deliveries (event, sub_uid, state, attempts, due_ms, window_start_ms, strict)
        SELECT w.id, live.uid, CASE WHEN c.uid IS NULL THEN 0 ELSE 1 END,
               CASE WHEN c.uid IS NULL THEN 0 ELSE 1 END,
               w.published_ms, w.published_ms, live.strict_order
        FROM written w JOIN live ON live.n = w.n
        LEFT JOIN claiming c ON c.n = live.n AND c.uid = live.uid
        ORDER BY w.n, live.uid
        RETURNING id, event, sub_uid, state
    ), unclaimed AS MATERIALIZED (
        SELECT w.n, m.sub_uid
        FROM written w JOIN made m ON m.event = w.id
        JOIN live l ON l.n = w.n AND l.uid = m.sub_uid
        WHERE m.state = 0
          AND NOT EXISTS (SELECT 1 FROM owner o JOIN held h USING (shard, epoch)
                          WHERE o.shard = l.shard)
    ), wide AS MATERIALIZED (
        SELECT n FROM unclaimed GROUP BY n HAVING sum(octet_length(sub_uid) + 1) > $12
    ), payloads AS (
        SELECT DISTINCT 'e:' || i.namespace || ':' || i.event_type AS p
        FROM wide JOIN input i ON i.n = wide.n
        UNION ALL
        SELECT string_agg(uid, ',' ORDER BY uid)
        FROM (SELECT uid, (sum(octet_length(uid) + 1) OVER (ORDER BY uid) - 1) / $12 AS part
              FROM (SELECT DISTINCT sub_uid AS uid FROM unclaimed
                    WHERE n NOT IN (SELECT n FROM wide)) named) parted
        GROUP BY part
    ), noticed AS MATERIALIZED (
        SELECT set_config('lock_timeout', '0', true) AS no_timeout
        FROM (SELECT count(pg_notify('herald_new_work', p)) FROM payloads) sent
    ), kept AS (
        INSERT INTO publish_claims (batch, at_ms, deliveries)
        SELECT $13, (SELECT min(published_ms) FROM input), array_agg(id)
        FROM made WHERE state = 1
        HAVING count(*) > 0
    ), forgotten AS (
        DELETE FROM publish_claims WHERE batch = ANY($14::bigint[])
    )
    SELECT w.n,
           coalesce(array_agg(m.sub_uid) FILTER (WHERE m.sub_uid IS NOT NULL),
                    ARRAY[]::text[]),
           coalesce(array_agg(m.sub_uid) FILTER (WHERE m.state = 1), ARRAY[]::text[]),
           coalesce(array_agg(m.id) FILTER (WHERE m.state = 1), ARRAY[]::bigint[]),
           -- Its NOTIFY sent, once, after every lock taken.
           (SELECT count(*) FROM noticed)
    FROM written w LEFT JOIN made m ON m.event = w.id
    GROUP BY w.n";

struct Queued {
    event: NewEvent,
    /// Each target once, in the caller's order.
    targets: Vec<String>,
    /// The subscriptions whose claim the publish asks for, each with its fence.
    claims: Vec<(String, Option<ShardFence>)>,
    /// The shards the publishing replica holds, whose lanes it wakes itself: no notice.
    held: Vec<ShardFence>,
    answer: oneshot::Sender<Result<Published>>,
    /// When it was asked for.
    asked: Instant,
}

/// A publish's answer and the deliveries it claimed.
pub(super) type Published = (PublishResult, Vec<Claimed>);

/// The publish queue; the committers stop once it is dropped.
pub(super) struct GroupCommit {
    queue: mpsc::Sender<Queued>,
    #[cfg(test)]
    writing: Arc<Writing>,
    /// Publishes handed to the committers so far.
    #[cfg(test)]
    sent: std::sync::atomic::AtomicUsize,
    #[cfg(test)]
    stream: Arc<Stream>,
}

impl GroupCommit {
    /// Starts the committers, writing batches through `batches` (whose connections wait
    /// [`LOCK_TIMEOUT`] for a row lock at most) and publishes on their own through `alone`;
    /// both commit synchronously.
    pub(super) fn start(batches: PgPool, alone: PgPool) -> Self {
        let (queue, queued) = mpsc::channel(QUEUE);
        let queued = Arc::new(Mutex::new(queued));
        let writing = Arc::new(Writing::default());
        let answered = Arc::new(Answered::default());
        let stream = Arc::new(Stream::new(GATHER_FOR));
        for _ in 0..COMMITTERS {
            tokio::spawn(committer(
                batches.clone(),
                alone.clone(),
                queued.clone(),
                writing.clone(),
                answered.clone(),
                stream.clone(),
            ));
        }
        Self {
            queue,
            #[cfg(test)]
            writing,
            #[cfg(test)]
            sent: Default::default(),
            #[cfg(test)]
            stream,
        }
    }

    /// When publishes last came, which tells the committers whether to wait briefly to fill
    /// a small batch (here for a test to set how long).
    #[cfg(test)]
    pub(super) fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Publishes handed to the committers so far.
    #[cfg(test)]
    pub(super) fn sent(&self) -> usize {
        self.sent.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Publishes waiting for a committer.
    #[cfg(test)]
    pub(super) fn queued(&self) -> usize {
        self.queue.max_capacity() - self.queue.capacity()
    }

    /// Commits being written (a committer's, from its batch taken to its answers).
    #[cfg(test)]
    pub(super) fn writing(&self) -> usize {
        self.writing.statements()
    }

    /// Publishes `event` to `targets` (each once) in the next group commit, claiming with it
    /// what `claims` asks for (see [`PUBLISH`]), answering once it is on disk.
    pub(super) async fn publish(
        &self,
        event: NewEvent,
        targets: Vec<String>,
        claims: Vec<(String, Option<ShardFence>)>,
        held: Vec<ShardFence>,
    ) -> Result<Published> {
        let (answer, answered) = oneshot::channel();
        let queued = Queued {
            event,
            targets,
            claims,
            held,
            answer,
            asked: Instant::now(),
        };
        let waited = tokio::time::timeout(OP_TIMEOUT, async {
            self.queue
                .send(queued)
                .await
                .map_err(|_| Error::Unavailable("the PostgreSQL store is closed".into()))?;
            #[cfg(test)]
            self.sent.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            answered.await.map_err(|_| {
                Error::Backend("the publish's commit stopped before it answered".into())
            })?
        })
        .await;
        waited.unwrap_or_else(|_| {
            Err(Error::Unavailable(format!(
                "PostgreSQL did not commit the publish within {}s",
                OP_TIMEOUT.as_secs()
            )))
        })
    }
}

async fn committer(
    batches: PgPool,
    alone: PgPool,
    queued: Arc<Mutex<mpsc::Receiver<Queued>>>,
    writing: Arc<Writing>,
    answered: Arc<Answered>,
    stream: Arc<Stream>,
) {
    loop {
        let batch = {
            let mut queued = queued.lock().await;
            let Some(first) = queued.recv().await else {
                return;
            };
            // Holding the queue, so that what comes meanwhile joins this batch.
            writing.wait_for_none(OVERLAP_AFTER).await;
            let mut bytes = first.event.body.len();
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH && bytes < MAX_BATCH_BYTES {
                match queued.try_recv() {
                    Ok(next) => {
                        bytes += next.event.body.len();
                        batch.push(next);
                    }
                    Err(_) => break,
                }
            }
            if stream.more_expected(Instant::now(), batch.len()) {
                let deadline = tokio::time::Instant::now() + stream.gather_for();
                while batch.len() < GATHER_UP_TO && bytes < MAX_BATCH_BYTES {
                    match tokio::time::timeout_at(deadline, queued.recv()).await {
                        Ok(Some(next)) => {
                            bytes += next.event.body.len();
                            batch.push(next);
                        }
                        _ => break,
                    }
                }
            }
            stream.took(batch[batch.len() - 1].asked, batch.len());
            batch
        };
        let _writing = writing.start();
        commit_and_answer(&batches, &alone, batch, &queued, &answered).await;
    }
}

/// Writes `batch` through `batches` and answers each of its publishes (and, when the server
/// cannot be reached, every publish still `queued`); what must go on its own goes through
/// `pool`, which waits for row locks as long as it takes.
async fn commit_and_answer(
    batches: &PgPool,
    pool: &PgPool,
    batch: Vec<Queued>,
    queued: &Mutex<mpsc::Receiver<Queued>>,
    answered: &Arc<Answered>,
) {
    let items: Vec<&Queued> = batch.iter().collect();
    let deadline = tokio::time::Instant::now() + OP_TIMEOUT;
    let written = write_or_give_back(batches, pool, &items, deadline, answered).await;
    match written {
        Ok(Ok(answers)) => {
            for (item, answer) in batch.into_iter().zip(answers) {
                match answer {
                    Some(result) => answer_or_give_back(pool, item.answer, result),
                    // Its answer may mean writing it again: on its own, as below.
                    None => {
                        tokio::spawn(alone(pool.clone(), item, answered.clone()));
                    }
                }
            }
        }
        // A subscription row held longer than the committers wait (a removal purging its
        // backlog), or, in a batch, one publish the server refused: that must not hold up
        // or fail the others, nor the committer. Each again in a transaction of its own,
        // side by side, answered as soon as it commits.
        // The server cannot be reached (it took the pool its whole acquire timeout to say
        // so): the publishes queued meanwhile are told so too, at once, rather than each
        // waiting for a committer to find the same, one batch after another.
        Ok(Err(e)) if unreachable(&e) => {
            let message = match classify(e) {
                Error::Unavailable(m) | Error::Backend(m) => m,
            };
            let mut refused = batch;
            if let Ok(mut queued) = queued.try_lock() {
                while let Ok(next) = queued.try_recv() {
                    refused.push(next);
                }
            }
            for item in refused {
                let _ = item.answer.send(Err(Error::Unavailable(message.clone())));
            }
        }
        // A subscription row held longer than the committers wait (a removal purging its
        // backlog), or, in a batch, anything the server refused (a value, a deadlock): that
        // must not hold up or fail the others, nor the committer. Each again in a
        // transaction of its own, side by side, answered as soon as it commits.
        Ok(Err(e)) if waited_for_a_lock(&e) || batch.len() > 1 => {
            for item in batch {
                tokio::spawn(alone(pool.clone(), item, answered.clone()));
            }
        }
        // The server refused the one publish, or cannot take work now: it is told so.
        Ok(Err(e)) => {
            let error = classify(e);
            let unavailable = matches!(error, Error::Unavailable(_));
            let message = match error {
                Error::Unavailable(m) | Error::Backend(m) => m,
            };
            for item in batch {
                let _ = item.answer.send(Err(if unavailable {
                    Error::Unavailable(message.clone())
                } else {
                    Error::Backend(message.clone())
                }));
            }
        }
        Err(_) => {
            for item in batch {
                let _ = item.answer.send(Err(timed_out()));
            }
        }
    }
}

/// A publish of a batch: written, or to publish again on its own.
pub(super) enum Batched {
    Written(PublishResult),
    Again(NewEvent, Vec<String>),
}

/// Writes `publishes` (each target once) in one transaction of their own, as a group commit
/// writes its batch but waiting for row locks as a lone publish does: per publish its
/// result, or, where its id existed or came earlier in the batch (nothing was written for
/// it), the publish back, to be published again on its own, which answers it as a repeat.
pub(super) async fn publish_batch(
    pool: &PgPool,
    publishes: Vec<(NewEvent, Vec<String>)>,
) -> Result<Vec<Batched>> {
    let items: Vec<Queued> = publishes
        .into_iter()
        .map(|(event, targets)| Queued {
            event,
            targets,
            claims: Vec::new(),
            held: Vec::new(),
            // Answered by the return value instead.
            answer: oneshot::channel().0,
            asked: Instant::now(),
        })
        .collect();
    let refs: Vec<&Queued> = items.iter().collect();
    let deadline = tokio::time::Instant::now() + OP_TIMEOUT;
    // It claims nothing, so it keeps no key to forget.
    let answers = match write_or_give_back(pool, pool, &refs, deadline, &Answered::default()).await
    {
        Ok(Ok(answers)) => answers,
        Ok(Err(e)) => return Err(classify(e)),
        Err(_) => return Err(timed_out()),
    };
    Ok(items
        .into_iter()
        .zip(answers)
        .map(|(item, answer)| match answer {
            Some((result, _)) => Batched::Written(result),
            None => Batched::Again(item.event, item.targets),
        })
        .collect())
}

/// The server could not be reached, rather than answering with an error of its own.
fn unreachable(e: &sqlx_core::Error) -> bool {
    !matches!(e, sqlx_core::Error::Database(_)) && is_unavailable(e)
}

/// A lock wait that outlasted [`LOCK_TIMEOUT`].
fn waited_for_a_lock(e: &sqlx_core::Error) -> bool {
    matches!(e, sqlx_core::Error::Database(db) if db.code().as_deref() == Some("55P03"))
}

/// Writes one publish in a transaction of its own and answers it: for an id that existed,
/// with the first publish's answer (written again if that was pruned in between).
async fn alone(pool: PgPool, item: Queued, answered: Arc<Answered>) {
    let deadline = tokio::time::Instant::now() + OP_TIMEOUT;
    let answer = async {
        for _ in 0..3 {
            let written = write_or_give_back(&pool, &pool, &[&item], deadline, &answered).await;
            if let Some(result) = written.map_err(|_| Failed::Timeout)??.remove(0) {
                return Ok(result);
            }
            let event = &item.event;
            // A repeat claims nothing: its deliveries were made by the first publish.
            let first = first_answer(&pool, &event.namespace, &event.event_id);
            if let Some(first) = tokio::time::timeout_at(deadline, first)
                .await
                .map_err(|_| Failed::Timeout)??
            {
                return Ok((first, Vec::new()));
            }
        }
        Err(sqlx_core::Error::Protocol(
            "publish: the event id conflicted with an event that then vanished".into(),
        )
        .into())
    }
    .await;
    match answer {
        Ok(result) => answer_or_give_back(&pool, item.answer, result),
        Err(e) => {
            let _ = item.answer.send(Err(match e {
                Failed::Timeout => timed_out(),
                Failed::Server(e) => classify(e),
            }));
        }
    }
}

/// Why [`alone`] gave up.
enum Failed {
    Timeout,
    Server(sqlx_core::Error),
}

impl From<sqlx_core::Error> for Failed {
    fn from(e: sqlx_core::Error) -> Self {
        Failed::Server(e)
    }
}

/// Answers a publish; when its publisher is gone (it gave up waiting), what the publish
/// claimed has nobody to send it and is given back. The publish itself stays written.
fn answer_or_give_back(
    pool: &PgPool,
    answer: oneshot::Sender<Result<Published>>,
    result: Published,
) {
    if let Err(Ok((_, claimed))) = answer.send(Ok(result))
        && !claimed.is_empty()
    {
        let ids = claimed.iter().map(|c| c.delivery_id).collect();
        tokio::spawn(give_back(pool.clone(), ids));
    }
}

/// [`write`] through `pool` by `deadline`. When it fails or runs out of time unanswered
/// after asking for claims, its statement may still have committed (the connection broke
/// with the answer on its way, or the statement arrives late): nobody would send what it
/// claimed, so that is given back, through `back` (see [`give_back_unanswered`]).
async fn write_or_give_back(
    pool: &PgPool,
    back: &PgPool,
    items: &[&Queued],
    deadline: tokio::time::Instant,
    answered: &Answered,
) -> std::result::Result<
    std::result::Result<Vec<Option<Published>>, sqlx_core::Error>,
    tokio::time::error::Elapsed,
> {
    let batch = rand::random::<i64>();
    let forget = answered.take();
    // Without a connection nothing was sent: there is nothing to give back.
    let mut sent = false;
    let written = tokio::time::timeout_at(deadline, async {
        let mut conn = pool.acquire().await?;
        sent = true;
        write(&mut conn, items, batch, &forget).await
    })
    .await;
    match &written {
        Ok(Ok(answers)) => {
            if answers
                .iter()
                .flatten()
                .any(|(_, claimed)| !claimed.is_empty())
            {
                answered.add(batch);
            }
        }
        // Even an error from the server may have come after the commit (the connection
        // ended by a shutdown then): failures are rare, and the give-back settles it.
        _ => {
            answered.put_back(forget);
            if sent && items.iter().any(|i| !i.claims.is_empty()) {
                tokio::spawn(give_back_unanswered(back.clone(), batch));
            }
        }
    }
    written
}

/// Keys of batches whose claims came back with their answer: the next statement deletes
/// their rows of `publish_claims` (nothing else needs them), so the table holds a few rows.
#[derive(Default)]
pub(super) struct Answered(std::sync::Mutex<Vec<i64>>);

/// Keys a statement deletes at most.
const FORGET: usize = 512;

impl Answered {
    fn add(&self, batch: i64) {
        let mut keys = self.0.lock().unwrap_or_else(|e| e.into_inner());
        // Beyond this, rows are left to the history's pruning.
        if keys.len() < 4 * FORGET {
            keys.push(batch);
        }
    }

    fn take(&self) -> Vec<i64> {
        let mut keys = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let from = keys.len().saturating_sub(FORGET);
        keys.split_off(from)
    }

    /// Keys a statement took and may not have deleted (deleting one twice does nothing).
    fn put_back(&self, forget: Vec<i64>) {
        let mut keys = self.0.lock().unwrap_or_else(|e| e.into_inner());
        keys.extend(forget);
    }
}

/// A batch's statement went unanswered: whether it committed is found through its key.
/// Writing the key first (an insert waits for a statement still writing it) settles it:
/// written here, the statement never committed and now never will with a claim (it would
/// fail on the key); already there, it committed, and its row names what it claimed, which
/// is given back as after a publisher gone ([`give_back`]).
pub(super) async fn give_back_unanswered(pool: PgPool, batch: i64) {
    retrying("giving back what an unanswered publish claimed", || async {
        let settled: Option<i64> = query_scalar(
            "INSERT INTO publish_claims (batch, at_ms, deliveries)
             VALUES ($1, (extract(epoch FROM clock_timestamp()) * 1000)::bigint, '{}')
             ON CONFLICT (batch) DO NOTHING
             RETURNING batch",
        )
        .bind(batch)
        .fetch_optional(&pool)
        .await?;
        if settled.is_some() {
            return Ok(());
        }
        // A statement of its own: it must see a row committed while the insert waited.
        let claimed: Option<Vec<i64>> =
            query_scalar("SELECT deliveries FROM publish_claims WHERE batch = $1")
                .bind(batch)
                .fetch_optional(&pool)
                .await?;
        put_back(&pool, &claimed.unwrap_or_default()).await
    })
    .await
}

/// Makes deliveries a publish claimed and nobody will send (its publisher gave up waiting)
/// due again, while they are still in flight under that claim (their first attempt: a
/// take-over since made them due, and another claim counted a second), and wakes their
/// lanes' holder.
pub(super) async fn give_back(pool: PgPool, ids: Vec<i64>) {
    retrying("giving back what an unanswered publish claimed", || {
        put_back(&pool, &ids)
    })
    .await
}

async fn put_back(pool: &PgPool, ids: &[i64]) -> std::result::Result<(), sqlx_core::Error> {
    query(
        "WITH back AS (
             UPDATE deliveries SET state = 0, attempts = attempts - 1
             WHERE id = ANY($1) AND state = 1 AND attempts = 1
             RETURNING sub_uid
         )
         SELECT count(pg_notify('herald_new_work', uid))
         FROM (SELECT DISTINCT sub_uid AS uid FROM back) b",
    )
    .bind(ids)
    .execute(pool)
    .await
    .map(|_| ())
}

/// Runs `step` until it succeeds, each time within [`OP_TIMEOUT`], while the server cannot
/// be reached or a statement it waits for is still writing, for up to [`GIVE_BACK_FOR`];
/// after that the deliveries are due again at the next take-over of their shard.
async fn retrying<F, Fut>(what: &str, step: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = std::result::Result<(), sqlx_core::Error>>,
{
    let started = tokio::time::Instant::now();
    let mut backoff = std::time::Duration::from_millis(100);
    loop {
        match tokio::time::timeout(OP_TIMEOUT, step()).await {
            Ok(Ok(())) => return,
            Ok(Err(e)) => tracing::warn!(error = %classify(e), "{what} failed; retrying"),
            Err(_) => tracing::warn!("{what} timed out; retrying"),
        }
        if started.elapsed() >= GIVE_BACK_FOR {
            tracing::error!(
                "{what}: gave up; those deliveries are due again when their shard is next taken"
            );
            return;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(std::time::Duration::from_secs(5));
    }
}

fn timed_out() -> Error {
    Error::Unavailable(format!(
        "PostgreSQL did not commit the publish within {}s",
        OP_TIMEOUT.as_secs()
    ))
}

/// One statement for `items`, its own transaction, with its NOTIFY (see [`PUBLISH`]): per
/// item its result, or `None` where the event id existed (nothing was written for it) or
/// came earlier in `items` (the caller writes it again on its own, which answers it as a
/// repeat). What it claims is kept under `batch_key`; the rows of batches `forget` are
/// deleted.
async fn write(
    conn: &mut PgConnection,
    items: &[&Queued],
    batch_key: i64,
    forget: &[i64],
) -> std::result::Result<Vec<Option<Published>>, sqlx_core::Error> {
    // One statement cannot both insert an id and see that insert conflict: a repeat
    // within the batch is left out of it.
    let mut seen = std::collections::HashSet::new();
    let first: Vec<bool> = items
        .iter()
        .map(|i| seen.insert((i.event.namespace.as_str(), i.event.event_id.as_str())))
        .collect();
    let batch: Vec<&Queued> = items
        .iter()
        .zip(&first)
        .filter(|(_, first)| **first)
        .map(|(i, _)| *i)
        .collect();
    let (mut target_of, mut target_uid) = (Vec::new(), Vec::new());
    let (mut asked_of, mut asked_uid, mut asked_shard, mut asked_epoch) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // One replica's publishes: the shards it holds, as each publish saw them.
    let held: BTreeSet<(i32, i64)> = batch
        .iter()
        .flat_map(|item| &item.held)
        .map(|f| (shard_number(f.shard), f.epoch))
        .collect();
    let (held_shard, held_epoch): (Vec<i32>, Vec<i64>) = held.into_iter().unzip();
    for (n, item) in batch.iter().enumerate() {
        for uid in &item.targets {
            target_of.push(n as i64 + 1);
            target_uid.push(uid.as_str());
        }
        for (uid, fence) in &item.claims {
            asked_of.push(n as i64 + 1);
            asked_uid.push(uid.as_str());
            asked_shard.push(fence.map(|f| shard_number(f.shard)));
            asked_epoch.push(fence.map(|f| f.epoch));
        }
    }
    let rows = query(PUBLISH)
        .bind(column(&batch, |e| e.namespace.as_str()))
        .bind(column(&batch, |e| e.event_id.as_str()))
        .bind(column(&batch, |e| e.event_type.as_str()))
        .bind(column(&batch, |e| e.body.as_slice()))
        .bind(column(&batch, |e| e.published_ms))
        .bind(target_of)
        .bind(target_uid)
        .bind(asked_of)
        .bind(asked_uid)
        .bind(asked_shard)
        .bind(asked_epoch)
        .bind(PAYLOAD_BYTES)
        .bind(batch_key)
        .bind(forget)
        .bind(held_shard)
        .bind(held_epoch)
        .fetch_all(conn)
        .await?;
    // Per publish written: its deliveries' subscriptions, and those made claimed with
    // their ids.
    type Made = (Vec<String>, Vec<String>, Vec<i64>);
    let mut made: Vec<Option<Made>> = vec![None; batch.len()];
    for row in rows {
        let n: i64 = row.try_get(0)?;
        if let Some(slot) = usize::try_from(n - 1).ok().and_then(|n| made.get_mut(n)) {
            *slot = Some((row.try_get(1)?, row.try_get(2)?, row.try_get(3)?));
        }
    }
    let mut written = made.into_iter().zip(&batch).map(|(made, item)| {
        let (made, claimed_uids, claimed_ids) = made?;
        let event = &item.event;
        let made: BTreeSet<&str> = made.iter().map(String::as_str).collect();
        let live: Vec<String> = item
            .targets
            .iter()
            .filter(|t| made.contains(t.as_str()))
            .cloned()
            .collect();
        let claimed = claimed_uids
            .into_iter()
            .zip(claimed_ids)
            .map(|(uid, delivery_id)| Claimed {
                delivery_id,
                fence: item
                    .claims
                    .iter()
                    .find(|(asked, _)| *asked == uid)
                    .and_then(|(_, fence)| *fence),
                subscription_uid: uid,
                event_id: event.event_id.clone(),
                event_type: event.event_type.clone(),
                body: event.body.clone(),
                attempt: 1,
                window_start_ms: event.published_ms,
            })
            .collect();
        let result = PublishResult {
            event_id: event.event_id.clone(),
            matched: live.len() as u32,
            duplicate: false,
            targets: live,
        };
        Some((result, claimed))
    });
    let answers: Vec<Option<Published>> = first
        .iter()
        .map(|first| {
            if *first {
                written.next().flatten()
            } else {
                None
            }
        })
        .collect();
    drop(written);
    Ok(answers)
}

/// Writes one publish as a batch keyed `batch` would, claiming what `claims` asks for: a
/// batch whose answer a test throws away, or that arrives after its give-back.
#[cfg(test)]
pub(super) async fn write_keyed(
    pool: &PgPool,
    event: NewEvent,
    targets: Vec<String>,
    claims: Vec<(String, Option<ShardFence>)>,
    batch: i64,
) -> std::result::Result<Option<Published>, sqlx_core::Error> {
    let item = Queued {
        event,
        targets,
        claims,
        held: Vec::new(),
        answer: oneshot::channel().0,
        asked: Instant::now(),
    };
    let mut conn = pool.acquire().await?;
    Ok(write(&mut conn, &[&item], batch, &[]).await?.remove(0))
}

/// One field of every event in `batch`, as an array to bind.
fn column<'a, T>(batch: &[&'a Queued], field: impl Fn(&'a NewEvent) -> T) -> Vec<T> {
    batch.iter().map(|i| field(&i.event)).collect()
}
