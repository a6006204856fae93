//! The quantized GEMV/GEMM kernels (`edgemoe::quant::matrix`) in bytes of weights per second,
//! next to this machine's memory bandwidth measured here (a STREAM-style read, copy and triad
//! over 512 MiB arrays, on one thread like the kernels below).
//!
//! Shapes: a switch-base-8 expert's first matrix `[3072, 768]` (short rows: 24 blocks of 32),
//! an OLMoE-1B-7B expert matrix `[1024, 2048]`, and its LM head `[50304, 2048]` (the
//! largest single matrix: 412 MB at f32, 206 at f16, 103 at INT8, 52 at INT4 — far beyond a
//! board's last-level cache, but a server's L3 can hold the smaller ones, so compare the f32 and
//! f16 ones with the bandwidth there). GEMV is one activation row (a decode step), `gemv-4
//! (beams)` four (a 4-beam decode step: the several-row INT8, f16 and bf16 kernels); GEMM is 64
//! rows (an expert's share of a 512-token prefill): integer formats take the integer GEMM where
//! the CPU has one (printed first), the others libtorch's f32 GEMM, so the f32 row is the
//! reference the integer ones are compared with.
//!
//! `cargo bench --bench matmul` (criterion prints the throughput; the STREAM figures are printed
//! first, as `stream read` / `stream copy` / `stream triad` in GB/s). `MATMUL_THREADS=N` runs
//! the "from memory" groups on N compute threads (the engine's `--threads`; default 1).

use std::hint::black_box;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use edgemoe::quant::matrix::{
    float_gemm_kernel, int_gemm_kernel, matmul, matmul_kernel, MatrixFormat, PackedMatrix,
    FLOAT_GEMM_MAX_ROWS,
};
use edgemoe::quant::QuantBits;

const FORMATS: [MatrixFormat; 6] = [
    MatrixFormat::F32,
    MatrixFormat::F16,
    MatrixFormat::Bf16,
    MatrixFormat::Quant(QuantBits::Int8),
    MatrixFormat::Quant(QuantBits::Int4),
    MatrixFormat::Quant(QuantBits::Int2),
];

/// Deterministic weights spread like a trained layer's.
fn weights(n: usize) -> Vec<f32> {
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
        })
        .collect()
}

/// Best of 5 passes of `f` over `bytes` moved, in GB/s.
fn bandwidth(bytes: usize, mut f: impl FnMut()) -> f64 {
    (0..5)
        .map(|_| {
            let t = Instant::now();
            f();
            bytes as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

/// The aligned middle of `values` as `u64` words (the read pass only needs bits to add).
fn as_words(values: &[f32]) -> &[u64] {
    // SAFETY: every bit pattern is a valid u64, and `align_to` returns an aligned middle.
    unsafe { values.align_to::<u64>().1 }
}

/// STREAM copy (`a = b`, 2 arrays touched) and triad (`a = b + s·c`, 3) over 128 Mi f32 each,
/// and a read-only pass (a wrapping sum of `b`'s words): a GEMV only reads its weights, so the
/// read figure is the one its bytes/s compare with.
fn stream() {
    let n = 128 << 20;
    let mut a = vec![0f32; n];
    let b = vec![1f32; n];
    let c = vec![2f32; n];
    let copy = bandwidth(2 * 4 * n, || {
        a.copy_from_slice(&b);
        black_box(&a);
    });
    let triad = bandwidth(3 * 4 * n, || {
        for ((a, b), c) in a.iter_mut().zip(&b).zip(&c) {
            *a = b + 3.0 * c;
        }
        black_box(&a);
    });
    let words = as_words(&b);
    let read = bandwidth(8 * words.len(), || {
        // Eight independent sums, so the adds do not wait on each other.
        // A prefetch 2 KiB ahead, as the x86_64 GEMV kernels do, so both are measured the same
        // way (the NEON kernels do not prefetch).
        let mut sums = [0u64; 8];
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
        for (i, chunk) in words.chunks_exact(8).enumerate() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a prefetch is only a hint; it never faults, whatever the address.
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                _mm_prefetch::<_MM_HINT_T0>(words.as_ptr().wrapping_add(i * 8 + 256).cast());
            }
            for (s, w) in sums.iter_mut().zip(chunk) {
                *s = s.wrapping_add(*w);
            }
        }
        black_box(sums);
    });
    println!("stream read  {read:.1} GB/s (1 thread)");
    println!("stream copy  {copy:.1} GB/s (1 thread)");
    println!("stream triad {triad:.1} GB/s (1 thread)");
    println!("kernels: {}", matmul_kernel());
    println!(
        "integer GEMM: {}",
        int_gemm_kernel().unwrap_or("none (dequantized tiles + libtorch's f32 GEMM)")
    );
    println!(
        "float GEMM (up to {FLOAT_GEMM_MAX_ROWS} rows): {}",
        float_gemm_kernel().unwrap_or("none (tiles + libtorch's f32 GEMM)")
    );
}

fn kernels(c: &mut Criterion) {
    // One thread throughout, as the engine runs libtorch (no compute pool is set up here).
    tch::set_num_threads(1);
    stream();
    for (name, rows, cols) in [
        ("switch-expert", 3072, 768),
        ("expert", 1024, 2048),
        ("lm-head", 50304, 2048),
    ] {
        let w = weights(rows * cols);
        for format in FORMATS {
            let m = PackedMatrix::encode(&w, rows, cols, format).unwrap();
            let bytes = m.view().stored_bytes() as u64;
            let mut group = c.benchmark_group(format!("{name} [{rows}x{cols}] {}", format.name()));
            group.throughput(Throughput::Bytes(bytes));
            if name == "lm-head" {
                group.sample_size(10);
            }
            for n in [1usize, 4, 64] {
                if name == "lm-head" && n > 1 {
                    continue;
                }
                let x = weights(n * cols);
                let mut out = vec![0f32; n * rows];
                let label = match n {
                    1 => "gemv",
                    4 => "gemv-4 (beams)",
                    _ => "gemm-64",
                };
                group.bench_function(BenchmarkId::new(label, n), |b| {
                    b.iter(|| matmul(black_box(&x), n, m.view(), &mut out).unwrap())
                });
            }
            group.finish();
        }
    }
}

/// Decode streams its weights from memory: one step's 16 OLMoE expert matrices (8 experts × 2
/// layers, 3 each), its attention and its LM head are more than a board's or this machine's
/// last-level cache holds. The groups above repeat one matrix, which a large L3 partly keeps
/// (even a 52 MB LM head in a 32 MiB L3); here a GEMV takes a different copy of the matrix each
/// time, from 512 MiB of copies visited in a scattered order, so every byte comes from memory
/// and every matrix starts cold (no stream under way), as in decoding.
fn streamed(c: &mut Criterion) {
    tch::set_num_threads(1);
    let threads: usize = std::env::var("MATMUL_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(1);
    edgemoe::quant::parallel::set_compute_threads(threads);
    let on = if threads > 1 {
        format!(", {threads} threads")
    } else {
        String::new()
    };
    for (name, rows, cols) in [("expert", 1024, 2048), ("lm-head", 50304, 2048)] {
        let w = weights(rows * cols);
        for format in [
            MatrixFormat::Quant(QuantBits::Int8),
            MatrixFormat::Quant(QuantBits::Int4),
            MatrixFormat::Quant(QuantBits::Int2),
            MatrixFormat::F16,
        ] {
            let one = PackedMatrix::encode(&w, rows, cols, format).unwrap();
            let bytes = one.view().stored_bytes();
            let count = (512usize << 20).div_ceil(bytes).max(2);
            let copies: Vec<PackedMatrix> = std::iter::once(one)
                .chain((1..count).map(|_| PackedMatrix::encode(&w, rows, cols, format).unwrap()))
                .collect();
            let mut group = c.benchmark_group(format!(
                "{name} from memory [{rows}x{cols}] {}{on}",
                format.name()
            ));
            group.throughput(Throughput::Bytes(bytes as u64));
            if name == "lm-head" {
                group.sample_size(10);
            }
            // A prime stride that does not divide the count: every copy once per round, and
            // never the neighbour of the one before.
            let stride = if count.is_multiple_of(37) { 1 } else { 37 };
            let mut next = 0;
            // One activation row (greedy decoding) and four (4 beams).
            for n in [1usize, 4] {
                let x = weights(n * cols);
                let mut out = vec![0f32; n * rows];
                let label = if n == 1 { "gemv" } else { "gemv-4 (beams)" };
                group.bench_function(BenchmarkId::new(label, n), |b| {
                    b.iter(|| {
                        next = (next + stride) % count;
                        matmul(black_box(&x), n, copies[next].view(), &mut out).unwrap()
                    })
                });
            }
            group.finish();
        }
    }
}

criterion_group!(benches, kernels, streamed);
criterion_main!(benches);
