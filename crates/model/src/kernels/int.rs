//! The integer pass: per 16-element group, `sum(u * x)` of weight integers and `i8`
//! activations. A scalar reference and an AVX2 path, chosen at run time; both compute exact
//! integers, and a test checks they agree on random data.

use super::GROUP;

/// Which instruction set the integer pass uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust.
    Scalar,
    /// x86-64 AVX2 (with F16C).
    Avx2,
}

impl Isa {
    /// The best this CPU supports.
    pub fn detect() -> Self {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                return Isa::Avx2;
            }
            Isa::Scalar
        })
    }
}

/// `g[k] = sum over group k of u * x`; `u` is unsigned (`signed == false`, values < 64) or
/// `i8` bits.
pub fn group_dots(isa: Isa, u: &[u8], x: &[i8], signed: bool, g: &mut [i32]) {
    debug_assert_eq!(u.len(), x.len());
    debug_assert_eq!(g.len() * GROUP, u.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx2` is only chosen when the CPU supports AVX2 (see `Isa::detect`; tests
        // construct it only after the same check).
        Isa::Avx2 => unsafe { avx2::group_dots(u, x, signed, g) },
        _ => scalar(u, x, signed, g),
    }
}

/// The reference.
pub fn scalar(u: &[u8], x: &[i8], signed: bool, g: &mut [i32]) {
    for ((gk, uc), xc) in g
        .iter_mut()
        .zip(u.chunks_exact(GROUP))
        .zip(x.chunks_exact(GROUP))
    {
        *gk = if signed {
            uc.iter()
                .zip(xc)
                .map(|(&a, &b)| a as i8 as i32 * b as i32)
                .sum()
        } else {
            uc.iter().zip(xc).map(|(&a, &b)| a as i32 * b as i32).sum()
        };
    }
}

/// The integer pass straight from packed blocks (Q4_K, Q6_K), without unpacking: the same
/// integers as unpacking then [`group_dots`]. AVX2 only; callers check [`Isa::Avx2`].
#[cfg(target_arch = "x86_64")]
pub fn fused_group_dots(fmt: super::Format, bytes: &[u8], x: &[i8], g: &mut [i32]) {
    assert_eq!(Isa::detect(), Isa::Avx2, "fused kernels need AVX2");
    // SAFETY: AVX2 checked above; `bytes` holds whole blocks for `x.len()` elements.
    unsafe { avx2::fused(fmt, bytes, x, g) }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Sums each 128-bit half of eight `i32` lanes of four registers: returns the eight group
    /// sums `[a.lo, a.hi, b.lo, b.hi, c.lo, c.hi, d.lo, d.hi]`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn reduce4(a: __m256i, b: __m256i, c: __m256i, d: __m256i) -> __m256i {
        let ab = _mm256_hadd_epi32(a, b);
        let cd = _mm256_hadd_epi32(c, d);
        let abcd = _mm256_hadd_epi32(ab, cd);
        // Lanes are now [a.lo, b.lo, c.lo, d.lo | a.hi, b.hi, c.hi, d.hi].
        _mm256_permutevar8x32_epi32(abcd, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
    }

    /// 32 elements: `i32` lanes 0..4 hold partial sums of the first 16, 4..8 of the second.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn dot32(u: *const u8, x: *const i8, signed: bool) -> __m256i {
        // SAFETY (of the loads): callers pass pointers to 32 readable bytes.
        let (w, a) = unsafe {
            (
                _mm256_loadu_si256(u as *const __m256i),
                _mm256_loadu_si256(x as *const __m256i),
            )
        };
        let p = if signed {
            // |w| * (x with w's sign): an unsigned-by-signed product that cannot overflow i16
            // pairs (128 * 127 * 2 < 32768).
            _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w))
        } else {
            // u < 64: 63 * 127 * 2 < 32768.
            _mm256_maddubs_epi16(w, a)
        };
        _mm256_madd_epi16(p, _mm256_set1_epi16(1))
    }

    /// Fused Q4_K / Q6_K integer pass.
    ///
    /// # Safety
    /// AVX2; `bytes` holds `x.len() / 256` blocks; `g` has `x.len() / 16` entries.
    #[target_feature(enable = "avx2")]
    pub unsafe fn fused(fmt: crate::kernels::Format, bytes: &[u8], x: &[i8], g: &mut [i32]) {
        use crate::kernels::Format;
        let nb = x.len() / 256;
        assert!(g.len() >= nb * 16 && bytes.len() >= nb * fmt.block_bytes());
        let m4 = _mm256_set1_epi8(0x0F);
        let m2 = _mm256_set1_epi8(0x03);
        for blk in 0..nb {
            // SAFETY: the assert above bounds every block, activation and output access.
            unsafe {
                let b = bytes.as_ptr().add(blk * fmt.block_bytes());
                let xp = x.as_ptr().add(blk * 256);
                let gp = g.as_mut_ptr().add(blk * 16);
                let ld = |p: *const u8| _mm256_loadu_si256(p as *const __m256i);
                let dot = |u: __m256i, at: usize| {
                    let a = _mm256_loadu_si256(xp.add(at) as *const __m256i);
                    _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1))
                };
                match fmt {
                    Format::Q4K => {
                        for pair in 0..2 {
                            let mut r = [_mm256_setzero_si256(); 4];
                            for k in 0..2 {
                                let c = 2 * pair + k;
                                let v = ld(b.add(16 + 32 * c));
                                let lo = _mm256_and_si256(v, m4);
                                let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                                r[2 * k] = dot(lo, 64 * c);
                                r[2 * k + 1] = dot(hi, 64 * c + 32);
                            }
                            _mm256_storeu_si256(
                                gp.add(8 * pair) as *mut __m256i,
                                reduce4(r[0], r[1], r[2], r[3]),
                            );
                        }
                    }
                    Format::Q6K => {
                        for half in 0..2 {
                            let ql0 = ld(b.add(half * 64));
                            let ql1 = ld(b.add(half * 64 + 32));
                            let qh = ld(b.add(128 + half * 32));
                            let hb = |s: i32| {
                                let sh = match s {
                                    0 => qh,
                                    2 => _mm256_srli_epi16(qh, 2),
                                    4 => _mm256_srli_epi16(qh, 4),
                                    _ => _mm256_srli_epi16(qh, 6),
                                };
                                _mm256_slli_epi16(_mm256_and_si256(sh, m2), 4)
                            };
                            let u0 = _mm256_or_si256(_mm256_and_si256(ql0, m4), hb(0));
                            let u1 = _mm256_or_si256(_mm256_and_si256(ql1, m4), hb(2));
                            let u2 = _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                hb(4),
                            );
                            let u3 = _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                hb(6),
                            );
                            let o = half * 128;
                            let r = reduce4(
                                dot(u0, o),
                                dot(u1, o + 32),
                                dot(u2, o + 64),
                                dot(u3, o + 96),
                            );
                            _mm256_storeu_si256(gp.add(8 * half) as *mut __m256i, r);
                        }
                    }
                    _ => unreachable!("fused kernels exist for Q4_K and Q6_K only"),
                }
            }
        }
    }

    /// AVX2 version of [`super::scalar`].
    ///
    /// # Safety
    /// The CPU must support AVX2; slices as in `group_dots`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn group_dots(u: &[u8], x: &[i8], signed: bool, g: &mut [i32]) {
        let n = u.len();
        let (up, xp) = (u.as_ptr(), x.as_ptr());
        let mut k = 0;
        // 128 elements (8 groups) at a time.
        while k + 128 <= n {
            // SAFETY: k + 128 <= n, so each 32-byte load is in bounds, as is the 8-lane store
            // into g[k/16..k/16+8].
            unsafe {
                let a = dot32(up.add(k), xp.add(k), signed);
                let b = dot32(up.add(k + 32), xp.add(k + 32), signed);
                let c = dot32(up.add(k + 64), xp.add(k + 64), signed);
                let d = dot32(up.add(k + 96), xp.add(k + 96), signed);
                _mm256_storeu_si256(
                    g.as_mut_ptr().add(k / 16) as *mut __m256i,
                    reduce4(a, b, c, d),
                );
            }
            k += 128;
        }
        if k < n {
            super::scalar(&u[k..], &x[k..], signed, &mut g[k / 16..]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn avx2_equals_scalar() {
        if Isa::detect() != Isa::Avx2 {
            return;
        }
        let mut s = 12345u64;
        let mut next = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as u32
        };
        for n in [32usize, 128, 256, 896, 1536, 4864] {
            for signed in [false, true] {
                let u: Vec<u8> = (0..n)
                    .map(|_| {
                        if signed {
                            next() as u8
                        } else {
                            (next() % 64) as u8
                        }
                    })
                    .collect();
                let x: Vec<i8> = (0..n)
                    .map(|_| (next() % 255) as i32 as i8)
                    .map(|v| v.max(-127))
                    .collect();
                let (mut a, mut b) = (vec![0; n / 16], vec![0; n / 16]);
                scalar(&u, &x, signed, &mut a);
                group_dots(Isa::Avx2, &u, &x, signed, &mut b);
                assert_eq!(a, b, "n={n} signed={signed}");
            }
        }
    }
}
