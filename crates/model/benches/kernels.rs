//! The quantized matmul kernels on one thread, at the shapes of our models' layers,
//! for 1 to 8 activation rows: `cargo bench -p pipeshard-model --bench kernels`.
//! Throughput is reported in weight bytes read per second.

use candle_core::quantized::k_quants::{BlockQ4K, BlockQ4_1, BlockQ5_0, BlockQ6K, BlockQ8_0};
use candle_core::quantized::{GgmlDType, GgmlType};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pipeshard_model::qweight::QWeight;

fn quantize<T: GgmlType + 'static>(vals: &[f32]) -> Vec<u8> {
    let mut blocks = vec![T::zeros(); vals.len() / T::BLCK_SIZE];
    T::from_float(vals, &mut blocks);
    let size = std::mem::size_of::<T>();
    // SAFETY: the blocks are plain-old-data; reading their bytes.
    unsafe { std::slice::from_raw_parts(blocks.as_ptr() as *const u8, blocks.len() * size) }
        .to_vec()
}

fn weight(dtype: GgmlDType, rows: usize, cols: usize) -> QWeight {
    let mut s = 1u64;
    let vals: Vec<f32> = (0..rows * cols)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect();
    let bytes = match dtype {
        GgmlDType::Q4K => quantize::<BlockQ4K>(&vals),
        GgmlDType::Q6K => quantize::<BlockQ6K>(&vals),
        GgmlDType::Q5_0 => quantize::<BlockQ5_0>(&vals),
        GgmlDType::Q4_1 => quantize::<BlockQ4_1>(&vals),
        _ => quantize::<BlockQ8_0>(&vals),
    };
    QWeight::from_bytes("w", dtype, rows, cols, &bytes).expect("weight")
}

fn matmul(c: &mut Criterion) {
    // The 1.5B's MLP gate (Q4_K, 8960 x 1536) and down (Q6_K in Q4_K_M, 1536 x 8960)
    // projections, the 0.5B's MLP gate (Q5_0, 4864 x 896) and lm_head (Q8_0, here a slice of
    // 16384 of its 151936 rows), and SmolLM2's MLP gate (Q4_1, 1536 x 576). `q4k_512x1536`
    // fits in L2: the kernels' compute-bound rate, without memory in the way.
    for (name, dtype, rows, cols) in [
        ("q4k_8960x1536", GgmlDType::Q4K, 8960, 1536),
        ("q4k_512x1536", GgmlDType::Q4K, 512, 1536),
        ("q6k_1536x8960", GgmlDType::Q6K, 1536, 8960),
        ("q6k_65536x1536", GgmlDType::Q6K, 65536, 1536),
        ("q4k_65536x1536", GgmlDType::Q4K, 65536, 1536),
        ("q5_0_4864x896", GgmlDType::Q5_0, 4864, 896),
        ("q8_0_16384x896", GgmlDType::Q8_0, 16384, 896),
        ("q4_1_1536x576", GgmlDType::Q4_1, 1536, 576),
    ] {
        let w = weight(dtype, rows, cols);
        let mut g = c.benchmark_group(name);
        g.throughput(Throughput::Bytes(w.nbytes() as u64));
        for n in [1usize, 2, 4, 5, 8] {
            let xs: Vec<f32> = (0..n * cols)
                .map(|k| ((k % 97) as f32 - 48.0) / 50.0)
                .collect();
            let mut out = vec![0f32; n * rows];
            g.bench_with_input(BenchmarkId::new("rows", n), &n, |b, &n| {
                b.iter(|| w.matmul(&xs, n, &mut out))
            });
        }
        g.finish();
    }
}

criterion_group!(benches, matmul);
criterion_main!(benches);
