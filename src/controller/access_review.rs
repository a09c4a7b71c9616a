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
//! Tokens must be issued for herald's audience (`--token-audience`, default `herald`:
//! `kubectl create token producer --audience herald`), so a token a producer hands herald
//! cannot be replayed against the API server, and one meant for the API server is refused.
//!
//! Answers are cached briefly so that publishing does not cost two API calls per event:
//! keyed by a SHA-256 of the token (the token itself is never kept), allowed answers for
//! [`ALLOWED_TTL`], refusals for [`DENIED_TTL`] (so a new RoleBinding takes effect within
//! seconds). A flood of garbage tokens must not evict producers nor load the API server that
//! herald's own Lease renewals depend on, so: allowed and refused answers live in separate
//! LRU caches (refusals evict only refusals); identical reviews in flight are sent once; and
//! each client address may cause at most [`FAILURE_BURST`] reviews at once and
//! [`FAILURE_RATE`] a second beyond that unless they authenticate (429 after that, no
//! review).

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

// tokio's clock, so that tests can pause it.
use tokio::time::Instant;

use async_trait::async_trait;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, UserInfo};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use lru::LruCache;
use sha2::{Digest, Sha256};

use crate::ingest::auth::{AccessRequest, AuthError, Authorizer, Verb, bearer};

pub const ALLOWED_TTL: Duration = Duration::from_secs(10);
/// A review the API server has not answered by then fails with 503 (the producer retries).
pub const REVIEW_TIMEOUT: Duration = Duration::from_secs(5);
pub const DENIED_TTL: Duration = Duration::from_secs(2);
/// Cached answers at most, per cache (allowed tokens, refused tokens, allowed decisions,
/// refused decisions); the least recently used go first.
const CACHE_ENTRIES: usize = 10_000;
/// TokenReviews one client address may have caused without authenticating, at once...
pub const FAILURE_BURST: f64 = 20.0;
/// ...and refilled at this many a second.
pub const FAILURE_RATE: f64 = 5.0;
/// Client addresses whose failures are remembered (least recently seen forgotten first).
const ADDRESSES: usize = 10_000;
/// Tokens that authenticated before, remembered (by hash) so that their next review, once
/// the cached answer expired, is never throttled: a producer sharing an address (a NAT, a
/// node) with a flood of garbage keeps publishing.
const KNOWN_TOKENS: usize = 10_000;

/// The audience producers' tokens are issued for unless `--token-audience` says otherwise.
pub const DEFAULT_AUDIENCE: &str = "herald";

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

/// The two reviews herald asks the API server for (a seam for the unit tests).
#[async_trait]
pub trait Reviews: Send + Sync + 'static {
    async fn token(&self, review: TokenReview) -> Result<TokenReview, AuthError>;
    async fn access(&self, review: SubjectAccessReview) -> Result<SubjectAccessReview, AuthError>;
}

/// The reviews as the API server answers them, each within [`REVIEW_TIMEOUT`].
pub struct ApiReviews(pub kube::Client);

#[async_trait]
impl Reviews for ApiReviews {
    async fn token(&self, review: TokenReview) -> Result<TokenReview, AuthError> {
        create(&self.0, &review).await
    }

    async fn access(&self, review: SubjectAccessReview) -> Result<SubjectAccessReview, AuthError> {
        create(&self.0, &review).await
    }
}

async fn create<K>(client: &kube::Client, review: &K) -> Result<K, AuthError>
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

/// Answers that expire, the least recently used evicted first when full.
struct Cache<V> {
    entries: LruCache<[u8; 32], (Instant, V)>,
}

impl<V: Clone> Cache<V> {
    fn new() -> Self {
        Self {
            entries: LruCache::new(NonZeroUsize::new(CACHE_ENTRIES).expect("not zero")),
        }
    }

    fn get(&mut self, key: &[u8; 32]) -> Option<V> {
        match self.entries.get(key) {
            Some((until, value)) if *until > Instant::now() => Some(value.clone()),
            Some(_) => {
                self.entries.pop(key);
                None
            }
            None => None,
        }
    }

    fn put(&mut self, key: [u8; 32], value: V, ttl: Duration) {
        self.entries.put(key, (Instant::now() + ttl, value));
    }
}

/// Allowed and refused answers apart, so that refusals never evict an allowed answer.
struct Answers<V> {
    allowed: Mutex<Cache<V>>,
    refused: Mutex<Cache<V>>,
}

impl<V: Clone> Answers<V> {
    fn new() -> Self {
        Self {
            allowed: Mutex::new(Cache::new()),
            refused: Mutex::new(Cache::new()),
        }
    }

    fn get(&self, key: &[u8; 32]) -> Option<V> {
        let cached = lock(&self.allowed).get(key);
        cached.or_else(|| lock(&self.refused).get(key))
    }

    fn put(&self, key: [u8; 32], value: V, allowed: bool) {
        if allowed {
            lock(&self.refused).entries.pop(&key);
            lock(&self.allowed).put(key, value, ALLOWED_TTL);
        } else {
            lock(&self.allowed).entries.pop(&key);
            lock(&self.refused).put(key, value, DENIED_TTL);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// A token bucket of reviews that did not authenticate, per client address.
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// The client an address stands for: an IPv6 client usually holds a whole /64.
fn address_key(peer: Option<IpAddr>) -> IpAddr {
    match peer {
        Some(IpAddr::V6(v6)) if v6.to_ipv4_mapped().is_none() => {
            let s = v6.segments();
            IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
        }
        Some(IpAddr::V6(v6)) => IpAddr::V4(v6.to_ipv4_mapped().expect("checked")),
        Some(v4) => v4,
        None => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
    }
}

type Review<T> = Shared<BoxFuture<'static, Result<T, AuthError>>>;

/// Runs `review` as a task and returns its answer for every client that waits for it.
fn spawned<T: Clone + Send + Sync + 'static>(
    review: impl Future<Output = Result<T, AuthError>> + Send + 'static,
) -> Review<T> {
    let task = tokio::spawn(review);
    async move {
        task.await
            .unwrap_or_else(|e| Err(AuthError::Unavailable(format!("the review failed: {e}"))))
    }
    .boxed()
    .shared()
}

struct State {
    reviews: Box<dyn Reviews>,
    audience: String,
    users: Answers<Option<UserInfo>>,
    decisions: Answers<bool>,
    token_reviews: Mutex<HashMap<[u8; 32], Review<Option<UserInfo>>>>,
    access_reviews: Mutex<HashMap<[u8; 32], Review<bool>>>,
    failures: Mutex<LruCache<IpAddr, Bucket>>,
    known: Mutex<LruCache<[u8; 32], ()>>,
}

pub struct KubeAuthorizer {
    state: Arc<State>,
}

fn key(parts: &[&[u8]]) -> [u8; 32] {
    let mut hash = Sha256::new();
    for part in parts {
        hash.update((part.len() as u64).to_le_bytes());
        hash.update(part);
    }
    hash.finalize().into()
}

fn count(review: &str, result: &str) {
    crate::metrics::get()
        .access_reviews
        .with_label_values(&[review, result])
        .inc();
}

impl State {
    /// Takes one review from the address's bucket; false when it is empty.
    fn take_failure(&self, address: IpAddr) -> bool {
        let now = Instant::now();
        let mut failures = lock(&self.failures);
        let bucket = failures.get_or_insert_mut(address, || Bucket {
            tokens: FAILURE_BURST,
            at: now,
        });
        let refill = now.duration_since(bucket.at).as_secs_f64() * FAILURE_RATE;
        bucket.tokens = (bucket.tokens + refill).min(FAILURE_BURST);
        bucket.at = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// Gives back what [`take_failure`](Self::take_failure) took: the token authenticated.
    fn give_back(&self, address: IpAddr) {
        if let Some(bucket) = lock(&self.failures).get_mut(&address) {
            bucket.tokens = (bucket.tokens + 1.0).min(FAILURE_BURST);
        }
    }

    /// The TokenReview for `token`, shared with any identical one in flight. Only a review
    /// that starts is charged to the client's address (unless the token authenticated
    /// before), so many requests at once with one new token cost one review and one charge.
    async fn token_review(
        self: &Arc<Self>,
        token_key: [u8; 32],
        token: &str,
        peer: Option<IpAddr>,
    ) -> Result<Option<UserInfo>, AuthError> {
        let review = {
            let mut in_flight = lock(&self.token_reviews);
            match in_flight.get(&token_key) {
                Some(review) => review.clone(),
                None => {
                    // A review that finished since the caller looked in the cache left the
                    // in-flight map only after caching its answer: look again before asking.
                    if let Some(user) = self.users.get(&token_key) {
                        return Ok(user);
                    }
                    let address = address_key(peer);
                    let known = lock(&self.known).get(&token_key).is_some();
                    if !known && !self.take_failure(address) {
                        crate::metrics::get().auth_throttled.inc();
                        return Err(AuthError::Throttled(format!(
                            "too many requests from {address} with tokens that did not \
                             authenticate; try again in a few seconds"
                        )));
                    }
                    let state = self.clone();
                    let request = TokenReview {
                        spec: TokenReviewSpec {
                            token: Some(token.to_string()),
                            audiences: Some(vec![self.audience.clone()]),
                        },
                        ..Default::default()
                    };
                    // A task of its own: it finishes (within the review timeout) and leaves the
                    // in-flight map even when every client waiting for it has gone.
                    let review = spawned(async move {
                        let answer = state.reviews.token(request).await;
                        // Leaves the in-flight map only once its answer is cached, so that no
                        // client finds neither and asks again.
                        let status = match answer {
                            Ok(answer) => answer.status,
                            Err(e) => {
                                count("token", "error");
                                lock(&state.token_reviews).remove(&token_key);
                                return Err(e);
                            }
                        };
                        // An audience-aware API server names the audience it checked; one
                        // that names none checked the token for itself only.
                        let user = status
                            .filter(|s| s.authenticated == Some(true))
                            .filter(|s| {
                                s.audiences
                                    .as_ref()
                                    .is_some_and(|a| a.contains(&state.audience))
                            })
                            .and_then(|s| s.user);
                        count(
                            "token",
                            if user.is_some() {
                                "authenticated"
                            } else {
                                "unauthenticated"
                            },
                        );
                        match (&user, known) {
                            // Tokens that authenticate cost their address nothing.
                            (Some(_), false) => {
                                state.give_back(address);
                                lock(&state.known).put(token_key, ());
                            }
                            // Expired or revoked since: charged like any other from now on.
                            (None, true) => {
                                lock(&state.known).pop(&token_key);
                            }
                            _ => {}
                        }
                        state.users.put(token_key, user.clone(), user.is_some());
                        lock(&state.token_reviews).remove(&token_key);
                        Ok(user)
                    });
                    in_flight.insert(token_key, review.clone());
                    review
                }
            }
        };
        review.await
    }

    async fn user(
        self: &Arc<Self>,
        token: &str,
        peer: Option<IpAddr>,
    ) -> Result<UserInfo, AuthError> {
        let token_key = key(&[b"token", token.as_bytes()]);
        let user = match self.users.get(&token_key) {
            Some(user) => user,
            None => self.token_review(token_key, token, peer).await?,
        };
        user.ok_or_else(|| {
            AuthError::Unauthenticated(format!(
                "the bearer token is not valid for this cluster and audience {:?} \
                 (kubectl create token NAME --audience {})",
                self.audience, self.audience
            ))
        })
    }

    /// The SubjectAccessReview for `spec`, shared with any identical one in flight.
    async fn access_review(
        self: &Arc<Self>,
        decision_key: [u8; 32],
        spec: SubjectAccessReviewSpec,
    ) -> Result<bool, AuthError> {
        let review = {
            let mut in_flight = lock(&self.access_reviews);
            match in_flight.get(&decision_key) {
                Some(review) => review.clone(),
                None => {
                    // As for token reviews: one may have finished since the cache was read.
                    if let Some(allowed) = self.decisions.get(&decision_key) {
                        return Ok(allowed);
                    }
                    let state = self.clone();
                    let request = SubjectAccessReview {
                        spec,
                        ..Default::default()
                    };
                    let review = spawned(async move {
                        let answer = state.reviews.access(request).await;
                        let allowed = match answer {
                            Ok(answer) => answer.status.is_some_and(|s| s.allowed),
                            Err(e) => {
                                count("subject_access", "error");
                                lock(&state.access_reviews).remove(&decision_key);
                                return Err(e);
                            }
                        };
                        count("subject_access", if allowed { "allowed" } else { "denied" });
                        state.decisions.put(decision_key, allowed, allowed);
                        lock(&state.access_reviews).remove(&decision_key);
                        Ok(allowed)
                    });
                    in_flight.insert(decision_key, review.clone());
                    review
                }
            }
        };
        review.await
    }
}

impl KubeAuthorizer {
    pub fn new(client: kube::Client, audience: impl Into<String>) -> Self {
        Self::with_reviews(ApiReviews(client), audience)
    }

    pub fn with_reviews(reviews: impl Reviews, audience: impl Into<String>) -> Self {
        Self {
            state: Arc::new(State {
                reviews: Box::new(reviews),
                audience: audience.into(),
                users: Answers::new(),
                decisions: Answers::new(),
                token_reviews: Mutex::new(HashMap::new()),
                access_reviews: Mutex::new(HashMap::new()),
                failures: Mutex::new(LruCache::new(
                    NonZeroUsize::new(ADDRESSES).expect("not zero"),
                )),
                known: Mutex::new(LruCache::new(
                    NonZeroUsize::new(KNOWN_TOKENS).expect("not zero"),
                )),
            }),
        }
    }
}

#[async_trait]
impl Authorizer for KubeAuthorizer {
    async fn authorize(&self, request: &AccessRequest<'_>) -> Result<(), AuthError> {
        let token = bearer(request.headers).ok_or_else(|| {
            AuthError::Unauthenticated(format!(
                "a bearer token is required (a ServiceAccount token for audience {:?})",
                self.state.audience
            ))
        })?;
        let user = self.state.user(token, request.peer).await?;
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
        let allowed = match self.state.decisions.get(&decision_key) {
            Some(allowed) => allowed,
            None => {
                let spec = SubjectAccessReviewSpec {
                    user: user.username.clone(),
                    uid: user.uid.clone(),
                    groups: user.groups.clone(),
                    extra: user
                        .extra
                        .clone()
                        .map(|extra| extra.into_iter().collect::<BTreeMap<String, Vec<String>>>()),
                    resource_attributes: Some(ResourceAttributes {
                        group: Some(crate::api::GROUP.into()),
                        resource: Some(resource.into()),
                        verb: Some(verb.into()),
                        namespace: Some(request.namespace.into()),
                        name: request.subscription.map(str::to_string),
                        ..Default::default()
                    }),
                    ..Default::default()
                };
                self.state.access_review(decision_key, spec).await?
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
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::http::HeaderMap;
    use k8s_openapi::api::authentication::v1::TokenReviewStatus;
    use k8s_openapi::api::authorization::v1::SubjectAccessReviewStatus;

    /// The API server as the tests need it: `good` (and `api` for the API server's own
    /// audience only) authenticate, everything is allowed, each answer after `delay`.
    #[derive(Default)]
    struct Fake {
        token_reviews: AtomicUsize,
        access_reviews: AtomicUsize,
        delay: Duration,
        audiences: Mutex<Vec<Vec<String>>>,
    }

    #[async_trait]
    impl Reviews for Arc<Fake> {
        async fn token(&self, review: TokenReview) -> Result<TokenReview, AuthError> {
            self.token_reviews.fetch_add(1, Ordering::SeqCst);
            let asked = review.spec.audiences.clone().unwrap_or_default();
            lock(&self.audiences).push(asked.clone());
            if !self.delay.is_zero() {
                tokio::time::sleep(self.delay).await;
            }
            let token = review.spec.token.as_deref().unwrap_or_default();
            let status = match token {
                t if t.starts_with("good") => TokenReviewStatus {
                    authenticated: Some(true),
                    audiences: Some(asked),
                    user: Some(UserInfo {
                        username: Some(t.to_string()),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                // Valid, but for the API server: the answer names no audience herald asked for.
                "api" => TokenReviewStatus {
                    authenticated: Some(true),
                    audiences: Some(Vec::new()),
                    user: Some(UserInfo::default()),
                    ..Default::default()
                },
                _ => TokenReviewStatus {
                    authenticated: Some(false),
                    ..Default::default()
                },
            };
            Ok(TokenReview {
                status: Some(status),
                ..review
            })
        }

        async fn access(
            &self,
            review: SubjectAccessReview,
        ) -> Result<SubjectAccessReview, AuthError> {
            self.access_reviews.fetch_add(1, Ordering::SeqCst);
            Ok(SubjectAccessReview {
                status: Some(SubjectAccessReviewStatus {
                    allowed: true,
                    ..Default::default()
                }),
                ..review
            })
        }
    }

    fn authorizer(fake: &Arc<Fake>) -> KubeAuthorizer {
        KubeAuthorizer::with_reviews(fake.clone(), DEFAULT_AUDIENCE)
    }

    fn headers(token: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            axum::http::header::AUTHORIZATION,
            format!("Bearer {token}").parse().unwrap(),
        );
        headers
    }

    async fn publish(auth: &KubeAuthorizer, token: &str, peer: &str) -> Result<(), AuthError> {
        let headers = headers(token);
        auth.authorize(&AccessRequest {
            verb: Verb::Publish,
            namespace: "shop",
            subscription: None,
            headers: &headers,
            peer: Some(peer.parse().unwrap()),
        })
        .await
    }

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

    #[test]
    fn an_ipv6_client_is_its_slash_64() {
        assert_eq!(
            address_key(Some("2001:db8:1:2:aaaa::1".parse().unwrap())),
            address_key(Some("2001:db8:1:2:bbbb::9".parse().unwrap()))
        );
        assert_ne!(
            address_key(Some("2001:db8:1:2::1".parse().unwrap())),
            address_key(Some("2001:db8:1:3::1".parse().unwrap()))
        );
        assert_eq!(
            address_key(Some("::ffff:10.0.0.7".parse().unwrap())),
            "10.0.0.7".parse::<IpAddr>().unwrap()
        );
    }

    #[tokio::test]
    async fn tokens_must_be_for_herald_s_audience() {
        let fake = Arc::new(Fake::default());
        let auth = authorizer(&fake);
        publish(&auth, "good", "10.0.0.1").await.unwrap();
        let refused = publish(&auth, "api", "10.0.0.1").await.unwrap_err();
        assert!(
            matches!(&refused, AuthError::Unauthenticated(m) if m.contains("--audience herald")),
            "{refused:?}"
        );
        assert!(
            lock(&fake.audiences)
                .iter()
                .all(|asked| asked == &vec!["herald".to_string()]),
            "every review names the audience"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn identical_reviews_in_flight_are_sent_once() {
        let fake = Arc::new(Fake {
            delay: Duration::from_millis(300),
            ..Default::default()
        });
        let auth = Arc::new(authorizer(&fake));
        let calls: Vec<_> = (0..50)
            .map(|i| {
                let auth = auth.clone();
                // Distinct addresses: the per-address bound is not what is tested here.
                tokio::spawn(async move {
                    let peer = format!("10.1.0.{i}");
                    (
                        publish(&auth, "bogus", &peer).await.is_err(),
                        publish(&auth, "good-shared", &peer).await.is_ok(),
                    )
                })
            })
            .collect();
        for call in calls {
            assert_eq!(call.await.unwrap(), (true, true));
        }
        assert_eq!(fake.token_reviews.load(Ordering::SeqCst), 2);
        assert_eq!(fake.access_reviews.load(Ordering::SeqCst), 1);
    }

    /// 32 producers sharing one new token start at once from one address (more than the
    /// address's burst): they join one review and are charged once, none is throttled.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_new_token_used_by_many_at_once_is_charged_once() {
        let fake = Arc::new(Fake {
            delay: Duration::from_millis(300),
            ..Default::default()
        });
        let auth = Arc::new(authorizer(&fake));
        let calls: Vec<_> = (0..32)
            .map(|_| {
                let auth = auth.clone();
                tokio::spawn(async move { publish(&auth, "good-new", "10.2.0.1").await })
            })
            .collect();
        for call in calls {
            call.await.unwrap().unwrap();
        }
        assert_eq!(fake.token_reviews.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_flood_of_garbage_tokens_evicts_no_producer() {
        let fake = Arc::new(Fake::default());
        let auth = authorizer(&fake);
        publish(&auth, "good-producer", "10.0.0.1").await.unwrap();
        let reviews = fake.token_reviews.load(Ordering::SeqCst);
        for i in 0..(CACHE_ENTRIES as u32 * 3) {
            // Spread over addresses, as a distributed flood would be.
            let peer = format!("10.{}.{}.{}", i >> 16, (i >> 8) & 0xff, i & 0xff);
            publish(&auth, &format!("bogus-{i}"), &peer)
                .await
                .unwrap_err();
        }
        publish(&auth, "good-producer", "10.0.0.1").await.unwrap();
        assert_eq!(
            fake.token_reviews.load(Ordering::SeqCst),
            reviews + CACHE_ENTRIES * 3,
            "the producer's token was reviewed again: the flood evicted it"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn failing_tokens_are_limited_per_client_address() {
        let fake = Arc::new(Fake::default());
        let auth = authorizer(&fake);
        publish(&auth, "good-producer", "10.0.0.9").await.unwrap();
        let garbage = |count: usize| {
            let (auth, fake) = (&auth, &fake);
            async move {
                let before = fake.token_reviews.load(Ordering::SeqCst);
                let mut throttled = 0;
                for i in 0..count {
                    match publish(auth, &format!("bogus-{i}"), "10.0.0.9").await {
                        Err(AuthError::Throttled(_)) => throttled += 1,
                        Err(AuthError::Unauthenticated(_)) => {}
                        other => panic!("{other:?}"),
                    }
                }
                let reviews = fake.token_reviews.load(Ordering::SeqCst) - before;
                assert_eq!(throttled, count - reviews);
                reviews
            }
        };
        // The clock stands still: the burst, then nothing.
        assert_eq!(garbage(200).await, FAILURE_BURST as usize);
        // Two seconds refill two seconds' worth.
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(garbage(200).await, 2 * FAILURE_RATE as usize);
        // The producer's cached token still passes from that address, and another address
        // is reviewed as usual.
        publish(&auth, "good-producer", "10.0.0.9").await.unwrap();
        assert!(matches!(
            publish(&auth, "bogus-other", "10.0.0.10").await,
            Err(AuthError::Unauthenticated(_))
        ));
        // Once its cached answer has expired, the producer's token is reviewed again even
        // while its address's bucket is empty: it authenticated before.
        tokio::time::advance(ALLOWED_TTL + Duration::from_secs(1)).await;
        garbage(200).await;
        let before = fake.token_reviews.load(Ordering::SeqCst);
        publish(&auth, "good-producer", "10.0.0.9").await.unwrap();
        assert_eq!(fake.token_reviews.load(Ordering::SeqCst), before + 1);
        // Tokens that authenticate cost the address nothing.
        for i in 0..50 {
            publish(&auth, &format!("good-{i}"), "10.0.0.11")
                .await
                .unwrap();
        }
    }
}
