//! What one forward step carries: which sequences, at which positions, with which inputs,
//! and what the last stage returns.

use std::fmt;

use crate::error::ModelError;

/// A token id in the model's vocabulary.
pub type TokenId = u32;

/// Identifies one sequence (one user's request); each has its own KV cache on every stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seq{}", self.0)
    }
}

/// A half-open range of layer indices `start..end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LayerRange {
    /// First layer (inclusive).
    pub start: usize,
    /// Last layer (exclusive).
    pub end: usize,
}

impl LayerRange {
    /// `start..end`; callers check `start < end`.
    pub fn new(start: usize, end: usize) -> Self {
        Self { start, end }
    }
    /// Number of layers in the range.
    pub fn len(&self) -> usize {
        self.end - self.start
    }
    /// True when the range holds no layer.
    pub fn is_empty(&self) -> bool {
        self.end <= self.start
    }
    /// Splits `0..n_layers` into `stages` contiguous ranges as even as possible.
    pub fn even_split(n_layers: usize, stages: usize) -> Vec<LayerRange> {
        let base = n_layers / stages;
        let extra = n_layers % stages;
        let mut out = Vec::with_capacity(stages);
        let mut start = 0;
        for i in 0..stages {
            let len = base + usize::from(i < extra);
            out.push(LayerRange::new(start, start + len));
            start += len;
        }
        out
    }

    /// Splits layers into `stages` contiguous ranges (at most one per layer) so that the
    /// costliest stage costs least: `layer_costs[i]` is layer i's cost, `tail` what the last
    /// stage adds (its output layer). Among equally good splits, earlier stages take more
    /// layers. A pipeline runs at the pace of its slowest stage, so this is the split that
    /// serves fastest when every stage runs on the same kind of machine.
    pub fn balanced_split(layer_costs: &[f64], tail: f64, stages: usize) -> Vec<LayerRange> {
        let n = layer_costs.len();
        let stages = stages.clamp(1, n.max(1));
        let mut prefix = vec![0.0; n + 1];
        for (i, c) in layer_costs.iter().enumerate() {
            prefix[i + 1] = prefix[i] + c;
        }
        let cost = |a: usize, b: usize| prefix[b] - prefix[a] + if b == n { tail } else { 0.0 };
        // best[s][i]: the least possible worst stage when the last s stages hold layers i..n;
        // cut[s][i]: where the first of them ends.
        let mut best = vec![vec![f64::INFINITY; n + 1]; stages + 1];
        let mut cut = vec![vec![n; n + 1]; stages + 1];
        best[0][n] = 0.0;
        for s in 1..=stages {
            for i in (0..n).rev() {
                // Scanning ends from the far one keeps the longest first stage among ties.
                for e in (i + 1..=n).rev() {
                    let worst = cost(i, e).max(best[s - 1][e]);
                    if worst < best[s][i] {
                        best[s][i] = worst;
                        cut[s][i] = e;
                    }
                }
            }
        }
        let mut out = Vec::with_capacity(stages);
        let mut start = 0;
        for s in (1..=stages).rev() {
            let end = cut[s][start];
            out.push(LayerRange::new(start, end));
            start = end;
        }
        out
    }
}

impl LayerRange {
    /// Checks that ranges tile `0..n_layers` in order, naming the first stage that does not.
    pub fn check_tiling(ranges: &[LayerRange], n_layers: usize) -> Result<(), ModelError> {
        let mut expect = 0;
        for (i, r) in ranges.iter().enumerate() {
            if r.start != expect || r.is_empty() {
                let what = if r.start > expect {
                    "a gap"
                } else {
                    "an overlap"
                };
                let what = if r.is_empty() { "an empty range" } else { what };
                return Err(ModelError::InvalidBatch(format!(
                    "stage {i} holds layers {r}: {what} (expected it to start at layer {expect})"
                )));
            }
            expect = r.end;
        }
        if expect != n_layers {
            return Err(ModelError::InvalidBatch(format!(
                "stages end at layer {expect}, the model has {n_layers}"
            )));
        }
        Ok(())
    }
}

impl fmt::Display for LayerRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..{}", self.start, self.end)
    }
}

/// Which logits the last stage returns for a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWanted {
    /// None (a prefill chunk that is not the prompt's last).
    None,
    /// Only the last new token's logits (plain decoding).
    Last,
    /// Logits at every new token (verifying drafted tokens, perplexity).
    All,
}

/// One sequence's part of a step.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqStep {
    /// The sequence.
    pub seq: SeqId,
    /// Position of this step's first token. The stage truncates the sequence's KV cache to
    /// `pos` before appending, which is how rejected speculation is rolled back.
    pub pos: usize,
    /// Number of new tokens.
    pub n: usize,
    /// Logits wanted from the last stage.
    pub logits: LogitsWanted,
}

/// The input rows of a step, in sequence order: `sum(n)` rows.
#[derive(Debug, Clone, PartialEq)]
pub enum StageInput {
    /// Token ids (first stage).
    Tokens(Vec<TokenId>),
    /// Hidden states, `[rows, hidden]` row-major (later stages).
    Hidden(Vec<f32>),
}

/// One forward step over several sequences.
#[derive(Debug, Clone, PartialEq)]
pub struct StepBatch {
    /// The sequences, each with its position and token count.
    pub seqs: Vec<SeqStep>,
    /// Their input rows, concatenated in `seqs` order.
    pub input: StageInput,
}

impl StepBatch {
    /// Total number of token rows in the step.
    pub fn total_rows(&self) -> usize {
        self.seqs.iter().map(|s| s.n).sum()
    }
}

/// Logits the last stage returns for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqLogits {
    /// The sequence.
    pub seq: SeqId,
    /// Position of the token whose logits are the first row (they predict `pos + 1`).
    pub first_pos: usize,
    /// Number of rows.
    pub rows: usize,
    /// `[rows, vocab]` row-major.
    pub data: Vec<f32>,
}

impl SeqLogits {
    /// Row `i` of the logits.
    pub fn row(&self, i: usize) -> &[f32] {
        let vocab = self.data.len() / self.rows.max(1);
        &self.data[i * vocab..(i + 1) * vocab]
    }
    /// Greedy choice at every row (lowest id on ties).
    pub fn argmax(&self) -> Vec<TokenId> {
        (0..self.rows).map(|i| argmax(self.row(i))).collect()
    }
}

/// Index of the largest value, the lowest index on ties.
pub fn argmax(xs: &[f32]) -> TokenId {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best as TokenId
}

/// What a stage's forward pass produces.
#[derive(Debug, Clone, PartialEq)]
pub enum StageOutput {
    /// Hidden states for every row, for the next stage.
    Hidden(Vec<f32>),
    /// Logits for the requested rows (last stage).
    Logits(Vec<SeqLogits>),
}

/// Hidden states as the bytes that travel between stages: f32, little-endian.
pub fn hidden_to_bytes(hidden: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(hidden.len() * 4);
    for x in hidden {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

/// Inverse of [`hidden_to_bytes`]; `None` when the length is not a multiple of 4.
pub fn hidden_from_bytes(bytes: &[u8]) -> Option<Vec<f32>> {
    if !bytes.len().is_multiple_of(4) {
        return None;
    }
    Some(
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_split_tiles() {
        let r = LayerRange::even_split(30, 4);
        assert_eq!(
            r.iter().map(|r| r.len()).collect::<Vec<_>>(),
            vec![8, 8, 7, 7]
        );
        assert_eq!(r[0].start, 0);
        assert_eq!(r[3].end, 30);
    }

    #[test]
    fn balanced_split_evens_out_the_costliest_stage() {
        let worst = |r: &[LayerRange], c: &[f64], tail: f64| {
            r.iter()
                .map(|r| {
                    c[r.start..r.end].iter().sum::<f64>()
                        + if r.end == c.len() { tail } else { 0.0 }
                })
                .fold(0.0, f64::max)
        };
        // Equal layers and no tail: the even split.
        let ones = vec![1.0; 30];
        assert_eq!(
            LayerRange::balanced_split(&ones, 0.0, 4),
            LayerRange::even_split(30, 4)
        );
        // An output layer worth six layers moves layers to the first stage: 28 + 6 = 2 x 17.
        let r = LayerRange::balanced_split(&vec![1.0; 28], 6.0, 2);
        assert_eq!(r, vec![LayerRange::new(0, 17), LayerRange::new(17, 28)]);
        // More stages than layers: one layer each.
        assert_eq!(LayerRange::balanced_split(&[1.0, 2.0], 0.0, 5).len(), 2);
        // Against every split of a few uneven layers into 3 stages.
        let mut x = 7u64;
        for _ in 0..50 {
            let c: Vec<f64> = (0..8)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    1.0 + (x >> 40) as f64 / (1u64 << 24) as f64 * 4.0
                })
                .collect();
            let r = LayerRange::balanced_split(&c, 3.0, 3);
            LayerRange::check_tiling(&r, 8).unwrap();
            let mut least = f64::INFINITY;
            for a in 1..7 {
                for b in a + 1..8 {
                    let cand = [
                        LayerRange::new(0, a),
                        LayerRange::new(a, b),
                        LayerRange::new(b, 8),
                    ];
                    least = least.min(worst(&cand, &c, 3.0));
                }
            }
            assert!((worst(&r, &c, 3.0) - least).abs() < 1e-9, "{c:?} {r:?}");
        }
    }

    #[test]
    fn hidden_bytes_round_trip() {
        let h = vec![1.5f32, -0.0, f32::MIN_POSITIVE, 3.25e7];
        let back = hidden_from_bytes(&hidden_to_bytes(&h)).unwrap();
        assert_eq!(
            h.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            back.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        assert!(hidden_from_bytes(&[1, 2, 3]).is_none());
    }
}
