//! Test kit: writes tiny random-weight GGUF models (llama and qwen2 flavours, a few layers,
//! hidden 64) with a byte-level tokenizer and a chat template, so tests need no real model.

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Which architecture the tiny model imitates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavour {
    /// `llama`, tied embeddings (no `output.weight`), Q4_1 and Q8_0 weights, like SmolLM2.
    Llama,
    /// `qwen2`, QKV bias, separate `output.weight`, Q5_0 / Q8_0 / F16 weights.
    Qwen2,
}

/// Shape and seed of a tiny model.
#[derive(Debug, Clone)]
pub struct TinySpec {
    /// Architecture flavour.
    pub flavour: Flavour,
    /// Number of layers.
    pub n_layers: usize,
    /// Weight seed.
    pub seed: u64,
    /// Context length written to the metadata.
    pub ctx_len: usize,
    /// Architecture name written instead of the flavour's (to test refusal).
    pub arch_name: Option<String>,
    /// Type of the attention weights instead of the flavour's (to test refusal).
    pub attn_dtype: Option<GgmlDType>,
    /// A wider MLP whose down projection is in a K format (Q4_K for llama, Q6_K for qwen2),
    /// so the super-block kernels run in the model (their rows must be 256-multiples).
    pub k_quants: bool,
}

impl TinySpec {
    /// Six layers, context 256.
    pub fn new(flavour: Flavour, seed: u64) -> Self {
        Self {
            flavour,
            n_layers: 6,
            seed,
            ctx_len: 256,
            arch_name: None,
            attn_dtype: None,
            k_quants: false,
        }
    }
}

/// Hidden size of tiny models.
pub const HIDDEN: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;

/// GPT-2's byte-to-unicode table: the printable stand-in for each byte.
pub fn byte_chars() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).collect();
    printable.extend(0xA1..=0xAC);
    printable.extend(0xAE..=0xFF);
    let mut map = vec!['\0'; 256];
    let mut extra = 0;
    for b in 0..256u32 {
        map[b as usize] = if printable.contains(&b) {
            char::from_u32(b).unwrap()
        } else {
            extra += 1;
            char::from_u32(255 + extra).unwrap()
        };
    }
    map
}

/// Merges of the tiny tokenizer, each adding one token after the 256 bytes.
pub const MERGES: [(&str, &str); 3] = [("h", "e"), ("l", "l"), ("Ġ", "t")];
/// Special tokens, after the merges: end of text (BOS/EOS), chat start, chat end.
pub const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
/// Vocabulary size of tiny models.
pub const VOCAB: usize = 256 + MERGES.len() + SPECIALS.len();
/// Id of `<|endoftext|>`.
pub const EOS: u32 = (256 + MERGES.len()) as u32;

/// A ChatML template like Qwen's.
pub const CHAT_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

fn tensor(rng: &mut StdRng, rows: usize, cols: usize, scale: f32, dtype: GgmlDType) -> QTensor {
    let data: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-1.0f32..1.0) * scale)
        .collect();
    let shape: &[usize] = if rows == 1 { &[cols] } else { &[rows, cols] };
    let t = Tensor::from_vec(data, shape, &Device::Cpu).expect("tensor shape");
    QTensor::quantize(&t, dtype).expect("quantize")
}

fn norm(rng: &mut StdRng, n: usize) -> QTensor {
    let data: Vec<f32> = (0..n).map(|_| rng.random_range(0.8f32..1.2)).collect();
    let t = Tensor::from_vec(data, n, &Device::Cpu).expect("tensor shape");
    QTensor::quantize(&t, GgmlDType::F32).expect("f32")
}

/// Writes a tiny random model to `path`.
pub fn write_tiny_gguf(path: &Path, spec: &TinySpec) -> candle_core::Result<()> {
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let arch = match spec.flavour {
        Flavour::Llama => "llama",
        Flavour::Qwen2 => "qwen2",
    };
    let (wmain, wffn) = match spec.flavour {
        Flavour::Llama => (GgmlDType::Q4_1, GgmlDType::Q8_0),
        Flavour::Qwen2 => (GgmlDType::Q5_0, GgmlDType::F16),
    };
    let wmain = spec.attn_dtype.unwrap_or(wmain);
    let (ffn, wdown) = match (spec.k_quants, spec.flavour) {
        (false, _) => (128, GgmlDType::Q8_0),
        (true, Flavour::Llama) => (512, GgmlDType::Q4K),
        (true, Flavour::Qwen2) => (512, GgmlDType::Q6K),
    };
    let arch = spec.arch_name.as_deref().unwrap_or(arch);
    let kv = HIDDEN / HEADS * KV_HEADS;
    let s_in = 1.7 / (HIDDEN as f32).sqrt();
    let s_ffn = 1.7 / (ffn as f32).sqrt();
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    tensors.push((
        "token_embd.weight".into(),
        tensor(&mut rng, VOCAB, HIDDEN, 1.0, GgmlDType::Q8_0),
    ));
    for i in 0..spec.n_layers {
        let n = |s: &str| format!("blk.{i}.{s}");
        tensors.push((n("attn_norm.weight"), norm(&mut rng, HIDDEN)));
        tensors.push((
            n("attn_q.weight"),
            tensor(&mut rng, HIDDEN, HIDDEN, s_in, wmain),
        ));
        tensors.push((
            n("attn_k.weight"),
            tensor(&mut rng, kv, HIDDEN, s_in, wmain),
        ));
        tensors.push((
            n("attn_v.weight"),
            tensor(&mut rng, kv, HIDDEN, s_in, GgmlDType::Q8_0),
        ));
        if spec.flavour == Flavour::Qwen2 {
            tensors.push((
                n("attn_q.bias"),
                tensor(&mut rng, 1, HIDDEN, 0.2, GgmlDType::F32),
            ));
            tensors.push((
                n("attn_k.bias"),
                tensor(&mut rng, 1, kv, 0.2, GgmlDType::F32),
            ));
            tensors.push((
                n("attn_v.bias"),
                tensor(&mut rng, 1, kv, 0.2, GgmlDType::F32),
            ));
        }
        tensors.push((
            n("attn_output.weight"),
            tensor(&mut rng, HIDDEN, HIDDEN, s_in, wmain),
        ));
        tensors.push((n("ffn_norm.weight"), norm(&mut rng, HIDDEN)));
        tensors.push((
            n("ffn_gate.weight"),
            tensor(&mut rng, ffn, HIDDEN, s_in, wffn),
        ));
        tensors.push((
            n("ffn_up.weight"),
            tensor(&mut rng, ffn, HIDDEN, s_in, wffn),
        ));
        tensors.push((
            n("ffn_down.weight"),
            tensor(&mut rng, HIDDEN, ffn, s_ffn, wdown),
        ));
    }
    tensors.push(("output_norm.weight".into(), norm(&mut rng, HIDDEN)));
    if spec.flavour == Flavour::Qwen2 {
        tensors.push((
            "output.weight".into(),
            tensor(&mut rng, VOCAB, HIDDEN, s_in * 2.0, GgmlDType::Q8_0),
        ));
    }

    let chars = byte_chars();
    let mut tokens: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    tokens.extend(MERGES.iter().map(|(a, b)| format!("{a}{b}")));
    tokens.extend(SPECIALS.iter().map(|s| s.to_string()));
    let mut types = vec![1i32; 256 + MERGES.len()];
    types.extend([3i32; SPECIALS.len()]);
    let p = |k: &str| format!("{arch}.{k}");
    let u32v = |x: usize| Value::U32(x as u32);
    let meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.name".into(), Value::String(format!("tiny-{arch}"))),
        (p("block_count"), u32v(spec.n_layers)),
        (p("embedding_length"), u32v(HIDDEN)),
        (p("feed_forward_length"), u32v(ffn)),
        (p("attention.head_count"), u32v(HEADS)),
        (p("attention.head_count_kv"), u32v(KV_HEADS)),
        (p("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
        (p("rope.freq_base"), Value::F32(10000.0)),
        (p("context_length"), u32v(spec.ctx_len)),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        (
            "tokenizer.ggml.pre".into(),
            Value::String(
                if spec.flavour == Flavour::Llama {
                    "smollm"
                } else {
                    "qwen2"
                }
                .into(),
            ),
        ),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(tokens.into_iter().map(Value::String).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
        (
            "tokenizer.ggml.merges".into(),
            Value::Array(
                MERGES
                    .iter()
                    .map(|(a, b)| Value::String(format!("{a} {b}")))
                    .collect(),
            ),
        ),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(EOS)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(EOS + 2)),
        (
            "tokenizer.chat_template".into(),
            Value::String(CHAT_TEMPLATE.into()),
        ),
    ];
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    gguf_file::write(&mut f, &meta_refs, &tensor_refs)?;
    use std::io::Write;
    f.flush()?;
    Ok(())
}

/// Writes a tiny model into `dir` and returns its path.
pub fn tiny_model(dir: &Path, flavour: Flavour, seed: u64) -> PathBuf {
    let path = dir.join(format!("tiny-{flavour:?}-{seed}.gguf").to_lowercase());
    write_tiny_gguf(&path, &TinySpec::new(flavour, seed)).expect("writing tiny model");
    path
}

/// Like [`tiny_model`], with the MLP's down projection in a K format (see
/// [`TinySpec::k_quants`]).
pub fn tiny_k_model(dir: &Path, flavour: Flavour, seed: u64) -> PathBuf {
    let path = dir.join(format!("tiny-k-{flavour:?}-{seed}.gguf").to_lowercase());
    let spec = TinySpec {
        k_quants: true,
        ..TinySpec::new(flavour, seed)
    };
    write_tiny_gguf(&path, &spec).expect("writing tiny model");
    path
}
