//! A pipeline of stages inside one process: one thread per stage, hidden states handed from
//! thread to thread as the bytes that would travel on a wire. The same stages run behind the
//! network ring; this is the in-process link.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;

use crate::batch::{
    hidden_from_bytes, hidden_to_bytes, LayerRange, SeqId, SeqLogits, SeqStep, StageInput,
    StageOutput, StepBatch, TokenId,
};
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::kv::KvStore;
use crate::stage::Stage;
use crate::Result;

/// The reply to one step: the last stage's logits, or the first error.
pub type StepReply = Result<Vec<SeqLogits>>;

enum Payload {
    Tokens(Vec<TokenId>),
    Bytes(Vec<u8>),
}

enum Job {
    Step {
        seqs: Vec<SeqStep>,
        payload: Payload,
        reply: Sender<StepReply>,
    },
    Release(SeqId),
}

/// Stages on their own threads, linked in order.
pub struct LocalPipeline {
    head: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
    config: ModelConfig,
    ranges: Vec<LayerRange>,
}

impl LocalPipeline {
    /// Starts one thread per stage. The stages must tile `0..n_layers` in order.
    pub fn new(stages: Vec<Stage>) -> Result<Self> {
        let config = stages
            .first()
            .ok_or_else(|| ModelError::InvalidBatch("a pipeline needs a stage".into()))?
            .config()
            .clone();
        let ranges: Vec<LayerRange> = stages.iter().map(|s| s.range()).collect();
        LayerRange::check_tiling(&ranges, config.n_layers)?;
        let mut next: Option<Sender<Job>> = None;
        let mut threads = Vec::new();
        for (i, stage) in stages.into_iter().enumerate().rev() {
            let (tx, rx) = channel::<Job>();
            let downstream = next.take();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("stage-{i}"))
                    .spawn(move || run_stage(i, stage, rx, downstream))
                    .map_err(|e| ModelError::InvalidBatch(format!("spawning stage {i}: {e}")))?,
            );
            next = Some(tx);
        }
        Ok(Self {
            head: next,
            threads,
            config,
            ranges,
        })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Layer ranges of the stages, in order.
    pub fn ranges(&self) -> &[LayerRange] {
        &self.ranges
    }

    /// Sends a step into the ring; the receiver gets the last stage's logits.
    pub fn submit(&self, seqs: Vec<SeqStep>, tokens: Vec<TokenId>) -> Receiver<StepReply> {
        let (reply, rx) = channel();
        let job = Job::Step {
            seqs,
            payload: Payload::Tokens(tokens),
            reply: reply.clone(),
        };
        if self.head.as_ref().is_none_or(|h| h.send(job).is_err()) {
            let _ = reply.send(Err(ModelError::StageStopped(0)));
        }
        rx
    }

    /// Runs one step and waits for its logits.
    pub fn step(&self, seqs: Vec<SeqStep>, tokens: Vec<TokenId>) -> StepReply {
        self.submit(seqs, tokens)
            .recv()
            .map_err(|_| ModelError::StageStopped(0))?
    }

    /// Frees a sequence's caches on every stage.
    pub fn release(&self, seq: SeqId) {
        if let Some(h) = &self.head {
            let _ = h.send(Job::Release(seq));
        }
    }
}

impl Drop for LocalPipeline {
    fn drop(&mut self) {
        self.head.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn run_stage(index: usize, stage: Stage, rx: Receiver<Job>, next: Option<Sender<Job>>) {
    let mut kv = KvStore::new();
    while let Ok(job) = rx.recv() {
        match job {
            Job::Release(seq) => {
                kv.release(seq);
                if let Some(n) = &next {
                    let _ = n.send(Job::Release(seq));
                }
            }
            Job::Step {
                seqs,
                payload,
                reply,
            } => {
                let input = match payload {
                    Payload::Tokens(t) => StageInput::Tokens(t),
                    Payload::Bytes(b) => match hidden_from_bytes(&b) {
                        Some(h) => StageInput::Hidden(h),
                        None => {
                            let _ = reply.send(Err(ModelError::InvalidBatch(
                                "hidden-state bytes not a multiple of 4".into(),
                            )));
                            continue;
                        }
                    },
                };
                let batch = StepBatch { seqs, input };
                match stage.forward(&batch, &mut kv) {
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                    Ok(StageOutput::Logits(l)) => {
                        let _ = reply.send(Ok(l));
                    }
                    Ok(StageOutput::Hidden(h)) => {
                        let job = Job::Step {
                            seqs: batch.seqs,
                            payload: Payload::Bytes(hidden_to_bytes(&h)),
                            reply: reply.clone(),
                        };
                        if next.as_ref().is_none_or(|n| n.send(job).is_err()) {
                            let _ = reply.send(Err(ModelError::StageStopped(index + 1)));
                        }
                    }
                }
            }
        }
    }
}
