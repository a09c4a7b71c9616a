//! Cluster mode: herald as a Kubernetes operator. A front beside `standalone.rs`, feeding
//! the same engine calls (`upsert`, `remove`, `set_quota`, `notices`):
//!
//! - [`watch`]: what is watched (subscriptions, the Secrets they reference as metadata,
//!   quotas) and the start-up purge of subscriptions deleted while herald was down;
//! - [`queue`]: which subscriptions to reconcile and when (one at a time per object, a bounded
//!   number at once, failures retried), from the watch events' objects;
//! - [`reconcile`]: one subscription's reconcile and its finalizer `herald.dev/purge`, and
//!   [`secret_reads`]: the Secret values reconciles read, shared for a few seconds;
//! - [`conditions`]: the pure decisions (status conditions, Events, which quota is in force);
//! - [`status`]: writing status (coalesced), computed from what the object shows
//!   ([`shown`]), and [`events`]: writing Events;
//! - [`access_review`]: TokenReview and SubjectAccessReview behind the ingest API;
//! - [`shard_leases`]: with several replicas, which shards this one delivers for.

pub mod access_review;
pub mod conditions;
pub mod events;
pub mod queue;
pub mod reconcile;
pub mod secret_reads;
pub mod shard_leases;
pub mod shown;
pub mod status;
pub mod watch;

use crate::delivery::engine::EngineError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("store: {0}")]
    Store(#[from] crate::store::Error),
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
    #[error("{0}")]
    Invalid(&'static str),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
