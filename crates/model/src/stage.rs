//! A stage: a contiguous range of layers, plus the token embedding on the first stage and the
//! final norm and lm_head on the last, with a forward pass over a batch of sequences.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use rayon::prelude::*;

use crate::batch::{
    LayerRange, LogitsWanted, SeqLogits, StageInput, StageOutput, StepBatch, TokenId,
};
use crate::config::{Arch, ModelConfig};
use crate::error::ModelError;
use crate::gguf::GgufFile;
use crate::kv::{KvStore, LayerCache, SeqCache};
use crate::ops::{self, Rope, RopeStyle};
use crate::qweight::QWeight;
use crate::Result;

/// Metadata keys a shard carries besides the model's own.
pub mod keys {
    /// Index of the stage in the ring.
    pub const STAGE_INDEX: &str = "pipeshard.stage_index";
    /// Number of stages.
    pub const STAGE_COUNT: &str = "pipeshard.stage_count";
    /// First layer held (inclusive).
    pub const LAYER_START: &str = "pipeshard.layer_start";
    /// Last layer held (exclusive).
    pub const LAYER_END: &str = "pipeshard.layer_end";
    /// sha256 of the source model file.
    pub const SOURCE_SHA256: &str = "pipeshard.source_sha256";
}

struct Layer {
    attn_norm: Vec<f32>,
    wq: QWeight,
    wk: QWeight,
    wv: QWeight,
    wo: QWeight,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    gate: QWeight,
    up: QWeight,
    down: QWeight,
}

/// The weights of a layer range, immutable once loaded.
pub struct Stage {
    config: ModelConfig,
    range: LayerRange,
    embed: Option<Arc<QWeight>>,
    layers: Vec<Layer>,
    output_norm: Option<Vec<f32>>,
    lm_head: Option<Arc<QWeight>>,
    rope: Rope,
    pool: Option<Arc<rayon::ThreadPool>>,
    weight_bytes: usize,
}

impl std::fmt::Debug for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stage")
            .field("range", &self.range)
            .field("first", &self.is_first())
            .field("last", &self.is_last())
            .finish()
    }
}

impl Stage {
    /// Loads a stage from a GGUF file. A shard written by `split` knows its own range; for a
    /// full model, `range` picks the layers (`None`: all of them).
    pub fn load(path: &Path, range: Option<LayerRange>) -> Result<Self> {
        let mut g = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&g.content).map_err(|e| match e {
            ModelError::Gguf { msg, .. } => g.err(msg),
            other => other,
        })?;
        let shard_range = shard_range(&g)?;
        let range = match (shard_range, range) {
            (Some(s), Some(r)) if s != r => {
                return Err(g.err(format!("shard holds layers {s}, not the requested {r}")))
            }
            (Some(s), _) => s,
            (None, Some(r)) => r,
            (None, None) => LayerRange::new(0, config.n_layers),
        };
        if range.is_empty() || range.end > config.n_layers {
            return Err(g.err(format!(
                "layer range {range} is not within 0..{}",
                config.n_layers
            )));
        }
        Self::from_gguf(&mut g, config, range)
    }

    fn from_gguf(g: &mut GgufFile, config: ModelConfig, range: LayerRange) -> Result<Self> {
        let first = range.start == 0;
        let last = range.end == config.n_layers;
        let mut weight_bytes = 0;
        let embed = if first {
            let w = Arc::new(g.qweight("token_embd.weight")?);
            check_shape(g, "token_embd.weight", &w, config.vocab, config.hidden)?;
            weight_bytes += w.nbytes();
            Some(w)
        } else {
            None
        };
        let mut layers = Vec::with_capacity(range.len());
        for i in range.start..range.end {
            let n = |s: &str| format!("blk.{i}.{s}");
            let bias = |g: &mut GgufFile, s: &str| -> Result<Option<Vec<f32>>> {
                let name = n(s);
                if g.has(&name) {
                    Ok(Some(g.vector(&name)?))
                } else {
                    Ok(None)
                }
            };
            let kv = config.kv_dim();
            let (h, f) = (config.hidden, config.ffn);
            let mut mat = |s: &str, rows: usize, cols: usize| -> Result<QWeight> {
                let w = g.qweight(&n(s))?;
                check_shape(g, &n(s), &w, rows, cols)?;
                weight_bytes += w.nbytes();
                Ok(w)
            };
            let layer = Layer {
                wq: mat("attn_q.weight", h, h)?,
                wk: mat("attn_k.weight", kv, h)?,
                wv: mat("attn_v.weight", kv, h)?,
                wo: mat("attn_output.weight", h, h)?,
                gate: mat("ffn_gate.weight", f, h)?,
                up: mat("ffn_up.weight", f, h)?,
                down: mat("ffn_down.weight", h, f)?,
                attn_norm: g.vector(&n("attn_norm.weight"))?,
                ffn_norm: g.vector(&n("ffn_norm.weight"))?,
                bq: bias(g, "attn_q.bias")?,
                bk: bias(g, "attn_k.bias")?,
                bv: bias(g, "attn_v.bias")?,
            };
            layers.push(layer);
        }
        let (output_norm, lm_head) = if last {
            let norm = g.vector("output_norm.weight")?;
            let head = if g.has("output.weight") {
                Arc::new(g.qweight("output.weight")?)
            } else if let Some(e) = &embed {
                e.clone()
            } else {
                // Tied embeddings: the last stage holds the embedding table as its lm_head.
                Arc::new(g.qweight("token_embd.weight")?)
            };
            check_shape(g, "lm_head", &head, config.vocab, config.hidden)?;
            if embed.as_ref().is_none_or(|e| !Arc::ptr_eq(e, &head)) {
                weight_bytes += head.nbytes();
            }
            (Some(norm), Some(head))
        } else {
            (None, None)
        };
        let style = match config.arch {
            Arch::Llama => RopeStyle::Adjacent,
            Arch::Qwen2 => RopeStyle::Halves,
        };
        let rope = Rope::new(style, config.head_dim, config.rope_theta);
        Ok(Self {
            config,
            range,
            embed,
            layers,
            output_norm,
            lm_head,
            rope,
            pool: None,
            weight_bytes,
        })
    }

    /// Runs matmuls on a pool of `n` threads (results do not depend on `n`).
    pub fn set_threads(&mut self, n: usize) -> Result<()> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build()
            .map_err(|e| ModelError::InvalidBatch(format!("thread pool: {e}")))?;
        self.pool = Some(Arc::new(pool));
        Ok(())
    }

    /// Runs matmuls on `pool` instead (one the caller built, e.g. of low priority).
    pub fn set_thread_pool(&mut self, pool: Arc<rayon::ThreadPool>) {
        self.pool = Some(pool);
    }

    /// Threads its matmuls run on.
    pub fn threads(&self) -> usize {
        self.pool
            .as_ref()
            .map_or_else(rayon::current_num_threads, |p| p.current_num_threads())
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
    /// The layers this stage runs.
    pub fn range(&self) -> LayerRange {
        self.range
    }
    /// Holds the token embedding.
    pub fn is_first(&self) -> bool {
        self.range.start == 0
    }
    /// Holds the final norm and lm_head.
    pub fn is_last(&self) -> bool {
        self.range.end == self.config.n_layers
    }
    /// Bytes of weights held.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// Checks a batch against this stage and the caches, before anything is changed.
    fn validate(&self, batch: &StepBatch, kv: &KvStore) -> Result<()> {
        let bad = |m: String| Err(ModelError::InvalidBatch(m));
        if batch.seqs.is_empty() {
            return bad("no sequences".into());
        }
        let mut seen = HashSet::new();
        for s in &batch.seqs {
            if !seen.insert(s.seq) {
                return bad(format!("{} appears twice", s.seq));
            }
            if s.n == 0 {
                return bad(format!("{} has no tokens", s.seq));
            }
            let have = kv.len(s.seq);
            if s.pos > have {
                return bad(format!(
                    "{} starts at position {} but only {have} are cached",
                    s.seq, s.pos
                ));
            }
            if s.pos + s.n > self.config.ctx_len {
                return bad(format!(
                    "{} reaches position {}, past the context length {}",
                    s.seq,
                    s.pos + s.n,
                    self.config.ctx_len
                ));
            }
        }
        let rows = batch.total_rows();
        match &batch.input {
            StageInput::Tokens(t) => {
                if !self.is_first() {
                    return bad(format!(
                        "stage {} takes hidden states, not tokens",
                        self.range
                    ));
                }
                if t.len() != rows {
                    return bad(format!("{} tokens for {rows} rows", t.len()));
                }
                if let Some(&bad_tok) = t.iter().find(|&&t| t as usize >= self.config.vocab) {
                    return bad(format!(
                        "token {bad_tok} outside vocabulary {}",
                        self.config.vocab
                    ));
                }
            }
            StageInput::Hidden(h) => {
                if self.is_first() {
                    return bad("the first stage takes tokens, not hidden states".into());
                }
                if h.len() != rows * self.config.hidden {
                    return bad(format!(
                        "{} hidden values for {rows} rows of {}",
                        h.len(),
                        self.config.hidden
                    ));
                }
            }
        }
        Ok(())
    }

    /// Runs the stage's layers over a batch. Each sequence's cache is first truncated to its
    /// `pos`, then the new tokens are appended. Returns hidden states for every row, or on the
    /// last stage the requested logits.
    pub fn forward(&self, batch: &StepBatch, kv: &mut KvStore) -> Result<StageOutput> {
        self.forward_scoring(batch, kv, None)
    }

    /// [`Stage::forward`], the last stage scoring only the tokens `vocab` names (all when
    /// `None`); the others' logits are `-inf`.
    pub fn forward_scoring(
        &self,
        batch: &StepBatch,
        kv: &mut KvStore,
        vocab: Option<&Vocab>,
    ) -> Result<StageOutput> {
        self.validate(batch, kv)?;
        match &self.pool {
            Some(p) => p.install(|| self.forward_inner(batch, kv, vocab)),
            None => self.forward_inner(batch, kv, vocab),
        }
    }

    fn forward_inner(
        &self,
        batch: &StepBatch,
        kv: &mut KvStore,
        vocab: Option<&Vocab>,
    ) -> Result<StageOutput> {
        let c = &self.config;
        let rows = batch.total_rows();
        let mut x = match &batch.input {
            StageInput::Tokens(tokens) => {
                // validate() proved the first stage holds the embedding.
                let embed = self.embed.as_ref().expect("first stage has an embedding");
                let mut x = vec![0f32; rows * c.hidden];
                for (t, row) in tokens.iter().zip(x.chunks_exact_mut(c.hidden)) {
                    embed.dequantize_row(*t as usize, row);
                }
                x
            }
            StageInput::Hidden(h) => h.clone(),
        };
        for s in &batch.seqs {
            let cache = kv.seqs.entry(s.seq).or_insert_with(|| SeqCache {
                layers: vec![LayerCache::default(); self.layers.len()],
                len: 0,
            });
            for l in &mut cache.layers {
                l.k.truncate(s.pos * c.kv_dim());
                l.v.truncate(s.pos * c.kv_dim());
            }
            cache.len = s.pos + s.n;
        }
        // Positions of every row, and its sequence's index in the batch.
        let mut row_pos = Vec::with_capacity(rows);
        for s in &batch.seqs {
            row_pos.extend(s.pos..s.pos + s.n);
        }
        let tables: Vec<(Vec<f32>, Vec<f32>)> =
            row_pos.iter().map(|&p| self.rope.table(p)).collect();
        for (li, layer) in self.layers.iter().enumerate() {
            self.layer_forward(layer, li, &mut x, batch, &tables, kv);
        }
        if !self.is_last() {
            return Ok(StageOutput::Hidden(x));
        }
        self.logits(&x, batch, vocab).map(StageOutput::Logits)
    }

    fn layer_forward(
        &self,
        l: &Layer,
        li: usize,
        x: &mut [f32],
        batch: &StepBatch,
        tables: &[(Vec<f32>, Vec<f32>)],
        kv: &mut KvStore,
    ) {
        let c = &self.config;
        let (h, kvd, rows) = (c.hidden, c.kv_dim(), batch.total_rows());
        let mut xn = vec![0f32; rows * h];
        ops::rms_norm(x, &l.attn_norm, c.rms_eps, &mut xn);
        let mut q = vec![0f32; rows * h];
        let mut k = vec![0f32; rows * kvd];
        let mut v = vec![0f32; rows * kvd];
        l.wq.matmul(&xn, rows, &mut q);
        l.wk.matmul(&xn, rows, &mut k);
        l.wv.matmul(&xn, rows, &mut v);
        for (t, b) in [(&mut q, &l.bq), (&mut k, &l.bk), (&mut v, &l.bv)] {
            if let Some(b) = b {
                ops::add_bias(t, b);
            }
        }
        for (r, (cos, sin)) in tables.iter().enumerate() {
            self.rope.apply(&mut q[r * h..(r + 1) * h], cos, sin);
            self.rope.apply(&mut k[r * kvd..(r + 1) * kvd], cos, sin);
        }
        let mut att = vec![0f32; rows * h];
        let mut row0 = 0;
        for s in &batch.seqs {
            let cache = &mut kv.seqs.get_mut(&s.seq).expect("cache created above").layers[li];
            cache
                .k
                .extend_from_slice(&k[row0 * kvd..(row0 + s.n) * kvd]);
            cache
                .v
                .extend_from_slice(&v[row0 * kvd..(row0 + s.n) * kvd]);
            let cache = &*cache;
            let q_rows = &q[row0 * h..(row0 + s.n) * h];
            let out = &mut att[row0 * h..(row0 + s.n) * h];
            let one = |j: usize, (qr, or): (&[f32], &mut [f32])| {
                self.attend_row(qr, or, s.pos + j, cache)
            };
            if rayon::current_num_threads() > 1 && s.n > 1 {
                q_rows
                    .par_chunks_exact(h)
                    .zip(out.par_chunks_exact_mut(h))
                    .enumerate()
                    .for_each(|(j, p)| one(j, p));
            } else {
                q_rows
                    .chunks_exact(h)
                    .zip(out.chunks_exact_mut(h))
                    .enumerate()
                    .for_each(|(j, p)| one(j, p));
            }
            row0 += s.n;
        }
        let mut o = vec![0f32; rows * h];
        l.wo.matmul(&att, rows, &mut o);
        for (a, b) in x.iter_mut().zip(&o) {
            *a += b;
        }
        ops::rms_norm(x, &l.ffn_norm, c.rms_eps, &mut xn);
        let mut gate = vec![0f32; rows * c.ffn];
        let mut up = vec![0f32; rows * c.ffn];
        l.gate.matmul(&xn, rows, &mut gate);
        l.up.matmul(&xn, rows, &mut up);
        ops::silu_mul(&mut gate, &up);
        l.down.matmul(&gate, rows, &mut o);
        for (a, b) in x.iter_mut().zip(&o) {
            *a += b;
        }
    }

    /// Causal attention of one query row at absolute position `pos` over the cache.
    fn attend_row(&self, q: &[f32], out: &mut [f32], pos: usize, cache: &LayerCache) {
        let c = &self.config;
        let (hd, kvd) = (c.head_dim, c.kv_dim());
        let group = c.n_heads / c.n_kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut scores = vec![0f32; pos + 1];
        for head in 0..c.n_heads {
            let kvh = head / group;
            let qh = &q[head * hd..(head + 1) * hd];
            for (t, s) in scores.iter_mut().enumerate() {
                let kt = &cache.k[t * kvd + kvh * hd..t * kvd + (kvh + 1) * hd];
                *s = ops::dot(qh, kt) * scale;
            }
            ops::softmax(&mut scores);
            let oh = &mut out[head * hd..(head + 1) * hd];
            oh.fill(0.0);
            for (t, &w) in scores.iter().enumerate() {
                ops::axpy(
                    w,
                    &cache.v[t * kvd + kvh * hd..t * kvd + (kvh + 1) * hd],
                    oh,
                );
            }
        }
    }

    fn logits(
        &self,
        x: &[f32],
        batch: &StepBatch,
        vocab: Option<&Vocab>,
    ) -> Result<Vec<SeqLogits>> {
        let c = &self.config;
        // validate() and is_last() prove these exist on the last stage.
        let norm = self
            .output_norm
            .as_ref()
            .expect("last stage has output norm");
        let head = self.lm_head.as_ref().expect("last stage has lm_head");
        let mut picked = Vec::new();
        let mut spans = Vec::new();
        let mut row0 = 0;
        for s in &batch.seqs {
            let (first, count) = match s.logits {
                LogitsWanted::None => (s.n, 0),
                LogitsWanted::Last => (s.n - 1, 1),
                LogitsWanted::All => (0, s.n),
            };
            picked.extend_from_slice(
                &x[(row0 + first) * c.hidden..(row0 + first + count) * c.hidden],
            );
            spans.push((s.seq, s.pos + first, count));
            row0 += s.n;
        }
        let n = picked.len() / c.hidden;
        let mut xn = vec![0f32; picked.len()];
        ops::rms_norm(&picked, norm, c.rms_eps, &mut xn);
        let mut logits = match vocab {
            None => {
                let mut logits = vec![0f32; n * c.vocab];
                head.matmul(&xn, n, &mut logits);
                logits
            }
            Some(v) => v.score(head, &xn, c.hidden),
        };
        let mut out = Vec::new();
        let mut at = 0;
        for (seq, first_pos, rows) in spans {
            if rows == 0 {
                continue;
            }
            // One sequence's rows are all of them: handed over, not copied (a 5-row
            // verification's are 3 MB).
            let data = if rows == n {
                std::mem::take(&mut logits)
            } else {
                logits[at * c.vocab..(at + rows) * c.vocab].to_vec()
            };
            out.push(SeqLogits {
                seq,
                first_pos,
                rows,
                data,
            });
            at += rows;
        }
        Ok(out)
    }
}

/// The tokens a last stage scores: the first `common` ids and the `extra` ones. A small draft
/// model spends a third of its time in its lm_head (the 0.5B's is 145 of 392 MB read per
/// token), and byte-level BPE vocabularies number tokens roughly by frequency, merges learned
/// first getting low ids: the first 32,768 of Qwen2.5's 151,936 cover 93% of tokens in code.
/// The extra ones are those the sequence has already seen (names from the prompt), which the
/// draft would otherwise never propose.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Vocab {
    /// Ids below this are scored (rounded up to a multiple of 8).
    pub common: usize,
    /// Further ids scored, by dot products with their dequantized rows.
    pub extra: Vec<TokenId>,
}

impl Vocab {
    /// `[n, vocab]` logits of the `n` rows of `xn`, `-inf` for the tokens not scored.
    fn score(&self, head: &QWeight, xn: &[f32], hidden: usize) -> Vec<f32> {
        let vocab = head.rows();
        let n = xn.len() / hidden;
        let common = self.common.next_multiple_of(8).min(vocab);
        let mut part = vec![0f32; n * common];
        head.matmul_first(xn, n, common, &mut part);
        let mut logits = vec![f32::NEG_INFINITY; n * vocab];
        for (row, part) in logits
            .chunks_exact_mut(vocab)
            .zip(part.chunks_exact(common))
        {
            row[..common].copy_from_slice(part);
        }
        let mut w = vec![0f32; hidden];
        for &id in &self.extra {
            let id = id as usize;
            if id < common || id >= vocab {
                continue;
            }
            head.dequantize_row(id, &mut w);
            for (row, x) in logits.chunks_exact_mut(vocab).zip(xn.chunks_exact(hidden)) {
                row[id] = ops::dot(&w, x);
            }
        }
        logits
    }
}

fn check_shape(g: &GgufFile, name: &str, w: &QWeight, rows: usize, cols: usize) -> Result<()> {
    if w.rows() != rows || w.cols() != cols {
        return Err(g.err(format!(
            "tensor `{name}` is {}x{}, expected {rows}x{cols}",
            w.rows(),
            w.cols()
        )));
    }
    Ok(())
}

/// The layer range recorded in a shard's metadata, if it is one.
fn shard_range(g: &GgufFile) -> Result<Option<LayerRange>> {
    let get = |k: &str| g.meta(k).and_then(|v| v.to_u32().ok());
    match (get(keys::LAYER_START), get(keys::LAYER_END)) {
        (Some(s), Some(e)) if s < e => Ok(Some(LayerRange::new(s as usize, e as usize))),
        (None, None) => Ok(None),
        _ => Err(g.err("malformed pipeshard layer range metadata")),
    }
}
