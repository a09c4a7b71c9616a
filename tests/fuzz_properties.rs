//! The fuzz targets as property tests on stable: the very bodies the cargo-fuzz crate runs
//! (`tests/fuzz/targets.rs`), fed by proptest with arbitrary bytes and with mutations of the
//! checked-in seeds (`tests/fuzz/seeds/<target>/`, which also hold every input that once
//! crashed a target). `scripts/fuzz` runs these instead of libFuzzer where no nightly
//! toolchain is installed. `HERALD_FUZZ_CASES` sets the cases per target (default 500);
//! with `HERALD_FUZZ_SECONDS` each target runs batches of that many cases until that many
//! seconds have passed, and prints how many cases it ran.

#[path = "fuzz/targets.rs"]
mod targets;

use std::path::{Path, PathBuf};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz")
}

fn target(name: &str) -> targets::Target {
    targets::TARGETS
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no target {name} in targets::TARGETS"))
        .1
}

/// The seed inputs of a target, by file name.
fn seeds(name: &str) -> Vec<(String, Vec<u8>)> {
    let dir = fuzz_dir().join("seeds").join(name);
    let mut seeds: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&path).unwrap())
        })
        .collect();
    seeds.sort();
    seeds
}

/// An input, shown as a byte string when a case fails.
#[derive(Clone)]
struct Bytes(Vec<u8>);

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "b\"{}\"", self.0.escape_ascii())
    }
}

/// A seed with a few bytes replaced, inserted or removed, or any bytes at all.
fn inputs(seeds: Vec<Vec<u8>>) -> impl Strategy<Value = Bytes> {
    let edits = proptest::collection::vec((any::<usize>(), any::<u8>(), 0u8..3), 0..8);
    let mutated = (proptest::sample::select(seeds), edits).prop_map(|(mut seed, edits)| {
        for (at, byte, op) in edits {
            let at = at % (seed.len() + 1);
            match op {
                0 if at < seed.len() => seed[at] = byte,
                1 if at < seed.len() => {
                    seed.remove(at);
                }
                _ => seed.insert(at, byte),
            }
        }
        seed
    });
    prop_oneof![
        3 => mutated,
        1 => proptest::collection::vec(any::<u8>(), 0..512),
    ]
    .prop_map(Bytes)
}

thread_local! {
    /// Set while proptest shrinks a failure: the many intermediate panics stay quiet and only
    /// the smallest failing input's message is printed.
    static QUIET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn quiet_while_shrinking() {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.get() {
                default(info);
            }
        }));
    });
}

fn check(name: &str) {
    let body = target(name);
    let cases = std::env::var("HERALD_FUZZ_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(500);
    let seconds: Option<u64> = std::env::var("HERALD_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok());
    let strategy = inputs(seeds(name).into_iter().map(|(_, bytes)| bytes).collect());
    let started = std::time::Instant::now();
    let mut ran = 0u64;
    quiet_while_shrinking();
    QUIET.set(true);
    let result = loop {
        let mut runner = TestRunner::new(Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        });
        let batch = runner.run(&strategy, |input| {
            std::panic::catch_unwind(|| body(&input.0))
                .map_err(|_| TestCaseError::fail("the target panicked (message below)"))
        });
        ran += u64::from(cases);
        let time_left = seconds.is_some_and(|s| started.elapsed().as_secs() < s);
        if batch.is_err() || !time_left {
            break batch;
        }
    };
    QUIET.set(false);
    if seconds.is_some() {
        println!(
            "fuzz property {name}: {ran} cases in {:.1}s, {}",
            started.elapsed().as_secs_f64(),
            if result.is_ok() { "ok" } else { "FAILED" }
        );
    }
    if let Err(e) = result {
        if let proptest::test_runner::TestError::Fail(_, input) = &e {
            // Again, aloud: the property's own message for the smallest input.
            let _ = std::panic::catch_unwind(|| body(&input.0));
        }
        panic!(
            "{name}: {e}\nSave the input under tests/fuzz/seeds/{name}/ as a regression \
             seed once fixed."
        );
    }
}

macro_rules! properties {
    ($($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                check(stringify!($name));
            }
        )*

        /// Every target here is a cargo-fuzz binary and in targets::TARGETS, and the other
        /// way round, so none is fuzzed on one side only.
        #[test]
        fn every_target_runs_in_both_harnesses() {
            let mut here = vec![$(stringify!($name)),*];
            here.sort();
            let mut listed: Vec<&str> = targets::TARGETS.iter().map(|(n, _)| *n).collect();
            listed.sort();
            assert_eq!(here, listed, "targets::TARGETS");
            let mut binaries: Vec<String> = std::fs::read_dir(fuzz_dir().join("fuzz_targets"))
                .unwrap()
                .map(|e| e.unwrap().path().file_stem().unwrap().to_string_lossy().into_owned())
                .collect();
            binaries.sort();
            assert_eq!(here, binaries, "tests/fuzz/fuzz_targets/");
            let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).unwrap();
            for name in here {
                assert!(
                    manifest.contains(&format!("name = \"{name}\"")),
                    "{name} is not a [[bin]] of tests/fuzz/Cargo.toml"
                );
            }
        }
    };
}

properties!(
    standard_webhooks,
    stripe,
    event_decode,
    duration,
    event_type,
    manifests,
    retry_after,
);

/// Each seed as it is, including the inputs that once crashed a target (regressions).
#[test]
fn every_seed_passes_its_target() {
    for (name, body) in targets::TARGETS {
        let seeds = seeds(name);
        assert!(!seeds.is_empty(), "no seeds for {name}");
        for (file, bytes) in seeds {
            if std::panic::catch_unwind(|| body(&bytes)).is_err() {
                panic!("tests/fuzz/seeds/{name}/{file} fails (message above)");
            }
        }
    }
}
