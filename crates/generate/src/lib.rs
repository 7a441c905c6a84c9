//! Everything between text and token ids, without any model compute: the tokenizer built from
//! GGUF metadata, the chat template, incremental detokenization, sampling and stop conditions.
//! Pure and seedable.

pub mod chat;
pub mod sampler;
pub mod stop;
pub mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate};
pub use sampler::{choose_rows, logprob, sample_with, verify, Dist, Lane, Sampler, SamplingParams};
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

/// The text side of a model: its tokenizer and chat template, read from GGUF metadata.
#[derive(Debug)]
pub struct TextModel {
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template, when the model has one.
    pub template: Option<ChatTemplate>,
}

impl TextModel {
    /// Builds both from a GGUF file's metadata.
    pub fn from_gguf(c: &candle_core::quantized::gguf_file::Content) -> Result<Self> {
        let tokenizer = Tokenizer::from_gguf(c)?;
        let template = match c
            .metadata
            .get("tokenizer.chat_template")
            .and_then(|v| v.to_string().ok())
        {
            Some(src) => {
                let name = |id: Option<u32>| {
                    id.and_then(|i| tokenizer.token(i))
                        .unwrap_or("")
                        .to_string()
                };
                let eos = tokenizer.eos().first().copied();
                Some(ChatTemplate::new(src, &name(tokenizer.bos()), &name(eos))?)
            }
            None => None,
        };
        Ok(Self {
            tokenizer,
            template,
        })
    }

    /// Renders a conversation with the chat template.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String> {
        self.template
            .as_ref()
            .ok_or_else(|| GenerateError::Template("the model has no chat template".into()))?
            .render(messages)
    }
}
