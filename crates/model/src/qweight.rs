//! Quantized weights kept in their block format (repacked on load for our kernels' interleaved
//! layouts), and a row-wise exact matmul over them.
//!
//! Each output element is computed by one fixed sequence of operations per (weight row,
//! activation row), whatever the number of activation rows or threads: our kernels
//! ([`crate::kernels`]) for Q8_0, Q4_1, Q5_0, Q4_K and Q6_K, candle's per-row `vec_dot` for the
//! other formats. So a token's result never depends on which other tokens share the pass.
//! (candle's own `QMatMul` switches to repacked multi-row tiles for batches, which round
//! differently, and keeps a second copy of the weights.) Threads split the output rows, so
//! thread count does not change results either.

use candle_core::quantized::k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K,
    BlockQ8_0,
};
use candle_core::quantized::{GgmlDType, GgmlType};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::ModelError;
use crate::kernels::{self, Format, Isa, Quant32, QuantK};

/// A `[rows, cols]` weight matrix in its storage format.
pub struct QWeight {
    rows: usize,
    cols: usize,
    dtype: GgmlDType,
    blocks: Box<dyn RowKernel>,
}

impl std::fmt::Debug for QWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QWeight[{}x{} {:?}]", self.rows, self.cols, self.dtype)
    }
}

/// Type-erased operations over one block format.
trait RowKernel: Send + Sync {
    fn matmul(&self, rows: usize, cols: usize, xs: &[f32], n: usize, out: &mut [f32], isa: Isa);
    fn dequantize_row(&self, row: usize, cols: usize, out: &mut [f32]);
    fn nbytes(&self) -> usize;
}

struct Blocks<T: GgmlType>(Vec<T>);

/// Allocates `nbytes` worth of blocks and lets `fill` write their raw GGUF bytes straight
/// into them: no second copy of the weights, even transiently.
fn read_blocks<T: GgmlType>(
    nbytes: usize,
    fill: impl FnOnce(&mut [u8]) -> Result<(), ModelError>,
) -> Result<Vec<T>, ModelError> {
    let size = std::mem::size_of::<T>();
    let mut v: Vec<T> = vec![T::zeros(); nbytes / size];
    // SAFETY: every GGML block type is a `repr(C)` struct of integers, f16 and byte arrays,
    // valid for any bit pattern, so viewing the initialized blocks as bytes and writing any
    // bytes into them is sound; the slice covers exactly the vector's elements.
    let bytes =
        unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, v.len() * size) };
    fill(bytes)?;
    Ok(v)
}

/// The fewest output rows handed to one rayon task: enough work to amortize scheduling (two of
/// the kernels' eight-row groups: what one 512-bit pass takes).
const ROWS_PER_TASK: usize = 16;

/// Tasks per thread a matmul is cut into, at most: enough for the threads to even out, few
/// enough that a 151,936-row lm_head is not 9,496 tasks (and as many slices per token).
const TASKS_PER_THREAD: usize = 16;

/// Runs `task(first_row, outs)` over the output rows of the token-major `out` (`[n, rows]`),
/// split into tasks of a multiple of [`ROWS_PER_TASK`] rows on the thread pool: `outs[i]` is
/// token `i`'s outputs for weight rows `first_row..first_row + outs[i].len()`. Each task writes
/// its outputs in place, so nothing is transposed after. How rows are split never changes a
/// result: every row is computed alone.
fn for_row_tasks(
    rows: usize,
    n: usize,
    out: &mut [f32],
    task: impl Fn(usize, &mut [&mut [f32]]) + Sync,
) {
    let threads = rayon::current_num_threads();
    if threads <= 1 || rows < 2 * ROWS_PER_TASK {
        let mut outs: Vec<&mut [f32]> = out.chunks_exact_mut(rows).collect();
        task(0, &mut outs);
        return;
    }
    let per = rows
        .div_ceil(threads * TASKS_PER_THREAD)
        .next_multiple_of(ROWS_PER_TASK);
    // Each token's row is cut into the tasks' pieces; the pieces are gathered task by task,
    // so every task gets its own disjoint slices of all the tokens.
    let tasks = rows.div_ceil(per);
    let mut pieces: Vec<_> = out
        .chunks_exact_mut(rows)
        .map(|t| t.chunks_mut(per))
        .collect();
    let mut slots = Vec::with_capacity(tasks * n);
    for _ in 0..tasks {
        for p in &mut pieces {
            slots.push(p.next().expect("every token has a piece for every task"));
        }
    }
    slots
        .par_chunks_mut(n)
        .enumerate()
        .for_each(|(c, outs)| task(c * per, outs));
}

/// Our own kernels (see [`crate::kernels`]) over the raw GGUF bytes.
struct Own {
    fmt: Format,
    data: Vec<u8>,
}

impl RowKernel for Own {
    fn matmul(&self, rows: usize, cols: usize, xs: &[f32], n: usize, out: &mut [f32], isa: Isa) {
        // Activations quantized once for all weight rows, the way the format's kernel wants
        // (on the pool when there are several: each row alone, so the result is the same).
        fn quantize<Q: Send>(xs: &[f32], cols: usize, n: usize, f: fn(&[f32]) -> Q) -> Vec<Q> {
            if n > 1 && rayon::current_num_threads() > 1 {
                xs.par_chunks_exact(cols).map(f).collect()
            } else {
                xs.chunks_exact(cols).map(f).collect()
            }
        }
        enum Acts {
            B32(Vec<Quant32>),
            K(Vec<QuantK>),
        }
        let acts = if self.fmt.is_k() {
            Acts::K(quantize(xs, cols, n, QuantK::quantize))
        } else {
            Acts::B32(quantize(xs, cols, n, Quant32::quantize))
        };
        let (fmt, data) = (self.fmt, &self.data[..]);
        for_row_tasks(rows, n, out, |first_row, outs| match &acts {
            Acts::B32(q) => kernels::q32::matmul(fmt, data, first_row, cols, q, outs, isa),
            Acts::K(q) => kernels::kquant::matmul(fmt, data, first_row, cols, q, outs, isa),
        });
    }

    fn dequantize_row(&self, row: usize, cols: usize, out: &mut [f32]) {
        self.fmt.dequantize_row(&self.data, row, cols, out);
    }

    fn nbytes(&self) -> usize {
        self.data.len()
    }
}

impl<T: GgmlType + 'static> RowKernel for Blocks<T> {
    fn matmul(&self, rows: usize, cols: usize, xs: &[f32], n: usize, out: &mut [f32], _isa: Isa) {
        let bw = cols / T::BLCK_SIZE;
        let bx = cols / T::VecDotType::BLCK_SIZE;
        let mut qx = vec![T::VecDotType::zeros(); n * bx];
        for i in 0..n {
            T::VecDotType::from_float(&xs[i * cols..(i + 1) * cols], &mut qx[i * bx..(i + 1) * bx]);
        }
        let dot = |r: usize, i: usize| {
            T::vec_dot(
                cols,
                &self.0[r * bw..(r + 1) * bw],
                &qx[i * bx..(i + 1) * bx],
            )
        };
        for_row_tasks(rows, n, out, |first_row, outs| {
            for (i, o) in outs.iter_mut().enumerate() {
                for (k, v) in o.iter_mut().enumerate() {
                    *v = dot(first_row + k, i);
                }
            }
        });
    }

    fn dequantize_row(&self, row: usize, cols: usize, out: &mut [f32]) {
        let bw = cols / T::BLCK_SIZE;
        T::to_float(&self.0[row * bw..(row + 1) * bw], &mut out[..cols]);
    }

    fn nbytes(&self) -> usize {
        self.0.len() * std::mem::size_of::<T>()
    }
}

impl QWeight {
    /// Builds a weight from GGUF bytes; `name` is used in errors.
    pub fn from_bytes(
        name: &str,
        dtype: GgmlDType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Result<Self, ModelError> {
        Self::read(name, dtype, rows, cols, |buf| {
            if buf.len() != bytes.len() {
                return Err(ModelError::Gguf {
                    path: Default::default(),
                    msg: format!(
                        "tensor `{name}`: {} bytes, expected {}",
                        bytes.len(),
                        buf.len()
                    ),
                });
            }
            buf.copy_from_slice(bytes);
            Ok(())
        })
    }

    /// Builds a `[rows, cols]` weight of type `dtype`, with `fill` writing its raw bytes.
    pub fn read<F: FnOnce(&mut [u8]) -> Result<(), ModelError>>(
        name: &str,
        dtype: GgmlDType,
        rows: usize,
        cols: usize,
        fill: F,
    ) -> Result<Self, ModelError> {
        if !cols.is_multiple_of(dtype.block_size()) {
            return Err(ModelError::UnsupportedTensorType {
                name: name.to_string(),
                dtype: format!("{dtype:?} with row length {cols} not a multiple of its block"),
            });
        }
        let nbytes = rows * cols / dtype.block_size() * dtype.type_size();
        fn b<T: GgmlType + 'static>(
            n: usize,
            fill: impl FnOnce(&mut [u8]) -> Result<(), ModelError>,
        ) -> Result<Box<dyn RowKernel>, ModelError> {
            Ok(Box::new(Blocks::<T>(read_blocks(n, fill)?)))
        }
        let own = |fmt: Format, fill: F| -> Result<Box<dyn RowKernel>, ModelError> {
            let mut data = vec![0u8; nbytes];
            fill(&mut data)?;
            match fmt {
                Format::Q4K => data = kernels::kquant::repack_q4k(&data, rows, cols),
                Format::Q6K => data = kernels::kquant::repack_q6k(&data, rows, cols),
                _ => data = kernels::q32::repack(fmt, &data, rows, cols),
            }
            Ok(Box::new(Own { fmt, data }))
        };
        // The interleaved layouts take rows in groups of eight (every model we know has them);
        // other row counts keep candle's row-wise kernels.
        let eights = rows.is_multiple_of(8);
        let blocks = match dtype {
            GgmlDType::Q8_0 if eights => own(Format::Q8_0, fill)?,
            GgmlDType::Q4_1 if eights => own(Format::Q4_1, fill)?,
            GgmlDType::Q5_0 if eights => own(Format::Q5_0, fill)?,
            GgmlDType::Q4K if eights => own(Format::Q4K, fill)?,
            GgmlDType::Q6K if eights => own(Format::Q6K, fill)?,
            GgmlDType::Q8_0 => b::<BlockQ8_0>(nbytes, fill)?,
            GgmlDType::Q4_1 => b::<BlockQ4_1>(nbytes, fill)?,
            GgmlDType::Q5_0 => b::<BlockQ5_0>(nbytes, fill)?,
            GgmlDType::Q4K => b::<BlockQ4K>(nbytes, fill)?,
            GgmlDType::Q6K => b::<BlockQ6K>(nbytes, fill)?,
            GgmlDType::F32 => b::<f32>(nbytes, fill)?,
            GgmlDType::F16 => b::<f16>(nbytes, fill)?,
            GgmlDType::BF16 => b::<bf16>(nbytes, fill)?,
            GgmlDType::Q4_0 => b::<BlockQ4_0>(nbytes, fill)?,
            GgmlDType::Q5_1 => b::<BlockQ5_1>(nbytes, fill)?,
            GgmlDType::Q2K => b::<BlockQ2K>(nbytes, fill)?,
            GgmlDType::Q3K => b::<BlockQ3K>(nbytes, fill)?,
            GgmlDType::Q5K => b::<BlockQ5K>(nbytes, fill)?,
            other => {
                return Err(ModelError::UnsupportedTensorType {
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        Ok(Self {
            rows,
            cols,
            dtype,
            blocks,
        })
    }

    /// Output size.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Input size.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Storage format.
    pub fn dtype(&self) -> GgmlDType {
        self.dtype
    }
    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        self.blocks.nbytes()
    }

    /// `out[i] = W · xs[i]` for `n` input rows: `xs` is `[n, cols]`, `out` is `[n, rows]`.
    pub fn matmul(&self, xs: &[f32], n: usize, out: &mut [f32]) {
        self.matmul_first(xs, n, self.rows, out);
    }

    /// [`QWeight::matmul`] over the first `rows` output rows only (`out` is `[n, rows]`), each
    /// computed as in the whole matmul; `rows` is a multiple of 8 (the interleaved layouts'
    /// group) or all of them. A draft model's head scores its most common tokens this way.
    pub fn matmul_first(&self, xs: &[f32], n: usize, rows: usize, out: &mut [f32]) {
        assert!(
            rows == self.rows || (rows < self.rows && rows.is_multiple_of(8)),
            "matmul_first: {rows} of {} rows",
            self.rows
        );
        assert_eq!(xs.len(), n * self.cols, "matmul input shape");
        assert_eq!(out.len(), n * rows, "matmul output shape");
        if n > 0 {
            self.blocks
                .matmul(rows, self.cols, xs, n, out, Isa::detect());
        }
    }

    /// [`QWeight::matmul`] with a chosen instruction set (tests compare them).
    pub fn matmul_with(&self, xs: &[f32], n: usize, out: &mut [f32], isa: Isa) {
        if n == 0 {
            return;
        }
        self.blocks.matmul(self.rows, self.cols, xs, n, out, isa);
    }

    /// Dequantizes one row into `out[..cols]` (embedding lookup reads only its rows).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        self.blocks.dequantize_row(row, self.cols, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quantize<T: GgmlType + 'static>(vals: &[f32]) -> Vec<u8> {
        let mut blocks = vec![T::zeros(); vals.len() / T::BLCK_SIZE];
        T::from_float(vals, &mut blocks);
        let size = std::mem::size_of::<T>();
        // SAFETY: reading the blocks' bytes; plain-old-data types.
        unsafe { std::slice::from_raw_parts(blocks.as_ptr() as *const u8, blocks.len() * size) }
            .to_vec()
    }

    fn dequant<T: GgmlType + 'static>(bytes: &[u8], n: usize) -> Vec<f32> {
        let blocks = read_blocks::<T>(bytes.len(), |b| {
            b.copy_from_slice(bytes);
            Ok(())
        })
        .unwrap();
        let mut out = vec![0f32; n];
        T::to_float(&blocks, &mut out);
        out
    }

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    }

    fn cases(w: &[f32], n: usize) -> Vec<(GgmlDType, Vec<u8>, Vec<f32>)> {
        let c = |dt, b: Vec<u8>, d: fn(&[u8], usize) -> Vec<f32>| {
            let deq = d(&b, n);
            (dt, b, deq)
        };
        vec![
            c(GgmlDType::Q4K, quantize::<BlockQ4K>(w), dequant::<BlockQ4K>),
            c(GgmlDType::Q6K, quantize::<BlockQ6K>(w), dequant::<BlockQ6K>),
            c(
                GgmlDType::Q8_0,
                quantize::<BlockQ8_0>(w),
                dequant::<BlockQ8_0>,
            ),
            c(
                GgmlDType::Q4_1,
                quantize::<BlockQ4_1>(w),
                dequant::<BlockQ4_1>,
            ),
            c(
                GgmlDType::Q5_0,
                quantize::<BlockQ5_0>(w),
                dequant::<BlockQ5_0>,
            ),
        ]
    }

    #[test]
    fn kernels_are_exact_across_batch_threads_and_isa() {
        let (rows, cols) = (72, 512);
        let mut s = 7;
        let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut s)).collect();
        for (dtype, bytes, deq) in cases(&w, rows * cols) {
            let q = QWeight::from_bytes("w", dtype, rows, cols, &bytes).unwrap();
            // Our dequantization agrees with candle's (an independent reading of the format).
            let mut row = vec![0f32; cols];
            for r in [0, 33, 69] {
                q.dequantize_row(r, &mut row);
                for (a, b) in row.iter().zip(&deq[r * cols..(r + 1) * cols]) {
                    assert!(
                        (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                        "{dtype:?} dequant {a} vs {b}"
                    );
                }
            }
            let n = 9;
            let xs: Vec<f32> = (0..n * cols).map(|_| lcg(&mut s)).collect();
            let mut batched = vec![0f32; n * rows];
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(2)
                .build()
                .unwrap();
            pool.install(|| q.matmul(&xs, n, &mut batched));
            let mut scalar = vec![0f32; n * rows];
            q.matmul_with(&xs, n, &mut scalar, Isa::Scalar);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&batched),
                bits(&scalar),
                "{dtype:?}: SIMD and threads equal scalar"
            );
            for i in 0..n {
                let mut one = vec![0f32; rows];
                q.matmul(&xs[i * cols..(i + 1) * cols], 1, &mut one);
                assert_eq!(
                    bits(&one),
                    bits(&batched[i * rows..(i + 1) * rows]),
                    "{dtype:?} row {i}"
                );
                // And close to the exact product with the dequantized weights.
                for r in [0, 41] {
                    let exact: f32 = deq[r * cols..(r + 1) * cols]
                        .iter()
                        .zip(&xs[i * cols..])
                        .map(|(a, b)| a * b)
                        .sum();
                    let norm: f32 = deq[r * cols..(r + 1) * cols]
                        .iter()
                        .map(|a| a.abs())
                        .sum::<f32>()
                        * 0.5;
                    assert!(
                        (exact - one[r]).abs() < 0.01 * norm,
                        "{dtype:?} {exact} vs {}",
                        one[r]
                    );
                }
            }
        }
    }

    #[test]
    fn misaligned_row_length_is_an_error() {
        let err = QWeight::from_bytes("blk.0.x", GgmlDType::Q4K, 1, 64, &[0u8; 10]).unwrap_err();
        assert!(err.to_string().contains("blk.0.x"), "{err}");
    }
}
