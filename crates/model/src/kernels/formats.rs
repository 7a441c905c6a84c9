//! The block formats with our own kernels, and their sizes as held in memory.

/// The block formats with our own kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// 32 elements: f16 scale, 32 × i8. Held repacked on load, eight rows interleaved
    /// ([`super::q32::repack`]), as are Q4_1 and Q5_0.
    Q8_0,
    /// 32 elements: f16 scale and min, 32 × 4 bits.
    Q4_1,
    /// 32 elements: f16 scale, 32 × 5 bits (value − 16).
    Q5_0,
    /// 256 elements: f16 scale and min, eight 6-bit sub-scales and mins, 256 × 4 bits.
    /// Held repacked on load, eight rows interleaved, 148 bytes a row's block
    /// ([`super::kquant::repack_q4k`]).
    Q4K,
    /// 256 elements: 256 × 6 bits (value − 32), sixteen i8 sub-scales, f16 scale. Held
    /// repacked on load, eight rows interleaved, same size ([`super::kquant::repack_q6k`]).
    Q6K,
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

    /// Whether this is a 256-element super-block format (kernels in [`super::kquant`]).
    pub fn is_k(self) -> bool {
        matches!(self, Format::Q4K | Format::Q6K)
    }

    /// Dequantizes row `row` of the weight `data` (rows of `cols` elements, as held in
    /// memory) into `out[..cols]`.
    pub fn dequantize_row(self, data: &[u8], row: usize, cols: usize, out: &mut [f32]) {
        match self {
            Format::Q4K => super::kquant::dequantize_q4k(data, row, cols, out),
            Format::Q6K => super::kquant::dequantize_q6k(data, row, cols, out),
            _ => super::q32::dequantize(self, data, row, cols, out),
        }
    }
}
