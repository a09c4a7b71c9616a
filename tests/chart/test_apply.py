"""The real API server accepts every object the chart and config/ make (server-side dry
run), and herald's pod passes the "restricted" Pod Security Standard where it is enforced."""

import copy

import pytest
import yaml

from conftest import ALL_OPTIONS, REPO, SCALE_OUT, find, render, render_text

RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/warn": "restricted",
}

def stand_in_crd(group, plural, kind):
    """A CustomResourceDefinition that accepts any object of `kind`, for a third party's
    resource the chart renders without that third party being installed here."""
    return f"""\
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: {plural}.{group}
spec:
  group: {group}
  scope: Namespaced
  names: {{plural: {plural}, singular: {kind.lower()}, kind: {kind}}}
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          x-kubernetes-preserve-unknown-fields: true
"""


# prometheus-operator's ServiceMonitor, and cert-manager's Certificate: cert-manager is not
# installed here, so its Certificate is checked for shape in test_static.py and accepted as
# an object here.
STAND_INS = [("monitoring.coreos.com", "servicemonitors", "ServiceMonitor"),
             ("cert-manager.io", "certificates", "Certificate")]


@pytest.fixture(scope="module")
def cluster(cp):
    # Every namespace the renders use, with the restricted standard enforced.
    for namespace in ("herald-system", "team-a", "team-b"):
        cp.create_namespace(namespace, RESTRICTED)
    for group, plural, kind in STAND_INS:
        cp.apply(stand_in_crd(group, plural, kind))
        cp.kubectl("wait", "--for=condition=Established", f"crd/{plural}.{group}",
                   "--timeout=60s")
    return cp


def dry_run(cp, text, *args):
    proc = cp.kubectl("apply", "--dry-run=server", "-f", "-", *args, input=text, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PodSecurity" not in proc.stderr, proc.stderr
    return proc.stdout


def pod_of(cp, deployment, namespace="herald-system"):
    """The Deployment's pod as a Pod: PodSecurity enforces on Pods, not on Deployments.
    Its ServiceAccount is created for real (admission looks it up)."""
    template = copy.deepcopy(deployment["spec"]["template"])
    cp.apply({"apiVersion": "v1", "kind": "ServiceAccount",
              "metadata": {"name": template["spec"]["serviceAccountName"], "namespace": namespace}})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "herald-pod-check", "namespace": namespace,
                     "labels": template["metadata"]["labels"]},
        "spec": template["spec"],
    }


# The renders checked: defaults, every option on the embedded store, and every option with
# several replicas on PostgreSQL.
RENDERS = pytest.mark.parametrize(
    "values", [[], ["-f", ALL_OPTIONS], ["-f", ALL_OPTIONS, "-f", SCALE_OUT]],
    ids=["default", "all-options", "all-options-scaled-out"])


@RENDERS
def test_server_accepts_every_rendered_object(cluster, values):
    text = render_text(*values)
    out = dry_run(cluster, text)
    kinds = {o["kind"] for o in yaml.safe_load_all(text) if o}
    assert out.count("(server dry run)") == len([o for o in yaml.safe_load_all(text) if o])
    assert {"Deployment", "ClusterRole", "Service"} <= kinds
    if SCALE_OUT in values:
        assert {"Role", "RoleBinding", "PodDisruptionBudget"} <= kinds
        assert "PersistentVolumeClaim" not in kinds
    else:
        assert "PersistentVolumeClaim" in kinds


@RENDERS
def test_herald_pod_passes_the_restricted_standard(cluster, values):
    deployment = find(render(*values), "Deployment")
    out = dry_run(cluster, yaml.safe_dump(pod_of(cluster, deployment)))
    assert "pod/herald-pod-check created (server dry run)" in out


def test_the_restricted_standard_is_really_enforced_here(cluster):
    """A pod that escalates privileges and runs as root is refused in the same namespace,
    so the acceptance above means something."""
    deployment = find(render(), "Deployment")
    pod = pod_of(cluster, deployment)
    pod["spec"]["securityContext"] = {}
    pod["spec"]["containers"][0]["securityContext"] = {"allowPrivilegeEscalation": True}
    proc = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(pod), check=False)
    assert proc.returncode != 0
    assert 'violates PodSecurity "restricted:latest"' in proc.stderr


def test_kustomize_config_default_is_accepted(cluster):
    proc = cluster.kubectl("apply", "-k", REPO / "config" / "default", "--dry-run=server", check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PodSecurity" not in proc.stderr, proc.stderr
    for name in ("deployment.apps/herald", "clusterrole.rbac.authorization.k8s.io/herald-publisher",
                 "customresourcedefinition.apiextensions.k8s.io/webhooksubscriptions.herald.dev",
                 "persistentvolumeclaim/herald-data", "service/herald"):
        assert name in proc.stdout, proc.stdout
    config = [d for d in yaml.safe_load_all(cluster.kubectl("kustomize", REPO / "config" / "default").stdout) if d]
    out = dry_run(cluster, yaml.safe_dump(pod_of(cluster, find(config, "Deployment", "herald"))))
    assert "created (server dry run)" in out
