//! Unpacking each block format into integers plus per-group scale and offset
//! (`weight = ws * u + wm`), read straight from the GGUF bytes (little-endian). Q4_K rows are
//! held interleaved in groups of eight instead (see [`super::kquant`]).

use half::f16;

use super::{Isa, UnpackedRow, GROUP};

/// The block formats with our own kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// 32 elements: f16 scale, 32 × i8.
    Q8_0,
    /// 32 elements: f16 scale and min, 32 × 4 bits.
    Q4_1,
    /// 32 elements: f16 scale, 32 × 5 bits (value − 16).
    Q5_0,
    /// 256 elements: f16 scale and min, eight 6-bit sub-scales and mins, 256 × 4 bits.
    /// Held repacked on load, eight rows interleaved, 148 bytes a row's block
    /// ([`super::kquant::repack_q4k`]).
    Q4K,
    /// 256 elements: 256 × 6 bits (value − 32), sixteen i8 sub-scales, f16 scale.
    Q6K,
}

fn h(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

impl Format {
    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            Format::Q8_0 | Format::Q4_1 | Format::Q5_0 => 32,
            Format::Q4K | Format::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Format::Q8_0 => 34,
            Format::Q4_1 => 20,
            Format::Q5_0 => 22,
            Format::Q4K => 148,
            Format::Q6K => 210,
        }
    }

    /// Bytes per block in a GGUF file.
    pub fn gguf_block_bytes(self) -> usize {
        match self {
            Format::Q4K => 144,
            other => other.block_bytes(),
        }
    }

    /// Bytes of a row of `cols` elements.
    pub fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_elems() * self.block_bytes()
    }

    /// Unpacks one row (`cols` elements, the row's bytes) into `w` (any format but Q4_K).
    /// Byte-exact work, so every instruction set gives the same result; AVX2 only makes it
    /// faster.
    pub fn unpack_row(self, bytes: &[u8], cols: usize, w: &mut UnpackedRow, isa: Isa) {
        w.u.resize(cols, 0);
        w.ws.resize(cols / GROUP, 0.0);
        w.wm.resize(cols / GROUP, 0.0);
        w.signed = self == Format::Q8_0;
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Avx2` is chosen only on CPUs with AVX2.
            Isa::Avx2 => unsafe { unpack_avx2(self, bytes, w) },
            _ => unpack(self, bytes, w, h),
        }
    }

    /// Whether this is a 256-element super-block format (kernels in [`super::kquant`]).
    pub fn is_k(self) -> bool {
        matches!(self, Format::Q4K | Format::Q6K)
    }

    /// Dequantizes row `row` of the weight `data` (rows of `cols` elements, as held in
    /// memory) into `out[..cols]`.
    pub fn dequantize_row(self, data: &[u8], row: usize, cols: usize, out: &mut [f32]) {
        if self == Format::Q4K {
            return super::kquant::dequantize_q4k(data, row, cols, out);
        }
        let rb = self.row_bytes(cols);
        let mut w = UnpackedRow::default();
        self.unpack_row(&data[row * rb..(row + 1) * rb], cols, &mut w, Isa::Scalar);
        for (i, o) in out[..cols].iter_mut().enumerate() {
            let g = i / GROUP;
            let v = if w.signed {
                w.u[i] as i8 as f32
            } else {
                w.u[i] as f32
            };
            *o = w.ws[g] * v + w.wm[g];
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn unpack_avx2(fmt: Format, bytes: &[u8], w: &mut UnpackedRow) {
    use std::arch::x86_64::{_mm_cvtph_ps, _mm_cvtsi32_si128, _mm_cvtss_f32};
    // f16 -> f32 is exact in every implementation; the F16C instruction is just faster.
    let cvt = |b: &[u8], at: usize| {
        let bits = u16::from_le_bytes([b[at], b[at + 1]]) as i32;
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)))
    };
    unpack(fmt, bytes, w, cvt)
}

const LOW4: u64 = 0x0F0F_0F0F_0F0F_0F0F;
const LOW2: u64 = 0x0303_0303_0303_0303;

/// Eight bytes at `at`, as a little-endian word.
#[inline(always)]
fn word(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

#[inline(always)]
fn put(u: &mut [u8], at: usize, v: u64) {
    u[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Bit `k` of a byte spread to bit 4 of byte `k` of a word (Q5_0's fifth bits).
const SPREAD: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut b = 0;
    while b < 256 {
        let mut k = 0;
        while k < 8 {
            t[b] |= (((b >> k) & 1) as u64) << (8 * k + 4);
            k += 1;
        }
        b += 1;
    }
    t
};

/// The unpacking loops, on 64-bit words (eight elements at a time; byte-exact).
#[inline(always)]
fn unpack(fmt: Format, bytes: &[u8], w: &mut UnpackedRow, h: impl Fn(&[u8], usize) -> f32) {
    let (be, bb) = (fmt.block_elems(), fmt.block_bytes());
    let groups = be / GROUP;
    let blocks = bytes.chunks_exact(bb).zip(w.u.chunks_exact_mut(be)).zip(
        w.ws.chunks_exact_mut(groups)
            .zip(w.wm.chunks_exact_mut(groups)),
    );
    match fmt {
        Format::Q8_0 => {
            for ((b, u), (ws, wm)) in blocks {
                // Fixed-size arrays, so the copy is two register moves, not a `memmove` call.
                let q: [u8; 32] = b[2..34].try_into().expect("32 bytes");
                *<&mut [u8; 32]>::try_from(u).expect("32 elements") = q;
                ws.fill(h(b, 0));
                wm.fill(0.0);
            }
        }
        Format::Q4_1 => {
            for ((b, u), (ws, wm)) in blocks {
                for k in 0..2 {
                    let q = word(b, 4 + 8 * k);
                    put(u, 8 * k, q & LOW4);
                    put(u, 16 + 8 * k, (q >> 4) & LOW4);
                }
                ws.fill(h(b, 0));
                wm.fill(h(b, 2));
            }
        }
        Format::Q5_0 => {
            for ((b, u), (ws, wm)) in blocks {
                let d = h(b, 0);
                let qh = [b[2], b[3], b[4], b[5]];
                for k in 0..2 {
                    let q = word(b, 6 + 8 * k);
                    put(u, 8 * k, (q & LOW4) | SPREAD[qh[k] as usize]);
                    put(
                        u,
                        16 + 8 * k,
                        ((q >> 4) & LOW4) | SPREAD[qh[2 + k] as usize],
                    );
                }
                ws.fill(d);
                wm.fill(-16.0 * d);
            }
        }
        Format::Q4K => unreachable!("Q4_K rows are held interleaved: kquant::dequantize_q4k"),
        Format::Q6K => {
            for ((b, u), (ws, wm)) in blocks {
                let d = h(b, 208);
                for half in 0..2 {
                    for k in 0..4 {
                        let l = 8 * k;
                        let ql0 = word(b, half * 64 + l);
                        let ql1 = word(b, half * 64 + 32 + l);
                        let qh = word(b, 128 + half * 32 + l);
                        let o = half * 128 + l;
                        put(u, o, (ql0 & LOW4) | ((qh & LOW2) << 4));
                        put(u, o + 32, (ql1 & LOW4) | (((qh >> 2) & LOW2) << 4));
                        put(u, o + 64, ((ql0 >> 4) & LOW4) | (((qh >> 4) & LOW2) << 4));
                        put(u, o + 96, ((ql1 >> 4) & LOW4) | (((qh >> 6) & LOW2) << 4));
                    }
                }
                for k in 0..16 {
                    let s = d * (b[192 + k] as i8) as f32;
                    ws[k] = s;
                    wm[k] = -32.0 * s;
                }
            }
        }
    }
}
