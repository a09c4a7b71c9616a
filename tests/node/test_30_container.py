"""What the image needs from its surroundings, shown from inside the container on the node:
a host name resolved by the pod's DNS server (glibc's resolver in the image), TLS to a
receiver whose certificate a private CA issued (the CA bundle and --egress-ca-file), and the
PostgreSQL store on this host. herald runs in standalone mode in a bare Pod (restricted,
read-only root filesystem), configured from ConfigMaps."""

import json
import subprocess
import urllib.request

import pytest
import yaml

from conftest import RESTRICTED, SECRET, Receiver, ready, report, run, wait_until

NAMESPACE = "image-check"


def certificates(directory):
    """A private CA and a server certificate for host.herald.test (the pods' DNS server's
    name for this host)."""
    ca_key, ca_crt = directory / "ca.key", directory / "ca.crt"
    key, csr, crt, ext = (directory / n for n in ("tls.key", "tls.csr", "tls.crt", "tls.ext"))
    run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", ca_key, "-out", ca_crt, "-days", "1", "-subj", "/CN=herald node test CA",
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign"])
    run(["openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", key, "-out", csr, "-subj", "/CN=host.herald.test"])
    ext.write_text("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                   "extendedKeyUsage=serverAuth\nsubjectAltName=DNS:host.herald.test\n")
    run(["openssl", "x509", "-req", "-in", csr, "-CA", ca_crt, "-CAkey", ca_key, "-CAcreateserial",
         "-days", "1", "-extfile", ext, "-out", crt])
    return ca_crt, crt, key


def test_dns_tls_and_postgres_from_inside_the_container(cluster, images, postgres, tmp_path):
    ca, crt, key = certificates(tmp_path)
    receiver = Receiver(cluster.node_ip, tls=(str(crt), str(key)))
    try:
        cluster.namespace(NAMESPACE, RESTRICTED)
        config = yaml.safe_dump_all([
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "signing", "namespace": "demo"},
             "type": "Opaque", "stringData": {"secret": SECRET}},
            {"apiVersion": "herald.dev/v1alpha1", "kind": "WebhookSubscription",
             "metadata": {"name": "tls", "namespace": "demo"},
             "spec": {"url": f"https://host.herald.test:{receiver.port}/tls", "eventTypes": ["order.*"],
                      "signing": {"scheme": "standard-webhooks",
                                  "secretRef": {"name": "signing", "key": "secret"}}}},
        ])
        cluster.apply([
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "config", "namespace": NAMESPACE},
             "data": {"subscription.yaml": config}},
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "receiver-ca", "namespace": NAMESPACE},
             "data": {"ca.crt": ca.read_text()}},
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "env", "namespace": NAMESPACE},
             "type": "Opaque", "stringData": {"HERALD_STORE": postgres, "HERALD_PUBLISH_TOKEN": "pub-token"}},
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "standalone", "namespace": NAMESPACE},
             "spec": {
                 "automountServiceAccountToken": False,
                 "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                 "containers": [{
                     "name": "herald", "image": images["herald"], "imagePullPolicy": "Never",
                     "args": ["run", "--standalone", "--config", "/config"],
                     "envFrom": [{"secretRef": {"name": "env"}}],
                     "env": [{"name": "HERALD_EGRESS_ALLOW", "value": f"{cluster.node_ip}/32"},
                             {"name": "HERALD_EGRESS_CA_FILE", "value": "/etc/herald/receiver-ca/ca.crt"}],
                     "readinessProbe": {"httpGet": {"path": "/readyz", "port": 9090}, "periodSeconds": 1},
                     "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                         "capabilities": {"drop": ["ALL"]}},
                     "volumeMounts": [{"name": "config", "mountPath": "/config", "readOnly": True},
                                      {"name": "ca", "mountPath": "/etc/herald/receiver-ca", "readOnly": True},
                                      {"name": "tmp", "mountPath": "/tmp"}],
                 }],
                 "volumes": [{"name": "config", "configMap": {"name": "config"}},
                             {"name": "ca", "configMap": {"name": "receiver-ca"}},
                             {"name": "tmp", "emptyDir": {}}],
             }},
        ])
        pod = wait_until("the standalone Pod Ready",
                         lambda: (p := cluster.get_json("pod", "standalone", "-n", NAMESPACE)) and ready(p) and p,
                         timeout=120)
        logs = cluster.logs(NAMESPACE, "standalone")
        assert "connecting to the PostgreSQL store" in logs, logs[-2000:]
        assert "receivers' certificates may also be issued by these CAs" in logs, logs[-2000:]
        # Publish from this host to the Pod's address.
        request = urllib.request.Request(
            f"http://{pod['status']['podIP']}:8080/v1/namespaces/demo/events",
            data=json.dumps({"id": "tls-1", "type": "order.created", "data": {"n": 1}}).encode(),
            headers={"Authorization": "Bearer pub-token", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status // 100 == 2
        wait_until("the event at the HTTPS receiver, verified", lambda: receiver.ids("tls-") == ["tls-1"],
                   timeout=60)
        assert not receiver.bad, receiver.bad
        report("inside the container: host.herald.test resolved by the pod's DNS server, HTTPS to a "
               "receiver with a private CA's certificate, the PostgreSQL store on the host: one event "
               "delivered and verified")
    finally:
        receiver.close()
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
