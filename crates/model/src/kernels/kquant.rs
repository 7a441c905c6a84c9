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
//! - Q6_K (GGUF layout): lane `l` (0..8) holds the elements `e` with `(e % 32) / 4 == l`,
//!   `I_l = Σ sc[e/16]·u_e·q_e − 32·(sc[2l]·Σq + sc[2l+1]·Σq)` over the lane's elements and the
//!   16-element groups `2l` and `2l+1`, `acc_l = acc_l + (d·dx)·I_l`, and the result is
//!   `((acc_0+acc_4) + (acc_2+acc_6)) + ((acc_1+acc_5) + (acc_3+acc_7))`.
//!
//! Integer sums are exact in any order and the float steps are the same operations in the same
//! order, so the AVX2 path equals the reference bit for bit. Each activation row's result is
//! computed the same way whatever other rows share the pass: the SIMD path only reuses each
//! loaded and unpacked weight block for up to [`MAX_ROWS`] activation rows.

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

/// Dequantizes row `row` of GGUF-layout Q6_K `data` (`cols` wide) into `out[..cols]`.
pub fn dequantize_q6k(data: &[u8], row: usize, cols: usize, out: &mut [f32]) {
    let rb = Format::Q6K.row_bytes(cols);
    let blocks = data[row * rb..(row + 1) * rb].chunks_exact(210);
    for (blk, o) in blocks.zip(out[..cols].chunks_exact_mut(QK)) {
        let d = f16_at(blk, 208);
        for (e, (v, &u)) in o.iter_mut().zip(&q6k_values(blk)).enumerate() {
            *v = d * (blk[192 + e / 16] as i8) as f32 * (u as i32 - 32) as f32;
        }
    }
}

/// The eight lanes reduced in the fixed order the SIMD path uses.
#[inline(always)]
fn reduce(acc: [f32; 8]) -> f32 {
    let s: [f32; 4] = std::array::from_fn(|k| acc[k] + acc[k + 4]);
    (s[0] + s[2]) + (s[1] + s[3])
}

/// Q6_K's 256 six-bit values of one block, in element order.
fn q6k_values(blk: &[u8]) -> [u8; QK] {
    let mut u = [0u8; QK];
    for h in 0..2 {
        for l in 0..32 {
            let (ql0, ql1) = (blk[64 * h + l], blk[64 * h + 32 + l]);
            let qh = blk[128 + 32 * h + l];
            let o = 128 * h + l;
            u[o] = (ql0 & 15) | ((qh & 3) << 4);
            u[o + 32] = (ql1 & 15) | (((qh >> 2) & 3) << 4);
            u[o + 64] = (ql0 >> 4) | (((qh >> 4) & 3) << 4);
            u[o + 96] = (ql1 >> 4) | (((qh >> 6) & 3) << 4);
        }
    }
    u
}

/// The reference: row `row` of the weight rows `w` (rows of `rb` bytes as held in memory,
/// starting at a multiple of [`Q4K_ROWS`]) against one activation row.
pub fn dot_scalar(fmt: Format, w: &[u8], rb: usize, row: usize, x: &QuantK) -> f32 {
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
            let mut acc = [0f32; 8];
            let row = &w[row * rb..(row + 1) * rb];
            for (b, blk) in row.chunks_exact(210).enumerate() {
                let q = &x.q[b * QK..(b + 1) * QK];
                let bs = &x.bs[b * 16..(b + 1) * 16];
                let dx = x.d[b];
                let mut lane = [0i32; 8];
                let d = f16_at(blk, 208);
                let sc = |k: usize| blk[192 + k] as i8 as i32;
                let u = q6k_values(blk);
                for (e, &qe) in q.iter().enumerate() {
                    lane[(e % 32) / 4] += sc(e / 16) * u[e] as i32 * qe as i32;
                }
                for l in 0..8 {
                    lane[l] -=
                        32 * (sc(2 * l) * bs[2 * l] as i32 + sc(2 * l + 1) * bs[2 * l + 1] as i32);
                    acc[l] += (d * dx) * lane[l] as f32;
                }
            }
            reduce(acc)
        }
        other => unreachable!("{other:?} is not a K format"),
    }
}

/// `out[k * xs.len() + i] = W[first_row + k] · xs[i]` for the rows `out` covers (weight-row-major,
/// so threads can split rows).
pub fn matmul_rows_major(
    fmt: Format,
    data: &[u8],
    first_row: usize,
    cols: usize,
    xs: &[QuantK],
    out: &mut [f32],
    isa: Isa,
) {
    let rb = fmt.row_bytes(cols);
    let n = xs.len();
    let rows = out.len() / n;
    let w = &data[first_row * rb..(first_row + rows) * rb];
    assert!(
        xs.iter().all(|x| x.q.len() == cols),
        "activation rows of {cols}"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::matmul(fmt, w, rb, xs, out),
        _ => {
            for (k, dst) in out.chunks_mut(n).enumerate() {
                for (x, d) in xs.iter().zip(dst.iter_mut()) {
                    *d = dot_scalar(fmt, w, rb, k, x);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{QuantK, MAX_ROWS, QK};
    use crate::kernels::{Format, Isa};
    use std::arch::x86_64::*;

    /// `pat(a, b)`: a shuffle that fills the low 128-bit lane with the `i16` at index `a` and the
    /// high lane with the one at index `b` (of each lane's own eight).
    const fn pat(a: usize, b: usize) -> [u8; 32] {
        let mut p = [0u8; 32];
        let mut k = 0;
        while k < 8 {
            p[2 * k] = 2 * a as u8;
            p[2 * k + 1] = 2 * a as u8 + 1;
            p[16 + 2 * k] = 2 * b as u8;
            p[16 + 2 * k + 1] = 2 * b as u8 + 1;
            k += 1;
        }
        p
    }
    /// Q6_K: the scales of 16-element groups 2t and 2t + 1 in the two lanes.
    static Q6K_PAT: [[u8; 32]; 4] = [pat(0, 1), pat(2, 3), pat(4, 5), pat(6, 7)];

    /// Weight rows per pass over a group of activation rows: the tile stays in cache while
    /// every group of [`MAX_ROWS`] activation rows goes over it.
    const TILE: usize = 16;

    /// Blocks per column chunk: the activation rows' part of a chunk stays in the L1 cache
    /// while every row of the tile goes over it (wide inputs, like the MLP's down projection,
    /// would otherwise stream the activations from L2 once per weight row).
    const KC: usize = 8;

    /// `out[k * xs.len() + i] = w[k] · xs[i]` for every row of `w` (rows of `rb` bytes).
    pub fn matmul(fmt: Format, w: &[u8], rb: usize, xs: &[QuantK], out: &mut [f32]) {
        assert_eq!(Isa::detect(), Isa::Avx2, "the AVX2 kernels need AVX2");
        let n = xs.len();
        let nb = xs[0].d.len();
        assert!(rb == nb * fmt.block_bytes() && w.len().is_multiple_of(rb));
        assert!(xs
            .iter()
            .all(|x| x.d.len() == nb && x.q.len() == nb * QK && x.bs.len() == nb * 16));
        assert!(out.len() >= w.len() / rb * n);
        if fmt == Format::Q4K {
            return q4k_matmul(w, rb, xs, out);
        }
        // Lane accumulators of every (row, activation row) pair of a tile, kept across the
        // column chunks; reduced at the end in the reference's order.
        let mut accs = vec![[0f32; 8]; TILE * n];
        for (t, wt) in w.chunks(TILE * rb).enumerate() {
            let rows = wt.len() / rb;
            accs.iter_mut().for_each(|a| *a = [0.0; 8]);
            for b0 in (0..nb).step_by(KC) {
                let blocks = b0..(b0 + KC).min(nb);
                for (c, xc) in xs.chunks(MAX_ROWS).enumerate() {
                    let (a, o) = (&mut accs[..], c * MAX_ROWS);
                    let bl = blocks.clone();
                    macro_rules! go {
                        ($($k:literal)*) => {
                            match (fmt, xc.len()) {
                                $(
                                    // SAFETY: AVX2 and the sizes are checked above.
                                    (Format::Q6K, $k) => unsafe { q6k::<$k>(wt, rb, xc, bl, a, n, o) },
                                )*
                                (f, k) => unreachable!("{f:?} with {k} rows"),
                            }
                        };
                    }
                    go!(1 2 3 4 5);
                }
            }
            for (k, a) in accs[..rows * n].iter().enumerate() {
                out[t * TILE * n + k] = super::reduce(*a);
            }
        }
    }

    /// Fetches the same block of the next row into the cache: a tile of rows wider than one
    /// column chunk is read chunk by chunk, row by row, a stride the hardware prefetcher does
    /// not follow (without this, the 1536 x 8960 Q6_K product ran 5x slower).
    #[inline(always)]
    fn ahead(blk: *const u8, rb: usize, len: usize) {
        let next = blk.wrapping_add(rb);
        for line in (0..len + 63).step_by(64) {
            // SAFETY: a prefetch is a hint; it never faults or reads into the program.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(line).cast()) };
        }
    }

    /// How far ahead of the block in hand a tile read in one piece is fetched.
    const STREAM_AHEAD: usize = 4096;

    /// Fetches the block `STREAM_AHEAD` bytes further on (rows of a tile narrower than a column
    /// chunk are read in one sequential stream).
    #[inline(always)]
    fn stream(blk: *const u8, len: usize) {
        let at = blk.wrapping_add(STREAM_AHEAD);
        for line in (0..len + 63).step_by(64) {
            // SAFETY: a prefetch is a hint; it never faults or reads into the program.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(line).cast()) };
        }
    }

    /// Loads 32 bytes.
    ///
    /// # Safety
    /// `p` points at 32 readable bytes.
    #[inline(always)]
    unsafe fn ld(p: *const u8) -> __m256i {
        // SAFETY: per the contract.
        unsafe { _mm256_loadu_si256(p.cast()) }
    }

    /// Interleaved Q4_K: every group of eight rows against every activation row; the float
    /// lanes are the group's rows.
    fn q4k_matmul(w: &[u8], rb: usize, xs: &[QuantK], out: &mut [f32]) {
        let n = xs.len();
        let group = super::Q4K_ROWS * rb;
        assert!(w.len().is_multiple_of(group));
        assert!(xs.iter().all(|x| x.bs32.len() == x.d.len() * 8));
        let mut accs = vec![[0f32; 8]; n];
        for (g, wg) in w.chunks_exact(group).enumerate() {
            accs.iter_mut().for_each(|a| *a = [0.0; 8]);
            for (c, xc) in xs.chunks(MAX_ROWS).enumerate() {
                let a = &mut accs[c * MAX_ROWS..];
                match xc.len() {
                    // SAFETY: AVX2 checked by the caller; sizes checked there and above.
                    1 => unsafe { q4k::<1>(wg, xc, a) },
                    2 => unsafe { q4k::<2>(wg, xc, a) },
                    3 => unsafe { q4k::<3>(wg, xc, a) },
                    4 => unsafe { q4k::<4>(wg, xc, a) },
                    5 => unsafe { q4k::<5>(wg, xc, a) },
                    k => unreachable!("{k} rows"),
                }
            }
            for (i, a) in accs.iter().enumerate() {
                for (r, v) in a.iter().enumerate() {
                    out[(g * super::Q4K_ROWS + r) * n + i] = *v;
                }
            }
        }
    }

    /// Adds one group of eight interleaved Q4_K rows (`gw`: its blocks) against `xs[i]` to the
    /// row lanes `accs[i]`.
    ///
    /// # Safety
    /// AVX2 and F16C; `gw` holds `xs[i].d.len()` group blocks; `N == xs.len() <= accs.len()`.
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn q4k<const N: usize>(gw: &[u8], xs: &[QuantK], accs: &mut [[f32; 8]]) {
        use super::{Q4K_GROUP_BYTES as GB, Q4K_MIN, Q4K_NIB, Q4K_SC};
        let m4 = _mm256_set1_epi8(0x0F);
        let nb = xs[0].d.len();
        let qs: [*const u8; N] = std::array::from_fn(|i| xs[i].q.as_ptr().cast());
        let b32: [*const i16; N] = std::array::from_fn(|i| xs[i].bs32.as_ptr());
        let bcast = |p: *const u8| {
            // SAFETY: callers pass pointers to 4 readable bytes.
            _mm256_set1_epi32(unsafe { std::ptr::read_unaligned(p as *const i32) })
        };
        // SAFETY: `accs` has N entries of 8 floats.
        let mut acc: [__m256; N] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(accs[i].as_ptr()) });
        for b in 0..nb {
            // SAFETY: group block `b` is `GB` bytes inside `gw`; every activation row holds `nb`
            // blocks of 256 values and 8 sums (checked by the callers).
            unsafe {
                let gb = gw.as_ptr().add(b * GB);
                // The group's blocks are one sequential stream; fetch two blocks ahead.
                for line in (0..GB).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(gb.wrapping_add(2 * GB + line).cast());
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(gb.cast()));
                let dmin = _mm256_cvtph_ps(_mm_loadu_si128(gb.add(16).cast()));
                let mut isum = [_mm256_setzero_si256(); N];
                // Sub-block 2c + h: the low (h = 0) or high halves of chunk c's bytes.
                let mut sub = |c: usize, h: usize| {
                    let s8 = _mm_loadl_epi64(gb.add(Q4K_SC + 8 * (2 * c + h)).cast());
                    let sc = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s8, s8));
                    let mut p = [_mm256_setzero_si256(); N];
                    for k in 0..8 {
                        let v = ld(gb.add(Q4K_NIB + (8 * c + k) * 32));
                        let u = if h == 0 {
                            _mm256_and_si256(v, m4)
                        } else {
                            _mm256_and_si256(_mm256_srli_epi16(v, 4), m4)
                        };
                        for i in 0..N {
                            let a = bcast(qs[i].add(b * QK + 64 * c + 32 * h + 4 * k));
                            // At most 8 · 2 · 15 · 127 = 30480: no i16 overflow.
                            p[i] = _mm256_add_epi16(p[i], _mm256_maddubs_epi16(u, a));
                        }
                    }
                    for i in 0..N {
                        isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(p[i], sc));
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
                        let bb = bcast(b32[i].add(8 * b + 2 * jp).cast());
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

    /// Adds blocks `blocks` of every row `r` of `w` against `xs[i]` to the lanes
    /// `accs[r * stride + off + i]`.
    ///
    /// # Safety
    /// AVX2 and F16C; `w` holds whole rows of `rb` bytes, each `xs[i].d.len()` blocks, and
    /// `blocks` is within them; `N == xs.len()`; `accs` reaches `(rows - 1) * stride + off + N`.
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn q6k<const N: usize>(
        w: &[u8],
        rb: usize,
        xs: &[QuantK],
        blocks: std::ops::Range<usize>,
        accs: &mut [[f32; 8]],
        stride: usize,
        off: usize,
    ) {
        let m4 = _mm256_set1_epi8(0x0F);
        let m30 = _mm256_set1_epi8(0x30);
        let qs: [*const i8; N] = std::array::from_fn(|i| xs[i].q.as_ptr());
        let bss: [*const i16; N] = std::array::from_fn(|i| xs[i].bs.as_ptr());
        for (r, row) in w.chunks_exact(rb).enumerate() {
            let at = r * stride + off;
            // SAFETY: `accs` has `stride` entries per row of the tile; `off + N <= stride`.
            let mut acc: [__m256; N] =
                std::array::from_fn(|i| unsafe { _mm256_loadu_ps(accs[at + i].as_ptr()) });
            for b in blocks.clone() {
                // SAFETY: block `b` of the row is 210 bytes; the activation rows hold `nb`
                // blocks (checked by the caller).
                unsafe {
                    let blk = row.as_ptr().add(b * 210);
                    if rb > KC * 210 {
                        ahead(blk, rb, 210);
                    } else {
                        stream(blk, 210);
                    }
                    let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(192).cast()));
                    let halves = [
                        _mm256_permute2x128_si256(sc16, sc16, 0x00),
                        _mm256_permute2x128_si256(sc16, sc16, 0x11),
                    ];
                    let mut isum = [_mm256_setzero_si256(); N];
                    for (h, &sc) in halves.iter().enumerate() {
                        let ql0 = ld(blk.add(64 * h));
                        let ql1 = ld(blk.add(64 * h + 32));
                        let qh = ld(blk.add(128 + 32 * h));
                        let lo = |v: __m256i| _mm256_and_si256(v, m4);
                        let hi = |v: __m256i| _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                        let u = [
                            _mm256_or_si256(
                                lo(ql0),
                                _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30),
                            ),
                            _mm256_or_si256(
                                lo(ql1),
                                _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30),
                            ),
                            _mm256_or_si256(hi(ql0), _mm256_and_si256(qh, m30)),
                            _mm256_or_si256(
                                hi(ql1),
                                _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30),
                            ),
                        ];
                        for (t, &ut) in u.iter().enumerate() {
                            let s = _mm256_shuffle_epi8(sc, ld(Q6K_PAT[t].as_ptr()));
                            for i in 0..N {
                                let q = qs[i].add(b * QK + 128 * h + 32 * t).cast::<u8>();
                                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(ut, ld(q)), s);
                                isum[i] = _mm256_add_epi32(isum[i], p);
                            }
                        }
                    }
                    let d = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(
                        blk.add(208) as *const u16
                    ) as i32));
                    for i in 0..N {
                        // The −32 offset of every value, from the 16-element sums.
                        let off = _mm256_madd_epi16(ld(bss[i].add(16 * b).cast()), sc16);
                        let is = _mm256_sub_epi32(isum[i], _mm256_slli_epi32(off, 5));
                        let f = _mm256_broadcastss_ps(_mm_mul_ps(
                            d,
                            _mm_set1_ps(*xs[i].d.get_unchecked(b)),
                        ));
                        acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(f, _mm256_cvtepi32_ps(is)));
                    }
                }
            }
            for i in 0..N {
                // SAFETY: as above.
                unsafe { _mm256_storeu_ps(accs[at + i].as_mut_ptr(), acc[i]) };
            }
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
            _ => w,
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
                for n in [1, 2, 3, 5, 8, 9, 13] {
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
                        matmul_rows_major(fmt, &data, 0, cols, xs, &mut out, isa);
                        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    };
                    let simd = run(Isa::detect(), &xs);
                    assert_eq!(simd, run(Isa::Scalar, &xs), "{fmt:?} cols={cols} n={n}");
                    // Each activation row alone gives the same bits as in the batch.
                    for i in 0..n {
                        let one = run(Isa::detect(), &xs[i..i + 1]);
                        for r in 0..rows {
                            assert_eq!(one[r], simd[r * n + i], "{fmt:?} n={n} row {i}");
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
            let got = dot_scalar(fmt, &w, fmt.row_bytes(cols), 5, &qx) as f64;
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
