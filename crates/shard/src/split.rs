//! `split`: one GGUF per stage holding only that stage's tensors, all model metadata and the
//! `pipeshard.*` keys, plus `manifest.json`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Content, Value};
use candle_core::quantized::QTensor;
use candle_core::Device;
use pipeshard_model::stage::keys;
use pipeshard_model::{LayerRange, ModelConfig};

use crate::manifest::{Manifest, SourceEntry, StageEntry, FORMAT};
use crate::{byte_bar, invalid, io_err, sha256_file, Result, ShardError};

/// Parses `0..15,15..28` into ranges.
pub fn parse_layers(spec: &str) -> Result<Vec<LayerRange>> {
    spec.split(',')
        .map(|part| {
            let part = part.trim();
            let (a, b) = part
                .split_once("..")
                .ok_or_else(|| ShardError::Ranges(format!("`{part}` is not START..END")))?;
            let num = |s: &str| {
                s.trim().parse::<usize>().map_err(|_| {
                    ShardError::Ranges(format!("`{part}`: `{s}` is not a layer number"))
                })
            };
            let (a, b) = (num(a)?, num(b)?);
            if a >= b {
                return Err(ShardError::Ranges(format!("`{part}` is empty")));
            }
            Ok(LayerRange::new(a, b))
        })
        .collect()
}

/// Layer ranges for `stages` stages on machines alike: the split whose costliest stage costs
/// least ([`LayerRange::balanced_split`]), counting the last stage's output layer. On one
/// core, a 1.5B decode step is ~5.8 layers' time in its output layer and a 0.5B's ~11; an
/// even split by layer count left the last stage the bottleneck.
///
/// A weight's cost is its bytes (streamed from memory once per step) plus its elements
/// (multiplied once per row), the bytes scaled by the model's mean bytes per layer weight so
/// both count equally: our kernels overlap streaming and arithmetic poorly, and this sum
/// matched the measured output-layer share of both Qwen models within 7% (bytes alone
/// overstate it by a fifth to a third, elements alone understate it by as much).
pub fn plan(c: &Content, n_layers: usize, stages: usize) -> Result<Vec<LayerRange>> {
    let n = n_layers;
    if stages == 0 || stages > n {
        return Err(ShardError::Ranges(format!(
            "cannot split {n} layers into {stages} stages"
        )));
    }
    let size = |name: &str| {
        c.tensor_infos.get(name).map_or((0.0, 0.0), |t| {
            let bytes = pipeshard_model::gguf::GgufFile::tensor_nbytes(t) as f64;
            (bytes, t.shape.elem_count() as f64)
        })
    };
    let mut layers = vec![(0.0, 0.0); n];
    for name in c.tensor_infos.keys() {
        let layer = name
            .strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse::<usize>().ok());
        if let Some(l) = layer.filter(|&l| l < n) {
            let (b, e) = size(name);
            layers[l].0 += b;
            layers[l].1 += e;
        }
    }
    let (bytes, elems) = layers
        .iter()
        .fold((0.0, 0.0), |(b, e), l| (b + l.0, e + l.1));
    let per_elem = if elems > 0.0 { bytes / elems } else { 1.0 };
    let cost = |(b, e): (f64, f64)| b / per_elem + e;
    let head = if c.tensor_infos.contains_key("output.weight") {
        size("output.weight")
    } else {
        size("token_embd.weight") // tied embeddings
    };
    let costs: Vec<f64> = layers.into_iter().map(cost).collect();
    Ok(LayerRange::balanced_split(&costs, cost(head), stages))
}

/// Names of the tensors stage `range` needs, in file order.
fn stage_tensors(c: &Content, config: &ModelConfig, range: LayerRange) -> Vec<String> {
    let mut names = Vec::new();
    if range.start == 0 {
        names.push("token_embd.weight".to_string());
    }
    let mut layer_names: Vec<&String> = c.tensor_infos.keys().collect();
    layer_names.sort();
    for i in range.start..range.end {
        let prefix = format!("blk.{i}.");
        names.extend(
            layer_names
                .iter()
                .filter(|n| n.starts_with(&prefix))
                .map(|n| n.to_string()),
        );
    }
    if range.end == config.n_layers {
        names.push("output_norm.weight".to_string());
        if c.tensor_infos.contains_key("output.weight") {
            names.push("output.weight".to_string());
        } else if range.start != 0 {
            // Tied embeddings: the last stage needs the table as its lm_head.
            names.push("token_embd.weight".to_string());
        }
    }
    names
}

/// Splits `model` into stages with the given ranges, writing shards and `manifest.json` into
/// `out`. Returns the manifest.
pub fn split(model: &Path, ranges: &[LayerRange], out: &Path, quiet: bool) -> Result<Manifest> {
    let mut f = File::open(model).map_err(io_err(model))?;
    let c = Content::read(&mut f)
        .map_err(|e| invalid(model, format!("not a readable GGUF file: {e}")))?;
    if c.metadata.contains_key(keys::SOURCE_SHA256) {
        return Err(invalid(
            model,
            "is already a pipeshard shard; split the original model",
        ));
    }
    let config = ModelConfig::from_gguf(&c).map_err(|e| invalid(model, e.to_string()))?;
    LayerRange::check_tiling(ranges, config.n_layers)
        .map_err(|e| ShardError::Ranges(format!("{e} (model {})", model.display())))?;
    std::fs::create_dir_all(out).map_err(io_err(out))?;

    let bytes = std::fs::metadata(model).map_err(io_err(model))?.len();
    let bar = byte_bar(bytes, "hashing", quiet);
    let sha = sha256_file(model, &bar)?;
    bar.finish_and_clear();

    let plan: Vec<Vec<String>> = ranges
        .iter()
        .map(|r| stage_tensors(&c, &config, *r))
        .collect();
    let total: u64 = plan
        .iter()
        .flatten()
        .map(|n| pipeshard_model::gguf::GgufFile::tensor_nbytes(&c.tensor_infos[n]) as u64)
        .sum();
    let bar = byte_bar(total, "splitting", quiet);
    let mut stages = Vec::new();
    for (i, (range, names)) in ranges.iter().zip(&plan).enumerate() {
        let mut tensors: Vec<(String, QTensor)> = Vec::with_capacity(names.len());
        for name in names {
            let t = c
                .tensor(&mut f, name, &Device::Cpu)
                .map_err(|e| invalid(model, format!("reading tensor `{name}`: {e}")))?;
            bar.inc(pipeshard_model::gguf::GgufFile::tensor_nbytes(&c.tensor_infos[name]) as u64);
            tensors.push((name.clone(), t));
        }
        let mut meta: Vec<(String, Value)> = c
            .metadata
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        meta.sort_by(|a, b| a.0.cmp(&b.0));
        meta.push((keys::STAGE_INDEX.into(), Value::U32(i as u32)));
        meta.push((keys::STAGE_COUNT.into(), Value::U32(ranges.len() as u32)));
        meta.push((keys::LAYER_START.into(), Value::U32(range.start as u32)));
        meta.push((keys::LAYER_END.into(), Value::U32(range.end as u32)));
        meta.push((keys::SOURCE_SHA256.into(), Value::String(sha.clone())));
        let file = format!("stage-{i}.gguf");
        let path = out.join(&file);
        {
            let meta_refs: Vec<(&str, &Value)> =
                meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
            let t_refs: Vec<(&str, &QTensor)> =
                tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
            let mut w = BufWriter::new(File::create(&path).map_err(io_err(&path))?);
            gguf_file::write(&mut w, &meta_refs, &t_refs)
                .map_err(|e| invalid(&path, format!("writing shard: {e}")))?;
            w.flush().map_err(io_err(&path))?;
        }
        let bytes = std::fs::metadata(&path).map_err(io_err(&path))?.len();
        let shard_sha = sha256_file(&path, &indicatif::ProgressBar::hidden())?;
        stages.push(StageEntry {
            index: i,
            layers: *range,
            file,
            bytes,
            sha256: shard_sha,
        });
    }
    bar.finish_and_clear();
    let manifest = Manifest {
        format: FORMAT,
        model: SourceEntry {
            file: model
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            sha256: sha,
            bytes,
        },
        config,
        stages,
    };
    manifest.save(&out.join("manifest.json"))?;
    Ok(manifest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ranges() {
        let r = parse_layers("0..15, 15..28").unwrap();
        assert_eq!(r, vec![LayerRange::new(0, 15), LayerRange::new(15, 28)]);
        for bad in ["0-15", "3..3", "a..4", ""] {
            assert!(parse_layers(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_plan_weighs_the_output_layer() {
        use candle_core::quantized::GgmlDType;
        // 28 layers of one Q8_0 matrix each and an output layer as big as six of them, in
        // Q8_0 (`tied`: the embedding table instead): 28 + 6 = 34 = 2 x 17.
        for tied in [false, true] {
            let info = |rows: usize, dtype: GgmlDType| gguf_file::TensorInfo {
                ggml_dtype: dtype,
                shape: candle_core::Shape::from((rows, 256)),
                offset: 0,
            };
            let mut t = std::collections::HashMap::new();
            for i in 0..28 {
                t.insert(
                    format!("blk.{i}.ffn_down.weight"),
                    info(64, GgmlDType::Q8_0),
                );
                t.insert(format!("blk.{i}.attn_norm.weight"), info(1, GgmlDType::F32));
            }
            let head = if tied {
                "token_embd.weight"
            } else {
                "output.weight"
            };
            t.insert(head.into(), info(6 * 64, GgmlDType::Q8_0));
            let c = Content {
                magic: gguf_file::VersionedMagic::GgufV3,
                metadata: Default::default(),
                tensor_infos: t,
                tensor_data_offset: 0,
            };
            let r = plan(&c, 28, 2).unwrap();
            assert_eq!(
                r,
                vec![LayerRange::new(0, 17), LayerRange::new(17, 28)],
                "tied {tied}"
            );
            assert_eq!(plan(&c, 28, 1).unwrap(), vec![LayerRange::new(0, 28)]);
            let r = plan(&c, 28, 4).unwrap();
            LayerRange::check_tiling(&r, 28).unwrap();
            assert_eq!(r[3].len(), 3, "{r:?}"); // 34 / 4 = 8.5: 3 layers and the output
            for bad in [0, 29] {
                let e = plan(&c, 28, bad).unwrap_err().to_string();
                assert!(e.contains(&format!("28 layers into {bad} stages")), "{e}");
            }
        }
    }
}
