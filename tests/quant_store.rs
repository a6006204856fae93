//! Quantized expert stores, on every tiny fixture of every architecture: a store with mixed
//! widths (a float width, INT8, INT4, INT2) converts, loads and runs; each expert is one blob
//! holding its matrices and scales; and every expert decodes to exactly the channel-wise
//! dequantization of its source weights (per-expert or fused checkpoint tensors alike).

mod common;

use common::engine::{expert_matrices, source_expert_matrix};
use common::golden::{decoder_golden, greedy_options};

use edgemoe::bundle::Bundle;
use edgemoe::config::ModelSpec;
use edgemoe::generation::causal::complete;
use edgemoe::generation::decoding::DecodeOptions;
use edgemoe::generation::seq2seq::generate;
use edgemoe::ids::{ExpertId, Stack};
use edgemoe::model::provider::ExpertProvider;
use edgemoe::offline::bit_plan::BitPlan;
use edgemoe::quant::{dequantize_scalar, quantize, QuantBits};
use edgemoe::runtime::buffer::ExpertBuffer;
use edgemoe::store::ExpertEncoding;
use edgemoe::weights::{WeightDtype, WeightFiles};

/// Converts fixture `name` with its experts at INT8, INT4, INT2 and `float` in turn, and checks
/// the store, every expert's decoded weights and a greedy run.
fn check_mixed_widths(name: &str, float: WeightDtype) {
    let hf = common::fixture(name);
    let files = WeightFiles::open_hf_dir(&hf).unwrap();
    let config = edgemoe::offline::convert::read_hf_config(&hf).unwrap();
    let ids = config.model.all_experts();
    let widths = [
        ExpertEncoding::Quant(QuantBits::Int8),
        ExpertEncoding::Quant(QuantBits::Int4),
        ExpertEncoding::Quant(QuantBits::Int2),
        ExpertEncoding::Float(float),
    ];
    let mut plan = BitPlan::uniform(ExpertEncoding::Quant(QuantBits::Int8));
    for (i, id) in ids.iter().enumerate() {
        plan.experts.insert(*id, widths[i % widths.len()]);
    }
    let dir = tempfile::tempdir().unwrap();
    let out = common::convert_with(&hf, dir.path(), plan.clone());

    let bundle = Bundle::open(&out).unwrap();
    let spec = bundle.config.model.clone();
    let matrices = expert_matrices(&spec);
    let store = bundle.open_store().unwrap();
    let widest = store.max_padded_expert_bytes();
    let mut seen = std::collections::HashSet::new();
    for e in &store.index().experts {
        assert_eq!(Some(e.encoding), plan.encoding(e.id), "{name} {}", e.id);
        assert!(e.padded_length() <= widest);
        seen.insert(e.encoding);
    }
    assert_eq!(seen.len(), 4, "{name}: all four widths in one store");
    let int8 = store
        .index()
        .experts
        .iter()
        .find(|e| e.encoding == ExpertEncoding::Quant(QuantBits::Int8))
        .unwrap();
    // One blob holds the expert's matrices and their scales.
    assert_eq!(
        int8.matrices
            .iter()
            .map(|m| m.name.as_str())
            .collect::<Vec<_>>(),
        matrices,
        "{name}"
    );
    let mut buffer = ExpertBuffer::new(store, &spec, 2);
    for &id in &ids {
        let weights = buffer.expert(id, None).unwrap();
        for (m, got) in matrices.iter().zip(weights.matrices()) {
            // Computed on in its stored encoding: never a float copy of a quantized expert.
            let format = got.stored().expect("a stored matrix").format();
            assert_eq!(
                format,
                edgemoe::runtime::codec::matrix_format(plan.encoding(id).unwrap()),
                "{name} {id} {m}"
            );
            let got = got.to_tensor().unwrap();
            let shape: Vec<usize> = got.size().iter().map(|&d| d as usize).collect();
            let source = source_expert_matrix(&files, &spec, id, m, &shape);
            let expected = match plan.encoding(id).unwrap() {
                ExpertEncoding::Quant(bits) => {
                    let (packed, scales) = quantize(&source, shape[0], shape[1], bits).unwrap();
                    let mut out = vec![0f32; source.len()];
                    dequantize_scalar(&packed, &scales, shape[0], shape[1], bits, &mut out)
                        .unwrap();
                    out
                }
                ExpertEncoding::Float(_) => source,
            };
            let got = Vec::<f32>::try_from(got.flatten(0, -1)).unwrap();
            assert_eq!(got, expected, "{name} {id} {m}");
        }
    }

    // And the model runs on it.
    let tokens = match &spec {
        ModelSpec::Switch(_) => {
            let model = common::engine::load_switch(&bundle);
            let options = DecodeOptions::from_defaults(&bundle.config.generation);
            generate(&model, &mut buffer, &[5, 9, 33, 120, 7, 1], &options)
                .unwrap()
                .tokens
        }
        ModelSpec::DecoderOnly(_) => {
            let model = common::engine::load_decoder(&bundle);
            let golden = decoder_golden(name);
            complete(
                &model,
                &mut buffer,
                &golden.cases[0].input_ids,
                &greedy_options(&golden),
                &mut |_| Ok(()),
            )
            .unwrap()
            .tokens
        }
    };
    assert!(!tokens.is_empty(), "{name}");
    let store = bundle.open_store().unwrap();
    for &id in &ids {
        assert!(store.entry(id).is_some(), "{name}: {id} in the store");
    }
}

#[test]
fn switch_mixed_width_stores_decode_exactly_and_run() {
    for name in common::SWITCH_FIXTURES {
        check_mixed_widths(name, WeightDtype::F32);
    }
    // The store of tiny-untied-e8 (MoE every second block) holds decoder block 1's experts.
    let untied = edgemoe::offline::convert::read_hf_config(&common::fixture("tiny-untied-e8"))
        .unwrap()
        .model
        .all_experts();
    assert!(untied.contains(&ExpertId {
        stack: Stack::Decoder,
        layer: 1,
        expert: 0,
    }));
}

#[test]
fn decoder_mixed_width_stores_decode_exactly_and_run() {
    // The float width is each checkpoint's own, so float experts must equal their source.
    let fixtures = [
        ("tiny-mixtral", WeightDtype::BF16),
        ("tiny-qwen2-moe", WeightDtype::F16),
        ("tiny-olmoe", WeightDtype::F32),
    ];
    assert_eq!(fixtures.map(|(name, _)| name), common::DECODER_FIXTURES);
    for (name, float) in fixtures {
        check_mixed_widths(name, float);
    }
}
