//! Quantized expert stores: a store with mixed widths (f16, INT8, INT4, INT2) converts, loads
//! and runs, and every expert decodes to exactly the channel-wise dequantization of its source
//! weights.

mod common;

use edgemoe::bundle::Bundle;
use edgemoe::generation::decoding::DecodeOptions;
use edgemoe::generation::seq2seq::generate;
use edgemoe::ids::ExpertId;
use edgemoe::ids::Stack;
use edgemoe::model::provider::ExpertProvider;
use edgemoe::model::switch::expert_tensor_name;
use edgemoe::offline::bit_plan::BitPlan;
use edgemoe::offline::convert::{convert, ConvertOptions};
use edgemoe::quant::{dequantize_scalar, quantize, QuantBits};
use edgemoe::runtime::buffer::ExpertBuffer;
use edgemoe::store::ExpertEncoding;
use edgemoe::weights::WeightFiles;

#[test]
fn mixed_width_store_decodes_exactly_and_runs() {
    let hf = common::fixture("tiny-untied-e8");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("mixed");
    let files = WeightFiles::open_hf_dir(&hf).unwrap();
    let config = edgemoe::offline::convert::read_hf_config(&hf).unwrap();
    let ids = config.model.all_experts();
    let widths = [
        ExpertEncoding::Quant(QuantBits::Int8),
        ExpertEncoding::Quant(QuantBits::Int4),
        ExpertEncoding::Quant(QuantBits::Int2),
        ExpertEncoding::Float(edgemoe::weights::WeightDtype::F32),
    ];
    let mut plan = BitPlan::uniform(ExpertEncoding::Quant(QuantBits::Int8));
    for (i, id) in ids.iter().enumerate() {
        plan.experts.insert(*id, widths[i % widths.len()]);
    }
    convert(&ConvertOptions {
        hf_dir: hf.clone(),
        out_dir: out.clone(),
        tokenizer: Some(common::t5_tokenizer()),
        bits: plan.clone(),
        show_progress: false,
    })
    .unwrap();

    let bundle = Bundle::open(&out).unwrap();
    let spec = bundle.config.model.clone();
    let store = bundle.open_store().unwrap();
    let mut seen = std::collections::HashSet::new();
    for e in &store.index().experts {
        assert_eq!(Some(e.encoding), plan.encoding(e.id));
        seen.insert(e.encoding);
    }
    assert_eq!(seen.len(), 4, "all four widths in one store");
    let mut buffer = ExpertBuffer::new(store, &spec, 2);
    for &id in &ids {
        let weights = buffer.expert(id).unwrap();
        for (name, got) in ["wi", "wo"].into_iter().zip(weights.matrices()) {
            let shape: Vec<usize> = got.size().iter().map(|&d| d as usize).collect();
            let source = files
                .load_f32(&expert_tensor_name(id, name), &shape)
                .unwrap();
            let source = Vec::<f32>::try_from(source.flatten(0, -1)).unwrap();
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
            assert_eq!(got, expected, "{id} {name}");
        }
    }
    // And the model runs on it.
    let model = common::switch_model(&bundle);
    let options = DecodeOptions::from_defaults(&bundle.config.generation);
    let g = generate(&model, &mut buffer, &[5, 9, 33, 120, 7, 1], &options).unwrap();
    assert!(!g.tokens.is_empty());
    let id = ExpertId {
        stack: Stack::Decoder,
        layer: 1,
        expert: 0,
    };
    assert!(store_has(&bundle, id));
}

fn store_has(bundle: &Bundle, id: ExpertId) -> bool {
    bundle.open_store().unwrap().entry(id).is_some()
}
