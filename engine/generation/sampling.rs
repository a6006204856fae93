//! How the next token is chosen when not greedily: HF's `TemperatureLogitsWarper` then
//! `TopPLogitsWarper` (drop the least probable tokens whose cumulative mass is at most
//! `1 − top_p`, keep at least one), then a draw from the renormalised distribution with the
//! engine's own SplitMix64 generator seeded by `--seed`: a seed reproduces a run on any
//! machine, not PyTorch's sampled tokens. Greedy choice is `torch.argmax`'s, in a plain loop.

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    Greedy,
    /// Temperature, then nucleus filtering, then a seeded draw.
    TopP {
        temperature: f64,
        top_p: f64,
        seed: u64,
    },
}

/// The greedy token: `torch.argmax` of `logits` (any shape, flattened): the first largest value,
/// or the first NaN where there is one (argmax ranks NaN above every number), in plain loops
/// over the tensor's memory: less than libtorch's reduction costs to set up for one row.
pub fn greedy_token(logits: &tch::Tensor) -> crate::error::Result<i64> {
    if let Some(values) = crate::model::layers::f32_values(logits) {
        return Ok(argmax(values));
    }
    let values = Vec::<f32>::try_from(&logits.f_to_kind(tch::Kind::Float)?.f_reshape([-1])?)?;
    Ok(argmax(&values))
}

/// The index of the first largest value of `values`, or of its first NaN (0 when empty).
/// Two passes the compiler vectorises (the largest value and whether there is a NaN, over 16
/// lanes), then a search for its first index: half the time of one branching pass over an LM
/// head's 50k logits.
pub fn argmax(values: &[f32]) -> i64 {
    const LANES: usize = 16;
    let mut top = [f32::NEG_INFINITY; LANES];
    let mut nan = false;
    let (chunks, tail) = values.as_chunks::<LANES>();
    for chunk in chunks {
        for (t, &v) in top.iter_mut().zip(chunk) {
            *t = if v > *t { v } else { *t };
            nan |= v.is_nan();
        }
    }
    for &v in tail {
        top[0] = if v > top[0] { v } else { top[0] };
        nan |= v.is_nan();
    }
    let found = if nan {
        values.iter().position(|v| v.is_nan())
    } else {
        let max = top
            .into_iter()
            .fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a });
        values.iter().position(|&v| v == max)
    };
    found.unwrap_or(0) as i64
}

/// SplitMix64: a small, well-mixed, seedable generator (the draw of [`Sampling::TopP`]).
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Samples a token from `logits` with temperature and top-p (see the module header).
pub fn sample_top_p(logits: &[f32], temperature: f64, top_p: f64, rng: &mut SplitMix64) -> i64 {
    let scaled: Vec<f64> = logits
        .iter()
        .map(|&l| l as f64 / temperature.max(1e-6))
        .collect();
    // sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    let mut order: Vec<usize> = (0..scaled.len()).collect();
    order.sort_by(|&a, &b| scaled[a].total_cmp(&scaled[b]).then(a.cmp(&b)));
    let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = order.iter().map(|&i| (scaled[i] - max).exp()).collect();
    let total: f64 = weights.iter().sum();
    // cumulative_probs <= (1 - top_p) are removed; the most probable token always stays.
    let mut cumulative = 0.0;
    let mut first_kept = 0;
    for (rank, w) in weights.iter().enumerate() {
        cumulative += w / total;
        if cumulative <= 1.0 - top_p && rank + 1 < weights.len() {
            first_kept = rank + 1;
        } else {
            break;
        }
    }
    let kept = &weights[first_kept..];
    let kept_total: f64 = kept.iter().sum();
    let mut target = rng.next_f64() * kept_total;
    for (offset, w) in kept.iter().enumerate() {
        if target < *w {
            return order[first_kept + offset] as i64;
        }
        target -= w;
    }
    order[order.len() - 1] as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_is_torchs_first_largest_value_with_nan_above_all() {
        let long: Vec<f32> = (0..100).map(|i| ((i * 37) % 101) as f32).collect();
        let mut long_nan = long.clone();
        long_nan[70] = f32::NAN;
        let mut long_ties = long.clone();
        long_ties[90] = 100.0;
        assert_eq!(argmax(&[]), 0);
        let cases: [&[f32]; 9] = [
            &long,
            &long_nan,
            &long_ties,
            &[1.0, 3.0, 2.0],
            &[3.0, 1.0, 3.0],
            &[-1.0, f32::NEG_INFINITY, -0.5, -0.5],
            &[1.0, f32::NAN, 5.0, f32::NAN],
            &[f32::INFINITY, 2.0, f32::INFINITY],
            &[f32::NEG_INFINITY, f32::NEG_INFINITY],
        ];
        for values in cases {
            let torch = tch::Tensor::from_slice(values)
                .argmax(-1, false)
                .int64_value(&[]);
            assert_eq!(argmax(values), torch, "{values:?}");
            let logits = tch::Tensor::from_slice(values).view([1, -1]);
            assert_eq!(greedy_token(&logits).unwrap(), torch, "{values:?}");
            // Every other value of a longer tensor: not contiguous, so copied out.
            let spaced: Vec<f32> = values.iter().flat_map(|&v| [v, f32::NAN]).collect();
            let strided = tch::Tensor::from_slice(&spaced).slice(0, 0, None, 2);
            assert!(!strided.is_contiguous());
            assert_eq!(greedy_token(&strided).unwrap(), torch, "{values:?}");
        }
    }

    #[test]
    fn top_p_keeps_the_nucleus_and_is_seeded() {
        // Probabilities ∝ e^l: 0.64, 0.24, 0.09, 0.03 (about).
        let logits = [3.0f32, 2.0, 1.0, -0.1];
        let mut rng = SplitMix64::new(7);
        let draws: Vec<i64> = (0..400)
            .map(|_| sample_top_p(&logits, 1.0, 0.7, &mut rng))
            .collect();
        // top_p 0.7 keeps tokens 0 and 1 (0.64 alone is below 0.7).
        assert!(draws.iter().all(|&t| t == 0 || t == 1), "{draws:?}");
        assert!(draws.contains(&0) && draws.contains(&1));
        let again: Vec<i64> = {
            let mut rng = SplitMix64::new(7);
            (0..400)
                .map(|_| sample_top_p(&logits, 1.0, 0.7, &mut rng))
                .collect()
        };
        assert_eq!(draws, again);
        // A tiny top_p keeps only the most probable token; a tiny temperature is greedy.
        let mut rng = SplitMix64::new(1);
        assert!((0..50).all(|_| sample_top_p(&logits, 1.0, 0.01, &mut rng) == 0));
        assert!((0..50).all(|_| sample_top_p(&logits, 1e-4, 1.0, &mut rng) == 0));
    }

    #[test]
    fn uniform_draws_are_in_range() {
        let mut rng = SplitMix64::new(0);
        let mean = (0..10_000).map(|_| rng.next_f64()).sum::<f64>() / 10_000.0;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
    }
}
