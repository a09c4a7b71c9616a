"""helm install, upgrade and uninstall against the test control plane. There is no kubelet:
herald's pod stays Pending, so the objects are checked, not a running herald (test_rbac.py
runs herald against the chart's ServiceAccount)."""

import json

import pytest

from conftest import CHART, REPO, wait_until

# The chart brings the CRDs itself (crds/), as on a fresh cluster.
INSTALL_CRDS = False

CRDS = {"webhooksubscriptions.herald.dev", "webhookquotas.herald.dev"}
IGNORED = {"events", "events.events.k8s.io"}
# What stays after `helm uninstall` (README): the CRDs, and the APIService the API server
# registers by itself for their group.
STAYS = {("CustomResourceDefinition", None, crd) for crd in CRDS} | {
    ("APIService", None, "v1alpha1.herald.dev")}


def snapshot(cp):
    """Every object the API server lists, as (resource, namespace, name)."""
    resources = [r for r in cp.kubectl("api-resources", "--verbs=list", "-o", "name").stdout.split()
                 if r not in IGNORED and r != "componentstatuses"]
    items = json.loads(cp.kubectl("get", ",".join(resources), "-A", "-o", "json").stdout)["items"]
    return {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in items}


def env_of(deployment):
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") for e in container["env"]}


@pytest.fixture(scope="module")
def release(cp):
    cp.create_namespace("herald-system")
    cp.create_namespace("team-a")
    before = snapshot(cp)
    cp.helm("install", "herald", CHART, "--namespace", "herald-system")
    return before


def test_install_creates_the_operator_objects(cp, release):
    for crd in CRDS:
        cp.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
    deployment = cp.get_json("deployment", "herald", "-n", "herald-system")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    for args in (("serviceaccount", "herald"), ("service", "herald"), ("persistentvolumeclaim", "herald-data"),
                 ("networkpolicy", "herald")):
        assert cp.exists(*args, "-n", "herald-system"), args
    for name in ("herald", "herald-edit", "herald-view", "herald-publisher"):
        assert cp.exists("clusterrole", name), name
    assert cp.exists("clusterrolebinding", "herald")
    # Nothing runs the pod here, but the Deployment controller made it, as on a cluster.
    wait_until("herald's pod", lambda: cp.kubectl(
        "get", "pods", "-n", "herald-system", "-l", "app.kubernetes.io/name=herald", "-o", "name").stdout.strip())


def test_tenant_roles_are_aggregated_into_edit_admin_and_view(cp, release):
    def rules_of(role):
        return json.dumps(cp.get_json("clusterrole", role).get("rules", []))

    for role in ("edit", "admin", "view"):
        wait_until(f"webhooksubscriptions in the built-in {role} role",
                   lambda: "webhooksubscriptions" in rules_of(role), timeout=60)
    assert "webhookevents" not in rules_of("edit")


def test_upgrade_with_changed_values(cp, release):
    cp.helm("upgrade", "herald", CHART, "--namespace", "herald-system",
            "--set", "log.level=debug", "--set", "defaultQuota.maxInFlight=64",
            "--set", "watchNamespaces={team-a}", "--set", "egress.allow={10.20.0.0/16}",
            "--set", "egress.clusterCIDRs={2001:db8:42::/56,2001:db8:43::/112}")
    env = env_of(cp.get_json("deployment", "herald", "-n", "herald-system"))
    assert env["HERALD_LOG_LEVEL"] == "debug"
    assert env["HERALD_NAMESPACE_MAX_IN_FLIGHT"] == "64"
    assert env["HERALD_WATCH_NAMESPACE"] == "team-a"
    assert env["HERALD_EGRESS_ALLOW"] == "10.20.0.0/16"
    assert env["HERALD_CLUSTER_CIDRS"] == "2001:db8:42::/56,2001:db8:43::/112"
    # herald's rights moved into team-a; the cluster-wide role kept only the reviews.
    assert cp.exists("role", "herald", "-n", "team-a")
    assert cp.exists("rolebinding", "herald", "-n", "team-a")
    cluster_rules = json.dumps(cp.get_json("clusterrole", "herald")["rules"])
    assert "secrets" not in cluster_rules and "tokenreviews" in cluster_rules
    history = json.loads(cp.helm("history", "herald", "-n", "herald-system", "-o", "json").stdout)
    assert [h["revision"] for h in history] == [1, 2]
    assert history[-1]["status"] == "deployed"


def test_upgrade_to_several_replicas_on_postgres_and_back(cp, release):
    """An installed release moves to three replicas sharing PostgreSQL and back to one on the
    embedded store, on the real API server (the strategy switches both ways; the Lease Role
    and the budget come and go with it)."""
    cp.helm("upgrade", "herald", CHART, "--namespace", "herald-system", "--reuse-values",
            "--set", "replicaCount=3", "--set", "store.postgres.existingSecret=herald-postgres")
    deployment = cp.get_json("deployment", "herald", "-n", "herald-system")
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["HERALD_STORE"]["valueFrom"] == {"secretKeyRef": {"name": "herald-postgres", "key": "url"}}
    assert env["HERALD_LEASE_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert "HERALD_DATA_DIR" not in env
    assert "podAntiAffinity" in deployment["spec"]["template"]["spec"]["affinity"]
    assert cp.exists("poddisruptionbudget", "herald", "-n", "herald-system")
    assert cp.exists("role", "herald-shard-leases", "-n", "herald-system")
    assert cp.exists("rolebinding", "herald-shard-leases", "-n", "herald-system")
    # The claim is no longer the chart's (Helm deletes it; the protection controller lets it
    # go once no pod uses it).
    wait_until("the claim to be deleted", lambda: not cp.exists("persistentvolumeclaim", "herald-data",
               "-n", "herald-system") or cp.get_json("persistentvolumeclaim", "herald-data", "-n",
               "herald-system")["metadata"].get("deletionTimestamp"))

    cp.helm("upgrade", "herald", CHART, "--namespace", "herald-system", "--reuse-values",
            "--set", "replicaCount=1", "--set", "store.postgres.existingSecret=")
    deployment = cp.get_json("deployment", "herald", "-n", "herald-system")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert "affinity" not in deployment["spec"]["template"]["spec"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert {e["name"] for e in container["env"]} >= {"HERALD_DATA_DIR"}
    assert not {"HERALD_STORE", "HERALD_SHARD_LEASES"} & {e["name"] for e in container["env"]}
    assert not cp.exists("poddisruptionbudget", "herald", "-n", "herald-system")
    assert not cp.exists("role", "herald-shard-leases", "-n", "herald-system")
    assert not cp.exists("rolebinding", "herald-shard-leases", "-n", "herald-system")
    wait_until("the claim again", lambda: cp.exists("persistentvolumeclaim", "herald-data", "-n", "herald-system")
               and not cp.get_json("persistentvolumeclaim", "herald-data", "-n",
                                   "herald-system")["metadata"].get("deletionTimestamp"), timeout=120)


def test_uninstall_leaves_only_the_crds(cp, release):
    before = release
    cp.helm("uninstall", "herald", "--namespace", "herald-system")

    def left_over():
        extra = snapshot(cp) - before
        assert extra == STAYS, sorted(extra)
        return extra

    wait_until("everything but the CRDs to be gone", left_over, timeout=120, interval=0.5)
    # The built-in roles lose the aggregated rules again.
    wait_until("edit without herald's rules",
               lambda: "webhooksubscriptions" not in json.dumps(cp.get_json("clusterrole", "edit").get("rules", [])))
