//! The scheduler, an actor: it owns every sequence's state, builds steps from the active
//! sequences (decode rows and prompt chunks in one forward pass), sends them to stage 0 and
//! turns the returned token ids into text events.
//!
//! Sequences are divided into micro-batch groups (by default one per stage), each with at most
//! one step in the ring: while stage 1 computes group A's step, stage 0 computes group B's, so
//! every stage stays busy. A new request joins the lightest group; a group that falls idle
//! takes sequences over from a heavier idle one. A sequence's own steps stay strictly in
//! order, so its tokens do not depend on the grouping.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use pipeshard_generate::{Detokenizer, FinishReason, Lane, Sampler, StopChecker};
use pipeshard_stage::Worker;
use pipeshard_wire::pb::{self, frame::Kind};
use tokio::sync::{mpsc, watch};

use crate::draft::{Acceptance, Others, Proposal, Tuner};
use crate::lookahead::Lookahead;
use crate::{GenEvent, GenRequest, HeadConfig, RingStatus, ServedModel, Usage};

/// KV bytes a request needs on each stage (`budgets`: per stage, budget and bytes per
/// position): its whole context. Fails, with the need and a message naming the stage, when
/// the request could never fit.
pub(crate) fn kv_need(
    budgets: &[(u64, u64)],
    req: &GenRequest,
) -> Result<Vec<u64>, (Vec<u64>, String)> {
    let positions = (req.prompt.len() + req.max_tokens) as u64;
    let need: Vec<u64> = budgets.iter().map(|(_, per)| positions * per).collect();
    match need.iter().zip(budgets).position(|(n, (b, _))| n > b) {
        Some(i) => {
            let msg = format!(
                "the request needs {} KiB of KV cache on stage {i}, whose whole budget is {} KiB; ask for fewer tokens",
                need[i] / 1024,
                budgets[i].0 / 1024
            );
            Err((need, msg))
        }
        None => Ok(need),
    }
}

pub(crate) enum Command {
    Submit {
        req: GenRequest,
        events: mpsc::UnboundedSender<GenEvent>,
    },
}

struct Seq {
    /// Its micro-batch group.
    group: usize,
    req: GenRequest,
    events: mpsc::UnboundedSender<GenEvent>,
    /// Positions already in the stages' caches.
    fed: usize,
    /// Prompt positions sent into the ring: ahead of `fed` while chunks are in it.
    sent: usize,
    /// The last chosen token, not yet fed.
    next_input: Option<u32>,
    draws: Sampler,
    stop: StopChecker,
    detok: Detokenizer,
    generated: usize,
    stage_us: Vec<u64>,
    /// The prompt and every token chosen since (the drafters' context).
    context: Vec<u32>,
    /// Its proposals, sent and accepted.
    acceptance: Acceptance,
    /// Steps since it last drafted (to try drafting again after a while).
    undrafted: usize,
}

/// A sequence's part of a step in the ring.
struct Fed {
    id: u64,
    /// Input rows.
    n: usize,
    /// The proposals verified with it.
    proposals: Vec<u32>,
    /// A prompt chunk.
    prompt: bool,
}

struct InFlight {
    batch_id: u64,
    seqs: Vec<Fed>,
    rows: usize,
    sent: std::time::Instant,
    deadline: tokio::time::Instant,
}

/// Speculative decoding at the head: the drafter and the choice of `k`.
pub(crate) struct Speculation {
    pub drafter: Lookahead,
    pub tuner: Tuner,
}

/// Everything the actor owns; synchronous, so it is tested without a runtime.
pub(crate) struct State {
    model: Arc<ServedModel>,
    seqs: BTreeMap<u64, Seq>,
    /// Per group, its step in the ring (if any).
    in_flight: Vec<Option<InFlight>>,
    /// Prompt chunks sent while the same prompt's previous chunk was in the ring.
    chunks: Vec<InFlight>,
    next_seq: u64,
    next_batch: u64,
    chunk: usize,
    max_rows: usize,
    step_timeout: std::time::Duration,
    /// Per stage: (KV budget bytes, KV bytes per position).
    budgets: Vec<(u64, u64)>,
    /// Per stage: KV bytes reserved by the admitted sequences (their whole context).
    reserved: Vec<u64>,
    /// Requests waiting for KV room, oldest first.
    queue: VecDeque<(GenRequest, mpsc::UnboundedSender<GenEvent>)>,
    /// The queue's length, for the handle to refuse requests when it is full.
    waiting: Arc<AtomicUsize>,
    spec: Option<Speculation>,
}

impl State {
    pub fn new(
        model: Arc<ServedModel>,
        config: &HeadConfig,
        groups: usize,
        budgets: Vec<(u64, u64)>,
        waiting: Arc<AtomicUsize>,
        spec: Option<Speculation>,
    ) -> Self {
        Self {
            spec,
            reserved: vec![0; budgets.len()],
            budgets,
            queue: VecDeque::new(),
            waiting,
            model,
            seqs: BTreeMap::new(),
            in_flight: (0..groups.max(1)).map(|_| None).collect(),
            chunks: Vec::new(),
            next_seq: 0,
            next_batch: 0,
            chunk: config.prefill_chunk.max(1),
            max_rows: config.limits.max_tokens_per_step.max(1),
            step_timeout: config.step_timeout,
        }
    }

    /// KV bytes a request needs on each stage: its whole context.
    fn need(&self, req: &GenRequest) -> Vec<u64> {
        kv_need(&self.budgets, req).unwrap_or_else(|(need, _)| need)
    }

    fn fits(&self, need: &[u64]) -> bool {
        need.iter()
            .zip(&self.reserved)
            .zip(&self.budgets)
            .all(|((n, r), (b, _))| r + n <= *b)
    }

    /// Takes a request: refused at once if it can never fit, else queued until its whole
    /// context fits in every stage's KV budget.
    pub fn admit(&mut self, req: GenRequest, events: mpsc::UnboundedSender<GenEvent>) {
        if let Err((_, msg)) = kv_need(&self.budgets, &req) {
            let _ = events.send(GenEvent::Error(msg));
            return;
        }
        self.queue.push_back((req, events));
        self.admit_waiting();
    }

    /// Admits waiting requests, oldest first, while they fit.
    pub fn admit_waiting(&mut self) {
        while let Some((req, events)) = self.queue.front() {
            if events.is_closed() {
                self.queue.pop_front();
                continue;
            }
            let need = self.need(req);
            if !self.fits(&need) {
                break;
            }
            for (r, n) in self.reserved.iter_mut().zip(&need) {
                *r += n;
            }
            let (req, events) = self.queue.pop_front().expect("front exists");
            self.start(req, events);
        }
        self.waiting.store(self.queue.len(), Ordering::Relaxed);
    }

    /// Forgets a sequence and frees its reservation.
    fn remove(&mut self, id: u64) -> Option<Seq> {
        let s = self.seqs.remove(&id)?;
        if let Some(sp) = &mut self.spec {
            sp.drafter.release(id);
        }
        let need = self.need(&s.req);
        for (r, n) in self.reserved.iter_mut().zip(&need) {
            *r = r.saturating_sub(*n);
        }
        Some(s)
    }

    fn start(&mut self, req: GenRequest, events: mpsc::UnboundedSender<GenEvent>) {
        let draws = match Sampler::new(req.sampling.clone()) {
            Ok(s) => s,
            Err(e) => {
                let need = self.need(&req);
                for (r, n) in self.reserved.iter_mut().zip(&need) {
                    *r = r.saturating_sub(*n);
                }
                let _ = events.send(GenEvent::Error(e.to_string()));
                return;
            }
        };
        self.next_seq += 1;
        let group = (0..self.in_flight.len())
            .min_by_key(|&g| (self.group_size(g), g))
            .unwrap_or(0);
        let eos = if req.ignore_eos {
            &[][..]
        } else {
            self.model.text.tokenizer.eos()
        };
        let stop = StopChecker::new(eos, &req.stops, req.max_tokens);
        self.seqs.insert(
            self.next_seq,
            Seq {
                group,
                context: req.prompt.clone(),
                acceptance: self
                    .spec
                    .as_ref()
                    .map_or_else(Acceptance::default, |sp| sp.tuner.prior()),
                undrafted: 0,
                req,
                events,
                fed: 0,
                sent: 0,
                next_input: None,
                draws,
                stop,
                detok: Detokenizer::new(),
                generated: 0,
                stage_us: vec![],
            },
        );
    }

    fn group_size(&self, g: usize) -> usize {
        self.seqs.values().filter(|s| s.group == g).count()
    }

    /// The steps in the ring.
    fn in_ring(&self) -> impl Iterator<Item = &InFlight> {
        self.in_flight.iter().flatten().chain(&self.chunks)
    }

    fn busy(&self) -> Vec<u64> {
        self.in_ring()
            .flat_map(|f| f.seqs.iter().map(|s| s.id))
            .collect()
    }

    /// Drops sequences whose client went away (not while their step is in the ring).
    pub fn reap_cancelled(&mut self) -> Vec<u64> {
        let busy = self.busy();
        let gone: Vec<u64> = self
            .seqs
            .iter()
            .filter(|(id, s)| s.events.is_closed() && !busy.contains(id))
            .map(|(id, _)| *id)
            .collect();
        for id in &gone {
            self.remove(*id);
            tracing::info!(seq = id, "client went away; sequence cancelled");
        }
        gone
    }

    /// The next step: for an idle group that has sequences ready, after evening the idle
    /// groups out; else a prompt's next chunk while its previous one is in the ring, if the
    /// ring has room. `None` when there is nothing to send.
    pub fn next_step(&mut self) -> Option<pb::Step> {
        self.group_step().or_else(|| self.chunk_step())
    }

    /// A long prompt's next chunk, sent before the previous one comes back when the ring
    /// holds fewer steps than it has stages: stage 0 reads chunk 2 while stage 1 reads chunk
    /// 1, instead of each chunk going round alone. Only then, so a decoding sequence waits
    /// behind at most one chunk at a stage, as before.
    fn chunk_step(&mut self) -> Option<pb::Step> {
        // The ring holds one step per stage (each stage reports its budget) without queueing.
        if self.in_ring().count() >= self.budgets.len().max(1) {
            return None;
        }
        let (chunk, max_rows) = (self.chunk, self.max_rows);
        let (&id, s) = self.seqs.iter_mut().find(|(_, s)| {
            s.next_input.is_none() && s.fed < s.sent && s.sent < s.req.prompt.len()
        })?;
        let n = (s.req.prompt.len() - s.sent).min(chunk).min(max_rows);
        let mut seq_step = pb::SeqStep {
            seq_id: id,
            n: n as u32,
            ..Default::default()
        };
        let mut sampling = sampling_of(s);
        let tokens = prompt_chunk(s, n, &mut seq_step, &mut sampling);
        seq_step.sampling = Some(sampling);
        if let Some(sp) = &self.spec {
            draft_ahead(sp, id, s, &seq_step, &tokens);
        }
        let fed = Fed {
            id,
            n,
            proposals: vec![],
            prompt: true,
        };
        let f = self.new_step(vec![fed], n);
        let batch_id = f.batch_id;
        self.chunks.push(f);
        Some(pb::Step {
            batch_id,
            seqs: vec![seq_step],
            tokens,
            ..Default::default()
        })
    }

    /// The record of a step about to be sent, under the next batch id.
    fn new_step(&mut self, seqs: Vec<Fed>, rows: usize) -> InFlight {
        self.next_batch += 1;
        InFlight {
            batch_id: self.next_batch,
            seqs,
            rows,
            sent: std::time::Instant::now(),
            deadline: tokio::time::Instant::now() + self.step_timeout,
        }
    }

    /// The next step of an idle group with sequences ready (not waiting for a chunk).
    fn group_step(&mut self) -> Option<pb::Step> {
        let idle: Vec<usize> = (0..self.in_flight.len())
            .filter(|&g| self.in_flight[g].is_none())
            .collect();
        // Even out idle groups: a lighter one takes sequences over from a heavier one.
        loop {
            let sizes: Vec<(usize, usize)> =
                idle.iter().map(|&g| (self.group_size(g), g)).collect();
            let (Some(&(lo, light)), Some(&(hi, heavy))) = (sizes.iter().min(), sizes.iter().max())
            else {
                break;
            };
            if hi < lo + 2 {
                break;
            }
            let moved = self
                .seqs
                .values_mut()
                .rev()
                .find(|s| s.group == heavy)
                .expect("a heavy group has sequences");
            moved.group = light;
        }
        let ready = |s: &Seq| s.next_input.is_some() || s.sent == s.fed;
        let group = idle
            .into_iter()
            .find(|&g| self.seqs.values().any(|s| s.group == g && ready(s)))?;
        let mut step = pb::Step::default();
        let mut fed = Vec::new();
        let mut rows = 0;
        // Decoding sequences first (one row each), then prompt chunks in arrival order.
        let mut order: Vec<u64> = self
            .seqs
            .iter()
            .filter(|(_, s)| s.group == group && s.next_input.is_some())
            .map(|(id, _)| *id)
            .collect();
        order.extend(
            self.seqs
                .iter()
                .filter(|(_, s)| s.group == group && s.next_input.is_none() && ready(s))
                .map(|(id, _)| *id),
        );
        // Prompt rows per step are bounded by one chunk, shared in arrival order: a long
        // prompt delays its group's decoding sequences by at most one chunk's time.
        let mut prefill_budget = self.chunk;
        // What the step carries besides a decoding sequence, for its draft length: the rows
        // and expected tokens of those before it, one of each for those after it, and the
        // prompt rows that follow.
        let mut decoding_after = order
            .iter()
            .filter(|id| self.seqs[id].next_input.is_some())
            .count();
        let prompt_rows = order
            .iter()
            .map(|id| &self.seqs[id])
            .filter(|s| s.next_input.is_none())
            .map(|s| s.req.prompt.len() - s.sent)
            .sum::<usize>()
            .min(self.chunk);
        let mut expected = 0.0;
        for id in order {
            let budget = self.max_rows - rows;
            if budget == 0 {
                break;
            }
            let s = self.seqs.get_mut(&id).expect("id taken from the map");
            let g = s.generated as u64;
            let mut seq_step = pb::SeqStep {
                seq_id: id,
                pos: s.fed as u32,
                ..Default::default()
            };
            let mut sampling = sampling_of(s);
            let tokens: Vec<u32> = match s.next_input {
                Some(t) => {
                    decoding_after -= 1;
                    let others = Others {
                        rows: rows + decoding_after + prompt_rows,
                        tokens: expected + decoding_after as f64,
                    };
                    let proposals = match &mut self.spec {
                        Some(sp) => draft(sp, id, s, budget, others),
                        None => vec![],
                    };
                    expected += s.acceptance.expected_tokens(proposals.len());
                    let mut tokens = vec![t];
                    if proposals.is_empty() {
                        seq_step.output = pb::Output::Last as i32;
                    } else {
                        // Every proposal but a sampling run's last one is also an input.
                        let fed = proposals.len() - usize::from(s.req.sampling.temperature > 0.0);
                        tokens.extend(proposals[..fed].iter().map(|p| p.token));
                        seq_step.output = pb::Output::All as i32;
                        sampling.accept_uniforms = (0..proposals.len() as u64)
                            .map(|i| s.draws.uniform(g + i, Lane::Accept))
                            .collect();
                        if proposals.iter().any(|p| p.q.is_some()) {
                            seq_step.draft_q = proposals
                                .iter()
                                .map(|p| match &p.q {
                                    Some(q) => pb::Dist {
                                        ids: q.ids.clone(),
                                        probs: q.probs.clone(),
                                    },
                                    None => pb::Dist::default(), // certain
                                })
                                .collect();
                        }
                        seq_step.draft = proposals.iter().map(|p| p.token).collect();
                    }
                    sampling.uniforms = (0..tokens.len() as u64)
                        .map(|i| s.draws.uniform(g + i, Lane::Sample))
                        .collect();
                    tokens
                }
                None => {
                    let n = (s.req.prompt.len() - s.sent)
                        .min(prefill_budget)
                        .min(budget);
                    if n == 0 {
                        continue;
                    }
                    prefill_budget -= n;
                    prompt_chunk(s, n, &mut seq_step, &mut sampling)
                }
            };
            if let Some(sp) = &self.spec {
                draft_ahead(sp, id, s, &seq_step, &tokens);
            }
            rows += tokens.len();
            seq_step.n = tokens.len() as u32;
            seq_step.sampling = Some(sampling);
            fed.push(Fed {
                id,
                n: tokens.len(),
                proposals: seq_step.draft.clone(),
                prompt: s.next_input.is_none(),
            });
            step.seqs.push(seq_step);
            step.tokens.extend(tokens);
        }
        let f = self.new_step(fed, rows);
        step.batch_id = f.batch_id;
        self.in_flight[group] = Some(f);
        Some(step)
    }

    /// When the oldest step in the ring is due back.
    pub fn deadline(&self) -> Option<tokio::time::Instant> {
        self.in_ring().map(|f| f.deadline).min()
    }

    /// Applies a step's result; returns the sequences that ended (to release).
    pub fn on_result(&mut self, r: pb::StepResult) -> Vec<u64> {
        let chunk = self.chunks.iter().position(|f| f.batch_id == r.batch_id);
        let Some(f) = chunk.map(|i| self.chunks.remove(i)).or_else(|| {
            self.in_flight
                .iter_mut()
                .find_map(|slot| slot.take_if(|f| f.batch_id == r.batch_id))
        }) else {
            tracing::warn!(
                batch = r.batch_id,
                "a result for no step in flight; ignored"
            );
            return vec![];
        };
        if !r.error.is_empty() {
            return self.fail(
                &f,
                &format!("stage {} refused the step: {}", r.error_stage, r.error),
            );
        }
        let stage_us: Vec<u64> = r.timings.iter().map(|t| t.compute_us).collect();
        let queue_us: Vec<u64> = r.timings.iter().map(|t| t.queue_us).collect();
        let total_us = f.sent.elapsed().as_micros() as u64;
        tracing::debug!(rows = f.rows, total_us, ?stage_us, ?queue_us, "step done");
        // Only decoding steps teach the step line: a prompt chunk's rows cost several times a
        // decoding row's (prefill is compute-bound), and fitted to both, the line priced a
        // proposal at ~27 ms on the 1.5B, so 8 users on code prompts drafted almost nothing.
        //
        // Nor is the time a step waited at a stage for another group's step its own: with 8
        // users on code prompts, round trips fitted a line of 30 ms a step and 34 ms a row
        // (the stages say ~90 and ~12), and drafting took the ring from 4.0x to 2.8x.
        let decoding = f.seqs.iter().all(|fed| !fed.prompt);
        let own_us = total_us.saturating_sub(queue_us.iter().sum());
        if let (Some(sp), true) = (&mut self.spec, decoding) {
            sp.tuner.observe_step(f.rows, own_us as f64);
        }
        let mut ended = Vec::new();
        for fed in &f.seqs {
            let id = fed.id;
            let Some(s) = self.seqs.get_mut(&id) else {
                continue;
            };
            if s.stage_us.len() < stage_us.len() {
                s.stage_us.resize(stage_us.len(), 0);
            }
            for (a, b) in s.stage_us.iter_mut().zip(&stage_us) {
                *a += b;
            }
            let out = r.seqs.iter().find(|o| o.seq_id == id);
            if out.is_none() && s.next_input.is_none() && s.fed + fed.n < s.req.prompt.len() {
                s.fed += fed.n; // a prompt chunk: no token yet
                continue;
            }
            // The result is the accepted proposals plus one token; the inputs after the last
            // accepted proposal are rolled back by the next step's position.
            let tokens = out.map_or(&[][..], |o| &o.tokens[..]);
            let accepted = tokens.len().saturating_sub(1);
            if tokens.is_empty()
                || accepted >= fed.n
                || tokens[..accepted] != fed.proposals[..accepted]
            {
                let _ = s.events.send(GenEvent::Error(
                    "the last stage returned tokens that do not fit the step".into(),
                ));
                ended.push(id);
                continue;
            }
            s.fed += match s.next_input.take() {
                Some(_) => 1 + accepted,
                None => fed.n, // the prompt's last chunk
            };
            s.acceptance.observe(&fed.proposals, tokens);
            if let Some(sp) = &mut self.spec {
                sp.tuner.observe_acceptance(&fed.proposals, tokens);
            }
            let logprobs = out.map_or(&[][..], |o| &o.logprobs[..]);
            let mut finish = None;
            for (i, &token) in tokens.iter().enumerate() {
                finish = self.on_token(id, token, logprobs.get(i).copied());
                if finish.is_some() {
                    break;
                }
            }
            if let Some(finish) = finish {
                let s = &self.seqs[&id];
                let prompt_tokens = s.req.prompt.len();
                if s.acceptance.drafted > 0 {
                    tracing::info!(
                        seq = id,
                        drafted = s.acceptance.drafted,
                        accepted = s.acceptance.accepted,
                        generated = s.generated,
                        "speculation"
                    );
                }
                let _ = s.events.send(GenEvent::Done {
                    finish,
                    usage: Usage {
                        prompt_tokens,
                        completion_tokens: s.generated,
                        total_tokens: prompt_tokens + s.generated,
                        drafted_tokens: s.acceptance.drafted,
                        accepted_tokens: s.acceptance.accepted,
                    },
                    stage_compute_us: s.stage_us.clone(),
                });
                ended.push(id);
            }
        }
        for id in &ended {
            self.remove(*id);
        }
        ended
    }

    /// Handles a chosen token; `Some` when the sequence is finished.
    fn on_token(&mut self, id: u64, token: u32, logprob: Option<f32>) -> Option<FinishReason> {
        let tok = &self.model.text.tokenizer;
        let s = self.seqs.get_mut(&id)?;
        if s.stop.is_eos(token) {
            let rest = s.stop.flush();
            if !rest.is_empty() {
                let _ = s.events.send(GenEvent::Text {
                    text: rest,
                    token: None,
                    logprob: None,
                });
            }
            return Some(FinishReason::Stop);
        }
        s.generated += 1;
        let piece = match s.detok.push(tok, token) {
            Ok(p) => p,
            Err(e) => {
                let _ = s.events.send(GenEvent::Error(e.to_string()));
                return Some(FinishReason::Stop);
            }
        };
        let (text, done) = s.stop.push(&piece);
        let _ = s.events.send(GenEvent::Text {
            text,
            token: Some(token),
            logprob,
        });
        s.context.push(token);
        if done.is_none() {
            s.next_input = Some(token);
        }
        done
    }

    /// Fails the sequences of every step overdue at `now`; returns them (to release).
    pub fn fail_overdue(&mut self, now: tokio::time::Instant, msg: &str) -> Vec<u64> {
        let mut overdue: Vec<InFlight> = self
            .in_flight
            .iter_mut()
            .filter_map(|slot| slot.take_if(|f| f.deadline <= now))
            .collect();
        let (late, on_time) = std::mem::take(&mut self.chunks)
            .into_iter()
            .partition(|f| f.deadline <= now);
        self.chunks = on_time;
        overdue.extend::<Vec<InFlight>>(late);
        overdue.iter().flat_map(|f| self.fail(f, msg)).collect()
    }

    fn fail(&mut self, f: &InFlight, msg: &str) -> Vec<u64> {
        tracing::warn!(batch = f.batch_id, "{msg}");
        let ids: Vec<u64> = f.seqs.iter().map(|s| s.id).collect();
        for id in &ids {
            if let Some(s) = self.remove(*id) {
                let _ = s.events.send(GenEvent::Error(msg.to_string()));
            }
        }
        ids
    }

    /// Fails every sequence (the ring went down): their caches may be gone.
    pub fn fail_all(&mut self, msg: &str) -> Vec<u64> {
        self.in_flight.iter_mut().for_each(|f| *f = None);
        self.chunks.clear();
        let ids: Vec<u64> = self.seqs.keys().copied().collect();
        for id in &ids {
            if let Some(s) = self.remove(*id) {
                let _ = s.events.send(GenEvent::Error(msg.to_string()));
            }
        }
        ids
    }
}

/// A step's sampling settings for sequence `s` (its draws are added per row).
fn sampling_of(s: &Seq) -> pb::Sampling {
    pb::Sampling {
        temperature: s.req.sampling.temperature,
        top_k: s.req.sampling.top_k as u32,
        top_p: s.req.sampling.top_p,
        logprobs: s.req.logprobs,
        ..Default::default()
    }
}

/// The next `n` prompt tokens of `s` as its part of a step: from the first position not yet
/// sent, with the first token's draw when they end the prompt.
fn prompt_chunk(
    s: &mut Seq,
    n: usize,
    seq_step: &mut pb::SeqStep,
    sampling: &mut pb::Sampling,
) -> Vec<u32> {
    seq_step.pos = s.sent as u32;
    let tokens = s.req.prompt[s.sent..s.sent + n].to_vec();
    s.sent += n;
    if s.sent == s.req.prompt.len() {
        seq_step.output = pb::Output::Last as i32;
        sampling.uniforms = vec![s.draws.uniform(s.generated as u64, Lane::Sample)];
    }
    tokens
}

/// Undrafted steps after which a sequence whose drafts do not seem to pay drafts one anyway.
const PROBE_EVERY: usize = 4;

/// Proposals for a decoding sequence, at most `budget - 1` of them fed: as many as the tuner
/// chooses (none when drafting does not pay, though it tries again now and then), within the
/// tokens the request may still produce, counting what the rest of its step carries
/// (`others`). A sampling sequence gets one more, for the row after the last fed one, so that
/// every position it samples is verified the same way.
fn draft(
    sp: &mut Speculation,
    id: u64,
    s: &mut Seq,
    budget: usize,
    others: Others,
) -> Vec<Proposal> {
    let left = s.req.max_tokens.saturating_sub(s.generated + 1);
    let mut k = s
        .req
        .draft_k
        .unwrap_or_else(|| sp.tuner.choose_among(&s.acceptance, others));
    // Undrafted steps teach nothing about acceptance, so one rejection could stop drafting
    // for the rest of a request: probe with one proposal every few steps (every 16 left the
    // 0.5B drafter idle for 16 of 48 tokens after an early miss).
    if k == 0 && s.undrafted >= PROBE_EVERY && s.req.draft_k.is_none() {
        k = 1;
    }
    let k = k.min(left).min(budget - 1);
    let sampling = s.req.sampling.temperature > 0.0;
    let want = k + usize::from(sampling);
    if k == 0 && (!sampling || s.req.draft_k == Some(0)) {
        s.undrafted += 1;
        return vec![];
    }
    s.undrafted = 0;
    let g = s.generated as u64;
    let draws: Vec<f32> = (0..want as u64)
        .map(|i| s.draws.uniform(g + i, Lane::Draft))
        .collect();
    let started = std::time::Instant::now();
    let (proposals, fed) = sp.drafter.with(id, |d| {
        let fed = d.fed();
        let p = d.propose(id, &s.context, want, &s.req.sampling, &draws);
        (p, d.fed() - fed)
    });
    sp.tuner
        .observe_draft(proposals.len(), fed, started.elapsed().as_micros() as f64);
    proposals
}

/// Has the drafter work ahead while a step of sequence `s` is in the ring: after a prompt
/// chunk, reading the prompt (and, for the last chunk, drafting past the target's first
/// token, guessing it is the draft's own); after proposals, drafting past them and the token
/// after them, guessing all are accepted (as many again as this step drafted). `tokens` are
/// the step's inputs for `s`.
fn draft_ahead(sp: &Speculation, id: u64, s: &Seq, step: &pb::SeqStep, tokens: &[u32]) {
    let greedy = s.req.sampling.temperature <= 0.0;
    let (context, k) = match s.next_input {
        // A decode step: proposals go after its inputs.
        Some(_) if !step.draft.is_empty() => {
            let mut c = s.context.clone();
            c.extend_from_slice(&tokens[1..]);
            (c, step.draft.len())
        }
        Some(_) => return,
        // The prompt's last chunk: the first token, then the proposals after it.
        None if step.output == pb::Output::Last as i32 => {
            let left = s.req.max_tokens.saturating_sub(1);
            let k = s
                .req
                .draft_k
                .unwrap_or_else(|| sp.tuner.choose(&s.acceptance));
            (s.context.clone(), k.min(left))
        }
        None => {
            let read = s.req.prompt[..s.sent].to_vec();
            sp.drafter.ahead(id, read, 0, greedy);
            return;
        }
    };
    if k > 0 {
        sp.drafter.ahead(id, context, k + 1, greedy);
    }
}

/// The state's next step; a drafter computes while building it, so the runtime is told to move
/// other tasks off this thread meanwhile.
fn next_step(state: &mut State) -> Option<pb::Step> {
    let multi = tokio::runtime::Handle::current().runtime_flavor()
        == tokio::runtime::RuntimeFlavor::MultiThread;
    if state.spec.is_some() && multi {
        tokio::task::block_in_place(|| state.next_step())
    } else {
        state.next_step()
    }
}

pub(crate) fn spawn(
    mut commands: mpsc::Receiver<Command>,
    mut results: mpsc::Receiver<pb::Frame>,
    worker: Worker,
    mut status: watch::Receiver<RingStatus>,
    mut state: State,
) {
    tokio::spawn(async move {
        let release = |ids: Vec<u64>| {
            if !ids.is_empty() {
                worker.send(pb::Frame {
                    kind: Some(Kind::Release(pb::Release { seq_ids: ids })),
                });
            }
        };
        loop {
            release(state.reap_cancelled());
            state.admit_waiting();
            if status.borrow().ready {
                while let Some(step) = next_step(&mut state) {
                    tracing::debug!(batch = step.batch_id, rows = step.tokens.len(), "step");
                    if !worker.send(pb::Frame {
                        kind: Some(Kind::Step(step)),
                    }) {
                        release(state.fail_all("stage 0 stopped"));
                    }
                }
            }
            let deadline = state.deadline();
            tokio::select! {
                cmd = commands.recv() => match cmd {
                    Some(Command::Submit { req, events }) => state.admit(req, events),
                    None => return,
                },
                frame = results.recv() => match frame.and_then(|f| f.kind) {
                    Some(Kind::Result(r)) => release(state.on_result(r)),
                    Some(_) => tracing::warn!("the ring returned a frame that is not a result"),
                    None => return,
                },
                changed = status.changed() => {
                    if changed.is_err() {
                        continue;
                    }
                    let s = status.borrow().clone();
                    if !s.ready {
                        release(state.fail_all(&format!("the ring is unavailable: {}", s.message)));
                    }
                }
                _ = async {
                    match deadline {
                        Some(d) => tokio::time::sleep_until(d).await,
                        None => std::future::pending().await,
                    }
                } => {
                    let now = tokio::time::Instant::now();
                    release(state.fail_overdue(now, "the step did not come back round the ring in time"));
                }
                // Wake up now and then to notice clients that went away.
                _ = tokio::time::sleep(std::time::Duration::from_millis(200)) => {}
            }
        }
    });
}

#[cfg(test)]
mod tests_support {
    use super::*;
    use pipeshard_generate::{SamplingParams, TextModel};
    use pipeshard_model::gguf::GgufFile;
    use pipeshard_testkit::{tiny_model, Flavour};

    pub fn state(chunk: usize, groups: usize) -> State {
        state_with(chunk, groups, None)
    }

    pub fn state_with(chunk: usize, groups: usize, spec: Option<Speculation>) -> State {
        state_on(chunk, groups, 1, spec)
    }

    /// A state for a ring of `stages` stages.
    pub fn state_on(
        chunk: usize,
        groups: usize,
        stages: usize,
        spec: Option<Speculation>,
    ) -> State {
        let tmp = tempfile::tempdir().unwrap();
        let path = tiny_model(tmp.path(), Flavour::Llama, 1);
        let g = GgufFile::open(&path).unwrap();
        let model = ServedModel {
            name: "tiny".into(),
            text: TextModel::from_gguf(&g.content).unwrap(),
            ctx_len: 256,
            sha256: "x".into(),
        };
        let config = HeadConfig {
            prefill_chunk: chunk,
            ..HeadConfig::default()
        };
        State::new(
            Arc::new(model),
            &config,
            groups,
            vec![(u64::MAX / 2, 1); stages],
            Arc::default(),
            spec,
        )
    }

    pub fn request(prompt_len: usize, max_tokens: usize) -> GenRequest {
        GenRequest {
            prompt: (0..prompt_len as u32).map(|i| 100 + i).collect(),
            sampling: SamplingParams::default(),
            max_tokens,
            stops: vec![],
            logprobs: false,
            ignore_eos: false,
            draft_k: None,
        }
    }

    pub fn reply(step: &pb::Step, token: u32) -> pb::StepResult {
        pb::StepResult {
            batch_id: step.batch_id,
            seqs: step
                .seqs
                .iter()
                .filter(|s| s.output != pb::Output::None as i32)
                .map(|s| pb::SeqResult {
                    seq_id: s.seq_id,
                    tokens: vec![token],
                    logprobs: vec![],
                })
                .collect(),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::tests_support::*;
    use super::*;

    #[test]
    fn prompts_go_in_chunks_then_one_token_per_step_until_max_tokens() {
        let mut st = state(4, 1);
        let (tx, mut rx) = mpsc::unbounded_channel();
        st.admit(request(10, 2), tx);
        let mut shapes = vec![];
        while let Some(step) = st.next_step() {
            assert!(st.next_step().is_none(), "one step in the ring at a time");
            let s = &step.seqs[0];
            shapes.push((s.pos, s.n, s.output));
            let ended = st.on_result(reply(&step, 104));
            if !ended.is_empty() {
                break;
            }
        }
        let (none, last) = (pb::Output::None as i32, pb::Output::Last as i32);
        assert_eq!(
            shapes,
            vec![(0, 4, none), (4, 4, none), (8, 2, last), (10, 1, last)]
        );
        let mut texts = 0;
        loop {
            match rx.try_recv().unwrap() {
                GenEvent::Text { token, .. } => {
                    assert_eq!(token, Some(104));
                    texts += 1;
                }
                GenEvent::Done { finish, usage, .. } => {
                    assert_eq!(finish, FinishReason::Length);
                    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (10, 2));
                    break;
                }
                GenEvent::Error(e) => panic!("{e}"),
            }
        }
        assert_eq!(texts, 2);
        assert!(st.seqs.is_empty());
    }

    #[test]
    fn eos_stops_and_errors_fail_only_their_step() {
        let mut st = state(64, 1);
        let (tx, mut rx) = mpsc::unbounded_channel();
        st.admit(request(3, 50), tx);
        let step = st.next_step().unwrap();
        // A result for another batch is ignored; the step is still awaited.
        let mut stray = reply(&step, 1);
        stray.batch_id += 7;
        assert!(st.on_result(stray).is_empty());
        let ended = st.on_result(reply(&step, pipeshard_testkit::EOS));
        assert_eq!(ended.len(), 1);
        assert!(matches!(
            rx.try_recv().unwrap(),
            GenEvent::Done {
                finish: FinishReason::Stop,
                ..
            }
        ));

        let (tx, mut rx) = mpsc::unbounded_channel();
        st.admit(request(3, 50), tx);
        let step = st.next_step().unwrap();
        let failed = st.on_result(pb::StepResult {
            batch_id: step.batch_id,
            error: "bad shape".into(),
            error_stage: 2,
            ..Default::default()
        });
        assert_eq!(failed.len(), 1);
        match rx.try_recv().unwrap() {
            GenEvent::Error(e) => assert!(e.contains("stage 2") && e.contains("bad shape"), "{e}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn cancelled_requests_are_reaped_but_not_while_in_the_ring() {
        let mut st = state(64, 1);
        let (tx, rx) = mpsc::unbounded_channel();
        st.admit(request(3, 50), tx);
        let step = st.next_step().unwrap();
        drop(rx);
        assert!(st.reap_cancelled().is_empty(), "its step is in the ring");
        assert!(st.on_result(reply(&step, 120)).is_empty());
        assert_eq!(st.reap_cancelled().len(), 1);
        assert!(st.next_step().is_none());
    }
}

#[cfg(test)]
mod group_tests {
    use super::tests_support::*;
    use super::*;

    #[test]
    fn groups_each_have_a_step_in_the_ring_and_stay_balanced() {
        let mut st = state(64, 2);
        let mut keep = vec![];
        for _ in 0..3 {
            let (tx, rx) = mpsc::unbounded_channel();
            keep.push(rx);
            st.admit(request(3, 50), tx);
        }
        // Groups 0 and 1 hold 2 and 1 sequences; both get a step at once.
        let a = st.next_step().unwrap();
        let b = st.next_step().unwrap();
        assert!(st.next_step().is_none());
        assert_eq!((a.seqs.len(), b.seqs.len()), (2, 1));
        // Group 1's result comes first; its next step goes while group 0's is still out.
        assert!(st.on_result(reply(&b, 120)).is_empty());
        let b2 = st.next_step().unwrap();
        assert_eq!(b2.seqs[0].seq_id, b.seqs[0].seq_id);
        assert_eq!(b2.seqs[0].pos, 3);
        assert!(st.next_step().is_none());
        // Four more arrive while both groups are out: each joins the lighter group.
        for _ in 0..4 {
            let (tx, rx) = mpsc::unbounded_channel();
            keep.push(rx);
            st.admit(request(3, 50), tx);
        }
        assert_eq!((st.group_size(0), st.group_size(1)), (4, 3));
    }

    fn shape(step: &pb::Step) -> (u64, u32, u32, bool) {
        let s = &step.seqs[0];
        (s.seq_id, s.pos, s.n, s.output == pb::Output::Last as i32)
    }

    #[test]
    fn a_long_prompt_pipelines_its_chunks_but_leaves_room_for_other_groups() {
        let mut st = state_on(8, 2, 2, None);
        let (tx, _rx) = mpsc::unbounded_channel();
        st.admit(request(30, 2), tx);
        // Alone, the prompt's second chunk follows the first into the ring: one per stage.
        let c1 = st.next_step().unwrap();
        let c2 = st.next_step().unwrap();
        assert!(st.next_step().is_none(), "two stages hold two steps");
        assert_eq!(
            (shape(&c1), shape(&c2)),
            ((1, 0, 8, false), (1, 8, 8, false))
        );
        assert!(st.on_result(reply(&c1, 0)).is_empty());
        let c3 = st.next_step().unwrap();
        assert!(st.next_step().is_none());
        assert!(st.on_result(reply(&c2, 0)).is_empty());
        let c4 = st.next_step().unwrap();
        assert_eq!(
            (shape(&c3), shape(&c4)),
            ((1, 16, 8, false), (1, 24, 6, true))
        );
        assert!(st.on_result(reply(&c3, 0)).is_empty());
        assert!(
            st.next_step().is_none(),
            "the prompt's end is still in the ring"
        );
        assert!(st.on_result(reply(&c4, 120)).is_empty());
        let d = st.next_step().unwrap();
        assert_eq!(shape(&d), (1, 30, 1, true));
        assert_eq!(d.tokens, vec![120]);

        // With another user in the other group, the ring is full with one step per group:
        // the long prompt goes one chunk at a time and the short one keeps decoding.
        let mut st = state_on(8, 2, 2, None);
        let (tx, _rx2) = mpsc::unbounded_channel();
        st.admit(request(3, 50), tx);
        let (tx, _rx3) = mpsc::unbounded_channel();
        st.admit(request(30, 2), tx);
        let a = st.next_step().unwrap();
        let b = st.next_step().unwrap();
        assert!(st.next_step().is_none());
        assert_eq!((shape(&a), shape(&b)), ((1, 0, 3, true), (2, 0, 8, false)));
        assert!(st.on_result(reply(&a, 120)).is_empty());
        let a2 = st.next_step().unwrap();
        assert_eq!(shape(&a2), (1, 3, 1, true));
        assert!(
            st.next_step().is_none(),
            "no chunk while both groups are out"
        );
        assert!(st.on_result(reply(&b, 0)).is_empty());
        assert_eq!(shape(&st.next_step().unwrap()), (2, 8, 8, false));
    }
}

#[cfg(test)]
mod admission_tests {
    use super::tests_support::*;
    use super::*;

    #[test]
    fn requests_wait_for_kv_room_and_oversized_ones_are_refused() {
        let mut st = state(64, 1);
        // Two stages; each position costs 10 and 20 bytes; stage 1 holds 2,000 bytes.
        st.budgets = vec![(1_000_000, 10), (2_000, 20)];
        st.reserved = vec![0, 0];
        let mut rxs = vec![];
        for _ in 0..3 {
            let (tx, rx) = mpsc::unbounded_channel();
            rxs.push(rx);
            st.admit(request(10, 40), tx); // 50 positions: 1,000 bytes on stage 1
        }
        assert_eq!(st.seqs.len(), 2);
        assert_eq!(st.waiting.load(Ordering::Relaxed), 1);
        // One that can never fit is refused with the stage named.
        let (tx, mut rx) = mpsc::unbounded_channel();
        st.admit(request(10, 100), tx);
        match rx.try_recv().unwrap() {
            GenEvent::Error(e) => assert!(e.contains("stage 1") && e.contains("budget"), "{e}"),
            other => panic!("{other:?}"),
        }
        // When one finishes, the waiting one is admitted.
        let first = *st.seqs.keys().next().unwrap();
        assert!(st.remove(first).is_some());
        st.admit_waiting();
        assert_eq!(st.seqs.len(), 2);
        assert_eq!(st.waiting.load(Ordering::Relaxed), 0);
        assert_eq!(st.reserved, vec![1_000, 2_000]);
    }
}

#[cfg(test)]
mod fairness_tests {
    use super::tests_support::*;
    use super::*;

    #[test]
    fn long_prompts_share_one_chunk_per_step_and_decoding_goes_on() {
        let mut st = state(8, 1);
        let mut keep = vec![];
        let (tx, rx) = mpsc::unbounded_channel();
        keep.push(rx);
        st.admit(request(3, 100), tx);
        let step = st.next_step().unwrap();
        st.on_result(reply(&step, 120));
        // Two long prompts arrive while the first sequence decodes.
        for _ in 0..2 {
            let (tx, rx) = mpsc::unbounded_channel();
            keep.push(rx);
            st.admit(request(20, 5), tx);
        }
        let mut prompt_rows_seen = vec![];
        for _ in 0..6 {
            let step = st.next_step().unwrap();
            let first = &step.seqs[0];
            assert_eq!(
                (first.seq_id, first.n),
                (1, 1),
                "the decoding sequence goes every step"
            );
            let prompt_rows: u32 = step.seqs[1..]
                .iter()
                .filter(|s| s.output == pb::Output::None as i32 || s.n > 1)
                .map(|s| s.n)
                .sum();
            assert!(prompt_rows <= 8, "{prompt_rows} prompt rows in one step");
            prompt_rows_seen.push(
                step.seqs[1..]
                    .iter()
                    .map(|s| (s.seq_id, s.n))
                    .collect::<Vec<_>>(),
            );
            st.on_result(reply(&step, 120));
        }
        // Arrival order: the older prompt is read first, then the newer one.
        assert_eq!(prompt_rows_seen[0], vec![(2, 8)]);
        assert_eq!(prompt_rows_seen[1], vec![(2, 8)]);
        assert_eq!(prompt_rows_seen[2], vec![(2, 4), (3, 4)]);
    }
}

#[cfg(test)]
mod speculation_tests {
    use super::tests_support::*;
    use super::*;

    #[test]
    fn proposals_are_verified_and_rejected_ones_rolled_back() {
        let spec = Speculation {
            drafter: Lookahead::new(crate::draft::Drafter::Ngram),
            tuner: Tuner::new(Some(3), 3),
        };
        let mut st = state_with(64, 1, Some(spec));
        let (tx, mut rx) = mpsc::unbounded_channel();
        // The prompt repeats [5 6 7 8]: after "5 6", prompt lookup proposes 7 8 5.
        let mut req = request(0, 8);
        req.prompt = vec![5, 6, 7, 8, 5, 6, 7, 8, 5];
        st.admit(req, tx);
        let prefill = st.next_step().unwrap();
        assert_eq!(prefill.seqs[0].draft, Vec::<u32>::new());
        st.on_result(reply(&prefill, 6));
        let steps_seen = |st: &State| st.spec.as_ref().unwrap().tuner.steps_seen();
        assert_eq!(
            steps_seen(&st),
            0.0,
            "a prompt chunk is no verification step"
        );
        let step = st.next_step().unwrap();
        let s = &step.seqs[0];
        assert_eq!((s.pos, s.n, s.output), (9, 4, pb::Output::All as i32));
        assert_eq!(step.tokens, [6, 7, 8, 5]);
        assert_eq!(s.draft, [7, 8, 5]);
        // The target accepts 7, replaces 8 with 1: two tokens; position 11 is rolled back.
        let mut r = reply(&step, 0);
        r.seqs[0].tokens = vec![7, 1];
        // It was 2 s round the ring, 1.5 s of them waiting at stage 0 behind another step:
        // the step line learns 0.5 s.
        st.in_flight[0].as_mut().unwrap().sent -= std::time::Duration::from_secs(2);
        r.timings = vec![pb::StageTiming {
            stage: 0,
            compute_us: 400_000,
            queue_us: 1_500_000,
        }];
        assert!(st.on_result(r).is_empty());
        assert_eq!(steps_seen(&st), 1.0);
        let mean = st.spec.as_ref().unwrap().tuner.mean_step_us();
        assert!((500_000.0..600_000.0).contains(&mean), "{mean}");
        let step = st.next_step().unwrap();
        assert_eq!(step.seqs[0].pos, 11);
        assert_eq!(step.tokens[0], 1);
        // A result that claims more than was proposed is refused.
        let mut r = reply(&step, 0);
        r.seqs[0].tokens = vec![3; step.tokens.len() + 1];
        assert_eq!(st.on_result(r).len(), 1);
        let mut tokens = vec![];
        while let Ok(e) = rx.try_recv() {
            match e {
                GenEvent::Text { token, .. } => tokens.extend(token),
                GenEvent::Error(e) => assert!(e.contains("do not fit"), "{e}"),
                GenEvent::Done { .. } => panic!("the sequence failed"),
            }
        }
        assert_eq!(tokens, [6, 7, 1]);
    }

    #[test]
    fn usage_counts_drafted_and_accepted_tokens_and_k_respects_max_tokens() {
        let spec = Speculation {
            drafter: Lookahead::new(crate::draft::Drafter::Ngram),
            tuner: Tuner::new(Some(8), 8),
        };
        let mut st = state_with(64, 1, Some(spec));
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut req = request(0, 4);
        req.prompt = vec![5, 6, 7, 8, 9, 10, 11, 5];
        st.admit(req, tx);
        let prefill = st.next_step().unwrap();
        st.on_result(reply(&prefill, 6));
        let step = st.next_step().unwrap();
        // 3 tokens left to generate: at most 2 proposals fed.
        assert_eq!(step.seqs[0].draft, [7, 8]);
        let mut r = reply(&step, 0);
        r.seqs[0].tokens = vec![7, 8, 9];
        assert_eq!(st.on_result(r).len(), 1);
        let done = std::iter::from_fn(|| rx.try_recv().ok()).last();
        let Some(GenEvent::Done { usage, .. }) = done else {
            panic!("{done:?}");
        };
        assert_eq!(
            (
                usage.completion_tokens,
                usage.drafted_tokens,
                usage.accepted_tokens
            ),
            (4, 2, 2)
        );
    }
}
