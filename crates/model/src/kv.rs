//! Per-sequence key/value caches of one stage.

use std::collections::HashMap;

use crate::batch::SeqId;

/// One layer's cache: `[len, kv_dim]` keys and values, token-major, grown by appending.
#[derive(Debug, Default, Clone)]
pub(crate) struct LayerCache {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// One sequence's caches for every layer of the stage.
#[derive(Debug, Default, Clone)]
pub(crate) struct SeqCache {
    pub layers: Vec<LayerCache>,
    /// Number of positions held.
    pub len: usize,
}

/// The KV caches of one stage, one per sequence. Owned by whoever owns the stage's thread and
/// handed to `forward` explicitly, so the weights stay immutable and shareable.
#[derive(Debug, Default)]
pub struct KvStore {
    pub(crate) seqs: HashMap<SeqId, SeqCache>,
}

impl KvStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Positions cached for a sequence (0 if unknown).
    pub fn len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.len)
    }

    /// Number of sequences held.
    pub fn n_seqs(&self) -> usize {
        self.seqs.len()
    }

    /// True when no sequence is held.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Frees a sequence's caches.
    pub fn release(&mut self, seq: SeqId) -> bool {
        self.seqs.remove(&seq).is_some()
    }

    /// Bytes held by all caches.
    pub fn bytes(&self) -> usize {
        self.seqs
            .values()
            .flat_map(|s| &s.layers)
            .map(|l| (l.k.capacity() + l.v.capacity()) * 4)
            .sum()
    }
}
