//! The fuzz harness (`fuzz/src/harness.rs`, one function per parser) on the committed seed
//! corpus and on every input a fuzzer once crashed or hung on (`fuzz/regressions/<target>/`),
//! with the fuzz targets' allocation limit: no panic, no allocation above 256 MiB, and each
//! regression input refused with an error rather than accepted. Runs without AFL++; the fuzzing
//! itself is `fuzz/run.sh`. `make_fuzz_corpus` (ignored) regenerates the seeds from the
//! fixtures: `cargo test --release --test fuzz_corpus -- --ignored make_fuzz_corpus`.

mod common;

#[path = "../fuzz/src/harness.rs"]
#[allow(dead_code)]
mod harness;
#[path = "../fuzz/src/limit.rs"]
mod limit;

#[global_allocator]
static ALLOCATOR: limit::LimitedAlloc = limit::LimitedAlloc;

use std::path::{Path, PathBuf};

/// A fuzz target: one parser fed arbitrary bytes.
type Target = fn(&[u8]);

/// The targets, by the name of their corpus folder.
const TARGETS: [(&str, Target); 9] = [
    ("store", harness::store),
    ("paths", harness::paths),
    ("profile", harness::profile),
    ("trace", harness::trace),
    ("config", harness::config),
    ("manifest", harness::manifest),
    ("safetensors", harness::safetensors),
    ("tokenizer", harness::tokenizer),
    ("jsonl", harness::jsonl),
];

fn fuzz_dir() -> PathBuf {
    common::root().join("fuzz")
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(entries) => entries.map(|e| e.unwrap().path()).collect(),
        Err(_) => Vec::new(),
    };
    files.sort();
    files
}

#[test]
fn every_seed_runs_through_its_parser() {
    harness::init();
    for (target, run) in TARGETS {
        let seeds = files_in(&fuzz_dir().join("corpus").join(target));
        assert!(!seeds.is_empty(), "no seeds for {target}");
        for seed in seeds {
            run(&std::fs::read(&seed).unwrap());
        }
    }
}

#[test]
fn every_regression_input_runs_through_its_parser() {
    harness::init();
    for (target, run) in TARGETS {
        for input in files_in(&fuzz_dir().join("regressions").join(target)) {
            run(&std::fs::read(&input).unwrap());
        }
    }
}

/// Writes the seed corpus of every target into `fuzz/corpus/` from the fixtures: small valid
/// inputs (a two-expert store, a dictionary, the built-in profiles, a trace, the fixtures'
/// bundle configs, small safetensors files, JSON-lines documents), and near-misses.
#[test]
#[ignore = "regenerates the committed corpus"]
fn make_fuzz_corpus() {
    let corpus = fuzz_dir().join("corpus");
    for (target, _) in TARGETS {
        let dir = corpus.join(target);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
    }
    let put = |target: &str, name: &str, bytes: &[u8]| {
        std::fs::write(corpus.join(target).join(name), bytes).unwrap();
    };
    let scratch = tempfile::tempdir().unwrap();
    let temp = |name: &str| scratch.path().join(name);

    // store: the harness's layout at three encodings; one with the index-checksum fix-up bit.
    use edgemoe::quant::QuantBits;
    use edgemoe::store::{ExpertEncoding, ExpertStoreWriter};
    use edgemoe::weights::WeightDtype;
    let layout = harness::store_layout();
    for (name, encoding) in [
        ("f32", ExpertEncoding::Float(WeightDtype::F32)),
        ("int4", ExpertEncoding::Quant(QuantBits::Int4)),
        ("bf16-int2", ExpertEncoding::Float(WeightDtype::BF16)),
    ] {
        let path = temp("experts.bin");
        let experts: Vec<_> = layout
            .experts
            .iter()
            .enumerate()
            .map(|(i, &id)| {
                let e = if name == "bf16-int2" && i == 1 {
                    ExpertEncoding::Quant(QuantBits::Int2)
                } else {
                    encoding
                };
                (id, e)
            })
            .collect();
        let mut writer = ExpertStoreWriter::create(&path, &layout, &experts).unwrap();
        let mut fill = 0u8;
        while let Some(entry) = writer.next_entry() {
            let blob: Vec<u8> = (0..entry.length)
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(fill))
                .collect();
            fill += 1;
            writer.write_next(&blob).unwrap();
        }
        writer.finish().unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        put("store", &format!("{name}.bin"), &bytes);
        bytes[12] |= 1;
        put("store", &format!("{name}-fixup.bin"), &bytes);
    }

    // paths: dictionaries of top-1 and top-2 routing (each token a pass of its own), and the
    // top-1 one as version 2 wrote it (no pass counts).
    use edgemoe::dictionary::PathDictionary;
    use edgemoe::ids::Stack;
    for (name, layers, experts, k) in [("top1", 3, 4, 1), ("top2", 2, 4, 2)] {
        let mut dict = PathDictionary::new(layers, layers, experts, k);
        let mut passes = Vec::new();
        for token in 0..12u16 {
            let path: Vec<u16> = (0..layers * k)
                .map(|i| (token + i as u16 * 3) % experts as u16)
                .collect();
            dict.stack_mut(Stack::Encoder).add_path(&path);
            dict.stack_mut(Stack::Decoder).add_path(&path);
            passes.push(path.chunks(k).map(<[u16]>::to_vec).collect());
        }
        for stack in [Stack::Encoder, Stack::Decoder] {
            dict.stack_mut(stack).add_passes(&passes);
        }
        let path = temp("paths.bin");
        dict.save(&path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        put("paths", &format!("{name}.bin"), &bytes);
        if name == "top1" {
            let body = bincode::serialized_size(&dict).unwrap() as usize;
            let mut v2 = bytes[..12 + body].to_vec();
            v2[8..12].copy_from_slice(&2u32.to_le_bytes());
            put("paths", "top1-v2.bin", &v2);
        }
    }

    // profile: the built-in profiles.
    for (name, text) in edgemoe::config::profile::BUILT_IN {
        put("profile", &format!("{name}.toml"), text.as_bytes());
    }

    // trace: a recorded-style trace with every event kind.
    use edgemoe::cache::trace::{TraceWriter, TRACE_VERSION};
    use edgemoe::cache::{AccessKind, LayerMap, Policy, TraceEvent, TraceHeader};
    use edgemoe::ids::ExpertId;
    let path = temp("trace.jsonl");
    let seeded = ExpertId {
        stack: Stack::Decoder,
        layer: 1,
        expert: 0,
    };
    let header = TraceHeader {
        edgemoe_trace: TRACE_VERSION,
        slots: 2,
        policy: Policy::Edgemoe,
        prefetch: true,
        layers: LayerMap {
            encoder_moe_blocks: vec![1],
            decoder_moe_blocks: vec![1, 3],
        },
        seeds: edgemoe::cache::Seeds {
            frequency: vec![(seeded, 0.5)],
            passes: vec![(seeded, 0.75, 0.5)],
            steps_per_document: Some(2.0),
        },
    };
    let mut writer = TraceWriter::create(&path, &header).unwrap();
    let events = [
        (AccessKind::Demand, Stack::Encoder, 1, 0, None),
        (AccessKind::Prefetch, Stack::Decoder, 1, 1, Some(0)),
        (AccessKind::Demand, Stack::Decoder, 1, 1, Some(0)),
        (AccessKind::Prefetch, Stack::Decoder, 3, 2, Some(0)),
        (AccessKind::Cancel, Stack::Decoder, 3, 2, Some(1)),
        (AccessKind::Demand, Stack::Decoder, 3, 0, Some(1)),
        (AccessKind::Demand, Stack::Decoder, 1, 1, Some(0)),
    ];
    for (token, (kind, stack, layer, expert, current)) in events.into_iter().enumerate() {
        writer
            .event(&TraceEvent {
                token: token as u64 / 3,
                kind,
                stack,
                layer,
                expert,
                current,
                pinned: if kind == AccessKind::Demand {
                    vec![ExpertId {
                        stack,
                        layer,
                        expert: (expert + 1) % 4,
                    }]
                } else {
                    vec![]
                },
                waited_ms: None,
            })
            .unwrap();
    }
    writer.finish().unwrap();
    put("trace", "small.jsonl", &std::fs::read(&path).unwrap());

    // config: every fixture's bundle config; safetensors: two fixtures' resident weights (bf16
    // and INT8, to keep them small) and hand-made files with one tensor of each dtype.
    use edgemoe::offline::bit_plan::BitPlan;
    use edgemoe::offline::convert::ResidentWidth;
    for name in common::SWITCH_FIXTURES
        .iter()
        .chain(&common::DECODER_FIXTURES)
    {
        let bundle = common::convert_to(&common::fixture(name), &scratch.path().join(name));
        put(
            "config",
            &format!("{name}.json"),
            &std::fs::read(bundle.join("config.json")).unwrap(),
        );
        // manifest: the bundle's own (its checksum recomputed by the harness), and as raw
        // bytes (a leading space: no fix-up) one listing a path outside the bundle.
        let manifest = std::fs::read_to_string(bundle.join("manifest.json")).unwrap();
        put("manifest", &format!("{name}.json"), manifest.as_bytes());
        if name == &"tiny-mixtral" {
            let outside = format!(
                " {}",
                manifest.replacen("\"config.json\"", "\"../config.json\"", 1)
            );
            put("manifest", "outside-raw.json", outside.as_bytes());
        }
    }
    for (name, width) in [
        ("tiny-tied-e4", ResidentWidth::Int8),
        ("tiny-mixtral", ResidentWidth::Bf16),
    ] {
        let dir = scratch.path().join(format!("{name}-resident"));
        let bundle = common::convert_at(&common::fixture(name), &dir, BitPlan::default(), width);
        put(
            "safetensors",
            &format!("{name}-{}.safetensors", width.name()),
            &std::fs::read(bundle.join("resident.safetensors")).unwrap(),
        );
    }
    // tokenizer: the decoder fixtures' BPE tokenizer (small; the T5 one is 2.4 MB) and a
    // near-miss with its model's type misspelled.
    let bpe =
        std::fs::read_to_string(common::fixture("tiny-mixtral").join("tokenizer.json")).unwrap();
    put("tokenizer", "bpe.json", bpe.as_bytes());
    put(
        "tokenizer",
        "bpe-bad-type.json",
        bpe.replacen("\"BPE\"", "\"BPX\"", 1).as_bytes(),
    );
    use safetensors::tensor::{Dtype, TensorView};
    let data: Vec<u8> = (0..48u8).collect();
    for (name, dtype, shape) in [
        ("f32", Dtype::F32, vec![3, 4]),
        ("f16", Dtype::F16, vec![2, 2, 6]),
        ("bf16", Dtype::BF16, vec![24]),
        ("i8", Dtype::I8, vec![4, 12]),
    ] {
        let view = TensorView::new(dtype, shape, &data).unwrap();
        let bytes = safetensors::serialize([("shared.weight", view)], None).unwrap();
        put("safetensors", &format!("one-{name}.safetensors"), &bytes);
    }

    // jsonl: documents and examples in each accepted form (invented text).
    let documents: [(&str, &str); 6] = [
        (
            "lines",
            "{\"dialogue\": \"Ann: lunch at noon?\\nBob: yes\", \"summary\": \"Lunch at noon.\"}\n{\"document\": \"The tram is late.\", \"reference\": \"Late tram.\"}\n",
        ),
        (
            "array",
            "[{\"dialogue\": \"Cy: hi\", \"summary\": \"Greeting.\"}, {\"document\": \"x\", \"summary\": \"y\"}]",
        ),
        (
            "bom-crlf",
            "\u{feff}{\"dialogue\": \"Di: ok\", \"summary\": \"Agreed.\"}\r\n\r\n{\"dialogue\": \"Ed: no\", \"summary\": \"Refused.\"}\r\n",
        ),
        ("plain", "[10:32] Fay: the meeting moved to Friday.\nGus: fine.\n"),
        ("empty-array", "[]"),
        ("bad-line", "{\"dialogue\": \"Hal: hi\"}\n{not json}\n"),
    ];
    for (name, text) in documents {
        put("jsonl", &format!("{name}.txt"), text.as_bytes());
    }
}

/// Fuzzer finding (paths): a loaded dictionary's counts near `u64::MAX` overflowed the `u64`
/// sums of `frequencies`, `predict`, `tokens` and `top_path_coverage` (a panic with overflow
/// checks, nonsense probabilities above 1 without).
#[test]
fn dictionary_counts_near_the_u64_limit_do_not_wrap() {
    use edgemoe::dictionary::PathDictionary;
    use edgemoe::ids::Stack;
    let mut dict = PathDictionary::new(1, 1, 2, 1);
    let paths = dict.stack_mut(Stack::Decoder);
    paths.marginal[0] = vec![u64::MAX, 2];
    paths.paths.insert(vec![0], u64::MAX);
    paths.paths.insert(vec![1], 5);
    let probabilities = paths.frequencies(0);
    assert!(
        probabilities.iter().all(|&p| (0.0..=1.0).contains(&p)),
        "{probabilities:?}"
    );
    assert!(probabilities[0] > 0.99, "{probabilities:?}");
    assert_eq!(paths.tokens(), u64::MAX);
    let coverage = paths.top_path_coverage(0.5);
    assert!(coverage > 0.99 && coverage <= 1.0, "{coverage}");
}

/// Fuzzer finding (config): a bundle `config.json` claiming 222,222,222 encoder layers was
/// accepted, and opening the bundle built every expert id it implies (gigabytes). A bundle
/// config whose sizes the engine cannot address or allocate is refused by name when read.
#[test]
fn bundle_configs_with_impossible_sizes_are_refused_naming_the_field() {
    use edgemoe::config::BundleConfig;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    let regression = fuzz_dir().join("regressions/config/encoder-layers-222222222.json");
    std::fs::copy(&regression, &path).unwrap();
    let err = BundleConfig::load(&path).unwrap_err();
    assert!(matches!(err, edgemoe::Error::Format { .. }), "{err:?}");
    assert!(err.to_string().contains("num_encoder_layers"), "{err}");

    let valid = fuzz_dir().join("specs/tiny-mixtral.json");
    let text = std::fs::read_to_string(valid).unwrap();
    assert!(BundleConfig::load(&{
        std::fs::write(&path, &text).unwrap();
        path.clone()
    })
    .is_ok());
    for (from, to, field) in [
        (
            "\"num_experts\": 8",
            "\"num_experts\": 70000",
            "experts per layer",
        ),
        ("\"top_k\": 2", "\"top_k\": 9", "top_k"),
        ("\"num_kv_heads\": 2", "\"num_kv_heads\": 0", "num_kv_heads"),
        (
            "\"hidden_size\": 32",
            "\"hidden_size\": 1099511627776",
            "hidden_size",
        ),
        (
            "\"num_layers\": 2",
            "\"num_layers\": 3",
            "attention windows",
        ),
    ] {
        assert!(text.contains(from), "{from}");
        std::fs::write(&path, text.replace(from, to)).unwrap();
        let err = BundleConfig::load(&path).unwrap_err();
        assert!(err.to_string().contains(field), "{from} → {to}: {err}");
    }
}
