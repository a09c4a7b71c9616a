"""The chart installed for real: herald's Pod on the node under the restricted Pod Security
Standard, its claim bound, Ready through its own probes; a tenant's subscription Ready; a
producer Pod publishing with its projected token; signatures checked by standardwebhooks."""

import json
import time

import yaml

from conftest import NS, RESTRICTED, TENANT, producer_pod, producer_results, ready_pods, report, wait_until


def test_image_is_herald_built_here_and_small(images):
    # Only the binary, four glibc libraries and the CA bundle (scripts/image-rootfs).
    assert images["size"] < 64 * 1024 * 1024, images


def test_pod_is_ready_under_restricted_pod_security(cluster, release):
    labels = cluster.get_json("namespace", NS)["metadata"]["labels"]
    for key, value in RESTRICTED.items():
        assert labels.get(key) == value
    (pod,) = ready_pods(cluster)
    spec = pod["spec"]
    assert spec["nodeName"] == cluster.node_name
    (container,) = spec["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert spec["securityContext"]["runAsUser"] == 65532
    (status,) = pod["status"]["containerStatuses"]
    assert status["ready"] and status["restartCount"] == 0, status
    assert status["image"].endswith("herald:0.1.0"), status["image"]
    # The embedded store's claim is bound to one of the node's local volumes.
    pvc = cluster.get_json("pvc", "herald-data", "-n", NS)
    assert pvc["status"]["phase"] == "Bound", pvc["status"]
    pv = cluster.get_json("pv", pvc["spec"]["volumeName"])
    assert pv["spec"]["storageClassName"] == "local" and "local" in pv["spec"]
    # On the node, herald's process runs as 65532:65532 (containerd's task for the container).
    container_id = status["containerID"].split("://", 1)[1]
    tasks = {line.split()[0]: line.split()[1]
             for line in cluster.ctr("tasks", "ls").stdout.splitlines()[1:] if line.strip()}
    proc_status = open(f"/proc/{tasks[container_id]}/status").read()
    ids = {line.split(":")[0]: line.split()[1:] for line in proc_status.splitlines()
           if line.startswith(("Uid:", "Gid:"))}
    assert ids == {"Uid": ["65532"] * 4, "Gid": ["65532"] * 4}, ids
    # No shell in the image: `kubectl exec` of herald itself (API server, kubelet, containerd).
    version = cluster.kubectl("exec", "-n", NS, pod["metadata"]["name"], "--", "/usr/local/bin/herald",
                              "--version", check=False)
    assert version.returncode == 0 and "herald" in version.stdout, version.stdout + version.stderr


def test_logs_show_the_start_line(cluster, release):
    (pod,) = ready_pods(cluster)
    logs = cluster.logs(NS, pod["metadata"]["name"])
    assert "herald is serving (cluster mode)" in logs, logs[-3000:]


def test_producer_pod_publishes_and_the_receiver_verifies_every_signature(cluster, images, shop):
    receiver = shop["receiver"]
    count = 30
    started = time.monotonic()
    cluster.apply(producer_pod("producer-first", TENANT, images["producer"], shop["ingest"],
                               prefix="first", rate=30, count=count))
    result = producer_results(cluster, TENANT, "producer-first")
    assert result["published"] == count and len(result["acked"]) == count, result["log"][-2000:]
    arrived = wait_until(f"{count} events at the receiver",
                         lambda: (ids := receiver.ids("first-")) and len(set(ids)) == count and ids,
                         timeout=60)
    elapsed = time.monotonic() - started
    assert set(arrived) == set(result["acked"])
    assert not receiver.bad, receiver.bad[:5]
    report(f"first publish: published {count}, acknowledged {len(result['acked'])}, arrived "
           f"{len(set(arrived))} (signatures verified by standardwebhooks), duplicates "
           f"{len(arrived) - len(set(arrived))}, {elapsed:.1f}s from producer Pod creation")


def test_token_meant_for_the_api_server_is_refused(cluster, images, shop):
    cluster.apply(producer_pod("producer-wrong-audience", TENANT, images["producer"], shop["ingest"],
                               prefix="wrong", count=1, token="api-server", retry_seconds=0))
    result = producer_results(cluster, TENANT, "producer-wrong-audience")
    assert result["acked"] == [] and len(result["gaveup"]) == 1, result["log"]
    assert " 401 " in result["gaveup"][0], result["gaveup"]
    assert shop["receiver"].ids("wrong-") == []


def test_kubectl_create_publishes_through_the_chart_s_aggregated_api(cluster, shop):
    """The chart's APIService, Service and serving certificate: the API server proxies
    delivery.herald.dev to herald's Pod, so a producer bound to herald-publisher publishes
    with `kubectl create` (impersonated here by the admin), and one without it is refused
    by the API server before herald hears of it."""
    def available():
        api_service = cluster.get_json("apiservice", "v1alpha1.delivery.herald.dev")
        conditions = {c["type"]: c for c in api_service.get("status", {}).get("conditions", [])}
        return conditions.get("Available", {}).get("status") == "True" or AssertionError(conditions)
    wait_until("the APIService Available", available, timeout=120)
    event = yaml.safe_dump({"apiVersion": "delivery.herald.dev/v1alpha1", "kind": "WebhookEvent",
                            "metadata": {"name": "aggregated-1", "namespace": TENANT},
                            "spec": {"type": "order.created", "data": {"order": 1}}})
    created = cluster.kubectl("create", "-f", "-", "-o", "json", "--as=system:serviceaccount:shop:producer",
                              input=event)
    assert json.loads(created.stdout)["status"] == {"matched": 1}
    wait_until("the event at the receiver", lambda: shop["receiver"].ids("aggregated-") == ["aggregated-1"],
               timeout=60)
    refused = cluster.kubectl("create", "-f", "-", "--as=bob", input=event.replace("aggregated-1", "aggregated-2"),
                              check=False)
    assert refused.returncode != 0 and "Forbidden" in refused.stderr, refused.stderr
    assert shop["receiver"].ids("aggregated-") == ["aggregated-1"]
