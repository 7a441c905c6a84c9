//! Drafting ahead: while a sequence's step is in the ring, a background thread feeds the draft
//! model what the sequence will need next and drafts past the proposals being verified, as if
//! the target accepted them all and then chose the draft's own next token. When it does, the
//! next step's proposals are already there; when not, only idle time was spent.
//!
//! Measured with the 0.5B drafting for the 1.5B on two stages: reading a prompt into the draft
//! model took ~1.4 s after the target's prefill came back, and drafting took ~115 of a
//! ~320 ms cycle, while the head's core sat idle during every step's last-stage compute.
//!
//! The draft model's threads run at the lowest priority (`SCHED_IDLE` on Linux) on any core,
//! so that they take only time no stage wants; the scheduler's own drafting, which the ring
//! waits for, runs on them too and gets the cores that wait with it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::draft::Drafter;

/// Work for the background thread: draft `n` greedy proposals after `context` (or, when
/// sampling, just read `context` into the draft model's cache).
struct Job {
    seq: u64,
    context: Vec<u32>,
    n: usize,
    greedy: bool,
}

#[derive(Default)]
struct Jobs {
    queue: VecDeque<Job>,
    /// The sequence whose job is being worked on, and whether it was cancelled meanwhile.
    running: Option<(u64, bool)>,
    stop: bool,
}

struct Shared {
    drafter: Mutex<Drafter>,
    /// The scheduler waits for the drafter: the thread lets it go between pieces of work.
    wanted: AtomicBool,
    jobs: Mutex<Jobs>,
    /// Signalled when a job is queued, or the queue runs dry (for [`Lookahead::wait_idle`]).
    changed: Condvar,
}

/// A drafter shared by the scheduler and the thread that drafts ahead.
pub struct Lookahead {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Lookahead {
    /// Starts the thread; a drafter without a model gets none (prompt lookup costs nothing).
    pub fn new(mut drafter: Drafter) -> Self {
        let has_model = drafter.use_idle_cores();
        let shared = Arc::new(Shared {
            drafter: Mutex::new(drafter),
            wanted: AtomicBool::new(false),
            jobs: Mutex::new(Jobs::default()),
            changed: Condvar::new(),
        });
        let thread = has_model.then(|| {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("draft-ahead".into())
                .spawn(move || work(&shared))
                .expect("spawning the draft-ahead thread")
        });
        Self { shared, thread }
    }

    /// Runs `f` with the drafter once the thread has finished its current piece of work;
    /// queued work for `seq` is dropped first (it assumed an older context).
    pub fn with<R>(&self, seq: u64, f: impl FnOnce(&mut Drafter) -> R) -> R {
        self.cancel(seq);
        self.shared.wanted.store(true, Ordering::SeqCst);
        let mut d = lock(&self.shared.drafter);
        self.shared.wanted.store(false, Ordering::SeqCst);
        f(&mut d)
    }

    /// Queues drafting `n` proposals after `context` for `seq` (greedy), or reading `context`
    /// into the draft model's cache (sampling), replacing the sequence's queued work.
    pub fn ahead(&self, seq: u64, context: Vec<u32>, n: usize, greedy: bool) {
        if self.thread.is_none() {
            return;
        }
        let mut jobs = lock(&self.shared.jobs);
        jobs.queue.retain(|j| j.seq != seq);
        jobs.queue.push_back(Job {
            seq,
            context,
            n,
            greedy,
        });
        self.shared.changed.notify_all();
    }

    /// Forgets a sequence: its queued work and the drafter's state.
    pub fn release(&self, seq: u64) {
        self.with(seq, |d| d.release(seq));
    }

    /// Tokens the draft model has fed through so far.
    pub fn fed(&self) -> usize {
        lock(&self.shared.drafter).fed()
    }

    /// Blocks until the thread has no work (tests).
    pub fn wait_idle(&self) {
        let mut jobs = lock(&self.shared.jobs);
        while !jobs.queue.is_empty() || jobs.running.is_some() {
            jobs = self
                .shared
                .changed
                .wait(jobs)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    fn cancel(&self, seq: u64) {
        let mut jobs = lock(&self.shared.jobs);
        jobs.queue.retain(|j| j.seq != seq);
        if let Some((s, cancelled)) = &mut jobs.running {
            if *s == seq {
                *cancelled = true;
            }
        }
    }
}

impl Drop for Lookahead {
    fn drop(&mut self) {
        lock(&self.shared.jobs).stop = true;
        self.shared.changed.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A poisoned lock only means a drafter panicked mid-proposal; its state is still usable
/// (the scheduler verifies whatever it proposes).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The background thread: takes jobs oldest first and works on each a piece at a time,
/// letting the scheduler have the drafter between pieces.
fn work(shared: &Shared) {
    loop {
        let mut job = {
            let mut jobs = lock(&shared.jobs);
            loop {
                if jobs.stop {
                    return;
                }
                if let Some(job) = jobs.queue.pop_front() {
                    jobs.running = Some((job.seq, false));
                    break job;
                }
                jobs.running = None;
                shared.changed.notify_all();
                jobs = shared.changed.wait(jobs).unwrap_or_else(|e| e.into_inner());
            }
        };
        // Greedy work ends with `n` proposals drafted (at least one: reading a prompt
        // ends with the draft's guess after it); sampling work when the prompt is read.
        let target = job.context.len() + job.n.max(1);
        loop {
            // Sleeping, not spinning: the scheduler's drafting runs on the low-priority
            // threads, which a spinning thread would keep off the core.
            while shared.wanted.load(Ordering::SeqCst) {
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            let more = {
                let mut d = lock(&shared.drafter);
                let jobs = lock(&shared.jobs);
                let cancelled = jobs.stop || jobs.running.is_none_or(|(_, c)| c);
                drop(jobs);
                !cancelled && d.ahead_piece(job.seq, &mut job.context, job.greedy)
            };
            if !more || job.context.len() >= target {
                break;
            }
        }
        lock(&shared.jobs).running = None;
    }
}

/// A thread pool whose threads run at the lowest priority, on any core.
pub(crate) fn idle_pool(threads: usize) -> Option<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .thread_name(|i| format!("draft-{i}"))
        .start_handler(|_| lower_priority())
        .build()
        .ok()
}

/// Lets the calling thread run only when a core would otherwise idle, on any core (it may
/// have inherited its process's pinning to a stage's core).
fn lower_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: plain system calls on the calling thread (id 0) with initialized arguments.
    unsafe {
        let mut all: libc::cpu_set_t = std::mem::zeroed();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        for c in 0..cores.min(libc::CPU_SETSIZE as usize) {
            libc::CPU_SET(c, &mut all);
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &all) != 0 {
            tracing::debug!("the draft model's threads stay on their inherited cores");
        }
        let param = libc::sched_param { sched_priority: 0 };
        if libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) != 0 {
            tracing::debug!("the draft model's threads keep their normal priority");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::draft::tests::{greedy, tiny_drafter};
    use pipeshard_generate::SamplingParams;

    #[test]
    fn the_thread_drafts_ahead_and_proposals_stay_the_same() {
        let tmp = tempfile::tempdir().unwrap();
        let prompt: Vec<u32> = (0..30).map(|i| 100 + (i * 5) % 40).collect();
        let want = greedy(&mut tiny_drafter(tmp.path(), 0), 1, &prompt, 5);
        let la = Lookahead::new(tiny_drafter(tmp.path(), 0));
        // The prompt's last chunk is in the ring: read it and draft past the first token.
        la.ahead(1, prompt.clone(), 5, true);
        la.wait_idle();
        let fed = la.fed();
        assert!(fed >= prompt.len(), "{fed}");
        // The target's first token was the draft's: four proposals ready, no forward pass.
        let mut ctx = prompt.clone();
        ctx.push(want[0]);
        let (got, more) = la.with(1, |d| {
            let before = d.fed();
            (greedy(d, 1, &ctx, 4), d.fed() - before)
        });
        assert_eq!((got, more), (want[1..].to_vec(), 0));
        // A sampling sequence's prompt is only read: its first proposal feeds one token.
        la.ahead(2, prompt.clone(), 0, false);
        la.wait_idle();
        let params = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let more = la.with(2, |d| {
            let before = d.fed();
            assert_eq!(d.propose(2, &prompt, 1, &params, &[0.3]).len(), 1);
            d.fed() - before
        });
        assert_eq!(more, 1);
        // Work queued and then overtaken by the scheduler is dropped, not waited for.
        let long: Vec<u32> = (0..200).map(|i| 60 + i % 90).collect();
        la.ahead(3, long.clone(), 5, true);
        let got = la.with(3, |d| greedy(d, 3, &long[..20], 2));
        assert_eq!(
            got,
            greedy(&mut tiny_drafter(tmp.path(), 0), 3, &long[..20], 2)
        );
        la.release(3);
        la.wait_idle();
    }
}
