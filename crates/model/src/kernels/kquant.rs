//! Q4_K and Q6_K: 256-element super-blocks against activations quantized per 256 elements
//! ([`QuantK`]), with the sub-block scales applied in integers and the float work done once
//! per block.
//!
//! The reference ([`dot_scalar`]) defines the result; for weight row `w`, activation row `x`
//! and block `b`:
//! - Q4_K: `I = Σ_j sc_j·Σ_{e∈j} u_e·q_e` and `M = Σ_j m_j·Σ_{e∈j} q_e` over the eight
//!   32-element sub-blocks, exact integers, then `acc = acc + ((d·dx)·I − (dmin·dx)·M)`; the
//!   result is `acc`. The rows are held interleaved in groups of eight ([`repack_q4k`]), so the
//!   AVX2 path's integer sums come out one lane per weight row and need no horizontal sums.
//! - Q6_K: `I = Σ_j sc_j·(Σ_{e∈j} u_e·q_e − 32·Σ_{e∈j} q_e)` over the sixteen 16-element
//!   sub-blocks (`u` the unsigned 6-bit values), exact, then `acc = acc + (d·dx)·I`. Held
//!   interleaved in groups of eight rows too ([`repack_q6k`]).
//!
//! Integer sums are exact in any order and the float steps are the same operations in the same
//! order, so the AVX2, VNNI and 512-bit (`zmm`, two groups per register) paths equal the
//! reference bit for bit. Each activation row's result is computed the same way whatever other
//! rows share the pass: the SIMD path only reuses each loaded and unpacked weight block for up
//! to [`MAX_ROWS`] activation rows.

use super::{f16_at, Format, Isa};

/// Elements per super-block.
pub const QK: usize = 256;

/// Activation rows handled together by one pass over a weight row.
pub const MAX_ROWS: usize = 5;

/// An activation row quantized per 256 elements to `i8`.
#[derive(Debug, Default, Clone)]
pub struct QuantK {
    /// One value per element, in -127..=127.
    pub q: Vec<i8>,
    /// Scale of each 256-element block.
    pub d: Vec<f32>,
    /// Sum of each 16-element group of `q`.
    pub bs: Vec<i16>,
    /// Sum of each 32-element group of `q`.
    pub bs32: Vec<i16>,
}

impl QuantK {
    /// Quantizes `x` (length a multiple of 256).
    pub fn quantize(x: &[f32]) -> Self {
        assert!(
            x.len().is_multiple_of(QK),
            "row length {} not a multiple of 256",
            x.len()
        );
        let n = x.len();
        let mut q = vec![0i8; n];
        let mut d = vec![0f32; n / QK];
        let mut bs = vec![0i16; n / 16];
        for ((xb, qb), db) in x.chunks_exact(QK).zip(q.chunks_exact_mut(QK)).zip(&mut d) {
            *db = super::quantize_block(xb, qb);
        }
        for (s, g) in bs.iter_mut().zip(q.chunks_exact(16)) {
            *s = g.iter().map(|&v| v as i16).sum();
        }
        let bs32 = bs.chunks_exact(2).map(|p| p[0] + p[1]).collect();
        Self { q, d, bs, bs32 }
    }
}

/// Q4_K's eight 6-bit scales and eight 6-bit mins from the 12 packed bytes at `blk[4..16]`,
/// as two little-endian words each (bytes 0..4 and 4..8).
#[inline(always)]
pub fn q4k_scales(blk: &[u8]) -> ([u32; 2], [u32; 2]) {
    let w = |k: usize| u32::from_le_bytes(blk[4 + 4 * k..8 + 4 * k].try_into().expect("4 bytes"));
    let (w0, w1, w2) = (w(0), w(1), w(2));
    const LOW6: u32 = 0x3F3F_3F3F;
    const LOW4: u32 = 0x0F0F_0F0F;
    const LOW2: u32 = 0x0303_0303;
    // Sub-blocks 0..4 keep their scale and min in the low 6 bits of bytes 0..4 and 4..8;
    // sub-blocks 4..8 have 4 low bits in bytes 8..12 and their top 2 bits in the top bits of
    // bytes 0..4 (scales) and 4..8 (mins).
    let s = [w0 & LOW6, (w2 & LOW4) | (((w0 >> 6) & LOW2) << 4)];
    let m = [w1 & LOW6, ((w2 >> 4) & LOW4) | (((w1 >> 6) & LOW2) << 4)];
    (s, m)
}

/// The eight bytes of two little-endian words.
pub fn bytes8(v: [u32; 2]) -> [u8; 8] {
    let mut o = [0u8; 8];
    o[..4].copy_from_slice(&v[0].to_le_bytes());
    o[4..].copy_from_slice(&v[1].to_le_bytes());
    o
}

/// Q4_K weight rows are held in groups of [`Q4K_ROWS`], interleaved block by block, so that
/// one register holds four values of each of eight rows and the integer sums come out one lane
/// per row. A group's block is [`Q4K_GROUP_BYTES`]: the eight rows' f16 scales, their f16 mins,
/// sub-scales `[sub-block][row]`, sub-mins `[pair of sub-blocks][row][2]` (one byte each), then
/// the 4-bit values as `[64-element chunk][4-byte column][row][4]` (byte `t` of column `k`
/// holds element `64c + 4k + t` in its low half and `64c + 32 + 4k + t` in its high half, as
/// in GGUF).
pub const Q4K_ROWS: usize = 8;
/// Bytes of one block of a group of eight Q4_K rows (8 × 148).
pub const Q4K_GROUP_BYTES: usize = 16 + 16 + 64 + 64 + 1024;
const Q4K_SC: usize = 32;
const Q4K_MIN: usize = 96;
const Q4K_NIB: usize = 160;

/// Repacks GGUF Q4_K rows (`rows` a multiple of 8, `cols` of 256) into the interleaved layout.
pub fn repack_q4k(gguf: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    assert!(rows.is_multiple_of(Q4K_ROWS) && cols.is_multiple_of(QK));
    let nb = cols / QK;
    let mut out = vec![0u8; rows / Q4K_ROWS * nb * Q4K_GROUP_BYTES];
    for (g, dst) in out.chunks_exact_mut(nb * Q4K_GROUP_BYTES).enumerate() {
        for (b, gb) in dst.chunks_exact_mut(Q4K_GROUP_BYTES).enumerate() {
            for r in 0..Q4K_ROWS {
                let at = ((g * Q4K_ROWS + r) * nb + b) * 144;
                let blk = &gguf[at..at + 144];
                let (sc, m) = q4k_scales(blk);
                let (sc, m) = (bytes8(sc), bytes8(m));
                gb[2 * r..2 * r + 2].copy_from_slice(&blk[0..2]);
                gb[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&blk[2..4]);
                for j in 0..8 {
                    gb[Q4K_SC + 8 * j + r] = sc[j];
                    gb[Q4K_MIN + 16 * (j / 2) + 2 * r + j % 2] = m[j];
                }
                for c in 0..4 {
                    for k in 0..8 {
                        let o = Q4K_NIB + (8 * c + k) * 32 + 4 * r;
                        gb[o..o + 4]
                            .copy_from_slice(&blk[16 + 32 * c + 4 * k..16 + 32 * c + 4 * k + 4]);
                    }
                }
            }
        }
    }
    out
}

/// Q6_K weight rows are held in groups of eight too ([`Q6K_GROUP_BYTES`] per block of the
/// group, the same size as GGUF's eight blocks): the eight rows' f16 scales, the sub-scales as
/// `[pair of sub-blocks][row][2]`, then each 128-element half `h` in turn (the kernel reads
/// them in order): its low four bits as `[4-byte column (16)][row][4]` (byte `t` of column `k`
/// is GGUF's `ql[64h + 4k + t]`: elements `128h + 4k + t` in its low and `128h + 64 + 4k + t`
/// in its high nibble), then its top two bits as `[column (8)][row][4]` (GGUF's
/// `qh[32h + 4k + t]`: elements `128h + 4k + t`, `+ 32`, `+ 64` and `+ 96` in bits 0-1, 2-3,
/// 4-5 and 6-7).
pub const Q6K_GROUP_BYTES: usize = 16 + 128 + 1024 + 512;
const Q6K_SC: usize = 16;
const Q6K_QL: usize = 144;
const Q6K_QH: usize = 144 + 512;
/// Bytes of one half's values (128 elements of eight rows: 512 low, then 256 top bits).
const Q6K_HALF: usize = 768;

/// Repacks GGUF Q6_K rows (`rows` a multiple of 8, `cols` of 256) into the interleaved layout.
pub fn repack_q6k(gguf: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    assert!(rows.is_multiple_of(Q4K_ROWS) && cols.is_multiple_of(QK));
    let nb = cols / QK;
    let mut out = vec![0u8; rows / Q4K_ROWS * nb * Q6K_GROUP_BYTES];
    for (g, dst) in out.chunks_exact_mut(nb * Q6K_GROUP_BYTES).enumerate() {
        for (b, gb) in dst.chunks_exact_mut(Q6K_GROUP_BYTES).enumerate() {
            for r in 0..Q4K_ROWS {
                let at = ((g * Q4K_ROWS + r) * nb + b) * 210;
                let blk = &gguf[at..at + 210];
                gb[2 * r..2 * r + 2].copy_from_slice(&blk[208..210]);
                for j in 0..16 {
                    gb[Q6K_SC + 16 * (j / 2) + 2 * r + j % 2] = blk[192 + j];
                }
                for h in 0..2 {
                    for k in 0..16 {
                        let o = Q6K_QL + Q6K_HALF * h + 32 * k + 4 * r;
                        let src = 64 * h + 4 * k;
                        gb[o..o + 4].copy_from_slice(&blk[src..src + 4]);
                    }
                    for k in 0..8 {
                        let o = Q6K_QH + Q6K_HALF * h + 32 * k + 4 * r;
                        let src = 128 + 32 * h + 4 * k;
                        gb[o..o + 4].copy_from_slice(&blk[src..src + 4]);
                    }
                }
            }
        }
    }
    out
}

/// One Q6_K block of one row, read from the interleaved layout.
struct Q6kBlock {
    d: f32,
    sc: [i8; 16],
    u: [u8; QK],
}

/// Block `b` of row `row` of interleaved Q6_K `data` with `nb` blocks per row.
fn q6k_block(data: &[u8], nb: usize, row: usize, b: usize) -> Q6kBlock {
    let (g, r) = (row / Q4K_ROWS, row % Q4K_ROWS);
    let at = (g * nb + b) * Q6K_GROUP_BYTES;
    let gb = &data[at..at + Q6K_GROUP_BYTES];
    let mut u = [0u8; QK];
    for (e, ue) in u.iter_mut().enumerate() {
        // Element e = 128h + 32s + l: the nibble of `ql[64h + 32(s % 2) + l]` (high for s ≥ 2)
        // and bits 2s, 2s + 1 of `qh[32h + l]`.
        let (h, s, l) = (e / 128, (e % 128) / 32, e % 32);
        let m = 32 * (s % 2) + l;
        let ql = gb[Q6K_QL + Q6K_HALF * h + 32 * (m / 4) + 4 * r + m % 4];
        let qh = gb[Q6K_QH + Q6K_HALF * h + 32 * (l / 4) + 4 * r + l % 4];
        let lo = if s < 2 { ql & 15 } else { ql >> 4 };
        *ue = lo | (((qh >> (2 * s)) & 3) << 4);
    }
    Q6kBlock {
        d: f16_at(gb, 2 * r),
        sc: std::array::from_fn(|j| gb[Q6K_SC + 16 * (j / 2) + 2 * r + j % 2] as i8),
        u,
    }
}

/// One Q4_K block of one row, read from the interleaved layout.
struct Q4kBlock {
    d: f32,
    dmin: f32,
    sc: [u8; 8],
    m: [u8; 8],
    u: [u8; QK],
}

/// Block `b` of row `row` of interleaved Q4_K `data` with `nb` blocks per row.
fn q4k_block(data: &[u8], nb: usize, row: usize, b: usize) -> Q4kBlock {
    let (g, r) = (row / Q4K_ROWS, row % Q4K_ROWS);
    let at = (g * nb + b) * Q4K_GROUP_BYTES;
    let gb = &data[at..at + Q4K_GROUP_BYTES];
    let mut u = [0u8; QK];
    for (e, ue) in u.iter_mut().enumerate() {
        let (c, k) = (e / 64, e % 32);
        let byte = gb[Q4K_NIB + (8 * c + k / 4) * 32 + 4 * r + k % 4];
        *ue = if e % 64 < 32 { byte & 15 } else { byte >> 4 };
    }
    Q4kBlock {
        d: f16_at(gb, 2 * r),
        dmin: f16_at(gb, 16 + 2 * r),
        sc: std::array::from_fn(|j| gb[Q4K_SC + 8 * j + r]),
        m: std::array::from_fn(|j| gb[Q4K_MIN + 16 * (j / 2) + 2 * r + j % 2]),
        u,
    }
}

/// Dequantizes row `row` of interleaved Q4_K `data` (`cols` wide) into `out[..cols]`.
pub fn dequantize_q4k(data: &[u8], row: usize, cols: usize, out: &mut [f32]) {
    let nb = cols / QK;
    for (b, o) in out[..cols].chunks_exact_mut(QK).enumerate() {
        let k = q4k_block(data, nb, row, b);
        for (e, v) in o.iter_mut().enumerate() {
            let j = e / 32;
            *v = k.d * k.sc[j] as f32 * k.u[e] as f32 - k.dmin * k.m[j] as f32;
        }
    }
}

/// Dequantizes row `row` of interleaved Q6_K `data` (`cols` wide) into `out[..cols]`.
pub fn dequantize_q6k(data: &[u8], row: usize, cols: usize, out: &mut [f32]) {
    let nb = cols / QK;
    for (b, o) in out[..cols].chunks_exact_mut(QK).enumerate() {
        let k = q6k_block(data, nb, row, b);
        for (e, v) in o.iter_mut().enumerate() {
            *v = k.d * k.sc[e / 16] as f32 * (k.u[e] as i32 - 32) as f32;
        }
    }
}

/// The reference: row `row` of the interleaved weight rows `w` (starting at a multiple of
/// [`Q4K_ROWS`]) against one activation row.
pub fn dot_scalar(fmt: Format, w: &[u8], row: usize, x: &QuantK) -> f32 {
    let nb = x.d.len();
    match fmt {
        Format::Q4K => {
            // Per block: I = Σ_j sc_j·Σ_{e∈j} u_e·q_e, M = Σ_j m_j·Σ_{e∈j} q_e, both exact.
            let mut acc = 0f32;
            for b in 0..nb {
                let k = q4k_block(w, nb, row, b);
                let q = &x.q[b * QK..(b + 1) * QK];
                let (mut i, mut m) = (0i32, 0i32);
                for j in 0..8 {
                    let g: i32 = (32 * j..32 * j + 32)
                        .map(|e| k.u[e] as i32 * q[e] as i32)
                        .sum();
                    i += k.sc[j] as i32 * g;
                    m += k.m[j] as i32 * x.bs32[8 * b + j] as i32;
                }
                let dx = x.d[b];
                acc += (k.d * dx) * i as f32 - (k.dmin * dx) * m as f32;
            }
            acc
        }
        Format::Q6K => {
            // Per block: I = Σ_j sc_j·(Σ_{e∈j} u_e·q_e − 32·Σ_{e∈j} q_e), exact.
            let mut acc = 0f32;
            for b in 0..nb {
                let k = q6k_block(w, nb, row, b);
                let q = &x.q[b * QK..(b + 1) * QK];
                let mut i = 0i32;
                for j in 0..16 {
                    let g: i32 = (16 * j..16 * j + 16)
                        .map(|e| k.u[e] as i32 * q[e] as i32)
                        .sum();
                    i += k.sc[j] as i32 * (g - 32 * x.bs[16 * b + j] as i32);
                }
                acc += (k.d * x.d[b]) * i as f32;
            }
            acc
        }
        other => unreachable!("{other:?} is not a K format"),
    }
}

/// `outs[i][k] = W[first_row + k] · xs[i]` for the rows `outs` covers (each `outs[i]` the
/// same length, a multiple of 8; `first_row` a multiple of 8).
pub fn matmul(
    fmt: Format,
    data: &[u8],
    first_row: usize,
    cols: usize,
    xs: &[QuantK],
    outs: &mut [&mut [f32]],
    isa: Isa,
) {
    let rb = fmt.row_bytes(cols);
    let rows = outs[0].len();
    assert!(
        first_row.is_multiple_of(Q4K_ROWS) && rows.is_multiple_of(Q4K_ROWS),
        "rows {first_row}..+{rows} are not whole groups"
    );
    assert!(
        outs.len() == xs.len() && outs.iter().all(|o| o.len() == rows),
        "one output row of {rows} per activation row"
    );
    let w = &data[first_row * rb..(first_row + rows) * rb];
    assert!(
        xs.iter().all(|x| x.q.len() == cols),
        "activation rows of {cols}"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::matmul(fmt, w, rb, xs, outs, false),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => avx2::matmul(fmt, w, rb, xs, outs, true),
        _ => {
            for (x, o) in xs.iter().zip(outs.iter_mut()) {
                for (k, d) in o.iter_mut().enumerate() {
                    *d = dot_scalar(fmt, w, k, x);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{QuantK, MAX_ROWS, QK};
    use crate::kernels::x86::{bcast4, fetch, fetch_l2, ld, BATCH_AHEAD};
    use crate::kernels::{Format, Isa};
    use std::arch::x86_64::*;

    /// `outs[i][k] = w[k] · xs[i]` for every row of `w` (rows of `rb` bytes, in interleaved
    /// groups of eight): every group against every activation row; the float lanes are the
    /// group's rows. `vnni`: with AVX-512 VNNI's dot products.
    pub fn matmul(
        fmt: Format,
        w: &[u8],
        rb: usize,
        xs: &[QuantK],
        outs: &mut [&mut [f32]],
        vnni: bool,
    ) {
        let isa = if vnni { Isa::Avx512Vnni } else { Isa::Avx2 };
        assert!(isa.supported(), "this CPU has no {isa:?}");
        let nb = xs[0].d.len();
        assert!(rb == nb * fmt.block_bytes() && w.len().is_multiple_of(rb));
        assert!(xs.iter().all(|x| x.d.len() == nb
            && x.q.len() == nb * QK
            && x.bs.len() == nb * 16
            && x.bs32.len() == nb * 8));
        let group = super::Q4K_ROWS * rb;
        assert!(w.len().is_multiple_of(group) && outs.iter().all(|o| o.len() == w.len() / rb));
        let groups = w.len() / group;
        crate::kernels::walk_groups(
            groups,
            xs,
            outs,
            MAX_ROWS,
            vnni.then_some(MAX_ROWS),
            |g, xc, a| {
                let wg = &w[g * group..(g + 1) * group];
                macro_rules! go {
                    ($($k:literal)*) => {
                        match (xc.len(), vnni) {
                            $(
                                // SAFETY: the ISA checked above; sizes checked above.
                                ($k, false) => unsafe { group_avx2::<$k>(fmt, wg, xc, a) },
                                ($k, true) => unsafe { group_vnni::<$k>(fmt, wg, xc, a) },
                            )*
                            (k, _) => unreachable!("{k} rows"),
                        }
                    };
                }
                go!(1 2 3 4 5);
            },
            |g, xc, a| {
                let wp = &w[g * group..(g + 2) * group];
                macro_rules! go {
                    ($($k:literal)*) => {
                        match xc.len() {
                            $(
                                // SAFETY: the ISA checked above (VNNI comes with AVX-512 F
                                // and BW); sizes checked above.
                                $k => unsafe { super::zmm::pair::<$k>(fmt, wp, xc, a) },
                            )*
                            k => unreachable!("{k} rows"),
                        }
                    };
                }
                go!(2 3 4 5);
            },
        );
    }

    /// How far ahead a single-row Q6_K pass fetches.
    const STREAM_AHEAD: usize = 4096;

    /// One group of eight interleaved rows of `fmt` (`gw`: its blocks) against `xs[i]`, added
    /// to the row lanes `accs[i]`, with AVX2.
    ///
    /// # Safety
    /// AVX2 and F16C; `gw` holds `xs[i].d.len()` group blocks; `N == xs.len() <= accs.len()`.
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn group_avx2<const N: usize>(
        fmt: Format,
        gw: &[u8],
        xs: &[QuantK],
        accs: &mut [[f32; 8]],
    ) {
        // SAFETY: per the contract.
        unsafe {
            match fmt {
                Format::Q4K => q4k::<N, false>(gw, xs, accs),
                Format::Q6K => q6k::<N, false>(gw, xs, accs),
                other => unreachable!("{other:?} is not a K format"),
            }
        }
    }

    /// [`group_avx2`] with AVX-512 VNNI's dot products.
    ///
    /// # Safety
    /// As [`group_avx2`], and AVX-512 VNNI and VL.
    #[target_feature(enable = "avx2,f16c,avx512vnni,avx512vl")]
    unsafe fn group_vnni<const N: usize>(
        fmt: Format,
        gw: &[u8],
        xs: &[QuantK],
        accs: &mut [[f32; 8]],
    ) {
        // SAFETY: per the contract.
        unsafe {
            match fmt {
                Format::Q4K => q4k::<N, true>(gw, xs, accs),
                Format::Q6K => q6k::<N, true>(gw, xs, accs),
                other => unreachable!("{other:?} is not a K format"),
            }
        }
    }

    /// Q4_K's group kernel, compiled into each caller with its instruction set. With `VNNI`,
    /// each 4-wide product sum goes straight into i32 lanes (`dpbusd`), which are scaled by
    /// the sub-block scales with one i32 multiply; without, into i16 lanes (`maddubs`, then an
    /// add) scaled with `madd`. The integers are the same.
    ///
    /// # Safety
    /// As [`group_avx2`], and VNNI with `VNNI`.
    #[inline(always)]
    unsafe fn q4k<const N: usize, const VNNI: bool>(
        gw: &[u8],
        xs: &[QuantK],
        accs: &mut [[f32; 8]],
    ) {
        use super::{Q4K_GROUP_BYTES as GB, Q4K_MIN, Q4K_NIB, Q4K_SC};
        // SAFETY: a register operation (the callers run with AVX2).
        let m4 = unsafe { _mm256_set1_epi8(0x0F) };
        let nb = xs[0].d.len();
        let qs: [*const u8; N] = std::array::from_fn(|i| xs[i].q.as_ptr().cast());
        let b32: [*const i16; N] = std::array::from_fn(|i| xs[i].bs32.as_ptr());
        // SAFETY: `accs` has N entries of 8 floats.
        let mut acc: [__m256; N] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(accs[i].as_ptr()) });
        for b in 0..nb {
            // SAFETY: group block `b` is `GB` bytes inside `gw`; every activation row holds `nb`
            // blocks of 256 values and 8 sums (checked by the callers).
            unsafe {
                let gb = gw.as_ptr().add(b * GB);
                if N == 1 {
                    fetch(gb.wrapping_add(2 * GB), GB);
                } else {
                    fetch_l2(gb.wrapping_add(BATCH_AHEAD * GB), GB);
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(gb.cast()));
                let dmin = _mm256_cvtph_ps(_mm_loadu_si128(gb.add(16).cast()));
                let mut isum = [_mm256_setzero_si256(); N];
                // Sub-block 2c + h: the low (h = 0) or high halves of chunk c's bytes.
                let mut sub = |c: usize, h: usize| {
                    let s8 = _mm_loadl_epi64(gb.add(Q4K_SC + 8 * (2 * c + h)).cast());
                    let sc = if VNNI {
                        _mm256_cvtepu8_epi32(s8)
                    } else {
                        _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s8, s8))
                    };
                    let mut p = [_mm256_setzero_si256(); N];
                    for k in 0..8 {
                        let v = ld(gb.add(Q4K_NIB + (8 * c + k) * 32));
                        let u = if h == 0 {
                            _mm256_and_si256(v, m4)
                        } else {
                            _mm256_and_si256(_mm256_srli_epi16(v, 4), m4)
                        };
                        for i in 0..N {
                            let a = bcast4(qs[i].add(b * QK + 64 * c + 32 * h + 4 * k));
                            // In i16: at most 8 · 2 · 15 · 127 = 30480, no overflow.
                            p[i] = dot::<VNNI>(p[i], u, a);
                        }
                    }
                    for i in 0..N {
                        isum[i] = _mm256_add_epi32(isum[i], scaled::<VNNI>(p[i], sc));
                    }
                };
                // One activation row: both halves of a chunk in turn, each chunk's bytes loaded
                // once. More rows: halves as the outer loop, each reloading the bytes (from L1),
                // since a chunk's registers kept live across both halves were spilled to the
                // stack (1.15-1.3x faster at 4 rows; slower at 1).
                if N == 1 {
                    (0..4).for_each(|c| (0..2).for_each(|h| sub(c, h)));
                } else {
                    (0..2).for_each(|h| (0..4).for_each(|c| sub(c, h)));
                }
                for i in 0..N {
                    let mut m = _mm256_setzero_si256();
                    for jp in 0..4 {
                        let mv =
                            _mm256_cvtepu8_epi16(_mm_loadu_si128(gb.add(Q4K_MIN + 16 * jp).cast()));
                        let bb = bcast4(b32[i].add(8 * b + 2 * jp).cast());
                        m = _mm256_add_epi32(m, _mm256_madd_epi16(mv, bb));
                    }
                    let dx = _mm256_set1_ps(*xs[i].d.get_unchecked(b));
                    let v = _mm256_sub_ps(
                        _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(isum[i])),
                        _mm256_mul_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(m)),
                    );
                    acc[i] = _mm256_add_ps(acc[i], v);
                }
            }
        }
        for i in 0..N {
            // SAFETY: as above.
            unsafe { _mm256_storeu_ps(accs[i].as_mut_ptr(), acc[i]) };
        }
    }

    /// Q6_K's group kernel, compiled into each caller with its instruction set (see [`q4k`]).
    ///
    /// # Safety
    /// As [`q4k`].
    #[inline(always)]
    unsafe fn q6k<const N: usize, const VNNI: bool>(
        gw: &[u8],
        xs: &[QuantK],
        accs: &mut [[f32; 8]],
    ) {
        use super::{Q6K_GROUP_BYTES as GB, Q6K_QL, Q6K_SC};
        let nb = xs[0].d.len();
        let qs: [*const u8; N] = std::array::from_fn(|i| xs[i].q.as_ptr().cast());
        let bss: [*const i16; N] = std::array::from_fn(|i| xs[i].bs.as_ptr());
        // SAFETY: `accs` has N entries of 8 floats.
        let mut acc: [__m256; N] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(accs[i].as_ptr()) });
        for b in 0..nb {
            // SAFETY: group block `b` is `GB` bytes inside `gw`; every activation row holds `nb`
            // blocks of 256 values and 16 sums (checked by the callers).
            unsafe {
                let gb = gw.as_ptr().add(b * GB);
                // One row streams from memory: its half kernel fetches each line it loads 4 KiB
                // ahead as it goes (this is the scales' part); a whole block's fetches in one
                // burst, as for more rows, left the single-row pass about 15% slower from DRAM.
                if N == 1 {
                    fetch(gb.wrapping_add(STREAM_AHEAD), Q6K_QL);
                } else {
                    fetch_l2(gb.wrapping_add(BATCH_AHEAD * GB), GB);
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(gb.cast()));
                let mut isum = [_mm256_setzero_si256(); N];
                for h in 0..2 {
                    let at: [*const u8; N] = std::array::from_fn(|i| qs[i].add(b * QK + 128 * h));
                    if N == 1 {
                        q6k_half_one::<VNNI>(gb, h, at[0], &mut isum[0]);
                        continue;
                    }
                    q6k_quarter::<N, 0, VNNI>(gb, h, at, &mut isum);
                    q6k_quarter::<N, 1, VNNI>(gb, h, at, &mut isum);
                    q6k_quarter::<N, 2, VNNI>(gb, h, at, &mut isum);
                    q6k_quarter::<N, 3, VNNI>(gb, h, at, &mut isum);
                }
                for i in 0..N {
                    // The −32 offset of every value: Σ_j sc_j · (sum of sub-block j's q).
                    let mut off = _mm256_setzero_si256();
                    for jp in 0..8 {
                        let sv =
                            _mm256_cvtepi8_epi16(_mm_loadu_si128(gb.add(Q6K_SC + 16 * jp).cast()));
                        let bb = bcast4(bss[i].add(16 * b + 2 * jp).cast());
                        off = _mm256_add_epi32(off, _mm256_madd_epi16(sv, bb));
                    }
                    let is = _mm256_sub_epi32(isum[i], _mm256_slli_epi32(off, 5));
                    let dx = _mm256_set1_ps(*xs[i].d.get_unchecked(b));
                    let v = _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(is));
                    acc[i] = _mm256_add_ps(acc[i], v);
                }
            }
        }
        for i in 0..N {
            // SAFETY: as above.
            unsafe { _mm256_storeu_ps(accs[i].as_mut_ptr(), acc[i]) };
        }
    }

    /// `p` plus the products of `u` (unsigned) and `a` (signed) summed four at a time: into
    /// i32 lanes with VNNI; in pairs into i16 lanes without (callers keep those from
    /// overflowing).
    ///
    /// # Safety
    /// The caller runs with AVX2, and VNNI with `VNNI`.
    #[inline(always)]
    unsafe fn dot<const VNNI: bool>(p: __m256i, u: __m256i, a: __m256i) -> __m256i {
        // SAFETY: register operations, per the contract.
        unsafe {
            if VNNI {
                _mm256_dpbusd_epi32(p, u, a)
            } else {
                _mm256_add_epi16(p, _mm256_maddubs_epi16(u, a))
            }
        }
    }

    /// [`dot`]'s sums `p` times per-row scales `sc`, summed into i32 lanes: `sc` holds a row's
    /// scale in its i32 lane with VNNI, in both i16 halves of it without.
    ///
    /// # Safety
    /// As [`dot`].
    #[inline(always)]
    unsafe fn scaled<const VNNI: bool>(p: __m256i, sc: __m256i) -> __m256i {
        // SAFETY: register operations, per the contract.
        unsafe {
            if VNNI {
                _mm256_mullo_epi32(p, sc)
            } else {
                _mm256_madd_epi16(p, sc)
            }
        }
    }

    /// Q6_K columns summed by [`dot`] before they are scaled: an i16 sum of two products of
    /// at most 2 · 63 · 127 each stays below 32768; i32 ones take a whole sub-block's four.
    const fn q6k_columns<const VNNI: bool>() -> usize {
        if VNNI {
            4
        } else {
            2
        }
    }

    /// Sub-block `j`'s scale of every row of a Q6_K group block `gb`, laid out for
    /// [`scaled`].
    ///
    /// # Safety
    /// `gb` is a whole group block; the caller runs with AVX2.
    #[inline(always)]
    unsafe fn q6k_scale<const VNNI: bool>(gb: *const u8, j: usize) -> __m256i {
        // SAFETY: per the contract; the pair of sub-blocks' 16 bytes is inside the block.
        unsafe {
            // Row r's scale of sub-block j is byte 2r + j % 2.
            let pair = _mm_loadu_si128(gb.add(super::Q6K_SC + 16 * (j / 2)).cast());
            let odd = _mm_set1_epi8((j % 2) as i8);
            if VNNI {
                let sel = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
                _mm256_cvtepi8_epi32(_mm_shuffle_epi8(pair, _mm_add_epi8(sel, odd)))
            } else {
                let sel = _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14);
                _mm256_cvtepi8_epi16(_mm_shuffle_epi8(pair, _mm_add_epi8(sel, odd)))
            }
        }
    }

    /// Quarter `s`'s unsigned 6-bit values of one 4-byte column: the low (s < 2) or high nibbles
    /// of `ql` (the column's low bits for quarters `s % 2` and `s % 2 + 2`) with bits `2s` and
    /// `2s + 1` of `qh` on top.
    ///
    /// # Safety
    /// The caller runs with AVX2.
    #[inline(always)]
    unsafe fn q6k_unpack(s: usize, ql: __m256i, qh: __m256i) -> __m256i {
        // SAFETY: register operations only.
        unsafe {
            let m4 = _mm256_set1_epi8(0x0F);
            let lo = if s < 2 {
                _mm256_and_si256(ql, m4)
            } else {
                _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4)
            };
            let hi = match s {
                0 => _mm256_slli_epi16(qh, 4),
                1 => _mm256_slli_epi16(qh, 2),
                2 => qh,
                _ => _mm256_srli_epi16(qh, 2),
            };
            _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)))
        }
    }

    /// Adds quarter `S` (elements `128h + 32S..+32`: sub-blocks `8h + 2S` and `8h + 2S + 1`)
    /// of a Q6_K group block `gb` against the activations at `at[i]` (the half's first value)
    /// to `isum[i]`.
    ///
    /// # Safety
    /// AVX2 (and VNNI with `VNNI`); `gb` is a whole group block and each `at[i]` has 128
    /// readable values.
    #[inline(always)]
    unsafe fn q6k_quarter<const N: usize, const S: usize, const VNNI: bool>(
        gb: *const u8,
        h: usize,
        at: [*const u8; N],
        isum: &mut [__m256i; N],
    ) {
        use super::{Q6K_HALF, Q6K_QH, Q6K_QL};
        for jj in 0..2 {
            // SAFETY (every access below): inside the group block, or within the 128 values.
            unsafe {
                let sc = q6k_scale::<VNNI>(gb, 8 * h + 2 * S + jj);
                for first in (4 * jj..4 * jj + 4).step_by(q6k_columns::<VNNI>()) {
                    let mut p = [_mm256_setzero_si256(); N];
                    for kk in first..first + q6k_columns::<VNNI>() {
                        let ql = ld(gb.add(Q6K_QL + Q6K_HALF * h + 32 * (8 * (S % 2) + kk)));
                        let qh = ld(gb.add(Q6K_QH + Q6K_HALF * h + 32 * kk));
                        let u = q6k_unpack(S, ql, qh);
                        for i in 0..N {
                            p[i] = dot::<VNNI>(p[i], u, bcast4(at[i].add(32 * S + 4 * kk)));
                        }
                    }
                    for i in 0..N {
                        isum[i] = _mm256_add_epi32(isum[i], scaled::<VNNI>(p[i], sc));
                    }
                }
            }
        }
    }

    /// [`q6k_quarter`] for one activation row, all four quarters of half `h` at once: each
    /// byte of the weights is loaded once and unpacked into the four quarters' values (fewer
    /// instructions per weight byte, which is what a memory-bound single-row step needs).
    ///
    /// # Safety
    /// As [`q6k_quarter`].
    #[inline(always)]
    unsafe fn q6k_half_one<const VNNI: bool>(
        gb: *const u8,
        h: usize,
        at: *const u8,
        isum: &mut __m256i,
    ) {
        use super::{Q6K_HALF, Q6K_QH, Q6K_QL};
        // SAFETY (every access below): inside the group block, or within the 128 values.
        unsafe {
            // Column kk's low bits of quarters 0 and 2, of quarters 1 and 3, and its top bits.
            let qa_at = |kk: usize| gb.add(Q6K_QL + Q6K_HALF * h + 32 * kk);
            let qb_at = |kk: usize| gb.add(Q6K_QL + Q6K_HALF * h + 32 * (8 + kk));
            let qh_at = |kk: usize| gb.add(Q6K_QH + Q6K_HALF * h + 32 * kk);
            for quad in 0..2 {
                // Quarter s's sub-block here is 8h + 2s + quad.
                let sc: [__m256i; 4] =
                    std::array::from_fn(|s| q6k_scale::<VNNI>(gb, 8 * h + 2 * s + quad));
                for first in (4 * quad..4 * quad + 4).step_by(q6k_columns::<VNNI>()) {
                    let mut p = [_mm256_setzero_si256(); 4];
                    for kk in first..first + q6k_columns::<VNNI>() {
                        let (qa, qb, qh) = (ld(qa_at(kk)), ld(qb_at(kk)), ld(qh_at(kk)));
                        if kk % 2 == 0 {
                            // The three 64-byte lines these loads and the next column's are in.
                            for q in [qa_at(kk), qb_at(kk), qh_at(kk)] {
                                fetch(q.wrapping_add(STREAM_AHEAD), 1);
                            }
                        }
                        let u = [
                            q6k_unpack(0, qa, qh),
                            q6k_unpack(1, qb, qh),
                            q6k_unpack(2, qa, qh),
                            q6k_unpack(3, qb, qh),
                        ];
                        for s in 0..4 {
                            p[s] = dot::<VNNI>(p[s], u[s], bcast4(at.add(32 * s + 4 * kk)));
                        }
                    }
                    for s in 0..4 {
                        *isum = _mm256_add_epi32(*isum, scaled::<VNNI>(p[s], sc[s]));
                    }
                }
            }
        }
    }
}

/// The 512-bit kernels: two groups of eight rows side by side in one register (lanes 0-7 the
/// first group's rows, 8-15 the second's), so each `vpdpbusd` does twice the work of a 256-bit
/// one at the same rate. Their per-lane integers and float steps are those of the 256-bit
/// kernels, so they equal the reference bit for bit as well. Used for two or more activation
/// rows, where the kernels are compute-bound; one row streams from memory, and the 256-bit
/// pass with its prefetching does that better.
#[cfg(target_arch = "x86_64")]
mod zmm {
    use super::{QuantK, QK};
    use crate::kernels::x86::wide::{bcast4, f16x16, ld2, ld2_16, ld2_8};
    use crate::kernels::x86::{fetch_l2, BATCH_AHEAD};
    use crate::kernels::Format;
    use std::arch::x86_64::*;

    /// Two groups of eight interleaved rows of `fmt` (`gw`: the first group's blocks, then the
    /// second's) against `xs[i]`, added to the row lanes `accs[i]` (the first group's rows,
    /// then the second's).
    ///
    /// # Safety
    /// AVX-512 F, BW, VL and VNNI, and F16C; `gw` holds two groups of `xs[i].d.len()` blocks;
    /// `N == xs.len() <= accs.len()`.
    #[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn pair<const N: usize>(
        fmt: Format,
        gw: &[u8],
        xs: &[QuantK],
        accs: &mut [[f32; 16]],
    ) {
        // SAFETY: per the contract.
        unsafe {
            match fmt {
                Format::Q4K => q4k::<N>(gw, xs, accs),
                Format::Q6K => q6k::<N>(gw, xs, accs),
                other => unreachable!("{other:?} is not a K format"),
            }
        }
    }

    /// Q4_K for two groups (see the 256-bit `q4k`): both halves of each 4-bit column are
    /// unpacked from one load, with 32 registers to hold their sums.
    ///
    /// # Safety
    /// As [`pair`].
    #[inline(always)]
    unsafe fn q4k<const N: usize>(gw: &[u8], xs: &[QuantK], accs: &mut [[f32; 16]]) {
        use super::{Q4K_GROUP_BYTES as GB, Q4K_MIN, Q4K_NIB, Q4K_SC};
        let nb = xs[0].d.len();
        let second = nb * GB;
        // SAFETY: register operations (the callers run with AVX-512).
        let m4 = unsafe { _mm512_set1_epi8(0x0F) };
        let qs: [*const u8; N] = std::array::from_fn(|i| xs[i].q.as_ptr().cast());
        let b32: [*const i16; N] = std::array::from_fn(|i| xs[i].bs32.as_ptr());
        // SAFETY: `accs` has N entries of 16 floats.
        let mut acc: [__m512; N] =
            std::array::from_fn(|i| unsafe { _mm512_loadu_ps(accs[i].as_ptr()) });
        for b in 0..nb {
            // SAFETY: block `b` of each group is `GB` bytes inside `gw`; every activation row
            // holds `nb` blocks of 256 values and 8 sums (checked by the callers).
            unsafe {
                let pa = gw.as_ptr().add(b * GB);
                let pb = pa.add(second);
                fetch_l2(pa.wrapping_add(BATCH_AHEAD * GB), GB);
                fetch_l2(pb.wrapping_add(BATCH_AHEAD * GB), GB);
                let d = f16x16(pa, pb);
                let dmin = f16x16(pa.add(16), pb.add(16));
                let mut isum = [_mm512_setzero_si512(); N];
                for c in 0..4 {
                    let sc = |j: usize| {
                        _mm512_cvtepu8_epi32(ld2_8(pa.add(Q4K_SC + 8 * j), pb.add(Q4K_SC + 8 * j)))
                    };
                    let mut lo = [_mm512_setzero_si512(); N];
                    let mut hi = [_mm512_setzero_si512(); N];
                    for k in 0..8 {
                        let at = Q4K_NIB + (8 * c + k) * 32;
                        let v = ld2(pa.add(at), pb.add(at));
                        let u0 = _mm512_and_si512(v, m4);
                        let u1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                        for i in 0..N {
                            let a = qs[i].add(b * QK + 64 * c + 4 * k);
                            lo[i] = _mm512_dpbusd_epi32(lo[i], u0, bcast4(a));
                            hi[i] = _mm512_dpbusd_epi32(hi[i], u1, bcast4(a.add(32)));
                        }
                    }
                    let (s0, s1) = (sc(2 * c), sc(2 * c + 1));
                    for i in 0..N {
                        let s = _mm512_add_epi32(
                            _mm512_mullo_epi32(lo[i], s0),
                            _mm512_mullo_epi32(hi[i], s1),
                        );
                        isum[i] = _mm512_add_epi32(isum[i], s);
                    }
                }
                for i in 0..N {
                    let mut m = _mm512_setzero_si512();
                    for jp in 0..4 {
                        let at = Q4K_MIN + 16 * jp;
                        let mv = _mm512_cvtepu8_epi16(ld2_16(pa.add(at), pb.add(at)));
                        let bb = bcast4(b32[i].add(8 * b + 2 * jp).cast());
                        m = _mm512_add_epi32(m, _mm512_madd_epi16(mv, bb));
                    }
                    let dx = _mm512_set1_ps(*xs[i].d.get_unchecked(b));
                    let v = _mm512_sub_ps(
                        _mm512_mul_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum[i])),
                        _mm512_mul_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(m)),
                    );
                    acc[i] = _mm512_add_ps(acc[i], v);
                }
            }
        }
        for i in 0..N {
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(accs[i].as_mut_ptr(), acc[i]) };
        }
    }

    /// Quarter `s`'s unsigned 6-bit values of one column of both groups (see the 256-bit
    /// `q6k_unpack`).
    ///
    /// # Safety
    /// The caller runs with AVX-512 BW.
    #[inline(always)]
    unsafe fn q6k_unpack(s: usize, ql: __m512i, qh: __m512i) -> __m512i {
        // SAFETY: register operations only.
        unsafe {
            let m4 = _mm512_set1_epi8(0x0F);
            let lo = if s < 2 {
                _mm512_and_si512(ql, m4)
            } else {
                _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4)
            };
            let hi = match s {
                0 => _mm512_slli_epi16(qh, 4),
                1 => _mm512_slli_epi16(qh, 2),
                2 => qh,
                _ => _mm512_srli_epi16(qh, 2),
            };
            _mm512_or_si512(lo, _mm512_and_si512(hi, _mm512_set1_epi8(0x30)))
        }
    }

    /// Sub-block `j`'s scale of every row of both groups' blocks `a` and `b`, in i32 lanes.
    ///
    /// # Safety
    /// Whole group blocks at `a` and `b`; AVX-512 F.
    #[inline(always)]
    unsafe fn q6k_scale(a: *const u8, b: *const u8, j: usize) -> __m512i {
        // SAFETY: per the contract; the pair of sub-blocks' 16 bytes is inside each block.
        unsafe {
            // Row r's scale of sub-block j is byte 2r + j % 2 of the pair's 16.
            let at = super::Q6K_SC + 16 * (j / 2);
            let sel = _mm_add_epi8(
                _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14),
                _mm_set1_epi8((j % 2) as i8),
            );
            let (sa, sb) = (
                _mm_shuffle_epi8(_mm_loadu_si128(a.add(at).cast()), sel),
                _mm_shuffle_epi8(_mm_loadu_si128(b.add(at).cast()), sel),
            );
            _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(sa, sb))
        }
    }

    /// Adds quarter `S` (elements `128h + 32S..+32`: sub-blocks `8h + 2S` and `8h + 2S + 1`)
    /// of both groups' blocks `pa` and `pb` against the activations at `at[i]` (the half's
    /// first value) to `isum[i]`. `S` is a constant: with a plain loop LLVM left the unpacking
    /// branchy.
    ///
    /// # Safety
    /// As [`pair`]; `pa` and `pb` are whole group blocks and each `at[i]` has 128 readable
    /// values.
    #[inline(always)]
    unsafe fn q6k_quarter<const N: usize, const S: usize>(
        pa: *const u8,
        pb: *const u8,
        h: usize,
        at: [*const u8; N],
        isum: &mut [__m512i; N],
    ) {
        use super::{Q6K_HALF, Q6K_QH, Q6K_QL};
        for jj in 0..2 {
            // SAFETY (every access below): inside the group blocks, or within the 128 values.
            unsafe {
                let sc = q6k_scale(pa, pb, 8 * h + 2 * S + jj);
                let mut p = [_mm512_setzero_si512(); N];
                for kk in 4 * jj..4 * jj + 4 {
                    let l = Q6K_QL + Q6K_HALF * h + 32 * (8 * (S % 2) + kk);
                    let t = Q6K_QH + Q6K_HALF * h + 32 * kk;
                    let u = q6k_unpack(S, ld2(pa.add(l), pb.add(l)), ld2(pa.add(t), pb.add(t)));
                    for i in 0..N {
                        p[i] = _mm512_dpbusd_epi32(p[i], u, bcast4(at[i].add(32 * S + 4 * kk)));
                    }
                }
                for i in 0..N {
                    isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(p[i], sc));
                }
            }
        }
    }

    /// Q6_K for two groups (see the 256-bit `q6k`), one quarter (two sub-blocks) at a time.
    ///
    /// # Safety
    /// As [`pair`].
    #[inline(always)]
    unsafe fn q6k<const N: usize>(gw: &[u8], xs: &[QuantK], accs: &mut [[f32; 16]]) {
        use super::{Q6K_GROUP_BYTES as GB, Q6K_SC};
        let nb = xs[0].d.len();
        let second = nb * GB;
        let qs: [*const u8; N] = std::array::from_fn(|i| xs[i].q.as_ptr().cast());
        let bss: [*const i16; N] = std::array::from_fn(|i| xs[i].bs.as_ptr());
        // SAFETY: `accs` has N entries of 16 floats.
        let mut acc: [__m512; N] =
            std::array::from_fn(|i| unsafe { _mm512_loadu_ps(accs[i].as_ptr()) });
        for b in 0..nb {
            // SAFETY: block `b` of each group is `GB` bytes inside `gw`; every activation row
            // holds `nb` blocks of 256 values and 16 sums (checked by the callers).
            unsafe {
                let pa = gw.as_ptr().add(b * GB);
                let pb = pa.add(second);
                fetch_l2(pa.wrapping_add(BATCH_AHEAD * GB), GB);
                fetch_l2(pb.wrapping_add(BATCH_AHEAD * GB), GB);
                let d = f16x16(pa, pb);
                let mut isum = [_mm512_setzero_si512(); N];
                for h in 0..2 {
                    let at: [*const u8; N] = std::array::from_fn(|i| qs[i].add(b * QK + 128 * h));
                    q6k_quarter::<N, 0>(pa, pb, h, at, &mut isum);
                    q6k_quarter::<N, 1>(pa, pb, h, at, &mut isum);
                    q6k_quarter::<N, 2>(pa, pb, h, at, &mut isum);
                    q6k_quarter::<N, 3>(pa, pb, h, at, &mut isum);
                }
                for i in 0..N {
                    // The −32 offset of every value: Σ_j sc_j · (sum of sub-block j's q).
                    let mut off = _mm512_setzero_si512();
                    for jp in 0..8 {
                        let at = Q6K_SC + 16 * jp;
                        let sv = _mm512_cvtepi8_epi16(ld2_16(pa.add(at), pb.add(at)));
                        let bb = bcast4(bss[i].add(16 * b + 2 * jp).cast());
                        off = _mm512_add_epi32(off, _mm512_madd_epi16(sv, bb));
                    }
                    let is = _mm512_sub_epi32(isum[i], _mm512_slli_epi32(off, 5));
                    let dx = _mm512_set1_ps(*xs[i].d.get_unchecked(b));
                    let v = _mm512_mul_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(is));
                    acc[i] = _mm512_add_ps(acc[i], v);
                }
            }
        }
        for i in 0..N {
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(accs[i].as_mut_ptr(), acc[i]) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::tests::lcg;

    /// Random GGUF rows (every quant and scale bit pattern, finite f16 scales), as held in
    /// memory.
    fn random_weight(fmt: Format, rows: usize, cols: usize, s: &mut u64) -> Vec<u8> {
        let bb = fmt.gguf_block_bytes();
        let mut w: Vec<u8> = (0..rows * cols / QK * bb).map(|_| lcg(s) as u8).collect();
        for blk in w.chunks_exact_mut(bb) {
            let mut put = |at: usize, v: f32| {
                blk[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes())
            };
            let v = (lcg(s) % 1000) as f32 / 1e5;
            match fmt {
                Format::Q4K => {
                    put(0, v);
                    put(2, v / 3.0);
                }
                _ => put(208, v),
            }
        }
        match fmt {
            Format::Q4K => repack_q4k(&w, rows, cols),
            _ => repack_q6k(&w, rows, cols),
        }
    }

    fn dequant(fmt: Format, data: &[u8], row: usize, cols: usize) -> Vec<f32> {
        let mut out = vec![0f32; cols];
        fmt.dequantize_row(data, row, cols, &mut out);
        out
    }

    #[test]
    fn simd_equals_scalar_for_every_row_count() {
        if Isa::detect() == Isa::Scalar {
            return;
        }
        let mut s = 99;
        for fmt in [Format::Q4K, Format::Q6K] {
            for cols in [256, 1536] {
                let rows = 24;
                let data = random_weight(fmt, rows, cols, &mut s);
                for n in [1, 2, 3, 5, 6, 8, 9, 13] {
                    let xs: Vec<QuantK> = (0..n)
                        .map(|k| {
                            let x: Vec<f32> = (0..cols)
                                .map(|_| {
                                    (lcg(&mut s) as f32 / u32::MAX as f32 - 0.5) * (k + 1) as f32
                                })
                                .collect();
                            QuantK::quantize(&x)
                        })
                        .collect();
                    let run = |isa, xs: &[QuantK]| {
                        let mut out = vec![0f32; rows * xs.len()];
                        let mut outs: Vec<&mut [f32]> = out.chunks_exact_mut(rows).collect();
                        matmul(fmt, &data, 0, cols, xs, &mut outs, isa);
                        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    };
                    let reference = run(Isa::Scalar, &xs);
                    for &isa in &Isa::available()[1..] {
                        let simd = run(isa, &xs);
                        assert_eq!(simd, reference, "{isa:?} {fmt:?} cols={cols} n={n}");
                        // Each activation row alone gives the same bits as in the batch.
                        for i in 0..n {
                            let one = run(isa, &xs[i..i + 1]);
                            assert_eq!(
                                one,
                                simd[i * rows..(i + 1) * rows],
                                "{isa:?} {fmt:?} n={n} row {i}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn reference_matches_dequantized_product() {
        // The integer formulation is the format: compare with the dequantized weights.
        let mut s = 5;
        let cols = 512;
        for fmt in [Format::Q4K, Format::Q6K] {
            let w = random_weight(fmt, 8, cols, &mut s);
            let deq = dequant(fmt, &w, 5, cols);
            let x: Vec<f32> = (0..cols)
                .map(|_| lcg(&mut s) as f32 / u32::MAX as f32 - 0.5)
                .collect();
            let qx = QuantK::quantize(&x);
            let exact: f64 = deq.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
            let norm: f64 = deq.iter().map(|a| a.abs() as f64).sum::<f64>() * 0.5;
            let got = dot_scalar(fmt, &w, 5, &qx) as f64;
            assert!(
                (exact - got).abs() < 0.01 * norm,
                "{fmt:?}: {exact} vs {got}"
            );
            // And with the activation values it was given, exactly up to float rounding.
            let xq: Vec<f32> =
                qx.q.iter()
                    .enumerate()
                    .map(|(e, &q)| q as f32 * qx.d[e / QK])
                    .collect();
            let on_q: f64 = deq
                .iter()
                .zip(&xq)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum();
            assert!(
                (on_q - got).abs() < 1e-4 * norm.max(1.0),
                "{fmt:?}: {on_q} vs {got}"
            );
        }
    }
}
