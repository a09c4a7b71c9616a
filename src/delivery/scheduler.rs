//! The lane scheduler: decides which subscription's lane may start its next attempt.
//!
//! Each subscription has a lane of bounded width (its `maxInFlight`). Lanes of one
//! namespace share that namespace's in-flight quota. Every namespace has a reserved floor
//! of attempts it may start whatever other namespaces hold; attempts beyond its floor draw
//! from one shared pool. So however many attempts other namespaces hold, a namespace under
//! its floor starts at once, and the sockets on the wire are bounded by
//! `pool + floor × namespaces with attempts on the wire`.
//! Namespaces with ready lanes are served round-robin, and within a namespace lanes are
//! served round-robin, so a namespace with thousands of due attempts to dead receivers
//! gets one turn like any other. A lane that cannot start (its width, its namespace's quota
//! or the global limit is used up) holds nothing: it just waits in a queue until a slot is
//! released. Pure bookkeeping, no I/O: the engine asks [`Scheduler::start_next`] for a lane, runs
//! the attempt, and calls [`Scheduler::release`].

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// Lanes, ready queues and the round-robin hold shared names (`Arc<str>`): a lane's uid is
/// the engine's, and a namespace's name is stored once, so neither a lane nor an attempt
/// copies a string.
#[derive(Debug)]
struct Lane {
    namespace: Arc<str>,
    width: u32,
    in_flight: u32,
    /// The lane may have due work (set on publish, timer, release; cleared when the store
    /// says it has nothing due).
    wants: bool,
    /// Queued in its namespace's ready queue.
    queued: bool,
    /// Bumped by every wake, so that a stale "nothing due" cannot cancel a newer wake.
    epoch: u64,
    /// Waiting for its pace (a rate limit, a slow-down) to allow the next attempt: not
    /// started, whatever wakes it, until [`Scheduler::unpace`].
    paced: bool,
}

#[derive(Debug)]
struct Namespace {
    limit: u32,
    in_flight: u32,
    ready: VecDeque<Arc<str>>,
    /// Listed in the round-robin of namespaces.
    listed: bool,
    /// Waiting for a slot of the shared pool (listed in `pool_waiters`).
    pool_waiting: bool,
    /// Times a lane queued while the namespace was at its quota (for metrics).
    quota_waits: u64,
}

#[derive(Debug)]
pub struct Scheduler {
    /// The shared pool: attempts beyond each namespace's reserved floor.
    pool_limit: u32,
    pool_in_flight: u32,
    /// Attempts every namespace may have on the wire whatever the pool holds.
    reserved: u32,
    /// Every attempt on the wire (reserved and pool).
    global_in_flight: u32,
    default_namespace_limit: u32,
    lanes: HashMap<Arc<str>, Lane>,
    namespaces: HashMap<Arc<str>, Namespace>,
    round_robin: VecDeque<Arc<str>>,
    /// Namespaces with due lanes waiting for a pool slot.
    pool_waiters: VecDeque<Arc<str>>,
}

impl Scheduler {
    /// `pool_limit`: the shared pool; `default_namespace_limit`: a namespace's quota where
    /// none is set; `reserved`: each namespace's floor outside the pool.
    pub fn new(pool_limit: u32, default_namespace_limit: u32, reserved: u32) -> Self {
        Self {
            pool_limit,
            pool_in_flight: 0,
            reserved,
            global_in_flight: 0,
            default_namespace_limit,
            lanes: HashMap::new(),
            namespaces: HashMap::new(),
            round_robin: VecDeque::new(),
            pool_waiters: VecDeque::new(),
        }
    }

    /// The namespace's entry and its shared name, made on first use.
    fn namespace_entry(&mut self, name: &str) -> (Arc<str>, &mut Namespace) {
        let key = match self.namespaces.get_key_value(name) {
            Some((key, _)) => key.clone(),
            None => {
                let key: Arc<str> = Arc::from(name);
                self.namespaces.insert(
                    key.clone(),
                    Namespace {
                        limit: self.default_namespace_limit,
                        in_flight: 0,
                        ready: VecDeque::new(),
                        listed: false,
                        pool_waiting: false,
                        quota_waits: 0,
                    },
                );
                key
            }
        };
        let ns = self.namespaces.get_mut(name).expect("present or just made");
        (key, ns)
    }

    fn namespace(&mut self, name: &str) -> &mut Namespace {
        self.namespace_entry(name).1
    }

    /// Adds or reconfigures a lane; `uid` is kept (shared), not copied.
    pub fn upsert_lane(&mut self, uid: &Arc<str>, namespace: &str, width: u32) {
        let (namespace, _) = self.namespace_entry(namespace);
        match self.lanes.get_mut(&**uid) {
            Some(lane) => {
                lane.width = width.max(1);
            }
            None => {
                self.lanes.insert(
                    uid.clone(),
                    Lane {
                        namespace,
                        width: width.max(1),
                        in_flight: 0,
                        wants: false,
                        queued: false,
                        epoch: 0,
                        paced: false,
                    },
                );
            }
        }
    }

    /// Forgets a lane; attempts still on the wire release into nothing.
    pub fn remove_lane(&mut self, uid: &str) {
        self.lanes.remove(uid);
    }

    pub fn has_lane(&self, uid: &str) -> bool {
        self.lanes.contains_key(uid)
    }

    /// Sets a namespace's in-flight quota (None: back to the default).
    pub fn set_namespace_limit(&mut self, namespace: &str, limit: Option<u32>) {
        let default = self.default_namespace_limit;
        let ns = self.namespace(namespace);
        ns.limit = limit.unwrap_or(default);
        self.relist(namespace);
    }

    /// The lane may have due work.
    pub fn wake(&mut self, uid: &str) {
        if let Some(lane) = self.lanes.get_mut(uid) {
            lane.wants = true;
            lane.epoch += 1;
        }
        self.enqueue(uid);
    }

    /// Whether the lane may have due work (false once the store found nothing due for it).
    #[cfg(test)]
    pub fn wants(&self, uid: &str) -> bool {
        self.lanes.get(uid).is_some_and(|lane| lane.wants)
    }

    /// The lane's wake count, to pass back to [`Scheduler::idle`].
    pub fn epoch(&self, uid: &str) -> u64 {
        self.lanes.get(uid).map_or(0, |lane| lane.epoch)
    }

    /// The store found nothing due for the lane, as of wake count `epoch`; a wake since
    /// then keeps the lane wanting.
    pub fn idle(&mut self, uid: &str, epoch: u64) {
        if let Some(lane) = self.lanes.get_mut(uid)
            && lane.epoch == epoch
        {
            lane.wants = false;
        }
    }

    /// The lane's pace allows no attempt now: it is not started until [`Scheduler::unpace`]
    /// (its pace timer), however often it is woken meanwhile.
    pub fn pace(&mut self, uid: &str) {
        if let Some(lane) = self.lanes.get_mut(uid) {
            lane.paced = true;
        }
    }

    /// The lane's pace allows an attempt again: it is started as its wants say.
    pub fn unpace(&mut self, uid: &str) {
        if let Some(lane) = self.lanes.get_mut(uid)
            && std::mem::take(&mut lane.paced)
        {
            self.enqueue(uid);
        }
    }

    fn enqueue(&mut self, uid: &str) {
        let Some((uid, lane)) = self.lanes.get_key_value(uid) else {
            return;
        };
        if lane.queued || !lane.wants || lane.in_flight >= lane.width || lane.paced {
            return;
        }
        let (uid, namespace) = (uid.clone(), lane.namespace.clone());
        if let Some(lane) = self.lanes.get_mut(&uid) {
            lane.queued = true;
        }
        let ns = self.namespace(&namespace);
        ns.ready.push_back(uid);
        if ns.in_flight >= ns.limit {
            ns.quota_waits += 1;
        }
        self.relist(&namespace);
    }

    fn relist(&mut self, namespace: &str) {
        let (namespace, ns) = self.namespace_entry(namespace);
        if !ns.listed && !ns.ready.is_empty() && ns.in_flight < ns.limit {
            ns.listed = true;
            self.round_robin.push_back(namespace);
        }
    }

    /// The next lane to start an attempt, with its slot taken; None when nothing can start.
    pub fn start_next(&mut self) -> Option<Arc<str>> {
        loop {
            let namespace = self.round_robin.pop_front()?;
            let Some(ns) = self.namespaces.get_mut(&namespace) else {
                continue;
            };
            ns.listed = false;
            if ns.in_flight >= ns.limit {
                continue; // relisted on release
            }
            let from_pool = ns.in_flight >= self.reserved;
            if from_pool && self.pool_in_flight >= self.pool_limit {
                // Past its floor and the pool is used up: relisted when a pool slot frees.
                if !ns.pool_waiting {
                    ns.pool_waiting = true;
                    self.pool_waiters.push_back(namespace);
                }
                continue;
            }
            let Some(uid) = ns.ready.pop_front() else {
                continue;
            };
            let Some(lane) = self.lanes.get_mut(&uid) else {
                self.relist(&namespace);
                continue; // removed while queued
            };
            lane.queued = false;
            if !lane.wants || lane.in_flight >= lane.width || lane.paced {
                self.relist(&namespace);
                continue;
            }
            lane.in_flight += 1;
            ns.in_flight += 1;
            self.global_in_flight += 1;
            if from_pool {
                self.pool_in_flight += 1;
            }
            // Wider lanes go to the back of their namespace's queue for their next slot.
            self.enqueue(&uid);
            self.relist(&namespace);
            return Some(uid);
        }
    }

    /// Starts an attempt of a lane with nothing on the wire, nothing known due and no place
    /// in a queue, outside the round-robin, when its namespace is under its reserved floor
    /// (and its quota) and has no lane waiting: a slot no other lane or namespace was
    /// waiting for. A publish that gives such a lane its only due delivery claims it in the
    /// same transaction, saving the lane a claim of its own. False: wake the lane instead.
    pub fn start_idle(&mut self, uid: &str) -> bool {
        let Some(lane) = self.lanes.get_mut(uid) else {
            return false;
        };
        if lane.in_flight > 0 || lane.queued || lane.wants || lane.paced {
            return false;
        }
        let Some(ns) = self.namespaces.get_mut(&lane.namespace) else {
            return false;
        };
        if ns.in_flight >= ns.limit.min(self.reserved) || !ns.ready.is_empty() {
            return false;
        }
        lane.in_flight += 1;
        ns.in_flight += 1;
        self.global_in_flight += 1;
        true
    }

    /// Whether the lane's attempt, done with one delivery, may go on to the lane's next in
    /// the same slot rather than give the slot back and queue for another: only while its
    /// namespace is within its quota (which may have been lowered), no namespace waits for
    /// the shared pool, and every other lane its namespace has queued could start beside it
    /// (under the quota, and under the floor or with a pool slot free), so that a lane keeps
    /// no slot another would have had.
    pub fn may_go_on(&self, uid: &str) -> bool {
        let Some(lane) = self.lanes.get(uid) else {
            return false;
        };
        let Some(ns) = self.namespaces.get(&lane.namespace) else {
            return false;
        };
        let others_wait = ns.ready.iter().any(|queued| **queued != *uid);
        let room = ns.in_flight < ns.limit
            && (ns.in_flight < self.reserved || self.pool_in_flight < self.pool_limit);
        ns.in_flight <= ns.limit && self.pool_waiters.is_empty() && (!others_wait || room)
    }

    /// An attempt of the lane finished (or found nothing to do): give its slot back.
    pub fn release(&mut self, uid: &str, namespace: &str) {
        self.global_in_flight = self.global_in_flight.saturating_sub(1);
        let mut pool_slot = false;
        if let Some(ns) = self.namespaces.get_mut(namespace) {
            // Slots are alike: a namespace uses max(0, in_flight - reserved) of the pool.
            pool_slot = ns.in_flight > self.reserved;
            ns.in_flight = ns.in_flight.saturating_sub(1);
        }
        if pool_slot {
            self.pool_in_flight = self.pool_in_flight.saturating_sub(1);
        }
        if let Some(lane) = self.lanes.get_mut(uid) {
            lane.in_flight = lane.in_flight.saturating_sub(1);
        }
        // A freed pool slot goes round the namespaces that waited for one, in the order
        // they began waiting, before the releasing namespace's next turn.
        if pool_slot {
            for waiter in std::mem::take(&mut self.pool_waiters) {
                if let Some(ns) = self.namespaces.get_mut(&waiter) {
                    ns.pool_waiting = false;
                }
                self.relist(&waiter);
            }
        }
        self.enqueue(uid);
        self.relist(namespace);
    }

    /// Per namespace: its name, attempts in flight, and how often a lane queued while the
    /// namespace was at its quota.
    pub fn namespace_stats(&self) -> impl Iterator<Item = (&str, u32, u64)> {
        self.namespaces
            .iter()
            .map(|(name, ns)| (&**name, ns.in_flight, ns.quota_waits))
    }

    pub fn in_flight(&self) -> u32 {
        self.global_in_flight
    }

    pub fn namespace_in_flight(&self, namespace: &str) -> u32 {
        self.namespaces.get(namespace).map_or(0, |ns| ns.in_flight)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(s: &mut Scheduler) -> Vec<String> {
        std::iter::from_fn(|| s.start_next().map(|uid| uid.to_string())).collect()
    }

    #[test]
    fn a_busy_lane_never_blocks_another() {
        let mut s = Scheduler::new(100, 50, 0);
        for i in 0..9 {
            s.upsert_lane(&format!("sub{i}").into(), "ns", 1);
        }
        for i in 0..8 {
            s.wake(&format!("sub{i}"));
        }
        assert_eq!(drain(&mut s).len(), 8);
        // Eight held, the ninth becomes due: it starts at once.
        s.wake("sub8");
        assert_eq!(s.start_next().as_deref(), Some("sub8"));
    }

    /// A lane goes on to its next delivery in its slot only while nobody waits for a slot:
    /// another lane of its namespace at the quota, or another namespace for the pool.
    /// A paced lane is not started, however often it is woken, nor started with a publish,
    /// until it is unpaced; the other lanes of its namespace start meanwhile.
    #[test]
    fn a_paced_lane_waits_for_its_pace() {
        let mut s = Scheduler::new(4, 8, 4);
        s.upsert_lane(&"slow".into(), "ns", 2);
        s.upsert_lane(&"fast".into(), "ns", 1);
        s.wake("slow");
        assert_eq!(s.start_next().as_deref(), Some("slow"));
        s.pace("slow");
        s.release("slow", "ns");
        s.wake("slow");
        s.wake("fast");
        assert_eq!(s.start_next().as_deref(), Some("fast"));
        assert_eq!(s.start_next(), None, "the paced lane started");
        s.idle("slow", s.epoch("slow"));
        assert!(!s.start_idle("slow"));
        s.unpace("slow");
        s.wake("slow");
        assert_eq!(s.start_next().as_deref(), Some("slow"));
    }

    #[test]
    fn a_lane_goes_on_only_while_nobody_waits() {
        let mut s = Scheduler::new(1, 2, 1);
        s.upsert_lane(&"a".into(), "ns", 1);
        s.upsert_lane(&"b".into(), "ns", 1);
        s.upsert_lane(&"e".into(), "ns", 1);
        s.wake("a");
        assert_eq!(s.start_next().as_deref(), Some("a"));
        assert!(s.may_go_on("a"), "nobody waits");
        assert!(!s.may_go_on("gone"));

        // b is queued with room to start beside a: a may go on.
        s.wake("b");
        assert!(s.may_go_on("a"), "b can start anyway");
        assert_eq!(s.start_next().as_deref(), Some("b"));
        assert!(s.may_go_on("a"));
        // e becomes due while the namespace is at its quota: e waits, so a gives way.
        s.wake("e");
        assert_eq!(s.start_next(), None);
        assert!(!s.may_go_on("a"), "a lane of its namespace waits");

        // Another namespace waiting for the shared pool (used up by ns) holds a back too.
        let mut s = Scheduler::new(1, 4, 1);
        s.upsert_lane(&"a".into(), "ns", 2);
        s.upsert_lane(&"c".into(), "other", 1);
        s.upsert_lane(&"d".into(), "other", 1);
        s.wake("a");
        assert_eq!(s.start_next().as_deref(), Some("a"));
        assert_eq!(s.start_next().as_deref(), Some("a"), "from the pool");
        s.wake("c");
        s.wake("d");
        assert_eq!(
            s.start_next().as_deref(),
            Some("c"),
            "other's reserved slot"
        );
        assert_eq!(s.start_next(), None, "d waits for the pool");
        assert!(!s.may_go_on("a"), "a namespace waits for the pool");
    }

    #[test]
    fn lane_width_bounds_a_subscription() {
        let mut s = Scheduler::new(100, 50, 0);
        s.upsert_lane(&"wide".into(), "ns", 3);
        s.upsert_lane(&"narrow".into(), "ns", 1);
        s.wake("wide");
        s.wake("narrow");
        let mut started = drain(&mut s);
        started.sort();
        assert_eq!(started, ["narrow", "wide", "wide", "wide"]);
        s.release("wide", "ns");
        assert_eq!(s.start_next().as_deref(), Some("wide"));
        assert_eq!(s.start_next(), None);
    }

    #[test]
    fn namespace_quota_does_not_hold_other_namespaces() {
        let mut s = Scheduler::new(1000, 16, 0);
        for i in 0..100 {
            s.upsert_lane(&format!("dead{i}").into(), "noisy", 1);
            s.wake(&format!("dead{i}"));
        }
        assert_eq!(drain(&mut s).len(), 16, "noisy is held to its quota");
        s.upsert_lane(&"healthy".into(), "quiet", 1);
        s.wake("healthy");
        assert_eq!(s.start_next().as_deref(), Some("healthy"));
        assert_eq!(s.namespace_in_flight("noisy"), 16);
        // A release lets exactly one more noisy lane in.
        s.release("dead0", "noisy");
        assert!(s.start_next().unwrap().starts_with("dead"));
        assert_eq!(s.start_next(), None);
    }

    #[test]
    fn namespaces_take_turns_under_the_global_limit() {
        let mut s = Scheduler::new(4, 100, 0);
        for i in 0..50 {
            s.upsert_lane(&format!("a{i}").into(), "a", 1);
            s.wake(&format!("a{i}"));
        }
        for i in 0..2 {
            s.upsert_lane(&format!("b{i}").into(), "b", 1);
            s.wake(&format!("b{i}"));
        }
        let first = drain(&mut s);
        assert_eq!(
            first.iter().filter(|u| u.starts_with('b')).count(),
            2,
            "{first:?}"
        );
        assert_eq!(first.len(), 4);
        // "b" runs out of work: its lanes go idle and give their slots to "a"'s backlog.
        for uid in first.iter().filter(|u| u.starts_with('b')) {
            s.idle(uid, s.epoch(uid));
            s.release(uid, "b");
        }
        let refill = drain(&mut s);
        assert_eq!(refill.len(), 2, "{refill:?}");
        assert!(refill.iter().all(|u| u.starts_with('a')), "{refill:?}");
        // Every slot is held by "a" and 46 "a" lanes wait. "b0" becomes due again: it waits
        // for one turn of "a" at most, not behind the 46 "a" lanes queued before it (as a
        // plain round-robin over lanes would have it).
        s.wake("b0");
        assert_eq!(s.start_next(), None, "the global limit is used up");
        s.release(&refill[0], "a");
        s.release(&refill[1], "a");
        let second = drain(&mut s);
        assert_eq!(second.len(), 2, "{second:?}");
        assert!(second.contains(&"b0".to_string()), "{second:?}");
        // The next free slot goes back to "a": "b" has nothing more due.
        s.idle("b0", s.epoch("b0"));
        s.release("b0", "b");
        assert!(s.start_next().unwrap().starts_with('a'));
        assert_eq!(s.start_next(), None);
    }

    #[test]
    fn idle_lanes_are_not_scheduled_and_removed_lanes_vanish() {
        let mut s = Scheduler::new(10, 10, 0);
        s.upsert_lane(&"x".into(), "ns", 1);
        s.wake("x");
        let seen = s.epoch("x");
        s.wake("x"); // a publish lands after the store said "nothing due"
        s.idle("x", seen);
        assert_eq!(
            s.start_next().as_deref(),
            Some("x"),
            "a newer wake survives a stale idle"
        );
        s.release("x", "ns");
        s.idle("x", s.epoch("x"));
        assert_eq!(s.start_next(), None);
        s.wake("x");
        s.remove_lane("x");
        assert_eq!(s.start_next(), None);
        s.release("x", "ns"); // a late release of a removed lane is harmless
        assert_eq!(s.in_flight(), 0);
    }

    #[test]
    fn raising_a_quota_lets_waiting_lanes_start() {
        let mut s = Scheduler::new(100, 1, 0);
        s.upsert_lane(&"a".into(), "ns", 1);
        s.upsert_lane(&"b".into(), "ns", 1);
        s.wake("a");
        s.wake("b");
        assert_eq!(drain(&mut s).len(), 1);
        s.set_namespace_limit("ns", Some(2));
        assert_eq!(drain(&mut s).len(), 1);
    }

    #[test]
    fn only_an_idle_lane_under_its_floor_starts_with_its_publish() {
        let mut s = Scheduler::new(1, 4, 2);
        for uid in ["a", "b", "c"] {
            s.upsert_lane(&uid.into(), "ns", 1);
        }
        s.upsert_lane(&"other".into(), "busy", 1);
        assert!(s.start_idle("a"));
        assert!(
            !s.start_idle("a"),
            "a lane with an attempt on the wire waits its turn"
        );
        s.wake("b");
        assert!(
            !s.start_idle("b"),
            "a lane known to have work is queued, not jumped"
        );
        assert!(
            !s.start_idle("c"),
            "b waits in the namespace: c does not go first"
        );
        assert_eq!(drain(&mut s), ["b"]);
        assert!(
            !s.start_idle("c"),
            "at the namespace's floor of 2: the pool is not for this"
        );
        assert_eq!((s.in_flight(), s.pool_in_flight), (2, 0));
        // Slots taken outside the round-robin are given back like any other.
        s.release("a", "ns");
        assert!(s.start_idle("c"));
        s.release("b", "ns");
        s.release("c", "ns");
        assert_eq!((s.in_flight(), s.pool_in_flight), (0, 0));
        assert!(s.start_idle("other"));
        assert!(!s.start_idle("nobody"));
    }

    #[test]
    fn a_full_pool_never_stops_a_namespace_under_its_floor() {
        // Pool of 4, floor of 2: three namespaces with plenty of due work hold their floors
        // (6) and the whole pool (4).
        let mut s = Scheduler::new(4, 100, 2);
        for ns in ["a", "b", "c"] {
            for i in 0..20 {
                let uid: Arc<str> = format!("{ns}{i}").into();
                s.upsert_lane(&uid, ns, 1);
                s.wake(&uid);
            }
        }
        let held = drain(&mut s);
        assert_eq!(held.len(), 3 * 2 + 4, "{held:?}");
        assert_eq!(s.in_flight(), 10);
        // A quiet namespace starts at once, up to its floor, although the pool is used up.
        s.upsert_lane(&"q0".into(), "quiet", 1);
        s.upsert_lane(&"q1".into(), "quiet", 1);
        s.upsert_lane(&"q2".into(), "quiet", 1);
        for q in ["q0", "q1", "q2"] {
            s.wake(q);
        }
        let quiet = drain(&mut s);
        assert_eq!(quiet.len(), 2, "the floor, no more: {quiet:?}");
        assert!(quiet.iter().all(|u| u.starts_with('q')));
        // A pool slot frees (one of "a"'s beyond its floor): it goes to the namespace that
        // waited longest ("b"), not back to "a".
        assert_eq!(s.namespace_in_flight("a"), 4);
        s.release("a0", "a");
        let next = drain(&mut s);
        assert_eq!(next.len(), 1, "{next:?}");
        assert!(next[0].starts_with('b'), "{next:?}");
        // A floor slot freed gives no pool slot: only the namespace's own waiting lane starts.
        s.release("q0", "quiet");
        assert_eq!(drain(&mut s), ["q2"]);
        assert_eq!(s.in_flight(), 12);
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        /// One step of the engine's use of the scheduler.
        #[derive(Clone, Debug)]
        enum Op {
            /// A lane may have due work (publish, timer, replay).
            Wake(usize),
            /// Start whatever may start now.
            Drain,
            /// The attempt of a running lane finished; its lane has more (or no more) due.
            Finish { pick: usize, more: bool },
            /// A namespace's quota changes.
            Quota { ns: usize, limit: Option<u32> },
            /// A publish gives a lane work: started at once if idle under its floor
            /// (the engine claims with the publish), woken otherwise.
            Publish(usize),
        }

        const NAMESPACES: usize = 4;
        const LANES: usize = 12;

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                4 => (0..LANES).prop_map(Op::Wake),
                3 => Just(Op::Drain),
                4 => (any::<usize>(), any::<bool>()).prop_map(|(pick, more)| Op::Finish { pick, more }),
                1 => (0..NAMESPACES, proptest::option::of(1u32..6)).prop_map(|(ns, limit)| Op::Quota { ns, limit }),
                3 => (0..LANES).prop_map(Op::Publish),
            ]
        }

        fn lane(i: usize) -> (String, String) {
            (format!("l{i}"), format!("ns{}", i % NAMESPACES))
        }

        /// What the scheduler's counters must always agree with.
        fn check(s: &Scheduler, running: &[(Arc<str>, Arc<str>)]) {
            assert_eq!(s.global_in_flight as usize, running.len());
            let mut pool = 0;
            for (name, ns) in &s.namespaces {
                let n = running.iter().filter(|(_, r)| r == name).count() as u32;
                assert_eq!(ns.in_flight, n, "namespace {name}");
                pool += n.saturating_sub(s.reserved);
            }
            assert_eq!(s.pool_in_flight, pool, "pool usage");
            assert!(s.pool_in_flight <= s.pool_limit, "the pool overflowed");
            for (uid, lane) in &s.lanes {
                let n = running.iter().filter(|(u, _)| u == uid).count() as u32;
                assert_eq!(lane.in_flight, n, "lane {uid}");
                assert!(lane.in_flight <= lane.width, "lane {uid} over its width");
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(500))]

            /// Under any interleaving: the counters stay true, no lane passes its width,
            /// no namespace passes its quota at start time, the pool never overflows, and
            /// when nothing more starts, every lane that wants to run is blocked by a
            /// limit (no lost wake, no starved namespace, no leaked slot).
            #[test]
            fn no_namespace_starves_under_any_interleaving(
                pool in 1u32..6,
                floor in 0u32..3,
                widths in proptest::collection::vec(1u32..3, LANES),
                ops in proptest::collection::vec(op(), 1..120),
            ) {
                let mut s = Scheduler::new(pool, 4, floor);
                for (i, width) in widths.iter().enumerate() {
                    let (uid, ns) = lane(i);
                    s.upsert_lane(&uid.into(), &ns, *width);
                }
                let mut running: Vec<(Arc<str>, Arc<str>)> = Vec::new();
                for op in ops {
                    match op {
                        Op::Wake(i) => s.wake(&lane(i).0),
                        Op::Drain => {
                            while let Some(uid) = s.start_next() {
                                let ns = s.lanes[&uid].namespace.clone();
                                let started_in = s.namespaces[&ns].in_flight;
                                prop_assert!(started_in <= s.namespaces[&ns].limit,
                                    "{ns} started past its quota");
                                running.push((uid, ns));
                            }
                        }
                        Op::Finish { pick, more } => {
                            if !running.is_empty() {
                                let (uid, ns) = running.swap_remove(pick % running.len());
                                if !more {
                                    let epoch = s.epoch(&uid);
                                    s.idle(&uid, epoch);
                                }
                                s.release(&uid, &ns);
                            }
                        }
                        Op::Quota { ns, limit } => {
                            s.set_namespace_limit(&format!("ns{ns}"), limit);
                        }
                        Op::Publish(i) => {
                            let (uid, ns) = lane(i);
                            if s.start_idle(&uid) {
                                let ns = &s.namespaces[ns.as_str()];
                                prop_assert!(ns.in_flight <= ns.limit.min(s.reserved),
                                    "{uid} started outside the round-robin past its floor");
                                running.push((uid.into(), lane(i).1.into()));
                            } else {
                                s.wake(&uid);
                            }
                        }
                    }
                    check(&s, &running);
                }
                // Work conservation: start everything that may start, then every lane that
                // still wants a slot is held back by its width, its quota or a full pool.
                while let Some(uid) = s.start_next() {
                    let ns = s.lanes[&uid].namespace.clone();
                    running.push((uid, ns));
                }
                check(&s, &running);
                for (uid, lane) in &s.lanes {
                    if !lane.wants || lane.in_flight >= lane.width {
                        continue;
                    }
                    let ns = &s.namespaces[&lane.namespace];
                    let at_quota = ns.in_flight >= ns.limit;
                    let pool_full = ns.in_flight >= s.reserved && s.pool_in_flight >= s.pool_limit;
                    prop_assert!(at_quota || pool_full,
                        "{uid} wants to run and nothing holds it back, yet nothing starts: {s:?}");
                }
            }
        }
    }
}
