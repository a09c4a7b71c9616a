//! A real OTLP/HTTP receiver for the tests: `tests/interop/otlp_sink.py` (oteltest's sink,
//! from PyPI) run by the test Python, its spans read back as JSON lines.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

pub struct OtlpSink {
    child: Child,
    lines: Arc<Mutex<Vec<Value>>>,
    pub port: u16,
}

impl OtlpSink {
    /// Starts the sink on a free port and waits until it takes connections.
    pub fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let python = std::env::var("HERALD_PYTHON").unwrap_or_else(|_| "python3".into());
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/interop/otlp_sink.py");
        let mut child = Command::new(&python)
            .args([script, &port.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("running {python}: {e}"));
        let lines = Arc::new(Mutex::new(Vec::new()));
        let out = child.stdout.take().unwrap();
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Ok(value) = serde_json::from_str(&line) {
                    sink.lock().unwrap().push(value);
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "the OTLP sink exited ({status}): is oteltest installed (scripts/test's .venv)?"
                );
            }
            assert!(Instant::now() < deadline, "the OTLP sink never listened");
            std::thread::sleep(Duration::from_millis(50));
        }
        Self { child, lines, port }
    }

    /// The spans received so far of `trace_id` (hex).
    pub fn spans(&self, trace_id: &str) -> Vec<Value> {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l["trace_id"] == trace_id)
            .cloned()
            .collect()
    }

    /// Waits until `count` spans of `trace_id` arrived; returns them.
    pub async fn wait_spans(&self, trace_id: &str, count: usize, deadline: Duration) -> Vec<Value> {
        let until = Instant::now() + deadline;
        loop {
            let spans = self.spans(trace_id);
            if spans.len() >= count {
                return spans;
            }
            assert!(
                Instant::now() < until,
                "{} of {count} spans of trace {trace_id} after {deadline:?}: {:?}",
                spans.len(),
                self.lines.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for OtlpSink {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
