//! The head: the first machine of the ring. It holds stage 0 in-process, checks that the
//! remote stages form one model's ring, and runs the scheduler, an actor that turns requests
//! into steps, sends them round the ring and turns the returned token ids into text events.
//!
//! Callers hold a [`HeadHandle`]: `submit` returns a channel of [`GenEvent`]s; dropping that
//! receiver cancels the request, and its KV caches are released on every stage.

pub mod draft;
pub mod lookahead;
pub mod ring;
mod scheduler;

use std::sync::Arc;
use std::time::Duration;

use pipeshard_generate::{FinishReason, SamplingParams, TextModel};
use pipeshard_model::{Stage, TokenId};
use pipeshard_stage::{
    spawn_link, spawn_worker, stage_info, LinkTarget, StageIdentity, WorkerConfig,
};
use pipeshard_wire::{pb, AddToken, Limits, WireDtype};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

pub use ring::{check_ring, RingStatus, StageStatus};

/// What went wrong at the head.
#[derive(Debug, thiserror::Error)]
pub enum HeadError {
    /// The stages do not form a ring of one model, or one cannot be reached.
    #[error("{0}")]
    Ring(String),
    /// The ring is not complete now (a stage is down); try later.
    #[error("the ring is unavailable: {0}")]
    Unavailable(String),
    /// The request cannot be served as given.
    #[error("{0}")]
    Invalid(String),
    /// Too many requests wait for room; try again later.
    #[error("{0}")]
    Busy(String),
    /// The local stage could not start.
    #[error(transparent)]
    Stage(#[from] pipeshard_stage::StageError),
    /// The head stopped.
    #[error("the head has stopped")]
    Stopped,
}

/// How the head runs.
#[derive(Debug, Clone)]
pub struct HeadConfig {
    /// Remote stages (`host:port`) after the local stage 0, in ring order.
    pub remote: Vec<String>,
    /// The cluster token.
    pub token: String,
    /// Limits on messages, also sent to the stages' limits.
    pub limits: Limits,
    /// Element type of the hidden states stage 0 sends.
    pub wire_dtype: WireDtype,
    /// Longest prompt chunk in one step. Small enough that a long prompt's chunks keep every
    /// stage busy: one 512-token prompt on the 1.5B over 2 stages reached its first token in
    /// 8.5-9.3 s at 64, 9.5-12.1 s at 128 and 11.4-12.7 s at 256.
    pub prefill_chunk: usize,
    /// A step not back after this long fails its sequences.
    pub step_timeout: Duration,
    /// How often the stages' health is checked.
    pub health_interval: Duration,
    /// Micro-batch groups cycling through the ring (0: one per stage).
    pub groups: usize,
    /// KV budget of the local stage 0, bytes.
    pub kv_budget_bytes: u64,
    /// Requests that may wait for KV room; beyond, new ones are refused (429).
    pub max_queue: usize,
    /// Tokens drafted per step when the head has a drafter: a fixed number, or `None` to
    /// adapt per sequence between 0 and `draft_max`.
    pub draft_k: Option<usize>,
    /// The most tokens drafted per step when adapting.
    pub draft_max: usize,
}

impl Default for HeadConfig {
    fn default() -> Self {
        Self {
            remote: vec![],
            token: String::new(),
            limits: Limits::default(),
            wire_dtype: WireDtype::F32,
            prefill_chunk: 64,
            step_timeout: Duration::from_secs(300),
            health_interval: Duration::from_secs(1),
            groups: 0,
            kv_budget_bytes: pipeshard_stage::kv_budget(None),
            max_queue: 64,
            draft_k: None,
            draft_max: 10,
        }
    }
}

/// One request, tokenized and validated.
#[derive(Debug, Clone)]
pub struct GenRequest {
    /// The prompt's token ids (at least one).
    pub prompt: Vec<TokenId>,
    /// How to pick tokens.
    pub sampling: SamplingParams,
    /// Most tokens to generate (at least one).
    pub max_tokens: usize,
    /// Stop strings (not included in the output).
    pub stops: Vec<String>,
    /// Report each token's log-probability.
    pub logprobs: bool,
    /// Go on past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
    /// Tokens to draft per step for this request, instead of the head's choice (benchmarks;
    /// 0: no speculation).
    pub draft_k: Option<usize>,
}

/// Token counts of a finished request (OpenAI's `usage`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
    /// Tokens a drafter proposed (speculative decoding).
    pub drafted_tokens: usize,
    /// Proposals the target accepted.
    pub accepted_tokens: usize,
}

/// What a request produces, in order: pieces, then `Done` or `Error`.
#[derive(Debug, Clone, PartialEq)]
pub enum GenEvent {
    /// New text (may be empty while a possible stop string is held back) and the token that
    /// produced it (`None` for text released at the end).
    Text {
        /// Text safe to show now.
        text: String,
        /// The token.
        token: Option<TokenId>,
        /// Its log-probability, when asked for.
        logprob: Option<f32>,
    },
    /// Generation ended.
    Done {
        /// Why.
        finish: FinishReason,
        /// Token counts.
        usage: Usage,
        /// Compute time per stage over the whole request, microseconds, in ring order.
        stage_compute_us: Vec<u64>,
    },
    /// Generation failed.
    Error(String),
}

/// The model the head serves.
#[derive(Debug)]
pub struct ServedModel {
    /// The name clients use (`model` in requests).
    pub name: String,
    /// Tokenizer and chat template.
    pub text: TextModel,
    /// Context length.
    pub ctx_len: usize,
    /// sha256 of the model file.
    pub sha256: String,
}

/// A cloneable handle to the head.
#[derive(Clone)]
pub struct HeadHandle {
    tx: mpsc::Sender<scheduler::Command>,
    status: watch::Receiver<RingStatus>,
    model: Arc<ServedModel>,
    /// Requests waiting for KV room (kept by the scheduler).
    waiting: Arc<std::sync::atomic::AtomicUsize>,
    max_queue: usize,
    /// Per stage: (KV budget bytes, KV bytes per position).
    budgets: Vec<(u64, u64)>,
}

impl HeadHandle {
    /// Queues a request. Fails at once when the ring is down or the request cannot fit.
    pub fn submit(&self, req: GenRequest) -> Result<mpsc::UnboundedReceiver<GenEvent>, HeadError> {
        let status = self.status.borrow().clone();
        if !status.ready {
            return Err(HeadError::Unavailable(status.message));
        }
        if req.prompt.is_empty() {
            return Err(HeadError::Invalid("the prompt is empty".into()));
        }
        if req.max_tokens == 0 {
            return Err(HeadError::Invalid("max_tokens must be at least 1".into()));
        }
        let ctx = self.model.ctx_len;
        if req.prompt.len() + req.max_tokens > ctx {
            return Err(HeadError::Invalid(format!(
                "the prompt ({} tokens) plus max_tokens ({}) exceeds the context length {ctx}",
                req.prompt.len(),
                req.max_tokens
            )));
        }
        req.sampling
            .validate()
            .map_err(|e| HeadError::Invalid(e.to_string()))?;
        scheduler::kv_need(&self.budgets, &req).map_err(|(_, msg)| HeadError::Invalid(msg))?;
        let waiting = self.waiting.load(std::sync::atomic::Ordering::Relaxed);
        if waiting >= self.max_queue {
            return Err(HeadError::Busy(format!(
                "{waiting} requests already wait for KV cache room; try again shortly"
            )));
        }
        let (events, rx) = mpsc::unbounded_channel();
        self.tx
            .try_send(scheduler::Command::Submit { req, events })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => {
                    HeadError::Unavailable("too many requests are queued".into())
                }
                mpsc::error::TrySendError::Closed(_) => HeadError::Stopped,
            })?;
        Ok(rx)
    }

    /// The ring's state now.
    pub fn status(&self) -> RingStatus {
        self.status.borrow().clone()
    }

    /// The model served.
    pub fn model(&self) -> &ServedModel {
        &self.model
    }
}

/// What computes in the head's process: stage 0, and the drafter if any.
pub struct LocalStage {
    /// Its weights.
    pub stage: Stage,
    /// Its identity.
    pub identity: StageIdentity,
    /// Speculative decoding's drafter.
    pub drafter: Option<draft::Drafter>,
}

/// Starts the head: the ring listener (for the last stage's results), the ring check, the
/// local stage 0, the health monitor and the scheduler. Must run inside a tokio runtime.
pub async fn start(
    local: LocalStage,
    model: ServedModel,
    ring_listener: TcpListener,
    config: HeadConfig,
) -> Result<HeadHandle, HeadError> {
    let add_token = AddToken::new(&config.token).map_err(|e| HeadError::Ring(e.to_string()))?;
    let (results_tx, results_rx) = mpsc::channel::<pb::Frame>(256);
    ring::serve_deliver(
        ring_listener,
        &config.token,
        config.limits,
        results_tx.clone(),
    );

    let next = config
        .remote
        .first()
        .cloned()
        .unwrap_or_else(|| "head (in-process)".into());
    let local_info = stage_info(
        &local.stage,
        &local.identity,
        config.wire_dtype,
        &next,
        config.kv_budget_bytes,
    );
    let remotes = ring::connect_all(&config.remote, &add_token, &config.limits).await?;
    let mut infos = vec![("the head's stage 0".to_string(), local_info.clone())];
    infos.extend(remotes.iter().map(|r| (r.describe(), r.info.clone())));
    check_ring(&infos).map_err(HeadError::Ring)?;
    if local.identity.model_sha256 != model.sha256 {
        return Err(HeadError::Ring(format!(
            "the head's stage 0 is a shard of model {}, but the head serves {}",
            short(&local.identity.model_sha256),
            short(&model.sha256)
        )));
    }

    let out = match config.remote.first() {
        Some(addr) => spawn_link(
            LinkTarget::Stage(addr.clone()),
            add_token.clone(),
            config.limits,
        ),
        None => results_tx,
    };
    let worker = spawn_worker(
        local.stage,
        WorkerConfig {
            index: 0,
            wire_dtype: config.wire_dtype,
            limits: config.limits,
        },
        out,
    )?;

    let waiting = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let budgets: Vec<(u64, u64)> = infos
        .iter()
        .map(|(_, i)| (i.kv_budget_bytes, i.kv_bytes_per_token))
        .collect();
    let budgets_for_handle = budgets.clone();
    let (status_tx, status_rx) = watch::channel(RingStatus::up(&infos));
    ring::spawn_health(
        remotes,
        infos,
        worker.stats.clone(),
        status_tx,
        config.health_interval,
    );

    let model = Arc::new(model);
    let (tx, rx) = mpsc::channel(1024);

    let groups = match config.groups {
        0 => 1 + config.remote.len(),
        n => n,
    };
    if let Some(d) = &local.drafter {
        tracing::info!(drafter = %d, k = ?config.draft_k, "speculative decoding");
    }
    let spec = local.drafter.map(|drafter| scheduler::Speculation {
        drafter: lookahead::Lookahead::new(drafter),
        tuner: draft::Tuner::new(config.draft_k, config.draft_max),
    });
    let state = scheduler::State::new(
        model.clone(),
        &config,
        groups,
        budgets,
        waiting.clone(),
        spec,
    );
    scheduler::spawn(rx, results_rx, worker, status_rx.clone(), state);
    Ok(HeadHandle {
        tx,
        status: status_rx,
        model,
        waiting,
        max_queue: config.max_queue,
        budgets: budgets_for_handle,
    })
}

/// The first 12 hex digits of a sha256, for messages.
pub(crate) fn short(sha: &str) -> &str {
    &sha[..sha.len().min(12)]
}
