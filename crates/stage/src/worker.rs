//! The compute thread: owns a `Stage` and its `KvStore`, takes frames in order, runs each step
//! as one forward pass, and sends what it produces to the successor.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;

use pipeshard_generate::{choose_rows, logprob, Dist, SamplingParams};
use pipeshard_model::{KvStore, SeqId, SeqLogits, Stage, StageOutput};
use pipeshard_wire::pb::{self, frame::Kind};
use pipeshard_wire::{decode_step, encode_hidden, Limits, WireDtype};
use tokio::sync::mpsc;

use crate::StageError;

/// How a worker runs.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// The stage's index in the ring (reported in timings and errors).
    pub index: usize,
    /// Element type of the hidden states it sends.
    pub wire_dtype: WireDtype,
    /// What it accepts.
    pub limits: Limits,
}

/// Counters the compute thread keeps up to date.
#[derive(Debug, Default)]
pub struct WorkerStats {
    /// Steps computed (or refused).
    pub steps: AtomicU64,
    /// Sequences with a KV cache.
    pub sequences: AtomicU64,
    /// Bytes of KV caches.
    pub kv_bytes: AtomicU64,
    /// Microseconds spent in forward passes.
    pub busy_us: AtomicU64,
}

/// A running compute thread. Dropping every sender (this and its clones) stops it.
#[derive(Clone)]
pub struct Worker {
    tx: Sender<(pb::Frame, Instant)>,
    /// Its counters.
    pub stats: Arc<WorkerStats>,
}

impl Worker {
    /// Queues a frame; false when the thread has stopped.
    pub fn send(&self, frame: pb::Frame) -> bool {
        self.tx.send((frame, Instant::now())).is_ok()
    }
}

/// Starts the compute thread of `stage`; what it produces goes to `out`.
pub fn spawn_worker(
    stage: Stage,
    config: WorkerConfig,
    out: mpsc::Sender<pb::Frame>,
) -> Result<Worker, StageError> {
    let (tx, rx) = channel();
    let stats = Arc::new(WorkerStats::default());
    let s = stats.clone();
    std::thread::Builder::new()
        .name(format!("stage-{}", config.index))
        .spawn(move || run(stage, config, rx, out, s))
        .map_err(StageError::Spawn)?;
    Ok(Worker { tx, stats })
}

fn run(
    stage: Stage,
    config: WorkerConfig,
    rx: Receiver<(pb::Frame, Instant)>,
    out: mpsc::Sender<pb::Frame>,
    stats: Arc<WorkerStats>,
) {
    let mut kv = KvStore::new();
    let send = |kind: Kind| {
        // A closed link means the process is shutting down; nothing is left to tell.
        let _ = out.blocking_send(pb::Frame { kind: Some(kind) });
    };
    while let Ok((frame, arrived)) = rx.recv() {
        match frame.kind {
            Some(Kind::Step(step)) => {
                let started = Instant::now();
                let outcome = compute(&stage, &config, &mut kv, &step);
                let timing = pb::StageTiming {
                    stage: config.index as u32,
                    compute_us: started.elapsed().as_micros() as u64,
                    queue_us: started.duration_since(arrived).as_micros() as u64,
                };
                stats.steps.fetch_add(1, Ordering::Relaxed);
                stats
                    .busy_us
                    .fetch_add(timing.compute_us, Ordering::Relaxed);
                let mut timings = step.timings;
                timings.push(timing);
                send(match outcome {
                    Ok(Computed::Hidden(hidden)) => Kind::Step(pb::Step {
                        batch_id: step.batch_id,
                        seqs: step.seqs,
                        tokens: vec![],
                        hidden: Some(hidden),
                        timings,
                    }),
                    Ok(Computed::Tokens(seqs)) => Kind::Result(pb::StepResult {
                        batch_id: step.batch_id,
                        seqs,
                        timings,
                        ..Default::default()
                    }),
                    Err(error) => {
                        tracing::warn!(stage = config.index, batch = step.batch_id, %error, "refused a step");
                        Kind::Result(pb::StepResult {
                            batch_id: step.batch_id,
                            seqs: vec![],
                            timings,
                            error,
                            error_stage: config.index as u32,
                        })
                    }
                });
            }
            Some(Kind::Release(r)) => {
                for id in &r.seq_ids {
                    kv.release(SeqId(*id));
                }
                if !stage.is_last() {
                    send(Kind::Release(r));
                }
            }
            Some(Kind::Result(r)) => send(Kind::Result(r)),
            None => tracing::warn!(stage = config.index, "ignored an empty frame"),
        }
        stats.sequences.store(kv.n_seqs() as u64, Ordering::Relaxed);
        stats.kv_bytes.store(kv.bytes() as u64, Ordering::Relaxed);
    }
}

enum Computed {
    Hidden(pb::Tensor),
    Tokens(Vec<pb::SeqResult>),
}

fn compute(
    stage: &Stage,
    config: &WorkerConfig,
    kv: &mut KvStore,
    step: &pb::Step,
) -> Result<Computed, String> {
    let c = stage.config();
    let decoded = decode_step(step, stage.is_first(), c.hidden, c.ctx_len, &config.limits)
        .map_err(|e| e.to_string())?;
    let rows = decoded.batch.total_rows();
    match stage
        .forward(&decoded.batch, kv)
        .map_err(|e| e.to_string())?
    {
        StageOutput::Hidden(h) => Ok(Computed::Hidden(encode_hidden(
            &h,
            rows,
            c.hidden,
            config.wire_dtype,
        ))),
        StageOutput::Logits(logits) => choose(&decoded.seqs, &logits).map(Computed::Tokens),
    }
}

/// The last stage's choice: tokens from the output rows (see [`choose_rows`]), with the
/// head's parameters and draws.
fn choose(seqs: &[pb::SeqStep], logits: &[SeqLogits]) -> Result<Vec<pb::SeqResult>, String> {
    let mut out = Vec::with_capacity(logits.len());
    let mut wanted = seqs.iter().filter(|s| s.output != pb::Output::None as i32);
    for l in logits {
        let s = wanted
            .next()
            .filter(|s| s.seq_id == l.seq.0)
            .ok_or_else(|| format!("logits of {} do not match the step", l.seq))?;
        let sp = s.sampling.clone().unwrap_or_default();
        let params = SamplingParams {
            temperature: sp.temperature,
            top_k: sp.top_k as usize,
            top_p: if sp.top_p > 0.0 { sp.top_p } else { 1.0 },
            seed: None,
        };
        params.validate().map_err(|e| e.to_string())?;
        let sampling = params.temperature > 0.0;
        if sampling && (sp.uniforms.len() < l.rows || sp.accept_uniforms.len() < s.draft.len()) {
            return Err(format!(
                "sequence {} samples {} rows with {} uniform draws and verifies {} proposals with {}",
                s.seq_id,
                l.rows,
                sp.uniforms.len(),
                s.draft.len(),
                sp.accept_uniforms.len()
            ));
        }
        let q: Vec<Option<Dist>> = s
            .draft_q
            .iter()
            .map(|q| {
                (!q.ids.is_empty()).then(|| Dist {
                    ids: q.ids.clone(),
                    probs: q.probs.clone(),
                })
            })
            .collect();
        let tokens = choose_rows(
            &params,
            (0..l.rows).map(|i| l.row(i)),
            &s.draft,
            &q,
            &sp.uniforms,
            &sp.accept_uniforms,
        );
        let logprobs = if sp.logprobs {
            tokens
                .iter()
                .enumerate()
                .map(|(i, &t)| logprob(l.row(i), t))
                .collect()
        } else {
            vec![]
        };
        let r = pb::SeqResult {
            seq_id: s.seq_id,
            tokens,
            logprobs,
        };
        out.push(r);
    }
    Ok(out)
}
