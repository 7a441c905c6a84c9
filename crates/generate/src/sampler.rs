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

/// A sampler with its own random state.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    /// A sampler; fails on out-of-range parameters.
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Ok(Self { params, rng })
    }

    /// Picks a token.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature <= 0.0 {
            return sample_with(&self.params, logits, 0.0);
        }
        let u: f32 = self.rng.random();
        sample_with(&self.params, logits, u)
    }

    /// The next uniform draw, for a sampler that runs elsewhere (the ring's last stage);
    /// [`sample_with`] on that draw picks what [`Sampler::sample`] would have.
    pub fn next_uniform(&mut self) -> f32 {
        if self.params.temperature <= 0.0 {
            return 0.0;
        }
        self.rng.random()
    }
}

/// Picks a token from `logits` with the uniform draw `u` in [0, 1): pure, so the draw can be
/// made on the head and the choice on the last stage.
pub fn sample_with(params: &SamplingParams, logits: &[f32], u: f32) -> u32 {
    if params.temperature <= 0.0 {
        return pipeshard_model::batch::argmax(logits);
    }
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    // Highest logit first, lowest id on ties: a fixed order.
    idx.sort_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    if params.top_k > 0 {
        idx.truncate(params.top_k);
    }
    let max = logits[idx[0] as usize];
    let mut probs: Vec<f32> = idx
        .iter()
        .map(|&i| ((logits[i as usize] - max) / params.temperature).exp())
        .collect();
    let sum: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= sum);
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
        let s: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= s);
    }
    let mut acc = 0.0;
    for (i, p) in probs.iter().enumerate() {
        acc += p;
        if u < acc {
            return idx[i];
        }
    }
    idx[probs.len() - 1]
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

    #[test]
    fn bad_params_are_refused() {
        assert!(Sampler::new(params(-1.0, 0, 1.0, 0)).is_err());
        assert!(Sampler::new(params(1.0, 0, 0.0, 0)).is_err());
        assert!(Sampler::new(params(1.0, 0, 1.5, 0)).is_err());
    }
}
