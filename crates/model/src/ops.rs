//! The small f32 operations of a transformer layer. Every loop has a fixed reduction order,
//! so a row's result depends only on that row.

/// Dot product with eight fixed lanes (vectorizes; the summation order is fixed).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        let (x, y) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for i in chunks * 8..a.len() {
        tail += a[i] * b[i];
    }
    let s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    s + tail
}

/// `y += a * x`.
#[inline]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// RMSNorm of each `weight.len()`-sized row of `x` into `out`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss = dot(xr, xr) / d as f32;
        let scale = 1.0 / (ss + eps).sqrt();
        for ((o, xi), w) in or.iter_mut().zip(xr).zip(weight) {
            *o = xi * scale * w;
        }
    }
}

/// Adds a bias to every row.
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        for (a, b) in row.iter_mut().zip(bias) {
            *a += b;
        }
    }
}

/// In-place softmax.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `gate = silu(gate) * up`, elementwise.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// How RoPE pairs the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i+1)` (GGUF llama: the converter permuted Q and K for it).
    Adjacent,
    /// Split halves `(i, i + d/2)` (qwen2, "neox").
    Halves,
}

/// Rotary position embedding for one head size.
#[derive(Debug, Clone)]
pub struct Rope {
    style: RopeStyle,
    inv_freq: Vec<f64>,
}

impl Rope {
    /// Frequencies `theta^(-2i/d)`.
    pub fn new(style: RopeStyle, head_dim: usize, theta: f32) -> Self {
        let inv_freq = (0..head_dim / 2)
            .map(|i| (theta as f64).powf(-2.0 * i as f64 / head_dim as f64))
            .collect();
        Self { style, inv_freq }
    }

    /// `(cos, sin)` for one position, `head_dim / 2` each.
    pub fn table(&self, pos: usize) -> (Vec<f32>, Vec<f32>) {
        self.inv_freq
            .iter()
            .map(|f| {
                let a = pos as f64 * f;
                (a.cos() as f32, a.sin() as f32)
            })
            .unzip()
    }

    /// Rotates every head in `x` (a token's `n_heads * head_dim` values) by `(cos, sin)`.
    pub fn apply(&self, x: &mut [f32], cos: &[f32], sin: &[f32]) {
        let half = self.inv_freq.len();
        for head in x.chunks_exact_mut(2 * half) {
            for i in 0..half {
                let (a, b) = match self.style {
                    RopeStyle::Adjacent => (2 * i, 2 * i + 1),
                    RopeStyle::Halves => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos[i] - x1 * sin[i];
                head[b] = x0 * sin[i] + x1 * cos[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_sums_to_one() {
        let mut x = vec![1.0, 2.0, 3.0, -1e9];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(x[3], 0.0);
    }

    #[test]
    fn rope_at_zero_is_identity_and_preserves_norm() {
        for style in [RopeStyle::Adjacent, RopeStyle::Halves] {
            let r = Rope::new(style, 8, 10000.0);
            let orig: Vec<f32> = (0..16).map(|i| i as f32 * 0.3 - 1.0).collect();
            let mut x = orig.clone();
            let (c, s) = r.table(0);
            r.apply(&mut x, &c, &s);
            assert_eq!(x, orig);
            let (c, s) = r.table(17);
            r.apply(&mut x, &c, &s);
            assert!((dot(&x, &x) - dot(&orig, &orig)).abs() < 1e-3);
        }
    }

    #[test]
    fn dot_matches_naive() {
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.5).collect();
        let naive: f32 = a.iter().map(|x| x * x).sum();
        assert!((dot(&a, &a) - naive).abs() < 1e-2);
    }
}
