//! The tokenizer, built from a GGUF's `tokenizer.ggml.*` metadata with the `tokenizers` crate,
//! and incremental detokenization that never cuts a UTF-8 character.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::{Content, Value};
use serde_json::json;

use crate::{GenerateError, Result};

/// Qwen2's pre-tokenizer split pattern (as in its `tokenizer.json`).
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A model's tokenizer and its special tokens.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    vocab: Vec<String>,
    bos: Option<u32>,
    add_bos: bool,
    eos: Vec<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokenizer({} tokens)", self.vocab.len())
    }
}

fn strings(c: &Content, key: &str) -> Result<Vec<String>> {
    match c.metadata.get(key) {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                _ => Err(GenerateError::Tokenizer(format!(
                    "`{key}` holds a non-string"
                ))),
            })
            .collect(),
        _ => Err(GenerateError::Tokenizer(format!("missing `{key}`"))),
    }
}

fn id(c: &Content, key: &str) -> Option<u32> {
    c.metadata.get(key).and_then(|v| v.to_u32().ok())
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes (gpt2-style byte-level BPE).
    pub fn from_gguf(c: &Content) -> Result<Self> {
        let model = c
            .metadata
            .get("tokenizer.ggml.model")
            .and_then(|v| v.to_string().ok())
            .map(String::as_str);
        if model != Some("gpt2") {
            return Err(GenerateError::Tokenizer(format!(
                "unsupported tokenizer model {model:?} (supported: gpt2)"
            )));
        }
        let tokens = strings(c, "tokenizer.ggml.tokens")?;
        let merges = strings(c, "tokenizer.ggml.merges")?;
        let types: Vec<i64> = match c.metadata.get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.to_i32().map(i64::from).unwrap_or(1))
                .collect(),
            _ => vec![1; tokens.len()],
        };
        let pre = c
            .metadata
            .get("tokenizer.ggml.pre")
            .and_then(|v| v.to_string().ok())
            .map_or("default", String::as_str);
        let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": use_regex});
        let pre_tokenizer = match pre {
            "qwen2" => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated", "invert": false},
                byte_level(false),
            ]}),
            "smollm" => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true),
            ]}),
            "default" | "gpt2" => byte_level(true),
            other => {
                return Err(GenerateError::Tokenizer(format!(
                    "unsupported pre-tokenizer `{other}` (supported: qwen2, smollm, gpt2)"
                )))
            }
        };
        let vocab: HashMap<&str, usize> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.as_str(), i))
            .collect();
        // Control (3) and user-defined (4) tokens are matched whole in the input text.
        let added: Vec<serde_json::Value> = types
            .iter()
            .enumerate()
            .filter(|(_, &t)| t == 3 || t == 4)
            .map(|(i, &t)| {
                json!({"id": i, "content": tokens[i], "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": t == 3})
            })
            .collect();
        let spec = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": merges},
        });
        let inner: tokenizers::Tokenizer = spec
            .to_string()
            .parse()
            .map_err(|e| GenerateError::Tokenizer(format!("building BPE: {e}")))?;
        let mut eos: Vec<u32> = id(c, "tokenizer.ggml.eos_token_id").into_iter().collect();
        for name in ["<|im_end|>", "<|endoftext|>", "<|eot_id|>"] {
            if let Some(&i) = vocab.get(name) {
                if !eos.contains(&(i as u32)) {
                    eos.push(i as u32);
                }
            }
        }
        let add_bos = c
            .metadata
            .get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(false);
        Ok(Self {
            inner,
            vocab: tokens,
            bos: id(c, "tokenizer.ggml.bos_token_id"),
            add_bos,
            eos,
        })
    }

    /// Token ids of `text`; special tokens written in the text are recognized. Adds BOS when
    /// the model asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| GenerateError::Tokenizer(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| GenerateError::Tokenizer(e.to_string()))
    }

    /// Ids that end generation.
    pub fn eos(&self) -> &[u32] {
        &self.eos
    }

    /// The token string of an id (for the chat template's bos/eos tokens).
    pub fn token(&self, id: u32) -> Option<&str> {
        self.vocab.get(id as usize).map(String::as_str)
    }

    /// BOS id, if the model has one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }
}

/// Turns a stream of ids into text pieces, holding back bytes of an unfinished character.
#[derive(Debug, Default)]
pub struct Detokenizer {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl Detokenizer {
    /// An empty stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a token; returns the new text it completes, if any.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') {
            // `before` decodes a prefix of the same ids, so it is a prefix of `now` unless
            // the byte-level decoder merged differently; fall back to the char boundary.
            let cut = if now.starts_with(&before) {
                before.len()
            } else {
                0
            };
            let piece = now[cut..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            return Ok(piece);
        }
        Ok(String::new())
    }
}
