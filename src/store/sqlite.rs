//! The embedded store: SQLite in WAL mode behind one writer thread that commits in groups;
//! commits that acknowledge events or change subscriptions are synced to disk
//! (`synchronous=FULL`, see [`Durability`]).
//!
//! Why SQLite: it needs no server (herald works with zero setup), its transactions make the
//! claim-and-fence one atomic step, and it is durable on disk. Why one writer thread with
//! group commit: every operation is a short transaction, and SQLite serialises writers
//! anyway; batching the operations that queue up while a commit is being synced into one
//! transaction makes one fsync acknowledge many events, so durability costs little
//! throughput. Each operation runs in its own savepoint, so one failing operation never
//! undoes another, and no caller hears "done" before the commit that holds its work.
//!
//! Reads (a subscription's state and backlog, attempt history, listings) run on
//! [`READERS`] read-only connections of their own, on threads at a lower CPU priority: WAL
//! lets them read while the writer commits, and no read ever runs in the writer's
//! transaction, where a tenant allowed only to read once held up every namespace's
//! publishes.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use rusqlite::config::DbConfig;
use rusqlite::{Connection, OptionalExtension, params};
use tokio::sync::{mpsc, oneshot};

use super::*;

/// Most operations folded into one transaction.
const MAX_GROUP: usize = 512;

type Finisher = Box<dyn FnOnce(Result<(), String>) + Send>;
type Job = (Durability, Box<dyn FnOnce(&Connection) -> Finisher + Send>);

/// Whether an operation's commit must reach the disk before its caller hears "done".
///
/// Acknowledging an event, purging a removed subscription, and every change of what a
/// subscription is must survive power loss: `Synced` commits with `synchronous=FULL`.
/// Claims, attempt results and reads only move work along; losing the last of them to a
/// power cut (never to a process crash: the WAL is written either way) means at worst that
/// an attempt is made again, which at-least-once delivery allows. Those commit `Relaxed`
/// (`synchronous=NORMAL`), unless they share a group with a `Synced` operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Durability {
    Synced,
    Relaxed,
}

pub struct SqliteStore {
    jobs: mpsc::UnboundedSender<Job>,
    /// The last write failed for want of space or I/O: cleared by the next that commits.
    failing: Arc<AtomicBool>,
    reads: std::sync::mpsc::Sender<ReadJob>,
    /// The folder the database is in, and its free space when last looked at.
    dir: std::path::PathBuf,
    free: std::sync::Mutex<Option<(std::time::Instant, u64)>>,
}

/// How long a look at the folder's free space is used for admission before the next.
const FREE_SPACE_TTL: std::time::Duration = std::time::Duration::from_millis(250);

/// Read-only connections (threads), each reading in its own transaction.
pub const READERS: usize = 2;
/// How much less CPU a reader thread gets than herald's other threads when they compete
/// (a nice value: 10 weighs about a tenth of 0).
const READER_NICE: i32 = 10;

type ReadJob = Box<dyn FnOnce(&Connection) + Send>;

/// Whether an error means the disk cannot take writes (full, or failing I/O).
fn disk_error(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(rusqlite::ErrorCode::DiskFull | rusqlite::ErrorCode::SystemIoFailure)
    )
}

const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS subscriptions (
    uid TEXT PRIMARY KEY,
    namespace TEXT NOT NULL,
    name TEXT NOT NULL,
    live INTEGER NOT NULL DEFAULT 1,
    paused INTEGER NOT NULL DEFAULT 0,
    disabled INTEGER NOT NULL DEFAULT 0,
    disable_after INTEGER NOT NULL DEFAULT 0,
    consecutive_failures INTEGER NOT NULL DEFAULT 0,
    delivered INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    dead_lettered INTEGER NOT NULL DEFAULT 0,
    shard INTEGER NOT NULL DEFAULT 0,
    gone INTEGER NOT NULL DEFAULT 0,
    strict_order INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    namespace TEXT NOT NULL,
    event_id TEXT NOT NULL,
    event_type TEXT NOT NULL,
    body BLOB NOT NULL,
    published_ms INTEGER NOT NULL,
    matched INTEGER NOT NULL,
    UNIQUE (namespace, event_id)
);
-- One row per (event, subscription). state: 0 pending, 1 in flight, 2 delivered, 3 dead.
CREATE TABLE IF NOT EXISTS deliveries (
    id INTEGER PRIMARY KEY,
    event INTEGER NOT NULL,
    sub_uid TEXT NOT NULL,
    state INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    due_ms INTEGER NOT NULL,
    window_start_ms INTEGER NOT NULL,
    finished_ms INTEGER,
    -- Of a strict-order subscription (see deliveries_order, made in migrate).
    strict INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS deliveries_lane ON deliveries (sub_uid, state, due_ms, id);
CREATE INDEX IF NOT EXISTS deliveries_event ON deliveries (event);
CREATE TABLE IF NOT EXISTS attempt_log (
    id INTEGER PRIMARY KEY,
    delivery INTEGER NOT NULL,
    at_ms INTEGER NOT NULL,
    outcome TEXT NOT NULL,
    status_code INTEGER,
    latency_ms INTEGER NOT NULL,
    message TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS attempt_log_delivery ON attempt_log (delivery, id);
CREATE INDEX IF NOT EXISTS attempt_log_at ON attempt_log (at_ms);
-- Shards several replicas share: the current lease epoch of each, and every taking.
CREATE TABLE IF NOT EXISTS shard_owners (
    shard INTEGER PRIMARY KEY,
    holder TEXT NOT NULL,
    epoch INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS shard_history (
    shard INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    holder TEXT NOT NULL,
    at_ms INTEGER NOT NULL,
    PRIMARY KEY (shard, epoch)
);
-- One row, rewritten to learn whether the store can commit again after a failure.
CREATE TABLE IF NOT EXISTS health (id INTEGER PRIMARY KEY, at_ms INTEGER NOT NULL, pad BLOB);
"#;

fn backend(e: rusqlite::Error) -> Error {
    Error::Backend(e.to_string())
}

/// Turns off SQLite's memory statistics, once per process and before its first connection
/// (SQLite takes its settings only before it initialises). With them on, every allocation
/// SQLite makes takes a process-wide mutex to count it: 4.8% of the store writer's CPU in a
/// profile of the end-to-end benchmark, 1.2% without. herald never reads those statistics.
#[allow(unsafe_code)]
fn configure_sqlite() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: sqlite3_config with SQLITE_CONFIG_MEMSTATUS takes one int. Called before
        // SQLite initialises, it changes a global setting; after, it only answers
        // SQLITE_MISUSE (something in this process opened a database first), changing nothing.
        let rc = unsafe {
            rusqlite::ffi::sqlite3_config(
                rusqlite::ffi::SQLITE_CONFIG_MEMSTATUS,
                0 as std::ffi::c_int,
            )
        };
        if rc != rusqlite::ffi::SQLITE_OK {
            tracing::debug!(
                rc,
                "store: SQLite was initialised before herald configured it"
            );
        }
    });
}

impl SqliteStore {
    /// Opens (creating if needed) `dir/herald.db`.
    pub fn open(dir: &Path) -> Result<Self> {
        configure_sqlite();
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::Unavailable(format!("creating {}: {e}", dir.display())))?;
        let path = dir.join("herald.db");
        let conn = Connection::open(&path)
            .map_err(|e| Error::Unavailable(format!("{}: {e}", path.display())))?;
        // A 4 MiB page cache: claims, completions and publishes touch few pages (the lanes'
        // index leaves and the tables' newest pages); the rest of a backlog of 1,000,000
        // pending attempts stays in the kernel's page cache, not in herald's memory.
        conn.execute_batch(
            "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL; PRAGMA foreign_keys=OFF;
             PRAGMA busy_timeout=5000; PRAGMA cache_size=-4096;",
        )
        .map_err(backend)?;
        conn.execute_batch(SCHEMA).map_err(backend)?;
        migrate(&conn).map_err(backend)?;
        // Room for every statement herald prepares, so none is parsed twice.
        conn.set_prepared_statement_cache_capacity(128);
        // Plans that do not depend on bound values. Without this SQLite marks statements
        // whose plan might change with a parameter, and clearing their bindings (which the
        // statement cache does on every reuse) makes it parse and plan them again: the claim
        // and the completion were re-prepared on every call, a third of the writer's time.
        conn.set_db_config(DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true)
            .map_err(backend)?;
        let (jobs, rx) = mpsc::unbounded_channel();
        let failing = Arc::new(AtomicBool::new(false));
        let writer_failing = failing.clone();
        std::thread::Builder::new()
            .name("herald-store".into())
            .spawn(move || writer(conn, rx, writer_failing))
            .map_err(|e| Error::Unavailable(e.to_string()))?;
        let (reads, queue) = std::sync::mpsc::channel::<ReadJob>();
        let queue = Arc::new(std::sync::Mutex::new(queue));
        for n in 0..READERS {
            let conn = open_reader(&path)?;
            let queue = queue.clone();
            std::thread::Builder::new()
                .name(format!("herald-read-{n}"))
                .spawn(move || reader(conn, queue))
                .map_err(|e| Error::Unavailable(e.to_string()))?;
        }
        Ok(Self {
            jobs,
            failing,
            reads,
            dir: dir.to_path_buf(),
            free: std::sync::Mutex::new(None),
        })
    }

    /// Runs `op` on a reader connection, in a read transaction of its own.
    async fn read<T: Send + 'static>(
        &self,
        op: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T> {
        let (reply, answer) = oneshot::channel();
        let job: ReadJob = Box::new(move |conn| {
            let result = conn
                .unchecked_transaction()
                .and_then(|tx| {
                    let value = op(&tx)?;
                    tx.commit()?;
                    Ok(value)
                })
                .map_err(backend);
            let _ = reply.send(result);
        });
        self.reads
            .send(job)
            .map_err(|_| Error::Unavailable("the store's readers have stopped".into()))?;
        answer
            .await
            .map_err(|_| Error::Unavailable("the store's readers have stopped".into()))?
    }

    /// Test knob: caps the database at this many pages, as a full disk would.
    #[cfg(test)]
    pub(crate) async fn set_max_page_count(&self, pages: u64) -> Result<()> {
        self.run(Durability::Relaxed, move |conn| {
            conn.query_row(&format!("PRAGMA max_page_count = {pages}"), [], |_| Ok(()))
        })
        .await
    }

    /// Runs `op` on the writer thread inside the next group transaction; answers after the
    /// commit.
    async fn run<T: Send + 'static>(
        &self,
        durability: Durability,
        op: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T> {
        let (reply, answer) = oneshot::channel();
        let failing = self.failing.clone();
        let job: Job = (
            durability,
            Box::new(move |conn| {
                let result = savepoint(conn, op);
                Box::new(move |commit: Result<(), String>| {
                    let outcome = match (commit, result) {
                        (Ok(()), Ok(value)) => {
                            failing.store(false, Ordering::Release);
                            Ok(value)
                        }
                        (_, Err(e)) if disk_error(&e) => {
                            failing.store(true, Ordering::Release);
                            Err(Error::Unavailable(e.to_string()))
                        }
                        (_, Err(e)) => Err(backend(e)),
                        (Err(e), Ok(_)) => {
                            failing.store(true, Ordering::Release);
                            Err(Error::Unavailable(format!("commit failed: {e}")))
                        }
                    };
                    let _ = reply.send(outcome);
                })
            }),
        );
        self.jobs
            .send(job)
            .map_err(|_| Error::Unavailable("the store's writer has stopped".into()))?;
        answer
            .await
            .map_err(|_| Error::Unavailable("the store's writer has stopped".into()))?
    }
}

/// Bytes an unprivileged process may still write in the file system holding `dir`.
#[allow(unsafe_code)]
fn available_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs reads a NUL-terminated path and fills the struct it is given, which
    // is plain data and zeroed beforehand.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statvfs(path.as_ptr(), &mut stat) };
    (rc == 0).then(|| stat.f_bavail.saturating_mul(stat.f_frsize))
}

/// A read-only connection to the store the writer opened.
fn open_reader(path: &Path) -> Result<Connection> {
    use rusqlite::OpenFlags;
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| Error::Unavailable(format!("{}: {e}", path.display())))?;
    // 256 KiB of page cache each: a reader's pages are read once per API read or status
    // count, and the kernel's page cache holds them between; at 2 MiB each, the two
    // readers' caches filled while 10,000 subscriptions were reconciled and held 0.23 KiB
    // per subscription of herald's memory.
    conn.execute_batch("PRAGMA busy_timeout=5000; PRAGMA cache_size=-256;")
        .map_err(backend)?;
    conn.set_prepared_statement_cache_capacity(32);
    conn.set_db_config(DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true)
        .map_err(backend)?;
    Ok(conn)
}

/// Lowers the calling thread's CPU priority to [`READER_NICE`] (Linux: per thread);
/// failing to is harmless. (Not the idle class: on a saturated machine that would starve
/// the status writer's reads.)
#[allow(unsafe_code)]
fn lower_this_threads_priority() {
    // SAFETY: setpriority and gettid take and return plain integers and touch no memory.
    unsafe {
        libc::setpriority(
            libc::PRIO_PROCESS,
            libc::gettid() as libc::id_t,
            READER_NICE,
        );
    }
}

/// A reader thread: takes the next read from the shared queue, runs it.
fn reader(conn: Connection, queue: Arc<std::sync::Mutex<std::sync::mpsc::Receiver<ReadJob>>>) {
    lower_this_threads_priority();
    loop {
        let job = match queue.lock().unwrap_or_else(|e| e.into_inner()).recv() {
            Ok(job) => job,
            Err(_) => return,
        };
        job(&conn);
    }
}

/// Brings a store made by an older herald up to [`SCHEMA`].
fn migrate(conn: &Connection) -> rusqlite::Result<()> {
    for (table, column, definition) in [
        ("subscriptions", "shard", "INTEGER NOT NULL DEFAULT 0"),
        ("subscriptions", "gone", "INTEGER NOT NULL DEFAULT 0"),
        (
            "subscriptions",
            "strict_order",
            "INTEGER NOT NULL DEFAULT 0",
        ),
        ("deliveries", "strict", "INTEGER NOT NULL DEFAULT 0"),
    ] {
        let has: bool = conn.query_row(
            "SELECT count(*) > 0 FROM pragma_table_info(?1) WHERE name = ?2",
            [table, column],
            |r| r.get(0),
        )?;
        if !has {
            conn.execute_batch(&format!(
                "ALTER TABLE {table} ADD COLUMN {column} {definition}"
            ))?;
        }
    }
    // A strict-order subscription's oldest pending delivery, without reading its backlog;
    // only such subscriptions' deliveries are in it, so it costs the others nothing.
    conn.execute_batch(
        "CREATE INDEX IF NOT EXISTS deliveries_order ON deliveries (sub_uid, id)
         WHERE state = 0 AND strict = 1",
    )
}

/// Runs one statement that takes no parameters, prepared once per connection.
fn exec(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([])?;
    Ok(())
}

fn savepoint<T>(
    conn: &Connection,
    op: impl FnOnce(&Connection) -> rusqlite::Result<T>,
) -> rusqlite::Result<T> {
    exec(conn, "SAVEPOINT op")?;
    match op(conn) {
        Ok(value) => {
            exec(conn, "RELEASE op")?;
            Ok(value)
        }
        Err(e) => {
            let _ = exec(conn, "ROLLBACK TO op").and_then(|()| exec(conn, "RELEASE op"));
            Err(e)
        }
    }
}

/// The writer loop: take what is queued (up to MAX_GROUP), run it in one transaction,
/// commit, then answer every caller.
fn writer(conn: Connection, mut rx: mpsc::UnboundedReceiver<Job>, failing: Arc<AtomicBool>) {
    let mut synced = true; // the connection opens with synchronous=FULL
    while let Some(first) = rx.blocking_recv() {
        let mut group = vec![first];
        while group.len() < MAX_GROUP {
            match rx.try_recv() {
                Ok(job) => group.push(job),
                Err(_) => break,
            }
        }
        let needs_sync = group.iter().any(|(d, _)| *d == Durability::Synced);
        if needs_sync != synced {
            let pragma = if needs_sync {
                "PRAGMA synchronous=FULL"
            } else {
                "PRAGMA synchronous=NORMAL"
            };
            if let Err(e) = exec(&conn, pragma) {
                // Never commit a synced operation with less: answer every caller with the error.
                tracing::error!(error = %e, "store: cannot set the sync mode");
                failing.store(true, Ordering::Release);
                drop(group);
                continue;
            }
            synced = needs_sync;
        }
        if let Err(e) = exec(&conn, "BEGIN IMMEDIATE") {
            // Never run an operation outside a transaction. Dropping the jobs drops their
            // reply channels, so each caller hears that the store is unavailable.
            tracing::error!(error = %e, "store: cannot begin a transaction");
            failing.store(true, Ordering::Release);
            drop(group);
            continue;
        }
        let finishers: Vec<Finisher> = group.into_iter().map(|(_, job)| job(&conn)).collect();
        let commit = exec(&conn, "COMMIT").map_err(|e| e.to_string());
        if commit.is_err() {
            let _ = conn.execute_batch("ROLLBACK");
        }
        for finish in finishers {
            finish(commit.clone());
        }
    }
}

/// A subscription's counters and flags, read after every upsert (each subscription at each
/// start) and for every status write.
const STATE_OF: &str = "SELECT live, disabled, consecutive_failures, delivered, failed,
            dead_lettered,
            (SELECT count(*) FROM deliveries WHERE sub_uid = ?1 AND state IN (0, 1)),
            (SELECT count(*) FROM deliveries WHERE sub_uid = ?1 AND state = 3),
            gone
     FROM subscriptions WHERE uid = ?1";

/// Creates or updates a live subscription (a tombstoned uid stays dead).
const UPSERT_SUBSCRIPTION: &str = "INSERT INTO subscriptions
         (uid, namespace, name, paused, disable_after, shard, strict_order)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
     ON CONFLICT (uid) DO UPDATE SET paused = excluded.paused,
         disable_after = excluded.disable_after, name = excluded.name,
         shard = excluded.shard, strict_order = excluded.strict_order
     WHERE subscriptions.live = 1
         -- Unchanged (every subscription, at each start): no page is written,
         -- so the commit has nothing to sync.
         AND (subscriptions.paused, subscriptions.disable_after,
              subscriptions.name, subscriptions.shard, subscriptions.strict_order)
             IS NOT (excluded.paused, excluded.disable_after,
                     excluded.name, excluded.shard, excluded.strict_order)";

fn state_of(conn: &Connection, uid: &str) -> rusqlite::Result<Option<SubscriptionState>> {
    conn.prepare_cached(STATE_OF)?
        .query_row([uid], |r| {
            Ok(SubscriptionState {
                live: r.get(0)?,
                disabled: r.get(1)?,
                gone: r.get(8)?,
                consecutive_failures: r.get(2)?,
                delivered: count(r, 3)?,
                failed: count(r, 4)?,
                dead_lettered: count(r, 5)?,
                pending: count(r, 6)?,
                dead: count(r, 7)?,
            })
        })
        .optional()
}

#[async_trait]
impl Store for SqliteStore {
    async fn upsert_subscription(&self, sub: SubscriptionRecord) -> Result<SubscriptionState> {
        self.run(Durability::Synced, move |conn| {
            let was_strict: Option<bool> = conn
                .prepare_cached("SELECT strict_order FROM subscriptions WHERE uid = ?1")?
                .query_row([&sub.uid], |r| r.get(0))
                .optional()?;
            conn.prepare_cached(UPSERT_SUBSCRIPTION)?.execute(params![
                sub.uid,
                sub.namespace,
                sub.name,
                sub.paused,
                sub.disable_after,
                sub.shard,
                sub.strict_order
            ])?;
            // The ordering changed: the deliveries that may still be sent (waiting, in
            // flight, dead for a replay) follow it, so that strict claims find them.
            if was_strict.is_some_and(|was| was != sub.strict_order) {
                conn.execute(
                    "UPDATE deliveries SET strict = ?2
                     WHERE sub_uid = ?1 AND state IN (0, 1, 3) AND strict <> ?2",
                    params![sub.uid, sub.strict_order],
                )?;
            }
            Ok(state_of(conn, &sub.uid)?.unwrap_or_default())
        })
        .await
    }

    async fn remove_subscription(&self, uid: &str) -> Result<u64> {
        let uid = uid.to_string();
        self.run(Durability::Synced, move |conn| {
            // The subscription and its dead-letter sink's lane.
            let mut purged = 0;
            for uid in [uid.clone(), sink_uid(&uid)] {
                // A delivery's history goes with it: SQLite gives a deleted row's id to the
                // next one, and a history left behind would then be read as that delivery's.
                conn.execute(
                    "DELETE FROM attempt_log WHERE delivery IN
                         (SELECT id FROM deliveries WHERE sub_uid = ?1 AND state IN (0, 1))",
                    [&uid],
                )?;
                purged += conn.execute(
                    "DELETE FROM deliveries WHERE sub_uid = ?1 AND state IN (0, 1)",
                    [&uid],
                )?;
                // Tombstone rather than delete, so a stale upsert cannot bring it back.
                conn.execute(
                    "INSERT INTO subscriptions (uid, namespace, name, live) VALUES (?1, '', '', 0)
                     ON CONFLICT (uid) DO UPDATE SET live = 0",
                    [&uid],
                )?;
            }
            Ok(purged as u64)
        })
        .await
    }

    async fn set_disabled(&self, uid: &str, disabled: bool) -> Result<SubscriptionState> {
        let uid = uid.to_string();
        self.run(Durability::Synced, move |conn| {
            conn.execute(
                "UPDATE subscriptions SET disabled = ?2, gone = gone AND ?2,
                     consecutive_failures = CASE WHEN ?2 THEN consecutive_failures ELSE 0 END
                 WHERE uid = ?1 AND live = 1",
                params![uid, disabled],
            )?;
            Ok(state_of(conn, &uid)?.unwrap_or_default())
        })
        .await
    }

    async fn subscription_state(&self, uid: &str) -> Result<Option<SubscriptionState>> {
        let uid = uid.to_string();
        self.read(move |conn| state_of(conn, &uid)).await
    }

    async fn live_subscriptions(&self) -> Result<Vec<SubscriptionRecord>> {
        self.read(|conn| {
            let mut stmt = conn.prepare(
                "SELECT uid, namespace, name, paused, disable_after, shard, strict_order
                 FROM subscriptions WHERE live = 1",
            )?;
            stmt.query_map([], |r| {
                Ok(SubscriptionRecord {
                    uid: r.get(0)?,
                    namespace: r.get(1)?,
                    name: r.get(2)?,
                    paused: r.get(3)?,
                    disable_after: r.get(4)?,
                    shard: r.get(5)?,
                    strict_order: r.get(6)?,
                })
            })?
            .collect()
        })
        .await
    }

    async fn publish(&self, event: NewEvent, targets: Vec<String>) -> Result<PublishResult> {
        self.run(Durability::Synced, move |conn| {
            publish(conn, event, targets)
        })
        .await
    }

    async fn publish_batch(
        &self,
        publishes: Vec<(NewEvent, Vec<String>)>,
    ) -> Result<Vec<PublishResult>> {
        // One savepoint: all of them, or on an error none.
        self.run(Durability::Synced, move |conn| {
            publishes
                .into_iter()
                .map(|(event, targets)| publish(conn, event, targets))
                .collect()
        })
        .await
    }

    async fn publish_and_claim(
        &self,
        event: NewEvent,
        targets: Vec<String>,
        claims: Vec<(String, Option<ShardFence>)>,
        // No other process shares this store: nobody to tell of new work.
        _held: Vec<ShardFence>,
    ) -> Result<(PublishResult, Vec<Claimed>)> {
        self.run(Durability::Synced, move |conn| {
            let now_ms = event.published_ms;
            let result = publish(conn, event, targets)?;
            let mut claimed = Vec::with_capacity(claims.len());
            for (uid, fence) in claims {
                if !result.targets.contains(&uid) {
                    continue;
                }
                if let Claim::Claimed(c) = claim_due(conn, uid, now_ms, fence)? {
                    claimed.push(c);
                }
            }
            Ok((result, claimed))
        })
        .await
    }

    fn claims_with_publish(&self) -> bool {
        true
    }

    async fn check_writable(&self) -> Result<()> {
        if !self.failing.load(Ordering::Acquire) {
            return Ok(());
        }
        // The last write failed: only a synced commit of a write the size of a large event
        // (a small row may still fit in a page or a WAL frame) says the disk takes writes.
        self.run(Durability::Synced, |conn| {
            conn.prepare_cached(
                "INSERT OR REPLACE INTO health (id, at_ms, pad) VALUES (1, ?1, zeroblob(1048576))",
            )?
            .execute([std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as i64)])
            .map(|_| ())
        })
        .await
    }

    async fn published(&self, namespace: &str, event_id: &str) -> Result<Option<PublishResult>> {
        let (namespace, event_id) = (namespace.to_string(), event_id.to_string());
        self.read(move |conn| {
            conn.prepare_cached(
                "SELECT matched FROM events WHERE namespace = ?1 AND event_id = ?2",
            )?
            .query_row(params![namespace, event_id], |r| r.get(0))
            .optional()
            .map(|matched: Option<u32>| {
                matched.map(|matched| PublishResult {
                    event_id,
                    matched,
                    duplicate: true,
                    targets: Vec::new(),
                })
            })
        })
        .await
    }

    async fn claim_next(&self, uid: &str, now_ms: i64) -> Result<Claim> {
        let uid = uid.to_string();
        self.run(Durability::Relaxed, move |conn| {
            claim_due(conn, uid, now_ms, None)
        })
        .await
    }

    async fn claim_fenced(&self, uid: &str, now_ms: i64, fence: ShardFence) -> Result<Claim> {
        let uid = uid.to_string();
        self.run(Durability::Relaxed, move |conn| {
            claim_due(conn, uid, now_ms, Some(fence))
        })
        .await
    }

    async fn unclaim(&self, delivery_id: i64, attempt: u32) -> Result<bool> {
        self.run(Durability::Relaxed, move |conn| {
            Ok(conn
                .prepare_cached(UNCLAIM)?
                .execute(params![delivery_id, attempt])?
                == 1)
        })
        .await
    }

    async fn take_shard(&self, shard: u32, holder: &str, epoch: i64, now_ms: i64) -> Result<bool> {
        let holder = holder.to_string();
        self.run(Durability::Synced, move |conn| {
            let taken = conn.execute(
                "INSERT INTO shard_owners (shard, holder, epoch) VALUES (?1, ?2, ?3)
                 ON CONFLICT (shard) DO UPDATE SET holder = excluded.holder, epoch = excluded.epoch
                 WHERE excluded.epoch > shard_owners.epoch",
                params![shard, holder, epoch],
            )? == 1;
            if taken {
                conn.execute(
                    "INSERT INTO shard_history (shard, epoch, holder, at_ms) VALUES (?1, ?2, ?3, ?4)",
                    params![shard, epoch, holder, now_ms],
                )?;
                // Attempts the previous holder had on the wire: it may be gone, so they are due
                // again (at least once). If it was only paused, whichever completion comes
                // first finishes the delivery.
                conn.execute(
                    "UPDATE deliveries SET state = 0, due_ms = min(due_ms, ?2)
                     WHERE state = 1 AND sub_uid IN (SELECT uid FROM subscriptions WHERE shard = ?1)",
                    params![shard, now_ms],
                )?;
            }
            Ok(taken)
        })
        .await
    }

    async fn shard_history(&self) -> Result<Vec<ShardTaking>> {
        self.read(|conn| {
            let mut stmt = conn.prepare(
                "SELECT shard, epoch, holder, at_ms FROM shard_history ORDER BY at_ms, shard, epoch",
            )?;
            stmt.query_map([], |r| {
                Ok(ShardTaking {
                    shard: r.get(0)?,
                    epoch: r.get(1)?,
                    holder: r.get(2)?,
                    at_ms: r.get(3)?,
                })
            })?
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
        self.run(Durability::Relaxed, move |conn| {
            complete(conn, claim, attempt, next, then_claim)
        })
        .await
    }

    async fn complete_dead_letter(
        &self,
        claim: ClaimRef,
        attempt: AttemptRecord,
        next: Next,
        letter: NewEvent,
        sink: String,
    ) -> Result<Completion> {
        self.run(Durability::Relaxed, move |conn| {
            let (mut completion, _) = complete(conn, claim, attempt, next, None)?;
            if completion.recorded {
                completion.letter_queued = !publish(conn, letter, vec![sink])?.targets.is_empty();
            }
            Ok(completion)
        })
        .await
    }

    async fn recover_in_flight(&self, now_ms: i64) -> Result<u64> {
        self.run(Durability::Relaxed, move |conn| {
            Ok(conn.execute(
                "UPDATE deliveries SET state = 0, due_ms = min(due_ms, ?1) WHERE state = 1",
                [now_ms],
            )? as u64)
        })
        .await
    }

    async fn stored_bytes(&self) -> Result<Vec<(String, u64)>> {
        self.read(|conn| {
            // length() of a blob reads its size from the row header, not the blob.
            let mut stmt = conn.prepare(
                "SELECT namespace, sum(CASE WHEN matched = 0 THEN ?1
                                          ELSE length(body) + ?1 + matched * ?2 END)
                 FROM events GROUP BY namespace",
            )?;
            stmt.query_map(
                params![EVENT_OVERHEAD_BYTES as i64, DELIVERY_OVERHEAD_BYTES as i64],
                |r| Ok((r.get(0)?, count(r, 1)?)),
            )?
            .collect()
        })
        .await
    }

    fn free_bytes(&self) -> Option<u64> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let now = std::time::Instant::now();
        match *free {
            Some((at, bytes)) if now.duration_since(at) < FREE_SPACE_TTL => Some(bytes),
            _ => {
                let bytes = available_bytes(&self.dir)?;
                *free = Some((now, bytes));
                Some(bytes)
            }
        }
    }

    async fn pending_by_subscription(&self) -> Result<Vec<(String, String, u64)>> {
        self.read(|conn| {
            let mut stmt = conn.prepare(
                "SELECT s.uid, s.namespace, count(d.id) FROM subscriptions s
                 JOIN deliveries d ON d.sub_uid = s.uid AND d.state IN (0, 1)
                 WHERE s.live = 1 GROUP BY s.uid",
            )?;
            stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, count(r, 2)?)))?
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
        let uid = uid.to_string();
        self.read(move |conn| {
            let states = match filter {
                StateFilter::Pending => "0, 1",
                StateFilter::Dead => "3",
                StateFilter::All => "0, 1, 2, 3",
            };
            let mut stmt = conn.prepare(&format!(
                "SELECT d.id, e.event_id, e.event_type, d.state, d.attempts, e.published_ms, d.due_ms
                 FROM deliveries d JOIN events e ON e.id = d.event
                 WHERE d.sub_uid = ?1 AND d.state IN ({states})
                 -- The lane index's order: a page costs its own rows, however long the
                 -- backlog (ORDER BY d.id sorted all of it for every page).
                 ORDER BY d.state, d.due_ms, d.id LIMIT ?2"
            ))?;
            let rows: Vec<(i64, DeliveryView)> = stmt
                .query_map(params![uid, limit], |r| {
                    let state = DeliveryState::from_code(r.get(3)?);
                    Ok((
                        r.get(0)?,
                        DeliveryView {
                            event_id: r.get(1)?,
                            event_type: r.get(2)?,
                            state,
                            attempts: r.get(4)?,
                            published_ms: r.get(5)?,
                            next_due_ms: (state == DeliveryState::Pending).then_some(r.get(6)?),
                            last_attempt: None,
                            last_attempt_id: None,
                        },
                    ))
                })?
                .collect::<rusqlite::Result<_>>()?;
            let mut last = conn.prepare_cached(
                "SELECT at_ms, outcome, status_code, latency_ms, message, id FROM attempt_log
                 WHERE delivery = ?1 ORDER BY id DESC LIMIT 1",
            )?;
            rows.into_iter()
                .map(|(id, mut view)| {
                    if let Some((attempt, log_id)) = last
                        .query_row([id], |r| Ok((attempt_row(r)?, r.get::<_, i64>(5)?)))
                        .optional()?
                    {
                        view.last_attempt = Some(attempt);
                        view.last_attempt_id = Some(log_id);
                    }
                    Ok(view)
                })
                .collect()
        })
        .await
    }

    async fn attempts(&self, uid: &str, event_id: &str) -> Result<Vec<AttemptRecord>> {
        let (uid, event_id) = (uid.to_string(), event_id.to_string());
        self.read(move |conn| {
            let mut stmt = conn.prepare(
                "SELECT a.at_ms, a.outcome, a.status_code, a.latency_ms, a.message
                 FROM attempt_log a JOIN deliveries d ON d.id = a.delivery
                 JOIN events e ON e.id = d.event
                 WHERE d.sub_uid = ?1 AND e.event_id = ?2 ORDER BY a.id",
            )?;
            stmt.query_map(params![uid, event_id], attempt_row)?
                .collect()
        })
        .await
    }

    async fn search_attempts(&self, search: AttemptSearch) -> Result<AttemptPage> {
        self.read(move |conn| {
            // As the PostgreSQL store: the newest rows of the log before the cursor, at most
            // SEARCH_SCAN_ROWS, then the namespace's that match.
            let (scanned, oldest): (u32, Option<i64>) = conn.query_row(
                "SELECT count(*), min(id) FROM (
                     SELECT id FROM attempt_log WHERE id < ?1 ORDER BY id DESC LIMIT ?2
                 )",
                params![search.before.unwrap_or(i64::MAX), SEARCH_SCAN_ROWS],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )?;
            let outcomes = search
                .outcomes
                .as_ref()
                .map(|o| serde_json::to_string(o).unwrap_or_default());
            let mut stmt = conn.prepare_cached(
                "SELECT a.id, s.name, e.event_id, e.event_type,
                        a.at_ms, a.outcome, a.status_code, a.latency_ms, a.message
                 FROM (SELECT * FROM attempt_log WHERE id < ?2 ORDER BY id DESC LIMIT ?3) a
                 JOIN deliveries d ON d.id = a.delivery
                 JOIN subscriptions s ON s.uid = d.sub_uid
                 JOIN events e ON e.id = d.event
                 WHERE s.namespace = ?1
                   AND (?4 IS NULL OR s.name = ?4)
                   AND (?5 IS NULL OR a.outcome IN (SELECT value FROM json_each(?5)))
                   AND (?6 IS NULL OR a.status_code = ?6)
                   AND (?7 IS NULL OR a.at_ms >= ?7)
                   AND (?8 IS NULL OR a.at_ms < ?8)
                 ORDER BY a.id DESC LIMIT ?9",
            )?;
            let hits = stmt
                .query_map(
                    params![
                        search.namespace,
                        search.before.unwrap_or(i64::MAX),
                        SEARCH_SCAN_ROWS,
                        search.subscription,
                        outcomes,
                        search.status_code,
                        search.since_ms,
                        search.until_ms,
                        search.limit,
                    ],
                    |r| {
                        Ok((
                            r.get(0)?,
                            AttemptHit {
                                subscription: r.get(1)?,
                                event_id: r.get(2)?,
                                event_type: r.get(3)?,
                                attempt: AttemptRecord {
                                    at_ms: r.get(4)?,
                                    outcome: r.get(5)?,
                                    status_code: r.get(6)?,
                                    latency_ms: r.get::<_, i64>(7)? as u64,
                                    message: r.get(8)?,
                                },
                            },
                        ))
                    },
                )?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(AttemptPage::of(hits, search.limit, scanned, oldest))
        })
        .await
    }

    async fn replay(&self, uid: &str, which: Replay, now_ms: i64) -> Result<u64> {
        let uid = uid.to_string();
        self.run(Durability::Synced, move |conn| {
            let live: bool = conn.query_row(
                "SELECT count(*) FROM subscriptions WHERE uid = ?1 AND live = 1",
                [&uid],
                |r| r.get(0),
            )?;
            if !live {
                return Ok(0);
            }
            // From the subscription's dead letters to their events (by key): once, or once
            // per event id asked for (?3).
            let mut requeue = conn.prepare(
                "UPDATE deliveries SET state = 0, attempts = 0, due_ms = ?2,
                     window_start_ms = ?2, finished_ms = NULL
                 WHERE sub_uid = ?1 AND state = 3
                   AND EXISTS (SELECT 1 FROM events e WHERE e.id = deliveries.event
                               AND (?3 IS NULL OR e.event_id = ?3)
                               AND (?4 IS NULL OR e.published_ms >= ?4)
                               AND (?5 IS NULL OR e.published_ms < ?5))",
            )?;
            let (since, until) = (which.since_ms, which.until_ms);
            let count = match which.event_ids {
                None => requeue.execute(params![uid, now_ms, None::<String>, since, until])?,
                Some(ids) => {
                    let mut count = 0;
                    for id in ids {
                        count += requeue.execute(params![uid, now_ms, id, since, until])?;
                    }
                    count
                }
            };
            Ok(count as u64)
        })
        .await
    }

    async fn prune(&self, older_than_ms: i64) -> Result<u64> {
        self.run(Durability::Relaxed, move |conn| {
            let mut removed = conn.execute("DELETE FROM attempt_log WHERE at_ms < ?1", [older_than_ms])?;
            // Deliveries with their history (see remove_subscription: ids are reused).
            let finished = "state = 2 AND finished_ms < ?1";
            removed += conn.execute(
                &format!("DELETE FROM attempt_log WHERE delivery IN (SELECT id FROM deliveries WHERE {finished})"),
                [older_than_ms],
            )?;
            removed += conn.execute(&format!("DELETE FROM deliveries WHERE {finished}"), [older_than_ms])?;
            let removed_subs = "sub_uid IN (SELECT uid FROM subscriptions WHERE live = 0)";
            removed += conn.execute(
                &format!("DELETE FROM attempt_log WHERE delivery IN (SELECT id FROM deliveries WHERE {removed_subs})"),
                [],
            )?;
            removed += conn.execute(&format!("DELETE FROM deliveries WHERE {removed_subs}"), [])?;
            removed += conn.execute(
                "DELETE FROM events WHERE published_ms < ?1
                     AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.event = events.id)",
                [older_than_ms],
            )?;
            Ok(removed as u64)
        })
        .await
    }
}

/// Records an attempt (see [`Store::complete_and_claim`]) in the caller's transaction.
fn complete(
    conn: &Connection,
    claim: ClaimRef,
    attempt: AttemptRecord,
    next: Next,
    then_claim: Option<i64>,
) -> rusqlite::Result<(Completion, Option<Claimed>)> {
    let (state, due_ms) = match next {
        Next::Delivered => (DeliveryState::Delivered, attempt.at_ms),
        Next::Retry { due_ms } => (DeliveryState::Pending, due_ms),
        Next::DeadLetter | Next::Gone => (DeliveryState::Dead, attempt.at_ms),
    };
    let finished = (state != DeliveryState::Pending).then_some(attempt.at_ms);
    let (shard, epoch) = claim
        .fence
        .map_or((None, None), |f| (Some(f.shard), Some(f.epoch)));
    // Only while the delivery is in flight under this claim (its attempt number and,
    // when fenced, the shard still at the claim's epoch).
    let sub_uid: Option<String> = conn
        .prepare_cached(
            "UPDATE deliveries SET state = ?2, due_ms = ?3, finished_ms = ?4
             WHERE id = ?1 AND state = 1 AND attempts = ?5
               AND (?6 IS NULL OR EXISTS (SELECT 1 FROM shard_owners
                                          WHERE shard = ?6 AND epoch = ?7))
             RETURNING sub_uid",
        )?
        .query_row(
            params![
                claim.delivery_id,
                state.code(),
                due_ms,
                finished,
                claim.attempt,
                shard,
                epoch
            ],
            |r| r.get(0),
        )
        .optional()?;
    let log = |message: &str| {
        conn.prepare_cached(
            "INSERT INTO attempt_log (delivery, at_ms, outcome, status_code, latency_ms, message)
             SELECT id, ?2, ?3, ?4, ?5, ?6 FROM deliveries WHERE id = ?1",
        )?
        .execute(params![
            claim.delivery_id,
            attempt.at_ms,
            attempt.outcome,
            attempt.status_code,
            attempt.latency_ms as i64,
            message
        ])
    };
    let Some(sub_uid) = sub_uid else {
        // Stale (a take-over, a later claim): history only. Purged: nothing.
        log(&superseded_message(&attempt.message))?;
        return Ok((Completion::default(), None));
    };
    log(&attempt.message)?;
    let ok = next == Next::Delivered;
    let gone = next == Next::Gone;
    // Whether a 410 disables it now, or found it disabled already.
    let was_disabled = gone
        && conn
            .prepare_cached("SELECT disabled FROM subscriptions WHERE uid = ?1")?
            .query_row([&sub_uid], |r| r.get::<_, bool>(0))
            .optional()?
            .unwrap_or(true);
    let (failures, disabled_now): (u32, bool) = conn
        .prepare_cached(COUNT_ATTEMPT)?
        .query_row(params![sub_uid, ok, next.is_dead(), gone], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .optional()?
        .unwrap_or((0, false));
    let disabled_now = if gone { !was_disabled } else { disabled_now };
    let following = match then_claim {
        Some(now_ms) if ok => match claim_due(conn, sub_uid.clone(), now_ms, claim.fence)? {
            Claim::Claimed(claimed) => Some(claimed),
            Claim::Idle { .. } => None,
        },
        _ => None,
    };
    // Going on with the one claimed, the lane learns what is due after it from its record.
    let next_due_ms = match following {
        Some(_) => None,
        None => next_due(conn, &sub_uid)?,
    };
    let completion = Completion {
        recorded: true,
        disabled_now,
        consecutive_failures: failures,
        next_due_ms,
        letter_queued: false,
    };
    Ok((completion, following))
}

/// SQLite integers are signed; counts never are.
/// Stores the event and one pending delivery per live target (see [`Store::publish`]).
fn publish(
    conn: &Connection,
    event: NewEvent,
    targets: Vec<String>,
) -> rusqlite::Result<PublishResult> {
    let existing: Option<u32> = conn
        .prepare_cached("SELECT matched FROM events WHERE namespace = ?1 AND event_id = ?2")?
        .query_row(params![event.namespace, event.event_id], |r| r.get(0))
        .optional()?;
    if let Some(matched) = existing {
        return Ok(PublishResult {
            event_id: event.event_id,
            matched,
            duplicate: true,
            targets: Vec::new(),
        });
    }
    // An event that matches nothing keeps its id (a repeat stays idempotent) but not
    // its body: nothing will ever send it, and unmatched floods must not fill the disk.
    let body: &[u8] = if targets.is_empty() { &[] } else { &event.body };
    conn.prepare_cached(
        "INSERT INTO events (namespace, event_id, event_type, body, published_ms, matched)
             VALUES (?1, ?2, ?3, ?4, ?5, 0)",
    )?
    .execute(params![
        event.namespace,
        event.event_id,
        event.event_type,
        body,
        event.published_ms
    ])?;
    let event_row = conn.last_insert_rowid();
    let mut live = Vec::with_capacity(targets.len());
    {
        let mut insert = conn.prepare_cached(
            "INSERT INTO deliveries (event, sub_uid, state, due_ms, window_start_ms, strict)
                 SELECT ?1, uid, 0, ?2, ?2, strict_order FROM subscriptions
                 WHERE uid = ?3 AND live = 1 AND namespace = ?4",
        )?;
        for uid in targets {
            if insert.execute(params![event_row, event.published_ms, uid, event.namespace])? == 1 {
                live.push(uid);
            }
        }
    }
    if live.is_empty() {
        conn.prepare_cached("UPDATE events SET body = x'' WHERE id = ?1")?
            .execute([event_row])?;
    } else {
        conn.prepare_cached("UPDATE events SET matched = ?2 WHERE id = ?1")?
            .execute(params![event_row, live.len() as u32])?;
    }
    Ok(PublishResult {
        event_id: event.event_id,
        matched: live.len() as u32,
        duplicate: false,
        targets: live,
    })
}

fn count(r: &rusqlite::Row<'_>, index: usize) -> rusqlite::Result<u64> {
    Ok(r.get::<_, i64>(index)?.max(0) as u64)
}

fn attempt_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<AttemptRecord> {
    Ok(AttemptRecord {
        at_ms: r.get(0)?,
        outcome: r.get(1)?,
        status_code: r.get(2)?,
        latency_ms: r.get::<_, i64>(3)? as u64,
        message: r.get(4)?,
    })
}

/// A claim's statement, around the conditions on the subscription's row (`s`): its next due
/// delivery moves to in flight only while the subscription is live, enabled and unpaused
/// (and those conditions hold). Under strict order only its oldest pending delivery is a
/// candidate, and only while none is in flight.
macro_rules! claim_sql {
    ($row:literal, $also:literal) => {
        concat!(
            "UPDATE deliveries SET state = 1, attempts = attempts + 1
             WHERE due_ms <= ?2 AND id = (
                 SELECT CASE WHEN s.strict_order
                     THEN (SELECT id FROM deliveries
                           WHERE sub_uid = ?1 AND state = 0 AND strict = 1
                           ORDER BY id LIMIT 1)
                     ELSE (SELECT id FROM deliveries
                           WHERE sub_uid = ?1 AND state = 0 AND due_ms <= ?2
                           ORDER BY due_ms, id LIMIT 1)
                 END
                 FROM subscriptions s
                 WHERE s.uid = ?1 AND s.live = 1 AND s.paused = 0 AND s.disabled = 0 ",
            $row,
            "
                   AND NOT (s.strict_order AND EXISTS (
                       SELECT 1 FROM deliveries WHERE sub_uid = ?1 AND state = 1)))",
            $also,
            "
             RETURNING id, event, attempts, window_start_ms"
        )
    };
}

/// The fence and the claim in one statement.
const CLAIM: &str = claim_sql!("", "");

/// [`CLAIM`], and only while the claimer's lease epoch (?4) is the shard's (?3) current one.
const CLAIM_FENCED: &str = claim_sql!(
    "AND s.shard = ?3",
    "
       AND EXISTS (SELECT 1 FROM shard_owners WHERE shard = ?3 AND epoch = ?4)"
);

/// Undoes one claim (?1 the delivery, ?2 the claim's attempt number): a take-over or a later
/// claim has changed state or attempts since, and then this matches nothing.
const UNCLAIM: &str = "UPDATE deliveries SET state = 0, attempts = attempts - 1
     WHERE id = ?1 AND state = 1 AND attempts = ?2";

/// When the lane's next claim can succeed: the earliest due time of the subscription's
/// deliveries waiting to be claimed (under strict order, its oldest one's, and none while
/// one is in flight); None when none waits or it is paused, disabled or gone.
fn next_due(conn: &Connection, uid: &str) -> rusqlite::Result<Option<i64>> {
    let due: Option<Option<i64>> = conn
        .prepare_cached(
            "SELECT CASE
                 WHEN NOT strict_order THEN
                     (SELECT min(due_ms) FROM deliveries WHERE sub_uid = ?1 AND state = 0)
                 WHEN NOT EXISTS (SELECT 1 FROM deliveries WHERE sub_uid = ?1 AND state = 1)
                 THEN (SELECT due_ms FROM deliveries
                       WHERE sub_uid = ?1 AND state = 0 AND strict = 1
                       ORDER BY id LIMIT 1)
             END
             FROM subscriptions WHERE uid = ?1 AND live = 1 AND paused = 0 AND disabled = 0",
        )?
        .query_row([uid], |r| r.get(0))
        .optional()?;
    Ok(due.flatten())
}

fn claim_due(
    conn: &Connection,
    uid: String,
    now_ms: i64,
    fence: Option<ShardFence>,
) -> rusqlite::Result<Claim> {
    let row = |r: &rusqlite::Row<'_>| -> rusqlite::Result<(i64, i64, u32, i64)> {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
    };
    let claimed = match fence {
        None => conn
            .prepare_cached(CLAIM)?
            .query_row(params![uid, now_ms], row)
            .optional()?,
        Some(fence) => conn
            .prepare_cached(CLAIM_FENCED)?
            .query_row(params![uid, now_ms, fence.shard, fence.epoch], row)
            .optional()?,
    };
    let Some((delivery_id, event, attempt, window_start_ms)) = claimed else {
        return Ok(Claim::Idle {
            next_due_ms: next_due(conn, &uid)?,
        });
    };
    conn.prepare_cached("SELECT event_id, event_type, body FROM events WHERE id = ?1")?
        .query_row([event], |r| {
            Ok(Claim::Claimed(Claimed {
                delivery_id,
                subscription_uid: uid.clone(),
                event_id: r.get(0)?,
                event_type: r.get(1)?,
                body: r.get(2)?,
                attempt,
                window_start_ms,
                fence,
            }))
        })
}

/// Counts an attempt on its subscription and disables it after too many failures in a row,
/// or at once after a 410 Gone (?4).
const COUNT_ATTEMPT: &str = "UPDATE subscriptions SET
         consecutive_failures = CASE WHEN ?2 THEN 0 ELSE consecutive_failures + 1 END,
         delivered = delivered + ?2,
         failed = failed + (NOT ?2),
         dead_lettered = dead_lettered + ?3,
         disabled = CASE WHEN ?4 OR (NOT ?2 AND disable_after > 0
                          AND consecutive_failures + 1 >= disable_after)
                         THEN 1 ELSE disabled END,
         gone = gone OR ?4
     WHERE uid = ?1 AND live = 1
     RETURNING consecutive_failures,
               disabled = 1 AND NOT ?2 AND disable_after > 0
                   AND consecutive_failures = disable_after";

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("herald-store-test-{}", uuid::Uuid::now_v7()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[tokio::test]
    async fn sqlite_passes_the_store_suite() {
        let dir = temp_dir();
        let store = SqliteStore::open(&dir).unwrap();
        super::super::suite::run(&store).await;
        drop(store);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// SQLite counts no memory (see configure_sqlite): with its statistics on, an open
    /// store's connections and page cache would show here. Every connection this test
    /// binary opens is opened by or after `SqliteStore::open`, so the setting is in place.
    #[tokio::test]
    #[allow(unsafe_code)]
    async fn sqlite_keeps_no_memory_statistics() {
        let dir = temp_dir();
        let store = SqliteStore::open(&dir).unwrap();
        store.prune(0).await.unwrap();
        // SAFETY: takes no argument and reads a global counter.
        assert_eq!(unsafe { rusqlite::ffi::sqlite3_memory_used() }, 0);
        drop(store);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// SQLite claims with the publish, in its transaction (the suite allows a store not to).
    #[tokio::test]
    async fn sqlite_claims_with_the_publish() {
        let dir = temp_dir();
        let store = SqliteStore::open(&dir).unwrap();
        assert_eq!(
            super::super::suite::claims_made_with_a_publish(&store).await,
            1
        );
        drop(store);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn the_hot_statements_are_prepared_once() {
        let dir = temp_dir();
        let store = SqliteStore::open(&dir).unwrap();
        let sub = |uid: &str| SubscriptionRecord {
            uid: uid.into(),
            namespace: "ns".into(),
            name: uid.into(),
            paused: false,
            disable_after: 0,
            shard: 0,
            strict_order: false,
        };
        let uids = ["a", "b"];
        for uid in uids {
            store.upsert_subscription(sub(uid)).await.unwrap();
        }
        for i in 0..4 {
            let event = NewEvent {
                namespace: "ns".into(),
                event_id: format!("e{i}"),
                event_type: "t".into(),
                body: b"{}".to_vec(),
                published_ms: 1,
            };
            store
                .publish(event, uids.iter().map(|u| u.to_string()).collect())
                .await
                .unwrap();
        }
        // Alternate subscriptions, so that every call binds a different value.
        for i in 0..8 {
            let Claim::Claimed(c) = store.claim_next(uids[i % 2], 10).await.unwrap() else {
                panic!("nothing to claim");
            };
            let attempt = AttemptRecord {
                at_ms: 11,
                outcome: "Accepted".into(),
                status_code: Some(200),
                latency_ms: 1,
                message: String::new(),
            };
            store
                .complete(c.claim_ref(), attempt, Next::Delivered)
                .await
                .unwrap();
        }
        // Every start upserts each subscription again, which reads its state: one prepared
        // statement each, not a parse per call. (Reads of the state alone run on the
        // readers' connections, each preparing it once too.)
        for uid in uids {
            store.upsert_subscription(sub(uid)).await.unwrap();
            store.subscription_state(uid).await.unwrap();
        }
        let (reprepared, runs) = store
            .run(Durability::Relaxed, |conn| {
                let status = |sql, what| conn.prepare_cached(sql).map(|s| s.get_status(what));
                use rusqlite::StatementStatus::{RePrepare, Run};
                Ok((
                    (status(CLAIM, RePrepare)?, status(COUNT_ATTEMPT, RePrepare)?),
                    (status(UPSERT_SUBSCRIPTION, Run)?, status(STATE_OF, Run)?),
                ))
            })
            .await
            .unwrap();
        assert_eq!(
            reprepared,
            (0, 0),
            "(claim, count attempt) re-prepared this often"
        );
        assert_eq!(
            runs,
            (4, 4),
            "(upsert, state) run this often on their cached statements"
        );
        drop(store);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn a_full_disk_is_reported_until_space_returns() {
        let dir = temp_dir();
        let store = SqliteStore::open(&dir).unwrap();
        store.check_writable().await.unwrap();
        let pages: i64 = {
            let conn = Connection::open(dir.join("herald.db")).unwrap();
            conn.query_row("PRAGMA page_count", [], |r| r.get(0))
                .unwrap()
        };
        store.set_max_page_count(pages as u64 + 2).await.unwrap();
        let big = |i: u32| NewEvent {
            namespace: "ns".into(),
            event_id: format!("big-{i}"),
            event_type: "t".into(),
            body: vec![b'x'; 64 * 1024],
            published_ms: 1,
        };
        store
            .upsert_subscription(SubscriptionRecord {
                uid: "u".into(),
                namespace: "ns".into(),
                name: "n".into(),
                paused: true,
                disable_after: 0,
                shard: 0,
                strict_order: false,
            })
            .await
            .unwrap();
        let mut full = None;
        for i in 0..100 {
            if let Err(e) = store.publish(big(i), vec!["u".into()]).await {
                full = Some(e);
                break;
            }
        }
        assert!(
            matches!(full, Some(Error::Unavailable(_))),
            "the capped store never filled: {full:?}"
        );
        assert!(
            store.check_writable().await.is_err(),
            "a full store reads as writable"
        );
        store.set_max_page_count(1 << 30).await.unwrap();
        store.check_writable().await.unwrap();
        store.publish(big(1000), vec!["u".into()]).await.unwrap();
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn what_was_acknowledged_survives_reopening() {
        let dir = temp_dir();
        {
            let store = SqliteStore::open(&dir).unwrap();
            super::super::suite::seed_for_reopen(&store).await;
        }
        let store = SqliteStore::open(&dir).unwrap();
        super::super::suite::check_after_reopen(&store).await;
        let _ = std::fs::remove_dir_all(dir);
    }
}
