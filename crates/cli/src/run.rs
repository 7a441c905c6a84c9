//! Driving a local pipeline: prompt in, tokens out, with sampling, stop conditions and timings.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use pipeshard_generate::{
    choose_rows, sample_with, ChatMessage, ChatTemplate, Detokenizer, FinishReason, Lane, Sampler,
    SamplingParams, StopChecker, TextModel, Tokenizer,
};
use pipeshard_head::draft::{Acceptance, Drafter, Tuner};
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
    /// Decode steps through the pipeline.
    pub generated_steps: usize,
    /// Proposals drafted and accepted (speculative decoding).
    pub drafted: usize,
    pub accepted: usize,
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

/// Speculative decoding for [`generate`]: the drafter and the choice of k.
pub struct Speculate<'a> {
    pub drafter: &'a mut Drafter,
    pub tuner: Tuner,
}

/// Generates one sequence, calling `on_text` with each new piece of text. With `spec`, a
/// drafter proposes tokens that each step verifies: the tokens are the same as without it
/// (greedy), or follow the same distribution with the same per-position draws (sampling).
pub fn generate(
    s: &mut Session,
    req: GenRequest,
    mut spec: Option<Speculate<'_>>,
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
    let sampling = req.sampling.temperature > 0.0;
    let draws = Sampler::new(req.sampling.clone())?;
    let params = req.sampling;
    let seq = s.new_seq();
    let t0 = Instant::now();
    let first = s.prefill(seq, 0, &req.prompt_ids)?;
    let mut chosen = vec![sample_with(
        &params,
        first.row(0),
        draws.uniform(0, Lane::Sample),
    )];
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut stop = StopChecker::new(s.tokenizer.eos(), &req.stops, max_tokens);
    let mut detok = Detokenizer::new();
    let mut context = req.prompt_ids.clone();
    let mut tokens = Vec::new();
    let mut steps = 0usize;
    let mut acceptance = Acceptance::default();
    let finish = 'outer: loop {
        if max_tokens == 0 {
            break FinishReason::Length;
        }
        for &t in &chosen {
            if stop.is_eos(t) {
                break 'outer FinishReason::Stop;
            }
            tokens.push(t);
            context.push(t);
            let piece = detok.push(&s.tokenizer, t)?;
            let (shown, done) = stop.push(&piece);
            if !shown.is_empty() {
                on_text(&shown);
            }
            if let Some(r) = done {
                break 'outer r;
            }
        }
        // The last token is fed; after it, the proposals (a sampling run's last one is not
        // fed: it is verified at the last row).
        let g = tokens.len() as u64;
        let proposals = match &mut spec {
            Some(sp) => {
                let k = sp
                    .tuner
                    .choose(&acceptance)
                    .min(max_tokens - tokens.len() - 1);
                let want = k + usize::from(sampling);
                let u: Vec<f32> = (0..want as u64)
                    .map(|i| draws.uniform(g + i, Lane::Draft))
                    .collect();
                let (started, fed) = (Instant::now(), sp.drafter.fed());
                let p = sp.drafter.propose(seq.0, &context, want, &params, &u);
                let us = started.elapsed().as_micros() as f64;
                sp.tuner.observe_draft(p.len(), sp.drafter.fed() - fed, us);
                p
            }
            None => vec![],
        };
        let fed = proposals.len().saturating_sub(usize::from(sampling));
        let mut input = vec![*context.last().expect("a token was chosen")];
        input.extend(proposals[..fed].iter().map(|p| p.token));
        let n = input.len();
        let step = SeqStep {
            seq,
            pos: context.len() - 1,
            n,
            logits: if proposals.is_empty() {
                LogitsWanted::Last
            } else {
                LogitsWanted::All
            },
        };
        let started = Instant::now();
        let logits = s
            .pipe
            .step(vec![step], input)?
            .into_iter()
            .next()
            .context("no logits")?;
        if let Some(sp) = &mut spec {
            sp.tuner
                .observe_step(n, started.elapsed().as_micros() as f64);
        }
        let ids: Vec<u32> = proposals.iter().map(|p| p.token).collect();
        let q: Vec<_> = proposals.iter().map(|p| p.q.clone()).collect();
        let uniforms: Vec<f32> = (0..n as u64)
            .map(|i| draws.uniform(g + i, Lane::Sample))
            .collect();
        let accept: Vec<f32> = (0..ids.len() as u64)
            .map(|i| draws.uniform(g + i, Lane::Accept))
            .collect();
        chosen = choose_rows(
            &params,
            (0..logits.rows).map(|i| logits.row(i)),
            &ids,
            &q,
            &uniforms,
            &accept,
        );
        acceptance.observe(&ids, &chosen);
        steps += 1;
    };
    let decode_s = t1.elapsed().as_secs_f64();
    if let Some(sp) = &mut spec {
        sp.drafter.release(seq.0);
    }
    s.pipe.release(seq);
    let decode_tok_s = if steps == 0 {
        0.0
    } else {
        tokens.len().saturating_sub(1) as f64 / decode_s.max(1e-9)
    };
    Ok(GenOutput {
        text: stop.text().to_string(),
        generated_steps: steps,
        drafted: acceptance.drafted,
        accepted: acceptance.accepted,
        tokens,
        prompt_ids: req.prompt_ids.clone(),
        finish_reason: finish,
        timings: Timings {
            prefill_tok_s: req.prompt_ids.len() as f64 / prefill_s.max(1e-9),
            decode_tok_s,
        },
    })
}
