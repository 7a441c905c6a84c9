//! Helpers for running the `pipeshard` binary in tests.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};

/// Runs `pipeshard` with `args`; returns (success, stdout, stderr).
pub fn pipeshard(args: &[&str]) -> (bool, String, String) {
    let out: Output = Command::new(env!("CARGO_BIN_EXE_pipeshard"))
        .args(args)
        .output()
        .expect("running pipeshard");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs and expects success; returns stdout.
pub fn ok(args: &[&str]) -> String {
    let (success, stdout, stderr) = pipeshard(args);
    assert!(success, "pipeshard {args:?} failed:\n{stderr}");
    stdout
}

/// Runs and expects failure; returns stderr.
pub fn fails(args: &[&str]) -> String {
    let (success, stdout, stderr) = pipeshard(args);
    assert!(
        !success,
        "pipeshard {args:?} should fail, printed:\n{stdout}"
    );
    stderr
}

/// `generate --json` parsed.
pub fn generate_json(model: &Path, extra: &[&str]) -> serde_json::Value {
    let m = model.to_str().unwrap();
    let mut args = vec!["generate", "--model", m, "--json"];
    args.extend_from_slice(extra);
    serde_json::from_str(ok(&args).trim()).expect("one JSON object")
}
