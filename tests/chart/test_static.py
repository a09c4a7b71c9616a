"""The chart, config/ and the Dockerfile without a cluster: lint, the values schema, what
the templates render, that config/ grants what the chart grants, hadolint and checkov."""

import base64
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ALL_OPTIONS, CHART, HERE, REPO, SCALE_OUT, bin_dir, find, helm, render, run, tool_env

# What herald calls in the API (src/controller/*.rs), as (apiGroup, resource, verb).
# The chart must grant exactly this to herald's ServiceAccount.
HERALD_NEEDS = {
    ("herald.dev", "webhooksubscriptions", v) for v in ("get", "list", "watch", "patch")
} | {
    ("herald.dev", "webhooksubscriptions/status", "patch"),
    ("herald.dev", "webhookquotas", "get"),
    ("herald.dev", "webhookquotas", "list"),
    ("herald.dev", "webhookquotas", "watch"),
    ("herald.dev", "webhookquotas/status", "patch"),
    ("", "secrets", "get"),
    ("", "secrets", "list"),
    ("", "secrets", "watch"),
    ("events.k8s.io", "events", "create"),
    ("events.k8s.io", "events", "patch"),
    ("authentication.k8s.io", "tokenreviews", "create"),
    ("authorization.k8s.io", "subjectaccessreviews", "create"),
}
CLUSTER_ONLY = {
    ("authentication.k8s.io", "tokenreviews", "create"),
    ("authorization.k8s.io", "subjectaccessreviews", "create"),
}
# What replicas sharing PostgreSQL do with their shard and member Leases
# (src/controller/shard_leases.rs: list by label, get, create, replace, delete), granted in
# herald's own namespace only. Never watched, never patched.
HERALD_LEASES = {("coordination.k8s.io", "leases", v) for v in ("get", "list", "create", "update", "delete")}
# Several replicas on a shared store: the values that make it.
POSTGRES = ("--set", "store.postgres.existingSecret=herald-postgres")
SCALED = (*POSTGRES, "--set", "replicaCount=3")


def triples(rules):
    """A role's rules as a set of (apiGroup, resource, verb); resourceNames must not occur."""
    out = set()
    for rule in rules:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule, rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    out.add((group, resource, verb))
    return out


# ---- helm lint and the values schema ----------------------------------------------------

def test_lint_strict_with_default_values():
    out = helm("lint", "--strict", CHART).stdout
    assert "0 chart(s) failed" in out


def test_lint_strict_with_every_option_set():
    out = helm("lint", "--strict", CHART, "-f", ALL_OPTIONS).stdout
    assert "0 chart(s) failed" in out


def test_lint_strict_with_every_option_set_and_scaled_out():
    out = helm("lint", "--strict", CHART, "-f", ALL_OPTIONS, "-f", SCALE_OUT).stdout
    assert "0 chart(s) failed" in out


def test_every_value_is_in_the_schema_and_the_schema_is_closed():
    """A value missing from the schema would be refused by additionalProperties: false, so
    every key of values.yaml and of the all-options file is declared, and every object the
    schema declares is closed (except Kubernetes objects passed through as they are)."""
    import json

    schema = json.loads((CHART / "values.schema.json").read_text())
    passthrough = {"podSecurityContext", "securityContext", "affinity", "global"}

    def closed(node, path):
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is False, f"{path} is open"
            for key, child in node["properties"].items():
                if key not in passthrough:
                    closed(child, f"{path}.{key}")

    closed(schema, "values")

    def declared(values, node, path):
        for key, value in values.items():
            assert key in node["properties"], f"{path}.{key} is not in values.schema.json"
            child = node["properties"][key]
            if isinstance(value, dict) and "properties" in child:
                declared(value, child, f"{path}.{key}")

    for source in (CHART / "values.yaml", ALL_OPTIONS, SCALE_OUT):
        declared(yaml.safe_load(source.read_text()), schema, "values")


@pytest.mark.parametrize(
    "values, complaint",
    [
        ("imge:\n  tag: x\n", "additional properties 'imge' not allowed"),
        ("store:\n  sise: 5Gi\n", "additional properties 'sise' not allowed"),
        ("networkPolicy:\n  enabeld: true\n", "additional properties 'enabeld' not allowed"),
        ("defaultQuota:\n  maxInFlight: many\n", "/defaultQuota/maxInFlight"),
        ("watchNamespaces: team-a\n", "/watchNamespaces"),
        ("serviceMonitor:\n  enabled: \"yes\"\n", "/serviceMonitor/enabled"),
        ("defaultQuota:\n  maxInFlight: 8\n", "/defaultQuota/maxInFlight"),
        ("egress:\n  allow: [10.0.0.1]\n", "/egress/allow/0"),
        ("image:\n  pullPolicy: Sometimes\n", "/image/pullPolicy"),
        ("ingest:\n  tls:\n    enabled: true\n", "/ingest/tls"),
        ("ingest:\n  tls:\n    enabled: true\n    certManager:\n      enabled: true\n",
         "/ingest/tls/certManager/issuerRef/name"),
        ("ingest:\n  tls:\n    certManager:\n      issuerRef:\n        kind: Cluster\n",
         "/ingest/tls/certManager/issuerRef/kind"),
        # The store's URL holds a password: only ever from a Secret.
        ("store:\n  postgres:\n    url: postgres://herald:pw@db:5432/herald\n",
         "additional properties 'url' not allowed"),
        ("store:\n  postgres:\n    existingSecret: Not_A_Name\n", "/store/postgres/existingSecret"),
        ("store:\n  postgres:\n    secretKey: \"\"\n", "/store/postgres/secretKey"),
        ("replicaCount: 0\n", "/replicaCount"),
        ("shards: 0\n", "/shards"),
        ("shards: 5000\n", "/shards"),
        ("shardLeaseSeconds: 2\n", "/shardLeaseSeconds"),
    ],
    ids=["unknown-top-level-key", "unknown-nested-key", "misspelt-switch", "string-for-integer",
         "string-for-list", "string-for-boolean", "quota-below-floor", "address-not-cidr",
         "unknown-enum", "tls-without-secret-or-cert-manager", "cert-manager-without-issuer",
         "unknown-issuer-kind", "postgres-url-in-values", "postgres-secret-not-a-name",
         "postgres-empty-key", "no-replicas", "no-shards", "too-many-shards", "lease-too-short"],
)
def test_schema_refuses_bad_values(tmp_path, values, complaint):
    bad = tmp_path / "bad.yaml"
    bad.write_text(values)
    for command in (["lint", "--strict", CHART, "-f", bad],
                    ["template", "herald", CHART, "-f", bad]):
        proc = helm(*command, check=False)
        assert proc.returncode != 0, f"helm {command[0]} accepted {values!r}"
        assert complaint in proc.stdout + proc.stderr, proc.stdout + proc.stderr


@pytest.mark.parametrize("values", [
    "replicaCount: 2\n",
    "replicaCount: 3\nstore:\n  postgres:\n    secretKey: url\n",
], ids=["two-replicas", "three-replicas-key-without-secret"])
def test_schema_refuses_several_replicas_on_the_embedded_store(tmp_path, values):
    """Two pods must never open the same embedded store: more than one replica only with a
    shared PostgreSQL store. The refusal names both sides, the replica count and the
    missing Secret."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(values)
    for command in (["lint", "--strict", CHART, "-f", bad], ["template", "herald", CHART, "-f", bad],
                    ["install", "herald", CHART, "--dry-run=client", "-f", bad]):
        proc = helm(*command, check=False)
        assert proc.returncode != 0, f"helm {command[0]} accepted {values!r}"
        out = proc.stdout + proc.stderr
        assert "at '/replicaCount': maximum: got" in out, out
        assert "at '/store/postgres/existingSecret': minLength: got 0, want 1" in out, out
    # The same values with the store's Secret named are accepted.
    good = tmp_path / "good.yaml"
    good.write_text(values + ("store:\n  postgres:\n    existingSecret: herald-postgres\n"
                              if "store:" not in values else "    existingSecret: herald-postgres\n"))
    assert find(render("-f", good), "Deployment")["spec"]["replicas"] == yaml.safe_load(values)["replicaCount"]


def test_templates_refuse_several_replicas_on_the_embedded_store_without_the_schema():
    """Where the schema is not checked (--skip-schema-validation), the template refuses too."""
    proc = helm("template", "herald", CHART, "--skip-schema-validation", "--set", "replicaCount=2",
                check=False)
    assert proc.returncode != 0
    assert "replicaCount (2) > 1 needs store.postgres.existingSecret" in proc.stderr, proc.stderr


def test_grace_period_must_exceed_the_shutdown_timeout():
    proc = helm("template", "herald", CHART, "--set", "shutdownTimeoutSeconds=40", check=False)
    assert proc.returncode != 0
    assert "terminationGracePeriodSeconds (35) must be larger than shutdownTimeoutSeconds (40) + 5" in proc.stderr


def test_grace_period_leaves_room_for_releasing_the_shard_leases():
    # The drain may take all of shutdownTimeoutSeconds; the Lease releases follow it.
    proc = helm("template", "herald", CHART, "--set", "shutdownTimeoutSeconds=30", check=False)
    assert proc.returncode != 0
    assert "+ 5" in proc.stderr
    helm("template", "herald", CHART, "--set", "shutdownTimeoutSeconds=29")


# ---- what the templates render ----------------------------------------------------------

def env_of(container):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_default_deployment_runs_cluster_mode_safely():
    objects = render()
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    deployment = find(objects, "Deployment", "herald")
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == f"herald:{chart['appVersion']}"
    assert container["args"] == ["run"]
    env = env_of(container)
    assert env["HERALD_LISTEN"] == "0.0.0.0:8080"
    assert env["HERALD_METRICS_LISTEN"] == "0.0.0.0:9090"
    assert env["HERALD_DATA_DIR"] == "/var/lib/herald"
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["HERALD_NAMESPACE_MAX_IN_FLIGHT"] == "256"
    assert env["HERALD_NAMESPACE_MAX_PENDING"] == "1000000"
    assert env["HERALD_NAMESPACE_MAX_STORED_BYTES"] == "268435456"
    assert env["HERALD_STORE_RESERVE_BYTES"] == "67108864"
    assert env["HERALD_LOG_LEVEL"] == "info"
    assert env["HERALD_LOG_FORMAT"] == "text"
    assert env["HERALD_TOKEN_AUDIENCE"] == "herald"
    assert "HERALD_WATCH_NAMESPACE" not in env and "HERALD_EGRESS_ALLOW" not in env
    assert "HERALD_CLUSTER_CIDRS" not in env
    assert pod["terminationGracePeriodSeconds"] > int(env["HERALD_SHUTDOWN_TIMEOUT_SECONDS"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"ingest": 8080, "metrics": 9090}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["resources"]["requests"] and container["resources"]["limits"]
    # The restricted Pod Security Standard (checked for real by the API server in
    # test_apply.py): non-root, no escalation, no capabilities, RuntimeDefault seccomp,
    # read-only root filesystem.
    sc, psc = container["securityContext"], pod["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/var/lib/herald"] == "data"
    volumes = {v["name"]: v for v in pod["volumes"]}
    claim = volumes["data"]["persistentVolumeClaim"]["claimName"]
    pvc = find(objects, "PersistentVolumeClaim", claim)
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert "storageClassName" not in pvc["spec"]
    assert pod["serviceAccountName"] == find(objects, "ServiceAccount", "herald")["metadata"]["name"]
    service = find(objects, "Service", "herald")
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        "ingest": (8080, "ingest"), "metrics": (9090, "metrics")}
    kinds = {o["kind"] for o in objects}
    assert "ServiceMonitor" not in kinds and "PodDisruptionBudget" not in kinds
    assert "NetworkPolicy" in kinds
    # One replica on the embedded store: no shared store, no shard Leases, no Role for
    # them, no spreading over nodes.
    assert not {"HERALD_STORE", "HERALD_SHARD_LEASES", "HERALD_SHARDS", "HERALD_LEASE_NAMESPACE",
                "HERALD_SHARD_LEASE_SECONDS"} & set(env)
    assert "affinity" not in pod
    assert "Role" not in kinds and "RoleBinding" not in kinds
    assert "leases" not in yaml.safe_dump_all(objects)
    for o in objects:
        if o["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert o["metadata"]["namespace"] == "herald-system", o["metadata"]


def test_all_options_reach_the_objects():
    objects = render("-f", ALL_OPTIONS)
    deployment = find(objects, "Deployment", "herald-webhooks")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"].endswith("@sha256:" + "0123456789abcdef" * 4)
    env = env_of(container)
    assert env["HERALD_WATCH_NAMESPACE"] == "team-a,team-b"
    assert env["HERALD_EGRESS_ALLOW"] == "10.20.0.0/16,fd00::/8"
    assert env["HERALD_CLUSTER_CIDRS"] == "2001:db8:42::/56,2001:db8:43::/112"
    assert env["HERALD_TOKEN_AUDIENCE"] == "webhooks.example.com"
    assert env["HERALD_NAMESPACE_MAX_IN_FLIGHT"] == "64"
    assert env["HERALD_SHUTDOWN_TIMEOUT_SECONDS"] == "40"
    assert env["RUST_BACKTRACE"] == "1"
    assert pod["terminationGracePeriodSeconds"] == 60
    assert pod["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert pod["serviceAccountName"] == "herald-operator"
    assert find(objects, "PersistentVolumeClaim")["spec"]["storageClassName"] == "fast-ssd"
    assert find(objects, "ServiceMonitor")["spec"]["endpoints"][0]["port"] == "metrics"
    assert find(objects, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    netpol = find(objects, "NetworkPolicy")["spec"]
    assert netpol["policyTypes"] == ["Ingress", "Egress"]
    assert env["HERALD_LOG_FORMAT"] == "json"
    dashboard = find(objects, "ConfigMap")
    assert dashboard["metadata"]["namespace"] == "team-b"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["herald.json"])["uid"] == "herald-overview"
    certificate = find(objects, "Certificate")
    assert certificate["spec"]["secretName"] == "herald-webhooks-ingest-cert"
    assert certificate["spec"]["issuerRef"]["kind"] == "ClusterIssuer"
    assert env["HERALD_TLS_CERT_FILE"].endswith("/tls.crt")


def test_all_options_scaled_out_reach_the_objects():
    """values-scale-out.yaml over values-all-options.yaml: the scale-out values reach herald,
    and the set affinity wins over the default anti-affinity."""
    objects = render("-f", ALL_OPTIONS, "-f", SCALE_OUT)
    deployment = find(objects, "Deployment", "herald-webhooks")
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]["spec"]
    env = env_of(pod["containers"][0])
    assert env["HERALD_STORE"] == {"secretKeyRef": {"name": "herald-postgres", "key": "database-url"}}
    assert env["HERALD_SHARDS"] == "32"
    assert env["HERALD_SHARD_LEASE_SECONDS"] == "20"
    # The store's URL is the only Secret passed as an environment variable (checkov.yaml
    # skips CKV_K8S_35 for it alone).
    assert [name for name, value in env.items() if isinstance(value, dict) and "secretKeyRef" in value] == \
        ["HERALD_STORE"]
    assert pod["affinity"] == yaml.safe_load(ALL_OPTIONS.read_text())["affinity"]
    assert "PersistentVolumeClaim" not in {o["kind"] for o in objects}
    role = find(objects, "Role", "herald-webhooks-shard-leases")
    assert role["metadata"]["namespace"] == "herald-system"
    binding = find(objects, "RoleBinding", "herald-webhooks-shard-leases")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "herald-operator",
                                    "namespace": "herald-system"}]


def test_large_numbers_reach_herald_as_integers(tmp_path):
    """Helm reads numbers of a values file as floats; 1000000 must not reach herald as "1e+06"."""
    values = tmp_path / "large.yaml"
    values.write_text("delivery: {maxInFlight: 1000000, historyRetentionHours: 8760000}\n"
                      "defaultQuota: {maxPendingAttempts: 50000000, maxStoredBytes: 10000000000}\n")
    objects = render("-f", values)
    env = env_of(find(objects, "Deployment", "herald")["spec"]["template"]["spec"]["containers"][0])
    assert env["HERALD_MAX_IN_FLIGHT"] == "1000000"
    assert env["HERALD_NAMESPACE_MAX_PENDING"] == "50000000"
    assert env["HERALD_NAMESPACE_MAX_STORED_BYTES"] == "10000000000"
    assert env["HERALD_HISTORY_RETENTION_HOURS"] == "8760000"


def test_existing_claim_replaces_the_chart_claim():
    objects = render("--set", "store.existingClaim=kept")
    assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    pod = find(objects, "Deployment", "herald")["spec"]["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["data"]["persistentVolumeClaim"] == {"claimName": "kept"}


def operator_grants(objects, service_account="herald", namespace="herald-system"):
    """What the bindings give herald's ServiceAccount: cluster-wide, and per namespace."""
    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
             for o in objects if o["kind"] in ("ClusterRole", "Role")}
    cluster, namespaced = set(), {}
    for b in objects:
        if b["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        if {"kind": "ServiceAccount", "name": service_account, "namespace": namespace} not in b["subjects"]:
            continue
        ref = b["roleRef"]
        role_ns = b["metadata"].get("namespace") if ref["kind"] == "Role" else None
        rules = triples(roles[(ref["kind"], role_ns, ref["name"])]["rules"])
        if b["kind"] == "ClusterRoleBinding":
            cluster |= rules
        else:
            namespaced.setdefault(b["metadata"]["namespace"], set()).update(rules)
    return cluster, namespaced


def test_herald_is_granted_exactly_what_it_calls():
    cluster, namespaced = operator_grants(render())
    assert cluster == HERALD_NEEDS
    assert namespaced == {}


def test_watch_namespaces_narrow_herald_to_roles_in_those_namespaces():
    objects = render("--set", "watchNamespaces={team-a,team-b}")
    cluster, namespaced = operator_grants(objects)
    assert cluster == CLUSTER_ONLY
    assert namespaced == {"team-a": HERALD_NEEDS - CLUSTER_ONLY, "team-b": HERALD_NEEDS - CLUSTER_ONLY}


# ---- scale-out: several replicas sharing PostgreSQL --------------------------------------

def test_scaled_out_replicas_share_postgres_and_roll_one_at_a_time():
    objects = render(*SCALED)
    deployment = find(objects, "Deployment", "herald")
    spec = deployment["spec"]
    assert spec["replicas"] == 3
    # A new pod starts before an old one stops (shards move as the old one lets them go);
    # never fewer ready replicas than asked for.
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    env = env_of(container)
    # The URL comes from the Secret, never from a value.
    assert env["HERALD_STORE"] == {"secretKeyRef": {"name": "herald-postgres", "key": "url"}}
    assert env["HERALD_SHARD_LEASES"] == "true"
    assert env["HERALD_SHARDS"] == "16"
    assert env["HERALD_SHARD_LEASE_SECONDS"] == "15"
    # The Leases go in herald's own namespace, whatever it is.
    assert env["HERALD_LEASE_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    # Each replica's identity is its pod's name (HERALD_REPLICA_ID's default).
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert "HERALD_REPLICA_ID" not in env
    # No embedded store: no claim, no data volume, no data directory.
    assert "HERALD_DATA_DIR" not in env
    assert "PersistentVolumeClaim" not in {o["kind"] for o in objects}
    assert not [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert "/var/lib/herald" not in {m["mountPath"] for m in container["volumeMounts"]}
    # The read-only root filesystem stays, with its writable /tmp.
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}


@pytest.mark.parametrize("release,namespace", [("herald", "herald-system"), ("hooks", "platform")])
def test_scaled_out_replicas_spread_over_nodes(release, namespace):
    objects = render(*SCALED, release=release, namespace=namespace)
    deployment = find(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    # Exactly this release's pods.
    assert term["podAffinityTerm"]["labelSelector"] == {"matchLabels": deployment["spec"]["selector"]["matchLabels"]}
    assert deployment["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == release
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in pod["affinity"]["podAntiAffinity"]
    assert set(pod["affinity"]) == {"podAntiAffinity"}


def test_affinity_value_replaces_the_default_anti_affinity():
    mine = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologyKey": "topology.kubernetes.io/zone",
         "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "herald"}}}]}}
    pod = find(render(*SCALED, "--set-json", f"affinity={json.dumps(mine)}"),
               "Deployment")["spec"]["template"]["spec"]
    assert pod["affinity"] == mine


def test_scaled_out_drain_keeps_the_shards_owned():
    """With several replicas a PodDisruptionBudget is there without asking: a drain
    evicts one replica at a time, the others take over its shards."""
    objects = render(*SCALED)
    deployment = find(objects, "Deployment", "herald")
    pdb = find(objects, "PodDisruptionBudget", "herald")
    assert pdb["metadata"]["namespace"] == "herald-system"
    assert pdb["spec"]["maxUnavailable"] == 1
    assert "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["selector"] == {"matchLabels": deployment["spec"]["selector"]["matchLabels"]}
    # Explicitly off does not remove it with several replicas (it never blocks a drain).
    assert find(render(*SCALED, "--set", "podDisruptionBudget.enabled=false"), "PodDisruptionBudget")
    # A percentage passes through.
    pdb = find(render(*SCALED, "--set", "podDisruptionBudget.maxUnavailable=34%"), "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == "34%"


def test_budget_that_lets_every_replica_go_is_refused():
    proc = helm("template", "herald", CHART, *SCALED, "--set", "podDisruptionBudget.maxUnavailable=3",
                check=False)
    assert proc.returncode != 0
    assert "podDisruptionBudget.maxUnavailable (3) must be below replicaCount (3)" in proc.stderr, proc.stderr


def test_one_replica_keeps_its_budget_behaviour():
    """One replica: no budget unless enabled, as before scale-out; on PostgreSQL too."""
    for args in ((), POSTGRES):
        assert "PodDisruptionBudget" not in {o["kind"] for o in render(*args)}, args
        pdb = find(render(*args, "--set", "podDisruptionBudget.enabled=true"), "PodDisruptionBudget")
        assert pdb["spec"]["maxUnavailable"] == 1


def test_scaled_out_lease_rights_are_a_role_in_herald_namespace_only():
    for namespace in ("herald-system", "platform"):
        objects = render(*SCALED, namespace=namespace)
        cluster, namespaced = operator_grants(objects, namespace=namespace)
        assert cluster == HERALD_NEEDS
        assert namespaced == {namespace: HERALD_LEASES}
        role = find(objects, "Role", "herald-shard-leases")
        assert role["metadata"]["namespace"] == namespace
        for o in objects:
            if o["kind"] == "ClusterRole":
                assert "leases" not in json.dumps(o["rules"]), o["metadata"]["name"]
    # With watchNamespaces, the Lease Role stays in herald's namespace, apart from the
    # Roles of the watched namespaces.
    cluster, namespaced = operator_grants(render(*SCALED, "--set", "watchNamespaces={team-a}"))
    assert cluster == CLUSTER_ONLY
    assert namespaced == {"team-a": HERALD_NEEDS - CLUSTER_ONLY, "herald-system": HERALD_LEASES}
    # One replica on PostgreSQL still shares by Leases (it may be scaled): same Role.
    assert operator_grants(render(*POSTGRES))[1] == {"herald-system": HERALD_LEASES}
    # No RBAC at all when the chart makes none.
    assert not [o for o in render(*SCALED, "--set", "rbac.create=false") if o["kind"] in ("Role", "RoleBinding")]


def test_one_replica_on_postgres_rolls_and_shares_by_leases():
    objects = render(*POSTGRES)
    spec = find(objects, "Deployment", "herald")["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"]["type"] == "RollingUpdate"
    env = env_of(spec["template"]["spec"]["containers"][0])
    assert env["HERALD_SHARD_LEASES"] == "true" and "HERALD_STORE" in env
    assert "PersistentVolumeClaim" not in {o["kind"] for o in objects}


def test_notes_say_who_holds_the_shards():
    out = helm("install", "herald", CHART, "--namespace", "herald-system", "--dry-run=client", *SCALED).stdout
    notes = out[out.index("NOTES:"):]
    assert "3 replicas share the PostgreSQL store whose URL is in Secret herald-postgres" in notes
    assert "kubectl get leases -n herald-system -l herald.dev/lease=shard" in notes
    out = helm("install", "herald", CHART, "--namespace", "herald-system", "--dry-run=client").stdout
    assert "leases" not in out[out.index("NOTES:"):]


def test_tenant_roles_aggregate_into_edit_and_view_and_never_write_quotas():
    objects = render()
    edit = find(objects, "ClusterRole", "herald-edit")
    view = find(objects, "ClusterRole", "herald-view")
    publisher = find(objects, "ClusterRole", "herald-publisher")
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert "rbac.authorization.k8s.io/aggregate-to-edit" not in publisher["metadata"]["labels"]
    subs = {("herald.dev", "webhooksubscriptions", v) for v in
            ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")}
    read_quotas = {("herald.dev", "webhookquotas", v) for v in ("get", "list", "watch")}
    # Through the aggregated API: replays and re-enabling (edit), attempts (edit, view).
    manage = {("delivery.herald.dev", r, "create") for r in ("replays", "enablements")}
    attempts = {("delivery.herald.dev", "deliveries", v) for v in ("get", "list", "watch")}
    assert triples(edit["rules"]) == subs | read_quotas | manage | attempts
    assert triples(view["rules"]) == {("herald.dev", r, v) for r in ("webhooksubscriptions", "webhookquotas")
                                      for v in ("get", "list", "watch")} | attempts
    # Publishing through herald's direct API and through the aggregated API (kubectl create).
    assert triples(publisher["rules"]) == {("herald.dev", "webhookevents", "create"),
                                           ("delivery.herald.dev", "webhookevents", "create"),
                                           ("delivery.herald.dev", "webhookeventbatches", "create")}
    names = {o["metadata"]["name"] for o in render("--set", "rbac.tenantRoles=false")
             if o["kind"] == "ClusterRole"}
    assert names == {"herald"}
    assert not [o for o in render("--set", "rbac.tenantRoles=false", "--set", "rbac.create=false")
                if o["kind"].endswith("Role") or o["kind"].endswith("RoleBinding")]


def test_notes_tell_how_to_subscribe_publish_and_read_status():
    out = helm("install", "herald", CHART, "--namespace", "herald-system", "--dry-run=client").stdout
    notes = out[out.index("NOTES:"):]
    for needle in ("kind: WebhookSubscription", "kubectl wait --for=condition=Ready",
                   "--clusterrole=herald-publisher", "kubectl create token producer -n shop --audience herald",
                   "http://herald.herald-system.svc:8080/v1/namespaces/shop/events",
                   "kubectl describe whsub", "watchNamespaces", "egress.allow",
                   "kubectl apply --server-side -f crds/"):
        assert needle in notes, needle


# ---- ingest TLS --------------------------------------------------------------------------

def ingest_tls_of(objects):
    """The ingest TLS wiring of the rendered Deployment: the env, the mount of the Secret
    and its volume (None when absent)."""
    pod = find(objects, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = env_of(container)
    mount = next((m for m in container["volumeMounts"] if m["name"] == "ingest-tls"), None)
    volume = next((v for v in pod["volumes"] if v["name"] == "ingest-tls"), None)
    return env, mount, volume


def test_ingest_tls_is_off_by_default():
    objects = render()
    env, mount, volume = ingest_tls_of(objects)
    assert "HERALD_TLS_CERT_FILE" not in env and "HERALD_TLS_KEY_FILE" not in env
    assert mount is None and volume is None
    assert "Certificate" not in {o["kind"] for o in objects}
    (ingest,) = [p for p in find(objects, "Service", "herald")["spec"]["ports"] if p["name"] == "ingest"]
    assert "appProtocol" not in ingest


def assert_serves_tls_from(objects, secret):
    """herald gets both files of `secret`, mounted whole (a subPath would miss renewals),
    read-only and readable by its group only; the probes stay on the plain metrics port."""
    env, mount, volume = ingest_tls_of(objects)
    assert volume["secret"] == {"secretName": secret, "defaultMode": 0o440}
    assert mount["readOnly"] is True and "subPath" not in mount
    assert env["HERALD_TLS_CERT_FILE"] == mount["mountPath"] + "/tls.crt"
    assert env["HERALD_TLS_KEY_FILE"] == mount["mountPath"] + "/tls.key"
    container = find(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] == "metrics", probe
    service = find(objects, "Service")
    (ingest,) = [p for p in service["spec"]["ports"] if p["name"] == "ingest"]
    assert ingest["appProtocol"] == "https"


def test_ingest_tls_from_an_existing_secret():
    objects = render("--set", "ingest.tls.enabled=true", "--set", "ingest.tls.secretName=herald-tls")
    assert_serves_tls_from(objects, "herald-tls")
    assert "Certificate" not in {o["kind"] for o in objects}


@pytest.mark.parametrize("release,namespace,secret", [
    ("herald", "herald-system", None),
    ("hooks", "platform", "hooks-cert"),
], ids=["default-secret", "named-secret"])
def test_ingest_tls_from_cert_manager(release, namespace, secret):
    """cert-manager issues a certificate for exactly the names the ingest Service has in the
    cluster, into the Secret herald mounts. (Rendering only: the test cluster has no
    cert-manager; test_apply.py dry-runs it against a stand-in CRD.)"""
    args = ["--set", "ingest.tls.enabled=true", "--set", "ingest.tls.certManager.enabled=true",
            "--set", "ingest.tls.certManager.issuerRef.name=internal-ca",
            "--set", "ingest.tls.certManager.issuerRef.kind=ClusterIssuer"]
    if secret:
        args += ["--set", f"ingest.tls.secretName={secret}"]
    objects = render(*args, release=release, namespace=namespace)
    service = find(objects, "Service")["metadata"]["name"]
    certificate = find(objects, "Certificate")
    assert certificate["apiVersion"] == "cert-manager.io/v1"
    assert certificate["metadata"]["namespace"] == namespace
    spec = certificate["spec"]
    assert spec["dnsNames"] == [service, f"{service}.{namespace}", f"{service}.{namespace}.svc",
                                f"{service}.{namespace}.svc.cluster.local"]
    assert spec["issuerRef"] == {"name": "internal-ca", "kind": "ClusterIssuer",
                                 "group": "cert-manager.io"}
    assert "server auth" in spec["usages"]
    assert spec["privateKey"]["rotationPolicy"] == "Always"
    assert spec["secretName"] == (secret or f"{service}-ingest-tls")
    assert_serves_tls_from(objects, spec["secretName"])


def test_notes_give_the_https_url_with_tls():
    out = helm("install", "herald", CHART, "--namespace", "herald-system", "--dry-run=client",
               "--set", "ingest.tls.enabled=true", "--set", "ingest.tls.secretName=herald-tls").stdout
    notes = out[out.index("NOTES:"):]
    assert "https://herald.herald-system.svc:8080/v1/namespaces/shop/events" in notes
    assert "--cacert" in notes and "herald-tls" in notes
    assert "http://herald" not in notes


# ---- config/ (kustomize) against the chart ----------------------------------------------

def kustomize(path):
    out = run([bin_dir() / "kubectl", "kustomize", path], env=tool_env()).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def rbac_view(objects):
    """Every role's rules and aggregation labels and every binding, by kind and name."""
    view = {}
    for o in objects:
        key = (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
        if o["kind"] in ("ClusterRole", "Role"):
            labels = {k: v for k, v in o["metadata"].get("labels", {}).items()
                      if k.startswith("rbac.authorization.k8s.io/")}
            view[key] = (triples(o["rules"]), labels)
        elif o["kind"] in ("ClusterRoleBinding", "RoleBinding"):
            view[key] = (o["roleRef"], sorted(map(str, o["subjects"])))
    return view


def test_config_grants_the_same_rules_as_the_chart():
    assert rbac_view(kustomize(REPO / "config" / "default")) == rbac_view(render())


def test_config_manager_runs_herald_as_the_chart_does():
    chart, config = render(), kustomize(REPO / "config" / "default")

    def pod(objects):
        spec = dict(find(objects, "Deployment", "herald")["spec"])
        template = spec.pop("template")
        return spec, template["spec"]

    assert pod(config) == pod(chart)
    for kind in ("Service", "PersistentVolumeClaim", "NetworkPolicy", "ServiceAccount"):
        assert find(config, kind)["spec" if kind != "ServiceAccount" else "automountServiceAccountToken"] == \
            find(chart, kind)["spec" if kind != "ServiceAccount" else "automountServiceAccountToken"], kind
    namespace = find(config, "Namespace", "herald-system")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_config_crds_are_the_generated_ones():
    bases = sorted(p.name for p in (REPO / "config" / "crd" / "bases").iterdir())
    assert bases == sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    for crd in sorted((REPO / "crds").glob("*.yaml")):
        assert (REPO / "config" / "crd" / "bases" / crd.name).read_bytes() == crd.read_bytes(), (
            f"config/crd/bases/{crd.name} differs from crds/{crd.name}: copy it (cp crds/*.yaml config/crd/bases/); "
            "kustomize loads no file from outside config/")
    crds = [o["metadata"]["name"] for o in kustomize(REPO / "config" / "default")
            if o["kind"] == "CustomResourceDefinition"]
    assert sorted(crds) == sorted(p.stem for p in (REPO / "crds").glob("*.yaml"))


# ---- the Dockerfile ---------------------------------------------------------------------

def hadolint(path):
    binary = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    return run([binary, "--no-color", path], check=False)


def test_dockerfile_is_hadolint_clean():
    proc = hadolint(REPO / "Dockerfile")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_does_flag_a_careless_dockerfile(tmp_path):
    """The lint above is real: the same hadolint refuses an unpinned base image."""
    careless = tmp_path / "Dockerfile"
    careless.write_text("FROM rust:latest\nRUN cd /src && cargo build\n")
    proc = hadolint(careless)
    assert proc.returncode != 0
    assert "DL3007" in proc.stdout


def test_dockerfile_shape():
    text = (REPO / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+)(?: AS (\S+))?$", text, re.M)
    assert len(stages) >= 2, "multi-stage"
    # Every base image but scratch is pinned; the stage the root filesystem comes from is
    # chosen by ROOTFS: the build stage (`docker build .`), or `prebuilt`, which scripts/image
    # uses where no base image can be pulled (tests/node runs that image).
    bases = [image for image, _ in stages[:-1] if image != "scratch" and not image.startswith("${")]
    assert bases, "a build stage"
    for image in bases:
        assert re.search(r":\d+\.\d+\.\d+-", image), f"{image} is not pinned to a version"
    assert re.search(r"^ARG ROOTFS=build$", text, re.M)
    assert ("${ROOTFS}", "rootfs") in stages and ("scratch", "prebuilt") in stages
    final_image = stages[-1][0]
    assert final_image == "scratch"
    final = text[text.rindex("\nFROM "):]
    copies = re.findall(r"^COPY --from=(\S+)(?: --chown=(\S+))? (\S+) (\S+)$", final, re.M)
    assert {stage for stage, _, _, _ in copies} == {"rootfs"}
    assert ("rootfs", "", "/rootfs/", "/") in copies
    # The embedded store's directory belongs to herald's user.
    assert ("rootfs", "65532:65532", "/rootfs/var/lib/", "/var/lib/") in copies
    assert re.search(r"^USER 65532:65532$", final, re.M)
    assert 'CMD ["run"]' in final
    assert 'ENTRYPOINT ["/usr/local/bin/herald"]' in final
    # Both ways lay the root filesystem out with one script: the binary, its libraries, the CA bundle.
    assert "image-rootfs target/release/herald /rootfs" in text
    script = (REPO / "scripts" / "image-rootfs").read_text()
    for path in ("/usr/local/bin/herald", "/etc/ssl/certs/ca-certificates.crt", "ldd", "nsswitch.conf"):
        assert path in script, path
    # The dependency layer: Cargo.toml and Cargo.lock are copied and built before src/.
    assert text.index("COPY Cargo.toml Cargo.lock") < text.index("cargo build") < text.index("COPY src ")


# ---- checkov on the rendered chart and the Dockerfile -----------------------------------

def checkov(*args):
    binary = os.environ.get("CHECKOV") or shutil.which("checkov") or str(REPO / ".venv-checkov" / "bin" / "checkov")
    env = dict(os.environ, BC_SKIP_MAPPING="TRUE", CHECKOV_RUN_SCA_PACKAGE_SCAN_V2="false")
    return run([binary, "--config-file", HERE / "checkov.yaml", *args], env=env, check=False, timeout=600)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rendered")
    (folder / "default.yaml").write_text(helm("template", "herald", CHART, "-n", "herald-system").stdout)
    (folder / "all-options.yaml").write_text(
        helm("template", "herald", CHART, "-n", "herald-system", "-f", ALL_OPTIONS).stdout)
    (folder / "scaled-out.yaml").write_text(
        helm("template", "herald", CHART, "-n", "herald-system", *SCALED).stdout)
    (folder / "all-options-scaled-out.yaml").write_text(
        helm("template", "herald", CHART, "-n", "herald-system", "-f", ALL_OPTIONS, "-f", SCALE_OUT).stdout)
    (folder / "config.yaml").write_text(
        run([bin_dir() / "kubectl", "kustomize", REPO / "config" / "default"], env=tool_env()).stdout)
    return folder


def test_checkov_passes_on_the_rendered_chart_and_config(rendered):
    proc = checkov("-d", rendered, "--framework", "kubernetes")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"Passed checks: [1-9]\d*, Failed checks: 0", proc.stdout), proc.stdout


def test_checkov_passes_on_the_dockerfile():
    proc = checkov("-f", REPO / "Dockerfile", "--framework", "dockerfile")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"Passed checks: [1-9]\d*, Failed checks: 0", proc.stdout), proc.stdout


def test_checkov_does_flag_a_careless_deployment(rendered, tmp_path):
    """checkov really runs its checks: a privileged, root container is refused."""
    objects = [d for d in yaml.safe_load_all((rendered / "default.yaml").read_text()) if d]
    deployment = find(objects, "Deployment", "herald")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["securityContext"] = {"privileged": True, "runAsUser": 0}
    (tmp_path / "careless.yaml").write_text(yaml.safe_dump(deployment))
    proc = checkov("-d", tmp_path, "--framework", "kubernetes")
    assert proc.returncode != 0
    assert "CKV_K8S_16" in proc.stdout  # Container should not be privileged


def test_aggregated_api_is_off_by_default():
    kinds = {o["kind"] for o in render()}
    assert "APIService" not in kinds


def test_aggregated_api_with_the_charts_own_certificate(tmp_path):
    """The APIService points at a Service of herald's pods whose certificate names it, and
    trusts the CA that signed it; herald serves it from the Secret and may read the API
    server's front-proxy settings; publishers may create delivery.herald.dev webhookevents."""
    objects = render("--set", "aggregatedApi.enabled=true")
    api_service = find(objects, "APIService", "v1alpha1.delivery.herald.dev")
    spec = api_service["spec"]
    assert spec["group"] == "delivery.herald.dev" and spec["version"] == "v1alpha1"
    assert spec["service"] == {"namespace": "herald-system", "name": "herald-api", "port": 443}
    assert "insecureSkipTLSVerify" not in spec
    service = find(objects, "Service", "herald-api")
    assert service["spec"]["selector"] == find(objects, "Deployment", "herald")["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"] == [{"name": "aggregated", "port": 443, "targetPort": "aggregated",
                                         "protocol": "TCP", "appProtocol": "https"}]
    secret = find(objects, "Secret", "herald-api-tls")
    assert secret["data"]["ca.crt"] == spec["caBundle"]
    (tmp_path / "ca.crt").write_bytes(base64.b64decode(secret["data"]["ca.crt"]))
    (tmp_path / "tls.crt").write_bytes(base64.b64decode(secret["data"]["tls.crt"]))
    verified = run(["openssl", "verify", "-CAfile", str(tmp_path / "ca.crt"), str(tmp_path / "tls.crt")])
    assert "OK" in verified.stdout
    names = run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(tmp_path / "tls.crt")])
    assert "DNS:herald-api.herald-system.svc" in names.stdout

    pod = find(objects, "Deployment", "herald")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = env_of(container)
    mount = next(m for m in container["volumeMounts"] if m["name"] == "api-tls")
    assert env["HERALD_AGGREGATED_LISTEN"] == "0.0.0.0:8443"
    assert env["HERALD_AGGREGATED_TLS_CERT_FILE"] == mount["mountPath"] + "/tls.crt"
    assert env["HERALD_AGGREGATED_TLS_KEY_FILE"] == mount["mountPath"] + "/tls.key"
    assert {"name": "aggregated", "containerPort": 8443, "protocol": "TCP"} in container["ports"]
    volume = next(v for v in pod["volumes"] if v["name"] == "api-tls")
    assert volume["secret"] == {"secretName": "herald-api-tls", "defaultMode": 0o440}
    policy = find(objects, "NetworkPolicy", "herald")
    assert {"ports": [{"port": "aggregated", "protocol": "TCP"}]} in policy["spec"]["ingress"]

    bindings = {(o["kind"], o["metadata"].get("namespace"), o["roleRef"]["name"])
                for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")
                and {"kind": "ServiceAccount", "name": "herald", "namespace": "herald-system"} in o["subjects"]}
    assert ("RoleBinding", "kube-system", "extension-apiserver-authentication-reader") in bindings
    assert ("ClusterRoleBinding", None, "system:auth-delegator") in bindings
    publisher = find(objects, "ClusterRole", "herald-publisher")
    assert ("delivery.herald.dev", "webhookevents", "create") in triples(publisher["rules"])


def test_aggregated_api_with_cert_manager():
    objects = render("--set", "aggregatedApi.enabled=true", "--set", "aggregatedApi.certManager.enabled=true",
                     "--set", "aggregatedApi.certManager.issuerRef.name=internal-ca")
    certificate = find(objects, "Certificate", "herald-api")
    assert certificate["spec"]["dnsNames"] == ["herald-api.herald-system.svc"]
    assert certificate["spec"]["secretName"] == "herald-api-tls"
    api_service = find(objects, "APIService", "v1alpha1.delivery.herald.dev")
    assert api_service["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from": "herald-system/herald-api"}
    assert "caBundle" not in api_service["spec"]
    assert "Secret" not in {o["kind"] for o in objects}
