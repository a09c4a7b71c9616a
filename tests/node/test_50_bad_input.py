"""Bad input on the real node: herald's image on a read-only root filesystem without its
data volume, a data directory that cannot be made, an egress.allow value that is no CIDR,
and several replicas whose store Secret is missing. Each must fail with a message a person
can act on (in the Pod's status, its log or its Events), never a silent crash loop."""

import pytest

from conftest import CHART, NS, RESTRICTED, herald_values, ready, wait_until

NAMESPACE = "bad-input"


def bare_pod(name, image, env):
    """herald's image as the chart runs it (restricted, read-only root filesystem), but
    without the data volume."""
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "herald", "image": image, "imagePullPolicy": "Never",
                "args": ["run", "--standalone", "--config", "/nonexistent-config-is-not-reached"],
                "env": [{"name": k, "value": v} for k, v in env.items()],
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "readinessProbe": {"httpGet": {"path": "/readyz", "port": 9090}, "periodSeconds": 2},
                "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}},
            }],
        },
    }


def terminated_message(cluster, name, namespace=NAMESPACE):
    """The message of the container's last termination (exit code non-zero), once there."""
    pod = cluster.get_json("pod", name, "-n", namespace)
    assert not ready(pod)
    for status in pod["status"].get("containerStatuses", []):
        for state in (status.get("state", {}), status.get("lastState", {})):
            term = state.get("terminated")
            if term and term.get("exitCode", 0) != 0:
                return term.get("message") or AssertionError(f"no message: {term}")
    return None


@pytest.fixture(scope="module")
def bad_ns(cluster):
    cluster.namespace(NAMESPACE, RESTRICTED)
    cluster.namespace(NS, RESTRICTED)
    yield NAMESPACE
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


@pytest.mark.parametrize("case,env,expect", [
    # The image's /var/lib/herald on the read-only root filesystem (the image declares no
    # VOLUME, so the runtime makes none): nothing can be written.
    ("readonly-root", {}, "the data directory /var/lib/herald is not writable"),
    # A data directory that does not exist and cannot be made.
    ("missing-dir", {"HERALD_DATA_DIR": "/nonexistent/herald"},
     "the data directory /nonexistent/herald cannot be created"),
])
def test_data_directory_that_cannot_be_written_is_a_clear_error(cluster, images, bad_ns, case, env, expect):
    name = f"herald-{case}"
    cluster.apply(bare_pod(name, images["herald"], env))
    message = wait_until(f"{name}'s termination message", lambda: terminated_message(cluster, name), timeout=120)
    assert expect in message and "Read-only file system" in message and "--data-dir" in message, message
    pod = cluster.get_json("pod", name, "-n", NAMESPACE)
    assert not ready(pod)
    cluster.kubectl("delete", "pod", name, "-n", NAMESPACE, "--wait=false")


def test_egress_allow_that_is_no_cidr_is_refused(cluster, bad_ns, tmp_path):
    # The values schema refuses what is not shaped like a CIDR...
    values = herald_values(cluster, tmp_path / "bad.yaml")
    values.write_text("egress:\n  allow: [\"10.88.0.1\"]\n")
    proc = cluster.helm("install", "herald", CHART, "--namespace", NS, "-f", values, check=False)
    assert proc.returncode != 0 and "egress" in proc.stderr and "allow" in proc.stderr, proc.stderr
    assert not cluster.exists("deployment", "herald", "-n", NS)


def test_egress_allow_shaped_like_a_cidr_but_invalid_is_reported_by_the_pod(cluster, images, bad_ns, tmp_path):
    # ...and herald refuses, in its log and the Pod's status, what is shaped like one but is not.
    values = tmp_path / "bad.yaml"
    values.write_text("egress:\n  allow: [\"10.88.0.300/32\"]\n")
    cluster.helm("install", "herald", CHART, "--namespace", NS, "-f", values)
    try:
        def message():
            pods = cluster.pods(NS)
            return pods and terminated_message(cluster, pods[0]["metadata"]["name"], NS)
        text = wait_until("herald's termination message", message, timeout=180)
        assert "10.88.0.300/32" in text, text
    finally:
        cluster.helm("uninstall", "herald", "--namespace", NS, "--wait", check=False, timeout=180)


def test_replicas_with_a_missing_store_secret_say_so_in_their_events(cluster, images, bad_ns, tmp_path):
    values = herald_values(cluster, tmp_path / "missing.yaml", replicaCount=2,
                           store={"postgres": {"existingSecret": "no-such-store-secret"}})
    cluster.helm("install", "herald", CHART, "--namespace", NS, "-f", values)
    try:
        def events():
            pods = cluster.pods(NS)
            found = [e for p in pods for e in cluster.events(NS, p["metadata"]["name"])
                     if 'secret "no-such-store-secret" not found' in e]
            return found
        found = wait_until("an Event naming the missing Secret", events, timeout=180)
        assert found
        assert all(not ready(p) for p in cluster.pods(NS))
    finally:
        cluster.helm("uninstall", "herald", "--namespace", NS, "--wait", check=False, timeout=180)
