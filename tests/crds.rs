//! The checked-in CRDs (crds/ and the chart's copy) are exactly what the code generates,
//! and every field a user can write or read is documented for `kubectl explain`.
//!
//! The drift test only reads. After changing src/api, regenerate the files with
//! `cargo test --test crds -- --ignored regenerate_crds` (the one test that writes; it is
//! ignored, so the test command never runs it).

use std::path::{Path, PathBuf};

use herald::api::crdgen;
use serde_json::Value;

const COPIES: &[&str] = &["crds", "charts/herald/crds", "config/crd/bases"];
const REGENERATE: &str = "cargo test --test crds -- --ignored regenerate_crds";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// (file name, text) of every CRD as the code renders it.
fn generated() -> Vec<(String, String)> {
    crdgen::all()
        .into_iter()
        .map(|(file, crd)| (file, crdgen::render(&crd).unwrap()))
        .collect()
}

/// The files of a folder, sorted by name.
fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}; run {REGENERATE}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
}

#[test]
fn checked_in_crds_match_the_code() {
    // UPDATE_CRDS used to turn this test into a write; now nothing here writes, and a
    // leftover UPDATE_CRDS in the environment is refused rather than silently ignored.
    assert!(
        std::env::var_os("UPDATE_CRDS").is_none(),
        "UPDATE_CRDS no longer regenerates anything; unset it and run {REGENERATE}"
    );
    let expected = generated();
    for dir in COPIES {
        let dir = root().join(dir);
        for (file, text) in &expected {
            let path = dir.join(file);
            let actual = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{}: {e}; run {REGENERATE}", path.display()));
            assert!(
                actual == *text,
                "{} drifted from the code; run {REGENERATE}",
                path.display()
            );
        }
        let present: Vec<_> = files_in(&dir)
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        let wanted: Vec<_> = expected.iter().map(|(f, _)| f.clone()).collect();
        assert_eq!(
            present,
            wanted,
            "{} holds files the code does not generate",
            dir.display()
        );
    }
}

/// Writes the generated CRDs into crds/ and the chart. Ignored: run it on purpose with
/// `cargo test --test crds -- --ignored regenerate_crds` after changing src/api.
#[test]
#[ignore = "writes crds/ and charts/herald/crds/; run it on purpose after changing src/api"]
fn regenerate_crds() {
    let expected = generated();
    for dir in COPIES {
        let dir = root().join(dir);
        std::fs::create_dir_all(&dir).unwrap();
        for stale in files_in(&dir) {
            let name = stale.file_name().unwrap().to_string_lossy().into_owned();
            if !expected.iter().any(|(file, _)| *file == name) {
                std::fs::remove_file(&stale).unwrap();
            }
        }
        for (file, text) in &expected {
            std::fs::write(dir.join(file), text).unwrap();
        }
    }
}

#[test]
fn herald_crds_prints_the_concatenation_of_crds_dir() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_herald"))
        .arg("crds")
        .output()
        .unwrap();
    assert!(output.status.success());
    // What a user would apply by hand: `cat crds/*.yaml`, the files in name order.
    let files: String = files_in(&root().join("crds"))
        .iter()
        .map(|path| std::fs::read_to_string(path).unwrap())
        .collect();
    assert!(!files.is_empty(), "crds/ is empty");
    assert!(
        String::from_utf8(output.stdout).unwrap() == files,
        "`herald crds` differs from `cat crds/*.yaml`"
    );
}

/// Collects the paths of properties without a description below `schema`.
fn undocumented(schema: &Value, path: &str, out: &mut Vec<String>) {
    if let Some(properties) = schema.get("properties").and_then(Value::as_object) {
        for (name, property) in properties {
            let here = format!("{path}.{name}");
            let described = property
                .get("description")
                .and_then(Value::as_str)
                .is_some_and(|d| !d.trim().is_empty());
            if !described {
                out.push(here.clone());
            }
            undocumented(property, &here, out);
        }
    }
    if let Some(items) = schema.get("items") {
        undocumented(items, &format!("{path}[]"), out);
    }
    if let Some(additional) = schema.get("additionalProperties").filter(|v| v.is_object()) {
        undocumented(additional, &format!("{path}{{}}"), out);
    }
}

#[test]
fn every_spec_and_status_field_has_a_description() {
    for (file, crd) in crdgen::all() {
        let crd = serde_json::to_value(&crd).unwrap();
        for version in crd["spec"]["versions"].as_array().unwrap() {
            let root = &version["schema"]["openAPIV3Schema"]["properties"];
            let mut missing = Vec::new();
            for part in ["spec", "status"] {
                assert!(root[part].is_object(), "{file}: no {part}");
                undocumented(&root[part], part, &mut missing);
            }
            assert!(
                missing.is_empty(),
                "{file}: fields without a description: {missing:?}"
            );
        }
    }
}

#[test]
fn subscription_schema_validates_what_can_be_checked_statically() {
    let crd = crdgen::all()
        .into_iter()
        .find(|(f, _)| f.starts_with("webhooksubscriptions"))
        .unwrap()
        .1;
    let crd = serde_json::to_value(&crd).unwrap();
    let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
    let required: Vec<_> = spec["required"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for field in ["url", "eventTypes", "signing"] {
        assert!(required.contains(&field), "{field} is not required");
    }
    assert_eq!(spec["properties"]["eventTypes"]["minItems"], 1);
    assert!(
        spec["properties"]["url"]["x-kubernetes-validations"]
            .to_string()
            .contains("isURL")
    );
    let retry = &spec["properties"]["delivery"]["properties"]["retry"];
    assert_eq!(retry["properties"]["maxDuration"]["default"], "72h");
    assert!(retry["properties"]["maxDuration"]["pattern"].is_string());
    assert_eq!(
        spec["properties"]["signing"]["properties"]["scheme"]["enum"],
        serde_json::json!(["standard-webhooks", "stripe"])
    );
    let printer: Vec<_> = crd["spec"]["versions"][0]["additionalPrinterColumns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(printer, ["URL", "Ready", "Pending", "Last Status", "Age"]);
}
