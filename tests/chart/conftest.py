"""Shared pieces of the chart tests: the tools (helm, kubectl from scripts/control-plane),
rendering the chart, and a control plane per test module (at most one runs at a time:
pytest runs the modules one after the other and each tears its own down)."""

import base64
import json
import os
import sys
from pathlib import Path

import pytest
import yaml

# run and wait_until are shared with the other Python suites (tests/support/commands.py);
# the test modules import them from here.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from commands import run, wait_until  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "herald"
HERE = Path(__file__).resolve().parent
SCRIPT = REPO / "scripts" / "control-plane"
ALL_OPTIONS = HERE / "values-all-options.yaml"
# Layered over ALL_OPTIONS: several replicas on PostgreSQL, so that together they set every value.
SCALE_OUT = HERE / "values-scale-out.yaml"

# kube-controller-manager's controllers for these tests: the harness's default set plus
# the one that lets a deleted PersistentVolumeClaim go (it removes the
# kubernetes.io/pvc-protection finalizer), as every real cluster runs it.
KCM_CONTROLLERS = (
    "namespace-controller,garbage-collector-controller,serviceaccount-controller,"
    "serviceaccount-token-controller,root-ca-certificate-publisher-controller,"
    "clusterrole-aggregation-controller,deployment-controller,replicaset-controller,"
    "endpointslice-controller,disruption-controller,"
    "persistentvolumeclaim-protection-controller"
)


_bin_dir = None


def bin_dir():
    """helm, kubectl and the control plane's binaries (built once, cached)."""
    global _bin_dir
    if _bin_dir is None:
        out = run([SCRIPT, "env"], timeout=3600).stdout.strip().splitlines()
        _bin_dir = Path(out[-1])
    return _bin_dir


def tool_env(**extra):
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir()}:{env['PATH']}"
    env.update(extra)
    return env


def helm(*args, env=None, check=True, input=None, timeout=300):
    return run([bin_dir() / "helm", *args], env=env or tool_env(), check=check, input=input,
               timeout=timeout)


def render(*args, release="herald", namespace="herald-system"):
    """`helm template` of the chart: the list of objects."""
    out = helm("template", release, CHART, "--namespace", namespace, *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def render_text(*args, release="herald", namespace="herald-system"):
    return helm("template", release, CHART, "--namespace", namespace, *args).stdout


def find(objects, kind, name=None):
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert found, f"no {kind} {name or ''} among {[(o['kind'], o['metadata']['name']) for o in objects]}"
    return found[0] if name is not None or len(found) == 1 else found


class ControlPlane:
    def __init__(self, directory, stdout):
        self.dir = Path(directory)
        env = dict(os.environ)
        out = run(["bash", "-c", stdout + '\nprintf "%s\\0%s" "$KUBECONFIG" "$PATH"'], env=env)
        kubeconfig, path = out.stdout.split("\0")
        env["KUBECONFIG"] = kubeconfig
        env["PATH"] = path
        self.env = env
        self.kubeconfig = Path(kubeconfig)

    def kubectl(self, *args, check=True, input=None, timeout=120):
        return run([bin_dir() / "kubectl", *args], env=self.env, check=check, input=input,
                   timeout=timeout)

    def helm(self, *args, check=True, timeout=300):
        return run([bin_dir() / "helm", *args], env=self.env, check=check, timeout=timeout)

    def apply(self, manifest, *args, check=True):
        text = manifest if isinstance(manifest, str) else yaml.safe_dump_all(
            manifest if isinstance(manifest, list) else [manifest])
        return self.kubectl("apply", "-f", "-", *args, input=text, check=check)

    def get_json(self, *args):
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def exists(self, *args):
        return self.kubectl("get", *args, "--ignore-not-found", "-o", "name").stdout.strip() != ""

    def create_namespace(self, name, labels=None):
        ns = {"apiVersion": "v1", "kind": "Namespace",
              "metadata": {"name": name, "labels": labels or {}}}
        self.apply(ns)
        # The serviceaccount controller creates "default"; tokens need the namespace ready.
        wait_until(f"namespace {name} ready", lambda: self.exists("serviceaccount", "default", "-n", name))

    def token(self, namespace, service_account, duration="1h", audience=None):
        """A ServiceAccount token: for the API server, or for `audience` (producers and
        readers of herald's API get theirs for audience "herald")."""
        extra = ["--audience", audience] if audience else []
        return self.kubectl("create", "token", service_account, "-n", namespace,
                            f"--duration={duration}", *extra).stdout.strip()

    def server(self):
        config = yaml.safe_load(self.kubeconfig.read_text())
        cluster = config["clusters"][0]["cluster"]
        return cluster["server"], Path(cluster["certificate-authority"])

    def token_kubeconfig(self, path, token):
        """A kubeconfig that authenticates with a bearer token only (no client cert)."""
        server, ca = self.server()
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "test", "cluster": {
                "server": server,
                "certificate-authority-data": base64.b64encode(ca.read_bytes()).decode()}}],
            "users": [{"name": "token", "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "token"}}],
            "current-context": "test",
        }))
        path.chmod(0o600)
        return path


@pytest.fixture(scope="module")
def cp(request, tmp_path_factory):
    """A control plane for this test module; with CRDs unless the module says
    `INSTALL_CRDS = False` (then `helm install` brings them from the chart)."""
    directory = tmp_path_factory.mktemp("cp") / "plane"
    args = [SCRIPT, "up", "--dir", directory]
    if getattr(request.module, "INSTALL_CRDS", True):
        args += ["--crds", REPO / "crds"]
    bin_dir()  # build (or wait for) the binaries outside up's timeout
    env = dict(os.environ, HERALD_KCM_CONTROLLERS=KCM_CONTROLLERS)
    proc = run(args, env=env, timeout=600)
    plane = ControlPlane(directory, proc.stdout)
    try:
        yield plane
    finally:
        run([SCRIPT, "down", "--dir", directory], check=False)
