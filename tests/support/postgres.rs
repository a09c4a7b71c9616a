//! A real PostgreSQL server for tests, from Debian's packages, started and stopped through
//! `scripts/postgres` (the one implementation scripts and tests share). Each handle owns a
//! server with its data in a private folder; dropping the handle stops it and removes the
//! folder, also when a test panics.
//!
//! Used by the store's unit tests (`src/store/mod.rs` includes this file) and by the
//! integration tests (`tests/support/mod.rs`), so it needs nothing but std.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

/// Set to 1 to skip the tests that need PostgreSQL (each says so); without it a server
/// that cannot be started fails them.
pub const SKIP_VAR: &str = "HERALD_SKIP_POSTGRES";

pub struct Postgres {
    dir: PathBuf,
    /// `postgres://herald:PASSWORD@127.0.0.1:PORT/herald`: the database `herald`, as
    /// its owner.
    pub url: String,
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/postgres")
}

impl Postgres {
    /// Starts a fresh server. Returns None, with a note on stderr, only when
    /// HERALD_SKIP_POSTGRES=1; otherwise a failure to start fails the test.
    pub fn start() -> Option<Self> {
        if std::env::var(SKIP_VAR).as_deref() == Ok("1") {
            eprintln!("{SKIP_VAR}=1: skipping a test that needs PostgreSQL");
            return None;
        }
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "herald-pg-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let started = Instant::now();
        let output = Command::new(script())
            .arg("up")
            .arg("--dir")
            .arg(&dir)
            .output()
            .expect("running scripts/postgres up");
        // The handle exists before the check, so that a half-started server is torn down.
        let server = Self {
            dir,
            url: String::from_utf8_lossy(&output.stdout).trim().to_string(),
        };
        assert!(
            output.status.success() && server.url.starts_with("postgres://"),
            "PostgreSQL did not start (set {SKIP_VAR}=1 to skip the tests that need it):\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        eprintln!("PostgreSQL started in {} ms", started.elapsed().as_millis());
        Some(server)
    }

    /// The URL of another database on this server (which the caller creates).
    pub fn url_of(&self, database: &str) -> String {
        let (server, _) = self.url.rsplit_once('/').expect("a URL with a database");
        format!("{server}/{database}")
    }

    /// The server's main process (its backends are its children), while it runs.
    #[allow(dead_code)] // the benchmarks only
    pub fn postmaster_pid(&self) -> Option<u32> {
        let pid = std::fs::read_to_string(self.dir.join("data/postmaster.pid")).ok()?;
        pid.lines().next()?.trim().parse().ok()
    }

    /// Stops the server (a clean shutdown), keeping its data.
    pub fn stop(&self) {
        self.run("stop");
    }

    /// Starts the stopped server again, on the same port.
    pub fn restart(&self) {
        self.run("start");
    }

    fn run(&self, what: &str) {
        let output = Command::new(script())
            .arg(what)
            .arg("--dir")
            .arg(&self.dir)
            .output()
            .unwrap_or_else(|e| panic!("running scripts/postgres {what}: {e}"));
        assert!(
            output.status.success(),
            "scripts/postgres {what} failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = Command::new(script())
            .arg("down")
            .arg("--dir")
            .arg(&self.dir)
            .output();
    }
}
