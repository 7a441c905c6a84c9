//! Drafters for speculative decoding: they propose the next tokens of a sequence, which the
//! ring then verifies in one pass. A proposal for a position depends only on the tokens
//! before it (and, for a sampling draft model, that position's draw), never on how many
//! tokens are drafted at once: so a seeded request gives the same output whatever `k`.

use std::collections::HashMap;
use std::fmt;

use pipeshard_generate::{Dist, SamplingParams, Tokenizer};
use pipeshard_model::{
    KvStore, LogitsWanted, SeqId, SeqStep, Stage, StageInput, StageOutput, StepBatch, Vocab,
};

/// The longest and shortest suffix an n-gram lookup matches.
const NGRAM_MAX: usize = 8;
const NGRAM_MIN: usize = 2;
/// A draft model proposes from its own `DRAFT_TOP_K` most likely tokens when sampling.
const DRAFT_TOP_K: usize = 16;
/// Longest prompt piece a draft model ingests in one forward pass.
const DRAFT_CHUNK: usize = 256;
/// Longest prompt piece it ingests in one forward pass while drafting ahead, so that the
/// scheduler, wanting the drafter, waits for at most that much (~0.2 s for the 0.5B).
pub const AHEAD_FEED: usize = 16;

/// One proposed token and the distribution it was drawn from (`None`: proposed with
/// certainty).
#[derive(Debug, Clone, PartialEq)]
pub struct Proposal {
    /// The token.
    pub token: u32,
    /// Its proposal distribution.
    pub q: Option<Dist>,
}

/// Prompt lookup: the token that followed the most recent earlier occurrence of the longest
/// suffix (of 2 to 8 tokens) of the context.
pub fn ngram_next(context: &[u32]) -> Option<u32> {
    let len = context.len();
    for n in (NGRAM_MIN..=NGRAM_MAX.min(len.saturating_sub(1))).rev() {
        let suffix = &context[len - n..];
        // Earlier occurrences end before the last token, so a continuation exists.
        if let Some(start) = (0..len - n).rev().find(|&j| &context[j..j + n] == suffix) {
            return Some(context[start + n]);
        }
    }
    None
}

/// A small model of the same tokenizer, run on the head: all its layers and one KV cache per
/// sequence, kept in step with the sequence's accepted tokens.
pub struct DraftModel {
    stage: Stage,
    kv: KvStore,
    /// Per sequence, the tokens its cache holds.
    cached: HashMap<u64, Vec<u32>>,
    /// Tokens fed through the model so far (all sequences).
    fed: usize,
    name: String,
    /// Score only ids below this, and the context's own tokens (`None`: the whole vocabulary).
    common: Option<usize>,
    /// Per sequence, its greedy choices remembered.
    chains: HashMap<u64, Chain>,
}

/// Greedy choices of a draft model: `tokens[i]` is its choice after `tokens[..i]`, for every
/// `i` from `from` on.
#[derive(Debug, Default)]
struct Chain {
    from: usize,
    tokens: Vec<u32>,
}

impl Chain {
    /// Whether `context` is a prefix of the chain whose next choice is (or may be) recorded.
    fn extends(&self, context: &[u32]) -> bool {
        (self.from..=self.tokens.len()).contains(&context.len()) && self.tokens.starts_with(context)
    }
}

/// How many leading tokens `a` and `b` share.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl DraftModel {
    /// A draft model: `stage` must hold every layer; `tokenizer` must be the target's.
    pub fn new(
        stage: Stage,
        tokenizer: &Tokenizer,
        target: &Tokenizer,
        name: &str,
    ) -> Result<Self, String> {
        if !stage.is_first() || !stage.is_last() {
            return Err(format!(
                "the draft model {name} must be whole (it holds layers {})",
                stage.range()
            ));
        }
        if let Some(why) = tokenizer_mismatch(tokenizer, target) {
            return Err(format!(
                "the draft model {name} cannot draft for this model: {why}"
            ));
        }
        Ok(Self {
            stage,
            kv: KvStore::new(),
            cached: HashMap::new(),
            fed: 0,
            name: name.to_string(),
            common: None,
            chains: HashMap::new(),
        })
    }

    /// Proposes only among the `common` lowest ids and the tokens already in the context
    /// (see [`Vocab`]); 0 scores the whole vocabulary.
    pub fn with_vocab(mut self, common: usize) -> Self {
        self.common = (common > 0 && common < self.stage.config().vocab).then_some(common);
        self
    }

    /// Tokens of `context` the cache lacks (after cutting it back to what they share).
    fn missing(&self, seq: u64, context: &[u32]) -> usize {
        let cached = self.cached.get(&seq).map_or(&[][..], |c| &c[..]);
        context.len() - common_prefix(cached, context)
    }

    /// Feeds the cache at most `max` more tokens of `context`, first cutting it back to what
    /// it shares with `context`; returns the logits after `context` once its last token has
    /// been fed (fed again if the cache already held it: its logits are not kept). `None`
    /// also when the model fails or `context` does not fit.
    fn feed(&mut self, seq: u64, context: &[u32], max: usize) -> Option<Vec<f32>> {
        if context.is_empty() || context.len() > self.stage.config().ctx_len {
            return None;
        }
        let cached = self.cached.entry(seq).or_default();
        let mut common = common_prefix(cached, context).min(context.len() - 1);
        cached.truncate(common);
        let end = context.len().min(common.saturating_add(max));
        // Which tokens to score matters only for the logits, after the context's last token.
        let vocab = self.common.filter(|_| end == context.len()).map(|below| {
            let mut extra: Vec<u32> = context
                .iter()
                .copied()
                .filter(|&t| t as usize >= below)
                .collect();
            extra.sort_unstable();
            extra.dedup();
            Vocab {
                common: below,
                extra,
            }
        });
        let mut logits = None;
        while common < end {
            let n = (end - common).min(DRAFT_CHUNK);
            let last = common + n == context.len();
            let batch = StepBatch {
                seqs: vec![SeqStep {
                    seq: SeqId(seq),
                    pos: common,
                    n,
                    logits: if last {
                        LogitsWanted::Last
                    } else {
                        LogitsWanted::None
                    },
                }],
                input: StageInput::Tokens(context[common..common + n].to_vec()),
            };
            match self
                .stage
                .forward_scoring(&batch, &mut self.kv, vocab.as_ref())
            {
                Ok(StageOutput::Logits(l)) if last => {
                    logits = l.into_iter().next().map(|l| l.row(0).to_vec());
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(seq, error = %e, "the draft model failed; not drafting");
                    self.release(seq);
                    return None;
                }
            }
            cached.extend_from_slice(&context[common..common + n]);
            self.fed += n;
            common += n;
        }
        logits
    }

    /// Logits for the position after `context`, after feeding the cache what it lacks.
    fn next_logits(&mut self, seq: u64, context: &[u32]) -> Option<Vec<f32>> {
        self.feed(seq, context, usize::MAX)
    }

    /// The greedy choice after `context`: remembered if drafted before (drafting ahead
    /// guesses a step's outcome, and the guess is right when every proposal is accepted and
    /// the target's next token is the draft's own), else computed and remembered.
    fn next_greedy(&mut self, seq: u64, context: &[u32]) -> Option<u32> {
        if let Some(chain) = self.chains.get(&seq) {
            if chain.extends(context) && context.len() < chain.tokens.len() {
                return Some(chain.tokens[context.len()]);
            }
        }
        let token = pipeshard_model::batch::argmax(&self.next_logits(seq, context)?);
        let chain = self.chains.entry(seq).or_default();
        if chain.extends(context) {
            chain.tokens.truncate(context.len());
        } else {
            chain.tokens = context.to_vec();
            chain.from = context.len();
        }
        chain.tokens.push(token);
        Some(token)
    }

    fn release(&mut self, seq: u64) {
        self.cached.remove(&seq);
        self.chains.remove(&seq);
        self.kv.release(SeqId(seq));
    }
}

/// Why a draft tokenizer cannot stand in for the target's, if it cannot.
fn tokenizer_mismatch(draft: &Tokenizer, target: &Tokenizer) -> Option<String> {
    if draft.vocab_size() != target.vocab_size() {
        return Some(format!(
            "its vocabulary has {} tokens, the target's {}",
            draft.vocab_size(),
            target.vocab_size()
        ));
    }
    if let Some(i) = (0..target.vocab_size() as u32).find(|&i| draft.token(i) != target.token(i)) {
        return Some(format!(
            "token {i} is {:?} there but {:?} in the target",
            draft.token(i).unwrap_or(""),
            target.token(i).unwrap_or("")
        ));
    }
    None
}

/// What proposes tokens.
pub enum Drafter {
    /// Prompt lookup.
    Ngram,
    /// A draft model.
    Model(Box<DraftModel>),
    /// Prompt lookup where it finds a match, the draft model elsewhere.
    Both(Box<DraftModel>),
}

impl fmt::Display for Drafter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ngram => write!(f, "ngram"),
            Self::Model(m) => write!(f, "{}", m.name),
            Self::Both(m) => write!(f, "ngram+{}", m.name),
        }
    }
}

impl Drafter {
    /// Up to `k` proposals for the positions after `context`; `uniforms[i]` is the draw for
    /// the i-th (a sampling draft model's choice). Stops early where there is nothing to
    /// propose.
    pub fn propose(
        &mut self,
        seq: u64,
        context: &[u32],
        k: usize,
        params: &SamplingParams,
        uniforms: &[f32],
    ) -> Vec<Proposal> {
        let mut ctx = context.to_vec();
        let mut out = Vec::with_capacity(k);
        for i in 0..k {
            let gram = match self {
                Self::Model(_) => None,
                _ => ngram_next(&ctx),
            };
            let p = match (gram, &mut *self) {
                (Some(token), _) => Proposal { token, q: None },
                (None, Self::Model(m) | Self::Both(m)) => {
                    if params.temperature <= 0.0 {
                        let Some(token) = m.next_greedy(seq, &ctx) else {
                            break;
                        };
                        Proposal { token, q: None }
                    } else {
                        let Some(logits) = m.next_logits(seq, &ctx) else {
                            break;
                        };
                        let q = Dist::new(params, &logits).top(DRAFT_TOP_K);
                        Proposal {
                            token: q.pick(uniforms.get(i).copied().unwrap_or(0.0)),
                            q: Some(q),
                        }
                    }
                }
                (None, Self::Ngram) => break,
            };
            ctx.push(p.token);
            out.push(p);
        }
        out
    }

    /// One piece of drafting ahead after `context`, taken as accepted: feeds the draft model
    /// at most [`AHEAD_FEED`] of its tokens, or drafts one greedy proposal and appends it.
    /// `false` when there is nothing to do (no draft model, nothing to propose).
    pub fn ahead_piece(&mut self, seq: u64, context: &mut Vec<u32>, greedy: bool) -> bool {
        let (Self::Model(m) | Self::Both(m)) = self else {
            return false;
        };
        if context.is_empty() || context.len() > m.stage.config().ctx_len {
            return false;
        }
        if m.missing(seq, context) > AHEAD_FEED {
            let before = m.fed;
            m.feed(seq, context, AHEAD_FEED);
            return m.fed > before;
        }
        if !greedy {
            // A sampling draft's choices depend on its draws: only its cache is kept current.
            if m.missing(seq, context) > 0 {
                m.feed(seq, context, AHEAD_FEED);
            }
            return false;
        }
        match self
            .propose(seq, context, 1, &SamplingParams::default(), &[])
            .pop()
        {
            Some(p) => {
                context.push(p.token);
                true
            }
            None => false,
        }
    }

    /// Moves a draft model's work to threads of the lowest priority on any core (see
    /// [`crate::lookahead`]); `false` when there is no draft model.
    pub fn use_idle_cores(&mut self) -> bool {
        let (Self::Model(m) | Self::Both(m)) = self else {
            return false;
        };
        if let Some(pool) = crate::lookahead::idle_pool(m.stage.threads()) {
            m.stage.set_thread_pool(std::sync::Arc::new(pool));
        }
        true
    }

    /// Forgets a sequence.
    pub fn release(&mut self, seq: u64) {
        if let Self::Model(m) | Self::Both(m) = self {
            m.release(seq);
        }
    }

    /// Tokens the draft model has fed through so far (0 without one). A call to
    /// [`Drafter::propose`] for `k` proposals feeds at most `2k` in steady state (the tokens
    /// accepted since the last call, then one per further proposal); more means it first read
    /// a prompt into its cache.
    pub fn fed(&self) -> usize {
        match self {
            Self::Model(m) | Self::Both(m) => m.fed,
            Self::Ngram => 0,
        }
    }
}

/// Proposal positions whose acceptance is tracked one by one (deeper ones take the last one's).
const POSITIONS: usize = 16;

/// How many steps' worth the pooled rate counts for in each position's estimate.
const SHRINK: f64 = 2.0;

/// How fast a sequence's acceptance counts fade (per step).
const FADE: f64 = 0.8;

/// A sequence's record of its proposals: totals (for usage reports) and decayed estimates of
/// how likely proposals are accepted (for the tuner), pooled and position by position.
#[derive(Debug, Clone, Copy, Default)]
pub struct Acceptance {
    /// Proposals sent.
    pub drafted: usize,
    /// Proposals accepted.
    pub accepted: usize,
    /// Decayed counts of proposals verified and accepted.
    verified_ema: f64,
    accepted_ema: f64,
    /// Per position `j` (0-based), decayed counts of steps that reached it (all proposals
    /// before it accepted) and of those that accepted it too.
    reached: [f64; POSITIONS],
    passed: [f64; POSITIONS],
}

impl Acceptance {
    /// Records a step's `proposals` and the `tokens` the target returned for them.
    pub fn observe(&mut self, proposals: &[u32], tokens: &[u32]) {
        let verified = proposals.len().min(tokens.len());
        let hits = tokens.iter().zip(proposals).filter(|(t, p)| t == p).count();
        let prefix = tokens
            .iter()
            .zip(proposals)
            .take_while(|(t, p)| t == p)
            .count();
        self.drafted += proposals.len();
        self.accepted += hits;
        if verified > 0 {
            self.verified_ema = FADE * self.verified_ema + verified as f64;
            self.accepted_ema = FADE * self.accepted_ema + hits as f64;
            for j in 0..POSITIONS {
                self.reached[j] *= FADE;
                self.passed[j] *= FADE;
                if j < verified && j <= prefix {
                    self.reached[j] += 1.0;
                    self.passed[j] += f64::from(u8::from(j < prefix));
                }
            }
        }
    }

    /// Probability that a proposal is accepted, estimated (0.5 before any).
    pub fn rate(&self) -> f64 {
        (self.accepted_ema + 1.0) / (self.verified_ema + 2.0)
    }

    /// Expected tokens from a step with `k` proposals: `1 + Σ_{j<k} Π_{i≤j} c_i`, with `c_i`
    /// position `i`'s rate given the earlier ones accepted (its own counts shrunk toward the
    /// pooled [`Acceptance::rate`]). Acceptance comes in runs (a drafter that gets a copied
    /// line's first token right usually gets the next ones too), so later positions' rates
    /// are typically above the pooled one; a geometric model with the pooled rate undervalued
    /// long drafts, and the tuner chose k = 1 where k = 4 ran faster.
    pub fn expected_tokens(&self, k: usize) -> f64 {
        let pooled = self.rate();
        let (mut survive, mut total) = (1.0, 1.0);
        for j in 0..k {
            let i = j.min(POSITIONS - 1);
            let c = (self.passed[i] + SHRINK * pooled) / (self.reached[i] + SHRINK);
            survive *= c.clamp(0.0, 0.99);
            total += survive;
        }
        total
    }

    /// Whether steps have lately reached position `j` (0-based) often enough to estimate it.
    pub fn knows(&self, j: usize) -> bool {
        self.reached[j.min(POSITIONS - 1)] >= 1.0
    }

    /// A fresh record (no totals) whose estimate starts from this one's, weighing at most
    /// [`PRIOR_WEIGHT`] proposals, so that the sequence's own proposals soon dominate.
    pub fn as_prior(&self) -> Self {
        let w = (PRIOR_WEIGHT / self.verified_ema.max(PRIOR_WEIGHT)).min(1.0);
        Self {
            verified_ema: self.verified_ema * w,
            accepted_ema: self.accepted_ema * w,
            reached: self.reached.map(|v| v * w),
            passed: self.passed.map(|v| v * w),
            ..Self::default()
        }
    }

    /// A record whose pooled rate is about `alpha`, with no positional data (for tests).
    #[cfg(test)]
    pub fn pooled(alpha: f64) -> Self {
        Self {
            verified_ema: 1000.0,
            accepted_ema: alpha * 1002.0 - 1.0,
            ..Self::default()
        }
    }
}

/// How many proposals' worth the head's recent acceptance counts for in a new sequence's
/// estimate.
pub const PRIOR_WEIGHT: f64 = 4.0;

/// Chooses how many tokens to draft for a sequence: the `k` that maximizes expected tokens
/// per unit of time, from the sequence's acceptance rate, the measured cost of a step as a
/// function of its rows (a decayed least-squares line) and the measured cost of drafting.
#[derive(Debug, Clone)]
pub struct Tuner {
    /// A fixed `k`, or `None` to adapt.
    fixed: Option<usize>,
    /// The largest `k` tried when adapting.
    max: usize,
    /// Decayed sums for the line `step_us = a + b * rows`: n, Σx, Σy, Σx², Σxy.
    sums: [f64; 5],
    /// Drafting time per proposal, µs (moving average).
    draft_us: Option<f64>,
    /// Proposals accepted across all sequences: a new sequence's starting estimate, so it
    /// drafts from its first step as much as the drafter has lately earned (starting from
    /// 0.5 made short requests spend their first tokens undrafted).
    seen: Acceptance,
}

/// How fast old observations fade (per observation).
const DECAY: f64 = 0.97;

/// What the rest of a step carries, for [`Tuner::choose_among`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Others {
    /// Input rows.
    pub rows: usize,
    /// Tokens they are expected to yield.
    pub tokens: f64,
}

impl Tuner {
    /// A tuner: `fixed` pins `k`; otherwise it adapts between 0 and `max`.
    pub fn new(fixed: Option<usize>, max: usize) -> Self {
        Self {
            fixed,
            max,
            sums: [0.0; 5],
            draft_us: None,
            seen: Acceptance::default(),
        }
    }

    /// A step verified `proposals` of some sequence and the target returned `tokens`.
    pub fn observe_acceptance(&mut self, proposals: &[u32], tokens: &[u32]) {
        self.seen.observe(proposals, tokens);
    }

    /// The acceptance record a new sequence starts with.
    pub fn prior(&self) -> Acceptance {
        self.seen.as_prior()
    }

    /// A step of `rows` rows took `us` of its own: from sending to its result, less the time
    /// it waited at stages behind other steps.
    pub fn observe_step(&mut self, rows: usize, us: f64) {
        let x = rows as f64;
        let [n, sx, sy, sxx, sxy] = &mut self.sums;
        for (s, v) in [(n, 1.0), (sx, x), (sy, us), (sxx, x * x), (sxy, x * us)] {
            *s = *s * DECAY + v;
        }
    }

    /// Steps the line was fitted to (decayed).
    #[cfg(test)]
    pub fn steps_seen(&self) -> f64 {
        self.sums[0]
    }

    /// The mean time of the steps the line was fitted to.
    #[cfg(test)]
    pub fn mean_step_us(&self) -> f64 {
        self.sums[2] / self.sums[0]
    }

    /// Drafting `proposals` tokens took `us`, the draft model feeding `fed` tokens (0 for
    /// prompt lookup). More than two per proposal means it first read a prompt into its cache
    /// (see [`Drafter::fed`]): a one-time cost, not a proposal's, so not counted (counted, it
    /// made the tuner stop drafting for the rest of the request).
    pub fn observe_draft(&mut self, proposals: usize, fed: usize, us: f64) {
        if proposals == 0 || fed > 2 * proposals {
            return;
        }
        let per = us / proposals as f64;
        self.draft_us = Some(self.draft_us.map_or(per, |d| 0.8 * d + 0.2 * per));
    }

    /// The step line (a, b): a fixed cost and a cost per row. Until rows vary enough to fit
    /// it (a standard deviation of at least one row), a row is taken to cost a quarter of the
    /// fixed part: a line fitted to, say, 4- and 5-row steps alone extrapolates noise to one
    /// row, and a too-cheap one-row step made the tuner stop drafting.
    fn line(&self) -> (f64, f64) {
        let [n, sx, sy, sxx, sxy] = self.sums;
        if n < 1.0 {
            return (1.0, 0.25);
        }
        let var = n * sxx - sx * sx;
        let (mx, my) = (sx / n, sy / n);
        if var < n * n {
            // Row counts too close together: split their mean as the prior does.
            let a = my / (1.0 + 0.25 * mx);
            return (a, 0.25 * a);
        }
        let b = ((n * sxy - sx * sy) / var).max(0.0);
        ((my - b * mx).max(0.0), b)
    }

    /// The `k` for a sequence with the acceptance record `acc`, alone in its step.
    pub fn choose(&self, acc: &Acceptance) -> usize {
        self.choose_among(acc, Others::default())
    }

    /// The `k` for a sequence with the acceptance record `acc` in a step that also carries
    /// `others`: the one that makes the whole step yield the most tokens per second. A step
    /// shared by several sequences already spreads its fixed cost over their tokens, so a
    /// proposal must pay for its row out of its own acceptance: with 4 sequences in a
    /// compute-bound step, drafting for each as if alone (k=2..4) cut 8 users' throughput
    /// from 2.91x to 2.37-2.54x. When the best `k`'s next position has not been reached
    /// lately, one more is drafted to learn its rate (else a tuner that settled on a short
    /// draft would never see how often longer ones pay).
    pub fn choose_among(&self, acc: &Acceptance, others: Others) -> usize {
        if let Some(k) = self.fixed {
            return k;
        }
        let (a, b) = self.line();
        let d = self.draft_us.unwrap_or(0.0);
        let rate = |k: usize| {
            (others.tokens + acc.expected_tokens(k))
                / (a + b * (others.rows + k + 1) as f64 + d * k as f64)
        };
        let best = (0..=self.max)
            .max_by(|&x, &y| rate(x).total_cmp(&rate(y)).then(y.cmp(&x)))
            .unwrap_or(0);
        let k = if best > 0 && best < self.max && !acc.knows(best) {
            best + 1
        } else {
            best
        };
        tracing::debug!(
            alpha = acc.rate(),
            step_us = a,
            row_us = b,
            draft_us = d,
            other_rows = others.rows,
            k,
            "draft length"
        );
        k
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn ngram_continues_the_longest_most_recent_match() {
        // "1 2 3 9 ... 1 2 3 7 ... 2 3" → suffix [2 3] last seen before "7".
        assert_eq!(ngram_next(&[1, 2, 3, 9, 5, 1, 2, 3, 7, 4, 2, 3]), Some(7));
        // The longer suffix [1 2 3] wins over the more recent [2 3].
        assert_eq!(ngram_next(&[1, 2, 3, 9, 5, 2, 3, 7, 4, 1, 2, 3]), Some(9));
        assert_eq!(ngram_next(&[1, 2, 3, 4]), None);
        assert_eq!(ngram_next(&[5]), None);
        assert_eq!(ngram_next(&[]), None);
    }

    #[test]
    fn the_tuner_drafts_more_when_more_is_accepted_and_rows_are_cheap() {
        let mut t = Tuner::new(None, 10);
        // Steps cost 100 ms plus 10 ms a row.
        for rows in [1, 2, 4, 8, 1, 3, 6] {
            t.observe_step(rows, 100_000.0 + 10_000.0 * rows as f64);
        }
        let (a, b) = t.line();
        assert!(
            (a - 100_000.0).abs() < 1.0 && (b - 10_000.0).abs() < 1.0,
            "{a} {b}"
        );
        assert_eq!(t.choose(&Acceptance::pooled(0.0)), 0);
        assert!(t.choose(&Acceptance::pooled(0.5)) >= 1);
        assert!(t.choose(&Acceptance::pooled(0.9)) > t.choose(&Acceptance::pooled(0.5)));
        // Reading a prompt into the draft model's cache is not a proposal's cost.
        let k = t.choose(&Acceptance::pooled(0.7));
        t.observe_draft(1, 40, 2_000_000.0);
        assert_eq!(t.choose(&Acceptance::pooled(0.7)), k);
        // Costly drafting (a whole step per proposal) does not pay.
        t.observe_draft(4, 8, 4.0 * 200_000.0);
        assert_eq!(t.choose(&Acceptance::pooled(0.7)), 0);
        assert_eq!(Tuner::new(Some(3), 10).choose(&Acceptance::pooled(0.0)), 3);
    }

    #[test]
    fn a_shared_step_drafts_less_and_a_costly_row_not_at_all() {
        let line = |a: f64, b: f64| {
            let mut t = Tuner::new(None, 10);
            for rows in [1, 2, 4, 8, 1, 3, 6] {
                t.observe_step(rows, a + b * rows as f64);
            }
            t
        };
        let acc = Acceptance::pooled(0.7);
        let three = Others {
            rows: 3,
            tokens: 3.0,
        };
        // A cheap row (memory-bound steps): worth drafting alone and among others, less so
        // among others (alone k=3 beats k=2, 2.53/100 against 2.19/90; in the step of four
        // it loses, 5.53/130 against 5.19/120).
        let t = line(60_000.0, 10_000.0);
        let (alone, among) = (t.choose(&acc), t.choose_among(&acc, three));
        assert!(among >= 1 && among < alone, "{among} {alone}");
        // A costly row (compute-bound steps): drafting pays alone, not in a step of four.
        let t = line(60_000.0, 40_000.0);
        assert!(t.choose(&acc) >= 1);
        assert_eq!(t.choose_among(&acc, three), 0);
    }

    #[test]
    fn acceptance_in_runs_makes_longer_drafts_pay() {
        // A drafter whose first proposal is often wrong but whose later ones, once the first
        // is right, always are (a copied line).
        let mut runs = Acceptance::default();
        for step in 0..12 {
            if step % 3 == 0 {
                runs.observe(&[1], &[9]);
            } else {
                runs.observe(&[1], &[1, 7]);
            }
        }
        for _ in 0..4 {
            runs.observe(&[1, 2, 3], &[1, 2, 3, 4]);
        }
        let flat = Acceptance::pooled(runs.rate());
        assert!((flat.rate() - runs.rate()).abs() < 1e-3);
        assert!(
            runs.expected_tokens(3) > flat.expected_tokens(3) + 0.2,
            "{} vs {} (rate {})",
            runs.expected_tokens(3),
            flat.expected_tokens(3),
            runs.rate()
        );
        // Steps cost 85 ms plus 27 ms a row, drafting 47 ms a proposal (as measured with the
        // 0.5B drafter on a two-stage ring).
        let mut t = Tuner::new(None, 10);
        for rows in [1, 5, 1, 5, 2, 3] {
            t.observe_step(rows, 85_000.0 + 27_000.0 * rows as f64);
        }
        t.observe_draft(1, 2, 47_000.0);
        assert!(
            t.choose(&runs) > t.choose(&flat),
            "{} vs {}",
            t.choose(&runs),
            t.choose(&flat)
        );
        // A position never reached lately is explored: one more than the best guess.
        let k = t.choose(&flat);
        assert!(!flat.knows(k - 1) && k >= 2);
    }

    #[test]
    fn a_line_is_not_fitted_to_row_counts_close_together() {
        // Only 4- and 5-row steps, the 5-row ones slower by noise: fitted, the line would
        // put a one-row step at nothing and never draft.
        let mut t = Tuner::new(None, 10);
        for _ in 0..10 {
            t.observe_step(4, 200_000.0);
            t.observe_step(5, 260_000.0);
        }
        let (a, b) = t.line();
        assert!(a > 100_000.0 && b < a, "{a} {b}");
        t.observe_draft(4, 8, 4.0 * 40_000.0);
        assert!(
            t.choose(&Acceptance::pooled(0.88)) >= 2,
            "{}",
            t.choose(&Acceptance::pooled(0.88))
        );
    }

    #[test]
    fn new_sequences_start_from_the_heads_recent_acceptance() {
        let mut t = Tuner::new(None, 10);
        assert_eq!(t.prior().rate(), 0.5);
        for _ in 0..20 {
            t.observe_acceptance(&[1, 2, 3, 4], &[1, 2, 3, 4, 5]);
        }
        let prior = t.prior();
        assert!(prior.rate() > 0.8, "{}", prior.rate());
        assert_eq!((prior.drafted, prior.accepted), (0, 0));
        // It weighs a few proposals: the sequence's own soon outweigh it.
        let mut own = prior;
        for _ in 0..3 {
            own.observe(&[1, 2, 3, 4], &[9, 9, 9, 9, 9]);
        }
        assert!(own.rate() < 0.3, "{}", own.rate());
    }

    /// On a tiny model: a different tiny model drafts (sampling from its top 16), the
    /// target verifies; the tokens chosen at a position follow the target's distribution.
    #[test]
    fn verified_draft_model_tokens_follow_the_target_distribution() {
        use pipeshard_generate::{verify, Lane, Sampler, TextModel};
        use pipeshard_model::gguf::GgufFile;
        use pipeshard_testkit::{tiny_model, Flavour};

        let tmp = tempfile::tempdir().unwrap();
        let target_path = tiny_model(tmp.path(), Flavour::Llama, 1);
        let draft_path = tiny_model(tmp.path(), Flavour::Llama, 2);
        let text = TextModel::from_gguf(&GgufFile::open(&target_path).unwrap().content).unwrap();
        let target = Stage::load(&target_path, None).unwrap();
        let draft = Stage::load(&draft_path, None).unwrap();
        let mut drafter = Drafter::Model(Box::new(
            DraftModel::new(draft, &text.tokenizer, &text.tokenizer, "tiny").unwrap(),
        ));
        let context = [259u32, 72, 101, 108, 108, 111];
        // High temperature, so that many tokens have weight.
        let params = SamplingParams {
            temperature: 3.0,
            top_k: 0,
            top_p: 1.0,
            seed: Some(11),
        };
        let batch = StepBatch {
            seqs: vec![SeqStep {
                seq: SeqId(1),
                pos: 0,
                n: context.len(),
                logits: LogitsWanted::Last,
            }],
            input: StageInput::Tokens(context.to_vec()),
        };
        let Ok(StageOutput::Logits(l)) = target.forward(&batch, &mut KvStore::new()) else {
            panic!("no logits");
        };
        let p = Dist::new(&params, l[0].row(0));
        let draws = Sampler::new(params.clone()).unwrap();
        let n = 20_000;
        let mut hist: HashMap<u32, f64> = HashMap::new();
        let mut accepted = 0;
        let q = drafter.propose(1, &context, 1, &params, &[0.5]).remove(0).q;
        // The first proposal read the prompt: more than two tokens fed for one proposal.
        assert_eq!(drafter.fed(), context.len());
        let q = q.expect("a sampling draft model sends q");
        assert_eq!(q.ids.len(), DRAFT_TOP_K);
        for i in 0..n as u64 {
            let u = draws.uniform(i, Lane::Draft);
            // The drafter's choice is its q at its draw (checked now and then: each
            // proposal costs a forward pass).
            let token = q.pick(u);
            if i % 1000 == 0 {
                let fed = drafter.fed();
                assert_eq!(
                    drafter.propose(1, &context, 1, &params, &[u])[0].token,
                    token
                );
                // Later ones only feed the last token again.
                assert_eq!(drafter.fed() - fed, 1);
            }
            let (a, s) = (
                draws.uniform(i, Lane::Accept),
                draws.uniform(i, Lane::Sample),
            );
            let t = verify(&p, token, Some(&q), a, s);
            accepted += usize::from(t == token);
            *hist.entry(t).or_default() += 1.0 / n as f64;
        }
        // Every token's frequency within 4.5 standard deviations of its probability, and
        // the total variation small.
        let mut tv = 0.0;
        for (id, want) in p.ids.iter().zip(&p.probs) {
            let got = hist.get(id).copied().unwrap_or(0.0);
            let want = *want as f64;
            let sd = (want * (1.0 - want) / n as f64).sqrt();
            assert!(
                (got - want).abs() < 4.5 * sd + 1e-4,
                "token {id}: {got} vs {want}"
            );
            tv += (got - want).abs() / 2.0;
        }
        assert!(tv < 0.05, "total variation {tv}");
        // The draft is not the target: some proposals were rejected, some accepted.
        assert!(accepted > 0 && accepted < n, "{accepted}");
    }

    /// A whole tiny model as a drafter for itself (same tokenizer).
    pub(crate) fn tiny_drafter(dir: &std::path::Path, common: usize) -> Drafter {
        use pipeshard_generate::TextModel;
        use pipeshard_model::gguf::GgufFile;
        use pipeshard_testkit::{tiny_model, Flavour};
        let path = tiny_model(dir, Flavour::Llama, 2);
        let text = TextModel::from_gguf(&GgufFile::open(&path).unwrap().content).unwrap();
        let stage = Stage::load(&path, None).unwrap();
        let m = DraftModel::new(stage, &text.tokenizer, &text.tokenizer, "tiny").unwrap();
        Drafter::Model(Box::new(m.with_vocab(common)))
    }

    /// `k` greedy proposals for sequence `seq` after `context`.
    pub(crate) fn greedy(d: &mut Drafter, seq: u64, context: &[u32], k: usize) -> Vec<u32> {
        d.propose(seq, context, k, &SamplingParams::default(), &[])
            .into_iter()
            .map(|p| p.token)
            .collect()
    }

    #[test]
    fn drafting_ahead_remembers_exactly_what_drafting_would_propose() {
        let tmp = tempfile::tempdir().unwrap();
        let prompt: Vec<u32> = (0..40).map(|i| 100 + (i * 7) % 50).collect();
        for common in [0, 64] {
            let mut ahead = tiny_drafter(tmp.path(), common);
            // Read the prompt in pieces, then draft five past it.
            let mut ctx = prompt.clone();
            let mut pieces = 0;
            while ctx.len() < prompt.len() + 5 {
                assert!(ahead.ahead_piece(1, &mut ctx, true));
                pieces += 1;
            }
            assert!(pieces > 5, "the prompt is read a piece at a time");
            let chain = ctx[prompt.len()..].to_vec();
            assert_eq!(
                greedy(&mut tiny_drafter(tmp.path(), common), 1, &prompt, 5),
                chain
            );
            // The target chose the draft's first two: the next three cost no forward pass.
            let mut hit = prompt.clone();
            hit.extend(&chain[..2]);
            let fed = ahead.fed();
            assert_eq!(greedy(&mut ahead, 1, &hit, 3), chain[2..]);
            assert_eq!(ahead.fed(), fed);
            // It chose another second token: computed afresh, the same as without the chain.
            let mut miss = prompt.clone();
            miss.extend([chain[0], chain[1] ^ 1]);
            let want = greedy(&mut tiny_drafter(tmp.path(), common), 1, &miss, 3);
            assert_eq!(greedy(&mut ahead, 1, &miss, 3), want);
            assert!(ahead.fed() > fed);
        }
    }

    #[test]
    fn ngram_chains_are_per_position() {
        let ctx = [10, 11, 12, 13, 14, 15, 10, 11];
        let mut d = Drafter::Ngram;
        let p = d.propose(1, &ctx, 3, &SamplingParams::default(), &[]);
        let tokens: Vec<u32> = p.iter().map(|p| p.token).collect();
        assert_eq!(tokens, [12, 13, 14]);
        // Each is what a one-token proposal gives after the previous ones.
        let mut longer = ctx.to_vec();
        longer.extend([12, 13]);
        assert_eq!(
            d.propose(1, &longer, 1, &SamplingParams::default(), &[])[0].token,
            14
        );
        assert!(p.iter().all(|p| p.q.is_none()));
    }
}
