//! Shared helpers for the integration tests; each test binary uses a part of them.
#![allow(dead_code)]

pub mod control_plane;
pub mod cpu;
pub mod herald;
pub mod operator;
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
