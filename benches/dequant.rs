//! Dequantization throughput in packed bytes per second, per bit width, for the demo model's
//! expert matrix `[512, 256]` and switch-base-8's `[3072, 768]`: the scalar reference against
//! the kernel `dequantize_into` picks on this CPU.
//!
//! `cargo bench --bench dequant`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use edgemoe::quant::{dequantize_into, dequantize_kernel, dequantize_scalar, quantize, QuantBits};

const SHAPES: [(usize, usize); 2] = [(512, 256), (3072, 768)];

/// Deterministic weights spread like a trained layer's (a sum of uniforms, roughly normal).
fn weights(n: usize) -> Vec<f32> {
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    (0..n)
        .map(|_| (uniform() + uniform() + uniform() + uniform()) * 0.05)
        .collect()
}

fn dequant(c: &mut Criterion) {
    let kernel = format!("dispatched-{}", dequantize_kernel());
    for bits in QuantBits::ALL {
        let mut group = c.benchmark_group(format!("dequant-{}", bits.name()));
        for (rows, cols) in SHAPES {
            let (packed, scales) =
                quantize(&weights(rows * cols), rows, cols, bits).expect("valid matrix");
            let mut out = vec![0f32; rows * cols];
            let shape = format!("{rows}x{cols}");
            group.throughput(Throughput::Bytes(packed.len() as u64));
            group.bench_function(BenchmarkId::new("scalar", &shape), |b| {
                b.iter(|| {
                    dequantize_scalar(black_box(&packed), &scales, rows, cols, bits, &mut out)
                })
            });
            group.bench_function(BenchmarkId::new(&kernel, &shape), |b| {
                b.iter(|| dequantize_into(black_box(&packed), &scales, rows, cols, bits, &mut out))
            });
        }
        group.finish();
    }
}

criterion_group!(benches, dequant);
criterion_main!(benches);
