//! Our own quantized matmul kernels, exact by construction.
//!
//! Every format is handled the same way:
//! 1. each activation row is quantized once per block to `i8` values with an f32 scale (per 32
//!    elements for Q8_0, Q4_1 and Q5_0: [`Quant32`]; per 256 for Q4_K and Q6_K: [`QuantK`]),
//!    keeping the integer sums the formats' offsets need;
//! 2. the integer pass multiplies the weight's small integers by those values and sums them
//!    exactly (with the sub-block scales of the K formats applied in integers too);
//! 3. one float step per block, in a fixed order, applies the scales.
//!
//! A scalar reference defines each result; the AVX2 paths compute the same integers and the
//! same float operations in the same order, so they equal it bit for bit (tests check this on
//! random blocks). Weights are repacked on load so that eight rows are interleaved, which makes
//! each SIMD lane one weight row.
//!
//! A token's result never depends on which other rows share the pass: each loaded and unpacked
//! weight block is reused for several activation rows (that is what makes small batches
//! cheap), but each row's arithmetic is the same as when it is alone.

pub mod formats;
pub mod kquant;
pub mod q32;

/// Loads, broadcasts and fetches the AVX2 kernels of every format share. Each is inlined into
/// a caller compiled with AVX2 (never called from anywhere else).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Loads 32 bytes.
    ///
    /// # Safety
    /// `p` points at 32 readable bytes; the caller runs with AVX.
    #[inline(always)]
    pub unsafe fn ld(p: *const u8) -> __m256i {
        // SAFETY: per the contract.
        unsafe { _mm256_loadu_si256(p.cast()) }
    }

    /// The 4 bytes at `p` (four activation values) in every 32-bit lane.
    ///
    /// # Safety
    /// `p` points at 4 readable bytes; the caller runs with AVX.
    #[inline(always)]
    pub unsafe fn bcast4(p: *const u8) -> __m256i {
        // SAFETY: per the contract.
        unsafe { _mm256_set1_epi32(std::ptr::read_unaligned(p as *const i32)) }
    }

    /// Fetches the `len` bytes from `p` into the cache (a group's blocks are one sequential
    /// stream; callers fetch ahead of the block in hand).
    #[inline(always)]
    pub fn fetch(p: *const u8, len: usize) {
        for line in (0..len).step_by(64) {
            // SAFETY: a prefetch is a hint; it never faults or reads into the program.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(line).cast()) };
        }
    }

    /// The 512-bit kernels' loads: two groups of eight rows side by side in one register.
    pub mod wide {
        use std::arch::x86_64::*;

        /// The 32 bytes at `a` (the first group's) then the 32 at `b`.
        ///
        /// # Safety
        /// 32 readable bytes at each; the caller runs with AVX-512 F.
        #[inline(always)]
        pub unsafe fn ld2(a: *const u8, b: *const u8) -> __m512i {
            // SAFETY: per the contract.
            unsafe {
                _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256(a.cast())),
                    _mm256_loadu_si256(b.cast()),
                    1,
                )
            }
        }

        /// The 16 bytes at `a` then the 16 at `b`.
        ///
        /// # Safety
        /// 16 readable bytes at each; the caller runs with AVX2.
        #[inline(always)]
        pub unsafe fn ld2_16(a: *const u8, b: *const u8) -> __m256i {
            // SAFETY: per the contract.
            unsafe {
                _mm256_inserti128_si256(
                    _mm256_castsi128_si256(_mm_loadu_si128(a.cast())),
                    _mm_loadu_si128(b.cast()),
                    1,
                )
            }
        }

        /// The 8 bytes at `a` then the 8 at `b`.
        ///
        /// # Safety
        /// 8 readable bytes at each; the caller runs with SSE2.
        #[inline(always)]
        pub unsafe fn ld2_8(a: *const u8, b: *const u8) -> __m128i {
            // SAFETY: per the contract.
            unsafe { _mm_unpacklo_epi64(_mm_loadl_epi64(a.cast()), _mm_loadl_epi64(b.cast())) }
        }

        /// The eight f16 values at `a` (the first group's) then the eight at `b`, as 16 floats.
        ///
        /// # Safety
        /// 16 readable bytes at each; the caller runs with AVX-512 F.
        #[inline(always)]
        pub unsafe fn f16x16(a: *const u8, b: *const u8) -> __m512 {
            // SAFETY: per the contract.
            unsafe { _mm512_cvtph_ps(ld2_16(a, b)) }
        }

        /// The 4 bytes at `p` (four activation values) in every 32-bit lane.
        ///
        /// # Safety
        /// 4 readable bytes at `p`; the caller runs with AVX-512 F.
        #[inline(always)]
        pub unsafe fn bcast4(p: *const u8) -> __m512i {
            // SAFETY: per the contract.
            unsafe { _mm512_set1_epi32(std::ptr::read_unaligned(p as *const i32)) }
        }
    }

    /// Blocks ahead of the one in hand that kernels over several activation rows fetch into
    /// L2, in each stream of weights they read. A block takes them long enough that memory can
    /// run far ahead; fetching two blocks ahead into L1, as one row does, left a 5-row step of
    /// the 1.5B at 117-119 ms, eight ahead into L2 at 105-112 (one core, decode 81-85 ms).
    pub const BATCH_AHEAD: usize = 8;

    /// Fetches the `len` bytes from `p` into L2 (see [`BATCH_AHEAD`]).
    #[inline(always)]
    pub fn fetch_l2(p: *const u8, len: usize) {
        for line in (0..len).step_by(64) {
            // SAFETY: a prefetch is a hint; it never faults or reads into the program.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(line).cast()) };
        }
    }
}

/// How the SIMD matmuls walk a weight's groups of eight interleaved rows: the 256-bit
/// kernels take one group against up to `rows` activation rows at a time (`group(g, xs, accs)`
/// adds group `g` against `xs[i]` to `accs[i]`); with `wide_rows`, two or more activation rows
/// take the 512-bit kernels, two groups against up to that many rows at a time
/// (`pair(g, xs, accs)`: groups `g` and `g + 1`, the first's rows in lanes 0-7), and a lone
/// activation row left over takes `group` over each of the two, which gives the same bits.
/// `outs[i][8g..8g + 8]` receives group `g` against activation row `i`.
#[cfg(target_arch = "x86_64")]
pub(crate) fn walk_groups<X>(
    groups: usize,
    xs: &[X],
    outs: &mut [&mut [f32]],
    rows: usize,
    wide_rows: Option<usize>,
    group: impl Fn(usize, &[X], &mut [[f32; 8]]),
    pair: impl Fn(usize, &[X], &mut [[f32; 16]]),
) {
    let n = xs.len();
    let mut accs = vec![[0f32; 8]; n];
    let mut wide = vec![[0f32; 16]; n];
    let mut g = 0;
    while g < groups {
        match wide_rows {
            Some(per) if g + 1 < groups && n > 1 => {
                wide.iter_mut().for_each(|a| *a = [0.0; 16]);
                for (c, xc) in xs.chunks(per).enumerate() {
                    let a = &mut wide[c * per..];
                    if xc.len() > 1 {
                        pair(g, xc, a);
                        continue;
                    }
                    for h in 0..2 {
                        let mut one = [[0f32; 8]];
                        group(g + h, xc, &mut one);
                        a[0][8 * h..8 * h + 8].copy_from_slice(&one[0]);
                    }
                }
                for (a, o) in wide.iter().zip(outs.iter_mut()) {
                    o[8 * g..8 * g + 16].copy_from_slice(a);
                }
                g += 2;
            }
            _ => {
                accs.iter_mut().for_each(|a| *a = [0.0; 8]);
                for (c, xc) in xs.chunks(rows).enumerate() {
                    group(g, xc, &mut accs[c * rows..]);
                }
                for (a, o) in accs.iter().zip(outs.iter_mut()) {
                    o[8 * g..8 * g + 8].copy_from_slice(a);
                }
                g += 1;
            }
        }
    }
}

pub use formats::Format;
pub use kquant::QuantK;
pub use q32::Quant32;

/// Which instruction set the kernels use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Portable Rust: the reference.
    Scalar,
    /// x86-64 AVX2 with FMA and F16C.
    Avx2,
    /// AVX2 plus AVX-512 (F, BW, VL) with VNNI: one instruction for what takes AVX2 two
    /// (`maddubs` and an add) in the K formats' dot products, 32 vector registers, and for
    /// several activation rows 512-bit registers holding two groups of rows at once.
    Avx512Vnni,
}

impl Isa {
    /// The best this CPU supports, or the one `PIPESHARD_ISA` (`scalar`, `avx2`,
    /// `avx512vnni`) asks for if the CPU has it: for measuring one against another.
    pub fn detect() -> Self {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            let all = Self::available();
            let asked = std::env::var("PIPESHARD_ISA").ok().and_then(|v| {
                all.iter()
                    .copied()
                    .find(|i| format!("{i:?}").eq_ignore_ascii_case(v.trim()))
            });
            asked.unwrap_or(*all.last().expect("scalar is always there"))
        })
    }

    /// Every instruction set this CPU runs, worst first.
    pub fn available() -> &'static [Self] {
        static ALL: std::sync::OnceLock<Vec<Isa>> = std::sync::OnceLock::new();
        ALL.get_or_init(|| {
            let mut all = vec![Isa::Scalar];
            #[cfg(target_arch = "x86_64")]
            {
                use std::arch::is_x86_feature_detected as has;
                if has!("avx2") && has!("fma") && has!("f16c") {
                    all.push(Isa::Avx2);
                    if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni")
                    {
                        all.push(Isa::Avx512Vnni);
                    }
                }
            }
            all
        })
    }

    /// Whether this CPU runs `self`.
    pub fn supported(self) -> bool {
        Self::available().contains(&self)
    }

    /// Whether the AVX2 kernels run (the VNNI ones are AVX2 kernels with more instructions).
    pub fn has_avx2(self) -> bool {
        self >= Isa::Avx2
    }
}

/// Quantizes one block of activations `x` to `q` (same length, a multiple of 8) and returns
/// its scale `d`: `q = clamp(round(x · 127/amax), ±127)` with `d = amax / 127`, where `round`
/// takes ties to even (by adding and subtracting 1.5 · 2²³, exact for the |values| ≤ 127 here,
/// so the portable and AVX2 versions give the same bits).
pub fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    assert!(x.len() == q.len() && x.len().is_multiple_of(8));
    match Isa::detect() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx2` is chosen only on CPUs with AVX2; lengths checked above.
        Isa::Avx2 | Isa::Avx512Vnni => unsafe { quantize_block_avx2(x, q) },
        _ => quantize_block_scalar(x, q),
    }
}

/// The little-endian f16 at `b[at..at + 2]`, as f32 (exact).
fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Added and subtracted to round to an integer, ties to even.
const ROUNDER: f32 = 12_582_912.0;

fn quantize_block_scalar(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        q.fill(0);
        return 0.0;
    }
    let id = 127.0 / amax;
    for (qi, xi) in q.iter_mut().zip(x) {
        *qi = ((xi * id + ROUNDER) - ROUNDER).clamp(-127.0, 127.0) as i8;
    }
    amax / 127.0
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_block_avx2(x: &[f32], q: &mut [i8]) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY (of every load and store below): `x` and `q` have the same length, a multiple
    // of 8, and each access covers 8 elements at `8 * k` for k below length / 8.
    let n = x.len();
    let xp = x.as_ptr();
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX));
    let mut m = _mm256_setzero_ps();
    for k in (0..n).step_by(8) {
        m = _mm256_max_ps(m, _mm256_and_ps(abs, unsafe { _mm256_loadu_ps(xp.add(k)) }));
    }
    let mut lanes = [0f32; 8];
    // SAFETY: 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m) };
    // The maximum is the same whatever the order.
    let amax = lanes.iter().fold(0f32, |a, &v| a.max(v));
    if amax == 0.0 {
        q.fill(0);
        return 0.0;
    }
    let id = _mm256_set1_ps(127.0 / amax);
    let (r, lo, hi) = (
        _mm256_set1_ps(ROUNDER),
        _mm256_set1_ps(-127.0),
        _mm256_set1_ps(127.0),
    );
    for k in (0..n).step_by(8) {
        let v = _mm256_mul_ps(unsafe { _mm256_loadu_ps(xp.add(k)) }, id);
        let v = _mm256_sub_ps(_mm256_add_ps(v, r), r);
        let i = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
        let w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
        unsafe { _mm_storel_epi64(q.as_mut_ptr().add(k).cast(), _mm_packs_epi16(w, w)) };
    }
    amax / 127.0
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A small deterministic generator for the kernels' random test data.
    pub(crate) fn lcg(s: &mut u64) -> u32 {
        *s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*s >> 33) as u32
    }

    #[test]
    fn block_quantization_is_the_same_on_every_isa() {
        let mut s = 11u64;
        let mut next = || (lcg(&mut s) as f32 / (1u64 << 31) as f32) - 0.5;
        for len in [8, 32, 256] {
            for scale in [0.0, 1e-6, 1.0, 127.0, 3e4] {
                let mut x: Vec<f32> = (0..len).map(|_| next() * scale).collect();
                // The block's extreme value, and (at 127, where the factor is exactly 1) ties.
                x[0] = scale;
                let ties = scale == 127.0;
                if ties {
                    x[1..4].copy_from_slice(&[0.5, -2.5, 1.5]);
                }
                let (mut a, mut b) = (vec![0i8; len], vec![0i8; len]);
                let da = quantize_block_scalar(&x, &mut a);
                let db = quantize_block(&x, &mut b);
                assert_eq!(
                    (da.to_bits(), &a),
                    (db.to_bits(), &b),
                    "len {len} scale {scale}"
                );
                if scale > 0.0 {
                    assert_eq!(a[0], 127);
                }
                if ties {
                    assert_eq!(a[1..4], [0, -2, 2], "ties go to even");
                }
                for (qi, xi) in a.iter().zip(&x) {
                    assert!((*qi as f32 * da - xi).abs() <= 0.5 * da * 1.0001 + 1e-30);
                }
            }
        }
    }
}
