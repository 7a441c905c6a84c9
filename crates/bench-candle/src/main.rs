//! `candle-ref MODEL.gguf [PROMPT_TOKENS] [GEN_TOKENS] [RUNS]`: prefill and decode tok/s of
//! candle-transformers' `quantized_qwen2` on the same workload as `pipeshard bench decode`
//! (median of runs), printed as one JSON object. Threads: `CANDLE_NUM_THREADS` /
//! `RAYON_NUM_THREADS`. Kept out of the default build: it exists only to be compared against.

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_qwen2::ModelWeights;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .context("usage: candle-ref MODEL.gguf [PROMPT] [GEN] [RUNS]")?;
    let num = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (prompt_n, gen_n, runs) = (num(2, 128), num(3, 64), num(4, 5));
    let mut f = std::fs::File::open(path)?;
    let content = gguf_file::Content::read(&mut f)?;
    let mut model = ModelWeights::from_gguf(content, &mut f, &Device::Cpu)?;
    let prompt: Vec<u32> = (0..prompt_n as u32)
        .map(|i| 100 + (i * 7919) % 30000)
        .collect();
    let (mut pre, mut dec) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let x = Tensor::new(prompt.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
        let t0 = Instant::now();
        let mut logits = model.forward(&x, 0)?;
        pre.push(prompt_n as f64 / t0.elapsed().as_secs_f64());
        let t1 = Instant::now();
        for k in 0..gen_n {
            let next = logits.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?;
            let x = Tensor::new(&[next], &Device::Cpu)?.unsqueeze(0)?;
            logits = model.forward(&x, prompt_n + k)?;
        }
        dec.push(gen_n as f64 / t1.elapsed().as_secs_f64());
    }
    println!(
        "{}",
        serde_json::json!({"prefill_tok_s": median(pre), "decode_tok_s": median(dec), "runs": runs})
    );
    Ok(())
}
