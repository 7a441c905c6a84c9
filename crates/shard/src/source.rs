//! What `--model` names: a GGUF file, a `manifest.json` written by `split`, or the name of a
//! known model (fetched if absent).

use std::path::{Path, PathBuf};

use pipeshard_model::{ModelError, Stage};

use crate::fetch::{fetch, known_model, KNOWN_MODELS};
use crate::manifest::Manifest;
use crate::{Result, ShardError};

/// A resolved model.
#[derive(Debug, Clone)]
pub enum ModelSource {
    /// A whole model in one GGUF file.
    Gguf(PathBuf),
    /// Shards listed by a manifest.
    Manifest {
        /// The manifest's path.
        path: PathBuf,
        /// Its content.
        manifest: Manifest,
    },
}

impl ModelSource {
    /// Resolves `arg`, fetching a known model name when it is not yet cached.
    pub fn resolve(arg: &str, quiet: bool) -> Result<Self> {
        let p = Path::new(arg);
        let manifest_path = if p.is_dir() {
            p.join("manifest.json")
        } else {
            p.to_path_buf()
        };
        if manifest_path.extension().is_some_and(|e| e == "json") {
            let manifest = Manifest::load(&manifest_path)?;
            return Ok(Self::Manifest {
                path: manifest_path,
                manifest,
            });
        }
        if p.exists() {
            return Ok(Self::Gguf(p.to_path_buf()));
        }
        if let Some(m) = known_model(arg) {
            return Ok(Self::Gguf(fetch(m, quiet)?));
        }
        let names: Vec<&str> = KNOWN_MODELS.iter().map(|m| m.name).collect();
        Err(ShardError::Invalid {
            path: p.to_path_buf(),
            msg: format!(
                "no such file, and not a known model name ({})",
                names.join(", ")
            ),
        })
    }

    /// A GGUF file holding the tokenizer and full metadata (the model, or stage 0's shard).
    pub fn metadata_file(&self) -> PathBuf {
        match self {
            Self::Gguf(p) => p.clone(),
            Self::Manifest { path, manifest } => Manifest::stage_path(path, &manifest.stages[0]),
        }
    }

    /// Loads the stages: a manifest's own (after verifying every shard), or a GGUF split
    /// evenly into `stages` (default 1). Each stage computes on `threads` threads.
    pub fn load_stages(
        &self,
        stages: Option<usize>,
        threads: usize,
        quiet: bool,
    ) -> Result<Vec<Stage>> {
        let mut out = match self {
            Self::Gguf(p) => {
                let g = pipeshard_model::gguf::GgufFile::open(p)?;
                let config = pipeshard_model::ModelConfig::from_gguf(&g.content)?;
                crate::plan(&g.content, config.n_layers, stages.unwrap_or(1))?
                    .into_iter()
                    .map(|r| Stage::load(p, Some(r)))
                    .collect::<Result<Vec<_>, ModelError>>()?
            }
            Self::Manifest { path, manifest } => {
                if let Some(n) = stages {
                    if n != manifest.stages.len() {
                        return Err(ShardError::Invalid {
                            path: path.clone(),
                            msg: format!("has {} stages, not {n}", manifest.stages.len()),
                        });
                    }
                }
                manifest.verify(path, true, quiet)?;
                manifest
                    .stages
                    .iter()
                    .map(|s| Stage::load(&Manifest::stage_path(path, s), Some(s.layers)))
                    .collect::<Result<Vec<_>, ModelError>>()?
            }
        };
        for s in &mut out {
            s.set_threads(threads)?;
        }
        Ok(out)
    }
}
