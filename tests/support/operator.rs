//! herald in cluster mode as a real process, against a [`ControlPlane`]: started with the
//! control plane's kubeconfig, an ingest API and a health port on free loopback ports, a
//! data folder of its own. It can be SIGKILLed and started again on the same folder.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::control_plane::ControlPlane;
use super::herald::run_command;

pub struct Operator {
    child: Option<Child>,
    pub dir: PathBuf,
    kubeconfig: PathBuf,
    args: Vec<String>,
    /// The ingest API, http://127.0.0.1:PORT.
    pub base: String,
    /// /healthz and /readyz, http://127.0.0.1:PORT.
    pub health: String,
    /// The aggregated API, https://ADDRESS:PORT, when started with --aggregated-listen.
    pub aggregated: Option<String>,
    /// From the last spawn of the process to /readyz answering 200 (polled every 50 ms).
    pub started_in: Duration,
    http: reqwest::Client,
}

impl Operator {
    /// Starts herald in cluster mode and waits until /readyz says ok. `args` are extra
    /// `herald run` flags.
    pub async fn start(cp: &ControlPlane, args: &[&str]) -> Self {
        let dir = super::fresh_dir("herald-op");
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut operator = Self {
            child: None,
            dir,
            kubeconfig: cp.kubeconfig.clone(),
            args: args.iter().map(|s| s.to_string()).collect(),
            base: String::new(),
            health: String::new(),
            aggregated: None,
            started_in: Duration::ZERO,
            http: reqwest::Client::new(),
        };
        operator.spawn().await;
        operator
    }

    async fn spawn(&mut self) {
        let ready = self.dir.join("ready");
        let child = run_command(&self.dir, &ready)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--metrics-listen")
            .arg("127.0.0.1:0")
            .arg("--egress-allow")
            .arg("127.0.0.0/8")
            .args(&self.args)
            .env_remove("KUBECONFIG")
            .spawn()
            .unwrap();
        self.child = Some(child);
        let spawned = Instant::now();
        let deadline = spawned + Duration::from_secs(90);
        loop {
            if let Ok(text) = std::fs::read_to_string(&ready) {
                let mut lines = text.lines();
                self.base = format!("http://{}", lines.next().unwrap());
                self.health = format!("http://{}", lines.next().unwrap());
                self.aggregated = lines.next().map(str::to_string);
                break;
            }
            self.check_alive();
            assert!(
                Instant::now() < deadline,
                "herald did not serve in 90s:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        loop {
            if let Ok(r) = self
                .http
                .get(format!("{}/readyz", self.health))
                .send()
                .await
                && r.status().as_u16() == 200
            {
                self.started_in = spawned.elapsed();
                return;
            }
            self.check_alive();
            assert!(
                Instant::now() < deadline,
                "herald not ready in 90s:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn check_alive(&mut self) {
        if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
            panic!("herald exited with {status}:\n{}", self.log());
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("herald.log")).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).unwrap_or_default()
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends a signal (STOP, CONT, ...) to the herald process.
    pub fn signal(&self, name: &str) {
        super::signal(self.pid(), name);
    }

    /// Starts again on the same data folder.
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn().await;
    }

    /// SIGTERM, then waits for the exit; returns the exit code.
    pub fn terminate(&mut self, deadline: Duration) -> Option<i32> {
        let mut child = self.child.take()?;
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status();
        let end = Instant::now() + deadline;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status.code();
            }
            if Instant::now() > end {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The sum of a metric's series whose labels contain `labels`, from /metrics.
    pub async fn metric(&self, name: &str, labels: &str) -> f64 {
        super::scrape(&self.http, &self.health, name, labels).await
    }

    /// A request to the ingest API with an optional bearer token; (status, JSON body).
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut request = self.http.request(method, format!("{}{path}", self.base));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        let text = response.text().await.unwrap_or_default();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    /// A call that must answer `expected`. A grant made just before may take a moment to
    /// reach the API server's authorizer (and herald caches a refusal for 2 s), so a 403 is
    /// retried for up to 15 s when something else is expected.
    pub async fn expect(
        &self,
        method: reqwest::Method,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
        expected: u16,
    ) -> Value {
        let end = Instant::now() + Duration::from_secs(15);
        loop {
            let (status, answer) = self.call(method.clone(), path, token, body.clone()).await;
            if status == expected {
                return answer;
            }
            assert!(
                status == 403 && expected != 403 && Instant::now() < end,
                "{method} {path} answered {status} {answer}, not {expected}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Publishes an event; asserts 202 (see [`Operator::expect`]).
    pub async fn publish(&self, namespace: &str, token: &str, event: Value) -> Value {
        self.expect(
            reqwest::Method::POST,
            &format!("/v1/namespaces/{namespace}/events"),
            Some(token),
            Some(event),
            202,
        )
        .await
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.kill();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("herald's log ({}):\n{}", self.dir.display(), self.log());
        }
    }
}
