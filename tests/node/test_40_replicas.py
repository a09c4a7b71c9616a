"""Several replicas as Pods: PostgreSQL on this host, the chart with replicaCount 3 and the
store URL Secret; the Pods share the one node (anti-affinity is only preferred), divide the
16 shards between them through Leases, and a rolling update while a producer publishes
loses nothing and never sends an event again while its first attempt is on the wire."""

import time

from conftest import (NS, REPLICAS, describe, ready_pods, report, shard_holders, steady_publishing,
                      wait_until)

SHARDS = 16


def balanced(cluster):
    """Every shard held, by the Ready pods only, none holding more than its share."""
    pods = {p["metadata"]["name"] for p in ready_pods(cluster)}
    holders = shard_holders(cluster)
    held = sorted(s for shards in holders.values() for s in shards)
    share = -(-SHARDS // REPLICAS)
    ok = (len(pods) == REPLICAS and set(holders) == pods and held == list(range(SHARDS))
          and all(len(s) <= share for s in holders.values()))
    return holders if ok else AssertionError({k: len(v) for k, v in holders.items()})


def test_replicas_share_the_node_and_balance_the_shards(cluster, replicas):
    pods = ready_pods(cluster)
    # The chart asks for replicas on different nodes only where it can (preferred): with one
    # node, all three run on it.
    anti = pods[0]["spec"]["affinity"]["podAntiAffinity"]
    assert "preferredDuringSchedulingIgnoredDuringExecution" in anti and \
        "requiredDuringSchedulingIgnoredDuringExecution" not in anti, anti
    assert {p["spec"]["nodeName"] for p in pods} == {cluster.node_name}
    holders = wait_until("the shards balanced over the three Pods", lambda: balanced(cluster), timeout=120)
    report("shards per replica: " + ", ".join(f"{k} {len(v)}" for k, v in sorted(holders.items())))
    for pod in pods:
        logs = cluster.logs(NS, pod["metadata"]["name"])
        assert "connecting to the PostgreSQL store" in logs, logs[-2000:]


def test_rolling_update_while_publishing_loses_nothing(cluster, images, replicas):
    old = {p["metadata"]["name"] for p in ready_pods(cluster)}
    # Answers take a while, so attempts are on the wire while shards move.
    replicas["receiver"].delay = 0.1

    def roll():
        cluster.kubectl("rollout", "restart", "deployment/herald", "-n", NS)
        cluster.kubectl("rollout", "status", "deployment/herald", "-n", NS, "--timeout=400s", timeout=420)
        wait_until("three new Pods Ready", lambda: len(ready_pods(cluster)) == REPLICAS and
                   not old & {p["metadata"]["name"] for p in ready_pods(cluster)}, timeout=180)

    c = steady_publishing(cluster, images, replicas, "rolling", roll)
    replicas["receiver"].delay = 0.0
    describe("rolling update, 3 replicas on PostgreSQL", c)
    assert c["arrived"] >= c["acknowledged"] > 0
    assert c["overlapping"] == 0, replicas["receiver"].overlaps[:10]
    holders = wait_until("the shards balanced over the new Pods", lambda: balanced(cluster), timeout=120)
    assert not old & set(holders)
