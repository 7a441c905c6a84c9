//! The real default model (SmolLM2-135M) and the Qwen2.5 tokenizer, fetched into the cache on
//! first use (`.ci/run` fetches them beforehand).

mod common;

use std::path::PathBuf;

use common::{generate_json, ok};
use pipeshard_generate::{ChatMessage, ChatTemplate, Tokenizer};
use pipeshard_model::gguf::GgufFile;
use pipeshard_shard::{fetch, known_model};

fn model(name: &str) -> PathBuf {
    fetch(known_model(name).expect("known"), true).expect("fetching a real model")
}

#[test]
fn tokenizers_match_the_reference_implementation() {
    // Ids from Hugging Face transformers' GGUF tokenizer conversion
    // (scripts/tokenizer_reference.py), an implementation independent of ours.
    let reference: serde_json::Value =
        serde_json::from_str(include_str!("data/tokenizer_reference.json")).unwrap();
    for (key, name) in [("smollm2", "smollm2-135m"), ("qwen2", "qwen2.5-coder-0.5b")] {
        let g = GgufFile::open(&model(name)).unwrap();
        let tok = Tokenizer::from_gguf(&g.content).unwrap();
        let cases = reference[key].as_array().unwrap();
        assert!(cases.len() >= 5);
        for case in cases {
            let text = case["text"].as_str().unwrap();
            let want: Vec<u32> = case["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(tok.encode(text).unwrap(), want, "{name}: {text:?}");
            if !text.contains("<|") {
                assert_eq!(tok.decode(&want).unwrap(), text, "{name} round trip");
            }
        }
    }
}

#[test]
fn capital_of_france_is_paris() {
    let m = model("smollm2-135m");
    let out = generate_json(
        &m,
        &["--prompt", "The capital of France is", "--max-tokens", "4"],
    );
    assert!(out["text"].as_str().unwrap().starts_with(" Paris"), "{out}");
}

#[test]
fn chat_template_renders() {
    let g = GgufFile::open(&model("smollm2-135m")).unwrap();
    let src = g
        .meta_str("tokenizer.chat_template")
        .expect("SmolLM2 has a chat template");
    let t = ChatTemplate::new(src, "<|im_start|>", "<|im_end|>").unwrap();
    let text = t
        .render(&[ChatMessage::new("user", "What is 2+2?")])
        .unwrap();
    assert!(
        text.contains("<|im_start|>user\nWhat is 2+2?<|im_end|>\n"),
        "{text:?}"
    );
    assert!(text.ends_with("<|im_start|>assistant\n"), "{text:?}");
    let tok = Tokenizer::from_gguf(&g.content).unwrap();
    let ids = tok.encode(&text).unwrap();
    assert_eq!(
        ids.iter()
            .filter(|&&i| tok.token(i) == Some("<|im_start|>"))
            .count(),
        text.matches("<|im_start|>").count()
    );
    let out = generate_json(
        &model("smollm2-135m"),
        &["--prompt", "What is 2+2?", "--chat", "--max-tokens", "24"],
    );
    assert!(!out["text"].as_str().unwrap().trim().is_empty(), "{out}");
}

#[test]
fn three_shards_give_the_unsplit_tokens() {
    let m = model("smollm2-135m");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("shards");
    ok(&[
        "split",
        m.to_str().unwrap(),
        "--stages",
        "3",
        "--out",
        dir.to_str().unwrap(),
        "-q",
    ]);
    let args = [
        "--prompt",
        "Once upon a time, in a small village,",
        "--max-tokens",
        "32",
    ];
    let want = generate_json(&m, &args);
    assert_eq!(want["tokens"].as_array().unwrap().len(), 32, "{want}");
    let got = generate_json(&dir.join("manifest.json"), &args);
    assert_eq!(got["tokens"], want["tokens"]);
    // Shards hold only their own tensors: together about the model's size (the tied
    // embedding is on both ends), each well under it.
    let model_bytes = std::fs::metadata(&m).unwrap().len();
    for i in 0..3 {
        let b = std::fs::metadata(dir.join(format!("stage-{i}.gguf")))
            .unwrap()
            .len();
        assert!(b < model_bytes * 2 / 3, "stage {i}: {b} of {model_bytes}");
    }
}

#[test]
fn three_stage_processes_give_the_unsplit_tokens() {
    let m = model("smollm2-135m");
    let cache = tempfile::tempdir().unwrap();
    let args = [
        "--prompt",
        "Once upon a time, in a small village,",
        "--max-tokens",
        "32",
    ];
    let want = generate_json(&m, &args);
    let mut up = vec![
        "up",
        "--model",
        m.to_str().unwrap(),
        "--stages",
        "3",
        "--json",
    ];
    up.extend_from_slice(&args);
    let (success, stdout, stderr) =
        common::pipeshard_env(&up, &[("PIPESHARD_CACHE", cache.path())]);
    assert!(success, "{stderr}");
    let got: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(got["tokens"], want["tokens"]);
    assert_eq!(got["text"], want["text"]);
}
