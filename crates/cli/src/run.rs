//! Driving a local pipeline: prompt in, tokens out, with sampling, stop conditions and timings.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use pipeshard_generate::{
    ChatMessage, ChatTemplate, Detokenizer, FinishReason, Sampler, SamplingParams, StopChecker,
    TextModel, Tokenizer,
};
use pipeshard_model::gguf::GgufFile;
use pipeshard_model::{LocalPipeline, LogitsWanted, SeqId, SeqLogits, SeqStep, TokenId};
use pipeshard_shard::ModelSource;

/// Longest prompt chunk fed in one step (bounds scratch memory; results do not depend on it).
pub const PREFILL_CHUNK: usize = 512;

/// A model ready to generate: its stages on threads, tokenizer and chat template.
pub struct Session {
    pub pipe: LocalPipeline,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    next_seq: u64,
}

impl Session {
    /// Loads the model `arg` names, split into `stages` (or as its manifest says).
    pub fn open(arg: &str, stages: Option<usize>, threads: usize) -> Result<Self> {
        let source = ModelSource::resolve(arg, false)?;
        let meta = GgufFile::open(&source.metadata_file())?;
        let TextModel {
            tokenizer,
            template,
        } = TextModel::from_gguf(&meta.content)?;
        let stages = source.load_stages(stages, threads, false)?;
        let pipe = LocalPipeline::new(stages)?;
        Ok(Self {
            pipe,
            tokenizer,
            template,
            next_seq: 0,
        })
    }

    /// Token ids of a prompt, rendered with the chat template when `chat`.
    pub fn prompt_ids(&self, prompt: &str, chat: bool) -> Result<Vec<TokenId>> {
        let text = if chat {
            let t = self
                .template
                .as_ref()
                .context("the model has no chat template")?;
            t.render(&[ChatMessage::new("user", prompt)])?
        } else {
            prompt.to_string()
        };
        let ids = self.tokenizer.encode(&text)?;
        if ids.is_empty() {
            bail!("the prompt is empty");
        }
        Ok(ids)
    }

    /// A fresh sequence id.
    pub fn new_seq(&mut self) -> SeqId {
        self.next_seq += 1;
        SeqId(self.next_seq)
    }

    /// Feeds `ids` from `pos` in chunks; returns the logits of the last token.
    pub fn prefill(&self, seq: SeqId, pos: usize, ids: &[TokenId]) -> Result<SeqLogits> {
        let mut at = 0;
        loop {
            let n = (ids.len() - at).min(PREFILL_CHUNK);
            let last = at + n == ids.len();
            let step = SeqStep {
                seq,
                pos: pos + at,
                n,
                logits: if last {
                    LogitsWanted::Last
                } else {
                    LogitsWanted::None
                },
            };
            let out = self.pipe.step(vec![step], ids[at..at + n].to_vec())?;
            at += n;
            if last {
                return out
                    .into_iter()
                    .next()
                    .context("the last stage returned no logits");
            }
        }
    }
}

/// What to generate.
pub struct GenRequest {
    pub prompt_ids: Vec<TokenId>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stops: Vec<String>,
}

/// What was generated.
#[derive(Debug, serde::Serialize)]
pub struct GenOutput {
    pub text: String,
    pub tokens: Vec<TokenId>,
    pub prompt_ids: Vec<TokenId>,
    pub finish_reason: FinishReason,
    pub timings: Timings,
}

/// Speeds of one generation.
#[derive(Debug, serde::Serialize)]
pub struct Timings {
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
}

/// Generates one sequence, calling `on_text` with each new piece of text.
pub fn generate(
    s: &mut Session,
    req: GenRequest,
    mut on_text: impl FnMut(&str),
) -> Result<GenOutput> {
    let ctx = s.pipe.config().ctx_len;
    if req.prompt_ids.len() >= ctx {
        bail!(
            "the prompt has {} tokens; the context holds {ctx}",
            req.prompt_ids.len()
        );
    }
    let max_tokens = req.max_tokens.min(ctx - req.prompt_ids.len());
    let mut sampler = Sampler::new(req.sampling)?;
    let seq = s.new_seq();
    let t0 = Instant::now();
    let mut logits = s.prefill(seq, 0, &req.prompt_ids)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut stop = StopChecker::new(s.tokenizer.eos(), &req.stops, max_tokens);
    let mut detok = Detokenizer::new();
    let mut tokens = Vec::new();
    let mut pos = req.prompt_ids.len();
    let mut steps = 0usize;
    let finish = loop {
        if max_tokens == 0 {
            break FinishReason::Length;
        }
        let t = sampler.sample(logits.row(0));
        if stop.is_eos(t) {
            break FinishReason::Stop;
        }
        tokens.push(t);
        let piece = detok.push(&s.tokenizer, t)?;
        let (shown, done) = stop.push(&piece);
        if !shown.is_empty() {
            on_text(&shown);
        }
        if let Some(r) = done {
            break r;
        }
        let step = SeqStep {
            seq,
            pos,
            n: 1,
            logits: LogitsWanted::Last,
        };
        logits = s
            .pipe
            .step(vec![step], vec![t])?
            .into_iter()
            .next()
            .context("no logits")?;
        pos += 1;
        steps += 1;
    };
    let decode_s = t1.elapsed().as_secs_f64();
    s.pipe.release(seq);
    Ok(GenOutput {
        text: stop.text().to_string(),
        tokens,
        prompt_ids: req.prompt_ids.clone(),
        finish_reason: finish,
        timings: Timings {
            prefill_tok_s: req.prompt_ids.len() as f64 / prefill_s.max(1e-9),
            decode_tok_s: if steps == 0 {
                0.0
            } else {
                steps as f64 / decode_s.max(1e-9)
            },
        },
    })
}
