"""Day-2 operations on the real Pod while a producer Pod publishes steadily: rollout restart,
`kubectl delete pod` (kubelet's SIGTERM and grace period), `helm upgrade`, `helm uninstall`.
Every acknowledged event must arrive; each scenario reports published, acknowledged and
arrived events, duplicates, and the longest gap in arrivals."""

import subprocess

from conftest import CHART, NS, TENANT, describe, ready_pods, steady_publishing, subscription_ready, wait_until


def the_pod(cluster):
    (pod,) = ready_pods(cluster)
    return pod["metadata"]["name"]


def test_rollout_restart_while_publishing(cluster, images, shop):
    old = the_pod(cluster)

    def restart():
        cluster.kubectl("rollout", "restart", "deployment/herald", "-n", NS)
        cluster.kubectl("rollout", "status", "deployment/herald", "-n", NS, "--timeout=240s", timeout=260)
        wait_until("the new Pod Ready", lambda: [p for p in ready_pods(cluster) if p["metadata"]["name"] != old],
                   timeout=120)

    c = steady_publishing(cluster, images, shop, "restart", restart)
    describe("rollout restart", c)
    assert c["arrived"] >= c["acknowledged"] > 0
    assert the_pod(cluster) != old


def test_delete_pod_lets_attempts_on_the_wire_finish(cluster, images, shop):
    old = the_pod(cluster)
    receiver = shop["receiver"]
    # Slow answers, so that attempts are on the wire when kubelet sends SIGTERM.
    receiver.delay = 0.2
    logs = subprocess.Popen(["kubectl", "logs", "-f", "-n", NS, old], env=cluster.env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def delete():
            cluster.kubectl("delete", "pod", old, "-n", NS, "--wait=true", timeout=120)
            wait_until("a new Pod Ready", lambda: [p for p in ready_pods(cluster) if p["metadata"]["name"] != old],
                       timeout=180)

        c = steady_publishing(cluster, images, shop, "delete", delete)
    finally:
        receiver.delay = 0.0
        try:
            out, _ = logs.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            logs.kill()
            out, _ = logs.communicate()
    describe("kubectl delete pod", c)
    assert c["arrived"] >= c["acknowledged"] > 0
    # The old Pod stopped gracefully within its grace period: herald logged its stop.
    assert "stopped" in out, out[-3000:]


def test_helm_upgrade_changes_a_value_while_publishing(cluster, images, shop, release):
    old = the_pod(cluster)

    def upgrade():
        cluster.helm("upgrade", "herald", CHART, "--namespace", NS, "--reuse-values",
                     "--set", "log.level=debug", "--wait", "--timeout", "240s", timeout=300)
        wait_until("the upgraded Pod Ready",
                   lambda: [p for p in ready_pods(cluster) if p["metadata"]["name"] != old], timeout=180)

    c = steady_publishing(cluster, images, shop, "upgrade", upgrade)
    describe("helm upgrade (log.level=debug)", c)
    assert c["arrived"] >= c["acknowledged"] > 0
    (pod,) = ready_pods(cluster)
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HERALD_LOG_LEVEL"] == "debug"
    assert " DEBUG " in cluster.logs(NS, pod["metadata"]["name"])
    # The tenant's subscription and the store's claim survived the upgrade.
    assert subscription_ready(cluster, TENANT, "orders")


def test_helm_uninstall_leaves_only_the_crds(cluster, shop):
    # Subscriptions first (README): herald's finalizer purges them while herald runs.
    cluster.kubectl("delete", "whsub", "--all", "-n", TENANT, "--timeout=120s", timeout=150)
    cluster.helm("uninstall", "herald", "--namespace", NS, "--wait", "--timeout", "120s", timeout=180)
    wait_until("herald's Pods gone", lambda: cluster.pods(NS) == [], timeout=120)
    left = cluster.get_json("all,pvc,secrets,configmaps,serviceaccounts,roles,rolebindings,networkpolicies,leases",
                            "-n", NS)["items"]
    left = [(o["kind"], o["metadata"]["name"]) for o in left
            if (o["kind"], o["metadata"]["name"]) not in {("ServiceAccount", "default"),
                                                          ("ConfigMap", "kube-root-ca.crt")}]
    assert left == [], left
    cluster_wide = [o["metadata"]["name"] for o in
                    cluster.get_json("clusterroles,clusterrolebindings")["items"]
                    if "herald" in o["metadata"]["name"]]
    assert cluster_wide == [], cluster_wide
    for crd in ("webhooksubscriptions.herald.dev", "webhookquotas.herald.dev"):
        assert cluster.exists("crd", crd)
