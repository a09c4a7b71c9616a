use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde_json::value::RawValue;

use super::replicas::{PENDING_RECOUNT, recount_wait};
use super::*;
use crate::delivery::clock::now_ms;
use crate::store::testing::FaultyStore;
use crate::store::*;

/// A receiver on 127.0.0.1 that answers 204 and counts what it received.
async fn counting_receiver() -> (std::net::SocketAddr, Arc<AtomicU32>) {
    let hits = Arc::new(AtomicU32::new(0));
    let counted = hits.clone();
    let app = axum::Router::new().fallback(move || {
        counted.fetch_add(1, Ordering::AcqRel);
        async { axum::http::StatusCode::NO_CONTENT }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (address, hits)
}

fn test_engine(store: Arc<dyn Store>) -> Arc<Engine> {
    Engine::for_tests(store)
}

/// Subscription `ns/hook` (uid-1), every event type, to `address`.
fn hook(address: std::net::SocketAddr) -> SubscriptionConfig {
    let spec: crate::api::WebhookSubscriptionSpec = serde_json::from_value(serde_json::json!({
        "url": format!("http://{address}/hook"),
        "eventTypes": ["*"],
        "signing": {"secretRef": {"name": "s", "key": "k"}},
    }))
    .unwrap();
    SubscriptionConfig::from_spec(
        "uid-1",
        "ns",
        "hook",
        &spec,
        Ok(vec!["whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYX".into()]),
    )
    .unwrap()
}

#[tokio::test]
async fn a_sink_lane_is_there_before_its_subscription() {
    let store = Arc::new(FaultyStore::new());
    let engine = test_engine(store.clone());
    let mut config = hook("127.0.0.1:9".parse().unwrap());
    config.dead_letter_sink = Some(Box::new("http://127.0.0.1:9/dead".into()));
    engine.upsert(config.clone()).await.unwrap();
    // Without a sink now, the lane is held: kept, and again first.
    config.dead_letter_sink = None;
    engine.upsert(config).await.unwrap();
    let sink = crate::delivery::sink_uid("uid-1");
    assert_eq!(
        *store.upserted.lock().unwrap(),
        [sink.as_str(), "uid-1", sink.as_str(), "uid-1"]
    );
    assert!(engine.config(&sink).unwrap().paused);
}

/// With several replicas, what another replica publishes reaches this one as the store's
/// new-work notices. A subscription whose shard is held here is announced as published
/// (the status writer then shows its pending count) even when its lane is held, paused or
/// disabled, which no attempt would otherwise mark.
#[tokio::test]
async fn work_another_replica_published_is_announced_for_a_held_lane() {
    let store = Arc::new(FaultyStore::new());
    let engine = test_engine(store.clone());
    let mut config = hook("127.0.0.1:9".parse().unwrap());
    config.paused = true;
    engine.upsert(config).await.unwrap();
    let mut notices = engine.notices();
    let (tell, feed) = crate::store::new_work_feed();
    tokio::spawn(engine.clone().follow_new_work(feed));
    assert!(tell.event("ns", "order.created"));
    let notice = tokio::time::timeout(Duration::from_secs(10), notices.recv())
        .await
        .expect("no notice for the published work")
        .unwrap();
    assert!(
        matches!(&notice, Notice::Published { namespace, subscriptions }
            if namespace == "ns" && subscriptions == &["uid-1".to_string()]),
        "{notice:?}"
    );
}

/// Unregister: a subscription removed, or paused, while a claim of its lane was on its way
/// gets nothing sent (RFC 0215: no attempt starts once the removal is done).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_answered_after_its_subscription_was_removed_or_paused_is_not_sent() {
    for remove in [true, false] {
        let (address, hits) = counting_receiver().await;
        let store = Arc::new(FaultyStore::new());
        let (reached, claimed) = tokio::sync::oneshot::channel();
        let (go, gate) = tokio::sync::oneshot::channel();
        *store.claim_gate.lock().unwrap() = Some((reached, gate));
        let engine = test_engine(store.clone());
        engine.upsert(hook(address)).await.unwrap();
        engine.recover().await.unwrap();
        engine.spawn();
        publish(&engine, "evt-1").await;
        claimed.await.unwrap();
        if remove {
            engine.remove("ns", "uid-1").await.unwrap();
        } else {
            let mut paused = hook(address);
            paused.paused = true;
            engine.upsert(paused).await.unwrap();
        }
        go.send(()).unwrap();
        // The claim is given back (paused) or gone with its delivery (removed).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let in_flight = store
                .list_deliveries("uid-1", StateFilter::All, 10)
                .await
                .unwrap()
                .iter()
                .any(|d| d.state == DeliveryState::InFlight);
            if !in_flight && engine.running.load(Ordering::Acquire) == 0 {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the claim was never given back"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            hits.load(Ordering::Acquire),
            0,
            "sent after removal: {remove}"
        );
    }
}

async fn publish(engine: &Arc<Engine>, id: &str) {
    let data = RawValue::from_string("{}".into()).unwrap();
    engine
        .publish("ns", Some(id.into()), "t", &Origin::default(), &data)
        .await
        .unwrap();
}

/// Polls until `ns/hook`'s first delivery is delivered; panics after `within`.
async fn wait_delivered(engine: &Engine, within: Duration, what: &str) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let list = engine
            .list("ns", "hook", StateFilter::All, 10)
            .await
            .unwrap();
        if list.len() == 1 && list[0].state == DeliveryState::Delivered {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: the delivery never left {:?}",
            list.first().map(|d| d.state)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn a_slow_recount_is_made_less_often() {
    assert_eq!(recount_wait(Duration::from_millis(5)), PENDING_RECOUNT);
    assert_eq!(
        recount_wait(Duration::from_millis(230)),
        Duration::from_millis(4600)
    );
}

/// Issue 9, defect 7: an attempt whose record cannot be committed (a full disk) is
/// recorded once the store commits again, without a restart and without a second POST.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_record_is_retried_not_left_in_flight() {
    let (address, hits) = counting_receiver().await;
    let store = Arc::new(FaultyStore::new());
    store.failures.store(3, Ordering::SeqCst);
    let engine = test_engine(store.clone());
    engine.upsert(hook(address)).await.unwrap();
    engine.recover().await.unwrap();
    engine.spawn();
    publish(&engine, "evt-1").await;

    wait_delivered(&engine, Duration::from_secs(30), "records failing").await;
    assert_eq!(store.failures.load(Ordering::Acquire), 0);
    assert_eq!(hits.load(Ordering::Acquire), 1, "sent again");
}

/// A running engine delivering `hook(address)`, sharing work by `ownership` (one shard),
/// that has taken shard 0 at epoch 1 and holds it for a minute.
async fn holding_the_only_shard(
    store: Arc<dyn Store>,
    ownership: Arc<Ownership>,
    address: std::net::SocketAddr,
) -> Arc<Engine> {
    let engine = test_engine(store.clone());
    engine.share_by_shards(ownership);
    engine.upsert(hook(address)).await.unwrap();
    engine.recover().await.unwrap();
    engine.spawn();
    assert!(store.take_shard(0, "me", 1, now_ms()).await.unwrap());
    engine.hold_shard(0, 1, std::time::Instant::now() + Duration::from_secs(60));
    engine
}

/// A lane that found its shard's hold past its deadline (a slow Lease round) rests; the
/// renewal of that hold at the same epoch must wake it, or its due work waits for the
/// next publish (found by the scale-out test: 10 acknowledged events never delivered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_refused_during_a_lapsed_hold_starts_once_the_hold_is_renewed() {
    let (address, hits) = counting_receiver().await;
    let store = Arc::new(FaultyStore::new());
    let engine = holding_the_only_shard(store, Arc::new(Ownership::new(1)), address).await;
    let later = || std::time::Instant::now() + Duration::from_secs(60);
    // The round that should have renewed it came late: the hold lapses.
    engine.hold_shard(0, 1, std::time::Instant::now());

    publish(&engine, "evt-1").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while engine.lock().scheduler.wants("uid-1") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the lane never rested"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(hits.load(Ordering::Acquire), 0, "sent while not held");

    engine.hold_shard(0, 1, later());
    wait_delivered(&engine, Duration::from_secs(10), "after the renewal").await;
    assert_eq!(hits.load(Ordering::Acquire), 1);
}

/// The store let a fenced claim through, but the hold ended while the claim was on its
/// way (found by the scale-out test: a replica resumed from SIGSTOP sent an attempt for a
/// shard another replica had taken). Nothing is sent; the delivery is due again, its
/// claim not counted as an attempt, and goes out once the shard is held again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_outlives_its_hold_is_given_back_unsent() {
    claim_outlives_its_hold(false).await;
}

/// The same when the claim was made with the publish (an idle lane).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_made_with_its_publish_that_outlives_its_hold_is_given_back_unsent() {
    claim_outlives_its_hold(true).await;
}

async fn claim_outlives_its_hold(claim_with_publish: bool) {
    let (address, hits) = counting_receiver().await;
    let ownership = Arc::new(Ownership::new(1));
    let mut store = FaultyStore::new();
    *store.lapse_during_claim.lock().unwrap() = Some(ownership.clone());
    store.claim_with_publish = claim_with_publish;
    let store = Arc::new(store);
    let engine = holding_the_only_shard(store.clone(), ownership, address).await;
    let later = || std::time::Instant::now() + Duration::from_secs(60);
    // Taking the shard woke the lane: it finds nothing and rests before the publish.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while engine.lock().scheduler.wants("uid-1") || engine.lock().scheduler.in_flight() > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the lane never rested"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    publish(&engine, "evt-1").await;
    assert_eq!(
        store.claimed_with_publish.load(Ordering::Acquire),
        u32::from(claim_with_publish)
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while store.lapse_during_claim.lock().unwrap().is_some()
        || engine.lock().scheduler.wants("uid-1")
        || engine.lock().scheduler.in_flight() > 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the lane never rested"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(hits.load(Ordering::Acquire), 0, "sent after the hold ended");
    let list = engine
        .list("ns", "hook", StateFilter::All, 10)
        .await
        .unwrap();
    assert_eq!(
        (list[0].state, list[0].attempts),
        (DeliveryState::Pending, 0),
        "the claim was not given back"
    );

    engine.hold_shard(0, 1, later());
    wait_delivered(&engine, Duration::from_secs(10), "after the renewal").await;
    assert_eq!(hits.load(Ordering::Acquire), 1);
    let list = engine
        .list("ns", "hook", StateFilter::All, 10)
        .await
        .unwrap();
    assert_eq!(list[0].attempts, 1, "the unsent claim was counted");
}

/// An idle lane's delivery is claimed in its publish's transaction and sent at once, and
/// the lane then rests without a claim of its own; a repeated publish of the same id
/// claims nothing and gives the lane's slot back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_lane_is_claimed_with_its_publish() {
    let (address, hits) = counting_receiver().await;
    let mut store = FaultyStore::new();
    store.claim_with_publish = true;
    let store = Arc::new(store);
    let engine = test_engine(store.clone());
    engine.upsert(hook(address)).await.unwrap();
    engine.recover().await.unwrap();
    engine.spawn();

    let rests = |what: &'static str| {
        let engine = engine.clone();
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while engine.lock().scheduler.in_flight() > 0 || engine.lock().scheduler.wants("uid-1")
            {
                assert!(tokio::time::Instant::now() < deadline, "{what}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    rests("the lane never rested after its start").await;
    let claims_before = store.claims_next.load(Ordering::Acquire);

    publish(&engine, "evt-1").await;
    assert_eq!(store.claimed_with_publish.load(Ordering::Acquire), 1);
    wait_delivered(&engine, Duration::from_secs(10), "claimed with its publish").await;
    rests("the lane never came to rest").await;
    assert_eq!(
        store.claims_next.load(Ordering::Acquire),
        claims_before,
        "the lane asked the store for more after its only delivery"
    );

    publish(&engine, "evt-1").await;
    assert_eq!(store.claimed_with_publish.load(Ordering::Acquire), 1);
    rests("the repeated publish left the lane's slot taken").await;
    assert_eq!(hits.load(Ordering::Acquire), 1);
    let list = engine
        .list("ns", "hook", StateFilter::All, 10)
        .await
        .unwrap();
    assert_eq!((list.len(), list[0].attempts), (1, 1));
}

/// A lane with a backlog claims once, and each delivery's record claims the next; after the
/// last, the record says nothing more is due and the lane rests instead of asking the store
/// (on PostgreSQL a claim that finds nothing cost two statements, 0.3 to 0.7 of them per
/// event delivered, and every delivery a claim of its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_claims_only_what_its_completions_say_is_due() {
    let (address, hits) = counting_receiver().await;
    let store = Arc::new(FaultyStore::new());
    let engine = test_engine(store.clone());
    engine.upsert(hook(address)).await.unwrap();
    engine.recover().await.unwrap();
    for i in 0..3 {
        publish(&engine, &format!("evt-{i}")).await;
    }
    engine.spawn();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while hits.load(Ordering::Acquire) < 3
        || engine.lock().scheduler.in_flight() > 0
        || engine.lock().scheduler.wants("uid-1")
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the backlog was not delivered and the lane never rested"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // One claim of its own; then each delivery's record claims the next in the same round
    // trip, and the last one's says nothing more is due.
    assert_eq!(store.claims_next.load(Ordering::Acquire), 1);
    assert_eq!(store.claimed_with_completion.load(Ordering::Acquire), 2);
    assert_eq!(hits.load(Ordering::Acquire), 3);
}

/// Issue 24 item 10: publishing into namespaces without a subscription does not add a
/// metric series per namespace; a namespace with one keeps its own.
#[tokio::test]
async fn namespaces_without_subscriptions_share_one_published_series() {
    let engine = test_engine(Arc::new(FaultyStore::new()));
    engine
        .upsert(hook("127.0.0.1:9".parse().unwrap()))
        .await
        .unwrap();
    let data = RawValue::from_string("{}".into()).unwrap();
    for i in 0..50 {
        engine
            .publish(&format!("nobody-{i}"), None, "t", &Origin::default(), &data)
            .await
            .unwrap();
    }
    publish(&engine, "evt-1").await;
    let text = crate::metrics::render(&Default::default());
    let series: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("herald_events_published_total{"))
        .collect();
    assert!(
        !series.iter().any(|l| l.contains("namespace=\"nobody-")),
        "a series per namespace without a subscription: {series:?}"
    );
    assert!(
        series.iter().any(|l| l.contains("namespace=\"ns\"")),
        "{series:?}"
    );
    assert!(
        series
            .iter()
            .any(|l| l.contains(&format!("namespace=\"{UNROUTED_NAMESPACE}\""))),
        "{series:?}"
    );
}

/// Issue 24 item 4: a namespace's byte budget refuses its own publishes and writes
/// nothing; what is counted as events are written agrees with the store's count; the
/// disk's reserve refuses every namespace's publishes while free space is within it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn byte_budgets_and_the_disk_reserve_refuse_publishes() {
    let store = Arc::new(FaultyStore::new());
    let engine = test_engine(store.clone());
    engine
        .upsert(hook("127.0.0.1:9".parse().unwrap()))
        .await
        .unwrap();
    let data = RawValue::from_string(format!("{{\"pad\":\"{}\"}}", "x".repeat(1000))).unwrap();
    // Room for three such events (each about 1,100 bytes of body, 512 and 256).
    engine.set_quota("ns", None, None, Some(6_000));
    let mut accepted = 0;
    let refusal = loop {
        match engine
            .publish("ns", None, "t", &Origin::default(), &data)
            .await
        {
            Ok(_) => accepted += 1,
            Err(e) => break e,
        }
        assert!(accepted < 10, "the byte budget never refused");
    };
    assert_eq!(accepted, 3);
    assert!(
        matches!(
            &refusal,
            EngineError::StoredBytesExceeded { limit: 6_000, .. }
        ),
        "{refusal:?}"
    );
    assert!(
        refusal.to_string().contains("maxStoredBytes of 6000"),
        "{refusal}"
    );
    assert_eq!(
        store.stored_bytes().await.unwrap(),
        vec![("ns".to_string(), engine.lock().stored["ns"])],
        "the count kept as events were written and the store's count differ"
    );
    // Other namespaces are not held to ns's budget.
    engine
        .publish("other", None, "t", &Origin::default(), &data)
        .await
        .unwrap();

    // 1 MiB free against a reserve of 64 MiB: nothing is accepted, from anyone.
    let engine = Engine::new(
        store.clone(),
        HttpSender::new(crate::delivery::egress::EgressPolicy::default()).unwrap(),
        EngineConfig {
            store_reserve_bytes: 64 << 20,
            ..engine.config.clone()
        },
    );
    store.free.store(1 << 20, Ordering::SeqCst);
    for namespace in ["ns", "other", "third"] {
        let refusal = engine
            .publish(namespace, None, "t", &Origin::default(), &data)
            .await
            .unwrap_err();
        assert!(
            matches!(refusal, EngineError::StoreReserve { .. }),
            "{refusal:?}"
        );
    }
    store.free.store(1 << 30, Ordering::SeqCst);
    engine
        .publish("third", None, "t", &Origin::default(), &data)
        .await
        .unwrap();
}
