//! OpenAI's request types, as far as we serve them. Unknown fields are ignored, as OpenAI
//! clients send fields a server may not know.

use pipeshard_generate::SamplingParams;
use serde::Deserialize;

/// `stop`: one string or several.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// `logprobs`: a bool for chat, a number for completions.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Logprobs {
    Flag(bool),
    Count(#[allow(dead_code)] u32), // alternatives per token: only the chosen one is returned
}

/// Parameters both endpoints take.
#[derive(Debug, Deserialize)]
pub struct CommonParams {
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub stop: Option<Stop>,
    pub seed: Option<u64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u32>,
    pub logprobs: Option<Logprobs>,
}

impl CommonParams {
    pub fn max_tokens(&self) -> Option<u32> {
        self.max_completion_tokens.or(self.max_tokens)
    }
    pub fn sampling(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(0) as usize,
            top_p: self.top_p.unwrap_or(1.0),
            seed: self.seed,
        }
    }
    pub fn stops(&self) -> Vec<String> {
        match &self.stop {
            None => vec![],
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        }
    }
    pub fn wants_logprobs(&self) -> bool {
        matches!(
            self.logprobs,
            Some(Logprobs::Flag(true)) | Some(Logprobs::Count(_))
        )
    }
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

/// `prompt`: text, a one-element list of texts, or token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    pub echo: Option<bool>,
    #[serde(flatten)]
    pub params: CommonParams,
}

/// A message's content: a string, or a list of parts of which the text ones are used.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

impl Content {
    pub fn text(&self) -> String {
        match self {
            Self::Text(t) => t.clone(),
            Self::Parts(p) => p
                .iter()
                .filter(|p| p.kind == "text")
                .filter_map(|p| p.text.clone())
                .collect::<Vec<_>>()
                .join(""),
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Content,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<Message>,
    #[serde(flatten)]
    pub params: CommonParams,
}
