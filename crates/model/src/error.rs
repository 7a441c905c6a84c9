//! The one error type of the model crate, with variants named after the phase that failed.

use std::path::PathBuf;

/// What went wrong while loading or running a stage.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file could not be opened or read.
    #[error("reading {path}: {source}")]
    Io {
        /// File being read.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// The GGUF header or metadata is malformed or missing a key.
    #[error("{path}: {msg}")]
    Gguf {
        /// File being read.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// The model uses an architecture this build does not run.
    #[error("unsupported architecture `{0}` (supported: llama, qwen2)")]
    UnsupportedArch(String),
    /// A tensor has a type this build cannot compute with.
    #[error("tensor `{name}` has unsupported type {dtype}")]
    UnsupportedTensorType {
        /// Tensor name.
        name: String,
        /// Its GGML type.
        dtype: String,
    },
    /// A batch handed to `forward` is inconsistent.
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    /// A stage thread of a local pipeline stopped.
    #[error("pipeline stage {0} stopped")]
    StageStopped(usize),
}
