"""The chart's RBAC against the real API server.

- Minimal: by impersonation, herald's ServiceAccount may do every call herald makes and
  nothing on a list of what it must never do.
- Sufficient: herald ($HERALD_BIN) runs outside the cluster with a kubeconfig holding only
  a token of the chart's ServiceAccount and passes the happy path (subscription Ready,
  quota in force, publish, delivery, Events, delete purged), with no "forbidden" in its log.
- Scaled out (several replicas on PostgreSQL): herald's Lease rights are a Role in its own
  namespace, nowhere else, and enough for herald with --shard-leases to take, renew and
  release its shards and leave.
- Tenant roles: `edit` manages subscriptions and not quotas, `view` reads only, and only a
  binding of herald-publisher lets a producer publish, through herald's own TokenReview and
  SubjectAccessReview, end to end.
"""

import base64
import json
import os
import signal
import subprocess
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from conftest import CHART, REPO, wait_until
from test_static import HERALD_LEASES, HERALD_NEEDS

SA = "system:serviceaccount:herald-system:herald"
SECRET = "whsec_" + base64.b64encode(bytes(range(24))).decode()

# What herald's ServiceAccount must never be able to do.
DENIED = [
    # (verb, resource, namespace or None for cluster scope, extra args)
    ("create", "secrets", "shop"), ("update", "secrets", "shop"), ("patch", "secrets", "shop"),
    ("delete", "secrets", "shop"), ("deletecollection", "secrets", "shop"),
    ("get", "pods", "shop"), ("list", "pods", "shop"), ("create", "pods", "shop"),
    ("create", "pods/exec", "shop"), ("get", "configmaps", "shop"),
    ("update", "deployments.apps", "herald-system"),
    ("create", "webhooksubscriptions.herald.dev", "shop"),
    ("update", "webhooksubscriptions.herald.dev", "shop"),
    ("delete", "webhooksubscriptions.herald.dev", "shop"),
    ("update", "webhooksubscriptions.herald.dev/status", "shop"),
    ("create", "webhookquotas.herald.dev", "shop"), ("patch", "webhookquotas.herald.dev", "shop"),
    ("update", "webhookquotas.herald.dev", "shop"), ("delete", "webhookquotas.herald.dev", "shop"),
    # herald authorizes publishers; it is not one.
    ("create", "webhookevents.herald.dev", "shop"),
    ("create", "customresourcedefinitions.apiextensions.k8s.io", None),
    ("update", "customresourcedefinitions.apiextensions.k8s.io", None),
    ("delete", "customresourcedefinitions.apiextensions.k8s.io", None),
    ("create", "clusterroles.rbac.authorization.k8s.io", None),
    ("update", "clusterroles.rbac.authorization.k8s.io", None),
    ("escalate", "clusterroles.rbac.authorization.k8s.io", None),
    ("bind", "clusterroles.rbac.authorization.k8s.io", None),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io", None),
    ("create", "rolebindings.rbac.authorization.k8s.io", "shop"),
    ("impersonate", "users", None), ("impersonate", "serviceaccounts", "shop"),
    ("create", "serviceaccounts/token", "shop"),
    ("create", "leases.coordination.k8s.io", "herald-system"),
    ("delete", "namespaces", None),
    ("delete", "events.events.k8s.io", "shop"),
    ("create", "certificatesigningrequests.certificates.k8s.io", None),
    ("*", "*", None),
]


def can_i(cp, verb, resource, namespace=None, as_user=SA, subresource=None):
    args = ["auth", "can-i", verb, resource, f"--as={as_user}"]
    args += ["-n", namespace] if namespace else []
    args += [f"--subresource={subresource}"] if subresource else []
    proc = cp.kubectl(*args, check=False)
    answer = proc.stdout.strip()
    assert answer in ("yes", "no"), proc.stdout + proc.stderr
    return answer == "yes"


# ---- a receiver and herald ---------------------------------------------------------------

class Receiver:
    """An HTTP receiver on 127.0.0.1 that records every request and answers 204."""

    def __init__(self):
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                received.append((self.path, dict(self.headers), body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Herald:
    def __init__(self, binary, kubeconfig, directory, *extra):
        self.dir = directory
        self.ready = directory / "ready"
        self.log_path = directory / "herald.log"
        env = dict(os.environ, RUST_LOG="info", POD_NAME="herald-chart-test")
        env.pop("KUBECONFIG", None)
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, "run", "--kubeconfig", kubeconfig, "--data-dir", directory / "data",
             "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
             "--egress-allow", "127.0.0.0/8", "--status-interval-seconds", "1",
             "--ready-file", self.ready, *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)

        def serving():
            assert self.proc.poll() is None, f"herald exited {self.proc.returncode}:\n{self.logs()}"
            lines = self.ready.read_text().split() if self.ready.exists() else []
            return lines if len(lines) == 2 else None

        ingest, health = wait_until("herald's ready file", serving, timeout=60)
        self.url, self.health = f"http://{ingest}", f"http://{health}"
        try:
            wait_until("herald /healthz", lambda: self.call("GET", self.health + "/healthz")[0] == 200, timeout=60)
        except AssertionError as e:
            self.stop()
            raise AssertionError(f"{e}\nherald's log:\n{self.logs()}") from None

    def logs(self):
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    @staticmethod
    def call(method, url, token=None, body=None):
        request = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode())
        request.add_header("Content-Type", "application/json")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except (urllib.error.URLError, ConnectionError) as e:
            return 0, str(e).encode()

    def publish(self, token, namespace, kind="order.created", data=None):
        return self.call("POST", f"{self.url}/v1/namespaces/{namespace}/events", token,
                         {"type": kind, "data": data or {"id": 1}})

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def herald_binary():
    binary = os.environ.get("HERALD_BIN") or str(REPO / "target" / "debug" / "herald")
    if not Path(binary).is_file():
        pytest.fail(f"no herald binary at {binary} (build it, or set HERALD_BIN)")
    return binary


@pytest.fixture(scope="module")
def installed(cp):
    cp.create_namespace("herald-system")
    cp.create_namespace("shop")
    cp.create_namespace("other")
    cp.helm("install", "herald", CHART, "--namespace", "herald-system")
    return cp


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def herald(installed, tmp_path_factory):
    directory = tmp_path_factory.mktemp("herald")
    token = installed.token("herald-system", "herald")
    kubeconfig = installed.token_kubeconfig(directory / "kubeconfig", token)
    # The kubeconfig holds nothing but the ServiceAccount's token.
    assert "client-certificate" not in kubeconfig.read_text()
    h = Herald(herald_binary(), kubeconfig, directory)
    yield h
    h.stop()


def service_account(cp, namespace, name, cluster_role=None):
    cp.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": namespace}})
    if cluster_role:
        cp.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                  "metadata": {"name": f"{name}-{cluster_role}", "namespace": namespace},
                  "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
                  "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]})
    return cp.token(namespace, name, audience="herald")


def subscription(name, url, namespace="shop"):
    return [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{name}-secret", "namespace": namespace},
         "type": "Opaque", "stringData": {"secret": SECRET}},
        {"apiVersion": "herald.dev/v1alpha1", "kind": "WebhookSubscription",
         "metadata": {"name": name, "namespace": namespace},
         "spec": {"url": url, "eventTypes": ["order.*"],
                  "signing": {"secretRef": {"name": f"{name}-secret", "key": "secret"}}}},
    ]


# ---- minimal ----------------------------------------------------------------------------

def test_herald_may_do_every_call_it_makes(installed):
    missing = []
    for group, resource, verb in sorted(HERALD_NEEDS):
        base, _, sub = resource.partition("/")
        name = f"{base}.{group}" if group else base
        cluster_scoped = group in ("authentication.k8s.io", "authorization.k8s.io")
        for namespace in ([None] if cluster_scoped else ["shop", "herald-system"]):
            if not can_i(installed, verb, name, namespace, subresource=sub or None):
                missing.append((verb, resource, group, namespace))
    assert not missing, f"herald's ServiceAccount may not: {missing}"


def test_herald_may_not_do_anything_else(installed):
    allowed = [(verb, resource, ns) for verb, resource, ns in DENIED if can_i(installed, verb, resource, ns)]
    assert not allowed, f"herald's ServiceAccount may: {allowed}"


# ---- sufficient -------------------------------------------------------------------------

def test_herald_runs_on_the_chart_service_account_alone(installed, herald, receiver):
    cp = installed
    cp.apply(subscription("orders", receiver.url + "/hooks/orders"))
    cp.kubectl("wait", "--for=condition=Ready", "webhooksubscription/orders", "-n", "shop", "--timeout=60s")
    # The finalizer went on with herald's patch.
    assert "herald.dev/purge" in cp.get_json("webhooksubscription", "orders", "-n", "shop")["metadata"]["finalizers"]

    # A quota is applied and its status written (webhookquotas/status).
    cp.apply({"apiVersion": "herald.dev/v1alpha1", "kind": "WebhookQuota",
              "metadata": {"name": "default", "namespace": "shop"},
              "spec": {"maxInFlight": 32, "maxPendingAttempts": 1000}})
    cp.kubectl("wait", "--for=condition=Ready", "webhookquota/default", "-n", "shop", "--timeout=60s")

    token = service_account(cp, "shop", "producer", "herald-publisher")
    status, body = wait_until(
        "the grant to reach herald",
        lambda: (lambda r: r if r[0] == 202 else None)(herald.publish(token, "shop", data={"n": 1})),
        timeout=30, interval=0.5)
    assert json.loads(body)["matched"] == 1

    path, headers, payload = wait_until("the delivery", lambda: receiver.received and receiver.received[-1], timeout=30)
    assert path == "/hooks/orders"
    assert json.loads(payload)["data"] == {"n": 1}
    from standardwebhooks import Webhook
    Webhook(SECRET).verify(payload, {k.lower(): v for k, v in headers.items()})

    # herald reported on the object with Events (events.k8s.io create/patch).
    def ready_event():
        events = cp.get_json("events.events.k8s.io", "-n", "shop")["items"]
        return [e for e in events if e.get("reason") == "Ready" and e["regarding"]["name"] == "orders"]
    wait_until("herald's Ready event", ready_event, timeout=30)

    # Delete: herald purges and takes its finalizer off, so the object goes.
    cp.kubectl("delete", "webhooksubscription", "orders", "-n", "shop", "--timeout=60s")
    assert not cp.exists("webhooksubscription", "orders", "-n", "shop")

    log = herald.logs()
    assert "forbidden" not in log.lower(), log


def test_herald_is_ready_on_the_chart_service_account(herald):
    """/readyz (the chart's readiness probe) says ok: every cache had its first full list
    with the chart's rights."""
    wait_until("herald /readyz", lambda: herald.call("GET", herald.health + "/readyz")[0] == 200, timeout=30)


# ---- tenant roles -----------------------------------------------------------------------

def bind_user(cp, user, cluster_role, namespace="shop"):
    cp.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
              "metadata": {"name": f"{user}-{cluster_role}", "namespace": namespace},
              "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
              "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]})


def test_edit_manages_subscriptions_but_not_quotas(installed, receiver):
    cp = installed
    bind_user(cp, "alice", "edit")
    wait_until("edit to aggregate herald-edit",
               lambda: can_i(cp, "create", "webhooksubscriptions.herald.dev", "shop", as_user="alice"))
    as_alice = ["--as=alice", "-n", "shop"]
    cp.apply(subscription("alice-sub", receiver.url + "/hooks/alice"), *as_alice)
    cp.kubectl("patch", "webhooksubscription", "alice-sub", "--type=merge", "-p", '{"spec":{"paused":true}}', *as_alice)
    for verb in ("get", "list", "watch", "update", "patch", "delete"):
        assert can_i(cp, verb, "webhooksubscriptions.herald.dev", "shop", as_user="alice"), verb
    quota = {"apiVersion": "herald.dev/v1alpha1", "kind": "WebhookQuota",
             "metadata": {"name": "mine", "namespace": "shop"}, "spec": {"maxInFlight": 1000, "maxPendingAttempts": 10}}
    proc = cp.apply(quota, *as_alice, check=False)
    assert proc.returncode != 0 and "forbidden" in proc.stderr.lower(), proc.stderr
    for verb in ("create", "update", "patch", "delete"):
        assert not can_i(cp, verb, "webhookquotas.herald.dev", "shop", as_user="alice"), verb
    assert can_i(cp, "get", "webhookquotas.herald.dev", "shop", as_user="alice")
    assert not can_i(cp, "create", "webhookevents.herald.dev", "shop", as_user="alice")
    # Only in the namespace of the binding.
    assert not can_i(cp, "create", "webhooksubscriptions.herald.dev", "other", as_user="alice")


def test_view_reads_and_never_writes(installed):
    cp = installed
    bind_user(cp, "bob", "view")
    wait_until("view to aggregate herald-view",
               lambda: can_i(cp, "list", "webhooksubscriptions.herald.dev", "shop", as_user="bob"))
    cp.kubectl("get", "webhooksubscriptions", "-n", "shop", "--as=bob")
    for verb in ("get", "list", "watch"):
        assert can_i(cp, verb, "webhooksubscriptions.herald.dev", "shop", as_user="bob"), verb
        assert can_i(cp, verb, "webhookquotas.herald.dev", "shop", as_user="bob"), verb
    for verb in ("create", "update", "patch", "delete"):
        assert not can_i(cp, verb, "webhooksubscriptions.herald.dev", "shop", as_user="bob"), verb
        assert not can_i(cp, verb, "webhookquotas.herald.dev", "shop", as_user="bob"), verb
    proc = cp.kubectl("delete", "webhooksubscription", "alice-sub", "-n", "shop", "--as=bob", check=False)
    assert proc.returncode != 0 and "forbidden" in proc.stderr.lower()
    assert not can_i(cp, "create", "webhookevents.herald.dev", "shop", as_user="bob")


def test_only_herald_publisher_lets_a_producer_publish_through_herald(installed, herald):
    cp = installed
    tokens = {
        "publisher": service_account(cp, "shop", "publisher", "herald-publisher"),
        "editor": service_account(cp, "shop", "editor", "edit"),
        "viewer": service_account(cp, "shop", "viewer", "view"),
        "nobody": service_account(cp, "shop", "nobody"),
    }
    # Grants made a moment ago reach herald's SubjectAccessReview within its refusal cache.
    wait_until("the publisher's grant", lambda: herald.publish(tokens["publisher"], "shop")[0] == 202, timeout=30)
    answers = {who: herald.publish(token, "shop")[0] for who, token in tokens.items()}
    assert answers == {"publisher": 202, "editor": 403, "viewer": 403, "nobody": 403}
    # Bound in shop, so not in other.
    assert herald.publish(tokens["publisher"], "other")[0] == 403
    # No token, one the API server does not know, or one issued for the API server rather
    # than for herald: 401.
    assert herald.publish(None, "shop")[0] == 401
    assert herald.publish("not-a-token", "shop")[0] == 401
    assert herald.publish(cp.token("shop", "publisher"), "shop")[0] == 401

    # Reading a subscription through herald needs `get` (view, edit); replay and enable
    # need `patch` (edit only).
    url = f"{herald.url}/v1/namespaces/shop/subscriptions/alice-sub"
    reads = {who: herald.call("GET", url, token)[0] for who, token in tokens.items()}
    assert reads == {"publisher": 403, "editor": 200, "viewer": 200, "nobody": 403}
    enables = {who: herald.call("POST", url + "/enable", token)[0] for who, token in tokens.items()}
    assert enables["viewer"] == 403 and enables["publisher"] == 403 and enables["nobody"] == 403
    assert enables["editor"] == 200, enables


# ---- narrowed to namespaces ---------------------------------------------------------------

def test_watch_namespaces_rights_suffice_and_stop_at_those_namespaces(installed, herald, receiver, tmp_path):
    """With watchNamespaces herald's rights are Roles in those namespaces: enough for herald
    started with --watch-namespace, and nothing in other namespaces."""
    cp = installed
    herald.stop()  # one herald per store and ServiceAccount at a time
    cp.helm("upgrade", "herald", CHART, "--namespace", "herald-system", "--set", "watchNamespaces={shop}")
    assert not can_i(cp, "list", "secrets", "other")
    assert not can_i(cp, "list", "secrets", None)
    assert not can_i(cp, "list", "webhooksubscriptions.herald.dev", None)
    assert can_i(cp, "list", "secrets", "shop")
    kubeconfig = cp.token_kubeconfig(tmp_path / "kubeconfig", cp.token("herald-system", "herald"))
    narrowed = Herald(herald_binary(), kubeconfig, tmp_path, "--watch-namespace", "shop")
    try:
        cp.apply(subscription("narrow", receiver.url + "/hooks/narrow"))
        cp.kubectl("wait", "--for=condition=Ready", "webhooksubscription/narrow", "-n", "shop", "--timeout=60s")
        token = cp.token("shop", "producer", audience="herald")
        before = len(receiver.received)
        wait_until("a publish", lambda: narrowed.publish(token, "shop", data={"n": 2})[0] == 202, timeout=30)
        wait_until("the delivery", lambda: any(p == "/hooks/narrow" for p, _, _ in receiver.received[before:]),
                   timeout=30)
        cp.kubectl("delete", "webhooksubscription", "narrow", "-n", "shop", "--timeout=60s")
        log = narrowed.logs()
        assert "forbidden" not in log.lower(), log
    finally:
        narrowed.stop()


# ---- scaled out: shard Leases in herald's namespace only ------------------------------------

LEASES = "leases.coordination.k8s.io"


def can_i_anywhere(cp, verb, resource, as_user=SA):
    """Whether `as_user` may `verb` `resource` cluster-wide (in every namespace at once)."""
    proc = cp.kubectl("auth", "can-i", verb, resource, f"--as={as_user}", "--all-namespaces", check=False)
    answer = proc.stdout.strip()
    assert answer in ("yes", "no"), proc.stdout + proc.stderr
    return answer == "yes"


def test_scaled_out_lease_rights_stop_at_herald_namespace(installed, tmp_path, receiver):
    """With several replicas on PostgreSQL herald may manage Leases in herald-system and in
    no other namespace, nor cluster-wide, and gains nothing else. Then herald itself, with
    --shard-leases on the chart's token, takes every shard, delivers, and on stopping
    releases its shards and deletes its member Lease: the rights suffice."""
    cp = installed
    assert not can_i(cp, "create", LEASES, "herald-system"), "Lease rights before scaling out"
    cp.helm("upgrade", "herald", CHART, "--namespace", "herald-system", "--reuse-values",
            "--set", "replicaCount=3", "--set", "store.postgres.existingSecret=herald-postgres")
    verbs = sorted(verb for _, _, verb in HERALD_LEASES)
    wait_until("the Lease Role", lambda: can_i(cp, "create", LEASES, "herald-system"))
    refused = []
    for verb in verbs:
        if not can_i(cp, verb, LEASES, "herald-system"):
            refused.append((verb, "herald-system"))
    assert not refused, f"herald's ServiceAccount may not: {refused}"
    allowed = []
    for verb in verbs:
        for namespace in ("shop", "other", "default", "kube-system", "kube-node-lease"):
            if can_i(cp, verb, LEASES, namespace):
                allowed.append((verb, namespace))
        if can_i_anywhere(cp, verb, LEASES):
            allowed.append((verb, "all namespaces"))
    # Only what herald does with its Leases, even in its own namespace.
    for verb in ("watch", "patch", "deletecollection"):
        if can_i(cp, verb, LEASES, "herald-system"):
            allowed.append((verb, "herald-system"))
    # And nothing else of the list of what it must never do.
    allowed += [(verb, resource, ns) for verb, resource, ns in DENIED
                if resource != LEASES and can_i(cp, verb, resource, ns)]
    assert not allowed, f"herald's ServiceAccount may: {allowed}"

    # herald with the chart's token, sharing by Leases in herald-system as the chart runs it,
    # on a PostgreSQL store (scripts/postgres: Debian's server in a private folder).
    kubeconfig = cp.token_kubeconfig(tmp_path / "kubeconfig", cp.token("herald-system", "herald"))
    shards = 4
    # Not under tmp_path: the server runs as the postgres user, which cannot enter pytest's
    # private folder; scripts/postgres creates this folder and gives it to that user.
    pg_dir = Path("/tmp") / f"herald-pg-chart-{os.getpid()}"
    postgres = REPO / "scripts" / "postgres"
    url = subprocess.run([str(postgres), "up", "--dir", str(pg_dir)], check=True,
                         capture_output=True, text=True).stdout.strip()
    try:
        sharing = Herald(herald_binary(), kubeconfig, tmp_path, "--watch-namespace", "shop",
                         "--store", url, "--shard-leases", "--lease-namespace", "herald-system",
                         "--shards", str(shards), "--shard-lease-seconds", "3")
    except BaseException:
        subprocess.run([str(postgres), "down", "--dir", str(pg_dir)], check=False)
        raise
    identity = "herald-chart-test"  # POD_NAME, as in the chart

    def holders():
        items = cp.get_json("leases", "-n", "herald-system", "-l", "herald.dev/lease=shard")["items"]
        return {o["metadata"]["name"]: o["spec"].get("holderIdentity") for o in items}

    try:
        wait_until("herald to hold every shard",
                   lambda: holders() == {f"herald-shard-{n}": identity for n in range(shards)}, timeout=60)
        assert cp.exists("lease", f"herald-member-{identity}", "-n", "herald-system")
        cp.apply(subscription("sharded", receiver.url + "/hooks/sharded"))
        cp.kubectl("wait", "--for=condition=Ready", "webhooksubscription/sharded", "-n", "shop", "--timeout=60s")
        token = service_account(cp, "shop", "producer", "herald-publisher")
        before = len(receiver.received)
        wait_until("a publish", lambda: sharing.publish(token, "shop", data={"n": 3})[0] == 202, timeout=30)
        wait_until("the delivery", lambda: any(p == "/hooks/sharded" for p, _, _ in receiver.received[before:]),
                   timeout=30)
        cp.kubectl("delete", "webhooksubscription", "sharded", "-n", "shop", "--timeout=60s")
    finally:
        sharing.stop()
        subprocess.run([str(postgres), "down", "--dir", str(pg_dir)], check=False)
    log = sharing.logs()
    assert "forbidden" not in log.lower(), log
    # Leaving: its shards released (update) and its member Lease deleted (delete).
    assert holders() == {f"herald-shard-{n}": None for n in range(shards)}, log
    assert not cp.exists("lease", f"herald-member-{identity}", "-n", "herald-system"), log
