//! The wire: tonic/prost code generated from `proto/pipeline.proto`, the hidden-state codec,
//! the cluster-token check every link carries, and the limits a stage enforces on what it
//! receives. Both ends of every link use this crate, so they cannot disagree.

use std::path::Path;

use half::{bf16, f16};
use pipeshard_model::{LogitsWanted, SeqId, SeqStep, StageInput, StepBatch};
use tonic::metadata::{Ascii, MetadataValue};
use tonic::{Request, Status};

/// Generated from `proto/pipeline.proto`.
#[allow(missing_docs, clippy::all)]
pub mod pb {
    tonic::include_proto!("pipeshard.v1");
}

/// What was wrong with something received or configured.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// A message breaks the protocol.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// A message is within the protocol but beyond a configured limit.
    #[error("over the limit: {0}")]
    Limit(String),
    /// The cluster token file cannot be used.
    #[error("token file {path}: {msg}")]
    TokenFile {
        /// The file.
        path: String,
        /// What is wrong.
        msg: String,
    },
}

type Result<T, E = WireError> = std::result::Result<T, E>;

/// Element type of hidden states on a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WireDtype {
    /// Exact (default).
    #[default]
    F32,
    /// Half the bytes, rounded.
    F16,
    /// Half the bytes, rounded.
    Bf16,
}

impl std::str::FromStr for WireDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(Self::F32),
            "f16" => Ok(Self::F16),
            "bf16" => Ok(Self::Bf16),
            _ => Err(format!("`{s}` is not a wire dtype (f32, f16, bf16)")),
        }
    }
}

impl WireDtype {
    fn pb(self) -> pb::DType {
        match self {
            Self::F32 => pb::DType::DtypeF32,
            Self::F16 => pb::DType::DtypeF16,
            Self::Bf16 => pb::DType::DtypeBf16,
        }
    }
    /// The protobuf enum value.
    pub fn to_i32(self) -> i32 {
        self.pb() as i32
    }
}

/// Encodes `[rows, width]` hidden states.
pub fn encode_hidden(h: &[f32], rows: usize, width: usize, dtype: WireDtype) -> pb::Tensor {
    let mut data = Vec::with_capacity(h.len() * if dtype == WireDtype::F32 { 4 } else { 2 });
    match dtype {
        WireDtype::F32 => h
            .iter()
            .for_each(|x| data.extend_from_slice(&x.to_le_bytes())),
        WireDtype::F16 => h
            .iter()
            .for_each(|x| data.extend_from_slice(&f16::from_f32(*x).to_le_bytes())),
        WireDtype::Bf16 => h
            .iter()
            .for_each(|x| data.extend_from_slice(&bf16::from_f32(*x).to_le_bytes())),
    }
    pb::Tensor {
        dtype: dtype.to_i32(),
        shape: vec![rows as u32, width as u32],
        data,
    }
}

/// Decodes hidden states, checking that they are `[rows, width]`.
pub fn decode_hidden(t: &pb::Tensor, rows: usize, width: usize) -> Result<Vec<f32>> {
    if t.shape != [rows as u32, width as u32] {
        return Err(WireError::Malformed(format!(
            "hidden tensor of shape {:?}, expected [{rows}, {width}]",
            t.shape
        )));
    }
    let dtype = pb::DType::try_from(t.dtype)
        .map_err(|_| WireError::Malformed(format!("unknown dtype {}", t.dtype)))?;
    let size = if dtype == pb::DType::DtypeF32 { 4 } else { 2 };
    if t.data.len() != rows * width * size {
        return Err(WireError::Malformed(format!(
            "hidden tensor holds {} bytes, expected {} for [{rows}, {width}] {dtype:?}",
            t.data.len(),
            rows * width * size
        )));
    }
    Ok(match dtype {
        pb::DType::DtypeF32 => t
            .data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        pb::DType::DtypeF16 => t
            .data
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        pb::DType::DtypeBf16 => t
            .data
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
    })
}

/// Bounds on what a stage accepts; a step beyond them is refused, and the stage goes on.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest encoded message, bytes.
    pub max_message_bytes: usize,
    /// Most token rows in one step.
    pub max_tokens_per_step: usize,
    /// Most sequences in one step.
    pub max_seqs_per_step: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_message_bytes: 64 << 20,
            max_tokens_per_step: 4096,
            max_seqs_per_step: 256,
        }
    }
}

/// A decoded step: the batch for `Stage::forward`, plus what only the last stage needs.
#[derive(Debug)]
pub struct DecodedStep {
    /// The forward pass's input.
    pub batch: StepBatch,
    /// Per sequence, in order: its sampling parameters and drafts.
    pub seqs: Vec<pb::SeqStep>,
}

/// Checks a step against the limits and the receiving stage, and turns it into a batch.
/// `first`: the stage takes tokens; `hidden`: width of hidden states; `ctx`: context length.
pub fn decode_step(
    step: &pb::Step,
    first: bool,
    hidden: usize,
    ctx: usize,
    limits: &Limits,
) -> Result<DecodedStep> {
    if step.seqs.is_empty() {
        return Err(WireError::Malformed("a step without sequences".into()));
    }
    if step.seqs.len() > limits.max_seqs_per_step {
        return Err(WireError::Limit(format!(
            "{} sequences in one step (at most {})",
            step.seqs.len(),
            limits.max_seqs_per_step
        )));
    }
    let mut rows = 0usize;
    let mut seqs = Vec::with_capacity(step.seqs.len());
    for s in &step.seqs {
        if s.n == 0 {
            return Err(WireError::Malformed(format!(
                "sequence {} has n = 0",
                s.seq_id
            )));
        }
        let (pos, n) = (s.pos as usize, s.n as usize);
        if pos + n > ctx {
            return Err(WireError::Limit(format!(
                "sequence {} reaches position {}, past the context length {ctx}",
                s.seq_id,
                pos + n
            )));
        }
        let output = pb::Output::try_from(s.output)
            .map_err(|_| WireError::Malformed(format!("unknown output kind {}", s.output)))?;
        if !s.draft.is_empty() {
            let bad = if output != pb::Output::All {
                Some("proposals need every row's output".to_string())
            } else if s.draft.len() + 1 < n || s.draft.len() > n {
                Some(format!("{} proposals for {n} rows", s.draft.len()))
            } else if !s.draft_q.is_empty() && s.draft_q.len() != s.draft.len() {
                Some(format!(
                    "{} proposal distributions for {} proposals",
                    s.draft_q.len(),
                    s.draft.len()
                ))
            } else if first
                && step
                    .tokens
                    .get(rows + 1..rows + n)
                    .is_some_and(|t| t != &s.draft[..n - 1])
            {
                Some("the proposals are not the drafted input tokens".to_string())
            } else {
                s.draft_q
                    .iter()
                    .find(|q| q.ids.len() != q.probs.len())
                    .map(|_| "a proposal distribution with more ids than probabilities".to_string())
            };
            if let Some(why) = bad {
                return Err(WireError::Malformed(format!(
                    "sequence {}: {why}",
                    s.seq_id
                )));
            }
        }
        rows += n;
        seqs.push(SeqStep {
            seq: SeqId(s.seq_id),
            pos,
            n,
            logits: match output {
                pb::Output::None => LogitsWanted::None,
                pb::Output::Last => LogitsWanted::Last,
                pb::Output::All => LogitsWanted::All,
            },
        });
    }
    if rows > limits.max_tokens_per_step {
        return Err(WireError::Limit(format!(
            "{rows} tokens in one step (at most {})",
            limits.max_tokens_per_step
        )));
    }
    let input = if first {
        if step.hidden.is_some() {
            return Err(WireError::Malformed(
                "the first stage takes token ids, not hidden states".into(),
            ));
        }
        if step.tokens.len() != rows {
            return Err(WireError::Malformed(format!(
                "{} token ids for {rows} rows",
                step.tokens.len()
            )));
        }
        StageInput::Tokens(step.tokens.clone())
    } else {
        let Some(t) = &step.hidden else {
            return Err(WireError::Malformed(
                "this stage takes hidden states, and the step has none".into(),
            ));
        };
        StageInput::Hidden(decode_hidden(t, rows, hidden)?)
    };
    Ok(DecodedStep {
        batch: StepBatch { seqs, input },
        seqs: step.seqs.clone(),
    })
}

/// Accepted connections of a server, with Nagle's delay off (every frame is latency-bound).
pub fn incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// Metadata key that carries the cluster token.
pub const AUTH_HEADER: &str = "authorization";

/// Reads a cluster token file: one line of at least 16 visible ASCII characters.
pub fn read_token_file(path: &Path) -> Result<String> {
    let err = |msg: String| WireError::TokenFile {
        path: path.display().to_string(),
        msg,
    };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    let token = text.trim();
    if token.len() < 16 {
        return Err(err(format!(
            "the token has {} characters; use at least 16",
            token.len()
        )));
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(err("the token must be visible ASCII, one line".into()));
    }
    Ok(token.to_string())
}

/// Adds the cluster token to every outgoing call.
#[derive(Clone)]
pub struct AddToken(MetadataValue<Ascii>);

impl AddToken {
    /// For `token` (as read by [`read_token_file`]).
    pub fn new(token: &str) -> Result<Self> {
        format!("Bearer {token}")
            .parse()
            .map(Self)
            .map_err(|_| WireError::Malformed("the token is not valid metadata".into()))
    }
}

impl tonic::service::Interceptor for AddToken {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        req.metadata_mut().insert(AUTH_HEADER, self.0.clone());
        Ok(req)
    }
}

/// Refuses every incoming call that lacks the cluster token, and logs it.
#[derive(Clone)]
pub struct CheckToken(std::sync::Arc<str>);

impl CheckToken {
    /// For `token`.
    pub fn new(token: &str) -> Self {
        Self(format!("Bearer {token}").into())
    }
}

impl tonic::service::Interceptor for CheckToken {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let peer = req
            .remote_addr()
            .map_or_else(|| "unknown peer".to_string(), |a| a.to_string());
        match req.metadata().get(AUTH_HEADER).map(|v| v.as_bytes()) {
            // Constant-time comparison: the token is a secret.
            Some(got) if constant_time_eq(got, self.0.as_bytes()) => Ok(req),
            Some(_) => {
                tracing::warn!(%peer, "refused a call with a wrong cluster token");
                Err(Status::unauthenticated("wrong cluster token"))
            }
            None => {
                tracing::warn!(%peer, "refused a call without a cluster token");
                Err(Status::unauthenticated("missing cluster token"))
            }
        }
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::service::Interceptor;

    #[test]
    fn hidden_round_trips_exactly_in_f32_and_closely_in_halves() {
        let h: Vec<f32> = (0..12).map(|i| (i as f32 - 5.5) * 0.37).collect();
        let t = encode_hidden(&h, 3, 4, WireDtype::F32);
        assert_eq!(decode_hidden(&t, 3, 4).unwrap(), h);
        for d in [WireDtype::F16, WireDtype::Bf16] {
            let t = encode_hidden(&h, 3, 4, d);
            assert_eq!(t.data.len(), 24);
            let back = decode_hidden(&t, 3, 4).unwrap();
            for (a, b) in h.iter().zip(&back) {
                assert!((a - b).abs() < 0.02, "{d:?}: {a} vs {b}");
            }
        }
        assert!(decode_hidden(&t, 4, 3).is_err());
        let mut short = encode_hidden(&h, 3, 4, WireDtype::F32);
        short.data.pop();
        assert!(decode_hidden(&short, 3, 4).is_err());
    }

    fn step(seqs: Vec<(u64, u32, u32)>, tokens: Vec<u32>) -> pb::Step {
        pb::Step {
            batch_id: 1,
            seqs: seqs
                .into_iter()
                .map(|(id, pos, n)| pb::SeqStep {
                    seq_id: id,
                    pos,
                    n,
                    output: pb::Output::Last as i32,
                    ..Default::default()
                })
                .collect(),
            tokens,
            hidden: None,
            timings: vec![],
        }
    }

    #[test]
    fn steps_are_checked_against_limits_and_shape() {
        let l = Limits {
            max_tokens_per_step: 4,
            max_seqs_per_step: 2,
            ..Limits::default()
        };
        let ok = decode_step(
            &step(vec![(1, 0, 2), (2, 5, 1)], vec![1, 2, 3]),
            true,
            8,
            64,
            &l,
        )
        .unwrap();
        assert_eq!(ok.batch.total_rows(), 3);
        let err = |s: pb::Step, first| decode_step(&s, first, 8, 64, &l).unwrap_err().to_string();
        assert!(err(step(vec![], vec![]), true).contains("without sequences"));
        assert!(err(step(vec![(1, 0, 5)], vec![0; 5]), true).contains("5 tokens in one step"));
        assert!(err(step(vec![(1, 0, 1); 3], vec![0; 3]), true).contains("3 sequences"));
        assert!(err(step(vec![(1, 0, 2)], vec![0]), true).contains("1 token ids for 2 rows"));
        assert!(err(step(vec![(1, 63, 2)], vec![0; 2]), true).contains("context length 64"));
        assert!(err(step(vec![(1, 0, 0)], vec![]), true).contains("n = 0"));
        let spec = |draft: Vec<u32>, q: usize, output: pb::Output| {
            let mut s = step(vec![(1, 0, 3)], vec![7, 8, 9]);
            s.seqs[0].output = output as i32;
            s.seqs[0].draft = draft;
            s.seqs[0].draft_q = vec![pb::Dist::default(); q];
            s
        };
        let all = pb::Output::All;
        assert!(decode_step(&spec(vec![8, 9], 0, all), true, 8, 64, &l).is_ok());
        assert!(decode_step(&spec(vec![8, 9, 4], 3, all), true, 8, 64, &l).is_ok());
        assert!(err(spec(vec![8, 9], 0, pb::Output::Last), true).contains("every row"));
        assert!(err(spec(vec![8], 0, all), true).contains("1 proposals for 3 rows"));
        assert!(err(spec(vec![8, 9], 1, all), true).contains("1 proposal distributions"));
        assert!(err(spec(vec![8, 5], 0, all), true).contains("not the drafted input"));
        assert!(err(step(vec![(1, 0, 1)], vec![0]), false).contains("has none"));
        let mut bad_output = step(vec![(1, 0, 1)], vec![0]);
        bad_output.seqs[0].output = 9;
        assert!(err(bad_output, true).contains("unknown output"));
    }

    #[test]
    fn token_check_refuses_missing_and_wrong_tokens() {
        let mut check = CheckToken::new("0123456789abcdef");
        let mut add = AddToken::new("0123456789abcdef").unwrap();
        let req = add.call(Request::new(())).unwrap();
        assert!(check.call(req).is_ok());
        let wrong = AddToken::new("0123456789abcdeX")
            .unwrap()
            .call(Request::new(()))
            .unwrap();
        assert_eq!(
            check.call(wrong).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        assert!(check
            .call(Request::new(()))
            .unwrap_err()
            .message()
            .contains("missing"));
    }

    #[test]
    fn token_files_must_hold_a_real_token() {
        let dir = std::env::temp_dir().join(format!("pipeshard-wire-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("t");
        std::fs::write(&f, "short\n").unwrap();
        assert!(read_token_file(&f)
            .unwrap_err()
            .to_string()
            .contains("at least 16"));
        std::fs::write(&f, "0123456789abcdef0123\n").unwrap();
        assert_eq!(read_token_file(&f).unwrap(), "0123456789abcdef0123");
        assert!(read_token_file(&dir.join("none")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
