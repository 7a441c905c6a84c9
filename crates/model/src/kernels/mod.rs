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
//! random blocks). Weights are repacked on load so that eight rows are interleaved (all but
//! Q6_K), which makes each SIMD lane one weight row.
//!
//! A token's result never depends on which other rows share the pass: each loaded and unpacked
//! weight block is reused for several activation rows (that is what makes small batches
//! cheap), but each row's arithmetic is the same as when it is alone.

pub mod formats;
pub mod kquant;
pub mod q32;

pub use formats::Format;
pub use kquant::QuantK;
pub use q32::Quant32;

/// Which instruction set the kernels use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust: the reference.
    Scalar,
    /// x86-64 AVX2 with FMA and F16C.
    Avx2,
}

impl Isa {
    /// The best this CPU supports.
    pub fn detect() -> Self {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                return Isa::Avx2;
            }
            Isa::Scalar
        })
    }
}
