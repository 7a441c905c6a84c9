//! The stage server. One compute thread owns the stage's weights and KV caches; frames reach
//! it on a channel, from the predecessor's gRPC stream or, on the head, in-process; what it
//! computes leaves on a link to the successor. The last stage turns logits into token ids
//! with the head's sampling parameters and uniform draws, so only token ids travel back.
//!
//! A step that is malformed or beyond the limits becomes a failed `StepResult` that travels
//! on to the head; the stage keeps serving every other sequence.

mod link;
mod server;
mod worker;

pub use link::{connect, spawn_link, AuthStageClient, LinkTarget};
pub use server::{serve_stage, StageService};
pub use worker::{spawn_worker, Worker, WorkerConfig, WorkerStats};

/// What went wrong in the stage server.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// The gRPC server failed.
    #[error("serving: {0}")]
    Serve(#[from] tonic::transport::Error),
    /// The compute thread could not start.
    #[error("starting the compute thread: {0}")]
    Spawn(std::io::Error),
    /// Something on the wire.
    #[error(transparent)]
    Wire(#[from] pipeshard_wire::WireError),
}

/// Resident memory of this process in bytes (Linux; 0 elsewhere).
pub fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

/// Who a stage is, as its shard records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageIdentity {
    /// Position in the ring.
    pub index: usize,
    /// Number of stages of the split.
    pub count: usize,
    /// sha256 of the model file the shard was cut from.
    pub model_sha256: String,
}

/// KV bytes one position costs on `stage`: keys and values in f32 for each of its layers,
/// doubled because a cache grows by doubling its capacity.
pub fn kv_bytes_per_token(stage: &pipeshard_model::Stage) -> u64 {
    let c = stage.config();
    (stage.range().len() * 2 * c.n_kv_heads * c.head_dim * 4 * 2) as u64
}

/// Memory the system can still give (Linux `MemAvailable`; 0 when unknown).
pub fn available_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable:"))?
                .split_whitespace()
                .nth(1)?
                .parse::<u64>()
                .ok()
        })
        .map_or(0, |kib| kib * 1024)
}

/// A KV budget: `kib` KiB when given, else 80% of the memory available now.
pub fn kv_budget(kib: Option<u64>) -> u64 {
    match kib {
        Some(k) => k * 1024,
        None => available_memory() / 10 * 8,
    }
}

/// The `Info` a stage reports.
pub fn stage_info(
    stage: &pipeshard_model::Stage,
    id: &StageIdentity,
    wire_dtype: pipeshard_wire::WireDtype,
    next: &str,
    kv_budget_bytes: u64,
) -> pipeshard_wire::pb::StageInfo {
    let c = stage.config();
    pipeshard_wire::pb::StageInfo {
        version: env!("CARGO_PKG_VERSION").to_string(),
        model_sha256: id.model_sha256.clone(),
        stage_index: id.index as u32,
        stage_count: id.count as u32,
        layer_start: stage.range().start as u32,
        layer_end: stage.range().end as u32,
        n_layers: c.n_layers as u32,
        weight_bytes: stage.weight_bytes() as u64,
        resident_bytes: resident_bytes(),
        architecture: format!("{:?}", c.arch).to_lowercase(),
        hidden_size: c.hidden as u32,
        context_len: c.ctx_len as u32,
        wire_dtype: wire_dtype.to_i32(),
        next: next.to_string(),
        kv_budget_bytes,
        kv_bytes_per_token: kv_bytes_per_token(stage),
    }
}
