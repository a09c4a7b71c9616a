//! The behaviour every store backend must have. Each backend's tests call [`run`].

use super::*;

const NS: &str = "tenant-a";

fn sub(uid: &str) -> SubscriptionRecord {
    SubscriptionRecord {
        uid: uid.into(),
        namespace: NS.into(),
        name: format!("name-{uid}"),
        paused: false,
        disable_after: 0,
        shard: 0,
        strict_order: false,
    }
}

fn event(id: &str, at: i64) -> NewEvent {
    NewEvent {
        namespace: NS.into(),
        event_id: id.into(),
        event_type: "invoice.paid".into(),
        body: format!("{{\"id\":\"{id}\"}}").into_bytes(),
        published_ms: at,
    }
}

fn attempt(at: i64, outcome: &str, status: Option<u16>) -> AttemptRecord {
    AttemptRecord {
        at_ms: at,
        outcome: outcome.into(),
        status_code: status,
        latency_ms: 3,
        message: "m".into(),
    }
}

async fn claim(store: &dyn Store, uid: &str, now: i64) -> Claimed {
    match store.claim_next(uid, now).await.unwrap() {
        Claim::Claimed(c) => c,
        Claim::Idle { next_due_ms } => {
            panic!("nothing to claim for {uid} (next due {next_due_ms:?})")
        }
    }
}

async fn claim_fenced(store: &dyn Store, uid: &str, now: i64, fence: ShardFence) -> Claimed {
    match store.claim_fenced(uid, now, fence).await.unwrap() {
        Claim::Claimed(c) => c,
        Claim::Idle { next_due_ms } => {
            panic!("nothing to claim for {uid} under {fence:?} (next due {next_due_ms:?})")
        }
    }
}

async fn idle(store: &dyn Store, uid: &str, now: i64) -> Option<i64> {
    match store.claim_next(uid, now).await.unwrap() {
        Claim::Idle { next_due_ms } => next_due_ms,
        Claim::Claimed(c) => panic!("claimed {} for {uid}", c.event_id),
    }
}

/// Publishes `{prefix}0` .. `{prefix}{count - 1}` at `at` to `uid`.
async fn publish_to(store: &dyn Store, uid: &str, prefix: &str, count: usize, at: i64) {
    for i in 0..count {
        store
            .publish(event(&format!("{prefix}{i}"), at), vec![uid.into()])
            .await
            .unwrap();
    }
}

pub async fn run(store: &dyn Store) {
    publish_is_atomic_idempotent_and_fenced(store).await;
    a_batch_publishes_each_as_a_publish_would(store).await;
    claims_follow_publish_order_and_due_time(store).await;
    removal_purges_and_fences_forever(store).await;
    completion_counts_and_auto_disables(store).await;
    gone_disables_at_once(store).await;
    strict_order_settles_each_event_first(store).await;
    dead_letters_list_and_replay(store).await;
    replay_by_publish_time(store).await;
    attempts_are_searched_by_namespace(store).await;
    a_death_queues_its_letter_with_it(store).await;
    in_flight_is_recovered(store).await;
    pause_blocks_claims(store).await;
    prune_keeps_what_is_unfinished(store).await;
    shard_epochs_fence_claims(store).await;
    claims_made_with_a_publish(store).await;
    stale_claims_complete_nothing(store).await;
    completions_claim_the_next_delivery(store).await;
}

async fn publish_is_atomic_idempotent_and_fenced(store: &dyn Store) {
    store.upsert_subscription(sub("p1")).await.unwrap();
    store.upsert_subscription(sub("p2")).await.unwrap();
    let first = store
        .publish(
            event("evt-p", 1000),
            vec!["p1".into(), "p2".into(), "unknown".into()],
        )
        .await
        .unwrap();
    assert_eq!(first.matched, 2, "only live subscriptions get deliveries");
    assert!(!first.duplicate);
    assert_eq!(first.targets, ["p1", "p2"]);

    let again = store
        .publish(event("evt-p", 2000), vec!["p1".into()])
        .await
        .unwrap();
    assert!(again.duplicate);
    assert_eq!(again.matched, 2, "a repeated id gets the first answer");
    assert!(again.targets.is_empty());
    // The same first answer, looked up without publishing (issue 9, defect 8).
    assert_eq!(
        store.published(NS, "evt-p").await.unwrap(),
        Some(again.clone())
    );
    assert_eq!(store.published(NS, "evt-unknown").await.unwrap(), None);
    assert_eq!(
        store
            .list_deliveries("p1", StateFilter::All, 10)
            .await
            .unwrap()
            .len(),
        1
    );

    // Another namespace may use the same id, and a target of another namespace is refused.
    let mut other = event("evt-p", 1000);
    other.namespace = "tenant-b".into();
    assert_eq!(
        store
            .publish(other, vec!["p1".into()])
            .await
            .unwrap()
            .matched,
        0
    );
    store.remove_subscription("p1").await.unwrap();
    store.remove_subscription("p2").await.unwrap();
}

async fn a_batch_publishes_each_as_a_publish_would(store: &dyn Store) {
    store.upsert_subscription(sub("b1")).await.unwrap();
    store.upsert_subscription(sub("b2")).await.unwrap();
    store
        .publish(event("evt-b-before", 1000), vec!["b1".into()])
        .await
        .unwrap();
    let batch = vec![
        (event("evt-b-1", 2000), vec!["b1".into(), "b2".into()]),
        // Published before the batch: its first answer, nothing written.
        (event("evt-b-before", 2000), vec!["b1".into(), "b2".into()]),
        // An unknown target gets no delivery.
        (event("evt-b-2", 2000), vec!["b2".into(), "unknown".into()]),
        // Earlier in this batch: the first one's answer.
        (event("evt-b-1", 2000), vec!["b2".into()]),
    ];
    let results = store.publish_batch(batch).await.unwrap();
    let figures: Vec<(&str, u32, bool, Vec<String>)> = results
        .iter()
        .map(|r| {
            (
                r.event_id.as_str(),
                r.matched,
                r.duplicate,
                r.targets.clone(),
            )
        })
        .collect();
    assert_eq!(
        figures,
        [
            ("evt-b-1", 2, false, vec!["b1".into(), "b2".into()]),
            ("evt-b-before", 1, true, vec![]),
            ("evt-b-2", 1, false, vec!["b2".into()]),
            ("evt-b-1", 2, true, vec![]),
        ]
    );
    assert_eq!(pending_ids(store, "b1").await, ["evt-b-1", "evt-b-before"]);
    assert_eq!(pending_ids(store, "b2").await, ["evt-b-1", "evt-b-2"]);
    for uid in ["b1", "b2"] {
        store.remove_subscription(uid).await.unwrap();
    }
}

async fn claims_follow_publish_order_and_due_time(store: &dyn Store) {
    store.upsert_subscription(sub("o1")).await.unwrap();
    for i in 0..3 {
        store
            .publish(event(&format!("evt-o{i}"), 1000 + i), vec!["o1".into()])
            .await
            .unwrap();
    }
    assert_eq!(idle(store, "o1", 999).await, Some(1000), "not due yet");
    let a = claim(store, "o1", 5000).await;
    let b = claim(store, "o1", 5000).await;
    assert_eq!(
        (a.event_id.as_str(), b.event_id.as_str()),
        ("evt-o0", "evt-o1")
    );
    assert_eq!(a.attempt, 1);
    assert_eq!(a.window_start_ms, 1000);
    assert_eq!(a.body, b"{\"id\":\"evt-o0\"}");

    // A retry goes back to pending with a due time and does not block later events.
    store
        .complete(
            a.claim_ref(),
            attempt(5001, "Transient", Some(500)),
            Next::Retry { due_ms: 9000 },
        )
        .await
        .unwrap();
    let c = claim(store, "o1", 5002).await;
    assert_eq!(c.event_id, "evt-o2");
    assert_eq!(idle(store, "o1", 5003).await, Some(9000));
    let retried = claim(store, "o1", 9000).await;
    assert_eq!((retried.event_id.as_str(), retried.attempt), ("evt-o0", 2));
    store.remove_subscription("o1").await.unwrap();
}

async fn removal_purges_and_fences_forever(store: &dyn Store) {
    store.upsert_subscription(sub("r1")).await.unwrap();
    store.upsert_subscription(sub("r-control")).await.unwrap();
    for i in 0..5 {
        store
            .publish(
                event(&format!("evt-r{i}"), 100),
                vec!["r1".into(), "r-control".into()],
            )
            .await
            .unwrap();
    }
    let on_the_wire = claim(store, "r1", 200).await;
    assert_eq!(
        store.remove_subscription("r1").await.unwrap(),
        5,
        "4 pending + 1 in flight purged"
    );
    assert_eq!(idle(store, "r1", i64::MAX).await, None);

    // The attempt that was on the wire may finish, but cannot schedule a retry.
    let done = store
        .complete(
            on_the_wire.claim_ref(),
            attempt(300, "Transient", Some(500)),
            Next::Retry { due_ms: 400 },
        )
        .await
        .unwrap();
    assert!(!done.recorded);
    assert_eq!(idle(store, "r1", i64::MAX).await, None);

    // A stale cache upserting the removed subscription does not bring it back.
    let state = store.upsert_subscription(sub("r1")).await.unwrap();
    assert!(!state.live);
    assert_eq!(
        store
            .publish(event("evt-r-late", 500), vec!["r1".into()])
            .await
            .unwrap()
            .matched,
        0
    );
    assert_eq!(idle(store, "r1", i64::MAX).await, None);
    assert_eq!(store.replay("r1", Replay::default(), 600).await.unwrap(), 0);
    assert_eq!(store.recover_in_flight(700).await.unwrap(), 0);
    assert_eq!(idle(store, "r1", i64::MAX).await, None);

    // The control is untouched.
    assert_eq!(
        store
            .subscription_state("r-control")
            .await
            .unwrap()
            .unwrap()
            .pending,
        5
    );
    store.remove_subscription("r-control").await.unwrap();
}

async fn completion_counts_and_auto_disables(store: &dyn Store) {
    store
        .upsert_subscription(SubscriptionRecord {
            disable_after: 3,
            ..sub("d1")
        })
        .await
        .unwrap();
    publish_to(store, "d1", "evt-d", 4, 100).await;
    let first = claim(store, "d1", 100).await;
    let done = store
        .complete(
            first.claim_ref(),
            attempt(101, "Accepted", Some(204)),
            Next::Delivered,
        )
        .await
        .unwrap();
    assert_eq!(
        done,
        Completion {
            recorded: true,
            disabled_now: false,
            consecutive_failures: 0,
            // Three more wait, due since 100: the lane claims again at once.
            next_due_ms: Some(100),
            letter_queued: false,
        }
    );

    let mut disabled_at = None;
    for n in 1..=3 {
        let c = claim(store, "d1", 200).await;
        let done = store
            .complete(
                c.claim_ref(),
                attempt(201, "Terminal", Some(404)),
                Next::DeadLetter,
            )
            .await
            .unwrap();
        assert_eq!(done.consecutive_failures, n);
        // The last one waiting was just dead-lettered (and the subscription disabled):
        // nothing is due, and the lane rests instead of claiming to find that out.
        assert_eq!(done.next_due_ms, (n < 3).then_some(100), "after {n}");
        if done.disabled_now {
            disabled_at = Some(n);
        }
    }
    assert_eq!(disabled_at, Some(3), "disableAfter = 3");
    let state = store.subscription_state("d1").await.unwrap().unwrap();
    assert!(state.disabled);
    assert_eq!(
        (state.delivered, state.failed, state.dead_lettered),
        (1, 3, 3)
    );
    assert_eq!(state.pending, 0);

    store
        .publish(event("evt-d-while-disabled", 300), vec!["d1".into()])
        .await
        .unwrap();
    assert_eq!(
        idle(store, "d1", i64::MAX).await,
        None,
        "disabled: no claim"
    );
    let state = store.set_disabled("d1", false).await.unwrap();
    assert!(!state.disabled);
    assert_eq!(state.consecutive_failures, 0);
    claim(store, "d1", 400).await;
    store.remove_subscription("d1").await.unwrap();
}

/// A 410 Gone dead-letters its delivery and disables the subscription at once, even one
/// that never auto-disables; a second 410 from an attempt that was on the wire meanwhile
/// does not disable it again. A re-enable clears the reason.
async fn gone_disables_at_once(store: &dyn Store) {
    store.upsert_subscription(sub("g1")).await.unwrap();
    publish_to(store, "g1", "evt-g", 3, 100).await;
    let first = claim(store, "g1", 100).await;
    let second = claim(store, "g1", 100).await;
    let done = store
        .complete(
            first.claim_ref(),
            attempt(101, "Gone", Some(410)),
            Next::Gone,
        )
        .await
        .unwrap();
    assert_eq!(
        done,
        Completion {
            recorded: true,
            disabled_now: true,
            consecutive_failures: 1,
            next_due_ms: None,
            letter_queued: false,
        }
    );
    let state = store.subscription_state("g1").await.unwrap().unwrap();
    assert!(state.disabled && state.gone, "{state:?}");
    assert_eq!((state.failed, state.dead_lettered, state.dead), (1, 1, 1));
    assert_eq!(idle(store, "g1", i64::MAX).await, None, "gone: no claim");
    let done = store
        .complete(
            second.claim_ref(),
            attempt(102, "Gone", Some(410)),
            Next::Gone,
        )
        .await
        .unwrap();
    assert!(done.recorded && !done.disabled_now, "{done:?}");
    let state = store.set_disabled("g1", false).await.unwrap();
    assert!(!state.disabled && !state.gone, "{state:?}");
    assert_eq!(claim(store, "g1", 200).await.event_id, "evt-g2");
    store.remove_subscription("g1").await.unwrap();
}

/// Under strict order a claim takes only the oldest unsettled delivery, and only while none
/// is in flight; a retry holds back later events until it is delivered or dead-lettered,
/// and every answer says when the lane's next claim can succeed.
async fn strict_order_settles_each_event_first(store: &dyn Store) {
    let strict = SubscriptionRecord {
        strict_order: true,
        ..sub("strict1")
    };
    // Published while unordered, then made strict: the waiting deliveries follow.
    store.upsert_subscription(sub("strict1")).await.unwrap();
    publish_to(store, "strict1", "evt-so", 3, 100).await;
    store.upsert_subscription(strict.clone()).await.unwrap();
    assert_eq!(
        store
            .live_subscriptions()
            .await
            .unwrap()
            .iter()
            .find(|s| s.uid == "strict1"),
        Some(&strict)
    );
    let first = claim(store, "strict1", 100).await;
    assert_eq!(first.event_id, "evt-so0");
    assert_eq!(
        idle(store, "strict1", 100).await,
        None,
        "one in flight holds the lane"
    );
    let done = store
        .complete(
            first.claim_ref(),
            attempt(101, "Transient", Some(500)),
            Next::Retry { due_ms: 500 },
        )
        .await
        .unwrap();
    assert_eq!(done.next_due_ms, Some(500), "the retry stays the oldest");
    assert_eq!(
        idle(store, "strict1", 200).await,
        Some(500),
        "later events wait"
    );
    let again = claim(store, "strict1", 500).await;
    assert_eq!((again.event_id.as_str(), again.attempt), ("evt-so0", 2));
    let (done, following) = store
        .complete_and_claim(
            again.claim_ref(),
            attempt(501, "Accepted", Some(204)),
            Next::Delivered,
            Some(600),
        )
        .await
        .unwrap();
    let second = following.expect("the next event, claimed with the record");
    assert_eq!(second.event_id, "evt-so1");
    assert_eq!(done.next_due_ms, None, "claimed with the record: in flight");
    let done = store
        .complete(
            second.claim_ref(),
            attempt(601, "Terminal", Some(400)),
            Next::DeadLetter,
        )
        .await
        .unwrap();
    assert_eq!(
        done.next_due_ms,
        Some(100),
        "dead-lettered: the lane moves on"
    );
    assert_eq!(claim(store, "strict1", 700).await.event_id, "evt-so2");
    // Unordered again: the flag follows the spec.
    store.upsert_subscription(sub("strict1")).await.unwrap();
    assert!(
        !store
            .live_subscriptions()
            .await
            .unwrap()
            .iter()
            .any(|s| s.uid == "strict1" && s.strict_order)
    );
    store.remove_subscription("strict1").await.unwrap();
}

/// The event ids of the subscription's pending deliveries, sorted.
async fn pending_ids(store: &dyn Store, uid: &str) -> Vec<String> {
    let mut ids: Vec<String> = store
        .list_deliveries(uid, StateFilter::Pending, 100)
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.event_id)
        .collect();
    ids.sort();
    ids
}

/// A replay by the time its events were published: `[since, until)`, alone or with ids.
async fn replay_by_publish_time(store: &dyn Store) {
    store.upsert_subscription(sub("tr1")).await.unwrap();
    for (i, at) in [100, 200, 300, 400].into_iter().enumerate() {
        store
            .publish(event(&format!("evt-t{i}"), at), vec!["tr1".into()])
            .await
            .unwrap();
        let c = claim(store, "tr1", at).await;
        store
            .complete(
                c.claim_ref(),
                attempt(at, "Terminal", Some(400)),
                Next::DeadLetter,
            )
            .await
            .unwrap();
    }
    let range = |since, until| Replay {
        since_ms: since,
        until_ms: until,
        ..Replay::default()
    };
    assert_eq!(
        store
            .replay("tr1", range(Some(200), Some(400)), 500)
            .await
            .unwrap(),
        2
    );
    assert_eq!(pending_ids(store, "tr1").await, ["evt-t1", "evt-t2"]);
    let ids_after = Replay {
        since_ms: Some(350),
        ..Replay::events(vec!["evt-t0".into(), "evt-t3".into()])
    };
    assert_eq!(store.replay("tr1", ids_after, 500).await.unwrap(), 1);
    assert_eq!(
        store
            .replay("tr1", range(None, Some(150)), 500)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        pending_ids(store, "tr1").await,
        ["evt-t0", "evt-t1", "evt-t2", "evt-t3"]
    );
    store.remove_subscription("tr1").await.unwrap();
}

/// Every page of a search, followed by its cursor to the end.
async fn search_all(store: &dyn Store, search: AttemptSearch) -> Vec<AttemptHit> {
    let mut found = Vec::new();
    let mut search = search;
    for _ in 0..1_000 {
        let page = store.search_attempts(search.clone()).await.unwrap();
        assert!(page.items.len() <= search.limit as usize);
        found.extend(page.items);
        match page.next {
            Some(next) => {
                assert!(
                    search.before.is_none_or(|before| next < before),
                    "the cursor moves on"
                );
                search.before = Some(next);
            }
            None => return found,
        }
    }
    panic!("a search that never ends");
}

async fn attempts_are_searched_by_namespace(store: &dyn Store) {
    let in_ns = |uid: &str, ns: &str| SubscriptionRecord {
        namespace: ns.into(),
        ..sub(uid)
    };
    for (uid, ns) in [
        ("sa1", "tenant-s"),
        ("sa2", "tenant-s"),
        ("so1", "tenant-o"),
    ] {
        store.upsert_subscription(in_ns(uid, ns)).await.unwrap();
    }
    // sa1: a 503 then a 200 per event; sa2: a 400, dead; so1 (another namespace): a 503 each.
    for i in 0..5_i64 {
        let at = 10_000 + i * 100;
        for ns in ["tenant-s", "tenant-o"] {
            let targets = if ns == "tenant-s" {
                vec!["sa1".into(), "sa2".into()]
            } else {
                vec!["so1".into()]
            };
            let e = NewEvent {
                namespace: ns.into(),
                ..event(&format!("evt-s{i}"), at)
            };
            store.publish(e, targets).await.unwrap();
        }
        // (lane, at, outcome, status, what follows), in this order.
        let busy = |due_ms| ("Transient", Some(503), Next::Retry { due_ms });
        for (uid, at, (outcome, status, next)) in [
            ("sa1", at, busy(at)),
            ("so1", at, busy(at + 1_000_000)),
            ("sa2", at + 10, ("Terminal", Some(400), Next::DeadLetter)),
            ("sa1", at + 20, ("Accepted", Some(200), Next::Delivered)),
        ] {
            let c = claim(store, uid, at).await;
            store
                .complete(c.claim_ref(), attempt(at, outcome, status), next)
                .await
                .unwrap();
        }
    }
    let search = |limit| AttemptSearch {
        namespace: "tenant-s".into(),
        limit,
        ..AttemptSearch::default()
    };
    let shown = |hits: &[AttemptHit]| -> Vec<String> {
        hits.iter()
            .map(|h| format!("{} {} {}", h.subscription, h.event_id, h.attempt.outcome))
            .collect()
    };
    // Newest first, only the namespace's, the same however it is paged.
    let all = search_all(store, search(100)).await;
    let mut expected = Vec::new();
    for i in (0..5).rev() {
        expected.push(format!("name-sa1 evt-s{i} Accepted"));
        expected.push(format!("name-sa2 evt-s{i} Terminal"));
        expected.push(format!("name-sa1 evt-s{i} Transient"));
    }
    assert_eq!(shown(&all), expected);
    assert_eq!(
        shown(&search_all(store, search(4)).await),
        expected,
        "paged by 4"
    );
    assert_eq!(
        shown(&search_all(store, search(1)).await),
        expected,
        "paged by 1"
    );
    // A page reads at most SEARCH_SCAN_ROWS (16 here) of the log: the newest 16 rows hold
    // other namespaces' too, so the first page holds fewer than all 15 and a cursor; a search for something absent comes back empty
    // with a cursor rather than reading the whole log.
    let first = store.search_attempts(search(100)).await.unwrap();
    assert!(first.next.is_some() && first.items.len() < 15, "{first:?}");
    let absent = AttemptSearch {
        status_code: Some(418),
        ..search(100)
    };
    let page = store.search_attempts(absent.clone()).await.unwrap();
    assert!(page.items.is_empty() && page.next.is_some(), "{page:?}");
    assert!(search_all(store, absent).await.is_empty());
    // Filters.
    let by = |f: fn(&mut AttemptSearch)| {
        let mut s = search(100);
        f(&mut s);
        s
    };
    let dead = search_all(store, by(|s| s.subscription = Some("name-sa2".into()))).await;
    assert_eq!(dead.len(), 5);
    assert!(
        dead.iter()
            .all(|h| h.attempt.outcome == "Terminal" && h.attempt.status_code == Some(400))
    );
    let failed = search_all(
        store,
        by(|s| s.outcomes = Some(vec!["Transient".into(), "Terminal".into()])),
    )
    .await;
    assert_eq!(failed.len(), 10);
    assert!(failed.iter().all(|h| h.attempt.outcome != "Accepted"));
    let ok = search_all(store, by(|s| s.status_code = Some(200))).await;
    assert_eq!(ok.len(), 5);
    assert!(ok.iter().all(|h| h.attempt.outcome == "Accepted"));
    let window = search_all(
        store,
        by(|s| {
            s.since_ms = Some(10_110);
            s.until_ms = Some(10_300)
        }),
    )
    .await;
    assert_eq!(
        shown(&window),
        [
            "name-sa1 evt-s2 Accepted",
            "name-sa2 evt-s2 Terminal",
            "name-sa1 evt-s2 Transient",
            "name-sa1 evt-s1 Accepted",
            "name-sa2 evt-s1 Terminal",
        ]
    );
    let other = search_all(
        store,
        AttemptSearch {
            namespace: "tenant-o".into(),
            ..search(100)
        },
    )
    .await;
    assert_eq!(other.len(), 5);
    assert!(other.iter().all(|h| h.subscription == "name-so1"));
    for uid in ["sa1", "sa2", "so1"] {
        store.remove_subscription(uid).await.unwrap();
    }
}

async fn a_death_queues_its_letter_with_it(store: &dyn Store) {
    store.upsert_subscription(sub("dl1")).await.unwrap();
    let sink = sink_uid("dl1");
    store.upsert_subscription(sub(&sink)).await.unwrap();
    let letter = |id: &str| NewEvent {
        event_type: "herald.dead_letter".into(),
        ..event(id, 700)
    };
    publish_to(store, "dl1", "evt-dl", 2, 600).await;
    // A stale claim's death is history only: no letter.
    let first = claim(store, "dl1", 600).await;
    let stale = ClaimRef {
        attempt: first.attempt + 1,
        ..first.claim_ref()
    };
    let dead = attempt(700, "Terminal", Some(400));
    let done = store
        .complete_dead_letter(
            stale,
            dead.clone(),
            Next::DeadLetter,
            letter("letter-0"),
            sink.clone(),
        )
        .await
        .unwrap();
    assert!(!done.recorded && !done.letter_queued);
    assert!(pending_ids(store, &sink).await.is_empty());
    // Recorded: the delivery is dead and the letter waits on the sink's lane.
    let done = store
        .complete_dead_letter(
            first.claim_ref(),
            dead.clone(),
            Next::DeadLetter,
            letter("letter-1"),
            sink.clone(),
        )
        .await
        .unwrap();
    assert!(done.recorded && done.letter_queued);
    assert_eq!(pending_ids(store, &sink).await, ["letter-1"]);
    let sent = claim(store, &sink, 800).await;
    assert_eq!(
        (sent.event_type.as_str(), sent.body.clone()),
        ("herald.dead_letter", letter("letter-1").body)
    );
    // The same record again (its answer was lost): stale now, nothing more queued.
    let again = store
        .complete_dead_letter(
            first.claim_ref(),
            dead.clone(),
            Next::DeadLetter,
            letter("letter-1"),
            sink.clone(),
        )
        .await
        .unwrap();
    assert!(!again.recorded && !again.letter_queued);
    // A sink's lane that is gone gets nothing; the death is recorded all the same.
    store
        .complete(
            sent.claim_ref(),
            attempt(800, "Accepted", Some(200)),
            Next::Delivered,
        )
        .await
        .unwrap();
    store.remove_subscription(&sink).await.unwrap();
    let second = claim(store, "dl1", 900).await;
    let done = store
        .complete_dead_letter(
            second.claim_ref(),
            dead,
            Next::DeadLetter,
            letter("letter-2"),
            sink.clone(),
        )
        .await
        .unwrap();
    // Not queued, so the engine counts no letter pending.
    assert!(done.recorded && !done.letter_queued);
    assert!(pending_ids(store, &sink).await.is_empty());
    assert_eq!(
        store.subscription_state("dl1").await.unwrap().unwrap().dead,
        2
    );
    store.remove_subscription("dl1").await.unwrap();
    // Removing a subscription purges and fences its sink's lane with it.
    store.upsert_subscription(sub("dl2")).await.unwrap();
    let sink = sink_uid("dl2");
    store.upsert_subscription(sub(&sink)).await.unwrap();
    publish_to(store, &sink, "evt-dl2-letter", 2, 1000).await;
    assert_eq!(store.remove_subscription("dl2").await.unwrap(), 2);
    assert!(!store.subscription_state(&sink).await.unwrap().unwrap().live);
    assert!(!store.upsert_subscription(sub(&sink)).await.unwrap().live);
}

async fn dead_letters_list_and_replay(store: &dyn Store) {
    store.upsert_subscription(sub("x1")).await.unwrap();
    for i in 0..3 {
        store
            .publish(event(&format!("evt-x{i}"), 100), vec!["x1".into()])
            .await
            .unwrap();
        let c = claim(store, "x1", 100).await;
        store
            .complete(
                c.claim_ref(),
                attempt(110, "Terminal", Some(404)),
                Next::DeadLetter,
            )
            .await
            .unwrap();
    }
    let dead = store
        .list_deliveries("x1", StateFilter::Dead, 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 3);
    assert_eq!(dead[0].state, DeliveryState::Dead);
    assert_eq!(
        dead[0].last_attempt.as_ref().unwrap().status_code,
        Some(404)
    );
    // Each names its last attempt's place in the log, as a search finds it.
    let logged = store
        .search_attempts(AttemptSearch {
            namespace: NS.into(),
            subscription: Some("name-x1".into()),
            limit: 10,
            ..AttemptSearch::default()
        })
        .await
        .unwrap();
    let mut named: Vec<i64> = dead.iter().filter_map(|d| d.last_attempt_id).collect();
    named.sort_unstable();
    let mut found = logged.ids.clone();
    found.sort_unstable();
    assert_eq!(named, found);
    assert!(
        store
            .list_deliveries("x1", StateFilter::Pending, 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(store.attempts("x1", "evt-x0").await.unwrap().len(), 1);

    assert_eq!(
        store
            .replay(
                "x1",
                Replay::events(vec!["evt-x1".into(), "nope".into()]),
                500
            )
            .await
            .unwrap(),
        1
    );
    let replayed = claim(store, "x1", 500).await;
    assert_eq!(
        (
            replayed.event_id.as_str(),
            replayed.attempt,
            replayed.window_start_ms
        ),
        ("evt-x1", 1, 500)
    );
    assert_eq!(store.replay("x1", Replay::default(), 600).await.unwrap(), 2);
    assert_eq!(
        store
            .list_deliveries("x1", StateFilter::Pending, 10)
            .await
            .unwrap()
            .len(),
        3
    );
    store.remove_subscription("x1").await.unwrap();
}

async fn in_flight_is_recovered(store: &dyn Store) {
    store.upsert_subscription(sub("c1")).await.unwrap();
    store
        .publish(event("evt-c", 100), vec!["c1".into()])
        .await
        .unwrap();
    let c = claim(store, "c1", 100).await;
    assert_eq!(idle(store, "c1", 100).await, None);
    assert_eq!(store.recover_in_flight(200).await.unwrap(), 1);
    let again = claim(store, "c1", 200).await;
    assert_eq!((again.delivery_id, again.attempt), (c.delivery_id, 2));
    let pending = store.pending_by_subscription().await.unwrap();
    assert!(pending.contains(&("c1".into(), NS.into(), 1)));
    store.remove_subscription("c1").await.unwrap();
}

async fn pause_blocks_claims(store: &dyn Store) {
    let mut paused = sub("z1");
    paused.paused = true;
    store.upsert_subscription(paused.clone()).await.unwrap();
    assert_eq!(
        store
            .publish(event("evt-z", 100), vec!["z1".into()])
            .await
            .unwrap()
            .matched,
        1
    );
    assert_eq!(idle(store, "z1", 1000).await, None);
    paused.paused = false;
    store.upsert_subscription(paused).await.unwrap();
    claim(store, "z1", 1000).await;
    store.remove_subscription("z1").await.unwrap();
}

/// Retention: `prune(cutoff)` drops attempt history older than the cutoff (of every
/// delivery, dead letters included), delivered deliveries that finished before it, and
/// events older than it that no delivery refers to any more, so their ids may be published
/// again. It keeps pending deliveries and dead letters of live subscriptions, whatever their
/// age; a removed subscription's finished deliveries go.
async fn prune_keeps_what_is_unfinished(store: &dyn Store) {
    const CUTOFF: i64 = 10_000;
    store.upsert_subscription(sub("k1")).await.unwrap();
    store.upsert_subscription(sub("k2")).await.unwrap();
    // (event id, subscription, published, finished at, outcome, next)
    let cases: [(&str, &str, i64, i64, &str, Next); 6] = [
        (
            "evt-k-old-done",
            "k1",
            100,
            150,
            "Accepted",
            Next::Delivered,
        ),
        (
            "evt-k-old-pending",
            "k1",
            100,
            150,
            "Transient",
            Next::Retry { due_ms: 50_000 },
        ),
        (
            "evt-k-old-dead",
            "k1",
            100,
            150,
            "Terminal",
            Next::DeadLetter,
        ),
        (
            "evt-k-late-done",
            "k1",
            100,
            20_000,
            "Accepted",
            Next::Delivered,
        ),
        (
            "evt-k-new-done",
            "k1",
            20_000,
            20_010,
            "Accepted",
            Next::Delivered,
        ),
        (
            "evt-k-gone-dead",
            "k2",
            100,
            150,
            "Terminal",
            Next::DeadLetter,
        ),
    ];
    for (id, uid, published, finished, outcome, next) in cases {
        store
            .publish(event(id, published), vec![uid.into()])
            .await
            .unwrap();
        let c = claim(store, uid, published).await;
        assert_eq!(c.event_id, id);
        store
            .complete(c.claim_ref(), attempt(finished, outcome, Some(500)), next)
            .await
            .unwrap();
    }
    store.remove_subscription("k2").await.unwrap();
    assert_eq!(
        store
            .list_deliveries("k2", StateFilter::Dead, 10)
            .await
            .unwrap()
            .len(),
        1,
        "removal purges unfinished deliveries only"
    );

    assert!(store.prune(CUTOFF).await.unwrap() >= 6);

    let left = store
        .list_deliveries("k1", StateFilter::All, 10)
        .await
        .unwrap();
    let ids: Vec<_> = left.iter().map(|d| d.event_id.as_str()).collect();
    // Listed by state (pending, delivered, dead), each in the order it was due.
    assert_eq!(
        ids,
        [
            "evt-k-old-pending",
            "evt-k-late-done",
            "evt-k-new-done",
            "evt-k-old-dead"
        ],
        "only the delivery that finished before the cutoff is pruned"
    );
    // History older than the cutoff is gone, also of what is kept; newer history stays.
    for (id, history) in [
        ("evt-k-old-done", 0),
        ("evt-k-old-pending", 0),
        ("evt-k-old-dead", 0),
        ("evt-k-late-done", 1),
        ("evt-k-new-done", 1),
    ] {
        assert_eq!(
            store.attempts("k1", id).await.unwrap().len(),
            history,
            "{id}"
        );
    }
    // The dead letter is kept, without its history, and can still be replayed.
    let dead = &left[3];
    assert_eq!(
        (dead.state, dead.attempts, dead.last_attempt.as_ref()),
        (DeliveryState::Dead, 1, None)
    );
    assert_eq!(left[0].state, DeliveryState::Pending);
    assert_eq!(left[0].next_due_ms, Some(50_000));
    assert!(
        store
            .list_deliveries("k2", StateFilter::All, 10)
            .await
            .unwrap()
            .is_empty(),
        "a removed subscription's dead letters are pruned"
    );
    // An event still referred to keeps its id; a pruned event's id may be published again.
    for id in ["evt-k-old-pending", "evt-k-old-dead", "evt-k-late-done"] {
        assert!(
            store
                .publish(event(id, 30_000), vec!["k1".into()])
                .await
                .unwrap()
                .duplicate,
            "{id}"
        );
    }
    let again = store
        .publish(event("evt-k-old-done", 30_000), vec!["k1".into()])
        .await
        .unwrap();
    assert_eq!((again.duplicate, again.matched), (false, 1));
    assert_eq!(
        store
            .replay("k1", Replay::events(vec!["evt-k-old-dead".into()]), 30_000)
            .await
            .unwrap(),
        1
    );
    store.remove_subscription("k1").await.unwrap();
}

/// Writes state that must survive closing and reopening the store.
pub async fn seed_for_reopen(store: &dyn Store) {
    store.upsert_subscription(sub("s1")).await.unwrap();
    store.upsert_subscription(sub("s-gone")).await.unwrap();
    store
        .publish(event("evt-s1", 100), vec!["s1".into(), "s-gone".into()])
        .await
        .unwrap();
    claim(store, "s1", 100).await; // in flight at "crash"
    store.remove_subscription("s-gone").await.unwrap();
}

pub async fn check_after_reopen(store: &dyn Store) {
    let live: Vec<_> = store
        .live_subscriptions()
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.uid)
        .collect();
    assert_eq!(live, ["s1"]);
    assert_eq!(store.recover_in_flight(200).await.unwrap(), 1);
    assert_eq!(claim(store, "s1", 200).await.event_id, "evt-s1");
    assert_eq!(idle(store, "s-gone", i64::MAX).await, None);
    assert!(!store.upsert_subscription(sub("s-gone")).await.unwrap().live);
    assert!(
        store
            .publish(event("evt-s1", 300), vec![])
            .await
            .unwrap()
            .duplicate
    );
}

async fn shard_epochs_fence_claims(store: &dyn Store) {
    let in_shard = |uid: &str, shard| SubscriptionRecord { shard, ..sub(uid) };
    store.upsert_subscription(in_shard("s1", 3)).await.unwrap();
    store.upsert_subscription(in_shard("s2", 4)).await.unwrap();
    for i in 0..3 {
        store
            .publish(
                event(&format!("evt-s{i}"), 100),
                vec!["s1".into(), "s2".into()],
            )
            .await
            .unwrap();
    }
    let at = |shard, epoch| ShardFence { shard, epoch };
    // Nobody has taken shard 3 yet: no fenced claim succeeds.
    let refused = store.claim_fenced("s1", 200, at(3, 1)).await.unwrap();
    assert!(
        matches!(refused, Claim::Idle { .. }),
        "claimed an untaken shard"
    );

    assert!(store.take_shard(3, "replica-a", 1, 200).await.unwrap());
    let Claim::Claimed(first) = store.claim_fenced("s1", 200, at(3, 1)).await.unwrap() else {
        panic!("the holder of epoch 1 could not claim");
    };
    // The right epoch for another shard than the subscription's is no proof.
    assert!(store.take_shard(4, "replica-a", 1, 200).await.unwrap());
    let wrong_shard = store.claim_fenced("s1", 200, at(4, 1)).await.unwrap();
    assert!(
        matches!(wrong_shard, Claim::Idle { .. }),
        "claimed with another shard's epoch"
    );

    // replica-b takes shard 3 over: the old epoch claims nothing, an older epoch is not
    // recorded, and the attempt replica-a had on the wire is due again.
    assert!(store.take_shard(3, "replica-b", 2, 300).await.unwrap());
    assert!(
        !store.take_shard(3, "replica-a", 1, 300).await.unwrap(),
        "an older epoch won"
    );
    assert!(
        !store.take_shard(3, "replica-a", 2, 300).await.unwrap(),
        "the same epoch twice"
    );
    let stale = store.claim_fenced("s1", 300, at(3, 1)).await.unwrap();
    assert!(matches!(stale, Claim::Idle { .. }), "a stale epoch claimed");
    let Claim::Claimed(again) = store.claim_fenced("s1", 300, at(3, 2)).await.unwrap() else {
        panic!("the new holder could not claim");
    };
    assert_eq!(
        again.delivery_id, first.delivery_id,
        "the in-flight attempt was not recovered"
    );
    assert_eq!(again.attempt, 2);
    // A late completion from the old holder (paused, not dead) is stale: the new holder's
    // claim stands, and the new holder's completion finishes the delivery.
    let late = store
        .complete(
            first.claim_ref(),
            attempt(310, "Accepted", Some(200)),
            Next::Delivered,
        )
        .await
        .unwrap();
    assert!(!late.recorded, "a stale claim's completion was applied");
    let after = store
        .complete(
            again.claim_ref(),
            attempt(320, "Accepted", Some(200)),
            Next::Delivered,
        )
        .await
        .unwrap();
    assert!(after.recorded, "the current claim's completion was dropped");
    let Claim::Claimed(unsent) = store.claim_fenced("s2", 300, at(4, 1)).await.unwrap() else {
        panic!("shard 4's holder could not claim");
    };
    // Its hold ended before it sent: the claim is given back, not counted as an attempt.
    assert!(
        store
            .unclaim(unsent.delivery_id, unsent.attempt)
            .await
            .unwrap()
    );
    let Claim::Claimed(resent) = store.claim_fenced("s2", 300, at(4, 1)).await.unwrap() else {
        panic!("a given-back claim was not due again");
    };
    assert_eq!(
        (resent.delivery_id, resent.attempt),
        (unsent.delivery_id, 1)
    );

    let history = store.shard_history().await.unwrap();
    let takings: Vec<_> = history
        .iter()
        .map(|t| (t.shard, t.epoch, t.holder.as_str()))
        .collect();
    assert_eq!(
        takings,
        [
            (3, 1, "replica-a"),
            (4, 1, "replica-a"),
            (3, 2, "replica-b")
        ]
    );
    // A late give-back, after a take-over made the claim due again and the new holder
    // claimed it: the new holder's claim stands.
    assert!(store.take_shard(4, "replica-b", 2, 400).await.unwrap());
    let Claim::Claimed(taken) = store.claim_fenced("s2", 400, at(4, 2)).await.unwrap() else {
        panic!("the new holder of shard 4 could not claim");
    };
    assert_eq!(taken.delivery_id, resent.delivery_id);
    assert!(
        !store
            .unclaim(resent.delivery_id, resent.attempt)
            .await
            .unwrap(),
        "an old claim was given back over a new one"
    );
    assert!(
        store
            .complete(
                taken.claim_ref(),
                attempt(410, "Accepted", Some(200)),
                Next::Delivered
            )
            .await
            .unwrap()
            .recorded
    );
    for uid in ["s1", "s2"] {
        store.remove_subscription(uid).await.unwrap();
    }
}

/// What a publish claims is what [`Store::claim_next`] would have claimed at the event's
/// time, only for the subscriptions asked for that got a delivery now and are unpaused; a
/// store may claim nothing, and then those deliveries wait for a claim. Returns how many
/// the store claimed with the first publish (0 or 1).
pub async fn claims_made_with_a_publish(store: &dyn Store) -> usize {
    for uid in ["w1", "w2", "w3"] {
        store.upsert_subscription(sub(uid)).await.unwrap();
    }
    store
        .upsert_subscription(SubscriptionRecord {
            paused: true,
            ..sub("w3")
        })
        .await
        .unwrap();
    let asked = vec![
        ("w1".to_string(), None),
        ("w3".to_string(), None),
        ("gone".to_string(), None),
    ];
    let targets = vec!["w1".into(), "w2".into(), "w3".into()];
    let (first, claimed) = store
        .publish_and_claim(event("evt-w", 5000), targets, asked, Vec::new())
        .await
        .unwrap();
    assert_eq!(first.targets, ["w1", "w2", "w3"]);
    assert!(
        claimed.len() <= 1,
        "only w1 may be claimed (w2 was not asked for, w3 is paused, gone got nothing): {claimed:?}"
    );
    for c in &claimed {
        assert_eq!(
            (c.subscription_uid.as_str(), c.event_id.as_str(), c.attempt),
            ("w1", "evt-w", 1)
        );
        assert_eq!(c.body, event("evt-w", 5000).body);
    }
    if claimed.is_empty() {
        claim(store, "w1", 5000).await;
    }
    assert_eq!(
        idle(store, "w1", 5000).await,
        None,
        "w1's delivery claimed twice"
    );
    assert_eq!(claim(store, "w2", 5000).await.event_id, "evt-w");
    assert_eq!(
        idle(store, "w3", 5000).await,
        None,
        "a paused subscription was claimed"
    );

    let (again, none) = store
        .publish_and_claim(
            event("evt-w", 6000),
            vec!["w1".into()],
            vec![("w1".into(), None)],
            Vec::new(),
        )
        .await
        .unwrap();
    assert!(again.duplicate, "{again:?}");
    assert!(none.is_empty(), "a repeated id claimed {none:?}");
    claimed.len()
}

/// Issue 24, item 3: a completion carries its claim, and the store applies it only while the
/// delivery is still in flight under that claim. A take-over made the old holder's attempt
/// due again and the new holder claimed it: the old holder's late answer (here a terminal
/// 400) changes neither the delivery nor the counters, and is kept in the history as
/// superseded; the new holder's answer then moves the delivery on. The same without shards
/// (a restart's recovery, then a new claim), and after a replay has reset the attempt count
/// (only the shard epoch tells the old claim from the new one there).
async fn stale_claims_complete_nothing(store: &dyn Store) {
    let at = |epoch| ShardFence { shard: 9, epoch };
    store
        .upsert_subscription(SubscriptionRecord {
            shard: 9,
            ..sub("stale1")
        })
        .await
        .unwrap();
    store.upsert_subscription(sub("stale2")).await.unwrap();
    store
        .publish(
            event("evt-stale", 100),
            vec!["stale1".into(), "stale2".into()],
        )
        .await
        .unwrap();
    assert!(store.take_shard(9, "replica-a", 1, 100).await.unwrap());
    let Claim::Claimed(old) = store.claim_fenced("stale1", 200, at(1)).await.unwrap() else {
        panic!("replica-a could not claim");
    };
    assert_eq!(old.fence, Some(at(1)), "the claim does not carry its fence");
    assert!(store.take_shard(9, "replica-b", 2, 300).await.unwrap());
    // Due again, not yet claimed: the old answer does not finish it either.
    let early = store
        .complete(
            old.claim_ref(),
            attempt(310, "Terminal", Some(400)),
            Next::DeadLetter,
        )
        .await
        .unwrap();
    assert!(
        !early.recorded,
        "a completion after the take-over was applied"
    );
    let Claim::Claimed(new) = store.claim_fenced("stale1", 400, at(2)).await.unwrap() else {
        panic!("replica-b could not claim after the take-over");
    };
    assert_eq!((new.delivery_id, new.attempt), (old.delivery_id, 2));
    let before = store.subscription_state("stale1").await.unwrap().unwrap();
    let late = store
        .complete(
            old.claim_ref(),
            attempt(450, "Terminal", Some(400)),
            Next::DeadLetter,
        )
        .await
        .unwrap();
    assert_eq!(
        late,
        Completion::default(),
        "a stale claim's completion was applied"
    );
    let state = store.subscription_state("stale1").await.unwrap().unwrap();
    assert_eq!(state, before, "a stale completion changed the counters");
    let listed = store
        .list_deliveries("stale1", StateFilter::All, 10)
        .await
        .unwrap();
    assert_eq!(
        (listed[0].state, listed[0].attempts),
        (DeliveryState::InFlight, 2),
        "a stale completion moved the delivery"
    );
    let history = store.attempts("stale1", "evt-stale").await.unwrap();
    assert_eq!(
        history.len(),
        2,
        "the stale attempts are not in the history: {history:?}"
    );
    assert!(
        history
            .iter()
            .all(|a| a.message.starts_with(SUPERSEDED) && a.status_code == Some(400))
    );

    let current = store
        .complete(
            new.claim_ref(),
            attempt(500, "Accepted", Some(204)),
            Next::Delivered,
        )
        .await
        .unwrap();
    assert!(
        current.recorded,
        "the current claim's completion was dropped"
    );
    let state = store.subscription_state("stale1").await.unwrap().unwrap();
    assert_eq!(
        (
            state.delivered,
            state.failed,
            state.dead_lettered,
            state.pending
        ),
        (1, 0, 0, 0)
    );
    let history = store.attempts("stale1", "evt-stale").await.unwrap();
    assert_eq!(history.len(), 3);
    assert_eq!(
        (history[2].status_code, history[2].message.as_str()),
        (Some(204), "m")
    );

    // Without shards: the attempt number alone tells a restart's re-claim from the old one.
    let first = claim(store, "stale2", 200).await;
    assert_eq!(first.fence, None);
    store.recover_in_flight(300).await.unwrap();
    let second = claim(store, "stale2", 300).await;
    assert_eq!(second.attempt, 2);
    let stale = store
        .complete(
            first.claim_ref(),
            attempt(310, "Accepted", Some(200)),
            Next::Delivered,
        )
        .await
        .unwrap();
    assert!(
        !stale.recorded,
        "an unfenced stale claim's completion was applied"
    );
    assert!(
        store
            .complete(
                second.claim_ref(),
                attempt(320, "Terminal", Some(400)),
                Next::DeadLetter
            )
            .await
            .unwrap()
            .recorded
    );
    let state = store.subscription_state("stale2").await.unwrap().unwrap();
    assert_eq!(
        (state.delivered, state.dead_lettered, state.dead),
        (0, 1, 1)
    );

    // A replay resets the attempt count: a claim under an old epoch with the same number
    // must still be stale.
    assert_eq!(
        store
            .replay("stale2", Replay::default(), 400)
            .await
            .unwrap(),
        1
    );
    store
        .upsert_subscription(SubscriptionRecord {
            shard: 9,
            ..sub("stale2")
        })
        .await
        .unwrap();
    let Claim::Claimed(replayed) = store.claim_fenced("stale2", 400, at(2)).await.unwrap() else {
        panic!("the replayed delivery could not be claimed");
    };
    assert_eq!(replayed.attempt, 1);
    let aba = ClaimRef {
        fence: Some(at(1)),
        ..replayed.claim_ref()
    };
    assert!(
        !store
            .complete(aba, attempt(410, "Accepted", Some(200)), Next::Delivered)
            .await
            .unwrap()
            .recorded,
        "a claim under an old epoch with the same attempt number was applied"
    );
    assert!(
        store
            .complete(
                replayed.claim_ref(),
                attempt(420, "Accepted", Some(200)),
                Next::Delivered
            )
            .await
            .unwrap()
            .recorded
    );
    for uid in ["stale1", "stale2"] {
        store.remove_subscription(uid).await.unwrap();
    }
}

/// [`Store::complete_and_claim`]: after a delivery, the lane's next due delivery is claimed
/// in the same round trip, by a claim's rules (due, live, not paused, under the fence); after
/// a failure, or without `then_claim`, nothing is.
async fn completions_claim_the_next_delivery(store: &dyn Store) {
    let uid = "n1";
    store
        .upsert_subscription(SubscriptionRecord {
            shard: 5,
            ..sub(uid)
        })
        .await
        .unwrap();
    for (i, at) in [100, 100, 100, 900].into_iter().enumerate() {
        store
            .publish(event(&format!("evt-n{i}"), at), vec![uid.into()])
            .await
            .unwrap();
    }
    assert!(store.take_shard(5, "me", 1, 50).await.unwrap());
    let fence = ShardFence { shard: 5, epoch: 1 };
    let first = claim_fenced(store, uid, 200, fence).await;
    // Records `c` as delivered, with `then_claim`.
    let deliver = async |c: &Claimed, then_claim: Option<i64>| {
        store
            .complete_and_claim(
                c.claim_ref(),
                attempt(201, "Accepted", Some(204)),
                Next::Delivered,
                then_claim,
            )
            .await
            .unwrap()
    };

    // A delivery claims the next, under the same fence.
    let (done, second) = deliver(&first, Some(200)).await;
    assert!(done.recorded);
    assert_eq!(
        done.next_due_ms, None,
        "the lane goes on with the claimed one, whose record says what is due after it"
    );
    let second = second.expect("the next due delivery is claimed with the completion");
    assert_eq!(
        (second.event_id.as_str(), second.subscription_uid.as_str()),
        ("evt-n1", uid)
    );
    assert_eq!((second.attempt, second.fence), (1, Some(fence)));
    assert_eq!(second.body, br#"{"id":"evt-n1"}"#);

    // A failure claims nothing, whatever is due.
    let (done, none) = store
        .complete_and_claim(
            second.claim_ref(),
            attempt(202, "Transient", Some(503)),
            Next::Retry { due_ms: 5000 },
            Some(200),
        )
        .await
        .unwrap();
    assert!(done.recorded && none.is_none());

    // Without then_claim nothing is claimed; the completion says what is due.
    let third = claim_fenced(store, uid, 200, fence).await;
    assert_eq!(third.event_id, "evt-n2");
    let (done, none) = deliver(&third, None).await;
    assert!(none.is_none());
    assert_eq!(done.next_due_ms, Some(900));

    // Only what is due: the last one is due at 900.
    let fourth = claim_fenced(store, uid, 900, fence).await;
    assert_eq!(fourth.event_id, "evt-n3");
    store
        .publish(event("evt-n4", 2000), vec![uid.into()])
        .await
        .unwrap();
    let (done, none) = deliver(&fourth, Some(1000)).await;
    assert!(done.recorded && none.is_none(), "evt-n4 is not due at 1000");

    // Paused: nothing is claimed with a completion.
    let fifth = claim_fenced(store, uid, 2000, fence).await;
    store
        .publish(event("evt-n5", 2000), vec![uid.into()])
        .await
        .unwrap();
    store
        .upsert_subscription(SubscriptionRecord {
            shard: 5,
            paused: true,
            ..sub(uid)
        })
        .await
        .unwrap();
    let (done, none) = deliver(&fifth, Some(3000)).await;
    assert!(done.recorded && none.is_none(), "paused");
    assert_eq!(done.next_due_ms, None, "paused: nothing is due");

    // A newer epoch: the completion is stale and claims nothing.
    store
        .upsert_subscription(SubscriptionRecord {
            shard: 5,
            ..sub(uid)
        })
        .await
        .unwrap();
    let sixth = claim_fenced(store, uid, 3000, fence).await;
    store
        .publish(event("evt-n6", 2000), vec![uid.into()])
        .await
        .unwrap();
    assert!(store.take_shard(5, "other", 2, 3000).await.unwrap());
    let (done, none) = deliver(&sixth, Some(3000)).await;
    assert!(!done.recorded && none.is_none(), "stale");
    store.remove_subscription(uid).await.unwrap();
}
