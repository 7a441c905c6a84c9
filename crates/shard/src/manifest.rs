//! `manifest.json`: what a split wrote, and the checks that a set of shards is what it claims.

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::Content;
use pipeshard_model::stage::keys;
use pipeshard_model::{LayerRange, ModelConfig};
use serde::{Deserialize, Serialize};

use crate::{byte_bar, invalid, io_err, sha256_file, Result};

/// Version of the manifest format.
pub const FORMAT: u32 = 1;

/// The source model of a split.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceEntry {
    /// File name of the source model.
    pub file: String,
    /// Its sha256.
    pub sha256: String,
    /// Its size.
    pub bytes: u64,
}

/// One stage's shard.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageEntry {
    /// Position in the ring.
    pub index: usize,
    /// Layers held.
    pub layers: LayerRange,
    /// Shard file name, relative to the manifest.
    pub file: String,
    /// Shard size.
    pub bytes: u64,
    /// Shard sha256.
    pub sha256: String,
}

/// What `split` wrote.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version.
    pub format: u32,
    /// The model split.
    pub model: SourceEntry,
    /// Its hyper-parameters.
    pub config: ModelConfig,
    /// The stages, in ring order.
    pub stages: Vec<StageEntry>,
}

impl Manifest {
    /// Reads a manifest and checks that its stages tile the model's layers.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(io_err(path))?;
        let m: Manifest = serde_json::from_str(&text)
            .map_err(|e| invalid(path, format!("not a pipeshard manifest: {e}")))?;
        if m.format != FORMAT {
            return Err(invalid(
                path,
                format!("manifest format {} (this build reads {FORMAT})", m.format),
            ));
        }
        let ranges: Vec<LayerRange> = m.stages.iter().map(|s| s.layers).collect();
        LayerRange::check_tiling(&ranges, m.config.n_layers)
            .map_err(|e| invalid(path, e.to_string()))?;
        for (i, s) in m.stages.iter().enumerate() {
            if s.index != i {
                return Err(invalid(
                    path,
                    format!("stage {i} is listed with index {}", s.index),
                ));
            }
        }
        Ok(m)
    }

    /// Writes the manifest as pretty JSON.
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).expect("manifest serializes");
        std::fs::write(path, text + "\n").map_err(io_err(path))
    }

    /// Path of a stage's shard, next to the manifest.
    pub fn stage_path(manifest_path: &Path, entry: &StageEntry) -> PathBuf {
        manifest_path
            .parent()
            .unwrap_or(Path::new("."))
            .join(&entry.file)
    }

    /// Checks every shard: present, full size, right sha256 (when `hash`), and carrying this
    /// model's identity and its own stage's range. Errors name the file and what is wrong.
    pub fn verify(&self, manifest_path: &Path, hash: bool, quiet: bool) -> Result<()> {
        for s in &self.stages {
            self.verify_stage(manifest_path, s, hash, quiet)?;
        }
        Ok(())
    }

    /// Checks one stage's shard: present, full size, the right identity and (if `hash`) sha256.
    pub fn verify_stage(
        &self,
        manifest_path: &Path,
        s: &StageEntry,
        hash: bool,
        quiet: bool,
    ) -> Result<()> {
        {
            let p = Self::stage_path(manifest_path, s);
            let meta = std::fs::metadata(&p)
                .map_err(|e| invalid(&p, format!("stage {} shard is missing: {e}", s.index)))?;
            if meta.len() != s.bytes {
                let what = if meta.len() < s.bytes {
                    "truncated"
                } else {
                    "the wrong size"
                };
                return Err(invalid(
                    &p,
                    format!(
                        "{what}: {} bytes, the manifest says {}",
                        meta.len(),
                        s.bytes
                    ),
                ));
            }
            check_shard_identity(&p, s.index, self.stages.len(), s.layers, &self.model.sha256)?;
            if hash {
                let bar = byte_bar(s.bytes, &format!("verify {}", s.index), quiet);
                let sha = sha256_file(&p, &bar)?;
                bar.finish_and_clear();
                if sha != s.sha256 {
                    return Err(invalid(
                        &p,
                        format!(
                            "sha256 mismatch: file has {sha}, the manifest says {}",
                            s.sha256
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Who a shard says it is: its `pipeshard.*` metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardIdentity {
    /// Position in the ring.
    pub index: usize,
    /// Number of stages of the split.
    pub count: usize,
    /// Layers held.
    pub layers: LayerRange,
    /// sha256 of the source model file.
    pub source_sha256: String,
}

impl ShardIdentity {
    /// Reads a shard's identity; fails on a file that is not a pipeshard shard.
    pub fn read(path: &Path) -> Result<Self> {
        let mut f = std::fs::File::open(path).map_err(io_err(path))?;
        let c = Content::read(&mut f)
            .map_err(|e| invalid(path, format!("not a readable GGUF: {e}")))?;
        Self::from_content(path, &c)
    }

    fn from_content(path: &Path, c: &Content) -> Result<Self> {
        let num = |k: &str| {
            c.metadata
                .get(k)
                .and_then(|v| v.to_u32().ok())
                .map(|v| v as usize)
                .ok_or_else(|| invalid(path, format!("not a pipeshard shard (no {k})")))
        };
        let source_sha256 = c
            .metadata
            .get(keys::SOURCE_SHA256)
            .and_then(|v| v.to_string().ok())
            .cloned()
            .ok_or_else(|| invalid(path, "not a pipeshard shard (no pipeshard.source_sha256)"))?;
        Ok(Self {
            index: num(keys::STAGE_INDEX)?,
            count: num(keys::STAGE_COUNT)?,
            layers: LayerRange::new(num(keys::LAYER_START)?, num(keys::LAYER_END)?),
            source_sha256,
        })
    }
}

/// Checks a shard's `pipeshard.*` metadata against what it should hold.
pub fn check_shard_identity(
    path: &Path,
    index: usize,
    count: usize,
    layers: LayerRange,
    source_sha: &str,
) -> Result<()> {
    let id = ShardIdentity::read(path)?;
    if id.source_sha256 != source_sha {
        return Err(invalid(
            path,
            format!(
                "shard of another model: source sha256 {}, expected {source_sha}",
                id.source_sha256
            ),
        ));
    }
    if (id.index, id.count, id.layers) != (index, count, layers) {
        return Err(invalid(
            path,
            format!(
                "shard metadata says stage {} of {}, layers {}; expected stage {index} of {count}, layers {layers}",
                id.index, id.count, id.layers
            ),
        ));
    }
    Ok(())
}
