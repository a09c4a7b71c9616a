//! What every benchmark shares: its sizes by mode, its figures (printed as a table and
//! written as JSON for `scripts/bench`), percentiles, a process's memory, and pending
//! deliveries written straight into a store.
//!
//! Environment:
//! - `HERALD_BENCH_MODE=quick|full` (default full): quick sizes check that every benchmark
//!   still works in seconds; full sizes are the ones the targets speak of.
//! - `HERALD_BENCH_OUT=DIR`: write `DIR/<bench>.json` (created if needed).
//!
//! A figure is `{name, label, value, unit, reference, reference_name, ratio, target, met}`:
//! `reference` is a value measured in the same run (or null), `ratio` is value / reference,
//! `target` is the goal as text and `met` whether it was reached (null without a target).
//! A benchmark that produces a value that is not a positive finite number panics: that is a
//! broken benchmark, whatever the machine's speed.
#![allow(dead_code)]

use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value, json};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Mode {
    Quick,
    Full,
}

impl Mode {
    pub fn from_env() -> Self {
        match std::env::var("HERALD_BENCH_MODE").as_deref() {
            Ok("quick") => Mode::Quick,
            Ok("full") | Ok("") | Err(_) => Mode::Full,
            Ok(other) => panic!("HERALD_BENCH_MODE={other:?}: expected quick or full"),
        }
    }

    /// `quick` in quick mode, `full` in full mode.
    pub fn pick<T>(self, quick: T, full: T) -> T {
        match self {
            Mode::Quick => quick,
            Mode::Full => full,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Mode::Quick => "quick",
            Mode::Full => "full",
        }
    }
}

/// A figure's goal.
#[derive(Clone, Copy, Debug)]
pub enum Target {
    /// value ≤ this
    AtMost(f64),
    /// value < this
    Below(f64),
    /// value / reference ≥ this
    RatioAtLeast(f64),
    /// value / reference ≤ this
    RatioAtMost(f64),
}

#[derive(Debug)]
pub struct Figure {
    name: String,
    label: String,
    value: f64,
    unit: String,
    reference: Option<(String, f64)>,
    target: Option<Target>,
}

impl Figure {
    /// The value it is compared with, measured in the same run, and what that is.
    pub fn reference(&mut self, name: &str, value: f64) -> &mut Self {
        self.reference = Some((name.to_string(), value));
        self
    }

    pub fn target(&mut self, target: Target) -> &mut Self {
        self.target = Some(target);
        self
    }

    fn ratio(&self) -> Option<f64> {
        self.reference.as_ref().map(|(_, r)| self.value / r)
    }

    fn target_text(&self) -> Option<String> {
        let unit = &self.unit;
        self.target.map(|t| match t {
            Target::AtMost(v) => format!("≤ {} {unit}", number(v)),
            Target::Below(v) => format!("< {} {unit}", number(v)),
            Target::RatioAtLeast(v) => format!("≥ {v} × reference"),
            Target::RatioAtMost(v) => format!("≤ {v} × reference"),
        })
    }

    fn met(&self) -> Option<bool> {
        let ratio = self.ratio();
        self.target.map(|t| match t {
            Target::AtMost(v) => self.value <= v,
            Target::Below(v) => self.value < v,
            Target::RatioAtLeast(v) => ratio.is_some_and(|r| r >= v),
            Target::RatioAtMost(v) => ratio.is_some_and(|r| r <= v),
        })
    }

    fn check(&self) {
        let sane = |v: f64| v.is_finite() && v > 0.0;
        assert!(
            sane(self.value),
            "figure {} is {} {}: not a positive finite number, the benchmark is broken",
            self.name,
            self.value,
            self.unit
        );
        if let Some((name, value)) = &self.reference {
            assert!(
                sane(*value),
                "the reference of figure {} ({name}) is {value}: the benchmark is broken",
                self.name
            );
        }
        assert!(
            self.target.is_none()
                || self.reference.is_some()
                || matches!(self.target, Some(Target::AtMost(_) | Target::Below(_))),
            "figure {} has a ratio target and no reference",
            self.name
        );
    }

    fn json(&self) -> Value {
        json!({
            "name": self.name,
            "label": self.label,
            "value": self.value,
            "unit": self.unit,
            "reference": self.reference.as_ref().map(|r| r.1),
            "reference_name": self.reference.as_ref().map(|r| r.0.clone()),
            "ratio": self.ratio(),
            "target": self.target_text(),
            "met": self.met(),
        })
    }
}

/// Up to three significant digits, without a trailing ".0".
pub fn number(v: f64) -> String {
    let digits = if v.abs() >= 100.0 {
        0
    } else if v.abs() >= 10.0 {
        1
    } else if v.abs() >= 1.0 {
        2
    } else {
        3
    };
    let text = format!("{v:.digits$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

/// `n` with thousands separators: 1,000,000.
pub fn thousands(n: impl std::fmt::Display) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// One benchmark's figures and the sizes it ran with.
pub struct Report {
    bench: String,
    pub mode: Mode,
    params: Map<String, Value>,
    figures: Vec<Figure>,
    started: Instant,
}

impl Report {
    pub fn new(bench: &str) -> Self {
        let _ = rustls::crypto::ring::default_provider().install_default();
        Self {
            bench: bench.to_string(),
            mode: Mode::from_env(),
            params: Map::new(),
            figures: Vec::new(),
            started: Instant::now(),
        }
    }

    /// A size or setting the figures were measured with (written to the JSON).
    pub fn param(&mut self, key: &str, value: impl Into<Value>) {
        self.params.insert(key.to_string(), value.into());
    }

    /// Adds a figure: `name` is stable across modes (what scripts/bench expects), `label`
    /// says what was measured, with its size.
    pub fn add(&mut self, name: &str, label: &str, value: f64, unit: &str) -> &mut Figure {
        self.figures.push(Figure {
            name: name.to_string(),
            label: label.to_string(),
            value,
            unit: unit.to_string(),
            reference: None,
            target: None,
        });
        self.figures.last_mut().unwrap()
    }

    /// Two figures of one reading of /proc: `<prefix>.rss` (VmRSS) and `<prefix>.hwm`
    /// (VmHWM, the peak), "with `what`", each against the same field of `reference` (a
    /// reading "with `reference_what`"), both with `target` if any.
    pub fn memory(
        &mut self,
        prefix: &str,
        what: &str,
        value: Memory,
        reference_what: &str,
        reference: Memory,
        target: Option<Target>,
    ) {
        for (field, name, value, reference) in [
            ("rss", "RSS", value.rss_mb, reference.rss_mb),
            ("hwm", "peak RSS (VmHWM)", value.hwm_mb, reference.hwm_mb),
        ] {
            let figure = self
                .add(
                    &format!("{prefix}.{field}"),
                    &format!("{name} with {what}"),
                    value,
                    "MB",
                )
                .reference(&format!("{name} with {reference_what}"), reference);
            if let Some(target) = target {
                figure.target(target);
            }
        }
    }

    /// Prints the table, writes `$HERALD_BENCH_OUT/<bench>.json`, and panics on a figure
    /// that is not a positive finite number.
    pub fn finish(self) {
        println!();
        println!("{} ({} mode)", self.bench, self.mode.name());
        println!("| figure | value | reference | ratio | target | met |");
        println!("| --- | --- | --- | --- | --- | --- |");
        for f in &self.figures {
            let reference = f
                .reference
                .as_ref()
                .map(|(name, v)| format!("{} {} ({name})", number(*v), f.unit))
                .unwrap_or_else(|| "—".into());
            let ratio = f.ratio().map(number).unwrap_or_else(|| "—".into());
            let met = match f.met() {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "—",
            };
            println!(
                "| {} | {} {} | {reference} | {ratio} | {} | {met} |",
                f.label,
                number(f.value),
                f.unit,
                f.target_text().unwrap_or_else(|| "—".into()),
            );
        }
        for f in &self.figures {
            f.check();
        }
        if let Some(dir) = std::env::var_os("HERALD_BENCH_OUT").filter(|d| !d.is_empty()) {
            let dir = Path::new(&dir);
            std::fs::create_dir_all(dir).unwrap();
            let json = json!({
                "bench": self.bench,
                "mode": self.mode.name(),
                "seconds": self.started.elapsed().as_secs_f64(),
                "params": self.params,
                "figures": self.figures.iter().map(Figure::json).collect::<Vec<_>>(),
            });
            let path = dir.join(format!("{}.json", self.bench));
            std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).unwrap();
            println!("figures written to {}", path.display());
        }
    }
}

/// The `p` quantile (0..=1) of `samples`, nearest rank.
pub fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    samples[((samples.len() as f64 * p) as usize).min(samples.len() - 1)]
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A process's resident memory now and at its peak, in MB (10^6 bytes), from
/// /proc/<pid>/status (VmRSS, VmHWM).
#[derive(Clone, Copy, Debug)]
pub struct Memory {
    pub rss_mb: f64,
    pub hwm_mb: f64,
}

pub fn memory(pid: u32) -> Memory {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("reading /proc/{pid}/status: {e}"));
    let field = |name: &str| -> f64 {
        let kib: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"));
        kib * 1024.0 / 1e6
    };
    Memory {
        rss_mb: field("VmRSS:"),
        hwm_mb: field("VmHWM:"),
    }
}

/// CPU time (user + system) a process has used so far, in seconds, from /proc/<pid>/stat
/// ("self" for this process).
pub fn cpu_seconds(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .unwrap_or_else(|e| panic!("reading /proc/{pid}/stat: {e}"));
    // Fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat[stat.rfind(')').expect("a stat line") + 2..]
        .split_whitespace()
        .collect();
    let ticks = |i: usize| fields[i].parse::<f64>().expect("a tick count");
    // utime and stime are fields 14 and 15 of the line (indices 11 and 12 after the name),
    // in USER_HZ ticks, which the kernel's ABI fixes at 100 per second.
    (ticks(11) + ticks(12)) / 100.0
}

/// Writes `events` events of `namespace` straight into the store's tables at `db`
/// (herald.db, schema already created, no herald process on it), in one transaction; each
/// `(uid, every)` gets a pending delivery, due now, for every `every`-th event. Publishing a million events through
/// the API would take a benchmark's whole budget. Returns how long the writing took.
pub fn seed_pending(db: &Path, namespace: &str, events: u64, targets: &[(&str, u64)]) -> Duration {
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let mut conn = rusqlite::Connection::open(db).unwrap();
    let started = Instant::now();
    let tx = conn.transaction().unwrap();
    {
        let first: i64 = tx
            .query_row("SELECT coalesce(max(id), 0) + 1 FROM events", [], |r| {
                r.get(0)
            })
            .unwrap();
        let mut event = tx
            .prepare("INSERT INTO events (id, namespace, event_id, event_type, body, published_ms, matched) VALUES (?1, ?2, ?3, 'seeded', x'7b7d', ?4, ?5)")
            .unwrap();
        let mut delivery = tx
            .prepare("INSERT INTO deliveries (event, sub_uid, state, due_ms, window_start_ms) VALUES (?1, ?2, 0, ?3, ?3)")
            .unwrap();
        for i in 0..events {
            let id = first + i as i64;
            let matched = targets
                .iter()
                .filter(|(_, every)| i.is_multiple_of(*every))
                .count() as i64;
            event
                .execute(rusqlite::params![
                    id,
                    namespace,
                    format!("seeded-{id}"),
                    now_ms,
                    matched
                ])
                .unwrap();
            for (uid, every) in targets {
                if i.is_multiple_of(*every) {
                    delivery
                        .execute(rusqlite::params![id, uid, now_ms])
                        .unwrap();
                }
            }
        }
    }
    tx.commit().unwrap();
    started.elapsed()
}
