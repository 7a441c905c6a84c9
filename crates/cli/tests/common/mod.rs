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

/// Runs `pipeshard` with extra environment; returns (success, stdout, stderr).
pub fn pipeshard_env(args: &[&str], env: &[(&str, &Path)]) -> (bool, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pipeshard"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("running pipeshard");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A `pipeshard` process killed when dropped.
pub struct Proc {
    pub child: std::process::Child,
}

impl Proc {
    /// Starts `pipeshard args`, and waits for its first stdout line (its address).
    /// Returns the process and the line, or the process's stderr when it exits first.
    pub fn start(args: &[&str], env: &[(&str, &Path)]) -> Result<(Self, String), String> {
        use std::io::{BufRead, BufReader, Read};
        use std::process::Stdio;
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pipeshard"));
        cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("starting pipeshard");
        let stdout = child.stdout.take().unwrap();
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        if line.is_empty() {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            let _ = child.wait();
            return Err(err);
        }
        // Keep draining stderr so the process never blocks on a full pipe.
        let mut stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            let mut sink = Vec::new();
            let _ = stderr.read_to_end(&mut sink);
        });
        std::thread::spawn(move || {
            let mut sink = Vec::new();
            let _ = reader.read_to_end(&mut sink);
        });
        Ok((Self { child }, line.trim().to_string()))
    }

    /// Stops the process now.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A free TCP port on loopback (bound and released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `pipeshard stage` on a shard; returns it and its `host:port`.
pub fn stage(shard: &Path, next: &str, token_file: &Path) -> (Proc, String) {
    start_stage(shard, next, token_file).unwrap_or_else(|e| panic!("stage failed: {e}"))
}

/// Like [`stage`], but returns the failure.
pub fn start_stage(shard: &Path, next: &str, token_file: &Path) -> Result<(Proc, String), String> {
    let (p, line) = Proc::start(
        &[
            "stage",
            "--shard",
            shard.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--next",
            next,
            "--token-file",
            token_file.to_str().unwrap(),
        ],
        &[],
    )?;
    let addr = line
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line: {line}"))
        .to_string();
    Ok((p, addr))
}

/// An HTTP request; returns (status, body).
pub fn http(method: &str, url: &str, body: Option<&str>) -> (u16, String) {
    let (status, text, _) = http_with_retry_after(method, url, body);
    (status, text)
}

/// An HTTP request; returns (status, body, Retry-After header).
pub fn http_with_retry_after(
    method: &str,
    url: &str,
    body: Option<&str>,
) -> (u16, String, Option<String>) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let resp = match (method, body) {
        ("GET", _) => agent.get(url).call(),
        (_, Some(b)) => agent
            .post(url)
            .header("content-type", "application/json")
            .send(b),
        (_, None) => agent.post(url).send_empty(),
    };
    let mut resp = resp.unwrap_or_else(|e| panic!("{method} {url}: {e}"));
    let status = resp.status().as_u16();
    let retry = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    (status, text, retry)
}

/// Writes a cluster token file.
pub fn token_file(dir: &Path, name: &str, token: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, format!("{token}\n")).unwrap();
    p
}

/// `pipeshard split MODEL --out DIR HOW...`; returns the manifest's path.
pub fn split(model: &Path, dir: &Path, how: &[&str]) -> std::path::PathBuf {
    let mut args = vec![
        "split",
        model.to_str().unwrap(),
        "--out",
        dir.to_str().unwrap(),
        "-q",
    ];
    args.extend_from_slice(how);
    ok(&args);
    dir.join("manifest.json")
}

/// `pipeshard up --model MODEL --stages 3 --json EXTRA...` with its cache in `cache`, parsed.
pub fn up_json(model: &Path, cache: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "up",
        "--model",
        model.to_str().unwrap(),
        "--stages",
        "3",
        "--json",
    ];
    args.extend_from_slice(extra);
    let (success, stdout, stderr) = pipeshard_env(&args, &[("PIPESHARD_CACHE", cache)]);
    assert!(success, "up failed:\n{stderr}");
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}
