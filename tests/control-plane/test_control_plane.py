"""Tests for scripts/control-plane: a real etcd + kube-apiserver +
kube-controller-manager on loopback, plus kubectl and helm.

Run through tests/control-plane/test.sh (builds the binaries first).
"""

import json
import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "control-plane"
VERSIONS = dict(
    line.split("=", 1)
    for line in (REPO / "tests" / "control-plane" / "versions.env").read_text().splitlines()
    if line and not line.startswith("#")
)
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager")

TINY_CRD = """\
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.test.herald.dev
spec:
  group: test.herald.dev
  scope: Namespaced
  names:
    plural: widgets
    singular: widget
    kind: Widget
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              size:
                type: integer
"""


def run(args, env=None, check=True, timeout=300, **kw):
    proc = subprocess.run(
        [str(a) for a in args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{shlex.join(map(str, args))} exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


def parse_exports(stdout):
    """The last lines of `up` are `export KUBECONFIG=...` and `export PATH=...`."""
    env = dict(os.environ)
    out = run(["bash", "-c", stdout + '\nprintf "%s\\0%s" "$KUBECONFIG" "$PATH"'], env=env)
    kubeconfig, path = out.stdout.split("\0")
    env["KUBECONFIG"] = kubeconfig
    env["PATH"] = path
    return env


def read_pids(cp_dir):
    pids = {}
    for line in (Path(cp_dir) / "pids").read_text().splitlines():
        name, pid = line.split()
        pids[name] = int(pid)
    return pids


def pid_running(pid):
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class ControlPlane:
    def __init__(self, cp_dir, stdout, stderr, seconds):
        self.dir = Path(cp_dir)
        self.stdout = stdout
        self.stderr = stderr
        self.seconds = seconds
        self.env = parse_exports(stdout)
        self.pids = read_pids(cp_dir)
        self.ports = dict(line.split() for line in (self.dir / "ports").read_text().splitlines())

    def kubectl(self, *args, check=True, timeout=120):
        return run(["kubectl", *args], env=self.env, check=check, timeout=timeout)

    def down(self):
        return run([SCRIPT, "down", "--dir", self.dir])


def up(cp_dir, *extra):
    start = time.monotonic()
    proc = run([SCRIPT, "up", "--dir", cp_dir, *extra], timeout=600)
    return ControlPlane(cp_dir, proc.stdout, proc.stderr, time.monotonic() - start)


def assert_all_stopped(cp):
    for name in COMPONENTS:
        assert not pid_running(cp.pids[name]), f"{name} (pid {cp.pids[name]}) still running"


@pytest.fixture(scope="session")
def crd_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("crds") / "widgets.yaml"
    path.write_text(TINY_CRD)
    return path


@pytest.fixture(scope="session")
def cp(tmp_path_factory, crd_file):
    plane = up(tmp_path_factory.mktemp("cp") / "plane", "--crds", crd_file)
    print(f"\nwarm up (to /readyz + CRDs Established): {plane.seconds:.1f}s")
    yield plane
    plane.down()
    assert_all_stopped(plane)
    assert not plane.dir.exists()


def test_env_prints_bin_dir_with_all_binaries():
    out = run([SCRIPT, "env"]).stdout.strip().splitlines()
    bin_dir = Path(out[-1])
    assert bin_dir.is_dir()
    assert str(bin_dir).startswith(
        os.environ.get("HERALD_CACHE_DIR", str(Path.home() / ".cache" / "herald"))
    )
    assert not str(bin_dir).startswith(str(REPO))
    for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl", "helm"):
        assert os.access(bin_dir / name, os.X_OK), name


def test_up_prints_exports_last(cp):
    lines = cp.stdout.strip().splitlines()
    assert lines[-2] == f"export KUBECONFIG={cp.dir / 'kubeconfig'}"
    assert lines[-1].startswith("export PATH=")
    assert (cp.dir / "kubeconfig").is_file()
    for name in COMPONENTS:
        assert pid_running(cp.pids[name]), name
        assert (cp.dir / "logs" / f"{name}.log").is_file()


def test_kubectl_version_reports_pinned_versions(cp):
    info = json.loads(cp.kubectl("version", "-o", "json").stdout)
    assert info["serverVersion"]["gitVersion"] == VERSIONS["K8S_VERSION"]
    assert info["clientVersion"]["gitVersion"] == VERSIONS["K8S_VERSION"]
    minor = VERSIONS["K8S_VERSION"].split(".")[1]
    assert info["serverVersion"]["major"] == "1"
    assert info["serverVersion"]["minor"] == minor


def test_etcd_version(cp):
    out = run([cp.env["PATH"].split(":")[0] + "/etcd", "--version"]).stdout
    assert f"etcd Version: {VERSIONS['ETCD_VERSION'].lstrip('v')}" in out


def test_api_resources(cp):
    out = cp.kubectl("api-resources", "-o", "name").stdout.split()
    for res in ("namespaces", "configmaps", "customresourcedefinitions.apiextensions.k8s.io",
                "deployments.apps", "widgets.test.herald.dev"):
        assert res in out


def test_crd_is_established_and_usable(cp):
    cond = cp.kubectl(
        "get", "crd", "widgets.test.herald.dev",
        "-o", "jsonpath={.status.conditions[?(@.type=='Established')].status}",
    ).stdout
    assert cond == "True"
    cp.kubectl("create", "namespace", "widgets")
    widget = '{"apiVersion":"test.herald.dev/v1","kind":"Widget","metadata":{"name":"w1","namespace":"widgets"},"spec":{"size":3}}'
    run(["kubectl", "apply", "-f", "-"], env=cp.env, input=widget)
    size = cp.kubectl("get", "widget", "w1", "-n", "widgets", "-o", "jsonpath={.spec.size}").stdout
    assert size == "3"


def test_namespace_deletion_completes(cp):
    cp.kubectl("create", "namespace", "doomed")
    cp.kubectl("create", "configmap", "cm", "-n", "doomed", "--from-literal=a=b")
    # The serviceaccount controller (kube-controller-manager) creates "default".
    deadline = time.monotonic() + 60
    while cp.kubectl("get", "serviceaccount", "default", "-n", "doomed", check=False).returncode:
        assert time.monotonic() < deadline, "default service account never appeared"
        time.sleep(0.5)
    cp.kubectl("delete", "namespace", "doomed", "--wait=false")
    deadline = time.monotonic() + 90
    while True:
        got = cp.kubectl("get", "namespace", "doomed", "--ignore-not-found", "-o", "name").stdout
        if not got.strip():
            break
        assert time.monotonic() < deadline, "namespace deletion did not finish"
        time.sleep(0.5)


def test_helm_version_and_template(cp, tmp_path):
    out = run(["helm", "version", "--short"], env=cp.env).stdout.strip()
    assert out.startswith(VERSIONS["HELM_VERSION"]), out
    assert out.startswith("v4."), out
    run(["helm", "create", "tiny"], env=cp.env, cwd=tmp_path)
    rendered = run(["helm", "template", "rel", tmp_path / "tiny"], env=cp.env).stdout
    assert "kind: Deployment" in rendered
    assert "name: rel-tiny" in rendered


def test_helm_install_against_cluster(cp, tmp_path):
    run(["helm", "create", "tiny"], env=cp.env, cwd=tmp_path)
    cp.kubectl("create", "namespace", "helmtest")
    run(["helm", "install", "rel", tmp_path / "tiny", "-n", "helmtest"], env=cp.env)
    listed = json.loads(run(["helm", "list", "-n", "helmtest", "-o", "json"], env=cp.env).stdout)
    assert [r["name"] for r in listed] == ["rel"]
    # The replicaset controller turns the Deployment into a ReplicaSet.
    deadline = time.monotonic() + 60
    while not cp.kubectl("get", "rs", "-n", "helmtest", "-o", "name").stdout.strip():
        assert time.monotonic() < deadline, "no ReplicaSet created for the Deployment"
        time.sleep(0.5)
    run(["helm", "uninstall", "rel", "-n", "helmtest"], env=cp.env)


def test_two_control_planes_at_once_do_not_collide(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    procs = [
        subprocess.Popen([str(SCRIPT), "up", "--dir", str(d)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for d in dirs
    ]
    results = [p.communicate(timeout=600) for p in procs]
    planes = []
    try:
        for d, p, (stdout, stderr) in zip(dirs, procs, results):
            assert p.returncode == 0, f"up --dir {d} failed:\n{stderr}"
            planes.append(ControlPlane(d, stdout, stderr, 0))
        a, b = planes
        assert not set(a.ports.values()) & set(b.ports.values())
        assert not set(a.pids.values()) & set(b.pids.values())
        a.kubectl("create", "namespace", "only-in-a")
        assert b.kubectl("get", "namespace", "only-in-a", check=False).returncode != 0
        b.kubectl("create", "namespace", "only-in-b")
        assert a.kubectl("get", "namespace", "only-in-b", check=False).returncode != 0
    finally:
        # Record pids before down removes the directories.
        for d in dirs:
            run([SCRIPT, "down", "--dir", d], check=False)
    for plane in planes:
        assert_all_stopped(plane)
        assert not plane.dir.exists()


def test_up_refuses_a_running_dir(cp):
    proc = run([SCRIPT, "up", "--dir", cp.dir], check=False)
    assert proc.returncode != 0
    assert "already running" in proc.stderr
    for name in COMPONENTS:
        assert pid_running(cp.pids[name]), name


def test_failed_up_tears_down_what_it_started(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\n"
                   "metadata:\n  name: broken.test.herald.dev\nspec: {}\n")
    cp_dir = tmp_path / "plane"
    proc = run([SCRIPT, "up", "--dir", cp_dir, "--crds", bad], check=False)
    assert proc.returncode != 0
    assert "kubectl apply" in proc.stderr
    assert "last 40 lines" in proc.stderr
    assert proc.stdout == ""
    pids = {}
    for line in (cp_dir / "pids.failed").read_text().splitlines():
        name, pid = line.split()
        pids[name] = int(pid)
    assert set(pids) == set(COMPONENTS)
    for name, pid in pids.items():
        assert not pid_running(pid), f"{name} (pid {pid}) still running after failed up"
    run([SCRIPT, "down", "--dir", cp_dir])
    assert not cp_dir.exists()


NODE_SYSCTLS = ("net.ipv4.ip_forward", "net.bridge.bridge-nf-call-iptables", "vm.overcommit_memory",
                "kernel.panic", "kernel.panic_on_oops")


def host_state(cp_dir):
    """What a node changes on this machine: its bridge, iptables chains, pod cgroups, mounts
    and processes under its directory, and the kernel settings kubelet tunes."""
    rules = []
    for cmd in ("iptables-save", "ip6tables-save"):
        out = run([cmd], check=False).stdout
        rules += [l for l in out.splitlines() if "KUBE" in l or "HERALD" in l]
    mounts = [l for l in Path("/proc/self/mountinfo").read_text().splitlines() if str(cp_dir) in l]
    processes = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if str(cp_dir).encode() in (proc / "cmdline").read_bytes() and pid_running(proc.name):
                    processes.append(proc.name)
            except OSError:
                pass
    return {
        "bridge": run(["ip", "link", "show", "herald0"], check=False).returncode == 0,
        "rules": rules,
        "cgroups": sorted(str(p) for p in Path("/sys/fs/cgroup").glob("*/kubepods")),
        "mounts": mounts,
        "processes": processes,
        "sysctls": {k: run(["sysctl", "-n", k], check=False).stdout.strip() for k in NODE_SYSCTLS},
    }


def test_node_runs_a_pod_and_down_leaves_the_machine_as_it_was(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a node needs root (scripts/test names the node tests skipped)")
    cp_dir = tmp_path / "plane"
    before = host_state(cp_dir)
    plane = up(cp_dir, "--node")
    try:
        print(f"\ncontrol plane and node up in {plane.seconds:.1f}s")
        assert {"containerd", "kubelet", "kube-scheduler", "kube-proxy", "dnsmasq"} <= set(plane.pids)
        node = json.loads(plane.kubectl("get", "node", "herald-node", "-o", "json").stdout)
        assert {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"] == "True"
        plane.kubectl("run", "sleeper", "--image=herald.test/pause:1", "--image-pull-policy=Never",
                      "--restart=Never")
        plane.kubectl("wait", "--for=condition=Ready", "pod/sleeper", "--timeout=120s", timeout=150)
        pod = json.loads(plane.kubectl("get", "pod", "sleeper", "-o", "json").stdout)
        assert pod["status"]["podIP"].startswith("10.88."), pod["status"]
        during = host_state(cp_dir)
        assert during["bridge"] and during["processes"] and during["mounts"]
        assert any("KUBE-SERVICES" in r for r in during["rules"])
    finally:
        plane.down()
    assert host_state(cp_dir) == before
    assert not cp_dir.exists()
