//! The command line on tiny random models: split, inspect, generate, perplexity, and a clear
//! error for each bad input.

mod common;

use std::path::Path;

use candle_core::quantized::GgmlDType;
use common::{fails, generate_json, ok, split};
use pipeshard_testkit::{tiny_model, write_tiny_gguf, Flavour, TinySpec};

#[test]
fn shards_and_stage_counts_give_the_unsplit_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    for flavour in [Flavour::Llama, Flavour::Qwen2] {
        let model = tiny_model(tmp.path(), flavour, 5);
        let gen = ["--prompt", "hello there, tell me", "--max-tokens", "24"];
        let want = generate_json(&model, &gen);
        assert!(
            want["tokens"].as_array().unwrap().len() >= 8,
            "a run long enough to compare: {want}"
        );
        assert!(want["prompt_ids"].as_array().unwrap().len() > 5);
        for key in ["text", "finish_reason", "timings"] {
            assert!(want.get(key).is_some(), "{key} missing in {want}");
        }
        assert!(want["timings"]["decode_tok_s"].is_number());
        for stages in ["2", "3", "4"] {
            let mut args = gen.to_vec();
            args.extend(["--stages", stages, "--threads", "2"]);
            let got = generate_json(&model, &args);
            assert_eq!(
                got["tokens"], want["tokens"],
                "{flavour:?} with {stages} stages"
            );
        }
        let dir = tmp.path().join(format!("{flavour:?}-split"));
        let manifest = split(&model, &dir, &["--layers", "0..1,1..4,4..6"]);
        let got = generate_json(&manifest, &gen);
        assert_eq!(got["tokens"], want["tokens"], "{flavour:?} from shards");
        assert_eq!(got["text"], want["text"]);
    }
}

#[test]
fn inspect_shows_stages_and_verifies() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model(tmp.path(), Flavour::Qwen2, 1);
    let manifest = split(
        &model,
        &tmp.path().join("s"),
        &["--layers", "0..2,2..4,4..6"],
    );
    let text = ok(&["inspect", manifest.to_str().unwrap(), "--verify"]);
    assert!(text.contains("qwen2"), "{text}");
    for r in ["0..2", "2..4", "4..6", "stage-2.gguf", "verified"] {
        assert!(text.contains(r), "{r} missing in {text}");
    }
    let json: serde_json::Value =
        serde_json::from_str(&ok(&["inspect", manifest.to_str().unwrap(), "--json"])).unwrap();
    assert_eq!(json["stages"].as_array().unwrap().len(), 3);
    assert_eq!(json["config"]["n_layers"], 6);
    assert_eq!(json["stages"][1]["layers"]["start"], 2);
    assert_eq!(json["stages"][0]["sha256"].as_str().unwrap().len(), 64);
}

#[test]
fn bad_layer_ranges_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model(tmp.path(), Flavour::Llama, 1);
    let m = model.to_str().unwrap();
    let out = tmp.path().join("x");
    let o = out.to_str().unwrap();
    for (layers, msg) in [
        ("0..2,3..6", "a gap"),
        ("0..3,2..6", "an overlap"),
        ("0..3,3..7", "stages end at layer 7, the model has 6"),
        ("0..3", "stages end at layer 3"),
        ("0..3,x..6", "not a layer number"),
        ("3..3", "empty"),
    ] {
        let err = fails(&["split", m, "--out", o, "-q", "--layers", layers]);
        assert!(err.contains(msg), "{layers}: {err}");
    }
    let err = fails(&["split", m, "--out", o, "-q", "--stages", "7"]);
    assert!(err.contains("6 layers into 7 stages"), "{err}");
    let err = fails(&["generate", "--model", m, "--prompt", "hi", "--stages", "9"]);
    assert!(err.contains("6 layers into 9 stages"), "{err}");
}

#[test]
fn damaged_shards_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model(tmp.path(), Flavour::Llama, 1);
    let other = tiny_model(tmp.path(), Flavour::Llama, 2);
    let run = |dir: &Path| {
        let m = dir.join("manifest.json");
        fails(&["generate", "--model", m.to_str().unwrap(), "--prompt", "hi"])
    };
    let fresh = |name: &str| {
        let d = tmp.path().join(name);
        split(&model, &d, &["--stages", "3"]);
        d
    };

    let d = fresh("missing");
    std::fs::remove_file(d.join("stage-1.gguf")).unwrap();
    let err = run(&d);
    assert!(
        err.contains("stage-1.gguf") && err.contains("missing"),
        "{err}"
    );

    let d = fresh("truncated");
    let p = d.join("stage-2.gguf");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 100]).unwrap();
    let err = run(&d);
    assert!(
        err.contains("stage-2.gguf") && err.contains("truncated"),
        "{err}"
    );

    let d = fresh("corrupt");
    let p = d.join("stage-0.gguf");
    let mut bytes = std::fs::read(&p).unwrap();
    let at = bytes.len() - 1000;
    bytes[at] ^= 0x55;
    std::fs::write(&p, &bytes).unwrap();
    let err = run(&d);
    assert!(
        err.contains("stage-0.gguf") && err.contains("sha256 mismatch"),
        "{err}"
    );

    let d = fresh("foreign");
    let od = tmp.path().join("other");
    split(&other, &od, &["--stages", "3"]);
    std::fs::copy(od.join("stage-1.gguf"), d.join("stage-1.gguf")).unwrap();
    let err = run(&d);
    assert!(
        err.contains("stage-1.gguf") && err.contains("another model"),
        "{err}"
    );

    let d = fresh("reordered");
    let text = std::fs::read_to_string(d.join("manifest.json")).unwrap();
    std::fs::write(
        d.join("manifest.json"),
        text.replace("stage-0.gguf", "stage-X.gguf")
            .replace("stage-1.gguf", "stage-0.gguf")
            .replace("stage-X.gguf", "stage-1.gguf"),
    )
    .unwrap();
    let err = run(&d);
    assert!(err.contains("stage-"), "{err}");

    let d = tmp.path().join("garbage");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("manifest.json"), "{\"format\": 1}").unwrap();
    let err = run(&d);
    assert!(
        err.contains("manifest.json") && err.contains("not a pipeshard manifest"),
        "{err}"
    );
}

#[test]
fn unsupported_models_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let mut spec = TinySpec::new(Flavour::Llama, 1);
    spec.arch_name = Some("gpt2".into());
    let p = tmp.path().join("gpt2.gguf");
    write_tiny_gguf(&p, &spec).unwrap();
    let err = fails(&["generate", "--model", p.to_str().unwrap(), "--prompt", "hi"]);
    assert!(err.contains("unsupported architecture `gpt2`"), "{err}");

    let mut spec = TinySpec::new(Flavour::Llama, 1);
    spec.attn_dtype = Some(GgmlDType::Q8_1);
    let p = tmp.path().join("q81.gguf");
    write_tiny_gguf(&p, &spec).unwrap();
    let err = fails(&["generate", "--model", p.to_str().unwrap(), "--prompt", "hi"]);
    assert!(
        err.contains("blk.0.attn_q.weight") && err.contains("Q8_1"),
        "{err}"
    );

    let p = tmp.path().join("cut.gguf");
    write_tiny_gguf(&p, &TinySpec::new(Flavour::Qwen2, 1)).unwrap();
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 4000]).unwrap();
    let err = fails(&["generate", "--model", p.to_str().unwrap(), "--prompt", "hi"]);
    assert!(
        err.contains("cut.gguf") && err.contains("truncated"),
        "{err}"
    );

    let p = tmp.path().join("not.gguf");
    std::fs::write(&p, b"hello").unwrap();
    let err = fails(&["generate", "--model", p.to_str().unwrap(), "--prompt", "hi"]);
    assert!(err.contains("not.gguf") && err.contains("GGUF"), "{err}");

    let err = fails(&["generate", "--model", "no-such-model", "--prompt", "hi"]);
    assert!(
        err.contains("not a known model name") && err.contains("smollm2-135m"),
        "{err}"
    );
    let err = fails(&["fetch", "llama-70b"]);
    assert!(err.contains("unknown model `llama-70b`"), "{err}");
}

#[test]
fn sampling_is_seeded_and_stops() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model(tmp.path(), Flavour::Qwen2, 3);
    let args = [
        "--prompt",
        "abc",
        "--max-tokens",
        "16",
        "--temperature",
        "0.9",
        "--top-k",
        "20",
        "--top-p",
        "0.95",
        "--seed",
        "7",
    ];
    let a = generate_json(&model, &args);
    let mut two = args.to_vec();
    two.extend(["--stages", "2"]);
    let b = generate_json(&model, &two);
    assert_eq!(a["tokens"], b["tokens"], "a seed reproduces across splits");
    let err = fails(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "x",
        "--temperature=-1",
    ]);
    assert!(err.contains("temperature"), "{err}");
    let long = generate_json(&model, &["--prompt", "abc", "--max-tokens", "5"]);
    assert_eq!(long["finish_reason"], "length");
    assert_eq!(long["tokens"].as_array().unwrap().len(), 5);
}

#[test]
fn perplexity_prints_ppl_and_is_split_invariant() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model(tmp.path(), Flavour::Llama, 4);
    let text = tmp.path().join("t.txt");
    std::fs::write(
        &text,
        "the quick brown fox jumps over the lazy dog. ".repeat(20),
    )
    .unwrap();
    let m = model.to_str().unwrap();
    let t = text.to_str().unwrap();
    let one = ok(&["perplexity", "--model", m, "--file", t, "--ctx", "64"]);
    let three = ok(&[
        "perplexity",
        "--model",
        m,
        "--file",
        t,
        "--ctx",
        "64",
        "--stages",
        "3",
    ]);
    let last = one.lines().last().unwrap();
    assert!(last.starts_with("ppl="), "{one}");
    let v: f64 = last[4..].parse().unwrap();
    assert!(v.is_finite() && v > 1.0, "{v}");
    assert_eq!(last, three.lines().last().unwrap());
    let err = fails(&["perplexity", "--model", m, "--file", t, "--ctx", "4096"]);
    assert!(err.contains("--ctx"), "{err}");
}
