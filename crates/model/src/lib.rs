//! The stage engine: a contiguous range of a model's layers, loaded from a GGUF file, run as
//! a row-wise exact forward pass over a batch of sequences.
//!
//! Exactness is the invariant everything else relies on: a token row's arithmetic never
//! depends on which other rows share the forward pass. Quantized matmuls compute every output
//! element with the same per-row dot product whatever the batch size or thread count, and
//! attention runs per query row with a fixed reduction order. So the unsplit model, any split
//! and any batch composition give the same greedy tokens.
//!
//! Nothing here knows about networks or async runtimes.

pub mod batch;
pub mod config;
pub mod error;
pub mod gguf;
pub mod kernels;
pub mod kv;
pub mod local;
pub mod ops;
pub mod qweight;
pub mod stage;

pub use batch::{
    hidden_from_bytes, hidden_to_bytes, LayerRange, LogitsWanted, SeqId, SeqLogits, SeqStep,
    StageInput, StageOutput, StepBatch, TokenId,
};
pub use config::{Arch, ModelConfig};
pub use error::ModelError;
pub use kv::KvStore;
pub use local::LocalPipeline;
pub use stage::{Stage, Vocab};

/// Result type of this crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
