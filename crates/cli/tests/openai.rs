//! The official `openai` Python package against `pipeshard up` on SmolLM2-135M, three stage
//! processes. `.ci/run` installs the package; without it this test fails, unless
//! `PIPESHARD_SKIP_OPENAI=1` says to skip it.

mod common;

use std::process::Command;

use common::Proc;
use pipeshard_shard::{fetch, known_model};

#[test]
fn the_openai_python_client_works_against_up() {
    let has_openai = Command::new("python3")
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_openai {
        if std::env::var_os("PIPESHARD_SKIP_OPENAI").is_some() {
            eprintln!("skipped: the openai package is not installed");
            return;
        }
        panic!("python3 -m pip install openai (or set PIPESHARD_SKIP_OPENAI=1)");
    }
    let model = fetch(known_model("smollm2-135m").unwrap(), true).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let (_up, line) = Proc::start(
        &[
            "up",
            "--model",
            model.to_str().unwrap(),
            "--stages",
            "3",
            "--port",
            "0",
            "--model-name",
            "smollm2-135m",
        ],
        &[("PIPESHARD_CACHE", cache.path())],
    )
    .unwrap_or_else(|e| panic!("up failed: {e}"));
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no URL in: {line}"));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let out = Command::new("python3")
        .args([script, url])
        .output()
        .expect("running python3");
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
