//! The PostgreSQL store, for several replicas sharing one database (`--store
//! postgres://…`). Same tables and the same semantics as the embedded store
//! ([`super::sqlite`]); the shared suite ([`super::suite`]) runs against both.
//!
//! **Transactions and locks.** Most operations are one statement (a data-modifying `WITH`
//! query), so each is one round trip and its own transaction; concurrent publishes are
//! joined into one transaction, a group commit ([`group_commit`]), concurrent attempt
//! records of different subscriptions into one statement ([`completions`]), and so are
//! concurrent claims of different lanes ([`claims`]). The server runs
//! them in READ COMMITTED; what makes them safe together is a fixed lock order: first the
//! subscription rows (in uid order when a statement takes several), then the shards' owner
//! rows, then delivery rows.
//!
//! - The B1 fence. [`Store::claim_next`] locks the subscription row `FOR KEY SHARE` while
//!   it is live, enabled and unpaused, and only then, in the same statement, picks and marks
//!   the next due delivery (`FOR UPDATE SKIP LOCKED`, so two claimers, on one replica or
//!   several, never get the same delivery). [`Store::remove_subscription`] locks the row
//!   `FOR UPDATE` (which waits for every claim holding it and makes every later claim wait
//!   for the commit, then see the tombstone), tombstones it and then, in the same
//!   transaction, deletes the unfinished deliveries, so it also purges what a claim just
//!   before it marked in flight. Publish and replay hold the row `FOR KEY SHARE` too, so no
//!   delivery for a removed subscription is created or revived after its purge. Pausing,
//!   enabling and disabling lock the row `FOR UPDATE` in the same way.
//! - Why `FOR KEY SHARE` and not `FOR SHARE`: a completion updates the row's counters (a
//!   `FOR NO KEY UPDATE` lock), which `FOR SHARE` would make wait for every publish holding
//!   the row until its commit is flushed to disk. Only the fences above need to exclude
//!   publishes and claims, and they take the one lock that does.
//! - The shard fence ([`Store::claim_fenced`]): the claim also holds the shard's
//!   `shard_owners` row `FOR SHARE` while it carries the claimer's lease epoch, before it
//!   locks a delivery. [`Store::take_shard`] raises the epoch (an update: it waits for those
//!   claims, and every later one sees the new epoch) and then, in the same transaction,
//!   makes the shard's attempts in flight due again, including what a claim just before it
//!   took: once it returns, the old holder claims nothing in that shard.
//! - A publish may claim too ([`Store::publish_and_claim`], for the lanes the engine starts
//!   with it): it writes those deliveries already in flight, under the same locks in the
//!   same order (the subscription rows, then the owner rows at the claim's epoch), so a
//!   removal or a take-over treats them as any claim's.
//! - [`Store::complete`] locks the subscription row (`FOR NO KEY UPDATE`, to count) before
//!   the delivery row, in the order everything else does, so a completion and a removal
//!   never deadlock.
//!
//! **Durability**, as in the embedded store: commits that acknowledge an event or change a
//! subscription (publish, replay, upsert, remove, enable/disable, the readiness write) run
//! on connections with `synchronous_commit` on (herald turns it on if the server's default
//! is off), so an answer means the commit is on disk. Claims, attempt results and pruning
//! run on a second pool with `synchronous_commit = off`: the server may lose the last of
//! them in a crash, which at worst repeats an attempt; it never reorders them, so a synced
//! commit also makes every earlier one durable. Reads run on a third, smaller pool, so
//! that no flood of them takes a connection those need.
//!
//! **Outages.** Every failure to reach the server, and every server error that says it
//! cannot take work now (shutting down, out of disk or connections, a read-only standby,
//! a deadlock or serialization failure), is [`Error::Unavailable`]; each operation gives up
//! after a deadline instead of hanging on a server that does not answer. The pools drop
//! broken connections and open new ones by themselves once the server is back.
//!
//! **Migrations** are embedded ([`MIGRATIONS`]) and applied at connect under sqlx's
//! migration lock (`pg_advisory_lock`, taken before the migrations table is even created),
//! on a connection of their own that is closed afterwards, so replicas starting at once
//! apply each migration exactly once and a failed run never leaves the lock held.

use std::borrow::Cow;
use std::collections::HashSet;
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use futures::future::BoxFuture;
use sqlx_core::connection::{ConnectOptions, Connection};
use sqlx_core::error::BoxDynError;
use sqlx_core::executor::Executor;
use sqlx_core::migrate::{Migration, MigrationSource, MigrationType, Migrator};
use sqlx_core::query::query;
use sqlx_core::query_scalar::query_scalar;
use sqlx_core::row::Row;
use sqlx_postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions, PgRow};

use super::*;

mod claims;
mod completions;
mod group_commit;
mod on_wire;
mod stream;
mod writing;

/// The schema, one migration a file: (version, description, SQL). Never edit one that has
/// been released; add the next.
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "schema", include_str!("postgres/0001_schema.sql")),
    (2, "shards", include_str!("postgres/0002_shards.sql")),
    (
        3,
        "gone and order",
        include_str!("postgres/0003_gone_and_order.sql"),
    ),
    (
        4,
        "publish claims",
        include_str!("postgres/0004_publish_claims.sql"),
    ),
    (
        5,
        "no event index",
        include_str!("postgres/0005_no_event_index.sql"),
    ),
];

/// Connections per writing pool (two per process). With the committers', the recorders'
/// and the claimers' pools, the read pool and the listener, three replicas use at most
/// 3 × (2 × 9 + 3 + 3 + 2 + 4 + 1) = 93 of PostgreSQL's default 100.
const POOL_SIZE: u32 = 9;
/// Connections of the read pool.
const READ_POOL_SIZE: u32 = 4;
/// How long an operation waits for a free connection (or for the server to accept one)
/// before it is answered `Unavailable`.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one operation may take in all, so that a server that stopped answering (a
/// network partition, a frozen process) makes herald unready instead of stuck.
const OP_TIMEOUT: Duration = Duration::from_secs(30);
/// The same for operations that may touch very many rows (a purge, pruning, recovery).
const BULK_TIMEOUT: Duration = Duration::from_secs(600);
/// The readiness probe's write.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(5);

pub struct PostgresStore {
    /// `synchronous_commit` on: for whatever acknowledges an event or changes a subscription.
    synced: PgPool,
    /// `synchronous_commit = off`: claims, attempt results, pruning.
    relaxed: PgPool,
    /// Reads (a subscription's state and backlog, attempt history, listings), in a pool of
    /// their own ([`READ_POOL_SIZE`]): however many a tenant asks for, they never take a
    /// connection a publish, claim or completion needs.
    reads: PgPool,
    /// One connection, for LISTEN (see [`Store::new_work`]).
    listen: PgPool,
    /// Publishes, joined into group commits on `committers` (connections as `synced`'s,
    /// whose transactions wait for no row lock long).
    publishes: group_commit::GroupCommit,
    committers: PgPool,
    /// Attempt records, joined into statements of many on `recorders` (connections as
    /// `relaxed`'s, whose statements wait for no row lock long).
    completions: completions::Completions,
    recorders: PgPool,
    /// Claims of lanes, joined into statements of many on `claimers` (connections as
    /// `relaxed`'s, whose statements wait for no row lock long).
    claims: claims::Claims,
    claimers: PgPool,
    /// The attempts handed to lanes and not yet recorded, which the recorders wait for
    /// briefly to fill a small batch.
    on_wire: std::sync::Arc<on_wire::OnWire>,
    /// When the claims last came, which tells the claimers whether to wait briefly to fill
    /// a small batch (here for a test to set how long).
    #[cfg(test)]
    claim_stream: std::sync::Arc<stream::Stream>,
}

/// The migrations, for sqlx's migrator.
#[derive(Debug)]
struct Embedded;

impl MigrationSource<'static> for Embedded {
    fn resolve(self) -> BoxFuture<'static, Result<Vec<Migration>, BoxDynError>> {
        Box::pin(async {
            Ok(MIGRATIONS
                .iter()
                .map(|&(version, description, sql)| {
                    Migration::new(
                        version,
                        Cow::Borrowed(description),
                        MigrationType::Simple,
                        Cow::Borrowed(sql),
                        false,
                    )
                })
                .collect())
        })
    }
}

/// SQLSTATE codes that mean "not now" rather than "wrong": the caller may try again.
fn transient_code(code: &str) -> bool {
    code.starts_with("08") // connection exception
        || code.starts_with("53") // insufficient resources: disk full, out of memory, too many connections
        || code.starts_with("57P") // admin or crash shutdown, cannot connect now
        || code.starts_with("58") // system error (I/O)
        || code == "57014" // query canceled (statement_timeout)
        || code == "25006" // read-only transaction: a standby (during a failover)
        || code == "40001" // serialization failure
        || code == "40P01" // deadlock detected
        || code == "55P03" // lock not available
}

/// Whether `e` means the server cannot take work now (rather than that the work is wrong).
fn is_unavailable(e: &sqlx_core::Error) -> bool {
    use sqlx_core::Error as E;
    match e {
        E::Io(_)
        | E::Tls(_)
        | E::Protocol(_)
        | E::PoolTimedOut
        | E::PoolClosed
        | E::WorkerCrashed => true,
        E::Database(db) => db.code().is_some_and(|c| transient_code(&c)),
        _ => false,
    }
}

fn classify(e: sqlx_core::Error) -> Error {
    if is_unavailable(&e) {
        Error::Unavailable(format!("PostgreSQL: {e}"))
    } else {
        Error::Backend(format!("PostgreSQL: {e}"))
    }
}

/// Runs one operation with a deadline; every error becomes the store's.
async fn within<T>(
    deadline: Duration,
    work: impl std::future::Future<Output = Result<T, sqlx_core::Error>>,
) -> Result<T> {
    match tokio::time::timeout(deadline, work).await {
        Ok(result) => result.map_err(classify),
        Err(_) => Err(Error::Unavailable(format!(
            "PostgreSQL did not answer within {}s",
            deadline.as_secs()
        ))),
    }
}

/// The URL with its password (in the user part or a `password` parameter) replaced, for
/// logs and messages.
pub fn redact_url(url: &str) -> String {
    let Ok(mut parsed) = url::Url::parse(url) else {
        return "<a URL that does not parse>".into();
    };
    if parsed.password().is_some() {
        let _ = parsed.set_password(Some("REDACTED"));
    }
    if parsed.query().is_some() {
        let pairs: Vec<(String, String)> = parsed
            .query_pairs()
            .map(|(k, v)| {
                let v = if k == "password" {
                    "REDACTED".into()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        parsed.query_pairs_mut().clear().extend_pairs(pairs);
    }
    parsed.to_string()
}

fn count(row: &PgRow, index: usize) -> Result<u64, sqlx_core::Error> {
    Ok(row.try_get::<i64, _>(index)?.max(0) as u64)
}

fn attempt_row(row: &PgRow, from: usize) -> Result<AttemptRecord, sqlx_core::Error> {
    Ok(AttemptRecord {
        at_ms: row.try_get(from)?,
        outcome: row.try_get(from + 1)?,
        status_code: row
            .try_get::<Option<i32>, _>(from + 2)?
            .map(|c| c.clamp(0, u16::MAX.into()) as u16),
        latency_ms: row.try_get::<i64, _>(from + 3)?.max(0) as u64,
        message: row.try_get(from + 4)?,
    })
}

const STATE_OF: &str = "
    SELECT live, disabled, consecutive_failures, delivered, failed, dead_lettered,
           (SELECT count(*) FROM deliveries WHERE sub_uid = $1 AND state IN (0, 1)),
           (SELECT count(*) FROM deliveries WHERE sub_uid = $1 AND state = 3),
           gone
    FROM subscriptions WHERE uid = $1";

fn state_row(row: &PgRow) -> Result<SubscriptionState, sqlx_core::Error> {
    Ok(SubscriptionState {
        live: row.try_get(0)?,
        disabled: row.try_get(1)?,
        gone: row.try_get(8)?,
        consecutive_failures: row.try_get::<i32, _>(2)?.max(0) as u32,
        delivered: count(row, 3)?,
        failed: count(row, 4)?,
        dead_lettered: count(row, 5)?,
        pending: count(row, 6)?,
        dead: count(row, 7)?,
    })
}

impl PostgresStore {
    /// Connects to `url` (`postgres://user:password@host:port/database?sslmode=…`, as
    /// libpq takes it, with the `PG*` environment variables for what it leaves out) and
    /// applies the migrations the database lacks. Fails when the server cannot be reached
    /// now; afterwards the pools reconnect by themselves.
    pub async fn connect(url: &str) -> Result<Self> {
        let mut options = PgConnectOptions::from_str(url)
            .map_err(|e| Error::Backend(format!("the PostgreSQL URL: {e}")))?
            // Statements carry no values (those are bound), but every one of them at debug
            // level drowns herald's own logs.
            .log_statements(log::LevelFilter::Trace);
        if options.get_application_name().is_none() {
            options = options.application_name("herald");
        }

        let mut conn = within(OP_TIMEOUT, PgConnection::connect_with(&options)).await?;
        let migrator = Migrator::new(Embedded)
            .await
            .map_err(|e| Error::Backend(format!("loading the migrations: {e}")))?;
        let migrated = tokio::time::timeout(BULK_TIMEOUT, migrator.run_direct(&mut conn)).await;
        // Closing the session also releases the migration lock if the run failed midway.
        let _ = conn.close().await;
        match migrated {
            Ok(Ok(())) => {}
            Ok(Err(sqlx_core::migrate::MigrateError::Execute(e))) => return Err(classify(e)),
            Ok(Err(e)) => return Err(Error::Backend(format!("migrating the schema: {e}"))),
            Err(_) => {
                return Err(Error::Unavailable(
                    "migrating the schema took too long".into(),
                ));
            }
        }

        // The write path's statements look up rows by key whatever their values, so one
        // plan each serves every call: planned once per connection rather than at every
        // call (the default re-plans a statement until a generic plan is no dearer than a
        // custom one, and these CTEs never get there; planning was a sixth of the server's
        // CPU per event). Reads keep custom plans: their optional filters are planned away.
        let write_path = options
            .clone()
            .options([("plan_cache_mode", "force_generic_plan")]);
        let pool = || {
            PgPoolOptions::new()
                .max_connections(POOL_SIZE)
                .min_connections(0)
                .acquire_timeout(ACQUIRE_TIMEOUT)
                // sqlx tests each connection when it is given back (and drops a broken one);
                // testing it again before every use would double the round trips.
                .test_before_acquire(false)
        };
        // A server (or role) whose default is off must not make herald acknowledge what is
        // not on disk; `local`, `remote_write` and `remote_apply` are at least as strong
        // as `on`, and are kept.
        let synchronous = |options: PgPoolOptions| {
            options.after_connect(|conn, _| {
                Box::pin(async move {
                    let setting: String =
                        query_scalar("SELECT current_setting('synchronous_commit')")
                            .fetch_one(&mut *conn)
                            .await?;
                    if setting == "off" {
                        conn.execute("SET synchronous_commit = on").await?;
                    }
                    Ok(())
                })
            })
        };
        // The joined writers run only the publish, record and claim statements, which find
        // every row by key, and plan each when a connection first runs it: on a fresh
        // database, with the tables still empty, the planner would read whole tables rather
        // than their keys, and that plan would stay as the tables grew (until an analyze
        // happened to invalidate it; measured: a record twice as dear at 10,000
        // deliveries). With sequential scans off, every plan addresses rows by their
        // indexes, whatever the tables held when it was made.
        let joined = write_path.clone().options([("enable_seqscan", "off")]);
        let synced = synchronous(pool()).connect_lazy_with(write_path.clone());
        let committers = synchronous(pool().max_connections(group_commit::COMMITTERS as u32))
            .connect_lazy_with(
                joined
                    .clone()
                    .options([("lock_timeout", group_commit::LOCK_TIMEOUT)]),
            );
        let relaxed =
            pool().connect_lazy_with(write_path.clone().options([("synchronous_commit", "off")]));
        let recorders = pool()
            .max_connections(completions::RECORDERS as u32)
            .connect_lazy_with(joined.clone().options([
                ("synchronous_commit", "off"),
                ("lock_timeout", completions::LOCK_TIMEOUT),
            ]));
        let claimers = pool()
            .max_connections(claims::CLAIMERS as u32)
            .connect_lazy_with(joined.options([
                ("synchronous_commit", "off"),
                ("lock_timeout", claims::LOCK_TIMEOUT),
            ]));
        let reads = pool()
            .max_connections(READ_POOL_SIZE)
            .connect_lazy_with(options.clone().options([("synchronous_commit", "off")]));
        let listen = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_lazy_with(options);
        let on_wire = std::sync::Arc::new(on_wire::OnWire::default());
        let claim_stream = std::sync::Arc::new(stream::Stream::new(claims::GATHER_FOR));
        Ok(Self {
            publishes: group_commit::GroupCommit::start(committers.clone(), synced.clone()),
            committers,
            completions: completions::Completions::start(
                completions::RECORDERS,
                recorders.clone(),
                relaxed.clone(),
                writing::Gathering::AttemptsOnWire(on_wire.clone()),
            ),
            recorders,
            claims: claims::Claims::start(
                claims::CLAIMERS,
                claimers.clone(),
                relaxed.clone(),
                writing::Gathering::InStream(claim_stream.clone()),
            ),
            claimers,
            on_wire,
            #[cfg(test)]
            claim_stream,
            synced,
            relaxed,
            reads,
            listen,
        })
    }

    /// Closes the pools (their connections end at once).
    pub async fn close(&self) {
        self.synced.close().await;
        self.committers.close().await;
        self.relaxed.close().await;
        self.recorders.close().await;
        self.claimers.close().await;
        self.reads.close().await;
        self.listen.close().await;
    }
}

#[async_trait]
impl Store for PostgresStore {
    async fn upsert_subscription(&self, sub: SubscriptionRecord) -> Result<SubscriptionState> {
        within(OP_TIMEOUT, async {
            let mut tx = self.synced.begin().await?;
            // A pause (or a move to another shard) waits for the claims holding the row.
            // (HOLD_SUBSCRIPTION, reading the ordering it had.)
            let was_strict: Option<bool> =
                query_scalar("SELECT strict_order FROM subscriptions WHERE uid = $1 FOR UPDATE")
                    .bind(&sub.uid)
                    .fetch_optional(&mut *tx)
                    .await?;
            query(
                "INSERT INTO subscriptions
                     (uid, namespace, name, paused, disable_after, shard, strict_order)
                 VALUES ($1, $2, $3, $4, $5, $6, $7)
                 ON CONFLICT (uid) DO UPDATE SET paused = excluded.paused,
                     disable_after = excluded.disable_after, name = excluded.name,
                     shard = excluded.shard, strict_order = excluded.strict_order
                 WHERE subscriptions.live",
            )
            .bind(&sub.uid)
            .bind(&sub.namespace)
            .bind(&sub.name)
            .bind(sub.paused)
            .bind(sub.disable_after.min(i32::MAX as u32) as i32)
            .bind(shard_number(sub.shard))
            .bind(sub.strict_order)
            .execute(&mut *tx)
            .await?;
            // The ordering changed: the deliveries that may still be sent (waiting, in
            // flight, dead for a replay) follow it, so that strict claims find them.
            if was_strict.is_some_and(|was| was != sub.strict_order) {
                query(
                    "UPDATE deliveries SET strict = $2
                     WHERE sub_uid = $1 AND state IN (0, 1, 3) AND strict <> $2",
                )
                .bind(&sub.uid)
                .bind(sub.strict_order)
                .execute(&mut *tx)
                .await?;
            }
            tx.commit().await?;
            let row = query(STATE_OF)
                .bind(&sub.uid)
                .fetch_optional(&self.synced)
                .await?;
            row.map(|r| state_row(&r))
                .transpose()
                .map(Option::unwrap_or_default)
        })
        .await
    }

    async fn remove_subscription(&self, uid: &str) -> Result<u64> {
        within(BULK_TIMEOUT, async {
            let mut tx = self.synced.begin().await?;
            // The subscription and its dead-letter sink's lane, in the order a death's record
            // takes them. Each row first: that waits for every claim and publish holding it,
            // and holds off every later one until the commit (after which they see the
            // tombstone).
            let uids = [uid.to_string(), sink_uid(uid)];
            for uid in &uids {
                query(HOLD_SUBSCRIPTION).bind(uid).execute(&mut *tx).await?;
                query(
                    "INSERT INTO subscriptions (uid, namespace, name, live) VALUES ($1, '', '', false)
                     ON CONFLICT (uid) DO UPDATE SET live = false",
                )
                .bind(uid)
                .execute(&mut *tx)
                .await?;
            }
            // A statement of its own, so that it sees what those claims and publishes
            // committed while the tombstones waited for them.
            let purged = query(
                "DELETE FROM deliveries WHERE sub_uid = ANY($1) AND state IN (0, 1)",
            )
            .bind(&uids[..])
            .execute(&mut *tx)
            .await?
            .rows_affected();
            tx.commit().await?;
            Ok(purged)
        })
        .await
    }

    async fn set_disabled(&self, uid: &str, disabled: bool) -> Result<SubscriptionState> {
        within(OP_TIMEOUT, async {
            let mut tx = self.synced.begin().await?;
            query(HOLD_SUBSCRIPTION).bind(uid).execute(&mut *tx).await?;
            query(
                "UPDATE subscriptions SET disabled = $2, gone = gone AND $2,
                     consecutive_failures = CASE WHEN $2 THEN consecutive_failures ELSE 0 END
                 WHERE uid = $1 AND live",
            )
            .bind(uid)
            .bind(disabled)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            let row = query(STATE_OF)
                .bind(uid)
                .fetch_optional(&self.synced)
                .await?;
            row.map(|r| state_row(&r))
                .transpose()
                .map(Option::unwrap_or_default)
        })
        .await
    }

    async fn subscription_state(&self, uid: &str) -> Result<Option<SubscriptionState>> {
        within(OP_TIMEOUT, async {
            let row = query(STATE_OF)
                .bind(uid)
                .fetch_optional(&self.reads)
                .await?;
            row.map(|r| state_row(&r)).transpose()
        })
        .await
    }

    async fn live_subscriptions(&self) -> Result<Vec<SubscriptionRecord>> {
        within(BULK_TIMEOUT, async {
            let rows = query(
                "SELECT uid, namespace, name, paused, disable_after, shard, strict_order
                 FROM subscriptions WHERE live ORDER BY uid",
            )
            .fetch_all(&self.reads)
            .await?;
            rows.iter()
                .map(|r| {
                    Ok(SubscriptionRecord {
                        uid: r.try_get(0)?,
                        namespace: r.try_get(1)?,
                        name: r.try_get(2)?,
                        paused: r.try_get(3)?,
                        disable_after: r.try_get::<i32, _>(4)?.max(0) as u32,
                        shard: r.try_get::<i32, _>(5)?.max(0) as u32,
                        strict_order: r.try_get(6)?,
                    })
                })
                .collect()
        })
        .await
    }

    async fn publish(&self, event: NewEvent, targets: Vec<String>) -> Result<PublishResult> {
        Ok(self
            .publish_and_claim(event, targets, Vec::new(), Vec::new())
            .await?
            .0)
    }

    /// One transaction of the batch's own (not joined with other publishes). An event whose
    /// id existed, or came earlier in the batch, was not written by it: each is then
    /// published again on its own, which answers it as a repeat.
    async fn publish_batch(
        &self,
        publishes: Vec<(NewEvent, Vec<String>)>,
    ) -> Result<Vec<PublishResult>> {
        let publishes = publishes
            .into_iter()
            .map(|(event, targets)| {
                let mut seen = HashSet::new();
                let targets = targets.into_iter().filter(|t| seen.insert(t.clone()));
                (event, targets.collect())
            })
            .collect();
        let written = group_commit::publish_batch(&self.synced, publishes).await?;
        let mut results = Vec::with_capacity(written.len());
        for result in written {
            results.push(match result {
                group_commit::Batched::Written(result) => result,
                group_commit::Batched::Again(event, targets) => {
                    self.publishes
                        .publish(event, targets, Vec::new(), Vec::new())
                        .await?
                        .0
                }
            });
        }
        Ok(results)
    }

    /// The claims are made in the publish's own statement, as its deliveries are written
    /// (see [`group_commit`]'s `PUBLISH`).
    async fn publish_and_claim(
        &self,
        event: NewEvent,
        targets: Vec<String>,
        claims: Vec<(String, Option<ShardFence>)>,
        held: Vec<ShardFence>,
    ) -> Result<(PublishResult, Vec<Claimed>)> {
        // Each target once, in the caller's order.
        let mut seen = HashSet::new();
        let targets: Vec<String> = targets
            .into_iter()
            .filter(|t| seen.insert(t.clone()))
            .collect();
        let (result, claimed) = self.publishes.publish(event, targets, claims, held).await?;
        for c in &claimed {
            self.on_wire.claimed(c.delivery_id, c.attempt);
        }
        Ok((result, claimed))
    }

    fn claims_with_publish(&self) -> bool {
        true
    }

    /// Publishes and replays NOTIFY `herald_new_work` with what they gave work (in the same
    /// transaction, so a notice arrives only once the work is committed; see [`notice`] for
    /// what a payload says); this listens, gathering notices into the feed, and says
    /// [`NewWork::unknown`] after every (re)connection, when notices may have been missed.
    fn new_work(&self) -> Option<NewWorkFeed> {
        let (notices, feed) = new_work_feed();
        let pool = self.listen.clone();
        tokio::spawn(async move {
            let mut delay = Duration::from_millis(200);
            loop {
                let mut listener = match sqlx_postgres::PgListener::connect_with(&pool).await {
                    Ok(listener) => listener,
                    Err(e) => {
                        tracing::warn!(error = %classify(e), "cannot listen for new work yet");
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(Duration::from_secs(5));
                        continue;
                    }
                };
                if let Err(e) = listener.listen("herald_new_work").await {
                    tracing::warn!(error = %classify(e), "cannot listen for new work yet");
                    tokio::time::sleep(delay).await;
                    continue;
                }
                delay = Duration::from_millis(200);
                if !notices.unknown() {
                    return;
                }
                loop {
                    let open = match listener.try_recv().await {
                        Ok(Some(n)) => match notice(n.payload()) {
                            Notice::Subscriptions(uids) => notices.subscriptions(uids),
                            Notice::Event {
                                namespace,
                                event_type,
                            } => notices.event(namespace, event_type),
                            Notice::Unknown => notices.unknown(),
                        },
                        // Reconnected: what was sent meanwhile is lost.
                        Ok(None) => notices.unknown(),
                        Err(e) => {
                            tracing::warn!(error = %classify(e), "listening for new work failed; listening again");
                            break;
                        }
                    };
                    if !open {
                        return;
                    }
                }
                tokio::time::sleep(delay).await;
            }
        });
        Some(feed)
    }

    async fn check_writable(&self) -> Result<()> {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        within(HEALTH_TIMEOUT, async {
            query(
                "INSERT INTO health (id, at_ms) VALUES (1, $1)
                 ON CONFLICT (id) DO UPDATE SET at_ms = excluded.at_ms",
            )
            .bind(now_ms)
            .execute(&self.synced)
            .await
            .map(|_| ())
        })
        .await
    }

    async fn published(&self, namespace: &str, event_id: &str) -> Result<Option<PublishResult>> {
        within(OP_TIMEOUT, first_answer(&self.reads, namespace, event_id)).await
    }

    async fn claim_next(&self, uid: &str, now_ms: i64) -> Result<Claim> {
        self.claim(uid, now_ms, None).await
    }

    async fn claim_fenced(&self, uid: &str, now_ms: i64, fence: ShardFence) -> Result<Claim> {
        self.claim(uid, now_ms, Some(fence)).await
    }

    async fn unclaim(&self, delivery_id: i64, attempt: u32) -> Result<bool> {
        self.on_wire.recorded(delivery_id, attempt);
        within(
            OP_TIMEOUT,
            claims::unclaim(&self.relaxed, delivery_id, attempt),
        )
        .await
    }

    async fn take_shard(&self, shard: u32, holder: &str, epoch: i64, now_ms: i64) -> Result<bool> {
        within(BULK_TIMEOUT, async {
            let mut tx = self.synced.begin().await?;
            // The new epoch first: it waits for every claim holding the row under the old
            // one, and holds off every later claim until the commit (which they then see).
            let taken = query(
                "INSERT INTO shard_owners (shard, holder, epoch) VALUES ($1, $2, $3)
                 ON CONFLICT (shard) DO UPDATE SET holder = excluded.holder, epoch = excluded.epoch
                 WHERE excluded.epoch > shard_owners.epoch",
            )
            .bind(shard_number(shard))
            .bind(holder)
            .bind(epoch)
            .execute(&mut *tx)
            .await?
            .rows_affected()
                == 1;
            if taken {
                query(
                    "INSERT INTO shard_history (shard, epoch, holder, at_ms)
                     VALUES ($1, $2, $3, $4)",
                )
                .bind(shard_number(shard))
                .bind(epoch)
                .bind(holder)
                .bind(now_ms)
                .execute(&mut *tx)
                .await?;
                // Attempts the previous holder had on the wire: it may be gone, so they are
                // due again (at least once); if it was only paused, whichever completion comes
                // first finishes the delivery. A statement of its own, so that it sees what
                // claims under the old epoch committed while the update above waited.
                query(
                    "UPDATE deliveries SET state = 0, due_ms = least(due_ms, $2)
                     WHERE state = 1
                       AND sub_uid IN (SELECT uid FROM subscriptions WHERE shard = $1)",
                )
                .bind(shard_number(shard))
                .bind(now_ms)
                .execute(&mut *tx)
                .await?;
            }
            tx.commit().await?;
            Ok(taken)
        })
        .await
    }

    async fn shard_history(&self) -> Result<Vec<ShardTaking>> {
        within(BULK_TIMEOUT, async {
            let rows = query(
                "SELECT shard, epoch, holder, at_ms FROM shard_history
                 ORDER BY at_ms, shard, epoch",
            )
            .fetch_all(&self.reads)
            .await?;
            rows.iter()
                .map(|r| {
                    Ok(ShardTaking {
                        shard: r.try_get::<i32, _>(0)?.max(0) as u32,
                        epoch: r.try_get(1)?,
                        holder: r.try_get(2)?,
                        at_ms: r.try_get(3)?,
                    })
                })
                .collect()
        })
        .await
    }

    async fn complete_and_claim(
        &self,
        claim: ClaimRef,
        attempt: AttemptRecord,
        next: Next,
        then_claim: Option<i64>,
    ) -> Result<(Completion, Option<Claimed>)> {
        self.on_wire.recorded(claim.delivery_id, claim.attempt);
        let recorded = self
            .completions
            .write(completions::Record {
                claim,
                attempt,
                next,
                then_claim,
            })
            .await?;
        if let Some(c) = &recorded.1 {
            self.on_wire.claimed(c.delivery_id, c.attempt);
        }
        Ok(recorded)
    }

    async fn complete_dead_letter(
        &self,
        claim: ClaimRef,
        attempt: AttemptRecord,
        next: Next,
        letter: NewEvent,
        sink: String,
    ) -> Result<Completion> {
        self.on_wire.recorded(claim.delivery_id, claim.attempt);
        within(OP_TIMEOUT, async {
            let mut tx = self.relaxed.begin().await?;
            let record = completions::Record {
                claim,
                attempt,
                next,
                then_claim: None,
            };
            let (mut completion, _) = completions::write_one(&mut *tx, &record).await?;
            if completion.recorded {
                // The letter, and its delivery to the sink's lane while that lane is live
                // (FOR KEY SHARE, as a publish: a removal waits, then purges it), and the
                // notice that wakes the lane wherever its shard is held. An id already
                // stored writes nothing.
                let queued = query(
                    "WITH sink AS MATERIALIZED (
                         SELECT uid FROM subscriptions
                         WHERE uid = $1 AND live AND namespace = $2 FOR KEY SHARE
                     ), written AS (
                         INSERT INTO events (namespace, event_id, event_type, body, published_ms, matched)
                         SELECT $2, $3, $4, $5, $6, 1 FROM sink
                         ON CONFLICT (namespace, event_id) DO NOTHING
                         RETURNING id
                     ), queued AS (
                         INSERT INTO deliveries (event, sub_uid, state, due_ms, window_start_ms)
                         SELECT written.id, $1, 0, $6, $6 FROM written
                         RETURNING sub_uid
                     )
                     SELECT pg_notify('herald_new_work', sub_uid) FROM queued",
                )
                .bind(&sink)
                .bind(&letter.namespace)
                .bind(&letter.event_id)
                .bind(&letter.event_type)
                .bind(&letter.body)
                .bind(letter.published_ms)
                .fetch_optional(&mut *tx)
                .await?;
                completion.letter_queued = queued.is_some();
            }
            tx.commit().await?;
            Ok(completion)
        })
        .await
    }

    async fn recover_in_flight(&self, now_ms: i64) -> Result<u64> {
        within(BULK_TIMEOUT, async {
            Ok(
                query(
                    "UPDATE deliveries SET state = 0, due_ms = least(due_ms, $1) WHERE state = 1",
                )
                .bind(now_ms)
                .execute(&self.relaxed)
                .await?
                .rows_affected(),
            )
        })
        .await
    }

    async fn pending_by_subscription(&self) -> Result<Vec<(String, String, u64)>> {
        within(BULK_TIMEOUT, async {
            let rows = query(
                "SELECT s.uid, s.namespace, count(d.id) FROM subscriptions s
                 JOIN deliveries d ON d.sub_uid = s.uid AND d.state IN (0, 1)
                 WHERE s.live GROUP BY s.uid, s.namespace",
            )
            .fetch_all(&self.reads)
            .await?;
            rows.iter()
                .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, count(r, 2)?)))
                .collect()
        })
        .await
    }

    async fn stored_bytes(&self) -> Result<Vec<(String, u64)>> {
        within(BULK_TIMEOUT, async {
            // octet_length of a stored bytea reads its size, not the value.
            let rows = query(
                "SELECT namespace, sum(CASE WHEN matched = 0 THEN $1
                                          ELSE octet_length(body) + $1 + matched * $2 END)::bigint
                 FROM events GROUP BY namespace",
            )
            .bind(EVENT_OVERHEAD_BYTES as i64)
            .bind(DELIVERY_OVERHEAD_BYTES as i64)
            .fetch_all(&self.reads)
            .await?;
            rows.iter()
                .map(|r| Ok((r.try_get(0)?, count(r, 1)?)))
                .collect()
        })
        .await
    }

    async fn list_deliveries(
        &self,
        uid: &str,
        filter: StateFilter,
        limit: u32,
    ) -> Result<Vec<DeliveryView>> {
        let states: Vec<i16> = match filter {
            StateFilter::Pending => vec![0, 1],
            StateFilter::Dead => vec![3],
            StateFilter::All => vec![0, 1, 2, 3],
        };
        within(OP_TIMEOUT, async {
            let rows = query(
                // Each state's first page from the lane index, in its order, then the first
                // of those: a page costs its own rows, however long the backlog (ORDER BY
                // d.id sorted all of it for every page).
                "SELECT e.event_id, e.event_type, d.state, d.attempts, e.published_ms, d.due_ms,
                        a.at_ms, a.outcome, a.status_code, a.latency_ms, a.message, a.id
                 FROM unnest($2::smallint[]) AS s(state)
                 CROSS JOIN LATERAL (
                     SELECT id, event, state, attempts, due_ms FROM deliveries
                     WHERE sub_uid = $1 AND state = s.state ORDER BY due_ms, id LIMIT $3
                 ) d
                 JOIN events e ON e.id = d.event
                 LEFT JOIN LATERAL (
                     SELECT at_ms, outcome, status_code, latency_ms, message, id FROM attempt_log
                     WHERE delivery = d.id ORDER BY id DESC LIMIT 1
                 ) a ON true
                 ORDER BY d.state, d.due_ms, d.id LIMIT $3",
            )
            .bind(uid)
            .bind(&states)
            .bind(i64::from(limit))
            .fetch_all(&self.reads)
            .await?;
            rows.iter()
                .map(|r| {
                    let state = DeliveryState::from_code(r.try_get::<i16, _>(2)?.into());
                    let last_attempt = match r.try_get::<Option<i64>, _>(6)? {
                        Some(_) => Some(attempt_row(r, 6)?),
                        None => None,
                    };
                    Ok(DeliveryView {
                        event_id: r.try_get(0)?,
                        event_type: r.try_get(1)?,
                        state,
                        attempts: r.try_get::<i32, _>(3)?.max(0) as u32,
                        published_ms: r.try_get(4)?,
                        next_due_ms: (state == DeliveryState::Pending)
                            .then(|| r.try_get(5))
                            .transpose()?,
                        last_attempt,
                        last_attempt_id: r.try_get(11)?,
                    })
                })
                .collect()
        })
        .await
    }

    async fn attempts(&self, uid: &str, event_id: &str) -> Result<Vec<AttemptRecord>> {
        within(OP_TIMEOUT, async {
            let rows = query(
                "SELECT a.at_ms, a.outcome, a.status_code, a.latency_ms, a.message
                 FROM attempt_log a JOIN deliveries d ON d.id = a.delivery
                 JOIN events e ON e.id = d.event
                 WHERE d.sub_uid = $1 AND e.event_id = $2 ORDER BY a.id",
            )
            .bind(uid)
            .bind(event_id)
            .fetch_all(&self.reads)
            .await?;
            rows.iter().map(|r| attempt_row(r, 0)).collect()
        })
        .await
    }

    async fn search_attempts(&self, search: AttemptSearch) -> Result<AttemptPage> {
        within(OP_TIMEOUT, async {
            // The newest rows of the log before the cursor, by its key, at most
            // SEARCH_SCAN_ROWS of them; of those, the namespace's that match. One row comes
            // back even when none matches, to say how far the scan read.
            let rows = query(
                "WITH scanned AS MATERIALIZED (
                     SELECT id, delivery, at_ms, outcome, status_code, latency_ms, message
                     FROM attempt_log WHERE id < $2 ORDER BY id DESC LIMIT $3
                 ), hits AS (
                     SELECT a.id, s.name, e.event_id, e.event_type,
                            a.at_ms, a.outcome, a.status_code, a.latency_ms, a.message
                     FROM scanned a
                     JOIN deliveries d ON d.id = a.delivery
                     JOIN subscriptions s ON s.uid = d.sub_uid
                     JOIN events e ON e.id = d.event
                     WHERE s.namespace = $1
                       AND ($4::text IS NULL OR s.name = $4)
                       AND ($5::text[] IS NULL OR a.outcome = ANY($5))
                       AND ($6::integer IS NULL OR a.status_code = $6)
                       AND ($7::bigint IS NULL OR a.at_ms >= $7)
                       AND ($8::bigint IS NULL OR a.at_ms < $8)
                     ORDER BY a.id DESC LIMIT $9
                 )
                 SELECT (SELECT count(*) FROM scanned), (SELECT min(id) FROM scanned),
                        h.id, h.name, h.event_id, h.event_type,
                        h.at_ms, h.outcome, h.status_code, h.latency_ms, h.message
                 FROM (SELECT 1) one LEFT JOIN hits h ON true ORDER BY h.id DESC",
            )
            .bind(&search.namespace)
            .bind(search.before.unwrap_or(i64::MAX))
            .bind(i64::from(SEARCH_SCAN_ROWS))
            .bind(search.subscription.as_deref())
            .bind(search.outcomes.as_deref())
            .bind(search.status_code.map(i32::from))
            .bind(search.since_ms)
            .bind(search.until_ms)
            .bind(i64::from(search.limit))
            .fetch_all(&self.reads)
            .await?;
            let Some(first) = rows.first() else {
                return Ok(AttemptPage::default());
            };
            let scanned = first.try_get::<i64, _>(0)?.clamp(0, u32::MAX.into()) as u32;
            let oldest: Option<i64> = first.try_get(1)?;
            let mut hits = Vec::with_capacity(rows.len());
            for r in &rows {
                let Some(id) = r.try_get::<Option<i64>, _>(2)? else {
                    continue;
                };
                hits.push((
                    id,
                    AttemptHit {
                        subscription: r.try_get(3)?,
                        event_id: r.try_get(4)?,
                        event_type: r.try_get(5)?,
                        attempt: attempt_row(r, 6)?,
                    },
                ));
            }
            Ok(AttemptPage::of(hits, search.limit, scanned, oldest))
        })
        .await
    }

    async fn replay(&self, uid: &str, which: Replay, now_ms: i64) -> Result<u64> {
        within(BULK_TIMEOUT, async {
            // FOR KEY SHARE on a live row, as a publish: a removal waits, then purges them.
            // From the subscription's dead letters to their events (by key), whatever the
            // selection: never through the namespace's whole event table.
            Ok(query(
                "WITH sub AS MATERIALIZED (
                     SELECT uid FROM subscriptions WHERE uid = $1 AND live FOR KEY SHARE
                 )
                 , replayed AS (
                     UPDATE deliveries d SET state = 0, attempts = 0, due_ms = $2,
                         window_start_ms = $2, finished_ms = NULL
                     FROM events e
                     WHERE d.sub_uid = (SELECT uid FROM sub) AND d.state = 3 AND e.id = d.event
                       AND ($3::text[] IS NULL OR e.event_id = ANY($3))
                       AND ($4::bigint IS NULL OR e.published_ms >= $4)
                       AND ($5::bigint IS NULL OR e.published_ms < $5)
                     RETURNING 1
                 ), notified AS (
                     SELECT pg_notify('herald_new_work', $1) FROM replayed HAVING count(*) > 0
                 )
                 SELECT count(*), (SELECT count(*) FROM notified) FROM replayed",
            )
            .bind(uid)
            .bind(now_ms)
            .bind(which.event_ids)
            .bind(which.since_ms)
            .bind(which.until_ms)
            .fetch_one(&self.synced)
            .await?
            .try_get::<i64, _>(0)? as u64)
        })
        .await
    }

    async fn prune(&self, older_than_ms: i64) -> Result<u64> {
        within(BULK_TIMEOUT, async {
            let mut tx = self.relaxed.begin().await?;
            let mut removed = 0;
            for sql in [
                "DELETE FROM attempt_log WHERE at_ms < $1",
                "DELETE FROM publish_claims WHERE at_ms < $1",
                "DELETE FROM deliveries WHERE state = 2 AND finished_ms < $1",
                "DELETE FROM deliveries WHERE sub_uid IN (SELECT uid FROM subscriptions WHERE NOT live)",
                // A statement of its own: it must see the deliveries just deleted as gone.
                "DELETE FROM events e WHERE published_ms < $1
                     AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.event = e.id)",
            ] {
                let q = query(sql);
                let q = if sql.contains("$1") {
                    q.bind(older_than_ms)
                } else {
                    q
                };
                removed += q.execute(&mut *tx).await?.rows_affected();
            }
            tx.commit().await?;
            Ok(removed)
        })
        .await
    }
}

/// What removals, pauses, enabling and disabling take first: the one lock on a
/// subscription row that excludes the `FOR KEY SHARE` of publishes and claims (see the
/// module's notes).
const HOLD_SUBSCRIPTION: &str = "SELECT 1 FROM subscriptions WHERE uid = $1 FOR UPDATE";

/// Shards are at most 4096 (`--shards`); PostgreSQL has no unsigned integers.
fn shard_number(shard: u32) -> i32 {
    shard.min(i32::MAX as u32) as i32
}

impl PostgresStore {
    /// The claim, fenced by liveness and, with several replicas, by the shard's lease epoch,
    /// joined with other lanes' claims ([`claims`]).
    async fn claim(&self, uid: &str, now_ms: i64, fence: Option<ShardFence>) -> Result<Claim> {
        let claim = self
            .claims
            .write(claims::Request {
                uid: uid.to_string(),
                now_ms,
                fence,
            })
            .await?;
        if let Claim::Claimed(c) = &claim {
            self.on_wire.claimed(c.delivery_id, c.attempt);
        }
        Ok(claim)
    }
}

/// The first answer to an event id already published in the namespace.
async fn first_answer(
    pool: &PgPool,
    namespace: &str,
    event_id: &str,
) -> Result<Option<PublishResult>, sqlx_core::Error> {
    let matched: Option<i32> =
        query_scalar("SELECT matched FROM events WHERE namespace = $1 AND event_id = $2")
            .bind(namespace)
            .bind(event_id)
            .fetch_optional(pool)
            .await?;
    Ok(matched.map(|matched| PublishResult {
        event_id: event_id.to_string(),
        matched: matched.max(0) as u32,
        duplicate: true,
        targets: Vec::new(),
    }))
}

/// What a `herald_new_work` payload says.
#[derive(Debug, PartialEq, Eq)]
enum Notice<'a> {
    /// `uid,uid,...`: these subscriptions got work (a publish to few, a replay).
    Subscriptions(Vec<&'a str>),
    /// `e:<namespace>:<type>`: an event published to more subscriptions than a payload
    /// (8,000 bytes) could name; each subscription of the namespace that matches the type
    /// got work. Bounded by the lengths of a namespace (63) and a type (253), so no
    /// fan-out can overflow it.
    Event {
        namespace: &'a str,
        event_type: &'a str,
    },
    /// `*` (what replicas before this format sent for a large fan-out): look at everything.
    Unknown,
}

fn notice(payload: &str) -> Notice<'_> {
    if payload == "*" {
        return Notice::Unknown;
    }
    // A uid never holds ':' (a UUID); a namespace never does (a DNS label), a type may.
    match payload
        .strip_prefix("e:")
        .and_then(|rest| rest.split_once(':'))
    {
        Some((namespace, event_type)) => Notice::Event {
            namespace,
            event_type,
        },
        None => Notice::Subscriptions(payload.split(',').collect()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::store::test_postgres::Postgres;

    async fn connect(server: &Postgres) -> PostgresStore {
        PostgresStore::connect(&server.url).await.unwrap()
    }

    /// The write path plans each statement once per connection; reads plan each call.
    #[tokio::test]
    async fn the_write_path_plans_once() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = connect(&server).await;
        let mode = |pool: PgPool| async move {
            query_scalar::<_, String>("SELECT current_setting('plan_cache_mode')")
                .fetch_one(&pool)
                .await
                .unwrap()
        };
        assert_eq!(mode(store.synced.clone()).await, "force_generic_plan");
        assert_eq!(mode(store.relaxed.clone()).await, "force_generic_plan");
        assert_eq!(mode(store.reads.clone()).await, "auto");
        store.close().await;
    }

    /// The joined writers' statements, planned on a fresh database's empty tables (as a
    /// connection's first statement of each kind is), still find their rows by key: a
    /// plan reading a whole table would stay cached while the table grew.
    #[tokio::test]
    async fn joined_statements_find_rows_by_key_though_planned_on_empty_tables() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = connect(&server).await;
        for (pool, name, sql, params) in [
            (&store.committers, "publish", group_commit::PUBLISH, 16),
            (&store.recorders, "record", completions::RECORD, 17),
            (&store.claimers, "claim", claims::CLAIM, 4),
        ] {
            let mut conn = pool.acquire().await.unwrap();
            conn.execute(format!("PREPARE probe AS {sql}").as_str())
                .await
                .unwrap();
            let nulls = vec!["NULL"; params].join(", ");
            let plan: Vec<String> = query_scalar(&format!("EXPLAIN EXECUTE probe({nulls})"))
                .fetch_all(&mut *conn)
                .await
                .unwrap();
            conn.execute("DEALLOCATE probe").await.unwrap();
            let scans: Vec<&String> = plan.iter().filter(|l| l.contains("Seq Scan")).collect();
            assert!(
                scans.is_empty(),
                "the {name} statement's plan reads whole tables: {scans:#?}"
            );
        }
        store.close().await;
    }

    #[tokio::test]
    async fn postgres_passes_the_store_suite() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = connect(&server).await;
        super::super::suite::run(&store).await;
        store.close().await;
    }

    #[tokio::test]
    async fn what_was_acknowledged_survives_reopening() {
        let Some(server) = Postgres::start() else {
            return;
        };
        {
            let store = connect(&server).await;
            super::super::suite::seed_for_reopen(&store).await;
            store.close().await;
        }
        // A restarted server, and a second store: another replica, or this one restarted.
        server.stop();
        server.restart();
        let store = connect(&server).await;
        super::super::suite::check_after_reopen(&store).await;
        store.close().await;
    }

    fn sub(uid: &str) -> SubscriptionRecord {
        SubscriptionRecord {
            uid: uid.into(),
            namespace: "ns".into(),
            name: uid.into(),
            paused: false,
            disable_after: 0,
            shard: 0,
            strict_order: false,
        }
    }

    fn event(id: &str) -> NewEvent {
        NewEvent {
            namespace: "ns".into(),
            event_id: id.into(),
            event_type: "t".into(),
            body: b"{}".to_vec(),
            published_ms: 100,
        }
    }

    #[test]
    fn a_notice_names_subscriptions_or_the_event() {
        assert_eq!(notice("a,b"), Notice::Subscriptions(vec!["a", "b"]));
        assert_eq!(notice("*"), Notice::Unknown);
        assert_eq!(
            notice("e:shop:order:created/v1"),
            Notice::Event {
                namespace: "shop",
                event_type: "order:created/v1"
            }
        );
    }

    /// Issue 24 item 6: a publish to more subscriptions than a payload can name says which
    /// event (namespace and type), never "look at everything"; notices the reader has not
    /// taken are gathered into one batch.
    #[tokio::test]
    async fn notices_of_a_wide_fan_out_name_the_event_and_are_gathered() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = connect(&server).await;
        // UUID-sized uids: 250 of them do not fit in one payload.
        let uids: Vec<String> = (0..250)
            .map(|i| format!("00000000-0000-7000-8000-{i:012}"))
            .collect();
        for uid in &uids {
            store.upsert_subscription(sub(uid)).await.unwrap();
        }
        let feed = store.new_work().unwrap();
        // The first look after listening: notices may have been missed before it.
        let first = tokio::time::timeout(Duration::from_secs(10), feed.next())
            .await
            .unwrap();
        assert!(first.unknown, "{first:?}");

        let wide = NewEvent {
            event_type: "order.created".into(),
            ..event("wide")
        };
        store.publish(wide, uids.clone()).await.unwrap();
        let narrow = uids[..3].to_vec();
        for i in 0..20 {
            store
                .publish(event(&format!("narrow-{i}")), narrow.clone())
                .await
                .unwrap();
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut seen = NewWork::default();
        while seen.events.is_empty() || seen.subscriptions.len() < 3 {
            assert!(std::time::Instant::now() < deadline, "{seen:?}");
            let work = tokio::time::timeout(Duration::from_secs(10), feed.next())
                .await
                .unwrap();
            assert!(!work.unknown, "a notice said look at everything: {work:?}");
            seen.events.extend(work.events);
            seen.subscriptions.extend(work.subscriptions);
        }
        assert_eq!(
            seen.events,
            HashSet::from([("ns".to_string(), "order.created".to_string())])
        );
        assert_eq!(seen.subscriptions, narrow.into_iter().collect());
        store.close().await;
    }

    /// One transaction's NOTIFY names each subscription given unclaimed work once, in
    /// payloads of at most 7,000 bytes, and a publish to more than one payload holds by its
    /// namespace and type.
    #[tokio::test]
    async fn a_batch_notifies_each_subscription_once_in_payloads_that_fit() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = connect(&server).await;
        let uuid = |i: usize| format!("00000000-0000-7000-8000-{i:012}");
        for i in (0..600).chain(1000..1250) {
            store.upsert_subscription(sub(&uuid(i))).await.unwrap();
        }
        let mut listener = sqlx_postgres::PgListener::connect(&server.url)
            .await
            .unwrap();
        listener.listen("herald_new_work").await.unwrap();
        // Six publishes naming 100 each (together several payloads), one naming 250.
        let mut batch: Vec<(NewEvent, Vec<String>)> = (0..6)
            .map(|p| {
                let targets = (p * 100..p * 100 + 100).map(uuid).collect();
                (event(&format!("n-{p}")), targets)
            })
            .collect();
        let wide = NewEvent {
            event_type: "order.created".into(),
            ..event("wide")
        };
        batch.push((wide, (1000..1250).map(uuid).collect()));
        store.publish_batch(batch).await.unwrap();
        // All of one commit's notices arrive together.
        let mut payloads: Vec<String> = Vec::new();
        let named = |payloads: &[String]| {
            payloads
                .iter()
                .filter(|p| !p.starts_with("e:"))
                .flat_map(|p| p.split(',').map(str::to_string))
                .collect::<Vec<_>>()
        };
        while named(&payloads).len() < 600 || !payloads.iter().any(|p| p.starts_with("e:")) {
            let notice = tokio::time::timeout(Duration::from_secs(10), listener.recv())
                .await
                .unwrap_or_else(|_| panic!("notices so far: {payloads:?}"));
            payloads.push(notice.unwrap().payload().to_string());
        }
        assert!(payloads.iter().all(|p| p.len() <= 7000), "{payloads:?}");
        let events: Vec<&String> = payloads.iter().filter(|p| p.starts_with("e:")).collect();
        assert_eq!(events, vec!["e:ns:order.created"]);
        let uids = named(&payloads);
        assert_eq!(uids.len(), 600, "named more than once: {payloads:?}");
        let expected: HashSet<String> = (0..600).map(uuid).collect();
        assert_eq!(uids.into_iter().collect::<HashSet<_>>(), expected);
        assert!(payloads.len() >= 5, "{} payloads", payloads.len());
        store.close().await;
    }

    /// Other replicas hear only of work in shards the publishing replica does not hold: a
    /// lane of a shard it holds at the owner row's epoch is woken by that replica itself.
    /// Held at an older epoch (another replica took the shard since) or not held, the lane
    /// is named in the notice.
    #[tokio::test]
    async fn a_publish_tells_other_replicas_only_of_shards_it_does_not_hold() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = connect(&server).await;
        for (uid, shard) in [("h1", 3), ("h2", 4), ("h3", 5)] {
            store
                .upsert_subscription(SubscriptionRecord { shard, ..sub(uid) })
                .await
                .unwrap();
        }
        assert!(store.take_shard(3, "me", 2, 50).await.unwrap());
        assert!(store.take_shard(4, "other", 2, 50).await.unwrap());
        let mut listener = sqlx_postgres::PgListener::connect(&server.url)
            .await
            .unwrap();
        listener.listen("herald_new_work").await.unwrap();
        let all: Vec<String> = ["h1", "h2", "h3"].map(String::from).into();
        let held = vec![
            ShardFence { shard: 3, epoch: 2 },
            // Held here once, at epoch 1: the shard has been taken since.
            ShardFence { shard: 4, epoch: 1 },
        ];
        let (published, claimed) = store
            .publish_and_claim(event("held"), all.clone(), Vec::new(), held)
            .await
            .unwrap();
        assert_eq!((published.targets, claimed.len()), (all, 0));
        // Then one naming h1, from a replica holding nothing: notices arrive in commit order.
        store
            .publish(event("not-held"), vec!["h1".into()])
            .await
            .unwrap();
        let mut notices: Vec<Vec<String>> = Vec::new();
        while !notices.iter().any(|n| n.contains(&"h1".to_string())) {
            let notice = tokio::time::timeout(Duration::from_secs(10), listener.recv())
                .await
                .unwrap_or_else(|_| panic!("notices so far: {notices:?}"));
            let payload = notice.unwrap().payload().to_string();
            notices.push(payload.split(',').map(str::to_string).collect());
        }
        assert_eq!(
            notices,
            vec![
                vec!["h2".to_string(), "h3".to_string()],
                vec!["h1".to_string()]
            ],
            "the first publish's notice names h1, whose shard its replica holds, or misses h2 or h3"
        );
        store.close().await;
    }

    /// A publish claims, in its own statement, the delivery of each lane it was asked for
    /// that a claim at its time would take, and only those: not under a stale epoch or in
    /// another shard, not a strict-order lane, not past a due delivery of the lane; and its
    /// notice names only the lanes it did not claim.
    #[tokio::test]
    async fn a_publish_claims_what_a_claim_at_its_time_would_take() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = connect(&server).await;
        assert_eq!(
            super::super::suite::claims_made_with_a_publish(&store).await,
            1
        );
        let fence = |epoch| Some(ShardFence { shard: 3, epoch });
        for uid in ["c1", "c2", "c3", "c4", "c5"] {
            let strict_order = uid == "c3";
            let shard = if uid == "c5" { 4 } else { 3 };
            store
                .upsert_subscription(SubscriptionRecord {
                    strict_order,
                    shard,
                    ..sub(uid)
                })
                .await
                .unwrap();
        }
        assert!(store.take_shard(3, "me", 2, 50).await.unwrap());
        assert!(store.take_shard(4, "me", 2, 50).await.unwrap());
        // c4 has a delivery due before the publish: that one is its lane's next.
        store
            .publish(
                NewEvent {
                    published_ms: 90,
                    ..event("early")
                },
                vec!["c4".into()],
            )
            .await
            .unwrap();
        let feed = store.new_work().unwrap();
        let first = tokio::time::timeout(Duration::from_secs(10), feed.next())
            .await
            .unwrap();
        assert!(first.unknown, "{first:?}");

        let all: Vec<String> = ["c1", "c2", "c3", "c4", "c5"].map(String::from).into();
        let asked = vec![
            ("c1".to_string(), fence(2)),
            ("c2".to_string(), fence(1)),
            ("c3".to_string(), fence(2)),
            ("c4".to_string(), fence(2)),
            ("c5".to_string(), fence(2)),
        ];
        let (published, claimed) = store
            .publish_and_claim(event("e1"), all.clone(), asked, Vec::new())
            .await
            .unwrap();
        assert_eq!(published.targets, all);
        let claimed: Vec<(&str, &str, u32, i64, Option<ShardFence>)> = claimed
            .iter()
            .map(|c| {
                (
                    c.subscription_uid.as_str(),
                    c.event_id.as_str(),
                    c.attempt,
                    c.window_start_ms,
                    c.fence,
                )
            })
            .collect();
        assert_eq!(
            claimed,
            [("c1", "e1", 1, 100, fence(2))],
            "claimed besides c1: c2 under a stale epoch, c3 in strict order, c4 past its due \
             delivery, or c5 under another shard's fence"
        );
        // c1's delivery is in flight: nothing of it to claim. The others claim as usual.
        assert!(matches!(
            store
                .claim_fenced("c1", 100, fence(2).unwrap())
                .await
                .unwrap(),
            Claim::Idle { .. }
        ));
        for (uid, id) in [("c2", "e1"), ("c3", "e1"), ("c4", "early"), ("c5", "e1")] {
            let shard = if uid == "c5" { 4 } else { 3 };
            let fence = ShardFence { shard, epoch: 2 };
            match store.claim_fenced(uid, 100, fence).await.unwrap() {
                Claim::Claimed(c) => assert_eq!(c.event_id, id, "{uid}"),
                Claim::Idle { .. } => panic!("{uid}'s delivery was taken by the publish"),
            }
        }
        // The notice names the lanes the publish did not start.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut seen = HashSet::new();
        while seen.len() < 4 {
            assert!(std::time::Instant::now() < deadline, "{seen:?}");
            let work = tokio::time::timeout(Duration::from_secs(10), feed.next())
                .await
                .unwrap();
            seen.extend(work.subscriptions);
        }
        assert_eq!(
            seen,
            ["c2", "c3", "c4", "c5"].map(String::from).into(),
            "the claimed lane was named, or another was not"
        );
        store.close().await;
    }

    /// What a publish claimed and nobody will send (its answer was lost, or its publisher
    /// gave up waiting) is given back: due again, its attempt not counted; found by the
    /// batch's key once its statement is done, and nothing when it never committed, which a
    /// statement arriving after its give-back then cannot either.
    #[tokio::test]
    async fn claims_of_an_unanswered_publish_are_given_back() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = connect(&server).await;
        for uid in ["g1", "g2", "g3", "g4"] {
            store.upsert_subscription(sub(uid)).await.unwrap();
        }
        let claims = |uid: &str| vec![(uid.to_string(), None)];
        let in_flight = |uid: &'static str| {
            let store = &store;
            async move {
                matches!(
                    store.claim_next(uid, 100).await.unwrap(),
                    Claim::Idle { .. }
                )
            }
        };
        let given_back = |uid: &'static str, id: i64| {
            let store = &store;
            async move {
                match store.claim_next(uid, 100).await.unwrap() {
                    Claim::Claimed(c) => assert_eq!((c.delivery_id, c.attempt), (id, 1)),
                    Claim::Idle { .. } => panic!("{uid}'s claim was not given back"),
                }
            }
        };
        let claimed_by = |published: Option<group_commit::Published>| {
            let (_, claimed) = published.expect("written");
            assert_eq!(claimed.len(), 1, "not claimed with its publish");
            claimed[0].delivery_id
        };

        // The publisher gone after the commit: given back at once.
        let (_, c) = store
            .publish_and_claim(event("e-g1"), vec!["g1".into()], claims("g1"), Vec::new())
            .await
            .unwrap();
        group_commit::give_back(store.synced.clone(), vec![c[0].delivery_id]).await;
        given_back("g1", c[0].delivery_id).await;

        // Committed, its answer lost: found by its key.
        let written = group_commit::write_keyed(
            &store.synced,
            event("e-g2"),
            vec!["g2".into()],
            claims("g2"),
            2,
        )
        .await
        .unwrap();
        let g2 = claimed_by(written);
        assert!(in_flight("g2").await);
        group_commit::give_back_unanswered(store.synced.clone(), 2).await;
        given_back("g2", g2).await;

        // A statement still writing its key: nothing given back until it is done.
        let (_, c) = store
            .publish_and_claim(event("e-g3"), vec!["g3".into()], claims("g3"), Vec::new())
            .await
            .unwrap();
        let g3 = c[0].delivery_id;
        let mut other = raw(&server.url).await;
        query("BEGIN").execute(&mut other).await.unwrap();
        query("INSERT INTO publish_claims VALUES (3, 100, $1)")
            .bind(vec![g3])
            .execute(&mut other)
            .await
            .unwrap();
        let waiting = tokio::spawn(group_commit::give_back_unanswered(store.synced.clone(), 3));
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !waiting.is_finished(),
            "gave back before the statement was done"
        );
        assert!(
            in_flight("g3").await,
            "g3 given back while its publish was writing"
        );
        query("COMMIT").execute(&mut other).await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("the give-back waited on")
            .unwrap();
        given_back("g3", g3).await;

        // Never arrived: the give-back writes the key, and the statement arriving after it
        // fails on it, claiming and writing nothing.
        group_commit::give_back_unanswered(store.synced.clone(), 4).await;
        let late = group_commit::write_keyed(
            &store.synced,
            event("e-g4"),
            vec!["g4".into()],
            claims("g4"),
            4,
        )
        .await;
        assert!(late.is_err(), "a statement after its give-back was written");
        assert!(store.published("ns", "e-g4").await.unwrap().is_none());

        // Keys of answered batches are forgotten by the statements after them.
        for i in 0..4 {
            store
                .publish_and_claim(
                    event(&format!("f-{i}")),
                    vec!["g4".into()],
                    claims("g4"),
                    Vec::new(),
                )
                .await
                .unwrap();
        }
        let kept: i64 =
            query_scalar("SELECT count(*) FROM publish_claims WHERE batch NOT IN (2, 3, 4)")
                .fetch_one(&mut other)
                .await
                .unwrap();
        assert_eq!(kept, 1, "only the last answered batch's key is left");
        store.close().await;
    }

    /// Polls `done` until it holds, failing after 4 s.
    async fn until(what: &str, done: impl Fn() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(4);
        while !done() {
            assert!(tokio::time::Instant::now() < deadline, "never {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// A plain connection beside the store, to look at or hold rows as another process would.
    async fn raw(url: &str) -> PgConnection {
        PgConnection::connect(url).await.unwrap()
    }

    /// `n` subscriptions `{prefix}{s}`, each with one event published and its attempt
    /// claimed: the claims, in order.
    async fn one_claim_each(store: &PostgresStore, prefix: &str, n: usize) -> Vec<Claimed> {
        let mut claims = Vec::new();
        for s in 0..n {
            let uid = format!("{prefix}{s}");
            store.upsert_subscription(sub(&uid)).await.unwrap();
            store
                .publish(event(&format!("{prefix}-{s}")), vec![uid.clone()])
                .await
                .unwrap();
            match store.claim_next(&uid, i64::MAX).await.unwrap() {
                Claim::Claimed(claimed) => claims.push(claimed),
                other => panic!("{uid}: {other:?}"),
            }
        }
        claims
    }

    /// Records `claimed`'s attempt as failed with a retry far off, in a task of its own.
    fn record_retry(
        store: &Arc<PostgresStore>,
        claimed: Claimed,
    ) -> tokio::task::JoinHandle<Result<Completion>> {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .complete(
                    claimed.claim_ref(),
                    attempt(),
                    Next::Retry { due_ms: 50_000 },
                )
                .await
        })
    }

    /// Replicas starting at once on an empty database: sqlx's migrator serialises them with
    /// an advisory lock, so each migration is applied once and every replica starts.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn replicas_migrating_at_once_all_start() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let mut admin = raw(&server.url).await;
        for round in 0..3 {
            let database = format!("fresh{round}");
            admin
                .execute(format!("CREATE DATABASE {database}").as_str())
                .await
                .unwrap();
            let url = server.url_of(&database);
            let starts: Vec<_> = (0..6)
                .map(|_| {
                    let url = url.clone();
                    tokio::spawn(async move { PostgresStore::connect(&url).await })
                })
                .collect();
            for start in starts {
                let store = start.await.unwrap().unwrap_or_else(|e| {
                    panic!("a replica failed to start on a fresh database: {e}")
                });
                store.upsert_subscription(sub("m1")).await.unwrap();
                store.close().await;
            }
            let mut conn = raw(&url).await;
            let applied: Vec<i64> =
                query_scalar("SELECT version FROM _sqlx_migrations ORDER BY version")
                    .fetch_all(&mut conn)
                    .await
                    .unwrap();
            let expected: Vec<i64> = MIGRATIONS.iter().map(|m| m.0).collect();
            assert_eq!(applied, expected, "each migration applied once");
        }
    }

    /// Many claimers (a wide lane, or several replicas) never get the same delivery.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_claims_never_share_a_delivery() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = Arc::new(connect(&server).await);
        let replica = Arc::new(connect(&server).await);
        store.upsert_subscription(sub("w1")).await.unwrap();
        const EVENTS: usize = 200;
        for i in 0..EVENTS {
            store
                .publish(event(&format!("evt-{i}")), vec!["w1".into()])
                .await
                .unwrap();
        }
        let claimers: Vec<_> = (0..12)
            .map(|n| {
                let store = if n % 2 == 0 {
                    store.clone()
                } else {
                    replica.clone()
                };
                tokio::spawn(async move {
                    let mut mine = Vec::new();
                    loop {
                        match store.claim_next("w1", 1_000).await.unwrap() {
                            Claim::Claimed(c) => mine.push(c.delivery_id),
                            // SKIP LOCKED: idle with a due delivery means another claimer
                            // is taking it right now.
                            Claim::Idle {
                                next_due_ms: Some(_),
                            } => tokio::task::yield_now().await,
                            Claim::Idle { next_due_ms: None } => return mine,
                        }
                    }
                })
            })
            .collect();
        let mut all = Vec::new();
        for claimer in claimers {
            all.extend(claimer.await.unwrap());
        }
        let distinct: HashSet<_> = all.iter().collect();
        assert_eq!(all.len(), EVENTS, "every delivery claimed");
        assert_eq!(distinct.len(), EVENTS, "no delivery claimed twice");
        store.close().await;
        replica.close().await;
    }

    /// The fence, step by step: while a removal is in progress (its tombstone written, not
    /// committed), a claim waits for it rather than taking a delivery, and then claims
    /// nothing; a publish for the subscription waits the same way and then matches nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn claims_and_publishes_wait_for_a_removal_in_progress() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = Arc::new(connect(&server).await);
        store.upsert_subscription(sub("f1")).await.unwrap();
        store
            .publish(event("evt-f1"), vec!["f1".into()])
            .await
            .unwrap();
        let mut removal = raw(&server.url).await;
        removal.execute("BEGIN").await.unwrap();
        removal
            .execute("SELECT 1 FROM subscriptions WHERE uid = 'f1' FOR UPDATE; UPDATE subscriptions SET live = false WHERE uid = 'f1'")
            .await
            .unwrap();
        let claim = tokio::spawn({
            let store = store.clone();
            async move { store.claim_next("f1", 1_000).await }
        });
        let publish = tokio::spawn({
            let store = store.clone();
            async move { store.publish(event("evt-f2"), vec!["f1".into()]).await }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !claim.is_finished(),
            "a claim went ahead while the subscription was being removed: {:?}",
            claim.await
        );
        assert!(
            !publish.is_finished(),
            "a publish went ahead of the removal"
        );
        removal
            .execute("DELETE FROM deliveries WHERE sub_uid = 'f1' AND state IN (0, 1)")
            .await
            .unwrap();
        removal.execute("COMMIT").await.unwrap();
        assert!(matches!(
            claim.await.unwrap().unwrap(),
            Claim::Idle { next_due_ms: None }
        ));
        assert_eq!(publish.await.unwrap().unwrap().matched, 0);
        assert_eq!(
            store
                .subscription_state("f1")
                .await
                .unwrap()
                .unwrap()
                .pending,
            0
        );
        store.close().await;
    }

    /// Publishes to other subscriptions go ahead while one subscription's removal holds its
    /// row, though they are joined into the same group commits: only the publishes to that
    /// subscription wait (three of them, one per committer, before the others).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn publishes_to_others_do_not_wait_for_a_removal_in_progress() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = Arc::new(connect(&server).await);
        store.upsert_subscription(sub("held")).await.unwrap();
        store.upsert_subscription(sub("free")).await.unwrap();
        let mut removal = raw(&server.url).await;
        removal.execute("BEGIN").await.unwrap();
        removal
            .execute("SELECT 1 FROM subscriptions WHERE uid = 'held' FOR UPDATE; UPDATE subscriptions SET live = false WHERE uid = 'held'")
            .await
            .unwrap();
        let publish = |id: String, uid: &str| {
            let (store, targets) = (store.clone(), vec![uid.to_string()]);
            tokio::spawn(async move { store.publish(event(&id), targets).await })
        };
        let held: Vec<_> = (0..3)
            .map(|i| publish(format!("held-{i}"), "held"))
            .collect();
        let started = std::time::Instant::now();
        let free: Vec<_> = (0..40)
            .map(|i| publish(format!("free-{i}"), "free"))
            .collect();
        for f in free {
            let result = tokio::time::timeout(Duration::from_secs(10), f)
                .await
                .expect("a publish to another subscription waited for the removal")
                .unwrap()
                .unwrap();
            assert_eq!(result.matched, 1);
        }
        let took = started.elapsed();
        assert!(
            held.iter().all(|h| !h.is_finished()),
            "a publish went ahead of the removal"
        );
        removal.execute("COMMIT").await.unwrap();
        for h in held {
            assert_eq!(h.await.unwrap().unwrap().matched, 0);
        }
        println!("40 publishes beside a removal in progress took {took:?}");
        store.close().await;
    }

    /// One publish the server refuses (a NUL in a text column) fails alone; the publishes
    /// joined with it in a group commit are written.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_refused_publish_fails_alone() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = Arc::new(connect(&server).await);
        store.upsert_subscription(sub("s")).await.unwrap();
        let publishes: Vec<_> = (0..60)
            .map(|i| {
                let store = store.clone();
                let mut event = event(&format!("e-{i}"));
                if i == 30 {
                    event.event_type = "bad\0type".into();
                }
                tokio::spawn(async move { (i, store.publish(event, vec!["s".into()]).await) })
            })
            .collect();
        for p in publishes {
            match p.await.unwrap() {
                (30, result) => assert!(matches!(result, Err(Error::Backend(_))), "{result:?}"),
                (i, result) => assert_eq!(result.unwrap().matched, 1, "publish {i}"),
            }
        }
        assert_eq!(
            store
                .subscription_state("s")
                .await
                .unwrap()
                .unwrap()
                .pending,
            59
        );
        store.close().await;
    }

    /// Concurrent publishes share transactions (an event's `xmin` is the transaction that
    /// wrote it), and each is answered as written: a repeated id (often in the same batch
    /// as its first publish) once, as a repeat, and every lane's deliveries in the order of
    /// their events.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_publishes_share_commits() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = Arc::new(connect(&server).await);
        store.upsert_subscription(sub("s")).await.unwrap();
        store.upsert_subscription(sub("t")).await.unwrap();
        // Ids g-0..g-399, g-0..g-99 twice; every other one to both subscriptions.
        let publishes: Vec<_> = (0..500)
            .map(|i| {
                let store = store.clone();
                let n = if i < 400 { i } else { i - 400 };
                let targets: Vec<String> = if n % 2 == 0 {
                    vec!["s".into(), "t".into()]
                } else {
                    vec!["s".into()]
                };
                tokio::spawn(async move {
                    let answer = store.publish(event(&format!("g-{n}")), targets.clone());
                    (n, targets, answer.await.unwrap())
                })
            })
            .collect();
        let mut firsts = std::collections::HashMap::new();
        for p in publishes {
            let (n, targets, answer) = p.await.unwrap();
            if !answer.duplicate {
                assert_eq!(answer.targets, targets, "g-{n}");
                assert!(firsts.insert(n, ()).is_none(), "g-{n} written twice");
            }
            assert_eq!(answer.matched as usize, targets.len(), "g-{n}");
        }
        assert_eq!(firsts.len(), 400);
        let mut conn = raw(&server.url).await;
        let (events, transactions): (i64, i64) = sqlx_core::query_as::query_as(
            "SELECT count(*), count(DISTINCT xmin::text) FROM events WHERE event_id LIKE 'g-%'",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
        println!("500 concurrent publishes: {events} events in {transactions} transactions");
        assert_eq!(events, 400);
        // How many commits they shared is printed, not asserted: on a loaded machine the
        // committers find one publish queued at a time (CI saw 399 transactions for 400).
        // `queued_publishes_share_one_commit` holds them so that they must share.
        assert!(transactions <= events);
        // Per lane, a transaction's deliveries were made in the order of its events.
        // (Concurrent transactions' publishes have no order between them.)
        let disordered: i64 = sqlx_core::query_scalar::query_scalar(
            "SELECT count(*) FROM (
                 SELECT d.sub_uid, d.id, e.id AS event,
                        lag(e.id) OVER (PARTITION BY d.sub_uid, d.xmin::text ORDER BY d.id)
                            AS before
                 FROM deliveries d JOIN events e ON e.id = d.event
             ) l WHERE l.before > l.event",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
        assert_eq!(disordered, 0);
        let per_lane: Vec<(String, i64)> = sqlx_core::query_as::query_as(
            "SELECT sub_uid, count(*) FROM deliveries GROUP BY sub_uid ORDER BY sub_uid",
        )
        .fetch_all(&mut conn)
        .await
        .unwrap();
        assert_eq!(per_lane, vec![("s".into(), 400), ("t".into(), 200)]);
        // An event that matches nothing keeps its id but not its body.
        let none = store
            .publish(event("g-none"), vec!["nobody".into()])
            .await
            .unwrap();
        assert_eq!((none.matched, none.duplicate), (0, false));
        let kept: Vec<(String, i32, i32)> = sqlx_core::query_as::query_as(
            "SELECT event_id, octet_length(body), matched FROM events
             WHERE event_id IN ('g-0', 'g-1', 'g-none') ORDER BY event_id",
        )
        .fetch_all(&mut conn)
        .await
        .unwrap();
        assert_eq!(
            kept,
            vec![
                ("g-0".into(), 2, 2),
                ("g-1".into(), 2, 1),
                ("g-none".into(), 0, 0)
            ]
        );
        store.close().await;
    }

    /// Publishes handed to the committers while they wait for a connection are written
    /// together: with the pool held until all 100 are handed over, they take at most a
    /// transaction per committer (each took a batch before it waited) and one for the rest.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn queued_publishes_share_one_commit() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = Arc::new(connect(&server).await);
        store.upsert_subscription(sub("s")).await.unwrap();
        let mut held = Vec::new();
        for _ in 0..group_commit::COMMITTERS {
            held.push(store.committers.acquire().await.unwrap());
        }
        let publishes: Vec<_> = (0..100)
            .map(|i| {
                let store = store.clone();
                tokio::spawn(async move {
                    store
                        .publish(event(&format!("q-{i}")), vec!["s".into()])
                        .await
                })
            })
            .collect();
        // The committers' waits for a connection end at ACQUIRE_TIMEOUT (5 s).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(4);
        while store.publishes.sent() < 100 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let sent = store.publishes.sent();
        drop(held);
        for p in publishes {
            assert_eq!(p.await.unwrap().unwrap().matched, 1);
        }
        let mut conn = raw(&server.url).await;
        let transactions: i64 =
            query_scalar("SELECT count(DISTINCT xmin::text) FROM events WHERE event_id LIKE 'q-%'")
                .fetch_one(&mut conn)
                .await
                .unwrap();
        println!("100 publishes held at the pool: {transactions} transactions");
        assert_eq!(
            sent, 100,
            "the publishes were not all handed over within 4 s"
        );
        let bound = group_commit::COMMITTERS as i64 + 1;
        assert!(
            transactions <= bound,
            "{transactions} transactions, bound {bound}"
        );
        store.close().await;
    }

    /// Publishes that come while a commit is written wait for it and then go together in
    /// the next transaction, rather than each committer starting one with what little has
    /// come so far.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn publishes_queued_while_a_commit_is_written_go_in_the_next_one() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = Arc::new(connect(&server).await);
        store.upsert_subscription(sub("s")).await.unwrap();
        let publish = |id: String| {
            let store = store.clone();
            tokio::spawn(async move { store.publish(event(&id), vec!["s".into()]).await })
        };
        // The first commit waits for a connection, the pool's all held here.
        let mut held = Vec::new();
        for _ in 0..group_commit::COMMITTERS {
            held.push(store.committers.acquire().await.unwrap());
        }
        let mut publishes = vec![publish("first".into())];
        until("the first commit written", || {
            store.publishes.writing() == 1
        })
        .await;
        // The next committer takes one and waits for it (OVERLAP_AFTER is 1 s in tests),
        // holding the queue; the other nineteen wait there.
        publishes.extend((0..20).map(|i| publish(format!("w-{i}"))));
        until("the other twenty handed over", || {
            store.publishes.sent() == 21 && store.publishes.queued() == 19
        })
        .await;
        assert_eq!(
            store.publishes.writing(),
            1,
            "a second commit went beside it"
        );
        drop(held);
        for p in publishes {
            assert_eq!(p.await.unwrap().unwrap().matched, 1);
        }
        let mut conn = raw(&server.url).await;
        let transactions: i64 =
            query_scalar("SELECT count(DISTINCT xmin::text) FROM events WHERE event_id LIKE 'w-%'")
                .fetch_one(&mut conn)
                .await
                .unwrap();
        assert_eq!(
            transactions, 1,
            "the twenty that waited took {transactions} transactions"
        );
        store.close().await;
    }

    /// Records queued while the recorders wait for a connection are joined: 60 records of
    /// 40 lanes (20 with two attempts on the wire) take a few statements, not 60; each
    /// lane's attempts are all applied, one after the other (two failures count two), and
    /// a delivery's record claims its lane's next.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn queued_records_of_many_lanes_share_statements() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = Arc::new(connect(&server).await);
        let mut claims = Vec::new();
        for s in 0..40 {
            let uid = format!("lane{s}");
            store.upsert_subscription(sub(&uid)).await.unwrap();
            for e in 0..3 {
                store
                    .publish(event(&format!("r-{s}-{e}")), vec![uid.clone()])
                    .await
                    .unwrap();
            }
            for _ in 0..(if s < 20 { 2 } else { 1 }) {
                match store.claim_next(&uid, i64::MAX).await.unwrap() {
                    Claim::Claimed(claimed) => claims.push(claimed),
                    other => panic!("{uid}: {other:?}"),
                }
            }
        }
        let mut held = Vec::new();
        for _ in 0..completions::RECORDERS {
            held.push(store.recorders.acquire().await.unwrap());
        }
        // Lanes 0..20 fail both attempts; the others deliver and claim their next.
        let records: Vec<_> = claims
            .into_iter()
            .map(|claimed| {
                let store = store.clone();
                tokio::spawn(async move {
                    let lane: usize = claimed.subscription_uid[4..].parse().unwrap();
                    let (next, then_claim) = if lane < 20 {
                        (Next::Retry { due_ms: 50_000 }, None)
                    } else {
                        (Next::Delivered, Some(i64::MAX))
                    };
                    let recorded = store
                        .complete_and_claim(claimed.claim_ref(), attempt(), next, then_claim)
                        .await
                        .unwrap();
                    (lane, recorded)
                })
            })
            .collect();
        // Every record handed over, each in the queue or in a recorder's batch waiting for
        // a connection (those waits end at ACQUIRE_TIMEOUT, 5 s).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(4);
        while store.completions.sent() < 60 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let sent = store.completions.sent();
        drop(held);
        for record in records {
            let (lane, (completion, following)) = record.await.unwrap();
            assert!(completion.recorded, "lane{lane}");
            if lane < 20 {
                assert!(following.is_none(), "lane{lane}");
            } else {
                let next = following.unwrap_or_else(|| panic!("lane{lane}: nothing claimed"));
                assert_eq!(next.subscription_uid, format!("lane{lane}"));
                assert_eq!(next.attempt, 1);
            }
        }
        for s in 0..40 {
            let state = store
                .subscription_state(&format!("lane{s}"))
                .await
                .unwrap()
                .unwrap();
            if s < 20 {
                assert_eq!((state.delivered, state.failed), (0, 2), "lane{s}");
                assert_eq!(state.consecutive_failures, 2, "lane{s}");
            } else {
                assert_eq!((state.delivered, state.failed), (1, 0), "lane{s}");
            }
        }
        let mut conn = raw(&server.url).await;
        let (logged, statements): (i64, i64) = sqlx_core::query_as::query_as(
            "SELECT count(*), count(DISTINCT xmin::text) FROM attempt_log",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
        println!("60 records held at the pool: {statements} statements");
        assert_eq!(sent, 60, "the records were not all handed over within 4 s");
        assert_eq!(logged, 60);
        // Each recorder took a batch before it waited (one record, or all that were
        // queued), and writes it in a statement and the second attempts of its lanes in
        // one more.
        let bound = 2 * completions::RECORDERS as i64;
        assert!(
            statements <= bound,
            "{statements} statements, bound {bound}"
        );
        store.close().await;
    }

    /// Claims queued while the claimers wait for a connection are joined: 60 claims of 40
    /// lanes (20 claiming twice) take a few statements, not 60, and each claim gets a
    /// delivery of its own lane, a lane's two claims two different ones.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn queued_claims_of_many_lanes_share_statements() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = Arc::new(connect(&server).await);
        for s in 0..40 {
            let uid = format!("lane{s}");
            store.upsert_subscription(sub(&uid)).await.unwrap();
            for e in 0..3 {
                store
                    .publish(event(&format!("c-{s}-{e}")), vec![uid.clone()])
                    .await
                    .unwrap();
            }
        }
        let mut held = Vec::new();
        for _ in 0..claims::CLAIMERS {
            held.push(store.claimers.acquire().await.unwrap());
        }
        let claiming: Vec<_> = (0..40)
            .flat_map(|s| std::iter::repeat_n(s, if s < 20 { 2 } else { 1 }))
            .map(|s| {
                let store = store.clone();
                tokio::spawn(async move {
                    let uid = format!("lane{s}");
                    (uid.clone(), store.claim_next(&uid, i64::MAX).await.unwrap())
                })
            })
            .collect();
        until("every claim handed over", || store.claims.sent() == 60).await;
        drop(held);
        let mut taken = HashSet::new();
        for claim in claiming {
            match claim.await.unwrap() {
                (uid, Claim::Claimed(c)) => {
                    assert_eq!(c.subscription_uid, uid);
                    assert_eq!(c.attempt, 1);
                    assert!(
                        taken.insert(c.delivery_id),
                        "{uid}: a delivery claimed twice"
                    );
                }
                (uid, other) => panic!("{uid}: {other:?}"),
            }
        }
        assert_eq!(taken.len(), 60);
        let mut conn = raw(&server.url).await;
        let statements: i64 =
            query_scalar("SELECT count(DISTINCT xmin::text) FROM deliveries WHERE state = 1")
                .fetch_one(&mut conn)
                .await
                .unwrap();
        println!("60 claims held at the pool: {statements} statements");
        // Each claimer took a batch before it waited (one claim, or all that were queued),
        // and writes it in a statement and the second claims of its lanes in one more.
        let bound = 2 * claims::CLAIMERS as i64;
        assert!(
            statements <= bound,
            "{statements} statements, bound {bound}"
        );
        store.close().await;
    }

    /// Claims of other lanes go ahead while removals hold two subscriptions' rows (as many
    /// as there are claimers), though they are joined into the same statements: only those
    /// lanes' claims wait, and then find nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn claims_of_others_do_not_wait_for_a_removal_in_progress() {
        let Some(server) = Postgres::start() else {
            return;
        };
        assert_eq!(claims::CLAIMERS, 2, "one held lane per claimer");
        let store = Arc::new(connect(&server).await);
        for uid in ["held1", "held2", "free"] {
            store.upsert_subscription(sub(uid)).await.unwrap();
            for e in 0..5 {
                store
                    .publish(event(&format!("{uid}-{e}")), vec![uid.into()])
                    .await
                    .unwrap();
            }
        }
        let mut removal = raw(&server.url).await;
        removal.execute("BEGIN").await.unwrap();
        removal
            .execute("SELECT 1 FROM subscriptions WHERE uid IN ('held1', 'held2') ORDER BY uid FOR UPDATE; UPDATE subscriptions SET live = false WHERE uid IN ('held1', 'held2')")
            .await
            .unwrap();
        let mut held = Vec::new();
        for uid in ["held1", "held2"] {
            let claiming = store.clone();
            held.push(tokio::spawn(async move {
                claiming.claim_next(uid, i64::MAX).await
            }));
            let sent = held.len();
            until("a held lane's claim handed over", || {
                store.claims.sent() == sent
            })
            .await;
        }
        // Each in a batch with a held lane's claim, or after them: none waits for them.
        for _ in 0..5 {
            let claimed =
                tokio::time::timeout(Duration::from_secs(3), store.claim_next("free", i64::MAX))
                    .await
                    .expect("a claim of another lane waited for the removals")
                    .unwrap();
            assert!(matches!(claimed, Claim::Claimed(_)), "{claimed:?}");
        }
        assert!(
            held.iter().all(|h| !h.is_finished()),
            "a held lane's claim did not wait"
        );
        removal.execute("COMMIT").await.unwrap();
        for h in held {
            let claimed = h.await.unwrap().unwrap();
            assert!(
                matches!(claimed, Claim::Idle { next_due_ms: None }),
                "{claimed:?}"
            );
        }
        store.close().await;
    }

    /// A record left for the next statement (a second attempt of its lane) is written when
    /// no other record comes: its recorder does not wait for the queue, which another
    /// recorder holds while it waits for records.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_record_left_for_the_next_statement_is_written_when_nothing_else_comes() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = Arc::new(connect(&server).await);
        let mut claims = std::collections::HashMap::new();
        for (uid, attempts) in [("f0", 1), ("f1", 1), ("f2", 1), ("lane", 2)] {
            store.upsert_subscription(sub(uid)).await.unwrap();
            for e in 0..attempts {
                store
                    .publish(event(&format!("{uid}-{e}")), vec![uid.into()])
                    .await
                    .unwrap();
                match store.claim_next(uid, i64::MAX).await.unwrap() {
                    Claim::Claimed(claimed) => claims.insert(format!("{uid}-{e}"), claimed),
                    other => panic!("{uid}: {other:?}"),
                };
            }
        }
        let record = |key: &str| record_retry(&store, claims[key].clone());
        let mut held = Vec::new();
        for _ in 0..completions::RECORDERS {
            held.push(store.recorders.acquire().await.unwrap());
        }
        // Each recorder takes one of f0..f2 and waits for a connection (the second and the
        // third once the first has not returned within OVERLAP_AFTER); both of lane's
        // records then wait in the queue, to be taken together by one recorder.
        let queued_within = |sent: usize, queued: usize, writing: usize| {
            let store = store.clone();
            async move {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(4);
                while store.completions.sent() != sent
                    || store.completions.queued() != queued
                    || store.completions.writing() != writing
                {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "never {sent} sent, {queued} queued and {writing} statements written"
                    );
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        };
        let mut records = Vec::new();
        for (n, key) in ["f0-0", "f1-0", "f2-0"].into_iter().enumerate() {
            records.push(record(key));
            queued_within(n + 1, 0, n + 1).await;
        }
        records.push(record("lane-0"));
        records.push(record("lane-1"));
        queued_within(5, 2, 3).await;
        drop(held);
        let all = tokio::time::timeout(Duration::from_secs(10), async {
            for record in records {
                assert!(record.await.unwrap().unwrap().recorded);
            }
        })
        .await;
        assert!(all.is_ok(), "a record waited for records that never came");
        let state = store.subscription_state("lane").await.unwrap().unwrap();
        assert_eq!(state.failed, 2);
        store.close().await;
    }

    /// Records that come while a statement is written wait for it and then go together in
    /// the next, rather than each in a statement of its own beside it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn records_queued_while_a_statement_is_written_go_in_the_next_one() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = Arc::new(connect(&server).await);
        let claims = one_claim_each(&store, "w", 6).await;
        let record = |claimed: Claimed| record_retry(&store, claimed);
        // The first statement waits for a connection, the pool's all held here.
        let mut held = Vec::new();
        for _ in 0..completions::RECORDERS {
            held.push(store.recorders.acquire().await.unwrap());
        }
        let mut claims = claims.into_iter();
        let mut records = vec![record(claims.next().unwrap())];
        until("the first statement written", || {
            store.completions.writing() == 1
        })
        .await;
        // The next recorder takes one and waits for it (OVERLAP_AFTER is 1 s in tests),
        // holding the queue; the other four wait there.
        records.extend(claims.map(record));
        until("the other five handed over", || {
            store.completions.sent() == 6 && store.completions.queued() == 4
        })
        .await;
        assert_eq!(
            store.completions.writing(),
            1,
            "a second statement went beside it"
        );
        drop(held);
        for r in records {
            assert!(r.await.unwrap().unwrap().recorded);
        }
        let mut conn = raw(&server.url).await;
        let statements: i64 = query_scalar(
            "SELECT count(DISTINCT l.xmin::text) FROM attempt_log l
             JOIN deliveries d ON d.id = l.delivery WHERE d.sub_uid <> 'w0'",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
        assert_eq!(
            statements, 1,
            "the five records that waited took {statements} statements"
        );
        store.close().await;
    }

    /// A record of a batch too small to share the statement's cost waits briefly for the
    /// records of attempts claimed moments ago, and they go in one statement (which
    /// attempts count: on_wire's own test).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_small_batch_waits_for_attempts_just_claimed() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = Arc::new(connect(&server).await);
        // Long enough to tell waiting from a slow machine.
        store
            .on_wire
            .set_waits(Duration::from_secs(1), Duration::from_secs(5));
        let claims = one_claim_each(&store, "g", 2).await;
        let record = |claimed: Claimed| record_retry(&store, claimed);
        let mut claims = claims.into_iter();
        let first = record(claims.next().unwrap());
        // The first record is taken by a recorder, which waits for the second (claimed just
        // now, and waits up to 1 s here) rather than writing it alone.
        until("the first record handed over", || {
            store.completions.sent() == 1 && store.completions.queued() == 0
        })
        .await;
        assert_eq!(store.completions.writing(), 0, "written without waiting");
        let second = record(claims.next().unwrap());
        assert!(first.await.unwrap().unwrap().recorded);
        assert!(second.await.unwrap().unwrap().recorded);
        let mut conn = raw(&server.url).await;
        let statements: i64 = query_scalar("SELECT count(DISTINCT xmin::text) FROM attempt_log")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert_eq!(
            statements, 1,
            "the two records took {statements} statements"
        );
        store.close().await;
    }

    /// Requests of one kind in a stream (at a rate that brings one more within the wait)
    /// wait briefly for more and are written together; one after a quiet moment, or the
    /// first, waits for nothing. `ask(n)` spawns
    /// the n-th request (0 to 3), `queue` reads how many were sent, are queued and are being
    /// written, `check` asserts an answer, and `statements` (run on the server at `url`)
    /// counts the statements that wrote requests 1 and 2.
    async fn stream_waits_for_more_and_after_quiet_for_none<T: std::fmt::Debug + Send + 'static>(
        stream: &stream::Stream,
        ask: impl Fn(usize) -> tokio::task::JoinHandle<T>,
        queue: impl Fn() -> (usize, usize, usize),
        check: impl Fn(T, &str),
        (url, statements): (&str, &str),
    ) {
        // Waits long enough to tell waiting from a slow machine; the rate remembers a
        // request for about a second (so one within a second brings another within 4 s).
        let (gather_for, memory) = (Duration::from_secs(4), Duration::from_secs(1));
        stream.set_waits(gather_for, memory);
        let promptly =
            async |asking: tokio::task::JoinHandle<T>, what: &str| match tokio::time::timeout(
                gather_for / 2,
                asking,
            )
            .await
            {
                Ok(answer) => check(answer.unwrap(), what),
                Err(_) => panic!("{what} waited for requests that were not coming"),
            };
        promptly(ask(0), "the first request").await;
        // Right after it: taken, and held for more.
        let second = ask(1);
        until("the second request handed over", || {
            let (sent, queued, _) = queue();
            sent == 2 && queued == 0
        })
        .await;
        assert_eq!(queue().2, 0, "written without waiting");
        let third = ask(2);
        for asking in [second, third] {
            check(asking.await.unwrap(), "a request in the stream");
        }
        let statements: i64 = query_scalar(statements)
            .fetch_one(&mut raw(url).await)
            .await
            .unwrap();
        assert_eq!(
            statements, 1,
            "the two requests took {statements} statements"
        );
        // A quiet moment (the thing under test, not a wait for something to happen): the
        // three requests' rate, about 3 a second, keeps e^-4 of itself, 0.05 a second: 0.2
        // of a request within the wait, less than a wait must expect.
        tokio::time::sleep(memory * 4).await;
        promptly(ask(3), "a request after a quiet moment").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn claims_in_a_stream_wait_for_more_and_after_quiet_for_none() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = Arc::new(connect(&server).await);
        for s in 0..4 {
            let uid = format!("c{s}");
            store.upsert_subscription(sub(&uid)).await.unwrap();
            store
                .publish(event(&format!("c-{s}")), vec![uid])
                .await
                .unwrap();
        }
        stream_waits_for_more_and_after_quiet_for_none(
            &store.claim_stream,
            |n| {
                let store = store.clone();
                tokio::spawn(async move { store.claim_next(&format!("c{n}"), i64::MAX).await })
            },
            || {
                let claims = &store.claims;
                (claims.sent(), claims.queued(), claims.writing())
            },
            |claim, what| assert!(matches!(claim, Ok(Claim::Claimed(_))), "{what}: {claim:?}"),
            (
                &server.url,
                "SELECT count(DISTINCT xmin::text) FROM deliveries WHERE sub_uid IN ('c1', 'c2')",
            ),
        )
        .await;
        store.close().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn publishes_in_a_stream_wait_for_more_and_after_quiet_for_none() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = Arc::new(connect(&server).await);
        store.upsert_subscription(sub("p")).await.unwrap();
        stream_waits_for_more_and_after_quiet_for_none(
            store.publishes.stream(),
            |n| {
                let store = store.clone();
                tokio::spawn(async move {
                    store
                        .publish(event(&format!("p-{n}")), vec!["p".into()])
                        .await
                })
            },
            || {
                let publishes = &store.publishes;
                (publishes.sent(), publishes.queued(), publishes.writing())
            },
            |published, what| match published {
                Ok(published) => assert_eq!(published.matched, 1, "{what}"),
                Err(e) => panic!("{what}: {e}"),
            },
            (
                &server.url,
                "SELECT count(DISTINCT xmin::text) FROM events WHERE event_id IN ('p-1', 'p-2')",
            ),
        )
        .await;
        store.close().await;
    }

    /// Claims, publishes and completions racing a removal: once `remove_subscription` has
    /// returned, nothing of the subscription is pending or in flight, no claim succeeds,
    /// and no completion of an attempt that was on the wire records anything.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn removal_racing_claims_and_publishes_leaves_nothing_to_claim() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = Arc::new(connect(&server).await);
        for round in 0..20 {
            let uid = format!("race{round}");
            store.upsert_subscription(sub(&uid)).await.unwrap();
            for i in 0..20 {
                store
                    .publish(event(&format!("{uid}-pre{i}")), vec![uid.clone()])
                    .await
                    .unwrap();
            }
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let mut workers = Vec::new();
            for n in 0..4 {
                let (store, uid, stop) = (store.clone(), uid.clone(), stop.clone());
                workers.push(tokio::spawn(async move {
                    let mut claimed = Vec::new();
                    let mut i = 0;
                    while !stop.load(std::sync::atomic::Ordering::Acquire) {
                        if n % 2 == 0 {
                            if let Claim::Claimed(c) = store.claim_next(&uid, 1_000).await.unwrap()
                            {
                                claimed.push(c.claim_ref());
                            }
                        } else {
                            i += 1;
                            store
                                .publish(event(&format!("{uid}-{n}-{i}")), vec![uid.clone()])
                                .await
                                .unwrap();
                        }
                    }
                    claimed
                }));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            store.remove_subscription(&uid).await.unwrap();
            let state = store.subscription_state(&uid).await.unwrap().unwrap();
            assert_eq!(
                (state.live, state.pending),
                (false, 0),
                "{uid} right after removal"
            );
            assert!(matches!(
                store.claim_next(&uid, i64::MAX).await.unwrap(),
                Claim::Idle { next_due_ms: None }
            ));
            stop.store(true, std::sync::atomic::Ordering::Release);
            let mut claimed = Vec::new();
            for worker in workers {
                claimed.extend(worker.await.unwrap());
            }
            for claim in claimed {
                let done = store
                    .complete(claim, attempt(), Next::Retry { due_ms: 0 })
                    .await
                    .unwrap();
                assert!(!done.recorded, "{uid}: a purged attempt scheduled a retry");
            }
            let state = store.subscription_state(&uid).await.unwrap().unwrap();
            assert_eq!(state.pending, 0, "{uid}: work appeared after the removal");
        }
        store.close().await;
    }

    /// The shard fence, step by step: while a take-over is in progress (the new epoch
    /// written, not committed), a claim under the old epoch waits for it, then claims
    /// nothing; the new epoch claims.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_stale_epoch_waits_for_a_take_over_in_progress_then_claims_nothing() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = Arc::new(connect(&server).await);
        let fence = |epoch| ShardFence { shard: 7, epoch };
        store
            .upsert_subscription(SubscriptionRecord {
                shard: 7,
                ..sub("g1")
            })
            .await
            .unwrap();
        assert!(store.take_shard(7, "replica-a", 1, 100).await.unwrap());
        for i in 0..2 {
            store
                .publish(event(&format!("evt-g{i}")), vec!["g1".into()])
                .await
                .unwrap();
        }
        let mut take_over = raw(&server.url).await;
        take_over.execute("BEGIN").await.unwrap();
        take_over
            .execute("UPDATE shard_owners SET epoch = 2, holder = 'replica-b' WHERE shard = 7")
            .await
            .unwrap();
        let stale = tokio::spawn({
            let store = store.clone();
            async move { store.claim_fenced("g1", 1_000, fence(1)).await }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !stale.is_finished(),
            "a claim under the old epoch went ahead during the take-over: {:?}",
            stale.await
        );
        take_over.execute("COMMIT").await.unwrap();
        assert!(matches!(stale.await.unwrap().unwrap(), Claim::Idle { .. }));
        assert!(matches!(
            store.claim_fenced("g1", 1_000, fence(2)).await.unwrap(),
            Claim::Claimed(_)
        ));
        store.close().await;
    }

    /// Claims under the old epoch racing `take_shard`: once it has returned, nothing of the
    /// shard is in flight (what the old holder took is due again) and the old epoch claims
    /// nothing more.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn take_over_racing_old_claims_leaves_nothing_in_flight() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = Arc::new(connect(&server).await);
        store
            .upsert_subscription(SubscriptionRecord {
                shard: 5,
                ..sub("t1")
            })
            .await
            .unwrap();
        for i in 0..400 {
            store
                .publish(event(&format!("evt-t{i}")), vec!["t1".into()])
                .await
                .unwrap();
        }
        for epoch in 1..=20 {
            assert!(store.take_shard(5, "old", epoch, 100).await.unwrap());
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let claimers: Vec<_> = (0..3)
                .map(|_| {
                    let (store, stop) = (store.clone(), stop.clone());
                    tokio::spawn(async move {
                        while !stop.load(std::sync::atomic::Ordering::Acquire) {
                            let fence = ShardFence { shard: 5, epoch };
                            store.claim_fenced("t1", 1_000, fence).await.unwrap();
                        }
                    })
                })
                .collect();
            tokio::time::sleep(Duration::from_millis(10)).await;
            // The take-over, while the old holder keeps claiming.
            let new_epoch = 1_000 + epoch;
            assert!(store.take_shard(5, "new", new_epoch, 200).await.unwrap());
            let in_flight: i64 =
                query_scalar("SELECT count(*) FROM deliveries WHERE sub_uid = 't1' AND state = 1")
                    .fetch_one(&store.relaxed)
                    .await
                    .unwrap();
            assert_eq!(in_flight, 0, "round {epoch}: in flight after the take-over");
            assert!(matches!(
                store
                    .claim_fenced("t1", 1_000, ShardFence { shard: 5, epoch })
                    .await
                    .unwrap(),
                Claim::Idle { .. }
            ));
            stop.store(true, std::sync::atomic::Ordering::Release);
            for claimer in claimers {
                claimer.await.unwrap();
            }
            let in_flight: i64 =
                query_scalar("SELECT count(*) FROM deliveries WHERE sub_uid = 't1' AND state = 1")
                    .fetch_one(&store.relaxed)
                    .await
                    .unwrap();
            assert_eq!(
                in_flight, 0,
                "round {epoch}: the old epoch claimed afterwards"
            );
            // Back to a low epoch, so that the next round starts with an "old" holder again.
            query("UPDATE shard_owners SET epoch = 0 WHERE shard = 5")
                .execute(&store.relaxed)
                .await
                .unwrap();
        }
        store.close().await;
    }

    fn attempt() -> AttemptRecord {
        AttemptRecord {
            at_ms: 2_000,
            outcome: "Transient".into(),
            status_code: Some(503),
            latency_ms: 1,
            message: "m".into(),
        }
    }

    /// The server going away: every operation answers `Unavailable` within its deadline
    /// (nothing hangs, nothing panics), the readiness check fails, and once the server is
    /// back the same store works again by itself.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_outage_is_unavailable_and_heals_by_itself() {
        let Some(server) = Postgres::start() else {
            return;
        };
        let store = connect(&server).await;
        store.upsert_subscription(sub("o1")).await.unwrap();
        store
            .publish(event("evt-o1"), vec!["o1".into()])
            .await
            .unwrap();
        store.check_writable().await.unwrap();

        server.stop();
        let began = std::time::Instant::now();
        let answers = [
            store.check_writable().await.map(|_| ()),
            store
                .publish(event("evt-o2"), vec!["o1".into()])
                .await
                .map(|_| ()),
            store.claim_next("o1", 1_000).await.map(|_| ()),
            store.remove_subscription("o1").await.map(|_| ()),
        ];
        for answer in &answers {
            assert!(
                matches!(answer, Err(Error::Unavailable(_))),
                "during the outage: {answer:?}"
            );
        }
        assert!(
            began.elapsed() < 4 * (ACQUIRE_TIMEOUT + Duration::from_secs(2)),
            "answers took {:?}",
            began.elapsed()
        );

        server.restart();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while let Err(e) = store.check_writable().await {
            assert!(
                std::time::Instant::now() < deadline,
                "still not writable after the restart: {e}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Nothing acknowledged was lost; what failed was not written.
        let duplicate = store
            .publish(event("evt-o1"), vec!["o1".into()])
            .await
            .unwrap();
        assert!(duplicate.duplicate);
        assert_eq!(store.published("ns", "evt-o2").await.unwrap(), None);
        let Claim::Claimed(c) = store.claim_next("o1", 1_000).await.unwrap() else {
            panic!("the acknowledged event is not claimable after the outage");
        };
        assert_eq!(c.event_id, "evt-o1");
        store.close().await;
    }

    #[tokio::test]
    async fn the_url_password_is_redacted() {
        let url =
            "postgres://herald:s3cr%2Ft@db.example:5432/herald?sslmode=require&password=other";
        let shown = redact_url(url);
        assert!(!shown.contains("s3cr"), "{shown}");
        assert!(!shown.contains("other"), "{shown}");
        assert_eq!(
            shown,
            "postgres://herald:REDACTED@db.example:5432/herald?sslmode=require&password=REDACTED"
        );
        assert_eq!(
            redact_url("postgres://db.example/herald"),
            "postgres://db.example/herald"
        );
        assert!(!redact_url("postgres://u:pw@[bad").contains("pw"));
    }
}
