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
