//! The user-facing subcommands.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use pipeshard_generate::SamplingParams;
use pipeshard_model::{LogitsWanted, SeqStep};
use pipeshard_shard::{
    fetch as fetch_model, known_model, parse_layers, Manifest, ModelSource, KNOWN_MODELS,
};

use crate::run::{generate as run_generate, GenRequest, Session, Speculate};
use pipeshard_head::draft::Tuner;

/// The model used wherever a model is optional.
pub const DEFAULT_MODEL: &str = "smollm2-135m";

#[derive(Args, Debug)]
pub struct FetchArgs {
    /// Model name: smollm2-135m, qwen2.5-coder-0.5b or qwen2.5-coder-1.5b.
    #[arg(default_value = DEFAULT_MODEL)]
    pub name: String,
    /// No progress bars.
    #[arg(long, short)]
    pub quiet: bool,
}

pub fn fetch(a: FetchArgs) -> Result<()> {
    let Some(m) = known_model(&a.name) else {
        let names: Vec<&str> = KNOWN_MODELS.iter().map(|m| m.name).collect();
        bail!("unknown model `{}` (known: {})", a.name, names.join(", "));
    };
    let path = fetch_model(m, a.quiet)?;
    println!("{}", path.display());
    Ok(())
}

#[derive(Args, Debug)]
pub struct SplitArgs {
    /// The model: a GGUF file or a known model name.
    pub model: String,
    /// Number of stages; layers are divided so that the costliest stage (counting the output
    /// layer, in weight bytes and elements) costs least.
    #[arg(long, conflicts_with = "layers")]
    pub stages: Option<usize>,
    /// Explicit layer ranges, e.g. `0..15,15..28`; they must tile all layers.
    #[arg(long)]
    pub layers: Option<String>,
    /// Output folder for the shards and manifest.json.
    #[arg(long)]
    pub out: PathBuf,
    /// No progress bars.
    #[arg(long, short)]
    pub quiet: bool,
}

pub fn split(a: SplitArgs) -> Result<()> {
    let ModelSource::Gguf(path) = ModelSource::resolve(&a.model, a.quiet)? else {
        bail!("{} is a manifest; split the original model", a.model);
    };
    let ranges = match (&a.layers, a.stages) {
        (Some(spec), _) => parse_layers(spec)?,
        (None, Some(n)) => {
            let g = pipeshard_model::gguf::GgufFile::open(&path)?;
            let c = pipeshard_model::ModelConfig::from_gguf(&g.content)?;
            pipeshard_shard::plan(&g.content, c.n_layers, n)?
        }
        (None, None) => bail!("give --stages N or --layers A..B,B..C"),
    };
    let m = pipeshard_shard::split(&path, &ranges, &a.out, a.quiet)?;
    for s in &m.stages {
        eprintln!(
            "stage {}: layers {} -> {} ({} bytes)",
            s.index, s.layers, s.file, s.bytes
        );
    }
    println!("{}", a.out.join("manifest.json").display());
    Ok(())
}

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// A manifest.json written by split (or its folder).
    pub manifest: PathBuf,
    /// Print the manifest as JSON.
    #[arg(long)]
    pub json: bool,
    /// Also check every shard's size, identity and sha256.
    #[arg(long)]
    pub verify: bool,
}

pub fn inspect(a: InspectArgs) -> Result<()> {
    let path = if a.manifest.is_dir() {
        a.manifest.join("manifest.json")
    } else {
        a.manifest.clone()
    };
    let m = Manifest::load(&path)?;
    if a.verify {
        m.verify(&path, true, false)?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&m)?);
        return Ok(());
    }
    let c = &m.config;
    println!(
        "model    {} ({} bytes, sha256 {})",
        m.model.file, m.model.bytes, m.model.sha256
    );
    println!(
        "config   {} layers={} hidden={} ffn={} heads={}/{} vocab={} ctx={} rope_theta={}",
        c.arch.name(),
        c.n_layers,
        c.hidden,
        c.ffn,
        c.n_heads,
        c.n_kv_heads,
        c.vocab,
        c.ctx_len,
        c.rope_theta
    );
    println!("stages   {}", m.stages.len());
    for s in &m.stages {
        println!(
            "  {:>2}  layers {:>7}  {:>12} bytes  {}  {}",
            s.index,
            s.layers.to_string(),
            s.bytes,
            s.sha256,
            s.file
        );
    }
    if a.verify {
        println!("verified: every shard is present, complete and matches its sha256");
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct ModelArgs {
    /// A GGUF file, a manifest.json written by split, or a known model name (fetched if absent).
    #[arg(long, default_value = DEFAULT_MODEL)]
    pub model: String,
    /// Split the model into this many stages, one thread each (default: 1, or the manifest's).
    #[arg(long)]
    pub stages: Option<usize>,
    /// Compute threads per stage (results are identical for any count).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt.
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    pub chat: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Sample among the K most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Sample from the smallest set of tokens whose probability reaches P.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Random seed for sampling.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when this text is produced (repeatable); it is not included.
    #[arg(long = "stop")]
    pub stops: Vec<String>,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub draft: crate::spec::DraftArgs,
}

pub fn generate(a: GenerateArgs) -> Result<()> {
    let mut s = Session::open(&a.model.model, a.model.stages, a.model.threads)?;
    let mut drafter = a.draft.load(&s.tokenizer, a.model.threads)?;
    let spec = match &mut drafter {
        Some(d) => Some(Speculate {
            drafter: d,
            tuner: Tuner::new(a.draft.fixed_k()?, a.draft.draft_max),
        }),
        None => None,
    };
    let req = GenRequest {
        prompt_ids: s.prompt_ids(&a.prompt, a.chat)?,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            seed: a.seed,
        },
        max_tokens: a.max_tokens,
        stops: a.stops,
    };
    let json = a.json;
    let mut stdout = std::io::stdout();
    let out = run_generate(&mut s, req, spec, |piece| {
        if !json {
            let _ = stdout.write_all(piece.as_bytes());
            let _ = stdout.flush();
        }
    })?;
    if json {
        println!("{}", serde_json::to_string(&out)?);
    } else {
        println!();
        eprintln!(
            "[{} prompt tokens, {} generated, finish: {:?}, prefill {:.1} tok/s, decode {:.1} tok/s{}]",
            out.prompt_ids.len(),
            out.tokens.len(),
            out.finish_reason,
            out.timings.prefill_tok_s,
            out.timings.decode_tok_s,
            if out.drafted > 0 {
                format!(", {} of {} drafted tokens accepted", out.accepted, out.drafted)
            } else {
                String::new()
            }
        );
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text file to score.
    #[arg(long)]
    pub file: PathBuf,
    /// Window size in tokens; the second half of each window is scored.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
}

/// Perplexity as llama.cpp's tool computes it: non-overlapping windows of `ctx` tokens, each
/// scored on its second half.
pub fn perplexity(a: PerplexityArgs) -> Result<()> {
    let mut s = Session::open(&a.model.model, a.model.stages, a.model.threads)?;
    let text = std::fs::read_to_string(&a.file)
        .with_context(|| format!("reading {}", a.file.display()))?;
    let tokens = s.tokenizer.encode(&text)?;
    if a.ctx < 4 || a.ctx > s.pipe.config().ctx_len {
        bail!(
            "--ctx {} must be between 4 and the model's context {}",
            a.ctx,
            s.pipe.config().ctx_len
        );
    }
    let chunks = tokens.len() / a.ctx;
    if chunks == 0 {
        bail!(
            "{} has {} tokens, fewer than one window of {}",
            a.file.display(),
            tokens.len(),
            a.ctx
        );
    }
    let first = a.ctx / 2;
    let (mut nll, mut count) = (0f64, 0usize);
    for c in 0..chunks {
        let w = &tokens[c * a.ctx..(c + 1) * a.ctx];
        let seq = s.new_seq();
        s.pipe.step(
            vec![SeqStep {
                seq,
                pos: 0,
                n: first,
                logits: LogitsWanted::None,
            }],
            w[..first].to_vec(),
        )?;
        let out = s.pipe.step(
            vec![SeqStep {
                seq,
                pos: first,
                n: a.ctx - first,
                logits: LogitsWanted::All,
            }],
            w[first..].to_vec(),
        )?;
        s.pipe.release(seq);
        let l = out.first().context("no logits")?;
        for j in first..a.ctx - 1 {
            let row = l.row(j - first);
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max
                + row
                    .iter()
                    .map(|&x| (x as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            nll += lse - row[w[j + 1] as usize] as f64;
            count += 1;
        }
        eprintln!(
            "[{}/{}] ppl so far {:.4}",
            c + 1,
            chunks,
            (nll / count as f64).exp()
        );
    }
    println!("ppl={:.4}", (nll / count as f64).exp());
    Ok(())
}
