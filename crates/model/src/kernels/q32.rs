//! Q8_0, Q4_1 and Q5_0: 32-element blocks against activations quantized per 32 elements
//! ([`Quant32`]), with the weight rows held interleaved in groups of eight ([`repack`]) so that
//! the integer sums come out one lane per weight row and need no horizontal sums.
//!
//! The reference ([`dot_scalar`]) defines the result. For weight row `w` and activation row `x`
//! (values `q`, per block scale `dx`, integer sum `S` and `dx·S`), `acc` starts at 0 and every
//! block, in order, does:
//! - Q8_0 (`w = d·v`, `v` an `i8`): `I = Σ v·q`, `acc = fma(d·dx, I, acc)`;
//! - Q5_0 (`w = d·(u − 16)`, `u` 5 bits): `I = Σ u·q − 16·S`, `acc = fma(d·dx, I, acc)`;
//! - Q4_1 (`w = d·u + m`, `u` 4 bits): `I = Σ u·q`, `acc = fma(m, dx·S, fma(d·dx, I, acc))`.
//!
//! `I` is an exact integer whatever the order of its sum, and the float steps are one multiply
//! and fused multiply-adds (correctly rounded, so `f32::mul_add` and the FMA instruction agree),
//! so the AVX2 path equals the reference bit for bit. Each activation row's result is computed
//! the same way whatever other rows share the pass: the SIMD path only reuses each loaded and
//! unpacked weight block for up to [`MAX_ROWS`] activation rows ([`WIDE_ROWS`] in the 512-bit
//! pass).

use super::{f16_at, Format, Isa};

/// Elements per block.
pub const QB: usize = 32;

/// Weight rows interleaved in one group.
pub const ROWS: usize = 8;

/// Activation rows handled together by one pass over a weight group.
pub const MAX_ROWS: usize = 4;

/// Activation rows handled together by one 512-bit pass over two groups (its 32 registers
/// hold more rows' sums; five rows, a 4-token draft's verification, take one pass).
pub const WIDE_ROWS: usize = 8;

/// An activation row quantized per 32 elements to `i8`.
#[derive(Debug, Default, Clone)]
pub struct Quant32 {
    /// One value per element, in -127..=127.
    pub q: Vec<i8>,
    /// Scale of each block.
    pub d: Vec<f32>,
    /// Integer sum of each block's values.
    pub s: Vec<i32>,
    /// `d · s` of each block (Q4_1's offset term).
    pub ds: Vec<f32>,
}

impl Quant32 {
    /// Quantizes `x` (length a multiple of 32).
    pub fn quantize(x: &[f32]) -> Self {
        assert!(
            x.len().is_multiple_of(QB),
            "row length {} not a multiple of 32",
            x.len()
        );
        let nb = x.len() / QB;
        let mut q = vec![0i8; x.len()];
        let (mut d, mut s, mut ds) = (vec![0f32; nb], vec![0i32; nb], vec![0f32; nb]);
        for (b, (xb, qb)) in x.chunks_exact(QB).zip(q.chunks_exact_mut(QB)).enumerate() {
            d[b] = super::quantize_block(xb, qb);
            s[b] = qb.iter().map(|&v| v as i32).sum();
            ds[b] = d[b] * s[b] as f32;
        }
        Self { q, d, s, ds }
    }
}

/// Bytes of one block of a group of eight rows (eight times the GGUF block: no padding).
///
/// Every group block starts with the eight rows' f16 scales (16 bytes). Then:
/// - Q8_0: the values as `[4-element column k (8)][row][4]`;
/// - Q4_1: the eight f16 mins, then the nibbles as `[column c (4)][row][4]`, byte `t` of
///   column `c` holding element `4c + t` in its low half and `16 + 4c + t` in its high half
///   (as in GGUF);
/// - Q5_0: the fifth bits as `[row][4]`, bit `k` of byte `t` holding element `4k + t`'s, then
///   the nibbles as Q4_1's.
pub fn group_bytes(fmt: Format) -> usize {
    ROWS * fmt.block_bytes()
}

const Q8_VALS: usize = 16;
const Q41_MIN: usize = 16;
const Q41_NIB: usize = 32;
const Q50_HIGH: usize = 16;
const Q50_NIB: usize = 48;

/// Repacks GGUF rows (`rows` a multiple of 8, `cols` of 32) into the interleaved layout.
pub fn repack(fmt: Format, gguf: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    assert!(rows.is_multiple_of(ROWS) && cols.is_multiple_of(QB));
    let (nb, bb, gbytes) = (cols / QB, fmt.block_bytes(), group_bytes(fmt));
    let mut out = vec![0u8; rows / ROWS * nb * gbytes];
    for (g, dst) in out.chunks_exact_mut(nb * gbytes).enumerate() {
        for (b, o) in dst.chunks_exact_mut(gbytes).enumerate() {
            for r in 0..ROWS {
                let at = ((g * ROWS + r) * nb + b) * bb;
                let blk = &gguf[at..at + bb];
                o[2 * r..2 * r + 2].copy_from_slice(&blk[0..2]);
                let mut columns = |dst: usize, src: usize, n: usize| {
                    for k in 0..n {
                        let to = dst + 32 * k + 4 * r;
                        o[to..to + 4].copy_from_slice(&blk[src + 4 * k..src + 4 * k + 4]);
                    }
                };
                match fmt {
                    Format::Q8_0 => columns(Q8_VALS, 2, 8),
                    Format::Q4_1 => {
                        columns(Q41_NIB, 4, 4);
                        o[Q41_MIN + 2 * r..Q41_MIN + 2 * r + 2].copy_from_slice(&blk[2..4]);
                    }
                    Format::Q5_0 => {
                        columns(Q50_NIB, 6, 4);
                        let qh = u32::from_le_bytes(blk[2..6].try_into().expect("4 bytes"));
                        for t in 0..4 {
                            o[Q50_HIGH + 4 * r + t] =
                                (0..8).fold(0u8, |v, k| v | (((qh >> (4 * k + t)) & 1) as u8) << k);
                        }
                    }
                    other => unreachable!("{other:?} is not a 32-element format"),
                }
            }
        }
    }
    out
}

/// One block of one row, read from the interleaved layout.
struct Block {
    d: f32,
    /// Q4_1's min (0 otherwise).
    m: f32,
    /// The stored integers: `i8` values (Q8_0), nibbles (Q4_1) or 5-bit values (Q5_0).
    v: [i32; QB],
}

/// Block `b` of row `row` of interleaved `data` with `nb` blocks per row.
fn block(fmt: Format, data: &[u8], nb: usize, row: usize, b: usize) -> Block {
    let (g, r) = (row / ROWS, row % ROWS);
    let gbytes = group_bytes(fmt);
    let o = &data[(g * nb + b) * gbytes..(g * nb + b + 1) * gbytes];
    let nib = |at: usize, e: usize| {
        let byte = o[at + 32 * (e % 16 / 4) + 4 * r + e % 4];
        (if e < 16 { byte & 15 } else { byte >> 4 }) as i32
    };
    let (m, v) = match fmt {
        Format::Q8_0 => (
            0.0,
            std::array::from_fn(|e| o[Q8_VALS + 32 * (e / 4) + 4 * r + e % 4] as i8 as i32),
        ),
        Format::Q4_1 => (
            f16_at(o, Q41_MIN + 2 * r),
            std::array::from_fn(|e| nib(Q41_NIB, e)),
        ),
        Format::Q5_0 => (
            0.0,
            std::array::from_fn(|e| {
                let high = (o[Q50_HIGH + 4 * r + e % 4] >> (e / 4)) & 1;
                nib(Q50_NIB, e) | (high as i32) << 4
            }),
        ),
        other => unreachable!("{other:?} is not a 32-element format"),
    };
    Block {
        d: f16_at(o, 2 * r),
        m,
        v,
    }
}

/// Dequantizes row `row` of interleaved `data` (`cols` wide) into `out[..cols]`.
pub fn dequantize(fmt: Format, data: &[u8], row: usize, cols: usize, out: &mut [f32]) {
    let nb = cols / QB;
    for (b, o) in out[..cols].chunks_exact_mut(QB).enumerate() {
        let k = block(fmt, data, nb, row, b);
        for (x, &v) in o.iter_mut().zip(&k.v) {
            *x = match fmt {
                Format::Q4_1 => k.d * v as f32 + k.m,
                Format::Q5_0 => k.d * (v - 16) as f32,
                _ => k.d * v as f32,
            };
        }
    }
}

/// The reference: row `row` of the interleaved weight rows `w` (`nb` blocks a row, starting at
/// a multiple of [`ROWS`]) against one activation row.
pub fn dot_scalar(fmt: Format, w: &[u8], row: usize, x: &Quant32) -> f32 {
    let nb = x.d.len();
    let mut acc = 0f32;
    for b in 0..nb {
        let k = block(fmt, w, nb, row, b);
        let q = &x.q[b * QB..(b + 1) * QB];
        let mut i: i32 = k.v.iter().zip(q).map(|(&v, &q)| v * q as i32).sum();
        if fmt == Format::Q5_0 {
            i -= 16 * x.s[b];
        }
        acc = (k.d * x.d[b]).mul_add(i as f32, acc);
        if fmt == Format::Q4_1 {
            acc = k.m.mul_add(x.ds[b], acc);
        }
    }
    acc
}

/// `outs[i][k] = W[first_row + k] · xs[i]` for the rows `outs` covers (each `outs[i]` the
/// same length; `first_row` and that length multiples of [`ROWS`]).
pub fn matmul(
    fmt: Format,
    data: &[u8],
    first_row: usize,
    cols: usize,
    xs: &[Quant32],
    outs: &mut [&mut [f32]],
    isa: Isa,
) {
    let rb = fmt.row_bytes(cols);
    let rows = outs[0].len();
    assert!(first_row.is_multiple_of(ROWS) && rows.is_multiple_of(ROWS));
    assert!(
        outs.len() == xs.len() && outs.iter().all(|o| o.len() == rows),
        "one output row of {rows} per activation row"
    );
    let w = &data[first_row * rb..(first_row + rows) * rb];
    assert!(
        xs.iter()
            .all(|x| x.q.len() == cols && x.d.len() == cols / QB),
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
    use super::{group_bytes, Quant32, MAX_ROWS, QB, ROWS, WIDE_ROWS};
    use crate::kernels::x86::{bcast4, fetch, ld};
    use crate::kernels::{Format, Isa};
    use std::arch::x86_64::*;

    pub(super) const Q8_0: u8 = 0;
    pub(super) const Q4_1: u8 = 1;
    pub(super) const Q5_0: u8 = 2;

    /// `outs[i][k] = w[k] · xs[i]` for every row of `w` (rows of `rb` bytes, whole groups of
    /// eight). `wide`: two or more activation rows take the 512-bit VNNI kernels, two groups
    /// at a time.
    pub fn matmul(
        fmt: Format,
        w: &[u8],
        rb: usize,
        xs: &[Quant32],
        outs: &mut [&mut [f32]],
        wide: bool,
    ) {
        let isa = if wide { Isa::Avx512Vnni } else { Isa::Avx2 };
        assert!(isa.supported(), "this CPU has no {isa:?}");
        let nb = xs[0].d.len();
        assert!(rb == nb * fmt.block_bytes() && w.len().is_multiple_of(ROWS * rb));
        assert!(xs.iter().all(|x| x.d.len() == nb
            && x.q.len() == nb * QB
            && x.s.len() == nb
            && x.ds.len() == nb));
        assert!(outs.iter().all(|o| o.len() == w.len() / rb));
        let gsize = ROWS * rb;
        crate::kernels::walk_groups(
            w.len() / gsize,
            xs,
            outs,
            MAX_ROWS,
            wide.then_some(WIDE_ROWS),
            |g, xc, a| {
                let wg = &w[g * gsize..(g + 1) * gsize];
                macro_rules! go {
                    ($($f:ident $k:literal),*) => {
                        match (fmt, xc.len()) {
                            $(
                                // SAFETY: AVX2 checked above; sizes checked above.
                                (Format::$f, $k) => unsafe { group::<$f, $k>(wg, xc, a) },
                            )*
                            (f, k) => unreachable!("{f:?} with {k} rows"),
                        }
                    };
                }
                go!(Q8_0 1, Q8_0 2, Q8_0 3, Q8_0 4, Q4_1 1, Q4_1 2, Q4_1 3, Q4_1 4,
                    Q5_0 1, Q5_0 2, Q5_0 3, Q5_0 4);
            },
            |g, xc, a| {
                let wp = &w[g * gsize..(g + 2) * gsize];
                macro_rules! go {
                    ($($f:ident $k:literal),*) => {
                        match (fmt, xc.len()) {
                            $(
                                // SAFETY: the ISA checked above (VNNI comes with AVX-512 F
                                // and BW here); sizes checked above.
                                (Format::$f, $k) => unsafe {
                                    super::zmm::pair::<$f, $k>(wp, xc, a)
                                },
                            )*
                            (f, k) => unreachable!("{f:?} with {k} rows"),
                        }
                    };
                }
                go!(Q8_0 2, Q8_0 3, Q8_0 4, Q8_0 5, Q8_0 6, Q8_0 7, Q8_0 8,
                    Q4_1 2, Q4_1 3, Q4_1 4, Q4_1 5, Q4_1 6, Q4_1 7, Q4_1 8,
                    Q5_0 2, Q5_0 3, Q5_0 4, Q5_0 5, Q5_0 6, Q5_0 7, Q5_0 8);
            },
        );
    }

    /// How far ahead of the group block in hand the weights are fetched.
    const AHEAD: usize = 2048;

    /// Adds one group of eight interleaved rows (`gw`: its blocks) against `xs[i]` to the row
    /// lanes `accs[i]`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `gw` holds `xs[i].d.len()` group blocks of format `F`;
    /// `N == xs.len() <= accs.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group<const F: u8, const N: usize>(gw: &[u8], xs: &[Quant32], accs: &mut [[f32; 8]]) {
        let fmt = [Format::Q8_0, Format::Q4_1, Format::Q5_0][F as usize];
        let gbytes = group_bytes(fmt);
        let nb = xs[0].d.len();
        let (m4, m10, ones) = (
            _mm256_set1_epi8(0x0F),
            _mm256_set1_epi8(0x10),
            _mm256_set1_epi16(1),
        );
        let qs: [*const u8; N] = std::array::from_fn(|i| xs[i].q.as_ptr().cast());
        // SAFETY: `accs` has N entries of 8 floats.
        let mut acc: [__m256; N] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(accs[i].as_ptr()) });
        for b in 0..nb {
            // SAFETY: group block `b` is `gbytes` bytes inside `gw`; every activation row holds
            // `nb` blocks (checked by the caller).
            unsafe {
                let gb = gw.as_ptr().add(b * gbytes);
                fetch(gb.wrapping_add(AHEAD), gbytes);
                // Four activation values of row `i` from element `e` of this block, in every
                // lane.
                let act = |i: usize, e: usize| bcast4(qs[i].add(b * QB + e));
                let mut isum = [_mm256_setzero_si256(); N];
                if F == Q8_0 {
                    for k in 0..8 {
                        let v = ld(gb.add(super::Q8_VALS + 32 * k));
                        // |v| times q with v's sign: 2 · 128 · 127 < 32768, no i16 overflow.
                        let av = _mm256_sign_epi8(v, v);
                        for (i, s) in isum.iter_mut().enumerate() {
                            let p = _mm256_maddubs_epi16(av, _mm256_sign_epi8(act(i, 4 * k), v));
                            *s = _mm256_add_epi32(*s, _mm256_madd_epi16(p, ones));
                        }
                    }
                } else {
                    let nib = if F == Q4_1 {
                        super::Q41_NIB
                    } else {
                        super::Q50_NIB
                    };
                    // Fifth bits, moved so that column c's are bit 4 of each byte after a right
                    // shift by c (elements 4c + t, then 16 + 4c + t).
                    let (mut h_lo, mut h_hi) = if F == Q5_0 {
                        let h = ld(gb.add(super::Q50_HIGH));
                        (_mm256_slli_epi16(h, 4), h)
                    } else {
                        (_mm256_setzero_si256(), _mm256_setzero_si256())
                    };
                    // Per half, four `maddubs` sums: 4 · 2 · 31 · 127 = 31496, no i16 overflow.
                    let mut p = [[_mm256_setzero_si256(); 2]; N];
                    for c in 0..4 {
                        let v = ld(gb.add(nib + 32 * c));
                        let mut lo = _mm256_and_si256(v, m4);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                        if F == Q5_0 {
                            lo = _mm256_or_si256(lo, _mm256_and_si256(h_lo, m10));
                            hi = _mm256_or_si256(hi, _mm256_and_si256(h_hi, m10));
                            h_lo = _mm256_srli_epi16(h_lo, 1);
                            h_hi = _mm256_srli_epi16(h_hi, 1);
                        }
                        for (i, [p_lo, p_hi]) in p.iter_mut().enumerate() {
                            *p_lo =
                                _mm256_add_epi16(*p_lo, _mm256_maddubs_epi16(lo, act(i, 4 * c)));
                            let a = _mm256_maddubs_epi16(hi, act(i, 16 + 4 * c));
                            *p_hi = _mm256_add_epi16(*p_hi, a);
                        }
                    }
                    for i in 0..N {
                        isum[i] = if F == Q4_1 {
                            // Eight nibble sums: 8 · 2 · 15 · 127 = 30480 fits an i16.
                            _mm256_madd_epi16(_mm256_add_epi16(p[i][0], p[i][1]), ones)
                        } else {
                            let s = _mm256_set1_epi32(16 * *xs[i].s.get_unchecked(b));
                            _mm256_sub_epi32(
                                _mm256_add_epi32(
                                    _mm256_madd_epi16(p[i][0], ones),
                                    _mm256_madd_epi16(p[i][1], ones),
                                ),
                                s,
                            )
                        };
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(gb.cast()));
                for i in 0..N {
                    let dx = _mm256_set1_ps(*xs[i].d.get_unchecked(b));
                    let f = _mm256_mul_ps(d, dx);
                    acc[i] = _mm256_fmadd_ps(f, _mm256_cvtepi32_ps(isum[i]), acc[i]);
                }
                if F == Q4_1 {
                    let m = _mm256_cvtph_ps(_mm_loadu_si128(gb.add(super::Q41_MIN).cast()));
                    for i in 0..N {
                        let ds = _mm256_set1_ps(*xs[i].ds.get_unchecked(b));
                        acc[i] = _mm256_fmadd_ps(m, ds, acc[i]);
                    }
                }
            }
        }
        for i in 0..N {
            // SAFETY: as above.
            unsafe { _mm256_storeu_ps(accs[i].as_mut_ptr(), acc[i]) };
        }
    }
}

/// The 512-bit kernels: two groups of eight rows side by side in one register (as in
/// [`super::kquant`]'s), with VNNI's dot products, for two or more activation rows. Their
/// per-lane integers and float steps are those of the AVX2 kernels, so they equal the
/// reference bit for bit as well.
#[cfg(target_arch = "x86_64")]
mod zmm {
    use super::{group_bytes, Quant32, QB};
    use crate::kernels::x86::wide::{bcast4, f16x16, ld2};
    use crate::kernels::x86::{fetch_l2, BATCH_AHEAD};
    use crate::kernels::Format;
    use std::arch::x86_64::*;

    /// How far ahead of the block in hand each group's weights are fetched into L2: about as
    /// far as the K formats' [`BATCH_AHEAD`] blocks (9.5-13 KiB), these blocks being 136-272
    /// bytes.
    const AHEAD: usize = BATCH_AHEAD * 1024;

    /// Two groups of eight interleaved rows of format `F` (`gw`: the first group's blocks,
    /// then the second's) against `xs[i]`, added to the row lanes `accs[i]` (the first
    /// group's rows, then the second's).
    ///
    /// # Safety
    /// AVX-512 F, BW, VL and VNNI, FMA and F16C; `gw` holds two groups of `xs[i].d.len()`
    /// blocks; `N == xs.len() <= accs.len()`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn pair<const F: u8, const N: usize>(
        gw: &[u8],
        xs: &[Quant32],
        accs: &mut [[f32; 16]],
    ) {
        use super::avx2::{Q4_1, Q5_0, Q8_0};
        let fmt = [Format::Q8_0, Format::Q4_1, Format::Q5_0][F as usize];
        let gbytes = group_bytes(fmt);
        let nb = xs[0].d.len();
        let second = nb * gbytes;
        let (m4, m10, flip) = (
            _mm512_set1_epi8(0x0F),
            _mm512_set1_epi8(0x10),
            _mm512_set1_epi8(-128),
        );
        let qs: [*const u8; N] = std::array::from_fn(|i| xs[i].q.as_ptr().cast());
        // SAFETY: `accs` has N entries of 16 floats.
        let mut acc: [__m512; N] =
            std::array::from_fn(|i| unsafe { _mm512_loadu_ps(accs[i].as_ptr()) });
        for b in 0..nb {
            // SAFETY: block `b` of each group is `gbytes` bytes inside `gw`; every activation
            // row holds `nb` blocks (checked by the caller).
            unsafe {
                let pa = gw.as_ptr().add(b * gbytes);
                let pb = pa.add(second);
                fetch_l2(pa.wrapping_add(AHEAD), gbytes);
                fetch_l2(pb.wrapping_add(AHEAD), gbytes);
                let act = |i: usize, e: usize| bcast4(qs[i].add(b * QB + e));
                // `dpbusd` multiplies unsigned weights by signed activations: Q8_0's signed
                // values go in with their sign bit flipped (v + 128), and the 128·S that adds
                // comes off first; Q5_0's 16·S likewise.
                let mut isum: [__m512i; N] = std::array::from_fn(|i| {
                    let s = *xs[i].s.get_unchecked(b);
                    match F {
                        Q8_0 => _mm512_set1_epi32(-128 * s),
                        Q5_0 => _mm512_set1_epi32(-16 * s),
                        _ => _mm512_setzero_si512(),
                    }
                });
                if F == Q8_0 {
                    for k in 0..8 {
                        let at = super::Q8_VALS + 32 * k;
                        let v = _mm512_xor_si512(ld2(pa.add(at), pb.add(at)), flip);
                        for (i, s) in isum.iter_mut().enumerate() {
                            *s = _mm512_dpbusd_epi32(*s, v, act(i, 4 * k));
                        }
                    }
                } else {
                    let nib = if F == Q4_1 {
                        super::Q41_NIB
                    } else {
                        super::Q50_NIB
                    };
                    // Fifth bits as in the AVX2 kernel: column c's are bit 4 of each byte after
                    // a right shift by c.
                    let (mut h_lo, mut h_hi) = if F == Q5_0 {
                        let h = ld2(pa.add(super::Q50_HIGH), pb.add(super::Q50_HIGH));
                        (_mm512_slli_epi16(h, 4), h)
                    } else {
                        (_mm512_setzero_si512(), _mm512_setzero_si512())
                    };
                    for c in 0..4 {
                        let v = ld2(pa.add(nib + 32 * c), pb.add(nib + 32 * c));
                        let mut lo = _mm512_and_si512(v, m4);
                        let mut hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                        if F == Q5_0 {
                            lo = _mm512_or_si512(lo, _mm512_and_si512(h_lo, m10));
                            hi = _mm512_or_si512(hi, _mm512_and_si512(h_hi, m10));
                            h_lo = _mm512_srli_epi16(h_lo, 1);
                            h_hi = _mm512_srli_epi16(h_hi, 1);
                        }
                        for (i, s) in isum.iter_mut().enumerate() {
                            *s = _mm512_dpbusd_epi32(*s, lo, act(i, 4 * c));
                            *s = _mm512_dpbusd_epi32(*s, hi, act(i, 16 + 4 * c));
                        }
                    }
                }
                let d = f16x16(pa, pb);
                for i in 0..N {
                    let dx = _mm512_set1_ps(*xs[i].d.get_unchecked(b));
                    let f = _mm512_mul_ps(d, dx);
                    acc[i] = _mm512_fmadd_ps(f, _mm512_cvtepi32_ps(isum[i]), acc[i]);
                }
                if F == Q4_1 {
                    let m = f16x16(pa.add(super::Q41_MIN), pb.add(super::Q41_MIN));
                    for i in 0..N {
                        let ds = _mm512_set1_ps(*xs[i].ds.get_unchecked(b));
                        acc[i] = _mm512_fmadd_ps(m, ds, acc[i]);
                    }
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

    const FORMATS: [Format; 3] = [Format::Q8_0, Format::Q4_1, Format::Q5_0];

    /// Random GGUF rows (every value bit pattern, Q8_0's -128 included; finite f16 scales),
    /// repacked.
    fn random_weight(fmt: Format, rows: usize, cols: usize, s: &mut u64) -> (Vec<u8>, Vec<u8>) {
        let bb = fmt.block_bytes();
        let mut w: Vec<u8> = (0..rows * cols / QB * bb).map(|_| lcg(s) as u8).collect();
        for blk in w.chunks_exact_mut(bb) {
            let mut put = |at: usize, v: f32| {
                blk[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes())
            };
            put(0, (lcg(s) % 1000) as f32 / 1e4);
            if fmt == Format::Q4_1 {
                put(2, -((lcg(s) % 1000) as f32) / 1e3);
            }
        }
        let packed = repack(fmt, &w, rows, cols);
        (w, packed)
    }

    /// GGUF's own reading of a block (independent of the interleaved layout).
    fn gguf_dequant(fmt: Format, w: &[u8], row: usize, cols: usize) -> Vec<f32> {
        let bb = fmt.block_bytes();
        let row = &w[row * cols / QB * bb..(row + 1) * cols / QB * bb];
        let mut out = Vec::with_capacity(cols);
        for blk in row.chunks_exact(bb) {
            let d = f16_at(blk, 0);
            match fmt {
                Format::Q8_0 => out.extend(blk[2..34].iter().map(|&v| d * v as i8 as f32)),
                Format::Q4_1 => {
                    let m = f16_at(blk, 2);
                    out.extend(blk[4..20].iter().map(|&v| d * (v & 15) as f32 + m));
                    out.extend(blk[4..20].iter().map(|&v| d * (v >> 4) as f32 + m));
                }
                _ => {
                    let qh = u32::from_le_bytes(blk[2..6].try_into().unwrap());
                    for e in 0..32 {
                        let nib = if e < 16 {
                            blk[6 + e] & 15
                        } else {
                            blk[6 + e - 16] >> 4
                        };
                        let u = nib as i32 | (((qh >> e) & 1) as i32) << 4;
                        out.push(d * (u - 16) as f32);
                    }
                }
            }
        }
        out
    }

    fn acts(n: usize, cols: usize, s: &mut u64) -> Vec<Quant32> {
        (0..n)
            .map(|k| {
                let x: Vec<f32> = (0..cols)
                    .map(|_| (lcg(s) as f32 / u32::MAX as f32 - 0.5) * (k + 1) as f32)
                    .collect();
                Quant32::quantize(&x)
            })
            .collect()
    }

    #[test]
    fn repacked_rows_read_back_as_in_gguf() {
        let mut s = 3;
        for fmt in FORMATS {
            let (rows, cols) = (16, 96);
            let (gguf, packed) = random_weight(fmt, rows, cols, &mut s);
            for row in 0..rows {
                let mut out = vec![0f32; cols];
                dequantize(fmt, &packed, row, cols, &mut out);
                assert_eq!(
                    out,
                    gguf_dequant(fmt, &gguf, row, cols),
                    "{fmt:?} row {row}"
                );
            }
        }
    }

    #[test]
    fn simd_equals_scalar_for_every_row_count() {
        if Isa::detect() == Isa::Scalar {
            return;
        }
        let mut s = 17;
        for fmt in FORMATS {
            for cols in [32, 896] {
                let rows = 24;
                let (_, data) = random_weight(fmt, rows, cols, &mut s);
                for n in [1, 2, 3, 4, 5, 8, 9, 13] {
                    let xs = acts(n, cols, &mut s);
                    let run = |isa, first: usize, xs: &[Quant32]| {
                        let mut out = vec![0f32; (rows - first) * xs.len()];
                        let mut outs: Vec<&mut [f32]> =
                            out.chunks_exact_mut(rows - first).collect();
                        matmul(fmt, &data, first, cols, xs, &mut outs, isa);
                        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    };
                    let reference = run(Isa::Scalar, 0, &xs);
                    for &isa in &Isa::available()[1..] {
                        let simd = run(isa, 0, &xs);
                        assert_eq!(simd, reference, "{isa:?} {fmt:?} cols={cols} n={n}");
                        for i in 0..n {
                            let one = run(isa, 0, &xs[i..i + 1]);
                            assert_eq!(
                                one,
                                simd[i * rows..(i + 1) * rows],
                                "{isa:?} {fmt:?} n={n} row {i}"
                            );
                        }
                        // A later group alone gives the same bits as in the whole matrix.
                        let tail = run(isa, 16, &xs);
                        for i in 0..n {
                            assert_eq!(
                                tail[i * 8..(i + 1) * 8],
                                simd[i * rows + 16..(i + 1) * rows],
                                "{isa:?} {fmt:?} n={n} rows 16..24"
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
        for fmt in FORMATS {
            let (_, w) = random_weight(fmt, 8, cols, &mut s);
            let mut deq = vec![0f32; cols];
            dequantize(fmt, &w, 5, cols, &mut deq);
            let qx = &acts(1, cols, &mut s)[0];
            let got = dot_scalar(fmt, &w, 5, qx) as f64;
            // With the activation values it was given, exact up to float rounding.
            let on_q: f64 = deq
                .iter()
                .enumerate()
                .map(|(e, &a)| a as f64 * qx.q[e] as f64 * qx.d[e / QB] as f64)
                .sum();
            let norm: f64 = deq
                .iter()
                .enumerate()
                .map(|(e, &a)| (a as f64 * qx.q[e] as f64 * qx.d[e / QB] as f64).abs())
                .sum();
            assert!(
                (on_q - got).abs() < 1e-5 * norm.max(1.0),
                "{fmt:?}: {on_q} vs {got}"
            );
        }
    }
}
