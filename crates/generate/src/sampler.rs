//! Choosing the next token from logits: greedy, or temperature with top-k and top-p, from a
//! seeded generator so a run with a seed is reproducible.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::{GenerateError, Result};

/// How to sample.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `p` (1: all).
    pub top_p: f32,
    /// Seed of the random generator (`None`: from the OS).
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Checks the ranges.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(GenerateError::Sampling(format!(
                "temperature {} must be >= 0",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(GenerateError::Sampling(format!(
                "top_p {} must be in (0, 1]",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// Which use a uniform draw is for; each position of a sequence has one draw per lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Choosing the token (plain sampling, or the residual after a rejected draft).
    Sample = 0,
    /// Accepting or rejecting a drafted token.
    Accept = 1,
    /// The draft model's own choice.
    Draft = 2,
}

/// A sampler's randomness: draws addressed by (position, lane), so that what is drawn for a
/// position does not depend on how many draws came before (speculation, batching, chunking).
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    seed: u64,
    count: u64,
}

impl Sampler {
    /// A sampler; fails on out-of-range parameters.
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(rand::random);
        Ok(Self {
            params,
            seed,
            count: 0,
        })
    }

    /// Its parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The draw in [0, 1) for position `index` (counted from the first generated token) and
    /// `lane`; 0 when greedy.
    pub fn uniform(&self, index: u64, lane: Lane) -> f32 {
        if self.params.temperature <= 0.0 {
            return 0.0;
        }
        // A counter-based draw: the generator is keyed by (seed, index, lane) and used once.
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&self.seed.to_le_bytes());
        key[8..16].copy_from_slice(&index.to_le_bytes());
        key[16] = lane as u8;
        StdRng::from_seed(key).random()
    }

    /// Picks the next token (the position after the previous call's).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let u = self.next_uniform();
        sample_with(&self.params, logits, u)
    }

    /// The next position's sampling draw, for a sampler that runs elsewhere (the ring's last
    /// stage); [`sample_with`] on that draw picks what [`Sampler::sample`] would have.
    pub fn next_uniform(&mut self) -> f32 {
        let u = self.uniform(self.count, Lane::Sample);
        self.count += 1;
        u
    }
}

/// A token distribution after temperature, top-k and top-p: ids, most likely first (lowest id
/// on ties), and their probabilities. Greedy is the point mass on the arg-max.
#[derive(Debug, Clone, PartialEq)]
pub struct Dist {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Their probabilities, summing to 1.
    pub probs: Vec<f32>,
}

impl Dist {
    /// All the mass on one token.
    pub fn point(id: u32) -> Self {
        Self {
            ids: vec![id],
            probs: vec![1.0],
        }
    }

    /// The distribution `params` sample from.
    pub fn new(params: &SamplingParams, logits: &[f32]) -> Self {
        if params.temperature <= 0.0 {
            return Self::point(pipeshard_model::batch::argmax(logits));
        }
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // Tokens more than 40 nats below the best weigh under 1e-17 of it, below what f32
        // sums can hold; leaving them out spares sorting the whole vocabulary.
        let floor = max - 40.0 * params.temperature;
        let mut idx: Vec<u32> = (0..logits.len() as u32)
            .filter(|&i| logits[i as usize] >= floor)
            .collect();
        idx.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        if params.top_k > 0 {
            idx.truncate(params.top_k);
        }
        let mut probs: Vec<f32> = idx
            .iter()
            .map(|&i| ((logits[i as usize] - max) / params.temperature).exp())
            .collect();
        normalize(&mut probs);
        if params.top_p > 0.0 && params.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= params.top_p {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            idx.truncate(keep);
            normalize(&mut probs);
        }
        Self { ids: idx, probs }
    }

    /// The `k` most likely tokens, renormalized (a draft's proposal distribution).
    pub fn top(mut self, k: usize) -> Self {
        if k > 0 && self.ids.len() > k {
            self.ids.truncate(k);
            self.probs.truncate(k);
            normalize(&mut self.probs);
        }
        self
    }

    /// Probability of `id`.
    pub fn prob(&self, id: u32) -> f32 {
        self.ids
            .iter()
            .position(|&i| i == id)
            .map_or(0.0, |i| self.probs[i])
    }

    /// The token the draw `u` in [0, 1) falls on.
    pub fn pick(&self, u: f32) -> u32 {
        pick(&self.ids, &self.probs, u)
    }
}

fn normalize(p: &mut [f32]) {
    let s: f32 = p.iter().sum();
    p.iter_mut().for_each(|x| *x /= s);
}

/// The id whose share of `weights` (not necessarily normalized) the draw `u` falls on.
fn pick(ids: &[u32], weights: &[f32], u: f32) -> u32 {
    let total: f32 = weights.iter().sum();
    let target = u * total;
    let mut acc = 0.0;
    for (id, w) in ids.iter().zip(weights) {
        acc += w;
        if target < acc {
            return *id;
        }
    }
    // Rounding left `target` at the very end: the last token with weight.
    ids.iter()
        .zip(weights)
        .rev()
        .find(|(_, w)| **w > 0.0)
        .map_or(ids[0], |(id, _)| *id)
}

/// Speculative sampling at one position: the draft proposed `draft` from `q` (`None`: with
/// certainty, as an n-gram does). The target's distribution `p` accepts it with probability
/// min(1, p/q) (`accept` is the draw for that); otherwise the token comes from the
/// normalized max(0, p − q) (with the draw `u`). The result is distributed exactly as `p`.
///
/// A certain proposal is accepted with probability p(draft); that test is made with the
/// sampling draw itself (accepted exactly when `u` falls on it, the residual being the rest
/// of `p`), so the token is the one sampling without the proposal picks.
pub fn verify(p: &Dist, draft: u32, q: Option<&Dist>, accept: f32, u: f32) -> u32 {
    let Some(q) = q else {
        return p.pick(u);
    };
    let qd = q.prob(draft);
    let pd = p.prob(draft);
    if qd > 0.0 && accept * qd < pd {
        return draft;
    }
    let residual: Vec<f32> = p
        .ids
        .iter()
        .zip(&p.probs)
        .map(|(&id, &pi)| (pi - q.prob(id)).max(0.0))
        .collect();
    if residual.iter().sum::<f32>() > 0.0 {
        pick(&p.ids, &residual, u)
    } else {
        // p ≤ q everywhere means p = q, where rejection has probability 0: only rounding
        // gets here.
        p.pick(u)
    }
}

/// The tokens a step's output rows yield. Without proposals, one per row. With proposals
/// (speculative decoding: proposal i is the expected token at row i, and the input of row
/// i + 1), rows are verified in order and the result stops at the first proposal replaced:
/// the accepted prefix plus one token. `q[i]`: proposal i's distribution (`None`: certain);
/// `uniforms[i]` and `accept[i]`: row i's draws.
pub fn choose_rows<'a>(
    params: &SamplingParams,
    rows: impl IntoIterator<Item = &'a [f32]>,
    proposals: &[u32],
    q: &[Option<Dist>],
    uniforms: &[f32],
    accept: &[f32],
) -> Vec<u32> {
    let mut out = Vec::new();
    for (i, row) in rows.into_iter().enumerate() {
        let u = uniforms.get(i).copied().unwrap_or(0.0);
        let t = match proposals.get(i) {
            Some(&d) => {
                let a = accept.get(i).copied().unwrap_or(0.0);
                let q = q.get(i).and_then(Option::as_ref);
                verify(&Dist::new(params, row), d, q, a, u)
            }
            None => sample_with(params, row, u),
        };
        out.push(t);
        if proposals.get(i).is_some_and(|&d| d != t) {
            break; // the rows after it followed a rejected proposal
        }
    }
    out
}

/// Picks a token from `logits` with the uniform draw `u` in [0, 1): pure, so the draw can be
/// made on the head and the choice on the last stage.
pub fn sample_with(params: &SamplingParams, logits: &[f32], u: f32) -> u32 {
    if params.temperature <= 0.0 {
        return pipeshard_model::batch::argmax(logits);
    }
    Dist::new(params, logits).pick(u)
}

/// Natural-log probability of `token` under `logits` (softmax at temperature 1).
pub fn logprob(logits: &[f32], token: u32) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| ((x - max) as f64).exp()).sum();
    (logits[token as usize] - max) - sum.ln() as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32, k: usize, p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature: t,
            top_k: k,
            top_p: p,
            seed: Some(seed),
        }
    }

    #[test]
    fn greedy_takes_the_max() {
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_seed_reproduces() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 7) % 13) as f32 * 0.3).collect();
        let mut s = Sampler::new(params(1.0, 1, 1.0, 3)).unwrap();
        assert_eq!(s.sample(&logits), pipeshard_model::batch::argmax(&logits));
        let run = |seed| {
            let mut s = Sampler::new(params(0.8, 10, 0.9, seed)).unwrap();
            (0..20).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }

    #[test]
    fn sampling_follows_the_distribution() {
        // p = softmax([0, ln 3]) = [0.25, 0.75].
        let logits = [0.0, 3f32.ln()];
        let mut s = Sampler::new(params(1.0, 0, 1.0, 9)).unwrap();
        let ones = (0..4000).filter(|_| s.sample(&logits) == 1).count();
        assert!((2850..3150).contains(&ones), "{ones}");
    }

    #[test]
    fn top_p_cuts_the_tail() {
        let logits = [5.0, 0.0, 0.0];
        let mut s = Sampler::new(params(1.0, 0, 0.5, 1)).unwrap();
        assert!((0..200).all(|_| s.sample(&logits) == 0));
    }

    #[test]
    fn a_sampler_and_its_draws_agree() {
        let logits: Vec<f32> = (0..40).map(|i| ((i * 11) % 17) as f32 * 0.2).collect();
        let p = params(0.9, 12, 0.95, 21);
        let mut local = Sampler::new(p.clone()).unwrap();
        let mut draws = Sampler::new(p.clone()).unwrap();
        for _ in 0..50 {
            let u = draws.next_uniform();
            assert_eq!(local.sample(&logits), sample_with(&p, &logits, u));
        }
    }

    #[test]
    fn logprob_is_log_softmax() {
        let lp = logprob(&[0.0, 3f32.ln()], 1);
        assert!((lp - 0.75f32.ln()).abs() < 1e-6, "{lp}");
    }

    /// Frequencies of `f(u, v, w)` over `n` seeded triples of draws.
    fn histogram(n: usize, vocab: usize, mut f: impl FnMut(f32, f32, f32) -> u32) -> Vec<f64> {
        let s = Sampler::new(params(1.0, 0, 1.0, 77)).unwrap();
        let mut h = vec![0.0; vocab];
        for i in 0..n as u64 {
            let t = f(
                s.uniform(i, Lane::Sample),
                s.uniform(i, Lane::Accept),
                s.uniform(i, Lane::Draft),
            );
            h[t as usize] += 1.0 / n as f64;
        }
        h
    }

    #[test]
    fn speculative_sampling_keeps_the_target_distribution() {
        let p_logits = [2.0, 1.0, 0.5, 0.0, -1.0, 1.5];
        let q_logits = [0.0, 2.0, 0.5, 1.0, 0.5, -2.0];
        let pp = params(1.0, 0, 1.0, 0);
        let p = Dist::new(&pp, &p_logits);
        // A draft sampling from its own top 4 (so p has mass the draft never proposes).
        let q = Dist::new(&pp, &q_logits).top(4);
        let n = 200_000;
        let h = histogram(n, 6, |u, a, d| verify(&p, q.pick(d), Some(&q), a, u));
        // An n-gram's certain proposal: the same token as plain sampling with that draw.
        let g = histogram(n, 6, |u, a, _| {
            let t = verify(&p, 3, None, a, u);
            assert_eq!(t, p.pick(u));
            t
        });
        for (id, want) in p.ids.iter().zip(&p.probs) {
            let want = *want as f64;
            let tol = 4.0 * (want * (1.0 - want) / n as f64).sqrt() + 1e-4;
            assert!(
                (h[*id as usize] - want).abs() < tol,
                "draft model, token {id}: {h:?} vs {p:?}"
            );
            assert!(
                (g[*id as usize] - want).abs() < tol,
                "n-gram, token {id}: {g:?} vs {p:?}"
            );
        }
    }

    #[test]
    fn greedy_verification_accepts_only_the_argmax() {
        let logits = [0.5, 3.0, 1.0];
        let p = Dist::new(&SamplingParams::default(), &logits);
        assert_eq!(p, Dist::point(1));
        assert_eq!(verify(&p, 1, None, 0.99, 0.0), 1);
        assert_eq!(verify(&p, 2, None, 0.0, 0.0), 1);
        let q = Dist::new(&params(1.0, 0, 1.0, 0), &[0.0, 0.0, 5.0]);
        assert_eq!(verify(&p, 2, Some(&q), 0.0, 0.7), 1);
    }

    #[test]
    fn draws_are_addressed_by_position_and_lane() {
        let a = Sampler::new(params(0.7, 0, 1.0, 5)).unwrap();
        let mut b = Sampler::new(params(0.7, 0, 1.0, 5)).unwrap();
        let seq: Vec<f32> = (0..5).map(|_| b.next_uniform()).collect();
        assert_eq!(
            seq,
            (0..5)
                .map(|i| a.uniform(i, Lane::Sample))
                .collect::<Vec<_>>()
        );
        assert_ne!(a.uniform(3, Lane::Sample), a.uniform(3, Lane::Accept));
        assert_ne!(a.uniform(3, Lane::Draft), a.uniform(4, Lane::Draft));
        assert!(seq.iter().all(|u| (0.0..1.0).contains(u)));
    }

    #[test]
    fn bad_params_are_refused() {
        assert!(Sampler::new(params(-1.0, 0, 1.0, 0)).is_err());
        assert!(Sampler::new(params(1.0, 0, 0.0, 0)).is_err());
        assert!(Sampler::new(params(1.0, 0, 1.5, 0)).is_err());
    }
}
