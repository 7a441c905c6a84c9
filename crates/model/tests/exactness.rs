//! The invariant: greedy tokens (and the logits behind them, bit for bit) are the same for the
//! unsplit model, any split into 1..4 stages, and any batch composition.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use pipeshard_model::KvStore;
use pipeshard_model::{
    LayerRange, LocalPipeline, LogitsWanted, SeqId, SeqLogits, SeqStep, Stage, StageInput,
    StageOutput, StepBatch, TokenId, Vocab,
};
use pipeshard_testkit::{tiny_k_model, tiny_model, Flavour, VOCAB};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const GEN: usize = 6;

struct Chain {
    stages: Vec<Stage>,
    kvs: Vec<KvStore>,
}

impl Chain {
    fn new(path: &Path, ranges: &[LayerRange]) -> Self {
        let stages: Vec<Stage> = ranges
            .iter()
            .map(|r| Stage::load(path, Some(*r)).unwrap())
            .collect();
        let kvs = ranges.iter().map(|_| KvStore::new()).collect();
        Self { stages, kvs }
    }

    fn step(&mut self, seqs: Vec<SeqStep>, tokens: Vec<TokenId>) -> Vec<SeqLogits> {
        let mut input = StageInput::Tokens(tokens);
        for (stage, kv) in self.stages.iter().zip(&mut self.kvs) {
            let batch = StepBatch {
                seqs: seqs.clone(),
                input,
            };
            match stage.forward(&batch, kv).unwrap() {
                StageOutput::Hidden(h) => input = StageInput::Hidden(h),
                StageOutput::Logits(l) => return l,
            }
        }
        unreachable!("last stage returns logits")
    }
}

/// Each sequence alone, prompt in one pass, then one token a step: the reference.
fn reference(path: &Path, prompts: &[Vec<TokenId>]) -> Vec<(Vec<TokenId>, Vec<Vec<u32>>)> {
    let mut chain = Chain::new(path, &[LayerRange::new(0, 6)]);
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let seq = SeqId(i as u64);
            let mut out = Vec::new();
            let mut bits = Vec::new();
            let mut pos = 0;
            let mut input = p.clone();
            for _ in 0..GEN {
                let l = chain.step(
                    vec![SeqStep {
                        seq,
                        pos,
                        n: input.len(),
                        logits: LogitsWanted::Last,
                    }],
                    input.clone(),
                );
                let t = l[0].argmax()[0];
                bits.push(l[0].data.iter().map(|x| x.to_bits()).collect());
                pos += input.len();
                out.push(t);
                input = vec![t];
            }
            (out, bits)
        })
        .collect()
}

/// Sequences advance in random groups, prompts fed in random chunks, decode rows mixed with
/// prefill rows in one pass.
fn batched(
    path: &Path,
    ranges: &[LayerRange],
    prompts: &[Vec<TokenId>],
    seed: u64,
) -> Vec<(Vec<TokenId>, Vec<Vec<u32>>)> {
    let mut chain = Chain::new(path, ranges);
    let mut rng = StdRng::seed_from_u64(seed);
    struct St {
        fed: usize,
        pending: Vec<TokenId>,
        out: Vec<TokenId>,
        bits: Vec<Vec<u32>>,
    }
    let mut st: Vec<St> = prompts
        .iter()
        .map(|p| St {
            fed: 0,
            pending: p.clone(),
            out: vec![],
            bits: vec![],
        })
        .collect();
    while st.iter().any(|s| s.out.len() < GEN) {
        let mut seqs = Vec::new();
        let mut tokens = Vec::new();
        for (i, s) in st.iter().enumerate() {
            if s.out.len() >= GEN || rng.random_bool(0.3) {
                continue;
            }
            let n = rng.random_range(1..=s.pending.len());
            let last = n == s.pending.len();
            seqs.push(SeqStep {
                seq: SeqId(i as u64),
                pos: s.fed,
                n,
                logits: if last {
                    LogitsWanted::Last
                } else {
                    LogitsWanted::None
                },
            });
            tokens.extend_from_slice(&s.pending[..n]);
        }
        if seqs.is_empty() {
            continue;
        }
        let logits: HashMap<SeqId, SeqLogits> = chain
            .step(seqs.clone(), tokens)
            .into_iter()
            .map(|l| (l.seq, l))
            .collect();
        for s in &seqs {
            let e = &mut st[s.seq.0 as usize];
            e.pending.drain(..s.n);
            e.fed += s.n;
            if let Some(l) = logits.get(&s.seq) {
                let t = l.argmax()[0];
                e.bits.push(l.data.iter().map(|x| x.to_bits()).collect());
                e.out.push(t);
                e.pending = vec![t];
            }
        }
    }
    st.into_iter().map(|s| (s.out, s.bits)).collect()
}

fn models() -> &'static [(Flavour, PathBuf)] {
    static M: std::sync::OnceLock<(tempfile::TempDir, Vec<(Flavour, PathBuf)>)> =
        std::sync::OnceLock::new();
    &M.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        // Each flavour as written, and with its MLP's down projection in Q4_K / Q6_K.
        let v = [Flavour::Llama, Flavour::Qwen2]
            .into_iter()
            .flat_map(|f| {
                [
                    (f, tiny_model(dir.path(), f, 11)),
                    (f, tiny_k_model(dir.path(), f, 11)),
                ]
            })
            .collect();
        (dir, v)
    })
    .1
}

fn split_strategy() -> impl Strategy<Value = Vec<LayerRange>> {
    // Cut points inside 1..6, 0 to 3 of them: 1..4 stages.
    proptest::collection::btree_set(1usize..6, 0..=3).prop_map(|cuts| {
        let mut bounds = vec![0];
        bounds.extend(cuts);
        bounds.push(6);
        bounds
            .windows(2)
            .map(|w| LayerRange::new(w[0], w[1]))
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn any_split_and_batching_matches_unsplit(
        llama in any::<bool>(),
        prompts in proptest::collection::vec(
            proptest::collection::vec(0..VOCAB as u32, 1..20), 1..=8),
        ranges in split_strategy(),
        seed in any::<u64>(),
    ) {
        let (_, path) = &models()[usize::from(!llama)];
        let want = reference(path, &prompts);
        let got = batched(path, &ranges, &prompts, seed);
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            prop_assert_eq!(&w.0, &g.0, "tokens of sequence {} with split {:?}", i, ranges);
            prop_assert!(w.1 == g.1, "logit bits of sequence {} with split {:?}", i, ranges);
        }
    }
}

#[test]
fn verification_rows_equal_one_token_steps() {
    // Logits at all k+1 positions of one pass equal those of k+1 single-token steps.
    for (_, path) in models() {
        let prompt: Vec<TokenId> = (0..9).map(|i| (i * 37 % VOCAB) as u32).collect();
        let mut a = Chain::new(path, &[LayerRange::new(0, 3), LayerRange::new(3, 6)]);
        let all = a.step(
            vec![SeqStep {
                seq: SeqId(1),
                pos: 0,
                n: 9,
                logits: LogitsWanted::All,
            }],
            prompt.clone(),
        );
        let mut b = Chain::new(path, &[LayerRange::new(0, 6)]);
        for (i, &t) in prompt.iter().enumerate() {
            let one = b.step(
                vec![SeqStep {
                    seq: SeqId(1),
                    pos: i,
                    n: 1,
                    logits: LogitsWanted::Last,
                }],
                vec![t],
            );
            assert_eq!(one[0].data, all[0].row(i), "row {i}");
        }
    }
}

#[test]
fn truncation_rolls_back() {
    // Feeding wrong tokens, then re-feeding at an earlier pos, equals never having fed them.
    let (_, path) = &models()[0];
    let mut a = Chain::new(path, &[LayerRange::new(0, 2), LayerRange::new(2, 6)]);
    let s = |pos, n| {
        vec![SeqStep {
            seq: SeqId(0),
            pos,
            n,
            logits: LogitsWanted::Last,
        }]
    };
    a.step(s(0, 4), vec![1, 2, 3, 4]);
    a.step(s(4, 3), vec![9, 9, 9]);
    let rolled = a.step(s(4, 1), vec![5]);
    let mut b = Chain::new(path, &[LayerRange::new(0, 6)]);
    let clean = b.step(s(0, 5), vec![1, 2, 3, 4, 5]);
    assert_eq!(rolled[0].data, clean[0].data);
}

#[test]
fn local_pipeline_matches_chain_and_threads() {
    let (_, path) = &models()[1];
    let ranges = LayerRange::even_split(6, 3);
    let stages = ranges
        .iter()
        .map(|r| {
            let mut s = Stage::load(path, Some(*r)).unwrap();
            s.set_threads(2).unwrap();
            s
        })
        .collect();
    let pipe = LocalPipeline::new(stages).unwrap();
    let seqs = vec![
        SeqStep {
            seq: SeqId(0),
            pos: 0,
            n: 5,
            logits: LogitsWanted::All,
        },
        SeqStep {
            seq: SeqId(1),
            pos: 0,
            n: 2,
            logits: LogitsWanted::Last,
        },
    ];
    let tokens = vec![1, 2, 3, 4, 5, 6, 7];
    let got = pipe.step(seqs.clone(), tokens.clone()).unwrap();
    let mut chain = Chain::new(path, &[LayerRange::new(0, 6)]);
    assert_eq!(got, chain.step(seqs, tokens));
    pipe.release(SeqId(0));
    // A bad step gets an error and the pipeline keeps serving.
    let bad = pipe.step(
        vec![SeqStep {
            seq: SeqId(1),
            pos: 7,
            n: 1,
            logits: LogitsWanted::Last,
        }],
        vec![1],
    );
    assert!(bad.unwrap_err().to_string().contains("only 2 are cached"));
    let ok = pipe.step(
        vec![SeqStep {
            seq: SeqId(1),
            pos: 2,
            n: 1,
            logits: LogitsWanted::Last,
        }],
        vec![1],
    );
    assert!(ok.is_ok());
}

#[test]
fn bad_batches_are_refused() {
    let (_, path) = &models()[0];
    let stage = Stage::load(path, Some(LayerRange::new(0, 3))).unwrap();
    let mut kv = KvStore::new();
    let one = |pos, n| SeqStep {
        seq: SeqId(0),
        pos,
        n,
        logits: LogitsWanted::Last,
    };
    let cases: Vec<(StepBatch, &str)> = vec![
        (
            StepBatch {
                seqs: vec![one(0, 2)],
                input: StageInput::Tokens(vec![1]),
            },
            "1 tokens for 2 rows",
        ),
        (
            StepBatch {
                seqs: vec![one(0, 1)],
                input: StageInput::Tokens(vec![VOCAB as u32]),
            },
            "outside vocabulary",
        ),
        (
            StepBatch {
                seqs: vec![one(3, 1)],
                input: StageInput::Tokens(vec![1]),
            },
            "only 0 are cached",
        ),
        (
            StepBatch {
                seqs: vec![one(0, 1), one(1, 1)],
                input: StageInput::Tokens(vec![1, 2]),
            },
            "appears twice",
        ),
        (
            StepBatch {
                seqs: vec![one(0, 1)],
                input: StageInput::Hidden(vec![0.0; 64]),
            },
            "takes tokens",
        ),
        (
            StepBatch {
                seqs: vec![one(250, 10)],
                input: StageInput::Tokens(vec![1; 10]),
            },
            "only 0",
        ),
        (
            StepBatch {
                seqs: vec![],
                input: StageInput::Tokens(vec![]),
            },
            "no sequences",
        ),
    ];
    for (batch, msg) in cases {
        let err = stage.forward(&batch, &mut kv).unwrap_err().to_string();
        assert!(err.contains(msg), "{err} should say {msg}");
    }
    assert!(kv.is_empty(), "refused batches leave no cache behind");
    let err = Stage::load(path, Some(LayerRange::new(2, 9)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("2..9"), "{err}");
}

#[test]
fn a_scored_part_of_the_vocabulary_keeps_its_logits() {
    // Both flavours: tied Q8_0 embeddings (llama) and a separate output weight (qwen2).
    for (_, path) in models().iter().step_by(2) {
        let stage = Stage::load(path, None).unwrap();
        let batch = StepBatch {
            seqs: vec![SeqStep {
                seq: SeqId(0),
                pos: 0,
                n: 3,
                logits: LogitsWanted::All,
            }],
            input: StageInput::Tokens(vec![7, 70, 140]),
        };
        let logits = |vocab: Option<&Vocab>| match stage
            .forward_scoring(&batch, &mut KvStore::new(), vocab)
            .unwrap()
        {
            StageOutput::Logits(mut l) => l.remove(0),
            StageOutput::Hidden(_) => unreachable!("a whole model returns logits"),
        };
        let all = logits(None);
        // 61 rounds up to 64; 200 is scored as an extra, 10 already is.
        let part = logits(Some(&Vocab {
            common: 61,
            extra: vec![200, 10, VOCAB as u32 + 5],
        }));
        for r in 0..3 {
            let (a, p) = (all.row(r), part.row(r));
            assert_eq!(&a[..64], &p[..64], "the common ids' logits, bit for bit");
            // Extras are f32 dot products with dequantized rows, not the quantized kernel.
            assert!(
                (a[200] - p[200]).abs() <= 0.05 * a[200].abs().max(1.0),
                "{} {}",
                a[200],
                p[200]
            );
            let scored = p.iter().filter(|x| x.is_finite()).count();
            assert_eq!(scored, 65, "the rest are -inf");
        }
    }
}
