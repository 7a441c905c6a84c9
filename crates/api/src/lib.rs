//! The OpenAI-compatible HTTP API (axum): `GET /v1/models`, `POST /v1/completions`,
//! `POST /v1/chat/completions` (whole or streamed as server-sent events), `GET /health`.
//!
//! Requests are validated here, at the edge, into the head's `GenRequest`; every failure is
//! an [`ApiError`], which becomes an OpenAI-style error object in one place.

mod error;
mod openai;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::stream::{self, Stream, StreamExt};
use pipeshard_generate::ChatMessage;
use pipeshard_head::{GenEvent, GenRequest, HeadHandle, Usage};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

pub use error::ApiError;
use openai::{ChatRequest, CommonParams, CompletionRequest, Prompt};

/// API settings.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// Largest request body, bytes.
    pub max_body_bytes: usize,
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 1 << 20,
        }
    }
}

struct AppState {
    head: HeadHandle,
    next_id: AtomicU64,
}

/// The router, ready for `axum::serve`.
pub fn router(head: HeadHandle, config: ApiConfig) -> Router {
    let state = Arc::new(AppState {
        head,
        next_id: AtomicU64::new(1),
    });
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .fallback(|| async { ApiError::not_found("no such route") })
        .layer(DefaultBodyLimit::max(config.max_body_bytes))
        .with_state(state)
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    let s = st.head.status();
    let code = if s.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "status": if s.ready { "ok" } else { "unavailable" },
        "message": s.message,
        "model": st.head.model().name,
        "stages": s.stages,
    });
    (code, Json(body)).into_response()
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": st.head.model().name,
            "object": "model",
            "created": 0,
            "owned_by": "pipeshard",
        }],
    }))
}

/// Parses a JSON body: malformed JSON and wrong types are 400s, an oversized body 413.
fn parse<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let body =
        body.map_err(|r| ApiError::new(r.status(), "invalid_request_error", r.body_text()))?;
    let value: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("malformed JSON: {e}")))?;
    serde_json::from_value(value)
        .map_err(|e| ApiError::bad_request(format!("invalid request: {e}")))
}

/// Checks the model name and the common parameters; returns the head's request.
fn validate(
    st: &AppState,
    model: &str,
    p: &CommonParams,
    prompt: Vec<u32>,
    default_max: Option<usize>,
) -> Result<GenRequest, ApiError> {
    let served = st.head.model();
    if model != served.name {
        return Err(ApiError::bad_request(format!(
            "the model `{model}` does not exist; this server serves `{}`",
            served.name
        ))
        .with_code("model_not_found")
        .with_param("model"));
    }
    if p.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_request("only n = 1 is supported").with_param("n"));
    }
    if prompt.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty").with_param("prompt"));
    }
    let ctx = served.ctx_len;
    if prompt.len() >= ctx {
        return Err(ApiError::bad_request(format!(
            "the prompt has {} tokens; the context holds {ctx}",
            prompt.len()
        )));
    }
    let room = ctx - prompt.len();
    let max_tokens = match p.max_tokens() {
        Some(0) => {
            return Err(
                ApiError::bad_request("max_tokens must be at least 1").with_param("max_tokens")
            )
        }
        Some(m) if m as usize > room => {
            return Err(ApiError::bad_request(format!(
                "max_tokens {m} plus the prompt's {} tokens exceeds the context length {ctx}",
                prompt.len()
            ))
            .with_param("max_tokens"))
        }
        Some(m) => m as usize,
        None => default_max.unwrap_or(room).min(room),
    };
    let sampling = p.sampling();
    sampling
        .validate()
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(GenRequest {
        prompt,
        sampling,
        max_tokens,
        stops: p.stops(),
        logprobs: p.wants_logprobs(),
        ignore_eos: false,
        draft_k: None,
    })
}

fn encode(st: &AppState, text: &str) -> Result<Vec<u32>, ApiError> {
    st.head
        .model()
        .text
        .tokenizer
        .encode(text)
        .map_err(|e| ApiError::bad_request(e.to_string()))
}

async fn completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let r: CompletionRequest = parse(body)?;
    if r.echo == Some(true) {
        return Err(ApiError::bad_request("echo is not supported").with_param("echo"));
    }
    let prompt = match &r.prompt {
        Prompt::Text(t) => encode(&st, t)?,
        Prompt::Texts(v) if v.len() == 1 => encode(&st, &v[0])?,
        Prompt::Texts(_) => {
            return Err(
                ApiError::bad_request("only one prompt per request is supported")
                    .with_param("prompt"),
            )
        }
        Prompt::Tokens(t) => {
            let vocab = st.head.model().text.tokenizer.vocab_size();
            if let Some(bad) = t.iter().find(|&&t| t as usize >= vocab) {
                return Err(ApiError::bad_request(format!(
                    "token {bad} is outside the vocabulary ({vocab})"
                ))
                .with_param("prompt"));
            }
            t.clone()
        }
    };
    let req = validate(&st, &r.model, &r.params, prompt, Some(16))?;
    let id = format!("cmpl-{}", st.next_id.fetch_add(1, Ordering::Relaxed));
    let kind = Kind::Completion {
        model: r.model.clone(),
        id,
    };
    respond(&st, kind, req, &r.params).await
}

/// Submits a validated request and answers it whole or as a stream.
async fn respond(
    st: &AppState,
    kind: Kind,
    req: GenRequest,
    params: &CommonParams,
) -> Result<Response, ApiError> {
    let rx = st.head.submit(req)?;
    if params.stream == Some(true) {
        Ok(stream_response(kind, rx, params.include_usage()).into_response())
    } else {
        whole_response(kind, rx).await
    }
}

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let r: ChatRequest = parse(body)?;
    if r.messages.is_empty() {
        return Err(ApiError::bad_request("messages is empty").with_param("messages"));
    }
    let messages: Vec<ChatMessage> = r
        .messages
        .iter()
        .map(|m| ChatMessage::new(&m.role, &m.content.text()))
        .collect();
    let text = st
        .head
        .model()
        .text
        .render_chat(&messages)
        .map_err(|e| ApiError::bad_request(e.to_string()).with_param("messages"))?;
    let prompt = encode(&st, &text)?;
    let req = validate(&st, &r.model, &r.params, prompt, None)?;
    let id = format!("chatcmpl-{}", st.next_id.fetch_add(1, Ordering::Relaxed));
    let kind = Kind::Chat {
        model: r.model.clone(),
        id,
    };
    respond(&st, kind, req, &r.params).await
}

/// Which endpoint a response is for.
#[derive(Clone)]
enum Kind {
    Completion { model: String, id: String },
    Chat { model: String, id: String },
}

impl Kind {
    fn ids(&self) -> (&str, &str) {
        match self {
            Self::Completion { model, id } | Self::Chat { model, id } => (model, id),
        }
    }
}

#[derive(Default)]
struct Collected {
    text: String,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
}

async fn whole_response(
    kind: Kind,
    mut rx: UnboundedReceiver<GenEvent>,
) -> Result<Response, ApiError> {
    let mut c = Collected::default();
    let (finish, usage) = loop {
        match rx.recv().await {
            Some(GenEvent::Text {
                text,
                token,
                logprob,
            }) => {
                c.text.push_str(&text);
                if let Some(t) = token {
                    c.tokens.push(t);
                }
                if let Some(l) = logprob {
                    c.logprobs.push(l);
                }
            }
            Some(GenEvent::Done { finish, usage, .. }) => break (finish, usage),
            Some(GenEvent::Error(e)) => return Err(ApiError::generation(e)),
            None => return Err(ApiError::generation("the head stopped".into())),
        }
    };
    let (model, id) = kind.ids();
    let finish = serde_json::to_value(finish).unwrap_or(Value::Null);
    let body = match &kind {
        Kind::Completion { .. } => json!({
            "id": id, "object": "text_completion", "created": now(), "model": model,
            "choices": [{
                "index": 0, "text": c.text, "finish_reason": finish,
                "logprobs": if c.logprobs.is_empty() { Value::Null } else { json!({
                    "tokens": c.tokens.iter().map(|t| t.to_string()).collect::<Vec<_>>(),
                    "token_logprobs": c.logprobs,
                    "top_logprobs": Value::Null,
                    "text_offset": Value::Null,
                })},
            }],
            "usage": usage_json(&usage),
        }),
        Kind::Chat { .. } => json!({
            "id": id, "object": "chat.completion", "created": now(), "model": model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": c.text},
                "finish_reason": finish,
                "logprobs": if c.logprobs.is_empty() { Value::Null } else { json!({
                    "content": c.tokens.iter().zip(&c.logprobs).map(|(t, l)| json!({
                        "token": t.to_string(), "logprob": l, "bytes": Value::Null, "top_logprobs": [],
                    })).collect::<Vec<_>>(),
                })},
            }],
            "usage": usage_json(&usage),
        }),
    };
    Ok(Json(body).into_response())
}

/// OpenAI's usage object; with speculative decoding, its `completion_tokens_details` tells the
/// drafted tokens accepted and rejected (the fields OpenAI uses for predicted outputs).
fn usage_json(u: &Usage) -> Value {
    let mut v = json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
    });
    if u.drafted_tokens > 0 {
        v["completion_tokens_details"] = json!({
            "accepted_prediction_tokens": u.accepted_tokens,
            "rejected_prediction_tokens": u.drafted_tokens - u.accepted_tokens,
        });
    }
    v
}

fn chunk(kind: &Kind, text: Option<&str>, first: bool, finish: Option<Value>) -> Value {
    let (model, id) = kind.ids();
    match kind {
        Kind::Completion { .. } => json!({
            "id": id, "object": "text_completion", "created": now(), "model": model,
            "choices": [{
                "index": 0, "text": text.unwrap_or(""), "logprobs": Value::Null,
                "finish_reason": finish.unwrap_or(Value::Null),
            }],
        }),
        Kind::Chat { .. } => {
            let mut delta = serde_json::Map::new();
            if first {
                delta.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = text {
                delta.insert("content".into(), json!(t));
            }
            json!({
                "id": id, "object": "chat.completion.chunk", "created": now(), "model": model,
                "choices": [{
                    "index": 0, "delta": delta, "logprobs": Value::Null,
                    "finish_reason": finish.unwrap_or(Value::Null),
                }],
            })
        }
    }
}

/// Server-sent events: one chunk per piece of text, a last chunk with the finish reason
/// (and, when asked, one with usage), then `data: [DONE]`. Dropping the stream (the client
/// went away) drops the receiver, which cancels the sequence.
fn stream_response(
    kind: Kind,
    rx: UnboundedReceiver<GenEvent>,
    include_usage: bool,
) -> Sse<impl Stream<Item = Result<Event, std::convert::Infallible>>> {
    let first = matches!(kind, Kind::Chat { .. }).then(|| chunk(&kind, Some(""), true, None));
    let head = stream::iter(first.map(|v| Ok(Event::default().data(v.to_string()))));
    let body = stream::unfold(Some((kind, rx)), move |st| async move {
        let (kind, mut rx) = st?;
        let events: Vec<Value> = match rx.recv().await {
            Some(GenEvent::Text { text, .. }) if text.is_empty() => vec![],
            Some(GenEvent::Text { text, .. }) => vec![chunk(&kind, Some(&text), false, None)],
            Some(GenEvent::Done { finish, usage, .. }) => {
                let finish = serde_json::to_value(finish).unwrap_or(Value::Null);
                let mut v = vec![chunk(&kind, None, false, Some(finish))];
                if include_usage {
                    let (model, id) = kind.ids();
                    let object = match kind {
                        Kind::Completion { .. } => "text_completion",
                        Kind::Chat { .. } => "chat.completion.chunk",
                    };
                    v.push(json!({
                        "id": id, "object": object, "created": now(), "model": model,
                        "choices": [], "usage": usage_json(&usage),
                    }));
                }
                let out: Vec<_> = v
                    .into_iter()
                    .map(|v| Ok(Event::default().data(v.to_string())))
                    .chain([Ok(Event::default().data("[DONE]"))])
                    .collect();
                return Some((stream::iter(out), None));
            }
            Some(GenEvent::Error(e)) => {
                let err = ApiError::generation(e).body();
                let out = vec![Ok(Event::default().data(err.to_string()))];
                return Some((stream::iter(out), None));
            }
            None => return None,
        };
        let out: Vec<_> = events
            .into_iter()
            .map(|v| Ok(Event::default().data(v.to_string())))
            .collect();
        Some((stream::iter(out), Some((kind, rx))))
    })
    .flatten();
    Sse::new(head.chain(body)).keep_alive(KeepAlive::default())
}
