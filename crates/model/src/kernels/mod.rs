//! Our own quantized matmul kernels, exact by construction.
//!
//! Every format is handled the same way, in 16-element groups:
//! 1. the weight row is unpacked once into small integers `u` (one byte each) plus, per group,
//!    a float scale `ws` and offset `wm`, so that the weight is `ws * u + wm`;
//! 2. each activation row is quantized per 32 elements to `i8` with an f32 scale `dx`, keeping
//!    the integer sum `S` of each 16-element group;
//! 3. the integer pass computes `G = sum(u * x)` per group (exact integers, so the SIMD and
//!    scalar paths agree bit for bit by construction);
//! 4. the float pass sums `dx * (ws * G + wm * S)` over groups in eight fixed lanes, written as
//!    plain Rust (no fused multiply-add, fixed order), so it too is the same on every CPU.
//!
//! A token's result never depends on which other rows share the pass: the unpacked weight row
//! is reused for all activation rows (that is what makes small batches cheap), but each row's
//! arithmetic is the same as when it is alone.

pub mod formats;
mod int;
pub mod kquant;

pub use formats::Format;
pub use int::Isa;
pub use kquant::QuantK;

/// Elements per group.
pub const GROUP: usize = 16;

/// An activation row quantized for the integer pass.
#[derive(Debug, Default, Clone)]
pub struct QuantRow {
    /// `i8` values, one per element.
    pub q: Vec<i8>,
    /// Scale of each group (shared by the two groups of a 32-element block).
    pub dx: Vec<f32>,
    /// Integer sum of each group's values.
    pub s: Vec<i32>,
}

impl QuantRow {
    /// Quantizes `x` (length a multiple of 32) per 32-element block to `i8`.
    pub fn quantize(x: &[f32]) -> Self {
        let n = x.len();
        let mut q = vec![0i8; n];
        let mut dx = vec![0f32; n / GROUP];
        let mut s = vec![0i32; n / GROUP];
        for (b, (xb, qb)) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)).enumerate() {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let (d, id) = if amax > 0.0 {
                (amax / 127.0, 127.0 / amax)
            } else {
                (0.0, 0.0)
            };
            for (qi, xi) in qb.iter_mut().zip(xb) {
                *qi = (xi * id).round().clamp(-127.0, 127.0) as i8;
            }
            dx[2 * b] = d;
            dx[2 * b + 1] = d;
            s[2 * b] = qb[..16].iter().map(|&v| v as i32).sum();
            s[2 * b + 1] = qb[16..].iter().map(|&v| v as i32).sum();
        }
        Self { q, dx, s }
    }
}

/// A weight row unpacked for the integer pass.
#[derive(Debug, Default, Clone)]
pub struct UnpackedRow {
    /// One small integer per element: unsigned (0..=63) or, for signed formats, `i8` bits.
    pub u: Vec<u8>,
    /// Per group: weight = `ws * u + wm`.
    pub ws: Vec<f32>,
    /// Per group offset (0 for signed formats).
    pub wm: Vec<f32>,
    /// Whether `u` holds signed values.
    pub signed: bool,
}

/// The float pass: `sum over groups of dx * (ws * G + wm * S)`, in eight fixed lanes.
/// Separate multiplies and adds in a fixed order (Rust never fuses them), so the AVX2 build of
/// the same code gives the same bits.
pub fn combine(w: &UnpackedRow, x: &QuantRow, g: &[i32], isa: Isa) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx2` is chosen only on CPUs with AVX2.
        Isa::Avx2 => unsafe { combine_avx2(w, x, g) },
        _ => combine_lanes(w, x, g),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn combine_avx2(w: &UnpackedRow, x: &QuantRow, g: &[i32]) -> f32 {
    combine_lanes(w, x, g)
}

#[inline(always)]
fn combine_lanes(w: &UnpackedRow, x: &QuantRow, g: &[i32]) -> f32 {
    let n = g.len();
    let n8 = n / 8 * 8;
    let mut acc = [0f32; 8];
    let lanes = g[..n8]
        .chunks_exact(8)
        .zip(x.dx.chunks_exact(8).zip(x.s.chunks_exact(8)))
        .zip(w.ws.chunks_exact(8).zip(w.wm.chunks_exact(8)));
    for ((gc, (dc, sc)), (wsc, wmc)) in lanes {
        for l in 0..8 {
            acc[l] += dc[l] * (wsc[l] * gc[l] as f32 + wmc[l] * sc[l] as f32);
        }
    }
    for j in n8..n {
        acc[j % 8] += x.dx[j] * (w.ws[j] * g[j] as f32 + w.wm[j] * x.s[j] as f32);
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// `out[k * xs.len() + i] = W[first_row + k] · xs[i]` for the rows `out` covers (weight-row-major,
/// so callers can split rows across threads).
pub fn matmul_rows_major(
    fmt: Format,
    data: &[u8],
    first_row: usize,
    cols: usize,
    xs: &[QuantRow],
    out: &mut [f32],
    isa: Isa,
) {
    let row_bytes = fmt.row_bytes(cols);
    let n = xs.len();
    let mut w = UnpackedRow::default();
    let mut g = vec![0i32; cols / GROUP];
    for (k, dst) in out.chunks_mut(n).enumerate() {
        let r = first_row + k;
        fmt.unpack_row(&data[r * row_bytes..(r + 1) * row_bytes], cols, &mut w, isa);
        for (x, d) in xs.iter().zip(dst.iter_mut()) {
            int::group_dots(isa, &w.u, &x.q, w.signed, &mut g);
            *d = combine(&w, x, &g, isa);
        }
    }
}
