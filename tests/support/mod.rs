//! Shared helpers for the integration tests; each test binary uses a part of them.
#![allow(dead_code)]

pub mod control_plane;
pub mod cpu;
pub mod herald;
pub mod operator;
pub mod otlp;
pub mod postgres;
pub mod receiver;
pub mod scale_out;
pub mod tls;

/// The sum of metric `name`'s series whose labels contain `labels`, scraped from
/// `{base}/metrics`.
pub async fn scrape(http: &reqwest::Client, base: &str, name: &str, labels: &str) -> f64 {
    let text = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    metric_sum(&text, name, labels)
}

/// The sum of metric `name`'s series whose labels contain `labels`, in a /metrics text.
fn metric_sum(text: &str, name: &str, labels: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Sends signal `name` (STOP, CONT, ...) to process `pid`. `kill` returns once the signal
/// is queued, while the process's threads stop one by one as each is next scheduled (on a
/// loaded machine, milliseconds later, and an API server answers meanwhile): after STOP
/// this waits until every thread of it is stopped.
pub fn signal(pid: u32, name: &str) {
    // `kill -STOP 0` would stop the whole process group, this test included.
    assert_ne!(pid, 0, "no process to send {name} to");
    let status = std::process::Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(status.success(), "kill -{name} {pid} failed");
    if name != "STOP" {
        return;
    }
    let stopped = |task: std::fs::DirEntry| {
        // The state follows the command name, which is in parentheses and may hold spaces.
        std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
            stat.rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with(['T', 't']))
        })
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap_or_else(|e| panic!("process {pid} gone after SIGSTOP: {e}"))
        .all(|task| stopped(task.unwrap()))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "process {pid} did not stop within 10 s of SIGSTOP"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// A new empty folder `<temp>/<prefix>-<pid>-<n>` for one test's files.
pub fn fresh_dir(prefix: &str) -> std::path::PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "{prefix}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A test's own folder (see [`fresh_dir`]), removed when it is dropped; kept for
/// inspection when dropped while the test fails, as herald's folder is.
pub struct Scratch(std::path::PathBuf);

impl Scratch {
    pub fn new(prefix: &str) -> Self {
        Self(fresh_dir(prefix))
    }
}

impl std::ops::Deref for Scratch {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "the test's folder kept for inspection: {}",
                self.0.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Runs the test Python (HERALD_PYTHON, else `python3`: scripts/test puts its .venv, with
/// the pinned packages, on PATH) with `args`, feeding it `input`; returns what it printed.
/// Fails with its stderr, naming `what` it was asked to do, unless it exits 0.
pub fn python(args: &[&str], input: &[u8], what: &str) -> Vec<u8> {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let python = std::env::var("HERALD_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut child = Command::new(&python)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running {python}: {e}"));
    child.stdin.take().unwrap().write_all(input).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{what} failed (is the .venv of scripts/test on PATH?): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}
