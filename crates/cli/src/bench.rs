//! `pipeshard bench`: end-to-end speed, medians of several runs.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use pipeshard_model::{LogitsWanted, SeqId, SeqStep, TokenId};

use pipeshard_head::{GenEvent, GenRequest, HeadHandle};
use pipeshard_shard::ModelSource;

use crate::cmd::ModelArgs;
use crate::run::Session;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Prefill and decode speed of the local pipeline.
    Decode(DecodeArgs),
    /// One user through a ring of stage processes on loopback, against the unsplit model in
    /// this process, alternating, same binary.
    Ring(RingArgs),
    /// Several users at once through a ring of stage processes, against the unsplit model
    /// serving one user on one core.
    Throughput(ThroughputArgs),
    /// Speculative decoding through a ring of stage processes: drafters and k against no
    /// speculation on the same pipeline, on coding prompts.
    Spec(SpecArgs),
}

#[derive(Args, Debug)]
pub struct SpecArgs {
    /// The target: a known model name or a GGUF file.
    #[arg(long, default_value = "qwen2.5-coder-1.5b")]
    pub model: String,
    /// Stages (processes; stage 0 and the drafter run in this one), layers split to balance
    /// their cost (`split --stages`).
    #[arg(long, default_value_t = 2)]
    pub stages: usize,
    /// Explicit layer ranges instead, e.g. `0..16,16..28`.
    #[arg(long)]
    pub layers: Option<String>,
    /// Drafters to measure, comma-separated (as `--draft` takes them).
    #[arg(long, default_value = "ngram,qwen2.5-coder-0.5b")]
    pub drafters: String,
    /// Values of k, comma-separated; `auto` adapts.
    #[arg(long, default_value = "0,1,2,3,4,6,8,10,auto")]
    pub ks: String,
    /// A draft model scores this many of the most common tokens (as `--draft-vocab`).
    #[arg(long, default_value_t = crate::spec::DraftArgs::default().draft_vocab)]
    pub draft_vocab: usize,
    /// Tokens generated per prompt (at most; greedy, stopping at end of sequence).
    #[arg(long, default_value_t = 96)]
    pub gen_tokens: usize,
    /// Pin each stage to one core: auto, on, off.
    #[arg(long, default_value = "auto")]
    pub pin: String,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct ThroughputArgs {
    /// A known model name or a GGUF file.
    #[arg(long, default_value = crate::cmd::DEFAULT_MODEL)]
    pub model: String,
    /// Stages (processes; stage 0 runs in this one), layers split to balance their cost.
    #[arg(long, default_value_t = 2)]
    pub stages: usize,
    /// Explicit layer ranges instead, e.g. `0..16,16..28`.
    #[arg(long)]
    pub layers: Option<String>,
    /// Concurrent users to measure, comma-separated.
    #[arg(long, default_value = "1,2,4,8")]
    pub users: String,
    /// Prompt length of each user.
    #[arg(long, default_value_t = 32)]
    pub prompt_tokens: usize,
    /// Tokens each user generates.
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    #[command(flatten)]
    pub batch: crate::serve::BatchArgs,
    /// What users ask: `synthetic` (a repeated line of code, `--prompt-tokens` long, rotated
    /// per user) or `code` (coding-assistant chats, a different one per user, as `bench spec`
    /// uses; `--prompt-tokens` does not apply).
    #[arg(long, default_value = "synthetic")]
    pub prompts: String,
    /// Speculative decoding in the ring (the unsplit baseline never drafts).
    #[command(flatten)]
    pub draft: crate::spec::DraftArgs,
    /// Pin each stage (and the unsplit model) to one core: auto, on, off.
    #[arg(long, default_value = "auto")]
    pub pin: String,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct RingArgs {
    /// A known model name or a GGUF file.
    #[arg(long, default_value = crate::cmd::DEFAULT_MODEL)]
    pub model: String,
    /// Stages (processes; stage 0 runs in this one), layers split to balance their cost.
    #[arg(long, default_value_t = 2)]
    pub stages: usize,
    /// Explicit layer ranges instead, e.g. `0..16,16..28`.
    #[arg(long)]
    pub layers: Option<String>,
    /// Prompt length.
    #[arg(long, default_value_t = 32)]
    pub prompt_tokens: usize,
    /// Tokens decoded per run.
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Rounds (each: the unsplit model, then the ring); medians are reported.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Pin each stage (and the unsplit model) to one core: auto, on, off.
    #[arg(long, default_value = "auto")]
    pub pin: String,
    /// Element type of hidden states between stages.
    #[arg(long, default_value = "f32")]
    pub wire_dtype: pipeshard_wire::WireDtype,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
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
    /// Rows of the verification step measured against a one-row step (one sequence, logits at
    /// every row, as when checking drafted tokens); 0 skips it.
    #[arg(long, default_value_t = 5)]
    pub verify_rows: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Decode(a) => decode(a),
        BenchCommand::Ring(a) => ring(a),
        BenchCommand::Throughput(a) => throughput(a),
        BenchCommand::Spec(a) => spec(a),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A code-like prompt of exactly `n` tokens.
fn bench_prompt(tok: &pipeshard_generate::Tokenizer, n: usize) -> Result<Vec<TokenId>> {
    let text = "fn main() { let v: Vec<u32> = (0..100).map(|x| x * x).collect(); println!(\"{:?}\", v); } ";
    let mut ids = tok.encode(&text.repeat(n / 8 + 1))?;
    ids.truncate(n);
    Ok(ids)
}

fn decode(a: DecodeArgs) -> Result<()> {
    let mut s = Session::open(&a.model.model, a.model.stages, a.model.threads)?;
    let base = bench_prompt(&s.tokenizer, a.prompt_tokens)?;
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
    let verify = match a.verify_rows {
        0 => None,
        k => Some(verify_cost(&mut s, &base, k, a.runs.max(1) * 4)?),
    };
    if a.json {
        let mut v = serde_json::json!({"prefill_tok_s": p, "decode_tok_s": d, "batch": a.batch,
                "threads": a.model.threads, "stages": s.pipe.ranges().len(), "runs": a.runs});
        if let Some((one, many)) = verify {
            v["verify_rows"] = a.verify_rows.into();
            v["step_1_ms"] = (one * 1e3).into();
            v["step_verify_ms"] = (many * 1e3).into();
            v["verify_ratio"] = (many / one).into();
        }
        println!("{v}");
    } else {
        println!("prefill {p:.2} tok/s ({} tokens x {}), decode {d:.2} tok/s (batch {}, {} tokens), median of {}",
            base.len(), a.batch, a.batch, a.gen_tokens, a.runs);
        if let Some((one, many)) = verify {
            println!(
                "verification: {} rows {:.1} ms, 1 row {:.1} ms, ratio {:.2} (medians of {})",
                a.verify_rows,
                many * 1e3,
                one * 1e3,
                many / one,
                a.runs.max(1) * 4
            );
        }
    }
    Ok(())
}

/// Median seconds of a one-row step and of a `k`-row step with logits at every row, for one
/// sequence after `prompt`, alternating; every step rewrites the same positions (`pos`
/// truncation), so the context length stays the same.
fn verify_cost(s: &mut Session, prompt: &[TokenId], k: usize, reps: usize) -> Result<(f64, f64)> {
    let seq = s.new_seq();
    s.prefill(seq, 0, prompt)?;
    let tokens: Vec<TokenId> = prompt.iter().cycle().take(k).copied().collect();
    let (mut one, mut many) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        for (n, times) in [(1, &mut one), (k, &mut many)] {
            let step = SeqStep {
                seq,
                pos: prompt.len(),
                n,
                logits: LogitsWanted::All,
            };
            let t = Instant::now();
            s.pipe.step(vec![step], tokens[..n].to_vec())?;
            times.push(t.elapsed().as_secs_f64());
        }
    }
    s.pipe.release(seq);
    Ok((median(one), median(many)))
}

/// One unsplit greedy run: (ttft s, decode tok/s, tokens).
fn unsplit_run(
    s: &mut Session,
    prompt: &[TokenId],
    gen: usize,
) -> Result<(f64, f64, Vec<TokenId>)> {
    let seq = s.new_seq();
    let t0 = Instant::now();
    let mut logits = s.prefill(seq, 0, prompt)?;
    let ttft = t0.elapsed().as_secs_f64();
    let mut tokens = vec![logits.argmax()[0]];
    let t1 = Instant::now();
    for k in 0..gen {
        let step = SeqStep {
            seq,
            pos: prompt.len() + k,
            n: 1,
            logits: LogitsWanted::Last,
        };
        let last = *tokens.last().expect("one token at least");
        logits = s
            .pipe
            .step(vec![step], vec![last])?
            .pop()
            .context("no logits")?;
        tokens.push(logits.argmax()[0]);
    }
    let tok_s = gen as f64 / t1.elapsed().as_secs_f64();
    s.pipe.release(seq);
    Ok((ttft, tok_s, tokens))
}

/// One ring run: (ttft s, decode tok/s, tokens, compute ms per stage).
async fn ring_run(
    head: &HeadHandle,
    prompt: &[TokenId],
    gen: usize,
) -> Result<(f64, f64, Vec<TokenId>, Vec<f64>)> {
    let t0 = Instant::now();
    let mut rx = head.submit(GenRequest {
        prompt: prompt.to_vec(),
        sampling: pipeshard_generate::SamplingParams::default(),
        max_tokens: gen + 1,
        stops: vec![],
        logprobs: false,
        ignore_eos: true,
        draft_k: None,
    })?;
    let mut first = None;
    let mut tokens = Vec::new();
    loop {
        match rx.recv().await {
            Some(GenEvent::Text { token, .. }) => {
                first.get_or_insert_with(Instant::now);
                tokens.extend(token);
            }
            Some(GenEvent::Done {
                stage_compute_us, ..
            }) => {
                let first = first.context("no token")?;
                let ttft = first.duration_since(t0).as_secs_f64();
                let tok_s = gen as f64 / first.elapsed().as_secs_f64();
                let per_stage = stage_compute_us
                    .iter()
                    .map(|u| *u as f64 / 1e3 / (gen + 1) as f64)
                    .collect();
                return Ok((ttft, tok_s, tokens, per_stage));
            }
            Some(GenEvent::Error(e)) => bail!("ring run failed: {e}"),
            None => bail!("the head stopped"),
        }
    }
}

/// A ring of stage processes on loopback with the head in this process, and the unsplit model
/// to compare with; the benches' common set-up. Dropping it stops the head's tasks first, so
/// that stopping the stages is not reported as a failure, then the stages.
struct BenchRing {
    head: HeadHandle,
    rt: Option<tokio::runtime::Runtime>,
    children: Option<crate::serve::Children>,
    manifest: std::path::PathBuf,
    gguf: std::path::PathBuf,
    stages: usize,
    pinned: bool,
}

impl BenchRing {
    fn start(
        model: &str,
        stages: usize,
        layers: Option<&str>,
        pin: &str,
        wire: pipeshard_wire::WireDtype,
        batch: crate::serve::BatchArgs,
        draft: &crate::spec::DraftArgs,
    ) -> Result<Self> {
        let manifest = crate::serve::ensure_split(model, stages, layers)?;
        let stages = pipeshard_shard::Manifest::load(&manifest)?.stages.len();
        let ModelSource::Gguf(gguf) = ModelSource::resolve(model, true)? else {
            bail!("the benches compare against the unsplit model: give a GGUF file or model name");
        };
        let pinned = crate::serve::pin_choice(pin, stages, 1)?;
        let local =
            crate::serve::launch_local_ring(&manifest, 1, pinned, wire, None, batch, draft)?;
        let rt = crate::serve::runtime()?;
        let (head, children) = rt.block_on(local.start_head())?;
        Ok(Self {
            head,
            rt: Some(rt),
            children: Some(children),
            manifest,
            gguf,
            stages,
            pinned,
        })
    }

    fn rt(&self) -> &tokio::runtime::Runtime {
        self.rt.as_ref().expect("the runtime lives until drop")
    }

    /// The unsplit model, one stage on one thread.
    fn unsplit(&self) -> Result<Session> {
        Session::open(self.gguf.to_str().context("path")?, Some(1), 1)
    }
}

impl Drop for BenchRing {
    fn drop(&mut self) {
        self.rt.take();
        self.children.take();
    }
}

/// Prints a bench's result: one JSON line, or pretty.
fn print_result(out: &serde_json::Value, json: bool) -> Result<()> {
    if json {
        println!("{out}");
    } else {
        println!("{}", serde_json::to_string_pretty(out)?);
    }
    Ok(())
}

fn ring(a: RingArgs) -> Result<()> {
    let bench = BenchRing::start(
        &a.model,
        a.stages,
        a.layers.as_deref(),
        &a.pin,
        a.wire_dtype,
        crate::serve::BatchArgs::default(),
        &crate::spec::DraftArgs::default(),
    )?;
    let (rt, head) = (bench.rt(), &bench.head);
    // Resident memory of this process with only stage 0 and the head loaded.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let head_rss = pipeshard_stage::resident_bytes();
    let mut s = bench.unsplit()?;
    let prompt = bench_prompt(&s.tokenizer, a.prompt_tokens)?;
    let (mut base, mut ring, mut base_ttft, mut ring_ttft) = (vec![], vec![], vec![], vec![]);
    let mut identical = true;
    let mut per_stage = Vec::new();
    let mut rounds = Vec::new();
    for round in 0..a.runs.max(1) {
        let (bt, bs, btok) = unsplit_run(&mut s, &prompt, a.gen_tokens)?;
        let (rt_, rs, rtok, ps) = rt.block_on(ring_run(head, &prompt, a.gen_tokens))?;
        identical &= btok == rtok;
        if !a.json {
            eprintln!(
                "round {round}: unsplit {bs:.2} tok/s, ring {rs:.2} tok/s ({:.3}x), tokens identical: {}",
                rs / bs,
                btok == rtok
            );
        }
        rounds.push(serde_json::json!({"baseline_decode_tok_s": bs, "ring_decode_tok_s": rs}));
        base.push(bs);
        ring.push(rs);
        base_ttft.push(bt * 1e3);
        ring_ttft.push(rt_ * 1e3);
        per_stage = ps;
    }
    let status = head.status();
    let m = pipeshard_shard::Manifest::load(&bench.manifest)?;
    let memory: Vec<serde_json::Value> = m
        .stages
        .iter()
        .map(|st| {
            let rss = if st.index == 0 {
                head_rss
            } else {
                status.stages.get(st.index).map_or(0, |x| x.resident_bytes)
            };
            serde_json::json!({"stage": st.index, "layers": st.layers.to_string(),
                "shard_bytes": st.bytes, "resident_bytes": rss,
                "note": if st.index == 0 { "the head's process: stage 0 + tokenizer + API" } else { "" }})
        })
        .collect();
    let (b, r) = (median(base), median(ring));
    let out = serde_json::json!({
        "model": a.model, "stages": bench.stages, "pinned": bench.pinned, "wire_dtype": format!("{:?}", a.wire_dtype),
        "prompt_tokens": prompt.len(), "gen_tokens": a.gen_tokens, "runs": a.runs,
        "baseline_decode_tok_s": b, "ring_decode_tok_s": r, "ratio": r / b,
        "baseline_ttft_ms": median(base_ttft), "ring_ttft_ms": median(ring_ttft),
        "stage_compute_ms_per_token": per_stage,
        "tokens_identical": identical, "memory": memory,
        "rounds": rounds,
    });
    print_result(&out, a.json)
}

fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

/// What one user saw: times from the start of the run, its tokens, and its proposals.
struct UserRun {
    ttft_s: f64,
    done_s: f64,
    tokens: Vec<TokenId>,
    drafted: usize,
    accepted: usize,
}

/// One user's greedy request through the ring, `gen` tokens whatever comes (end of sequence
/// ignored), timed from `t0`.
async fn user_run(
    head: HeadHandle,
    prompt: Vec<TokenId>,
    gen: usize,
    t0: Instant,
) -> Result<UserRun> {
    let mut rx = head.submit(GenRequest {
        prompt,
        sampling: pipeshard_generate::SamplingParams::default(),
        max_tokens: gen,
        stops: vec![],
        logprobs: false,
        ignore_eos: true,
        draft_k: None,
    })?;
    let mut first = None;
    let mut tokens = Vec::new();
    loop {
        match rx.recv().await {
            Some(GenEvent::Text { token, .. }) => {
                first.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                tokens.extend(token);
            }
            Some(GenEvent::Done { usage, .. }) => {
                return Ok(UserRun {
                    ttft_s: first.unwrap_or(0.0),
                    done_s: t0.elapsed().as_secs_f64(),
                    tokens,
                    drafted: usage.drafted_tokens,
                    accepted: usage.accepted_tokens,
                })
            }
            Some(GenEvent::Error(e)) => bail!("a user's request failed: {e}"),
            None => bail!("the head stopped"),
        }
    }
}

fn throughput(a: ThroughputArgs) -> Result<()> {
    let users: Vec<usize> = a
        .users
        .split(',')
        .map(|u| u.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .context("--users takes numbers like 1,2,4,8")?;
    let most = users.iter().copied().max().unwrap_or(1).max(1);
    let bench = BenchRing::start(
        &a.model,
        a.stages,
        a.layers.as_deref(),
        &a.pin,
        Default::default(),
        a.batch,
        &a.draft,
    )?;
    let (rt, head) = (bench.rt(), &bench.head);
    let mut s = bench.unsplit()?;
    // User i's prompt is prompts[i % prompts.len()].
    let prompts: Vec<Vec<TokenId>> = match a.prompts.as_str() {
        "synthetic" => {
            let p = bench_prompt(&s.tokenizer, a.prompt_tokens)?;
            (0..most)
                .map(|i| {
                    let mut q = p.clone();
                    q.rotate_left(i % p.len().max(1));
                    q
                })
                .collect()
        }
        "code" => {
            let n = most.min(CODE_PROMPTS.len());
            chat_prompts(&head.model().text, &CODE_PROMPTS[..n])?
        }
        other => bail!("--prompts takes synthetic or code, not `{other}`"),
    };
    // The unsplit model serving one user at a time, never drafting: whole requests, prompts
    // included, over the prompts that the largest run uses (each only once for the synthetic
    // prompt, whose rotations cost the same). Its tokens are what every user with one of
    // those prompts must get.
    let gen = a.gen_tokens.max(2);
    let measured = if a.prompts == "synthetic" {
        1
    } else {
        prompts.len()
    };
    let (mut secs, mut expected) = (0.0, Vec::new());
    for p in &prompts[..measured] {
        let (ttft, tok_s, tokens) = unsplit_run(&mut s, p, gen - 1)?;
        secs += ttft + (gen - 1) as f64 / tok_s;
        expected.push(tokens);
    }
    let baseline = (gen * measured) as f64 / secs;
    drop(s);
    if !a.json {
        eprintln!("unsplit, one user: {baseline:.2} tok/s");
    }
    let busy =
        |h: &HeadHandle| -> Vec<u64> { h.status().stages.iter().map(|s| s.busy_us).collect() };
    let settle = std::time::Duration::from_millis(1300);
    let mut runs = Vec::new();
    for &n in &users {
        std::thread::sleep(settle);
        let before = busy(head);
        let t0 = Instant::now();
        let results = rt.block_on(async {
            let tasks: Vec<_> = (0..n)
                .map(|i| {
                    let p = prompts[i % prompts.len()].clone();
                    tokio::spawn(user_run(head.clone(), p, a.gen_tokens, t0))
                })
                .collect();
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.context("a user task")??);
            }
            Ok::<_, anyhow::Error>(out)
        })?;
        let wall = results.iter().map(|r| r.done_s).fold(0.0, f64::max);
        std::thread::sleep(settle);
        let after = busy(head);
        let tokens: usize = results.iter().map(|r| r.tokens.len()).sum();
        let identical = results
            .iter()
            .enumerate()
            .filter_map(|(i, r)| expected.get(i % prompts.len()).map(|e| (r, e)))
            .all(|(r, e)| r.tokens[..] == e[..r.tokens.len().min(e.len())]);
        let (drafted, accepted) = results
            .iter()
            .fold((0, 0), |(d, acc), r| (d + r.drafted, acc + r.accepted));
        let aggregate = tokens as f64 / wall;
        let ttfts: Vec<f64> = results.iter().map(|r| r.ttft_s * 1e3).collect();
        let stage_busy: Vec<f64> = before
            .iter()
            .zip(&after)
            .map(|(b, a)| (a - b) as f64 / 1e6 / wall)
            .collect();
        let run = serde_json::json!({
            "users": n, "aggregate_tok_s": aggregate, "ratio": aggregate / baseline,
            "ttft_p50_ms": percentile(ttfts.clone(), 0.5), "ttft_p95_ms": percentile(ttfts, 0.95),
            "stage_busy": stage_busy, "wall_s": wall,
            "drafted": drafted, "accepted": accepted,
            "acceptance": if drafted > 0 { accepted as f64 / drafted as f64 } else { 0.0 },
            "tokens_identical": identical,
        });
        if !a.json {
            eprintln!("{run}");
        }
        runs.push(run);
    }
    let out = serde_json::json!({
        "model": a.model, "stages": bench.stages, "pinned": bench.pinned, "gen_tokens": a.gen_tokens,
        "prompts": a.prompts, "prompt_tokens": prompts[0].len(),
        "prompt_lengths": prompts.iter().map(Vec::len).collect::<Vec<_>>(),
        "draft": a.draft.draft, "draft_k": a.draft.draft_k,
        "baseline_tok_s": baseline, "runs": runs,
    });
    print_result(&out, a.json)
}

/// Coding-assistant prompts: rewriting or extending code the prompt shows, where the answer
/// repeats much of its input. `bench spec` uses the first [`SPEC_PROMPTS`] (its figures since
/// the start); `bench throughput --prompts code` gives each user its own.
const CODE_PROMPTS: [&str; 8] = [
    "Add type hints and a docstring to this function, and return the whole function:\n\n```python\ndef merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n```",
    "Rename the variable `cnt` to `count` everywhere in this code and show the result:\n\n```rust\nfn histogram(words: &[&str]) -> HashMap<String, usize> {\n    let mut cnt = HashMap::new();\n    for w in words {\n        *cnt.entry(w.to_lowercase()).or_insert(0) += 1;\n    }\n    cnt.retain(|_, c| *c > 1);\n    cnt\n}\n```",
    "Write a Python function `is_prime(n)` and a function `primes_below(n)` that uses it, with tests using assert.",
    "Convert this JavaScript function to TypeScript with explicit types and return the whole function:\n\n```javascript\nfunction groupBy(items, key) {\n  const out = {};\n  for (const item of items) {\n    const k = item[key];\n    if (!out[k]) {\n      out[k] = [];\n    }\n    out[k].push(item);\n  }\n  return out;\n}\n```",
    "Make this Go function return an error instead of ignoring failures, and show the full function:\n\n```go\nfunc readConfig(path string) Config {\n\tdata, _ := os.ReadFile(path)\n\tvar cfg Config\n\tjson.Unmarshal(data, &cfg)\n\tif cfg.Port == 0 {\n\t\tcfg.Port = 8080\n\t}\n\treturn cfg\n}\n```",
    "Write pytest unit tests for this class:\n\n```python\nclass Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n        self.items.append(x)\n\n    def pop(self):\n        if not self.items:\n            raise IndexError(\"pop from empty stack\")\n        return self.items.pop()\n\n    def peek(self):\n        return self.items[-1] if self.items else None\n\n    def __len__(self):\n        return len(self.items)\n```",
    "Rewrite this C function with a `for` loop instead of the `while` loop, keeping everything else the same:\n\n```c\nint sum_even(const int *v, int n) {\n    int i = 0;\n    int total = 0;\n    while (i < n) {\n        if (v[i] % 2 == 0) {\n            total += v[i];\n        }\n        i++;\n    }\n    return total;\n}\n```",
    "Write a SQL query over tables `customers(id, name)` and `orders(id, customer_id, amount, created_at)` that returns each customer's name and total order amount in 2025, highest first, and explain it briefly.",
];

/// How many of [`CODE_PROMPTS`] `bench spec` runs.
const SPEC_PROMPTS: usize = 3;

/// `prompts` rendered as one-message chats and tokenized.
fn chat_prompts(
    text: &pipeshard_generate::TextModel,
    prompts: &[&str],
) -> Result<Vec<Vec<TokenId>>> {
    prompts
        .iter()
        .map(|p| {
            let chat = text.render_chat(&[pipeshard_generate::ChatMessage::new("user", p)])?;
            Ok(text.tokenizer.encode(&chat)?)
        })
        .collect()
}

/// One greedy request through the ring: (seconds from first token to done, tokens, drafted,
/// accepted).
async fn spec_run(
    head: &HeadHandle,
    prompt: &[TokenId],
    gen: usize,
    k: Option<usize>,
) -> Result<(f64, Vec<TokenId>, usize, usize)> {
    let mut rx = head.submit(GenRequest {
        prompt: prompt.to_vec(),
        sampling: pipeshard_generate::SamplingParams::default(),
        max_tokens: gen,
        stops: vec![],
        logprobs: false,
        ignore_eos: false,
        draft_k: k,
    })?;
    let mut first = None;
    let mut tokens = Vec::new();
    loop {
        match rx.recv().await {
            Some(GenEvent::Text { token, .. }) => {
                first.get_or_insert_with(Instant::now);
                tokens.extend(token);
            }
            Some(GenEvent::Done { usage, .. }) => {
                let secs = first.context("no token")?.elapsed().as_secs_f64();
                return Ok((secs, tokens, usage.drafted_tokens, usage.accepted_tokens));
            }
            Some(GenEvent::Error(e)) => bail!("a request failed: {e}"),
            None => bail!("the head stopped"),
        }
    }
}

fn spec(a: SpecArgs) -> Result<()> {
    let ks: Vec<Option<usize>> =
        a.ks.split(',')
            .map(|k| match k.trim() {
                "auto" => Ok(None),
                n => n.parse().map(Some),
            })
            .collect::<Result<_, _>>()
            .context("--ks takes numbers and auto, like 0,2,4,auto")?;
    let mut runs = Vec::new();
    let mut baselines = Vec::new();
    for drafter in a.drafters.split(',').map(str::trim) {
        let draft = crate::spec::DraftArgs {
            draft: Some(drafter.to_string()),
            draft_vocab: a.draft_vocab,
            ..Default::default()
        };
        let bench = BenchRing::start(
            &a.model,
            a.stages,
            a.layers.as_deref(),
            &a.pin,
            Default::default(),
            crate::serve::BatchArgs {
                groups: 1,
                ..Default::default()
            },
            &draft,
        )?;
        let prompts = chat_prompts(&bench.head.model().text, &CODE_PROMPTS[..SPEC_PROMPTS])?;
        // Tokens over the decode time of all prompts, for a fixed k (or auto).
        let measure = |k: Option<usize>| -> Result<(f64, Vec<Vec<TokenId>>, usize, usize)> {
            let (mut secs, mut n, mut drafted, mut accepted) = (0.0, 0, 0, 0);
            let mut all = Vec::new();
            for p in &prompts {
                let (s, t, d, acc) =
                    bench
                        .rt()
                        .block_on(spec_run(&bench.head, p, a.gen_tokens, k))?;
                secs += s;
                n += t.len().saturating_sub(1);
                drafted += d;
                accepted += acc;
                all.push(t);
            }
            Ok((n as f64 / secs.max(1e-9), all, drafted, accepted))
        };
        let (base, base_tokens, _, _) = measure(Some(0))?;
        if !a.json {
            eprintln!("{drafter}: no speculation {base:.2} tok/s");
        }
        baselines.push(base);
        for &k in &ks {
            let (tok_s, tokens, drafted, accepted) = measure(k)?;
            let run = serde_json::json!({
                "drafter": drafter,
                "k": k.map_or(serde_json::json!("auto"), |k| serde_json::json!(k)),
                "tok_s": tok_s,
                "acceptance": if drafted > 0 { accepted as f64 / drafted as f64 } else { 0.0 },
                "speedup": tok_s / base,
                "baseline_tok_s": base,
                "drafted": drafted, "accepted": accepted,
                "tokens_identical": tokens == base_tokens,
            });
            if !a.json {
                eprintln!("{run}");
            }
            runs.push(run);
        }
    }
    let out = serde_json::json!({
        "model": a.model, "gen_tokens": a.gen_tokens, "prompts": SPEC_PROMPTS,
        "draft_vocab": a.draft_vocab,
        "baseline_tok_s": baselines.first().copied().unwrap_or(0.0), "runs": runs,
    });
    print_result(&out, a.json)
}
