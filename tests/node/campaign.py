"""A fault campaign (tests/node/test_60_campaign_postgres.py, test_61_campaign_embedded.py,
scripts/campaign): while producers in three namespaces publish, a tenant creates and deletes
a subscription over and over (sometimes stripping its finalizer first) and a hostile tenant
(tests/node/hostile.py) subscribes to receivers that answer badly, a seeded nemesis kills,
pauses and partitions herald's replicas (three Pods on PostgreSQL, or one on the embedded
store; a partition drops the packets from one replica to PostgreSQL or to the API server),
restarts them in turn, pauses and restarts PostgreSQL, pauses the API server, fills the
embedded store's filesystem, changes the hostile namespace's quota and rotates its secret.
A checker then reads the promises from the outside:

- every event acknowledged (202) arrives at the subscriptions that were never deleted, at
  least once, verified with the tenant's secret;
- no attempt for the churned subscription arrives after its deletion, beyond a grace: GRACE
  after the object was gone (with the finalizer: once herald had purged and fenced it),
  STRIPPED_GRACE after a deletion whose finalizer the tenant removed (herald learns of it
  from its watch). Each incarnation of it sends to a path of its own, so an attempt is
  told apart by the incarnation it was made for;
- the hostile tenant's promises (hostile.py): the in-flight quota, the secret rotation, 410;
- every repeated delivery has a cause (`repeated`), and every subscription's status agrees
  with the store (`statuses_agree_with_the_store`);
- the faults really happened (each kind is counted).

The seed and the length come from HERALD_CAMPAIGN_SEED and HERALD_CAMPAIGN_SECONDS (the
test command runs a short campaign with a fixed seed; `scripts/campaign --minutes N --seed
S` a longer one). The seed is printed: the same seed makes the same choices (the moments
they land on still depend on the machine)."""

import collections
import json
import os
import random
import signal
import threading
import time
import urllib.request
from pathlib import Path

from conftest import (NS, REPO, Receiver, TENANT, acknowledged_arrive, producer_pod, ready_pods,
                      report, run, subscription_ready, tenant, wait_until)
from hostile import FINAL, HOSTILE, Hostile

SEED = int(os.environ.get("HERALD_CAMPAIGN_SEED", "20261205"))
SECONDS = float(os.environ.get("HERALD_CAMPAIGN_SECONDS", "75"))
MARKET = "market"
CHURN = "churn"
RATE = 15
# The hostile tenant publishes faster: its attempts, held by slow answers, must fill its
# in-flight quota for the quota check to mean something.
HOSTILE_RATE = 30
# (namespace, id prefix) of each producer.
PRODUCERS = [(TENANT, "shop-c"), (MARKET, "market-c"), (HOSTILE, "hostile-c")]
# An attempt that had started when the deletion finished arrives within milliseconds; the
# rest is this loaded machine's scheduling of the Python receiver.
GRACE = 2.0
# Without the finalizer, the deletion is over before herald hears of it: its watch event
# (delayed by a paused API server or replica) or, after a restart, the start-up purge.
STRIPPED_GRACE = 20.0
# A repeated delivery is put down to a fault that overlapped its first attempt's life: from
# BEFORE_FIRST before it arrived (a pause or partition under way) to AFTER_FIRST after (the
# attempt's timeout and the recording of its answer).
BEFORE_FIRST = 1.0
AFTER_FIRST = 10.0
# What may keep a replica from seeing a change to a subscription for a while.
WATCH_DELAYING = {"pause-replica", "pause-replica-during-churn", "pause-api-server",
                  "partition-replica-from-api-server", "rolling-restart"}
# What the nemesis does that may repeat a delivery (changing a quota or a secret may not).
DISRUPTIVE = {"kill-replica", "pause-replica", "pause-replica-during-churn", "pause-api-server",
              "partition-replica-from-api-server", "rolling-restart", "pause-postgres",
              "restart-postgres", "partition-replica-from-postgres", "fill-disk"}


def herald_pids(cluster):
    """Pod name -> PID of its herald process. Root sees every container's processes here;
    the one whose executable is the image's herald and whose environment names a herald Pod
    of this release (herald binaries of other tests run on this host too)."""
    pods = {p["metadata"]["name"] for p in cluster.pods(NS)}
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not os.readlink(entry / "exe").endswith("/usr/local/bin/herald"):
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"POD_NAME="):
                name = item.split(b"=", 1)[1].decode()
                if name in pods:
                    found[name] = int(entry.name)
    return found


def children(pid):
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # The parent follows the command name, which is in parentheses.
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


class Nemesis:
    """Faults chosen by a seeded generator, one at a time, with quiet spells between them.
    Whatever it stopped is let go again by resume_all, whatever happens."""

    KINDS = ["kill-replica", "pause-replica", "pause-replica-during-churn", "pause-api-server",
             "partition-replica-from-api-server", "rolling-restart", "change-quota", "rotate-secret",
             "pause-subscription"]
    POSTGRES_KINDS = ["pause-postgres", "restart-postgres", "partition-replica-from-postgres"]
    # With the embedded store on a filesystem of its own (conftest.embedded's `volume`).
    VOLUME_KINDS = ["fill-disk"]

    def __init__(self, cluster, postgres, rng, churn, hostile, volume=None):
        self.cluster = cluster
        self.hostile = hostile
        self.postgres = postgres
        self.volume = volume
        self.filler = Path(volume) / "campaign-filler" if volume else None
        self.kinds = (self.KINDS + (self.POSTGRES_KINDS if postgres else [])
                      + (self.VOLUME_KINDS if volume else []))
        self.rng = rng
        self.churn = churn
        self.stopped = set()
        self.partitioned = set()   # (Pod, iptables rule) in force now
        self.lock = threading.Lock()
        # Where a replica reaches PostgreSQL (the URL's host and port) and the API server
        # (the `kubernetes` Service, before kube-proxy's translation on the host).
        if postgres:
            address = postgres["url"].rsplit("@", 1)[1].split("/", 1)[0]
            self.postgres_address = tuple(address.rsplit(":", 1))
        service = cluster.get_json("service", "kubernetes", "-n", "default")
        self.api_address = (service["spec"]["clusterIP"], str(service["spec"]["ports"][0]["port"]))
        self.faults = collections.Counter()
        self.log = []
        self.intervals = []   # (kind, start, end) on the monotonic clock
        # The tenant's pauses of market/orders: [paused, resumed or None]; a timer resumes.
        self.pauses = []
        self.resume_timer = None

    def signal(self, pids, sig):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
            with self.lock:
                if sig == signal.SIGSTOP:
                    self.stopped.add(pid)
                elif sig == signal.SIGCONT:
                    self.stopped.discard(pid)

    def pause(self, pids, seconds):
        self.signal(pids, signal.SIGSTOP)
        time.sleep(seconds)
        self.signal(list(reversed(pids)), signal.SIGCONT)

    def resume_all(self):
        with self.lock:
            stopped = list(self.stopped)
        self.signal(stopped, signal.SIGCONT)
        for pod, rule in list(self.partitioned):
            self.iptables(pod, "-D", rule)
        if self.filler:
            self.filler.unlink(missing_ok=True)
        if self.resume_timer:
            self.resume_timer.cancel()
            self.resume_subscription()

    def set_paused(self, paused):
        self.cluster.kubectl("patch", "whsub", "orders", "-n", MARKET, "--type=merge",
                             "-p", json.dumps({"spec": {"paused": paused}}), timeout=60)

    def pause_subscription(self, seconds):
        """The tenant pauses market/orders, and resumes it `seconds` later while the nemesis
        goes on with other faults."""
        self.set_paused(True)
        with self.lock:
            self.pauses.append([time.monotonic(), None])
            self.resume_timer = threading.Timer(seconds, self.resume_subscription)
            self.resume_timer.start()

    def resume_subscription(self):
        with self.lock:
            if not self.pauses or self.pauses[-1][1] is not None:
                return
        # The resume counts from when it is sent: herald may deliver before kubectl exits.
        resuming = time.monotonic()
        self.set_paused(False)
        with self.lock:
            self.pauses[-1][1] = resuming

    def watch_delayed_until(self, start, end):
        """The end of the last fault that could keep a replica from seeing, between `start`
        and `end`, what the tenant changed (a paused replica or API server, a partition from
        the API server, a rolling restart), or None."""
        ends = [e for kind, s, e in self.intervals
                if kind in WATCH_DELAYING and s <= end and e >= start]
        return max(ends, default=None)

    def fill(self):
        """Takes every free byte of the store's filesystem: first the space statvfs shows,
        then block by block until the filesystem refuses."""
        with open(self.filler, "wb") as f:
            size = 0
            stat = os.statvfs(self.volume)
            for want in (stat.f_bavail * stat.f_frsize, 4096):
                while True:
                    try:
                        os.posix_fallocate(f.fileno(), size, want)
                        size += want
                    except OSError:
                        if want == 4096:
                            return size
                        want //= 2
                        if want < 4096:
                            break

    def iptables(self, pod, action, rule):
        """An OUTPUT rule in the Pod's network namespace (which outlives a restart of its
        container: entered through whichever herald process the Pod runs now)."""
        # Healing waits for the Pod's herald: a replica killed while partitioned restarts
        # after the kubelet's back-off (which doubles with each kill, up to 5 minutes).
        deadline = time.monotonic() + 330
        while (pid := herald_pids(self.cluster).get(pod)) is None:
            if action == "-A":
                return
            if pod not in {p["metadata"]["name"] for p in self.cluster.pods(NS)}:
                # The Pod is gone (a rolling restart), and its network namespace with the rule.
                with self.lock:
                    self.partitioned.discard((pod, rule))
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"cannot heal the partition of {pod}: no herald process "
                                     "in it for 330 s")
            time.sleep(1)
        run(["nsenter", "-t", str(pid), "-n", "iptables", "-w", action, "OUTPUT", *rule], timeout=30)
        with self.lock:
            (self.partitioned.add if action == "-A" else self.partitioned.discard)((pod, rule))

    def partition(self, pod, address, seconds):
        """Packets from the Pod to address (host, port) dropped for a while: its connections
        hang rather than fail, so only herald's own timeouts get it out."""
        rule = ("-d", address[0], "-p", "tcp", "--dport", address[1], "-j", "DROP")
        self.iptables(pod, "-A", rule)
        time.sleep(seconds)
        self.iptables(pod, "-D", rule)

    def postgres_pids(self):
        pid = int((Path(self.postgres["dir"]) / "data" / "postmaster.pid").read_text().split()[0])
        return [pid, *children(pid)]

    def api_server_pid(self):
        for line in (self.cluster.dir / "pids").read_text().splitlines():
            name, _, pid = line.partition(" ")
            if name == "kube-apiserver":
                return int(pid)
        raise AssertionError("no kube-apiserver in the control plane's pids")

    def step(self):
        kind = self.rng.choice(self.kinds)
        started = time.monotonic()
        detail = ""
        length = round(self.rng.uniform(1.0, 6.0), 1)
        pids = herald_pids(self.cluster)
        target = self.rng.choice(sorted(pids)) if pids else None
        if "replica" in kind and target is None:
            return
        if kind == "kill-replica":
            self.signal([pids[target]], signal.SIGKILL)
        elif kind == "pause-replica":
            self.pause([pids[target]], length)
        elif kind == "pause-replica-during-churn":
            # A paused replica, and meanwhile the tenant deletes its subscription.
            self.signal([pids[target]], signal.SIGSTOP)
            self.churn.delete_now.set()
            time.sleep(length)
            self.signal([pids[target]], signal.SIGCONT)
        elif kind == "pause-postgres":
            self.pause(self.postgres_pids(), length)
        elif kind == "restart-postgres":
            script = REPO / "scripts" / "postgres"
            run([script, "stop", "--dir", self.postgres["dir"]], timeout=120)
            run([script, "start", "--dir", self.postgres["dir"]], timeout=120)
        elif kind == "pause-api-server":
            self.pause([self.api_server_pid()], length)
        elif kind == "partition-replica-from-postgres":
            self.partition(target, self.postgres_address, length * 2)
        elif kind == "partition-replica-from-api-server":
            self.partition(target, self.api_address, length * 2)
        elif kind == "rolling-restart":
            # A graceful stop of every replica in turn, as `helm upgrade` does it.
            self.cluster.kubectl("rollout", "restart", "deployment/herald", "-n", NS)
            self.cluster.kubectl("rollout", "status", "deployment/herald", "-n", NS, "--timeout=300s",
                                 timeout=330)
        elif kind == "fill-disk":
            # The embedded store's volume full: publishes are refused (507) and herald's own
            # writes fail until the space comes back.
            detail = f" ({self.fill() >> 20} MiB)"
            time.sleep(length)
            self.filler.unlink()
        elif kind == "change-quota":
            detail = f" to {self.hostile.change_quota()}"
        elif kind == "pause-subscription":
            if self.pauses and self.pauses[-1][1] is None:
                return   # paused already
            detail = f" for {length * 5:.0f}s"
            self.pause_subscription(length * 5)
        elif kind == "rotate-secret":
            self.hostile.rotate(overlap=length)
            detail = f" (overlap {length}s)"
        self.intervals.append((kind, started, time.monotonic()))
        self.faults[kind] += 1
        on = f" {target}" if "replica" in kind else ""
        lasted = length * 2 if kind.startswith("partition") else length
        timed = kind.startswith(("pause", "partition", "fill")) and kind != "pause-subscription"
        self.log.append(f"{kind}{on}{detail}" + (f" {lasted}s" if timed else ""))

    def cause(self, first, again):
        """The disruptive fault that overlapped the life of an attempt that arrived at
        `first` and was delivered again at `again`, or None."""
        for kind, start, end in self.intervals:
            if kind in DISRUPTIVE and start <= min(again, first + AFTER_FIRST) and end >= first - BEFORE_FIRST:
                return kind
        return None

    def run(self, until):
        while time.monotonic() < until:
            self.step()
            time.sleep(self.rng.uniform(1.0, 4.0))


class Churn:
    """The tenant `market` creates its subscription `churn`, lets it run a while and deletes
    it, over and over; sometimes it strips the finalizer first. Each incarnation sends to a
    path of its own; records when each one's deletion was over."""

    def __init__(self, cluster, receiver, rng):
        self.cluster = cluster
        self.receiver = receiver
        self.rng = rng
        self.windows = []   # (path, gone, stripped)
        self.delete_now = threading.Event()

    def gone(self):
        return not self.cluster.exists("whsub", CHURN, "-n", MARKET)

    def once(self):
        path = f"/hooks/churn-{len(self.windows)}"
        tenant(self.cluster, MARKET, self.receiver.port, name=CHURN, path=path)
        self.delete_now.wait(self.rng.uniform(2.0, 6.0))
        self.delete_now.clear()
        stripped = self.rng.random() < 0.3
        if stripped:
            self.cluster.kubectl("patch", "whsub", CHURN, "-n", MARKET, "--type=merge",
                                 "-p", '{"metadata":{"finalizers":null}}', check=False, timeout=60)
        self.cluster.kubectl("delete", "whsub", CHURN, "-n", MARKET, "--wait=false",
                             check=False, timeout=60)
        # Over once the object is gone (with the finalizer: once herald purged and fenced it).
        wait_until("the churned subscription gone", self.gone, timeout=240, interval=0.05)
        self.windows.append((path, time.monotonic(), stripped))

    def run(self, until):
        while time.monotonic() < until:
            self.once()
            time.sleep(self.rng.uniform(0.5, 2.0))

    def late(self, prefix):
        """Arrivals for an incarnation after its deletion and grace: (path, seconds late)."""
        return [(path, round(at - gone, 2))
                for path, gone, stripped in self.windows
                for at in self.receiver.arrivals(prefix, path)
                if at > gone + (STRIPPED_GRACE if stripped else GRACE)]


def run_campaign(cluster, images, release, postgres=None):
    """The campaign against `release` (see conftest.fresh_release; `postgres`: the
    postgres_server it stores in, whose faults join the nemesis's)."""
    replicas = release["replicas"]
    rng = random.Random(SEED)
    report(f"campaign ({'PostgreSQL' if postgres else 'embedded store'}, {replicas} replica(s)): "
           f"seed {SEED}, {SECONDS:.0f}s of faults")
    receiver, churned = Receiver(cluster.node_ip), Receiver(cluster.node_ip)
    hostile = Hostile(cluster, random.Random(rng.random()))
    try:
        tenant(cluster, MARKET, receiver.port)
        hostile.set_up()
        for namespace, name in SUBSCRIPTIONS:
            wait_until(f"subscription {namespace}/{name} Ready",
                       lambda: subscription_ready(cluster, namespace, name), timeout=120)
        check(cluster, images, release, postgres, rng, receiver, churned, hostile)
    finally:
        for namespace, prefix in PRODUCERS:
            cluster.kubectl("delete", "pod", f"producer-{prefix}", "-n", namespace, "--wait=false", check=False)
        for namespace in (MARKET, HOSTILE):
            cluster.kubectl("delete", "whsub", "--all", "-n", namespace, "--timeout=120s", timeout=150,
                            check=False)
        cluster.kubectl("delete", "webhookquota", "--all", "-n", HOSTILE, check=False)
        receiver.close()
        churned.close()
        hostile.receiver.close()


# Every subscription that lives through the campaign: (namespace, name).
SUBSCRIPTIONS = [(TENANT, "orders"), (MARKET, "orders"), (HOSTILE, "mixed"), (HOSTILE, "gone")]


def check(cluster, images, release, postgres, rng, market_receiver, churned, hostile):
    replicas = release["replicas"]
    shop_receiver = release["receiver"]
    producers = [(namespace, receiver, prefix) for (namespace, prefix), receiver
                 in zip(PRODUCERS, (shop_receiver, market_receiver, hostile.receiver))]
    for namespace, receiver, prefix in producers:
        receiver.control = "go"
        cluster.apply(producer_pod(f"producer-{prefix}", namespace, images["producer"], release["ingest"],
                                   prefix=prefix, rate=HOSTILE_RATE if namespace == HOSTILE else RATE,
                                   count=1_000_000, retry_seconds=600,
                                   control_url=f"http://{cluster.node_ip}:{receiver.port}/control"))
    for namespace, receiver, prefix in producers:
        wait_until(f"{prefix}: first arrivals", lambda: len(receiver.ids(f"{prefix}-")) >= RATE, timeout=180)

    churn = Churn(cluster, churned, random.Random(rng.random()))
    nemesis = Nemesis(cluster, postgres, random.Random(rng.random()), churn, hostile, release.get("volume"))
    until = time.monotonic() + SECONDS
    errors = []

    def guarded(job):
        try:
            job(until)
        except BaseException as e:  # reported by the test, not lost in a thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(job,), daemon=True) for job in (churn.run, nemesis.run)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=SECONDS + 600)
    finally:
        nemesis.resume_all()
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "the campaign's threads did not finish"
    report("campaign faults: " + ", ".join(f"{k} {v}" for k, v in sorted(nemesis.faults.items())))
    report("campaign fault log: " + "; ".join(nemesis.log))
    assert sum(nemesis.faults.values()) >= 5, nemesis.log
    assert len(churn.windows) >= 3, churn.windows

    # Healed: every replica back and Ready, then the producers stop and every event they
    # were told was accepted must arrive (at `mixed`: reach it at least once, whatever it
    # answered; `gone` is disabled after its first answer and keeps the rest).
    wait_until(f"{replicas} Ready replica(s) after the campaign", lambda: len(ready_pods(cluster)) == replicas,
               timeout=420)
    totals = collections.Counter()
    causes = collections.Counter()
    for namespace, receiver, prefix in producers:
        receiver.control = "stop"
    for namespace, receiver, prefix in producers:
        result, acked, delivered = acknowledged_arrive(cluster, namespace, f"producer-{prefix}", receiver,
                                                       prefix, finish_timeout=660, arrive_timeout=300)
        totals["published"] += result["published"]
        totals["acknowledged"] += len(acked)
        totals["producer retries"] += len(result["retries"])
        totals["arrived"] += len(set(delivered))
        assert not receiver.bad, receiver.bad[:5]
        if receiver is hostile.receiver:
            arrivals = [(d[0], d[2], d[4]) for d in receiver.arrivals_at("/hooks/mixed")]
        else:
            arrivals = [(d[0], d[3], "ok") for d in receiver.deliveries if d[1] and d[0].startswith(f"{prefix}-")]
        causes.update(repeated(arrivals, receiver.overlaps, nemesis))
    totals["duplicates"] = sum(causes.values())

    late = churn.late("market-c-")
    totals["arrived at the churned subscription"] = len(churned.arrivals("market-c-"))
    report("campaign: " + ", ".join(f"{k} {v}" for k, v in totals.items()) +
           f"; the churned subscription lived {len(churn.windows)} times "
           f"({sum(s for _, _, s in churn.windows)} deletions with the finalizer stripped)")
    report("campaign duplicates by cause: " + (", ".join(f"{k} {v}" for k, v in sorted(causes.items())) or "none"))
    report(f"campaign hostile receiver: answers {dict(sorted(hostile.answered().items()))}; at most "
           f"{hostile.receiver.most} attempts of namespace {HOSTILE} on the wire at once (quotas "
           f"{[v for _, v in hostile.quotas]}, {replicas} replica(s)); {len(hostile.rotations) - 1} secret "
           f"rotation(s); `gone` saw {len(hostile.receiver.arrivals_at('/hooks/gone'))} attempt(s)")
    over_quota, rotation = hostile.quota_violations(replicas), hostile.rotation_violations()
    while_paused = paused_arrivals(nemesis, market_receiver)
    report(f"campaign violations: late attempts after a deletion {len(late)}, while paused "
           f"{len(while_paused)}, unexplained duplicates "
           f"{causes.get('unexplained', 0)}, over the in-flight quota {len(over_quota)} ({hostile.excused} "
           f"more over it only by connections herald closed that the receiver saw closed late), "
           f"signed against the rotation {len(rotation)}")
    assert not late, (len(late), late[:10])
    assert not while_paused, (len(while_paused), while_paused[:10])
    assert not churned.bad, churned.bad[:5]
    assert not causes.get("unexplained"), causes
    assert not over_quota, (len(over_quota), over_quota[:10])
    assert not rotation, (len(rotation), rotation[:10])
    # 410 Gone: disabled at once; besides the attempt answered 410, only attempts already on
    # the wire (one lane, maxInFlight 8) or sent again by a fault may come.
    gone = hostile.receiver.arrivals_at("/hooks/gone")
    assert 1 <= len(gone) <= 8 + sum(nemesis.faults[k] for k in DISRUPTIVE), len(gone)
    statuses_agree_with_the_store(cluster, {(TENANT, "orders"): shop_receiver,
                                            (MARKET, "orders"): market_receiver})


def paused_arrivals(nemesis, receiver):
    """Arrivals at market/orders while the tenant had it paused: past GRACE after the pause,
    or, when a fault may have kept a replica from seeing it, past STRIPPED_GRACE after that
    fault ended. (seconds after the pause, seconds before the resume)"""
    out = []
    arrivals = receiver.arrivals("market-c-", "/hooks/orders")
    for paused, resumed in nemesis.pauses:
        delayed = nemesis.watch_delayed_until(paused - GRACE, paused + GRACE)
        allowed = paused + GRACE if delayed is None else max(paused, delayed) + STRIPPED_GRACE
        out += [(round(at - paused, 2), round(resumed - at, 2)) for at in arrivals if allowed < at < resumed]
    return out


def repeated(arrivals, overlaps, nemesis):
    """Deliveries of an event after one that ended its deliveries (a 2xx, or a 4xx that
    dead-letters it), by cause. `arrivals`: (event id, time, answer) in arrival order."""
    causes = collections.Counter()
    ended = {}   # event id -> (time, answer) of the first arrival that ended its deliveries
    on_wire = collections.Counter(overlaps)
    for event_id, at, answer in sorted(arrivals, key=lambda a: a[1]):
        if event_id in ended:
            first, first_answer = ended[event_id]
            if on_wire[event_id]:
                on_wire[event_id] -= 1
                causes["sent again while the first attempt was on the wire"] += 1
            elif kind := nemesis.cause(first, at):
                causes[f"after {kind}"] += 1
            elif first_answer == "ok-late":
                causes["a 2xx that came late (herald's timeout may have passed first)"] += 1
            else:
                causes["unexplained"] += 1
        elif answer in FINAL:
            ended[event_id] = (at, answer)
    return causes


def statuses_agree_with_the_store(cluster, receivers):
    """Each subscription's status (written by the replica holding its shard) comes to agree
    with what herald's API reads from the store; and a healthy subscription's delivered
    count is the number of events its receiver saw."""
    pod = ready_pods(cluster)[0]
    for namespace, name in SUBSCRIPTIONS:
        cluster.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                       "metadata": {"name": "producer-reads", "namespace": namespace},
                       "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                   "name": "herald-view"},
                       "subjects": [{"kind": "ServiceAccount", "name": "producer", "namespace": namespace}]})
        token = cluster.kubectl("create", "token", "producer", "-n", namespace, "--audience", "herald").stdout.strip()

        def compare():
            request = urllib.request.Request(
                f"http://{pod['status']['podIP']}:8080/v1/namespaces/{namespace}/subscriptions/{name}",
                headers={"Authorization": f"Bearer {token}"})
            try:
                with urllib.request.urlopen(request, timeout=10) as answer:
                    store = json.load(answer)
            except OSError as e:   # a 403 while RBAC's cache catches up, or a timeout
                return AssertionError(f"{namespace}/{name}: {e}")
            status = cluster.get_json("whsub", name, "-n", namespace).get("status", {})
            counters = status.get("counters", {})
            disabled = {c["type"]: c for c in status.get("conditions", [])}.get("Disabled", {})
            shown = {"pending": status.get("pendingAttempts", 0), "dead": status.get("deadAttempts", 0),
                     "delivered": counters.get("delivered", 0), "failed": counters.get("failed", 0),
                     "deadLettered": counters.get("deadLettered", 0),
                     "disabled": disabled.get("status") == "True", "gone": disabled.get("reason") == "Gone"}
            stored = {k: store.get(k) for k in shown}
            return shown == stored or AssertionError(f"{namespace}/{name}: status {shown}, store {stored}")

        wait_until(f"{namespace}/{name}: status and store agree", compare, timeout=120, interval=1)
        if (namespace, name) in receivers:
            status = cluster.get_json("whsub", name, "-n", namespace)["status"]
            seen = len(set(receivers[namespace, name].ids()))
            assert status["counters"]["delivered"] == seen, (namespace, name, status["counters"], seen)
    report("campaign: every subscription's status agrees with the store")
