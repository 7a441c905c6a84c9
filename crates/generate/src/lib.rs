//! Everything between text and token ids, without any model compute: the tokenizer built from
//! GGUF metadata, the chat template, incremental detokenization, sampling and stop conditions.
//! Pure and seedable.

pub mod chat;
pub mod sampler;
pub mod stop;
pub mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate};
pub use sampler::{Sampler, SamplingParams};
pub use stop::{FinishReason, StopChecker};
pub use tokenizer::{Detokenizer, Tokenizer};

/// What went wrong in text handling.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The GGUF metadata does not describe a tokenizer we can build.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template failed to parse or render.
    #[error("chat template: {0}")]
    Template(String),
    /// Sampling parameters are out of range.
    #[error("sampling: {0}")]
    Sampling(String),
}

/// Result type of this crate.
pub type Result<T, E = GenerateError> = std::result::Result<T, E>;
