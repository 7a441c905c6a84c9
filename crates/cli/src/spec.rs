//! `--draft`: loading a drafter for speculative decoding.

use anyhow::{bail, Context, Result};
use clap::Args;
use pipeshard_generate::{TextModel, Tokenizer};
use pipeshard_head::draft::{DraftModel, Drafter};
use pipeshard_model::gguf::GgufFile;
use pipeshard_shard::ModelSource;

/// Tokens a draft model scores by default (see `--draft-vocab`).
const DRAFT_VOCAB: usize = 32768;

/// Speculative decoding.
#[derive(Args, Debug, Clone)]
pub struct DraftArgs {
    /// Draft tokens for the model to verify: `ngram` (prompt lookup), a draft model (a known
    /// name such as qwen2.5-coder-0.5b, or a GGUF path; it must share the model's tokenizer),
    /// or `ngram+MODEL` (prompt lookup where it finds a match, the model elsewhere).
    #[arg(long)]
    pub draft: Option<String>,
    /// Tokens drafted per step: a number, or `auto` to adapt per sequence to its acceptance
    /// rate and the measured step and drafting costs.
    #[arg(long, default_value = "auto")]
    pub draft_k: String,
    /// With `--draft-k auto`: the most tokens drafted per step.
    #[arg(long, default_value_t = 10)]
    pub draft_max: usize,
    /// A draft model scores only this many of the most common tokens (the lowest ids) and
    /// the ones the sequence has already seen, skipping most of its output layer; 0 scores
    /// them all. Proposals change, never the output: the model verifies every one.
    #[arg(long, default_value_t = DRAFT_VOCAB)]
    pub draft_vocab: usize,
}

impl Default for DraftArgs {
    fn default() -> Self {
        Self {
            draft: None,
            draft_k: "auto".into(),
            draft_max: 10,
            draft_vocab: DRAFT_VOCAB,
        }
    }
}

impl DraftArgs {
    /// The fixed k, or `None` for auto.
    pub fn fixed_k(&self) -> Result<Option<usize>> {
        match self.draft_k.as_str() {
            "auto" => Ok(None),
            n => n
                .parse()
                .map(Some)
                .with_context(|| format!("--draft-k takes a number or auto, not `{n}`")),
        }
    }

    /// Loads the drafter (`None` without `--draft`); a draft model must share `target`'s
    /// tokenizer.
    pub fn load(&self, target: &Tokenizer, threads: usize) -> Result<Option<Drafter>> {
        self.fixed_k()?;
        let Some(spec) = self.draft.as_deref() else {
            return Ok(None);
        };
        let (ngram, model) = match spec.strip_prefix("ngram") {
            Some("") => return Ok(Some(Drafter::Ngram)),
            Some(rest) => match rest.strip_prefix('+') {
                Some(m) if !m.is_empty() => (true, m),
                _ => bail!("--draft takes ngram, a model, or ngram+MODEL, not `{spec}`"),
            },
            None => (false, spec),
        };
        let source = ModelSource::resolve(model, false)?;
        let meta = GgufFile::open(&source.metadata_file())?;
        let text = TextModel::from_gguf(&meta.content)?;
        let stage = source
            .load_stages(Some(1), threads, true)?
            .pop()
            .context("the draft model has no stage")?;
        let m = DraftModel::new(stage, &text.tokenizer, target, model)
            .map_err(anyhow::Error::msg)?
            .with_vocab(self.draft_vocab);
        Ok(Some(if ngram {
            Drafter::Both(Box::new(m))
        } else {
            Drafter::Model(Box::new(m))
        }))
    }
}
