//! Cluster mode's answer to "who may call the ingest API": the bearer token is checked with a
//! TokenReview, the request with a SubjectAccessReview, so producers are granted publishing
//! with ordinary RBAC:
//!
//! | call | RBAC rule (group herald.dev, the URL's namespace) |
//! | --- | --- |
//! | publish an event | `create` on `webhookevents` (a virtual resource: no CRD) |
//! | read a subscription or its attempts | `get` on `webhooksubscriptions` |
//! | replay dead letters, re-enable | `patch` on `webhooksubscriptions` |
//!
//! Answers are cached briefly so that publishing does not cost two API calls per event:
//! keyed by a SHA-256 of the token (the token itself is never kept), bounded in size,
//! allowed answers for [`ALLOWED_TTL`], refusals for [`DENIED_TTL`] (so a new RoleBinding
//! takes effect within seconds).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, UserInfo};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use sha2::{Digest, Sha256};

use crate::ingest::auth::{AccessRequest, AuthError, Authorizer, Verb, bearer};

pub const ALLOWED_TTL: Duration = Duration::from_secs(10);
/// A review the API server has not answered by then fails with 503 (the producer retries).
pub const REVIEW_TIMEOUT: Duration = Duration::from_secs(5);
pub const DENIED_TTL: Duration = Duration::from_secs(2);
/// Cached answers at most (per kind); beyond it the expired ones go, then all.
const CACHE_ENTRIES: usize = 10_000;

/// The virtual resource producers are granted `create` on.
pub const PUBLISH_RESOURCE: &str = "webhookevents";

/// The RBAC verb and resource behind an API call.
pub fn rbac_attributes(verb: Verb) -> (&'static str, &'static str) {
    match verb {
        Verb::Publish => ("create", PUBLISH_RESOURCE),
        Verb::Read => ("get", "webhooksubscriptions"),
        Verb::Manage => ("patch", "webhooksubscriptions"),
    }
}

struct Cache<V> {
    entries: HashMap<[u8; 32], (Instant, V)>,
}

impl<V: Clone> Cache<V> {
    fn new() -> Self {
        Self {
            entries: HashMap::new(),
        }
    }

    fn get(&self, key: &[u8; 32]) -> Option<V> {
        self.entries
            .get(key)
            .filter(|(until, _)| *until > Instant::now())
            .map(|(_, v)| v.clone())
    }

    fn put(&mut self, key: [u8; 32], value: V, ttl: Duration) {
        if self.entries.len() >= CACHE_ENTRIES {
            let now = Instant::now();
            self.entries.retain(|_, (until, _)| *until > now);
            if self.entries.len() >= CACHE_ENTRIES {
                self.entries.clear();
            }
        }
        self.entries.insert(key, (Instant::now() + ttl, value));
    }
}

pub struct KubeAuthorizer {
    client: kube::Client,
    users: Mutex<Cache<Option<UserInfo>>>,
    decisions: Mutex<Cache<bool>>,
}

fn key(parts: &[&[u8]]) -> [u8; 32] {
    let mut hash = Sha256::new();
    for part in parts {
        hash.update((part.len() as u64).to_le_bytes());
        hash.update(part);
    }
    hash.finalize().into()
}

/// Creates a review object and returns the API server's answer, within [`REVIEW_TIMEOUT`].
async fn review<K>(client: &kube::Client, review: &K) -> Result<K, AuthError>
where
    K: kube::Resource<Scope = k8s_openapi::ClusterResourceScope, DynamicType = ()>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let api = Api::<K>::all(client.clone());
    match tokio::time::timeout(REVIEW_TIMEOUT, api.create(&PostParams::default(), review)).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(e)) => Err(AuthError::Unavailable(format!(
            "the Kubernetes API refused the review: {e}"
        ))),
        Err(_) => Err(AuthError::Unavailable(format!(
            "the Kubernetes API did not answer within {}s",
            REVIEW_TIMEOUT.as_secs()
        ))),
    }
}

impl KubeAuthorizer {
    pub fn new(client: kube::Client) -> Self {
        Self {
            client,
            users: Mutex::new(Cache::new()),
            decisions: Mutex::new(Cache::new()),
        }
    }

    async fn user(&self, token: &str) -> Result<UserInfo, AuthError> {
        let token_key = key(&[b"token", token.as_bytes()]);
        let cached = self
            .users
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&token_key);
        let user = match cached {
            Some(user) => user,
            None => {
                let request = TokenReview {
                    spec: TokenReviewSpec {
                        token: Some(token.to_string()),
                        ..Default::default()
                    },
                    ..Default::default()
                };
                let answer = review(&self.client, &request).await?;
                let user = answer
                    .status
                    .filter(|s| s.authenticated == Some(true))
                    .and_then(|s| s.user);
                let ttl = if user.is_some() {
                    ALLOWED_TTL
                } else {
                    DENIED_TTL
                };
                self.users.lock().unwrap_or_else(|e| e.into_inner()).put(
                    token_key,
                    user.clone(),
                    ttl,
                );
                user
            }
        };
        user.ok_or_else(|| {
            AuthError::Unauthenticated("the bearer token is not valid for this cluster".into())
        })
    }
}

#[async_trait]
impl Authorizer for KubeAuthorizer {
    async fn authorize(&self, request: &AccessRequest<'_>) -> Result<(), AuthError> {
        let token = bearer(request.headers).ok_or_else(|| {
            AuthError::Unauthenticated(
                "a bearer token is required (for example a ServiceAccount token)".into(),
            )
        })?;
        let user = self.user(token).await?;
        let (verb, resource) = rbac_attributes(request.verb);
        let name = request.subscription.unwrap_or_default();
        let decision_key = key(&[
            b"decision",
            token.as_bytes(),
            verb.as_bytes(),
            resource.as_bytes(),
            request.namespace.as_bytes(),
            name.as_bytes(),
        ]);
        let cached = self
            .decisions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&decision_key);
        let allowed = match cached {
            Some(allowed) => allowed,
            None => {
                let sar = SubjectAccessReview {
                    spec: SubjectAccessReviewSpec {
                        user: user.username.clone(),
                        uid: user.uid.clone(),
                        groups: user.groups.clone(),
                        extra: user.extra.clone().map(|extra| {
                            extra.into_iter().collect::<BTreeMap<String, Vec<String>>>()
                        }),
                        resource_attributes: Some(ResourceAttributes {
                            group: Some(crate::api::GROUP.into()),
                            resource: Some(resource.into()),
                            verb: Some(verb.into()),
                            namespace: Some(request.namespace.into()),
                            name: request.subscription.map(str::to_string),
                            ..Default::default()
                        }),
                        ..Default::default()
                    },
                    ..Default::default()
                };
                let answer = review(&self.client, &sar).await?;
                let allowed = answer.status.is_some_and(|s| s.allowed);
                let ttl = if allowed { ALLOWED_TTL } else { DENIED_TTL };
                self.decisions
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .put(decision_key, allowed, ttl);
                allowed
            }
        };
        if allowed {
            Ok(())
        } else {
            Err(AuthError::Forbidden(format!(
                "{} may not {verb} {resource}.{} in namespace {}",
                user.username.as_deref().unwrap_or("this user"),
                crate::api::GROUP,
                request.namespace
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_call_maps_to_its_rbac_verb() {
        assert_eq!(rbac_attributes(Verb::Publish), ("create", "webhookevents"));
        assert_eq!(rbac_attributes(Verb::Read), ("get", "webhooksubscriptions"));
        assert_eq!(
            rbac_attributes(Verb::Manage),
            ("patch", "webhooksubscriptions")
        );
    }

    #[test]
    fn the_cache_forgets_expired_answers_and_stays_bounded() {
        let mut cache = Cache::new();
        let k = key(&[b"a"]);
        cache.put(k, true, Duration::from_secs(60));
        assert_eq!(cache.get(&k), Some(true));
        cache.put(k, false, Duration::ZERO);
        assert_eq!(cache.get(&k), None);
        for i in 0..(CACHE_ENTRIES as u32 + 10) {
            cache.put(key(&[&i.to_le_bytes()]), true, Duration::from_secs(60));
        }
        assert!(cache.entries.len() <= CACHE_ENTRIES);
    }

    #[test]
    fn keys_never_collide_across_field_boundaries() {
        assert_ne!(key(&[b"ab", b"c"]), key(&[b"a", b"bc"]));
    }
}
