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
