//! Model files: fetching the known models, splitting a GGUF into per-stage shards with a
//! manifest, inspecting and verifying them, and resolving what `--model` names.

pub mod fetch;
pub mod manifest;
pub mod source;
pub mod split;

use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

pub use fetch::{cache_dir, fetch, known_model, KnownModel, KNOWN_MODELS};
pub use manifest::{Manifest, ShardIdentity, StageEntry};
pub use source::ModelSource;
pub use split::{parse_layers, plan, split};

/// What went wrong with a model file, a shard or a manifest. Every message names the file.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// A model or shard could not be parsed or used.
    #[error(transparent)]
    Model(#[from] pipeshard_model::ModelError),
    /// A shard or manifest does not match what it should be.
    #[error("{path}: {msg}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A layer range specification is wrong.
    #[error("bad layer ranges: {0}")]
    Ranges(String),
    /// Fetching a model failed.
    #[error("fetching {name}: {msg}")]
    Fetch {
        /// Model name.
        name: String,
        /// What failed.
        msg: String,
    },
}

/// Result type of this crate.
pub type Result<T, E = ShardError> = std::result::Result<T, E>;

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ShardError + '_ {
    move |source| ShardError::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub(crate) fn invalid(path: &Path, msg: impl Into<String>) -> ShardError {
    ShardError::Invalid {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

/// sha256 of a file, hex, reporting progress in bytes to `bar`.
pub fn sha256_file(path: &Path, bar: &indicatif::ProgressBar) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(io_err(path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        bar.inc(n as u64);
    }
    Ok(hex::encode(h.finalize()))
}

/// A byte progress bar on stderr (hidden when stderr is not a terminal or `quiet`).
pub fn byte_bar(len: u64, msg: &str, quiet: bool) -> indicatif::ProgressBar {
    if quiet {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg:>12} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    bar.set_message(msg.to_string());
    bar
}
