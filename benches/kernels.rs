//! Criterion benchmarks of the engine's hot pieces on the demo model: one expert FFN, one
//! decoder step (experts resident, so only compute), and reading one expert from the store
//! (page cache warm, then O_DIRECT).

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use edgemoe::bundle::Bundle;
use edgemoe::model::moe::expert_forward;
use edgemoe::model::provider::ExpertProvider;
use edgemoe::model::KvFormat;
use edgemoe::offline::convert::{convert, ConvertOptions};
use edgemoe::runtime::resident::ResidentExperts;
use edgemoe::store::AlignedBuf;
use edgemoe::store::{ExpertStore, StorageMode};
use tch::{Kind, Tensor};

fn demo_bundle() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("bundle");
    convert(&ConvertOptions {
        resident: Default::default(),
        hf_dir: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/switch-samsum-tiny"),
        out_dir: out.clone(),
        tokenizer: None,
        bits: Default::default(),
        force: false,
        show_progress: false,
    })
    .unwrap();
    (dir, out)
}

fn kernels(c: &mut Criterion) {
    let _guard = tch::no_grad_guard();
    let (_dir, bundle_dir) = demo_bundle();
    let bundle = Bundle::open(&bundle_dir).unwrap();
    let spec = bundle.config.model.clone();
    let store = bundle.open_store().unwrap();
    let first = store.index().experts[0].id;

    let mut experts = ResidentExperts::load(&store, &[]).unwrap();
    let w = experts.expert(first, None).unwrap();
    let x = Tensor::randn([1, spec.d_model() as i64], (Kind::Float, tch::Device::Cpu));
    c.bench_function("expert FFN, 1 token (demo shape)", |b| {
        b.iter(|| black_box(expert_forward(&x, &w).unwrap()))
    });
    let x64 = Tensor::randn([64, spec.d_model() as i64], (Kind::Float, tch::Device::Cpu));
    c.bench_function("expert FFN, 64 tokens (demo shape)", |b| {
        b.iter(|| black_box(expert_forward(&x64, &w).unwrap()))
    });

    let model = match bundle.load_model(tch::Device::Cpu).unwrap() {
        edgemoe::model::Model::Switch(model) => model,
        _ => panic!("a Switch bundle"),
    };
    let source: Vec<i64> = (0..64).map(|i| 100 + i).chain([1]).collect();
    let encoded = model
        .encode(&source, &mut experts, &mut Vec::new())
        .unwrap();
    c.bench_function("decoder step, experts resident (demo model)", |b| {
        b.iter_batched(
            || model.start_decoder(&encoded, 1, KvFormat::F32).unwrap(),
            |mut state| {
                black_box(
                    model
                        .decode_step(&[0], &mut state, &mut experts, &mut Vec::new())
                        .unwrap(),
                )
            },
            criterion::BatchSize::SmallInput,
        )
    });

    let mut slot = AlignedBuf::new(store.max_padded_expert_bytes() as usize);
    let bytes = store.entry(first).unwrap().length;
    let mut group = c.benchmark_group("store read of one expert");
    group.throughput(Throughput::Bytes(bytes));
    group.bench_function("page cache", |b| {
        b.iter(|| black_box(store.read_expert(first, slot.as_mut_slice()).unwrap()))
    });
    let (direct, _) = ExpertStore::open_with(
        &bundle.path(edgemoe::bundle::EXPERTS_FILE),
        &spec.expert_layout(),
        StorageMode::Direct,
    )
    .unwrap();
    group.bench_function("O_DIRECT", |b| {
        b.iter(|| black_box(direct.read_expert(first, slot.as_mut_slice()).unwrap()))
    });
    group.finish();
}

criterion_group!(benches, kernels);
criterion_main!(benches);
