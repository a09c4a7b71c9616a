//! Joined writers: requests of many lanes written in one statement ([`Joined`]: the
//! recorders of [`super::completions`], the claimers of [`super::claims`]), and one statement
//! at a time while it goes well, for them and for [`super::group_commit`]'s committers.
//!
//! A writer holding work waits for the statement before it to return, and what is queued
//! meanwhile joins its batch: batches grow with the load instead of being split between
//! writers that each start at once with the little queued so far, and the server's cost of
//! a statement (setting up its plan, its transaction) is shared by more rows. On two cores
//! writers going side by side gained nothing that waiting lost. A statement that has not
//! returned within [`OVERLAP_AFTER`] (a row lock held by a removal purging its backlog, a
//! slow server) no longer holds the next one back, so one subscription's wait delays the
//! others by that much at most.
//!
//! A statement takes at most one request per subscription (what follows depends on it); a
//! second waits for the next statement. One request's failure never fails the others: a
//! batch the server refuses, or that waited too long for a row lock (the writers'
//! connections carry a short lock timeout; a removal purging its backlog holds its
//! subscription's row), is written again one request at a time, each in a task of its
//! own, waiting as long as it takes, so that only the request that waits waits, and no
//! writer.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use sqlx_postgres::PgPool;
use tokio::sync::{Mutex, Notify, mpsc, oneshot};

use super::on_wire::OnWire;
use super::stream::Stream;
use super::{Error, OP_TIMEOUT, Result, classify};

/// How long a writer with work waits for the statement before it to return before writing
/// its own beside it (in tests long enough to tell the wait from a slow machine).
pub(super) const OVERLAP_AFTER: Duration = if cfg!(test) {
    Duration::from_secs(1)
} else {
    Duration::from_millis(10)
};

/// Gathering: a writer (or a publish committer, [`super::group_commit`]) that finds fewer
/// requests than this waits a moment for more, when more are likely to come
/// ([`Gathering`]). Without it a replica that sees a third of the events (three on one
/// server) wrote a third as many records a statement (2.8 against 9.4), and paid the
/// server's fixed cost of a statement (the record's executor start-up alone is about
/// 0.07 ms) three times as often; its claims went 2.8 a statement.
pub(super) const GATHER_UP_TO: usize = 16;

/// When a writer with a small batch waits for more (see [`GATHER_UP_TO`]).
pub(super) enum Gathering {
    /// The records: for up to [`OnWire::gather_for`] (2 ms), while an attempt claimed
    /// moments ago (within 10 ms) is still unrecorded. A lane alone on the wire never
    /// waits, nor do lanes whose receivers take longer than those 10 ms: no receiver holds
    /// other lanes' records back for more than 2 ms, and only while its attempt is that
    /// young.
    AttemptsOnWire(Arc<OnWire>),
    /// The claims: for up to [`Stream::gather_for`] (2 ms), when the rate claims come at
    /// makes another likely within the wait. A claim after a quiet moment, or at a
    /// moderate pace, waits for nothing; under load a claim waits 2 ms at most, which
    /// delays its delivery's first attempt by as much.
    InStream(Arc<Stream>),
}

/// One kind of writer's statements being written, and a signal each time one returns.
#[derive(Default)]
pub(super) struct Writing {
    statements: AtomicUsize,
    returned: Notify,
}

impl Writing {
    /// Statements being written now.
    #[cfg(test)]
    pub(super) fn statements(&self) -> usize {
        self.statements.load(Ordering::Acquire)
    }

    /// Waits until no statement is being written, or `at_most`.
    pub(super) async fn wait_for_none(&self, at_most: Duration) {
        let deadline = tokio::time::Instant::now() + at_most;
        loop {
            // Made before the count is read: a return in between still wakes it.
            let returned = self.returned.notified();
            if self.statements.load(Ordering::Acquire) == 0 {
                return;
            }
            if tokio::time::timeout_at(deadline, returned).await.is_err() {
                return;
            }
        }
    }

    /// Counts a statement as written until the guard drops.
    pub(super) fn start(self: &Arc<Self>) -> WritingGuard {
        self.statements.fetch_add(1, Ordering::AcqRel);
        WritingGuard(self.clone())
    }
}

pub(super) struct WritingGuard(Arc<Writing>);

impl Drop for WritingGuard {
    fn drop(&mut self) {
        self.0.statements.fetch_sub(1, Ordering::AcqRel);
        self.0.returned.notify_waiters();
    }
}

/// One kind of joined statement: what it is asked, what it answers, how it is written.
pub(super) trait Statement: 'static {
    type Request: Send + Sync + 'static;
    type Answer: Send + 'static;
    /// Requests in one statement at most.
    const MAX_BATCH: usize;
    /// Per request its answer, or None for one left for the next statement (a second
    /// request of the same subscription).
    fn write<'a>(
        pool: &'a PgPool,
        requests: &'a [&'a Self::Request],
    ) -> BoxFuture<'a, std::result::Result<Vec<Option<Self::Answer>>, sqlx_core::Error>>;
    /// One request in a statement of its own.
    fn write_one<'a>(
        pool: &'a PgPool,
        request: &'a Self::Request,
    ) -> BoxFuture<'a, std::result::Result<Self::Answer, sqlx_core::Error>>;
    /// The error of a request the server did not answer within [`OP_TIMEOUT`].
    fn timed_out() -> Error;
    /// An answer whose requester gave up waiting (undone through `pool` where it must be).
    fn unwanted(_pool: &PgPool, _answer: Self::Answer) {}
}

/// Requests waiting for a writer; beyond it a request waits to be queued.
const QUEUE: usize = 4096;

struct Queued<S: Statement> {
    request: S::Request,
    answer: oneshot::Sender<Result<S::Answer>>,
    /// When it was asked for.
    asked: Instant,
}

/// The queue of one kind of joined statement; its writers stop once it is dropped.
pub(super) struct Joined<S: Statement> {
    queue: mpsc::Sender<Queued<S>>,
    #[cfg(test)]
    writing: Arc<Writing>,
    /// Requests handed to the queue so far.
    #[cfg(test)]
    sent: AtomicUsize,
}

impl<S: Statement> Joined<S> {
    /// Starts `writers` writers, writing batches through `batches` (whose connections wait
    /// for a row lock briefly) and requests on their own through `alone`, gathering small
    /// batches as `gathering` says.
    pub(super) fn start(
        writers: usize,
        batches: PgPool,
        alone: PgPool,
        gathering: Gathering,
    ) -> Self {
        let gathering = Arc::new(gathering);
        let (queue, queued) = mpsc::channel(QUEUE);
        let queued = Arc::new(Mutex::new(queued));
        let writing = Arc::new(Writing::default());
        for _ in 0..writers {
            tokio::spawn(writer::<S>(
                batches.clone(),
                alone.clone(),
                queued.clone(),
                writing.clone(),
                gathering.clone(),
            ));
        }
        Self {
            queue,
            #[cfg(test)]
            writing,
            #[cfg(test)]
            sent: Default::default(),
        }
    }

    /// Requests handed to the queue so far.
    #[cfg(test)]
    pub(super) fn sent(&self) -> usize {
        self.sent.load(Ordering::Acquire)
    }

    /// Statements being written (a writer's, from its batch taken to its answers).
    #[cfg(test)]
    pub(super) fn writing(&self) -> usize {
        self.writing.statements()
    }

    /// Requests waiting for a writer.
    #[cfg(test)]
    pub(super) fn queued(&self) -> usize {
        self.queue.max_capacity() - self.queue.capacity()
    }

    /// Writes `request` in the next batch, answering once its statement has returned.
    pub(super) async fn write(&self, request: S::Request) -> Result<S::Answer> {
        let (answer, answered) = oneshot::channel();
        let waited = tokio::time::timeout(OP_TIMEOUT, async {
            self.queue
                .send(Queued {
                    request,
                    answer,
                    asked: Instant::now(),
                })
                .await
                .map_err(|_| Error::Unavailable("the PostgreSQL store is closed".into()))?;
            #[cfg(test)]
            self.sent.fetch_add(1, Ordering::AcqRel);
            answered
                .await
                .map_err(|_| Error::Backend("the statement stopped before it answered".into()))?
        })
        .await;
        waited.unwrap_or_else(|_| Err(S::timed_out()))
    }
}

async fn writer<S: Statement>(
    batches: PgPool,
    alone: PgPool,
    queued: Arc<Mutex<mpsc::Receiver<Queued<S>>>>,
    writing: Arc<Writing>,
    gathering: Arc<Gathering>,
) {
    // Requests a statement left for the next one.
    let mut carried: Vec<Queued<S>> = Vec::new();
    loop {
        let mut batch = std::mem::take(&mut carried);
        if batch.is_empty() {
            let mut queued = queued.lock().await;
            let Some(first) = queued.recv().await else {
                return;
            };
            batch.push(first);
            // Holding the queue, so that what comes meanwhile joins this batch.
            writing.wait_for_none(OVERLAP_AFTER).await;
            take_queued(&mut queued, &mut batch);
            match &*gathering {
                Gathering::AttemptsOnWire(on_wire) => {
                    gather(&mut queued, &mut batch, on_wire.gather_for(), || {
                        on_wire.any_recent()
                    })
                    .await
                }
                Gathering::InStream(stream) => {
                    if stream.more_expected(Instant::now(), batch.len()) {
                        gather(&mut queued, &mut batch, stream.gather_for(), || true).await;
                    }
                    stream.took(batch[batch.len() - 1].asked, batch.len());
                }
            }
        } else if let Ok(mut queued) = queued.try_lock() {
            // Never waits for the queue: another writer may hold it while waiting for a
            // request that does not come, and the requests carried here would wait with it.
            take_queued(&mut queued, &mut batch);
        }
        let _writing = writing.start();
        carried = write_and_answer(&batches, &alone, batch).await;
    }
}

/// Adds what is queued to `batch`, up to the statement's batch.
fn take_queued<S: Statement>(queued: &mut mpsc::Receiver<Queued<S>>, batch: &mut Vec<Queued<S>>) {
    while batch.len() < S::MAX_BATCH {
        match queued.try_recv() {
            Ok(next) => batch.push(next),
            Err(_) => break,
        }
    }
}

/// Waits up to `at_most` for more requests while the batch is small and `more_may_come`
/// (see [`GATHER_UP_TO`]).
async fn gather<S: Statement>(
    queued: &mut mpsc::Receiver<Queued<S>>,
    batch: &mut Vec<Queued<S>>,
    at_most: Duration,
    more_may_come: impl Fn() -> bool,
) {
    let deadline = tokio::time::Instant::now() + at_most;
    while batch.len() < GATHER_UP_TO.min(S::MAX_BATCH) && more_may_come() {
        match tokio::time::timeout_at(deadline, queued.recv()).await {
            Ok(Some(next)) => batch.push(next),
            _ => return,
        }
    }
}

/// Writes `batch` and answers each of its requests; returns those left for the next batch.
async fn write_and_answer<S: Statement>(
    batches: &PgPool,
    alone: &PgPool,
    batch: Vec<Queued<S>>,
) -> Vec<Queued<S>> {
    let requests: Vec<&S::Request> = batch.iter().map(|q| &q.request).collect();
    let written = tokio::time::timeout(OP_TIMEOUT, S::write(batches, &requests)).await;
    drop(requests);
    let mut carried = Vec::new();
    match written {
        Ok(Ok(answers)) => {
            for (queued, answer) in batch.into_iter().zip(answers) {
                match answer {
                    Some(answer) => {
                        if let Err(Ok(unwanted)) = queued.answer.send(Ok(answer)) {
                            S::unwanted(alone, unwanted);
                        }
                    }
                    None => carried.push(queued),
                }
            }
        }
        // A row held longer than the writers wait, or anything the server refused (a
        // value, a deadlock): each again on its own, side by side.
        Ok(Err(sqlx_core::Error::Database(_))) => {
            for queued in batch {
                let pool = alone.clone();
                tokio::spawn(async move {
                    let answer =
                        tokio::time::timeout(OP_TIMEOUT, S::write_one(&pool, &queued.request))
                            .await
                            .map_err(|_| S::timed_out())
                            .and_then(|written| written.map_err(classify));
                    if let Err(Ok(unwanted)) = queued.answer.send(answer) {
                        S::unwanted(&pool, unwanted);
                    }
                });
            }
        }
        // The server cannot be reached: each request is told so (its lane tries again).
        Ok(Err(e)) => {
            let message = match classify(e) {
                Error::Unavailable(m) | Error::Backend(m) => m,
            };
            for queued in batch {
                let _ = queued.answer.send(Err(Error::Unavailable(message.clone())));
            }
        }
        Err(_) => {
            for queued in batch {
                let _ = queued.answer.send(Err(S::timed_out()));
            }
        }
    }
    carried
}
