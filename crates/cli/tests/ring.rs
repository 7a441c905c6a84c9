//! The ring across processes on loopback: `up`, `stage` and `serve` on tiny models. Tokens
//! must equal the unsplit model's; a bad ring, a bad request or a dead stage gets a clear
//! error.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{
    fails, free_port, generate_json, http, pipeshard_env, split, stage, start_stage, token_file,
    up_json, Proc,
};
use pipeshard_testkit::{tiny_model, Flavour};
use serde_json::{json, Value};

#[test]
fn three_stage_processes_give_the_unsplit_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    for flavour in [Flavour::Llama, Flavour::Qwen2] {
        let m = tiny_model(tmp.path(), flavour, 11);
        for extra in [
            &["--prompt", "hello there, ring", "--max-tokens", "40"][..],
            &[
                "--prompt",
                "sampled",
                "--max-tokens",
                "40",
                "--temperature",
                "0.9",
                "--seed",
                "5",
            ][..],
        ] {
            let want = generate_json(&m, extra);
            let got = up_json(&m, tmp.path(), extra);
            assert_eq!(got["tokens"], want["tokens"], "{flavour:?} {extra:?}");
            assert_eq!(got["text"], want["text"]);
            assert!(!want["tokens"].as_array().unwrap().is_empty());
            // Every stage reported its compute time.
            assert_eq!(
                got["stage_compute_ms"].as_array().unwrap().len(),
                3,
                "{got}"
            );
        }
    }
}

/// Runs `serve` expecting it to refuse the ring; returns its stderr.
fn serve_fails(manifest: &Path, stages: &[&str], token: &Path, ring_port: u16) -> String {
    let ring = format!("127.0.0.1:{ring_port}");
    let mut args = vec![
        "serve",
        "--manifest",
        manifest.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--ring-listen",
        &ring,
        "--token-file",
        token.to_str().unwrap(),
    ];
    for s in stages {
        args.extend_from_slice(&["--stage", s]);
    }
    let (success, stdout, stderr) = pipeshard_env(&args, &[]);
    assert!(!success, "serve should refuse, printed: {stdout}");
    stderr
}

#[test]
fn bad_rings_are_refused_with_the_stage_named() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let m = tiny_model(d, Flavour::Llama, 1);
    let other = tiny_model(d, Flavour::Llama, 2);
    let a = split(&m, &d.join("a"), &["--stages", "3"]); // 0..2, 2..4, 4..6
    let b = split(&m, &d.join("b"), &["--layers", "0..3,3..6"]);
    split(&other, &d.join("c"), &["--stages", "3"]);
    let token = token_file(d, "token", "0123456789abcdef0123456789abcdef");
    let wrong = token_file(d, "wrong", "fedcba9876543210fedcba9876543210");
    let ring_port = free_port();
    let next = format!("127.0.0.1:{ring_port}");
    let shard = |dir: &str, i: usize| d.join(dir).join(format!("stage-{i}.gguf"));
    let (_a1, a1) = stage(&shard("a", 1), &next, &token);
    let (_a2, a2) = stage(&shard("a", 2), &next, &token);
    let (_b1, b1) = stage(&shard("b", 1), &next, &token);
    let (_c1, c1) = stage(&shard("c", 1), &next, &token);
    let (_c2, c2) = stage(&shard("c", 2), &next, &token);
    let (_w1, w1) = stage(&shard("a", 1), &next, &wrong);

    let e = serve_fails(&a, &[&a2, &a1], &token, ring_port);
    assert!(e.contains("ring order") && e.contains("stage 1 at"), "{e}");
    let e = serve_fails(&a, &[&b1, &a2], &token, ring_port);
    assert!(e.contains("gap") && e.contains("layers 2..3"), "{e}");
    let e = serve_fails(&b, &[&a1], &token, ring_port);
    assert!(e.contains("overlap") && e.contains("stage 1 at"), "{e}");
    let e = serve_fails(&a, &[&c1, &c2], &token, ring_port);
    assert!(
        e.contains("another model") && e.contains("stage 1 at"),
        "{e}"
    );
    let e = serve_fails(&a, &[&w1, &a2], &token, ring_port);
    assert!(
        e.contains("stage 1 at") && e.contains("cluster token"),
        "{e}"
    );
    let down = format!("127.0.0.1:{}", free_port());
    let e = serve_fails(&a, &[&a1, &down], &token, ring_port);
    assert!(
        e.contains(&format!("stage 2 at {down} is unreachable")),
        "{e}"
    );
    let e = serve_fails(&a, &[&a1], &token, ring_port);
    assert!(e.contains("give --stage for each of stages 1..2"), "{e}");
    // A stage refuses to start without a usable token file.
    let short = token_file(d, "short", "abc");
    let e = start_stage(&shard("a", 1), &next, &short).err().unwrap();
    assert!(e.contains("at least 16"), "{e}");
}

struct Served {
    url: String,
    stages: Vec<Proc>,
    _serve: Proc,
}

/// A three-stage ring on a tiny model: two stage processes and `serve`.
fn serve_tiny(d: &Path, extra: &[&str]) -> (Served, PathBuf) {
    let m = tiny_model(d, Flavour::Qwen2, 3);
    let a = split(&m, &d.join("a"), &["--stages", "3"]);
    let token = token_file(d, "token", "0123456789abcdef0123456789abcdef");
    let ring_port = free_port();
    let ring = format!("127.0.0.1:{ring_port}");
    let (p2, a2) = stage(&d.join("a/stage-2.gguf"), &ring, &token);
    let (p1, a1) = stage(&d.join("a/stage-1.gguf"), &a2, &token);
    let mut args = vec![
        "serve",
        "--manifest",
        a.to_str().unwrap(),
        "--stage",
        &a1,
        "--stage",
        &a2,
        "--listen",
        "127.0.0.1:0",
        "--ring-listen",
        &ring,
        "--token-file",
        token.to_str().unwrap(),
        "--model-name",
        "tiny",
        "--max-body-kib",
        "64",
    ];
    args.extend_from_slice(extra);
    let (serve, line) = Proc::start(&args, &[]).unwrap_or_else(|e| panic!("serve failed: {e}"));
    let url = line
        .rsplit(' ')
        .next()
        .unwrap()
        .trim_end_matches("/v1")
        .to_string();
    (
        Served {
            url,
            stages: vec![p1, p2],
            _serve: serve,
        },
        m,
    )
}

fn post(url: &str, body: &Value) -> (u16, Value) {
    let (status, text) = http("POST", url, Some(&body.to_string()));
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

#[test]
fn the_api_serves_the_ring_and_names_bad_requests() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut s, model) = serve_tiny(tmp.path(), &[]);
    let u = &s.url;
    let (code, health) = http("GET", &format!("{u}/health"), None);
    assert_eq!(code, 200, "{health}");
    let (code, models) = http("GET", &format!("{u}/v1/models"), None);
    assert_eq!(code, 200);
    assert!(models.contains("\"id\":\"tiny\""), "{models}");

    // Completions through the API give the unsplit model's text.
    let want = generate_json(&model, &["--prompt", "hello", "--max-tokens", "12"]);
    let (code, r) = post(
        &format!("{u}/v1/completions"),
        &json!({"model": "tiny", "prompt": "hello", "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["choices"][0]["text"], want["text"], "{r}");
    let n = want["tokens"].as_array().unwrap().len();
    assert_eq!(r["usage"]["completion_tokens"], n);
    assert_eq!(
        r["usage"]["prompt_tokens"],
        want["prompt_ids"].as_array().unwrap().len()
    );

    // Streamed: the same text in chunks, then [DONE].
    let (code, body) = http(
        "POST",
        &format!("{u}/v1/completions"),
        Some(&json!({"model": "tiny", "prompt": "hello", "max_tokens": 12, "temperature": 0, "stream": true}).to_string()),
    );
    assert_eq!(code, 200);
    let mut text = String::new();
    let lines: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(lines.last(), Some(&"[DONE]"), "{body}");
    for l in &lines[..lines.len() - 1] {
        let v: Value = serde_json::from_str(l).unwrap();
        text += v["choices"][0]["text"].as_str().unwrap_or("");
    }
    assert_eq!(text, want["text"].as_str().unwrap());

    // Chat, whole.
    let (code, r) = post(
        &format!("{u}/v1/chat/completions"),
        &json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}),
    );
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["object"], "chat.completion");
    assert_eq!(r["choices"][0]["message"]["role"], "assistant");
    assert!(r["usage"]["completion_tokens"].as_u64().unwrap() <= 5);

    // Bad requests: a 400 (or 413) with an OpenAI error object naming the problem.
    let chat = format!("{u}/v1/chat/completions");
    let (code, body) = http("POST", &chat, Some("{\"model\": \"tiny\", \"messages\": ["));
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("malformed JSON"), "{body}");
    let (code, r) = post(
        &chat,
        &json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}),
    );
    assert_eq!(code, 400);
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("invalid request"),
        "{r}"
    );
    let (code, r) = post(
        &chat,
        &json!({"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(code, 400);
    assert_eq!(r["error"]["code"], "model_not_found", "{r}");
    let (code, r) = post(
        &chat,
        &json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}),
    );
    assert_eq!(code, 400);
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("context length 256"),
        "{r}"
    );
    let (code, r) = post(&chat, &json!({"model": "tiny", "messages": []}));
    assert_eq!(code, 400, "{r}");
    let big = "x".repeat(100 << 10);
    let (code, r) = post(
        &chat,
        &json!({"model": "tiny", "messages": [{"role": "user", "content": big}]}),
    );
    assert_eq!(code, 413, "{r}");
    assert!(r["error"]["message"].is_string(), "{r}");
    let (code, _) = http("GET", &format!("{u}/v1/nothing"), None);
    assert_eq!(code, 404);

    // A stage dies: health and requests answer 503 naming it.
    s.stages[1].kill();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (code, body) = http("GET", &format!("{u}/health"), None);
        if code == 503 {
            assert!(body.contains("stage 2 at"), "{body}");
            break;
        }
        assert!(Instant::now() < deadline, "health still {code}: {body}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let (code, r) = post(
        &chat,
        &json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(code, 503, "{r}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("stage 2 at"),
        "{r}"
    );
}

#[test]
fn half_precision_wire_runs_the_ring() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path(), Flavour::Llama, 12);
    for dtype in ["f16", "bf16"] {
        let got = up_json(
            &m,
            tmp.path(),
            &[
                "--prompt",
                "hello",
                "--max-tokens",
                "8",
                "--wire-dtype",
                dtype,
            ],
        );
        assert_eq!(got["usage"]["prompt_tokens"], 3, "{got}");
        assert!(
            got["usage"]["completion_tokens"].as_u64().unwrap() >= 1,
            "{got}"
        );
    }
}

/// Many users at once, arriving at random times with prompts of different lengths, some
/// sampling with a seed: each gets exactly what it gets alone from the unsplit model, whatever
/// the micro-batch groups and prompt chunks it shared its steps with, and whether its own
/// prompt's chunks went round one at a time or several at once.
#[test]
fn concurrent_users_each_get_their_tokens_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, model) = serve_tiny(tmp.path(), &["--groups", "2", "--prefill-chunk", "16"]);
    let words = ["hello", "ring", "there", "stage", "token", "batch"];
    for users in [1usize, 4, 8] {
        let cases: Vec<(String, Option<u64>, usize)> = (0..users)
            .map(|i| {
                // A lone user's long prompt goes in chunks that follow each other round.
                let n = if users == 1 {
                    20
                } else {
                    1 + (i * 7 + users) % 40
                };
                let prompt: Vec<&str> = (0..n).map(|k| words[(k + i) % words.len()]).collect();
                let seed = (i % 2 == 1).then_some(100 + i as u64);
                (prompt.join(" "), seed, 8 + (i * 5) % 24)
            })
            .collect();
        let want: Vec<Value> = cases
            .iter()
            .map(|(p, seed, max)| {
                let max = max.to_string();
                let mut args = vec!["--prompt", p.as_str(), "--max-tokens", &max];
                let seed_s = seed.map(|x| x.to_string());
                if let Some(sd) = &seed_s {
                    args.extend_from_slice(&["--temperature", "0.9", "--seed", sd]);
                }
                generate_json(&model, &args)
            })
            .collect();
        let url = format!("{}/v1/completions", s.url);
        let threads: Vec<_> = cases
            .iter()
            .enumerate()
            .map(|(i, (p, seed, max))| {
                let body = json!({
                    "model": "tiny", "prompt": p, "max_tokens": max,
                    "temperature": if seed.is_some() { 0.9 } else { 0.0 }, "seed": seed,
                });
                let url = url.clone();
                std::thread::spawn(move || {
                    // Random-looking, reproducible arrival times.
                    std::thread::sleep(Duration::from_millis(((i * 37) % 50) as u64));
                    post(&url, &body)
                })
            })
            .collect();
        for (i, t) in threads.into_iter().enumerate() {
            let (code, r) = t.join().unwrap();
            assert_eq!(code, 200, "{r}");
            assert_eq!(
                r["choices"][0]["text"], want[i]["text"],
                "user {i} of {users}: {:?}",
                cases[i]
            );
            assert_eq!(
                r["usage"]["completion_tokens"],
                want[i]["tokens"].as_array().unwrap().len()
            );
        }
    }
}

/// KV admission: a request runs only when its whole context fits every stage's KV budget;
/// others wait in a bounded queue, and beyond it get 429 with Retry-After; one that can never
/// fit gets 400. Whoever is served gets the tokens it gets alone.
#[test]
fn kv_budgets_queue_and_refuse_requests() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, model) = serve_tiny(tmp.path(), &["--kv-budget-kib", "150", "--max-queue", "1"]);
    let (_, health) = http("GET", &format!("{}/health", s.url), None);
    let health: Value = serde_json::from_str(&health).unwrap();
    let per = health["stages"][0]["kv_bytes_per_token"].as_u64().unwrap();
    let budget = health["stages"][0]["kv_budget_bytes"].as_u64().unwrap();
    assert_eq!(budget, 150 * 1024);
    let prompt = "hello ring";
    let prompt_len = generate_json(&model, &["--prompt", prompt, "--max-tokens", "1"])
        ["prompt_ids"]
        .as_array()
        .unwrap()
        .len();
    // One request's context takes two thirds of the budget: two never fit together.
    let max = (budget / per) as usize * 2 / 3 - prompt_len;
    assert!(max > 8, "{per} bytes per token");
    let url = format!("{}/v1/completions", s.url);
    let (code, r) = post(
        &url,
        &json!({"model": "tiny", "prompt": prompt, "max_tokens": (budget / per) as usize}),
    );
    assert_eq!(code, 400, "{r}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("KV cache on stage 0"),
        "{r}"
    );

    let want = generate_json(
        &model,
        &["--prompt", prompt, "--max-tokens", &max.to_string()],
    );
    let body =
        json!({"model": "tiny", "prompt": prompt, "max_tokens": max, "temperature": 0}).to_string();
    let threads: Vec<_> = (0..6)
        .map(|_| {
            let (url, body) = (url.clone(), body.clone());
            std::thread::spawn(move || common::http_with_retry_after("POST", &url, Some(&body)))
        })
        .collect();
    let (mut served, mut refused) = (0, 0);
    for t in threads {
        let (code, text, retry) = t.join().unwrap();
        match code {
            200 => {
                let r: Value = serde_json::from_str(&text).unwrap();
                assert_eq!(r["choices"][0]["text"], want["text"]);
                served += 1;
            }
            429 => {
                assert_eq!(retry.as_deref(), Some("1"), "{text}");
                assert!(text.contains("wait for KV cache room"), "{text}");
                refused += 1;
            }
            other => panic!("{other}: {text}"),
        }
    }
    assert!(
        served >= 2 && refused >= 1,
        "{served} served, {refused} refused"
    );
}

/// Speculative decoding through the ring: with prompt lookup, a draft model, or both, for
/// fixed and adaptive k, in micro-batch groups with several users at once, each user gets
/// the tokens decoding without speculation gives (greedy, and seeded sampling with prompt
/// lookup); a sampling draft model gives the same tokens whatever k and batching.
#[test]
fn speculation_keeps_every_users_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let draft = tiny_model(tmp.path(), Flavour::Qwen2, 4);
    let draft_s = draft.to_str().unwrap().to_string();
    let both = format!("ngram+{draft_s}");
    let words = ["hello", "ring", "there", "hello", "ring", "token"];
    let cases: Vec<(String, Option<u64>)> = (0..4)
        .map(|i| {
            let n = 3 + (i * 7) % 20;
            let prompt: Vec<&str> = (0..n).map(|k| words[(k + i) % words.len()]).collect();
            (prompt.join(" "), (i % 2 == 1).then_some(40 + i as u64))
        })
        .collect();
    for (drafter, k) in [
        ("ngram", "3"),
        (draft_s.as_str(), "auto"),
        (both.as_str(), "2"),
    ] {
        let d = tmp.path().join(format!("ring-{k}"));
        std::fs::create_dir_all(&d).unwrap();
        let (s, model) = serve_tiny(&d, &["--groups", "2", "--draft", drafter, "--draft-k", k]);
        let want: Vec<Value> = cases
            .iter()
            .map(|(p, seed)| {
                let mut args = vec!["--prompt", p.as_str(), "--max-tokens", "24"];
                let seed_s = seed.map(|x| x.to_string());
                if let Some(sd) = &seed_s {
                    args.extend_from_slice(&["--temperature", "0.9", "--seed", sd]);
                    if drafter != "ngram" {
                        // A sampling draft model: compare with k = 1 alone.
                        args.extend_from_slice(&["--draft", drafter, "--draft-k", "1"]);
                    }
                }
                generate_json(&model, &args)
            })
            .collect();
        let url = format!("{}/v1/completions", s.url);
        let threads: Vec<_> = cases
            .iter()
            .enumerate()
            .map(|(i, (p, seed))| {
                let body = json!({
                    "model": "tiny", "prompt": p, "max_tokens": 24,
                    "temperature": if seed.is_some() { 0.9 } else { 0.0 }, "seed": seed,
                });
                let url = url.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(((i * 29) % 40) as u64));
                    post(&url, &body)
                })
            })
            .collect();
        let mut drafted = 0;
        for (i, t) in threads.into_iter().enumerate() {
            let (code, r) = t.join().unwrap();
            assert_eq!(code, 200, "{r}");
            assert_eq!(
                r["choices"][0]["text"], want[i]["text"],
                "drafter {drafter}, k {k}, user {i}: {:?}",
                cases[i]
            );
            let details = &r["usage"]["completion_tokens_details"];
            drafted += details["accepted_prediction_tokens"].as_u64().unwrap_or(0)
                + details["rejected_prediction_tokens"].as_u64().unwrap_or(0);
        }
        assert!(drafted > 0, "{drafter} drafted nothing");
    }
}

/// `generate --draft` gives the tokens plain decoding gives, for every k and drafter, and a
/// seeded draft-model run is the same whatever k.
#[test]
fn generate_with_a_drafter_keeps_the_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path(), Flavour::Llama, 2);
    let draft = tiny_model(tmp.path(), Flavour::Llama, 2);
    let other = tiny_model(tmp.path(), Flavour::Llama, 5);
    let prompt = [
        "--prompt",
        "hello there hello there hello",
        "--max-tokens",
        "40",
    ];
    let plain = generate_json(&m, &prompt)["tokens"].clone();
    let seeded = ["--temperature", "0.8", "--seed", "3"];
    let plain_seeded = generate_json(&m, &[&prompt[..], &seeded[..]].concat())["tokens"].clone();
    let mut model_seeded = vec![];
    for d in ["ngram", draft.to_str().unwrap(), other.to_str().unwrap()] {
        for k in ["1", "4", "9", "auto"] {
            let args = [&prompt[..], &["--draft", d, "--draft-k", k]].concat();
            let out = generate_json(&m, &args);
            assert_eq!(out["tokens"], plain, "drafter {d}, k {k}");
            assert!(out["drafted"].as_u64().unwrap() > 0, "drafter {d}, k {k}");
            let s = generate_json(&m, &[&args[..], &seeded[..]].concat())["tokens"].clone();
            if d == "ngram" {
                assert_eq!(s, plain_seeded, "ngram, k {k}, sampling");
            } else {
                model_seeded.push((d.to_string(), s));
            }
        }
    }
    for w in model_seeded.windows(2) {
        if w[0].0 == w[1].0 {
            assert_eq!(w[0].1, w[1].1, "a sampling draft model, {}", w[0].0);
        }
    }
    // The same model drafting for itself proposes what greedy decoding chooses.
    let same = generate_json(
        &m,
        &[
            &prompt[..],
            &["--draft", draft.to_str().unwrap(), "--draft-k", "4"],
        ]
        .concat(),
    );
    assert_eq!(same["accepted"], same["drafted"]);
    let e = fails(&[
        "generate",
        "--model",
        m.to_str().unwrap(),
        "--prompt",
        "hi",
        "--draft",
        "ngram+",
    ]);
    assert!(e.contains("ngram+MODEL"), "{e}");
    let e = fails(&[
        "generate",
        "--model",
        m.to_str().unwrap(),
        "--prompt",
        "hi",
        "--draft",
        "ngram",
        "--draft-k",
        "many",
    ]);
    assert!(e.contains("--draft-k takes a number or auto"), "{e}");
}
