//! `pipeshard bench`: end-to-end speed, medians of several runs.

use std::time::Instant;

use anyhow::Result;
use clap::{Args, Subcommand};
use pipeshard_model::{LogitsWanted, SeqId, SeqStep, TokenId};

use crate::cmd::ModelArgs;
use crate::run::Session;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Prefill and decode speed of the local pipeline.
    Decode(DecodeArgs),
}

#[derive(Args, Debug)]
pub struct DecodeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Sequences decoded together in one batch.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Tokens decoded per run.
    #[arg(long, default_value_t = 64)]
    pub gen_tokens: usize,
    /// Runs; the median is reported.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Decode(a) => decode(a),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn decode(a: DecodeArgs) -> Result<()> {
    let mut s = Session::open(&a.model.model, a.model.stages, a.model.threads)?;
    let text = "fn main() { let v: Vec<u32> = (0..100).map(|x| x * x).collect(); println!(\"{:?}\", v); } ";
    let mut base = s.tokenizer.encode(&text.repeat(a.prompt_tokens / 8 + 1))?;
    base.truncate(a.prompt_tokens);
    let (mut pre, mut dec) = (Vec::new(), Vec::new());
    for _ in 0..a.runs.max(1) {
        let seqs: Vec<SeqId> = (0..a.batch).map(|_| s.new_seq()).collect();
        // Every sequence gets its own prompt (shifted), prefilled in one batch.
        let mut tokens: Vec<TokenId> = Vec::new();
        let mut steps = Vec::new();
        for (i, &seq) in seqs.iter().enumerate() {
            let mut p = base.clone();
            let shift = i % p.len().max(1);
            p.rotate_left(shift);
            tokens.extend(p);
            steps.push(SeqStep {
                seq,
                pos: 0,
                n: base.len(),
                logits: LogitsWanted::Last,
            });
        }
        let t0 = Instant::now();
        let mut out = s.pipe.step(steps, tokens)?;
        pre.push((a.batch * base.len()) as f64 / t0.elapsed().as_secs_f64());
        let t1 = Instant::now();
        for k in 0..a.gen_tokens {
            let next: Vec<TokenId> = out.iter().map(|l| l.argmax()[0]).collect();
            let steps = seqs
                .iter()
                .map(|&seq| SeqStep {
                    seq,
                    pos: base.len() + k,
                    n: 1,
                    logits: LogitsWanted::Last,
                })
                .collect();
            out = s.pipe.step(steps, next)?;
        }
        dec.push((a.batch * a.gen_tokens) as f64 / t1.elapsed().as_secs_f64());
        for seq in seqs {
            s.pipe.release(seq);
        }
    }
    let (p, d) = (median(pre), median(dec));
    if a.json {
        println!(
            "{}",
            serde_json::json!({"prefill_tok_s": p, "decode_tok_s": d, "batch": a.batch,
                "threads": a.model.threads, "stages": s.pipe.ranges().len(), "runs": a.runs})
        );
    } else {
        println!("prefill {p:.2} tok/s ({} tokens x {}), decode {d:.2} tok/s (batch {}, {} tokens), median of {}",
            base.len(), a.batch, a.batch, a.gen_tokens, a.runs);
    }
    Ok(())
}
