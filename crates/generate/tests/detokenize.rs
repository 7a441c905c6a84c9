//! Tokenizer and detokenizer on the tiny model's byte-level vocabulary, where every byte of a
//! multi-byte character is its own token.

use candle_core::quantized::gguf_file::Content;
use pipeshard_generate::{Detokenizer, Tokenizer};
use pipeshard_testkit::{tiny_model, Flavour, EOS};

fn tokenizer(flavour: Flavour) -> Tokenizer {
    let dir = tempfile::tempdir().unwrap();
    let p = tiny_model(dir.path(), flavour, 1);
    let mut f = std::fs::File::open(p).unwrap();
    Tokenizer::from_gguf(&Content::read(&mut f).unwrap()).unwrap()
}

#[test]
fn streaming_never_cuts_a_character() {
    let tok = tokenizer(Flavour::Qwen2);
    let text = "héllo 日本 🚀!";
    let ids = tok.encode(text).unwrap();
    assert!(
        ids.len() > text.chars().count(),
        "multi-byte chars span several tokens"
    );
    let mut d = Detokenizer::new();
    let mut out = String::new();
    for &id in &ids {
        let piece = d.push(&tok, id).unwrap();
        assert!(!piece.contains('\u{FFFD}'), "{piece:?}");
        out += &piece;
    }
    assert_eq!(out, text);
}

#[test]
fn merges_and_special_tokens_apply() {
    let tok = tokenizer(Flavour::Llama);
    // "he" and "ll" are merges; <|im_start|> is one special token; digits split singly.
    let ids = tok.encode("<|im_start|>hello 42").unwrap();
    assert_eq!(ids[0], EOS + 1);
    assert_eq!(ids[1], 256);
    assert_eq!(ids[2], 257);
    assert_eq!(tok.decode(&ids).unwrap(), "hello 42");
    assert!(tok.eos().contains(&(EOS + 2)) && tok.eos().contains(&EOS));
}
