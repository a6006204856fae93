//! Criterion benchmarks of the decode step's cached attention ([`CachedKv`]): the
//! cross-attention of 4 beams over one switch-base-8 document (353 tokens, 12 heads of 64),
//! beam by beam against one shared walk of the cache and against the same cache held as a
//! [`SourceKv`] (keys by dimension) in each format, and one query over a long self-attention
//! cache (OLMoE's 16 heads of 128, 512 tokens; 1024 tokens in each format, on
//! `ATTENTION_THREADS` compute threads, 1 by default: with more, the heads are split over them).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use edgemoe::model::kv::{KvCacheRows, KvFormat, SourceKv};
use edgemoe::model::layers::CachedKv;

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn attention(c: &mut Criterion) {
    let mut group = c.benchmark_group("cached attention");
    let (heads, head_dim, tokens, beams) = (12, 64, 353, 4);
    let width = heads * head_dim;
    let (keys, vals) = (values(tokens * width, 1), values(tokens * width, 2));
    let queries = values(beams * width, 3);
    let kv = CachedKv {
        keys: &keys[..],
        values: &vals[..],
        kv_heads: heads,
        head_dim,
    };
    group.throughput(Throughput::Bytes((2 * tokens * width * 4) as u64));
    group.bench_function("4 beams over one 353-token cache, beam by beam", |b| {
        b.iter(|| {
            for query in queries.chunks_exact(width) {
                black_box(kv.attend(black_box(query), 0, 1.0, None));
            }
        })
    });
    group.bench_function("4 beams over one 353-token cache, one walk", |b| {
        b.iter(|| black_box(kv.attend_each(black_box(&queries), beams, 0, 1.0, None)))
    });
    for format in KvFormat::ALL {
        let source = SourceKv::new(format, &keys, vals.clone(), width);
        group.bench_function(
            format!("1 query over one 353-token source cache by dimension, {format}"),
            |b| {
                b.iter(|| {
                    black_box(source.attend_each(
                        heads,
                        head_dim,
                        black_box(&queries[..width]),
                        1,
                        0,
                        1.0,
                        None,
                    ))
                })
            },
        );
        group.bench_function(
            format!("4 beams over one 353-token source cache by dimension, {format}"),
            |b| {
                b.iter(|| {
                    black_box(source.attend_each(
                        heads,
                        head_dim,
                        black_box(&queries),
                        beams,
                        0,
                        1.0,
                        None,
                    ))
                })
            },
        );
    }

    let (heads, head_dim, tokens) = (16, 128, 512);
    let width = heads * head_dim;
    let (keys, vals) = (values(tokens * width, 4), values(tokens * width, 5));
    let query = values(width, 6);
    let kv = CachedKv {
        keys: &keys[..],
        values: &vals[..],
        kv_heads: heads,
        head_dim,
    };
    group.throughput(Throughput::Bytes((2 * tokens * width * 4) as u64));
    group.bench_function("1 query over a 512-token cache", |b| {
        b.iter(|| black_box(kv.attend(black_box(&query), 0, 1.0, None)))
    });

    let threads: usize = std::env::var("ATTENTION_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(1);
    edgemoe::quant::parallel::set_compute_threads(threads);
    let tokens = 1024;
    let (keys, vals) = (values(tokens * width, 7), values(tokens * width, 8));
    for format in KvFormat::ALL {
        let cache = KvCacheRows::new(format, keys.clone(), vals.clone(), width);
        group.throughput(Throughput::Bytes(
            2 * format.bytes(tokens as u64, width as u64),
        ));
        group.bench_function(
            format!("1 query over a 1024-token cache, {format}, {threads} threads"),
            |b| {
                b.iter(|| {
                    black_box(cache.attend_each(
                        heads,
                        head_dim,
                        black_box(&query),
                        1,
                        0,
                        1.0,
                        None,
                    ))
                })
            },
        );
    }
    group.finish();
}

criterion_group!(benches, attention);
criterion_main!(benches);
