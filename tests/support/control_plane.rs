//! A real control plane (etcd, kube-apiserver, kube-controller-manager) for tests, started
//! and stopped through `scripts/control-plane`, the one implementation the demo and the
//! Python tests use too. Dropping the handle tears it down, also when a test panics.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

pub struct ControlPlane {
    dir: PathBuf,
    pub kubeconfig: PathBuf,
    pub bin: PathBuf,
}

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

impl ControlPlane {
    /// Starts a control plane with herald's CRDs installed and Established. Returns None,
    /// with a note on stderr, only when HERALD_SKIP_CONTROL_PLANE=1; otherwise a failure to
    /// start fails the test.
    pub fn start() -> Option<Self> {
        if std::env::var("HERALD_SKIP_CONTROL_PLANE").as_deref() == Ok("1") {
            eprintln!("HERALD_SKIP_CONTROL_PLANE=1: skipping a test that needs a control plane");
            return None;
        }
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "herald-cp-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let script = repo().join("scripts/control-plane");
        let output = Command::new(&script)
            .arg("up")
            .arg("--dir")
            .arg(&dir)
            .arg("--crds")
            .arg(repo().join("crds"))
            .output()
            .expect("running scripts/control-plane up");
        // Built before `up` can fail, so the handle tears down whatever did start.
        let bin = String::from_utf8(
            Command::new(&script)
                .arg("env")
                .output()
                .expect("control-plane env")
                .stdout,
        )
        .unwrap();
        let plane = Self {
            kubeconfig: dir.join("kubeconfig"),
            bin: PathBuf::from(bin.trim()),
            dir,
        };
        assert!(
            output.status.success(),
            "control plane did not start:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        Some(plane)
    }

    /// The control plane's folder: `pki/` (its CAs and keys), `logs/` (with `audit.log`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A kube-rs client with the admin credential.
    pub async fn client(&self) -> kube::Client {
        let kubeconfig = kube::config::Kubeconfig::read_from(&self.kubeconfig).unwrap();
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .unwrap();
        kube::Client::try_from(config).unwrap()
    }

    /// Runs the pinned kubectl against this control plane.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        Command::new(self.bin.join("kubectl"))
            .args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .env("KUBECACHEDIR", self.dir.join("kube-cache"))
            .output()
            .expect("running kubectl")
    }

    /// kubectl that must succeed; returns stdout.
    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        let out = self.kubectl(args);
        assert!(
            out.status.success(),
            "kubectl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }
}

impl ControlPlane {
    /// kubectl that must succeed within `deadline`, for answers that lag behind a change
    /// (the OpenAPI document behind `kubectl explain` is published after a CRD is
    /// Established).
    pub fn kubectl_eventually(&self, args: &[&str], deadline: std::time::Duration) -> String {
        let end = std::time::Instant::now() + deadline;
        loop {
            let out = self.kubectl(args);
            if out.status.success() {
                return String::from_utf8(out.stdout).unwrap();
            }
            assert!(
                std::time::Instant::now() < end,
                "kubectl {args:?} still failing after {deadline:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }
}

impl ControlPlane {
    /// kubectl with `input` on standard input (`kubectl apply -f -`); must succeed.
    pub fn kubectl_stdin(&self, args: &[&str], input: &str) -> String {
        let out = self.kubectl_stdin_output(args, input);
        assert!(
            out.status.success(),
            "kubectl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// kubectl with `input` on standard input, succeeding or not.
    pub fn kubectl_stdin_output(&self, args: &[&str], input: &str) -> Output {
        use std::io::Write;
        let mut child = Command::new(self.bin.join("kubectl"))
            .args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .env("KUBECACHEDIR", self.dir.join("kube-cache"))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("running kubectl");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    }

    /// `kubectl apply` of manifests given as JSON values.
    pub fn apply(&self, manifests: &[serde_json::Value]) -> String {
        let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": manifests});
        self.kubectl_stdin(&["apply", "-f", "-"], &list.to_string())
    }

    /// The PID of a component (etcd, kube-apiserver, kube-controller-manager).
    pub fn pid(&self, component: &str) -> u32 {
        let pids = std::fs::read_to_string(self.dir.join("pids")).unwrap();
        pids.lines()
            .find_map(|l| {
                let (name, pid) = l.split_once(' ')?;
                (name == component).then(|| pid.trim().parse().ok())?
            })
            .unwrap_or_else(|| panic!("no {component} in {pids}"))
    }

    /// `kubectl wait --for=condition=Ready` on one object (for example "whsub/orders").
    pub fn wait_ready(&self, namespace: &str, object: &str) {
        self.kubectl_ok(&[
            "wait",
            "--for=condition=Ready",
            object,
            "-n",
            namespace,
            "--timeout=60s",
        ]);
    }

    /// A token of a ServiceAccount for herald's audience, as producers and readers get
    /// theirs (`kubectl create token NAME --audience herald`).
    pub fn token(&self, namespace: &str, service_account: &str) -> String {
        self.kubectl_ok(&[
            "create",
            "token",
            service_account,
            "-n",
            namespace,
            "--audience",
            "herald",
        ])
        .trim()
        .to_string()
    }

    /// A token of a ServiceAccount for the API server's own audience (what
    /// `kubectl create token` gives without `--audience`).
    pub fn api_token(&self, namespace: &str, service_account: &str) -> String {
        self.kubectl_ok(&["create", "token", service_account, "-n", namespace])
            .trim()
            .to_string()
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        let status = Command::new(repo().join("scripts/control-plane"))
            .arg("down")
            .arg("--dir")
            .arg(&self.dir)
            .status();
        if !matches!(status, Ok(s) if s.success()) {
            eprintln!(
                "control plane teardown in {} failed: {status:?}",
                self.dir.display()
            );
        }
    }
}
