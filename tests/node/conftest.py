"""herald as users run it: its own image, in Pods on a real node (kubelet, containerd, runc,
CNI bridge, kube-proxy), installed by its own chart.

One cluster with one node serves every test here (`scripts/control-plane up --node`, torn
down at the end of the session, failing or not). Nothing is pulled: the pause image, herald's
image (the repository's Dockerfile, built by scripts/image with buildah) and the producer's
image are built on this machine and imported into the node's containerd.

Receivers run on this host, on the node's bridge address (the pods reach it directly; the
pods' DNS server answers `host.herald.test` with it), and check every signature with the
`standardwebhooks` package from PyPI."""

import base64
import hashlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from standardwebhooks.webhooks import Webhook

# run and wait_until are shared with the other Python suites (tests/support/commands.py);
# the test modules import them from here.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from commands import run, wait_until  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CHART = REPO / "charts" / "herald"
SCRIPT = REPO / "scripts" / "control-plane"
SECRET = "whsec_" + base64.b64encode(bytes(range(24))).decode()
CACHE = Path(os.environ.get("HERALD_CACHE_DIR", Path.home() / ".cache" / "herald"))

# The restricted Pod Security Standard, enforced (and warned about) in every namespace here.
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/warn": "restricted"}


def _terminated(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


# SIGTERM (the test command stopping early, a CI time-out) unwinds like Ctrl-C, so that the
# node is torn down (its processes, pods, mounts, network) by the fixtures' finalizers.
signal.signal(signal.SIGTERM, _terminated)


def report(line):
    """A figure for the closing note: printed (pytest -s or the captured output of a
    failure) and appended to $HERALD_NODE_REPORT when set."""
    print(f"[node] {line}", flush=True)
    path = os.environ.get("HERALD_NODE_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


class Cluster:
    def __init__(self, directory, exports):
        self.dir = Path(directory)
        env = dict(os.environ)
        out = run(["bash", "-c", exports + '\nenv -0'], env=env).stdout
        for item in out.split("\0"):
            if "=" in item:
                k, v = item.split("=", 1)
                env[k] = v
        self.env = env
        self.node_ip = env["HERALD_NODE_IP"]
        self.node_name = env["HERALD_NODE_NAME"]

    def kubectl(self, *args, check=True, input=None, timeout=120):
        return run(["kubectl", *args], env=self.env, check=check, input=input, timeout=timeout)

    def helm(self, *args, check=True, timeout=300):
        return run(["helm", *args], env=self.env, check=check, timeout=timeout)

    def ctr(self, *args, check=True, timeout=300):
        return run(["ctr", *args], env=self.env, check=check, timeout=timeout)

    def apply(self, manifest, *args, check=True):
        text = manifest if isinstance(manifest, str) else yaml.safe_dump_all(
            manifest if isinstance(manifest, list) else [manifest])
        return self.kubectl("apply", "-f", "-", *args, input=text, check=check)

    def get_json(self, *args, check=True):
        proc = self.kubectl("get", *args, "-o", "json", check=check)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def exists(self, *args):
        return self.kubectl("get", *args, "--ignore-not-found", "-o", "name").stdout.strip() != ""

    def namespace(self, name, labels=None):
        self.apply({"apiVersion": "v1", "kind": "Namespace",
                    "metadata": {"name": name, "labels": labels or {}}})
        wait_until(f"namespace {name} ready",
                   lambda: self.exists("serviceaccount", "default", "-n", name))

    def pods(self, namespace, selector="app.kubernetes.io/name=herald"):
        return self.get_json("pods", "-n", namespace, "-l", selector)["items"]

    def logs(self, namespace, pod, *args, check=True):
        return self.kubectl("logs", "-n", namespace, pod, *args, check=check).stdout

    def events(self, namespace, name):
        items = self.get_json("events", "-n", namespace,
                              "--field-selector", f"involvedObject.name={name}")["items"]
        return [f"{e.get('reason')}: {e.get('message')}" for e in items]


def ready(pod):
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in pod.get("status", {}).get("conditions", []))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A control plane with one node; down at the end, failing or not."""
    if os.geteuid() != 0:
        pytest.fail("the node tests need root (containerd, kubelet, network namespaces)")
    directory = tmp_path_factory.mktemp("node") / "plane"
    started = time.monotonic()
    try:
        proc = run([SCRIPT, "up", "--dir", directory, "--node"], timeout=3600)
        c = Cluster(directory, proc.stdout)
        report(f"control plane and node up in {time.monotonic() - started:.1f}s")
        yield c
    finally:
        run([SCRIPT, "down", "--dir", directory], check=False, timeout=300)


def build_small_image(cluster, name, program_dir, tag):
    """A static Go program in a FROM-scratch image (its Containerfile), cached by the
    sources' digest, imported into the node."""
    digest = hashlib.sha256()
    for f in sorted(program_dir.iterdir()):
        digest.update(f.name.encode() + f.read_bytes())
    out = CACHE / "node-test" / f"{name}-{digest.hexdigest()[:16]}.tar"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        work = out.parent / f".{name}-build"
        shutil.rmtree(work, ignore_errors=True)
        (work / "ctx").mkdir(parents=True)
        go = shutil.which("go") or "/usr/local/go/bin/go"
        proc = subprocess.run(
            ["flock", "/tmp/herald-cpu.lock", "env", "CGO_ENABLED=0", "GOFLAGS=-buildvcs=false",
             "GOTOOLCHAIN=local", go, "build", "-trimpath", "-ldflags", "-s -w", "-o",
             str(work / "ctx" / name), "."], cwd=program_dir, capture_output=True, text=True,
            timeout=900)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        shutil.copy(program_dir / "Containerfile", work / "ctx" / "Containerfile")
        b = ["buildah", "--root", work / "storage" / "root", "--runroot", work / "storage" / "run",
             "--storage-driver", "vfs"]
        run([*b, "bud", "--quiet", "--isolation", "chroot", "-t", tag, work / "ctx"], timeout=600)
        run([*b, "push", "--quiet", tag, f"docker-archive:{out}.tmp:{tag}"], timeout=600)
        run([*b, "rmi", "--all"], check=False)
        shutil.rmtree(work, ignore_errors=True)
        os.replace(f"{out}.tmp", out)
    cluster.ctr("images", "import", out)
    return tag


@pytest.fixture(scope="session")
def images(cluster):
    """herald's image (scripts/image: the Dockerfile, built here) and the producer's,
    imported into the node's containerd."""
    started = time.monotonic()
    out = run([REPO / "scripts" / "image"], timeout=3600).stdout
    built = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    cluster.ctr("images", "import", built["tar"])
    size = int(built["size"])
    report(f"herald image {built['image']}: {size} bytes ({size / 1048576:.1f} MiB) uncompressed, "
           f"built and imported in {time.monotonic() - started:.1f}s")
    listed = cluster.ctr("images", "ls", "-q").stdout.split()
    assert f"docker.io/library/{built['image']}" in listed, listed
    producer = build_small_image(cluster, "producer", HERE / "producer",
                                 "herald.test/producer:1")
    return {"herald": built["image"], "size": size, "producer": producer}


class ReceiverServer(ThreadingHTTPServer):
    """A receiver's server: a peer that resets a connection (a replica killed with an
    attempt on the wire) is part of the test, not an error to print."""
    daemon_threads = True

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class ControlHandler(BaseHTTPRequestHandler):
    """A receiver's requests: HTTP/1.1, not logged; GET answers the receiver's `control`
    ("go" or "stop") for producers. `receiver` is set on the subclass."""
    protocol_version = "HTTP/1.1"
    receiver = None

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = self.receiver.control.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Receiver:
    """A webhook receiver on the node's bridge address: verifies every request with the
    standardwebhooks package, answers 204 (or 401 when the signature fails), records each
    delivery. Also serves GET /control ("go" or "stop") for producers."""

    def __init__(self, host, secret=SECRET, delay=0.0, tls=None):
        self.verifier = Webhook(secret)
        self.lock = threading.Lock()
        self.deliveries = []   # (event id, verified, type, arrival on the monotonic clock, path)
        self.bad = []
        self.in_flight = {}    # event id -> requests being answered now
        self.overlaps = []     # ids delivered again while an earlier attempt was on the wire
        self.control = "go"
        self.delay = delay
        receiver = self

        class Handler(ControlHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                headers = {k.lower(): v for k, v in self.headers.items()}
                event_id = headers.get("webhook-id", "")
                with receiver.lock:
                    if receiver.in_flight.get(event_id):
                        receiver.overlaps.append(event_id)
                    receiver.in_flight[event_id] = receiver.in_flight.get(event_id, 0) + 1
                try:
                    if receiver.delay:
                        time.sleep(receiver.delay)
                    try:
                        payload = receiver.verifier.verify(body, headers)
                        ok = True
                    except Exception as e:  # the verifier's own WebhookVerificationError
                        payload, ok = None, False
                        with receiver.lock:
                            receiver.bad.append((event_id, repr(e)))
                    with receiver.lock:
                        receiver.deliveries.append((event_id, ok, (payload or {}).get("type"),
                                                    time.monotonic(), self.path))
                    self.send_response(204 if ok else 401)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                finally:
                    with receiver.lock:
                        receiver.in_flight[event_id] -= 1

        Handler.receiver = self
        self.server = ReceiverServer((host, 0), Handler)
        if tls:
            # HTTPS with the certificate and key files tls names.
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def ids(self, prefix=""):
        with self.lock:
            return [d[0] for d in self.deliveries if d[1] and d[0].startswith(prefix)]

    def arrivals(self, prefix="", path=None):
        """Arrival times of verified deliveries whose id starts with prefix (and, given a
        path, that were sent to it)."""
        with self.lock:
            return [d[3] for d in self.deliveries
                    if d[1] and d[0].startswith(prefix) and path in (None, d[4])]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver(cluster):
    r = Receiver(cluster.node_ip)
    yield r
    r.close()


def producer_pod(name, namespace, image, ingest_url, prefix, rate=20, count=50,
                 control_url="", token="herald", retry_seconds=120):
    """A producer Pod as a tenant would run it: the ServiceAccount `producer` (bound to
    herald-publisher), its token projected by kubelet with audience `herald` (or, with
    token="api-server", the ServiceAccount's ordinary token, meant for the API server)."""
    token_file = "/var/run/secrets/herald/token"
    volumes, mounts = [], []
    if token == "herald":
        volumes = [{"name": "herald-token", "projected": {"sources": [{"serviceAccountToken": {
            "audience": "herald", "expirationSeconds": 3600, "path": "token"}}]}}]
        mounts = [{"name": "herald-token", "mountPath": "/var/run/secrets/herald", "readOnly": True}]
    else:
        token_file = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": "producer"}},
        "spec": {
            "serviceAccountName": "producer",
            "automountServiceAccountToken": token != "herald",
            "restartPolicy": "Never",
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65532,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "producer", "image": image, "imagePullPolicy": "Never",
                "env": [{"name": k, "value": str(v)} for k, v in {
                    "INGEST_URL": ingest_url, "NAMESPACE": namespace, "TOKEN_FILE": token_file,
                    "PREFIX": prefix, "RATE": rate, "MAX": count, "CONTROL_URL": control_url,
                    "RETRY_SECONDS": retry_seconds, "EVENT_TYPE": "order.created"}.items()],
                "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": mounts,
            }],
            "volumes": volumes,
        },
    }


def producer_results(cluster, namespace, name, timeout=300):
    """Waits for the producer Pod to finish; its acknowledged ids and summary."""
    def finished():
        pod = cluster.get_json("pod", name, "-n", namespace)
        phase = pod["status"].get("phase")
        return phase if phase in ("Succeeded", "Failed") else None
    phase = wait_until(f"producer {name} to finish", finished, timeout=timeout, interval=0.5)
    out = cluster.logs(namespace, name)
    assert phase == "Succeeded", out[-2000:]
    lines = out.splitlines()
    acked = [l.split()[1] for l in lines if l.startswith("ack ")]
    retries = [l for l in lines if l.startswith("retry ")]
    gaveup = [l for l in lines if l.startswith("gaveup ")]
    done = [l for l in lines if l.startswith("done ")]
    assert done, out[-2000:]
    summary = dict(kv.split("=") for kv in done[-1].split()[1:])
    return {"acked": acked, "retries": retries, "gaveup": gaveup,
            "published": int(summary["published"]), "log": out}


def tenant(cluster, namespace, receiver_port, name="orders", path="/hooks/orders"):
    """A tenant namespace (restricted), its subscription to the host receiver (by name,
    resolved by the pods' DNS server) and its producer ServiceAccount bound to
    herald-publisher."""
    if not cluster.exists("namespace", namespace):
        cluster.namespace(namespace, RESTRICTED)
    cluster.apply([
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{name}-secret", "namespace": namespace},
         "type": "Opaque", "stringData": {"secret": SECRET}},
        {"apiVersion": "herald.dev/v1alpha1", "kind": "WebhookSubscription",
         "metadata": {"name": name, "namespace": namespace},
         "spec": {"url": f"http://host.herald.test:{receiver_port}{path}",
                  "eventTypes": ["order.*"],
                  "signing": {"scheme": "standard-webhooks",
                              "secretRef": {"name": f"{name}-secret", "key": "secret"}},
                  "delivery": {"timeout": "5s", "maxInFlight": 8,
                               "retry": {"maxAttempts": 20, "initialBackoff": "200ms",
                                                          "maxBackoff": "2s"}}}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "producer", "namespace": namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "producer-publishes", "namespace": namespace},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "herald-publisher"},
         "subjects": [{"kind": "ServiceAccount", "name": "producer", "namespace": namespace}]},
    ])


NS = "herald-system"
TENANT = "shop"


def herald_values(cluster, path, **extra):
    """The chart's default values, but for egress.allow opening the host receivers'
    address (the bridge address is private, so the guard refuses it by default)."""
    values = {"egress": {"allow": [f"{cluster.node_ip}/32"]}, **extra}
    path.write_text(yaml.safe_dump(values))
    return path


def ready_pods(cluster, namespace=NS):
    pods = [p for p in cluster.pods(namespace) if not p["metadata"].get("deletionTimestamp")]
    return [p for p in pods if ready(p)]


@pytest.fixture(scope="session")
def release(cluster, images, tmp_path_factory):
    """`helm install` with default values (egress.allow and the aggregated API aside) into a namespace enforcing
    the restricted Pod Security Standard; waits until herald's Pod is Ready."""
    cluster.namespace(NS, RESTRICTED)
    # With the aggregated API: the API server proxies delivery.herald.dev to herald's Pod.
    values = herald_values(cluster, tmp_path_factory.mktemp("values") / "values.yaml",
                           aggregatedApi={"enabled": True})
    started = time.monotonic()
    cluster.helm("install", "herald", CHART, "--namespace", NS, "-f", values)
    pod = wait_until("herald's Pod Ready", lambda: (ready_pods(cluster) or [None])[0],
                     timeout=240)
    wall = time.monotonic() - started
    name = pod["metadata"]["name"]
    created = pod["metadata"]["creationTimestamp"]
    ready_at = next(c["lastTransitionTime"] for c in pod["status"]["conditions"] if c["type"] == "Ready")
    report(f"helm install to Pod Ready: {wall:.1f}s (Pod {name} created {created}, Ready {ready_at})")
    return {"values": values, "install_to_ready": wall}


def service_url(cluster, namespace=NS, name="herald"):
    svc = cluster.get_json("service", name, "-n", namespace)
    return f"http://{svc['spec']['clusterIP']}:{svc['spec']['ports'][0]['port']}"


def subscription_ready(cluster, namespace, name):
    obj = cluster.get_json("whsub", name, "-n", namespace)
    conditions = {c["type"]: c for c in obj.get("status", {}).get("conditions", [])}
    return conditions.get("Ready", {}).get("status") == "True"


@pytest.fixture(scope="session")
def shop(cluster, release):
    """The tenant `shop`: a receiver on this host, a subscription to it (Ready), a producer
    ServiceAccount bound to herald-publisher; producers publish through the chart's
    Service (its ClusterIP, routed by kube-proxy)."""
    receiver = Receiver(cluster.node_ip)
    tenant(cluster, TENANT, receiver.port)
    wait_until("subscription shop/orders Ready", lambda: subscription_ready(cluster, TENANT, "orders"),
               timeout=120)
    yield {"receiver": receiver, "ingest": service_url(cluster)}
    receiver.close()


def acknowledged_arrive(cluster, namespace, name, receiver, prefix, finish_timeout, arrive_timeout):
    """Once the producer Pod `name` has been told to stop: waits for it to finish and for
    every event it was told was accepted to arrive (none given up on). Returns its results,
    the acknowledged ids and the ids delivered (repeats included)."""
    result = producer_results(cluster, namespace, name, timeout=finish_timeout)
    acked = set(result["acked"])
    assert not result["gaveup"], result["gaveup"][:5]
    wait_until(f"{prefix}: every acknowledged event at the receiver",
               lambda: acked <= set(receiver.ids(f"{prefix}-")) or
               AssertionError(sorted(acked - set(receiver.ids(f"{prefix}-")))[:10]), timeout=arrive_timeout)
    return result, acked, receiver.ids(f"{prefix}-")


def steady_publishing(cluster, images, shop, prefix, action, rate=20):
    """Starts a producer at `rate` events/s, waits for arrivals, runs `action`, waits for
    arrivals after it, stops the producer and checks that every acknowledged event
    arrived. Returns the counts."""
    receiver = shop["receiver"]
    receiver.control = "go"
    name = f"producer-{prefix}"
    cluster.apply(producer_pod(name, TENANT, images["producer"], shop["ingest"], prefix=prefix,
                               rate=rate, count=100000,
                               control_url=f"http://{cluster.node_ip}:{receiver.port}/control"))
    wait_until(f"{prefix}: arrivals before", lambda: len(receiver.ids(f"{prefix}-")) >= 2 * rate,
               timeout=120)
    before = len(set(receiver.ids(f"{prefix}-")))
    action_started = time.monotonic()
    action()
    action_seconds = time.monotonic() - action_started
    wait_until(f"{prefix}: arrivals after", lambda: len(set(receiver.ids(f"{prefix}-"))) >= before + 2 * rate,
               timeout=180)
    receiver.control = "stop"
    result, acked, delivered = acknowledged_arrive(cluster, TENANT, name, receiver, prefix,
                                                   finish_timeout=240, arrive_timeout=120)
    arrivals = sorted(receiver.arrivals(f"{prefix}-"))
    gap = max((b - a for a, b in zip(arrivals, arrivals[1:])), default=0.0)
    counts = {"published": result["published"], "acknowledged": len(acked),
              "arrived": len(set(delivered)), "duplicates": len(delivered) - len(set(delivered)),
              "overlapping": len([i for i in receiver.overlaps if i.startswith(f"{prefix}-")]),
              "retries": len(result["retries"]), "gap": gap, "action_seconds": action_seconds,
              # Why the producer had to retry (herald restarting): each distinct reason once.
              "why": sorted({" ".join(r.split()[2:])[:160] for r in result["retries"]})[:4]}
    assert not receiver.bad, receiver.bad[:5]
    cluster.kubectl("delete", "pod", name, "-n", TENANT, "--wait=false")
    return counts


def describe(what, c):
    report(f"{what}: published {c['published']}, acknowledged {c['acknowledged']}, arrived "
           f"{c['arrived']}, duplicates {c['duplicates']} (while the first attempt was on the wire: "
           f"{c['overlapping']}), producer retries {c['retries']}, longest gap in arrivals "
           f"{c['gap']:.1f}s, the operation took {c['action_seconds']:.1f}s; retried for: "
           f"{'; '.join(c['why']) or 'nothing'}")


@pytest.fixture(scope="session")
def postgres_server(cluster, tmp_path_factory):
    """PostgreSQL on this host (scripts/postgres), listening on the node's bridge address
    and open to the pods' range (password login): its URL and its directory (for
    `scripts/postgres stop|start --dir` and the postmaster's PID)."""
    # Not under pytest's own temporary directory: its parents are private to root, and the
    # server runs as the postgres user.
    directory = Path(tempfile.mkdtemp(prefix="herald-node-pg-")) / "server"
    directory.parent.chmod(0o755)
    script = REPO / "scripts" / "postgres"
    try:
        url = run([script, "up", "--dir", directory, "--listen", cluster.node_ip,
                   "--allow", cluster.env["HERALD_NODE_POD_CIDR"]], timeout=180).stdout.strip()
        yield {"url": url, "dir": directory}
    finally:
        run([script, "down", "--dir", directory], check=False, timeout=120)
        shutil.rmtree(directory.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres(postgres_server):
    """The URL of PostgreSQL on this host (see postgres_server)."""
    return postgres_server["url"]


def store_secret(cluster, namespace, name, url):
    cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace},
                   "type": "Opaque", "stringData": {"url": url}})


def shard_holders(cluster, namespace=NS):
    """holder identity -> shards held, from herald's shard Leases."""
    holders = {}
    for lease in cluster.get_json("leases", "-n", namespace)["items"]:
        name = lease["metadata"]["name"]
        if name.startswith("herald-shard-"):
            holder = lease["spec"].get("holderIdentity") or ""
            holders.setdefault(holder, []).append(int(name.rsplit("-", 1)[1]))
    return holders


REPLICAS = 3


def fresh_release(cluster, values_path, replica_count, **values):
    """herald installed anew (any release before it, and every subscription, removed first)
    with `values`, the tenant `shop` subscribed to a receiver on this host. Yields what the
    tests need; uninstalls at the end."""
    cluster.namespace(NS, RESTRICTED)
    if cluster.exists("deployment", "herald", "-n", NS):
        cluster.kubectl("delete", "whsub", "--all", "-A", "--timeout=120s", timeout=150)
        cluster.helm("uninstall", "herald", "--namespace", NS, "--wait", timeout=180)
    herald_values(cluster, values_path, replicaCount=replica_count, **values)
    started = time.monotonic()
    cluster.helm("install", "herald", CHART, "--namespace", NS, "-f", values_path)
    wait_until(f"{replica_count} Ready replicas", lambda: len(ready_pods(cluster)) == replica_count,
               timeout=300)
    report(f"{replica_count} replica(s) Ready {time.monotonic() - started:.1f}s after helm install "
           f"({'PostgreSQL' if 'postgres' in values.get('store', {}) else 'embedded store'})")
    receiver = Receiver(cluster.node_ip)
    tenant(cluster, TENANT, receiver.port)
    wait_until("subscription Ready", lambda: subscription_ready(cluster, TENANT, "orders"), timeout=120)
    svc = cluster.get_json("service", "herald", "-n", NS)
    yield {"receiver": receiver, "ingest": f"http://{svc['spec']['clusterIP']}:8080",
           "replicas": replica_count}
    receiver.close()
    cluster.kubectl("delete", "whsub", "--all", "-n", TENANT, "--timeout=120s", timeout=150, check=False)
    cluster.helm("uninstall", "herald", "--namespace", NS, "--wait", timeout=180, check=False)


@pytest.fixture(scope="module")
def replicas(cluster, images, postgres, tmp_path_factory):
    """herald with REPLICAS replicas on PostgreSQL for the module using it (fresh_release)."""
    cluster.namespace(NS, RESTRICTED)
    store_secret(cluster, NS, "herald-store", postgres)
    yield from fresh_release(cluster, tmp_path_factory.mktemp("values") / "replicas.yaml", REPLICAS,
                             store={"postgres": {"existingSecret": "herald-store"}})


# The size of the embedded store's filesystem in `embedded`: room for a campaign's events
# (about 60 KB a second of it, twice that here) beside the chart's reserve
# (store.reserveBytes, 64 MiB), small enough to fill at once.
SMALL_VOLUME_MIB = 192 + int(float(os.environ.get("HERALD_CAMPAIGN_SECONDS", "75")) * 0.2)


@pytest.fixture(scope="module")
def embedded(cluster, images, tmp_path_factory):
    """One replica on the embedded store, as the chart installs it by default, but on a
    filesystem of its own: a tmpfs of SMALL_VOLUME_MIB mounted on this host (the node), the
    local PersistentVolume of a StorageClass `small`, so that a test can fill it. For the
    module using it (fresh_release); `volume` is the filesystem's path here."""
    volume = tmp_path_factory.mktemp("store-volume")
    run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_VOLUME_MIB}m,mode=0777", "tmpfs", str(volume)])
    try:
        cluster.apply([
            {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "small"},
             "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "WaitForFirstConsumer",
             "reclaimPolicy": "Retain"},
            {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "herald-small-store"},
             "spec": {"capacity": {"storage": f"{SMALL_VOLUME_MIB}Mi"}, "accessModes": ["ReadWriteOnce"],
                      "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "small",
                      "volumeMode": "Filesystem", "local": {"path": str(volume)},
                      "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                          {"key": "kubernetes.io/hostname", "operator": "In", "values": [cluster.node_name]}]}]}}}},
        ])
        releases = fresh_release(cluster, tmp_path_factory.mktemp("values") / "embedded.yaml", 1,
                                 store={"storageClass": "small", "size": f"{SMALL_VOLUME_MIB}Mi"})
        for release in releases:
            yield {**release, "volume": volume}
    finally:
        cluster.kubectl("delete", "pv", "herald-small-store", "--wait=false", check=False)
        run(["umount", "--lazy", str(volume)], check=False)
