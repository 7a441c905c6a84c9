//! Model hyper-parameters, read from GGUF metadata.

use candle_core::quantized::gguf_file::{Content, Value};

use crate::error::ModelError;

/// The architectures this engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Llama family (SmolLM2): RoPE on adjacent pairs, no QKV bias.
    Llama,
    /// Qwen2 family (Qwen2.5): RoPE on split halves ("neox"), QKV bias.
    Qwen2,
}

impl Arch {
    /// The GGUF `general.architecture` name.
    pub fn name(&self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
        }
    }
}

/// Hyper-parameters of a model, the same on every stage.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModelConfig {
    /// Architecture.
    pub arch: Arch,
    /// Number of transformer layers in the whole model.
    pub n_layers: usize,
    /// Hidden size (embedding length).
    pub hidden: usize,
    /// Feed-forward inner size.
    pub ffn: usize,
    /// Number of query heads.
    pub n_heads: usize,
    /// Number of key/value heads (grouped-query attention).
    pub n_kv_heads: usize,
    /// Size of one head.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// Maximum context length the model was trained for.
    pub ctx_len: usize,
}

fn get<'a>(c: &'a Content, key: &str) -> Result<&'a Value, String> {
    c.metadata
        .get(key)
        .ok_or_else(|| format!("missing metadata key `{key}`"))
}

fn get_usize(c: &Content, key: &str) -> Result<usize, String> {
    let v = get(c, key)?;
    let n = match v {
        Value::U8(x) => *x as u64,
        Value::U16(x) => *x as u64,
        Value::U32(x) => *x as u64,
        Value::U64(x) => *x,
        Value::I32(x) if *x >= 0 => *x as u64,
        Value::I64(x) if *x >= 0 => *x as u64,
        other => {
            return Err(format!(
                "metadata `{key}` is not an unsigned integer: {other:?}"
            ))
        }
    };
    Ok(n as usize)
}

fn get_f32(c: &Content, key: &str) -> Result<f32, String> {
    match get(c, key)? {
        Value::F32(x) => Ok(*x),
        Value::F64(x) => Ok(*x as f32),
        other => Err(format!("metadata `{key}` is not a float: {other:?}")),
    }
}

impl ModelConfig {
    /// Reads the configuration from GGUF metadata; `what` names the file in errors.
    pub fn from_gguf(c: &Content) -> Result<Self, ModelError> {
        let arch_name = match get(c, "general.architecture") {
            Ok(Value::String(s)) => s.clone(),
            _ => {
                return Err(ModelError::Gguf {
                    path: Default::default(),
                    msg: "missing `general.architecture`".into(),
                })
            }
        };
        let arch = match arch_name.as_str() {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            other => return Err(ModelError::UnsupportedArch(other.to_string())),
        };
        let p = |k: &str| format!("{arch_name}.{k}");
        let inner = || -> Result<ModelConfig, String> {
            let hidden = get_usize(c, &p("embedding_length"))?;
            let n_heads = get_usize(c, &p("attention.head_count"))?;
            let n_kv_heads = get_usize(c, &p("attention.head_count_kv")).unwrap_or(n_heads);
            if n_heads == 0 || hidden % n_heads != 0 || n_kv_heads == 0 || n_heads % n_kv_heads != 0
            {
                return Err(format!(
                    "inconsistent heads: hidden {hidden}, heads {n_heads}, kv heads {n_kv_heads}"
                ));
            }
            let head_dim = hidden / n_heads;
            if head_dim % 2 != 0 {
                return Err(format!("head size {head_dim} is odd"));
            }
            let vocab = match c.metadata.get("tokenizer.ggml.tokens") {
                Some(Value::Array(a)) => a.len(),
                _ => match c.tensor_infos.get("token_embd.weight") {
                    Some(t) => t.shape.dims()[0],
                    None => get_usize(c, &p("vocab_size"))?,
                },
            };
            Ok(ModelConfig {
                arch,
                n_layers: get_usize(c, &p("block_count"))?,
                hidden,
                ffn: get_usize(c, &p("feed_forward_length"))?,
                n_heads,
                n_kv_heads,
                head_dim,
                vocab,
                rms_eps: get_f32(c, &p("attention.layer_norm_rms_epsilon"))?,
                rope_theta: get_f32(c, &p("rope.freq_base")).unwrap_or(10_000.0),
                ctx_len: get_usize(c, &p("context_length"))?,
            })
        };
        inner().map_err(|msg| ModelError::Gguf {
            path: Default::default(),
            msg,
        })
    }

    /// Size of one token's keys (or values) in one layer.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}
