//! The herald binary as a real process in standalone mode: a config folder, a data folder,
//! an ingest API on a free port. It can be SIGKILLed and restarted on the same folders.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::receiver::SECRET;

pub struct Herald {
    child: Option<Child>,
    pub dir: PathBuf,
    pub base: String,
    /// /healthz, /readyz and /metrics when started with `--metrics-listen`.
    pub metrics: Option<String>,
    /// From the last spawn of the process to its ready file (polled every 20 ms).
    pub started_in: Duration,
    args: Vec<String>,
    http: reqwest::Client,
    /// The --publish-token (or HERALD_PUBLISH_TOKEN), sent on every API call.
    token: Option<String>,
    /// Extra environment of the herald process.
    env: Vec<(String, String)>,
    /// Send SIGHUP the moment the ready file appears (see
    /// [`Herald::restart_hangup_at_ready`]).
    hangup_at_ready: bool,
}

/// A subscription manifest (JSON is YAML) with `spec` merged over test defaults.
pub fn subscription(
    namespace: &str,
    name: &str,
    url: &str,
    event_types: &[&str],
    spec: Value,
) -> Value {
    let mut base = json!({
        "url": url,
        "eventTypes": event_types,
        "signing": {"secretRef": {"name": "hook-secret", "key": "secret"}},
    });
    merge(&mut base, &spec);
    json!({
        "apiVersion": "herald.dev/v1alpha1",
        "kind": "WebhookSubscription",
        "metadata": {"name": name, "namespace": namespace},
        "spec": base,
    })
}

/// A producer ServiceAccount that may publish in `namespace`.
pub fn producer(namespace: &str) -> Vec<Value> {
    vec![
        json!({"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": "producer", "namespace": namespace}}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": "producer", "namespace": namespace},
               "rules": [{"apiGroups": ["herald.dev"], "resources": ["webhookevents"], "verbs": ["create"]}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "producer", "namespace": namespace},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "producer"},
               "subjects": [{"kind": "ServiceAccount", "name": "producer", "namespace": namespace}]}),
    ]
}

/// The secret every test subscription signs with, in a namespace.
pub fn secret(namespace: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "hook-secret", "namespace": namespace},
        "stringData": {"secret": SECRET},
    })
}

/// A secret and `lanes` subscriptions `sub-<n>` in `namespace`, each on its own receiver
/// path and event type `<prefix>.<n>`, with lane width `width`.
pub fn lanes(
    receiver: &super::receiver::Receiver,
    namespace: &str,
    prefix: &str,
    lanes: usize,
    width: usize,
    paused: bool,
) -> Vec<Value> {
    let mut list = vec![secret(namespace)];
    for lane in 0..lanes {
        list.push(subscription(
            namespace,
            &format!("sub-{lane}"),
            &receiver.url(&format!("/sub-{lane}")),
            &[&format!("{prefix}.{lane}")],
            json!({"paused": paused, "delivery": {"maxInFlight": width}}),
        ));
    }
    list
}

/// `count` active subscriptions `s-<n>` to `url`, `per_namespace` in each namespace
/// `idle-<n>`, with their namespaces' secrets first, for an event type nobody publishes:
/// idle subscriptions, as the memory benchmarks hold them. With `count` 0, one secret.
pub fn idle_subscriptions(count: usize, per_namespace: usize, url: &str) -> Vec<Value> {
    let namespaces = count.div_ceil(per_namespace).max(1);
    let mut list: Vec<Value> = (0..namespaces)
        .map(|n| secret(&format!("idle-{n}")))
        .collect();
    list.extend((0..count).map(|i| {
        subscription(
            &format!("idle-{}", i / per_namespace),
            &format!("s-{}", i % per_namespace),
            url,
            &["idle"],
            json!({}),
        )
    }));
    list
}

pub fn quota(namespace: &str, max_in_flight: u32) -> Value {
    json!({
        "apiVersion": "herald.dev/v1alpha1",
        "kind": "WebhookQuota",
        "metadata": {"name": "quota", "namespace": namespace},
        "spec": {"maxInFlight": max_in_flight},
    })
}

/// Asserts an attempt failed transiently without a status code (nothing answered it);
/// returns its message.
pub fn transient_message(attempt: &Value) -> &str {
    assert_eq!(attempt["outcome"], "Transient", "{attempt}");
    assert!(attempt["statusCode"].is_null(), "{attempt}");
    attempt["message"].as_str().unwrap()
}

/// JSON merge patch (RFC 7386): objects merge, null removes, anything else replaces.
pub fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

/// `herald run` on `dir`: its store in `dir/data`, its log appended to `dir/herald.log`, the
/// ingest API on a free loopback port announced in `ready` (removed first). Settings come
/// from the test alone, never from the caller's environment.
pub fn run_command(dir: &std::path::Path, ready: &std::path::Path) -> Command {
    let _ = std::fs::remove_file(ready);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("herald.log"))
        .unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_herald"));
    for (key, _) in std::env::vars().filter(|(k, _)| k.starts_with("HERALD_")) {
        command.env_remove(key);
    }
    command
        .arg("run")
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--ready-file")
        .arg(ready)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
    command
}

impl Herald {
    /// Writes the manifests and starts herald on them. `args` are extra `herald run` flags.
    pub fn start(manifests: &[Value], args: &[&str]) -> Self {
        Self::start_env(manifests, args, &[])
    }

    /// As [`Herald::start`], with extra environment variables for herald.
    pub fn start_env(manifests: &[Value], args: &[&str], env: &[(&str, &str)]) -> Self {
        let dir = super::fresh_dir("herald-it");
        std::fs::create_dir_all(dir.join("config")).unwrap();
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut herald = Self {
            child: None,
            dir,
            base: String::new(),
            metrics: None,
            started_in: Duration::ZERO,
            args: args.iter().map(|s| s.to_string()).collect(),
            http: reqwest::Client::new(),
            token: args
                .windows(2)
                .find(|w| w[0] == "--publish-token")
                .map(|w| w[1].to_string())
                .or_else(|| {
                    env.iter()
                        .find(|(k, _)| *k == "HERALD_PUBLISH_TOKEN")
                        .map(|(_, v)| v.to_string())
                }),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            hangup_at_ready: false,
        };
        herald.write_files(manifests);
        herald.spawn();
        herald
    }

    fn spawn(&mut self) {
        let ready = self.dir.join("ready");
        let child = run_command(&self.dir, &ready)
            .arg("--standalone")
            .arg("--config")
            .arg(self.dir.join("config"))
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .spawn()
            .unwrap();
        self.child = Some(child);
        let spawned = Instant::now();
        let deadline = spawned + Duration::from_secs(60);
        loop {
            if let Ok(address) = std::fs::read_to_string(&ready) {
                self.started_in = spawned.elapsed();
                if self.hangup_at_ready {
                    self.hangup();
                }
                // Line 1: the ingest API; line 2, with --metrics-listen: the metrics port.
                // Line 1 is `https://ADDRESS` when herald serves TLS.
                let mut lines = address.lines();
                let ingest = lines.next().unwrap_or_default();
                self.base = if ingest.contains("://") {
                    ingest.to_string()
                } else {
                    format!("http://{ingest}")
                };
                self.metrics = lines.next().map(|a| format!("http://{a}"));
                return;
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "herald exited with {status} before serving:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "herald did not start in 60s:\n{}",
                self.log()
            );
            std::thread::sleep(if self.hangup_at_ready {
                Duration::from_micros(200)
            } else {
                Duration::from_millis(20)
            });
        }
    }

    /// Makes the API calls with this client (for an ingest API that serves TLS).
    pub fn use_client(&mut self, client: reqwest::Client) {
        self.http = client;
    }

    /// The sum of a metric's series whose labels contain `labels`, from /metrics (herald
    /// started with `--metrics-listen`).
    pub async fn metric(&self, name: &str, labels: &str) -> f64 {
        let url = self
            .metrics
            .as_ref()
            .expect("herald runs with --metrics-listen");
        super::scrape(&self.http, url, name, labels).await
    }

    /// The herald process's id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether the herald process is still running.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().unwrap().is_none())
    }

    /// Waits until herald's log holds `needle` at least `times` times; returns the log.
    pub async fn wait_log(&self, needle: &str, times: usize, deadline: Duration) -> String {
        let end = Instant::now() + deadline;
        loop {
            let log = self.log();
            if log.matches(needle).count() >= times {
                return log;
            }
            assert!(
                Instant::now() < end,
                "timed out waiting for {times}x {needle:?} in herald's log:\n{log}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("herald.log")).unwrap_or_default()
    }

    /// Replaces the config folder's manifests (atomically) and asks herald to reload.
    pub fn write_config(&self, manifests: &[Value]) {
        self.write_files(manifests);
        self.hangup();
    }

    /// Replaces the config folder's manifests (atomically), without a signal: herald sees it
    /// when it polls the folder.
    pub fn write_files(&self, manifests: &[Value]) {
        let text: String = manifests.iter().map(|m| format!("---\n{m}\n")).collect();
        self.write_text("manifests.yaml", &text);
    }

    /// Writes one file of the config folder (atomically), without a signal.
    pub fn write_text(&self, file: &str, text: &str) {
        let path = self.dir.join("config").join(file);
        let tmp = self.dir.join(format!("{file}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    }

    /// Sends SIGHUP: reload the folder now.
    pub fn hangup(&self) {
        if let Some(child) = &self.child {
            let _ = Command::new("kill")
                .arg("-HUP")
                .arg(child.id().to_string())
                .status();
        }
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts again on the same folders.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Starts again on the same folders and sends SIGHUP the moment the ready file appears.
    pub fn restart_hangup_at_ready(&mut self) {
        self.kill();
        self.hangup_at_ready = true;
        self.spawn();
        self.hangup_at_ready = false;
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn authorized(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.post_with_headers(path, body, &[]).await
    }

    /// [`Herald::post`] with these headers too.
    pub async fn post_with_headers(
        &self,
        path: &str,
        body: Value,
        headers: &[(&str, &str)],
    ) -> (u16, Value) {
        let mut request = self.authorized(self.http.post(format!("{}{path}", self.base)));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = request.json(&body).send().await.unwrap();
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        let response = self
            .authorized(self.http.get(format!("{}{path}", self.base)))
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }

    /// Publishes one event; panics unless it is accepted.
    pub async fn publish(&self, namespace: &str, event: Value) -> Value {
        let (status, body) = self
            .post(&format!("/v1/namespaces/{namespace}/events"), event)
            .await;
        assert_eq!(status, 202, "publish refused: {body}");
        body
    }

    /// The `items` of GET `path`, which must answer 200.
    async fn items(&self, path: &str) -> Vec<Value> {
        let (status, body) = self.get(path).await;
        assert_eq!(status, 200, "{body}");
        body["items"].as_array().cloned().unwrap_or_default()
    }

    pub async fn deliveries(&self, namespace: &str, name: &str, state: &str) -> Vec<Value> {
        self.items(&format!(
            "/v1/namespaces/{namespace}/subscriptions/{name}/attempts?state={state}&limit=10000"
        ))
        .await
    }

    /// Every attempt of event `id` to subscription `name`.
    pub async fn event_attempts(&self, namespace: &str, name: &str, id: &str) -> Vec<Value> {
        self.items(&format!(
            "/v1/namespaces/{namespace}/subscriptions/{name}/events/{id}/attempts"
        ))
        .await
    }

    /// Publishes event `id` of type `kind` and asserts it reaches `receiver` within
    /// `prompt` of the publish.
    pub async fn publish_promptly(
        &self,
        namespace: &str,
        receiver: &super::receiver::Receiver,
        id: &str,
        kind: &str,
        prompt: Duration,
    ) {
        let sent = Instant::now();
        self.publish(namespace, json!({"id": id, "type": kind}))
            .await;
        receiver
            .wait_until(&format!("{id} at the receiver"), prompt, |hits| {
                hits.iter().any(|h| h.header("webhook-id") == id)
            })
            .await;
        let took = sent.elapsed();
        assert!(took < prompt, "{id} took {took:?}");
    }

    /// Polls until `done` holds for the answer of GET `path`, or panics at the deadline.
    pub async fn poll(
        &self,
        what: &str,
        path: &str,
        deadline: Duration,
        done: impl Fn(u16, &Value) -> bool,
    ) -> Value {
        let end = Instant::now() + deadline;
        loop {
            let (status, body) = self.get(path).await;
            if done(status, &body) {
                return body;
            }
            assert!(
                Instant::now() < end,
                "timed out waiting for {what}: last answer {status} {body}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the subscription is gone from herald (the purge has committed).
    pub async fn wait_removed(&self, namespace: &str, name: &str) {
        self.poll(
            &format!("{namespace}/{name} to be removed"),
            &format!("/v1/namespaces/{namespace}/subscriptions/{name}"),
            Duration::from_secs(30),
            |status, _| status == 404,
        )
        .await;
    }
}

impl Drop for Herald {
    fn drop(&mut self) {
        self.kill();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!(
                "herald's folder kept for inspection: {}",
                self.dir.display()
            );
        }
    }
}
