//! Parity with Hugging Face transformers on tiny random Switch models (see
//! `tests/fixtures/make_tiny_switch.py`): router choices at every MoE layer, encoder states and
//! logits within 1e-4, greedy and beam outputs token-identical, at the largest and the smallest
//! expert buffer.

mod common;

use common::assert_close;

use edgemoe::bundle::Bundle;
use edgemoe::config::EarlyStopping;
use edgemoe::generation::decoding::DecodeOptions;
use edgemoe::generation::sampling::Sampling;
use edgemoe::generation::seq2seq::generate;
use edgemoe::ids::Stack;
use edgemoe::model::LayerRoute;
use edgemoe::runtime::buffer::ExpertBuffer;
use serde::Deserialize;

#[derive(Deserialize)]
struct Golden {
    beam: BeamConfig,
    max_new_tokens: usize,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct BeamConfig {
    num_beams: usize,
    length_penalty: Option<f64>,
    early_stopping: Option<bool>,
    no_repeat_ngram_size: Option<usize>,
}

#[derive(Deserialize)]
struct EncoderRoute {
    layer: usize,
    experts: Vec<u16>,
    dropped: Vec<bool>,
}

#[derive(Deserialize)]
struct DecoderRoute {
    layer: usize,
    experts: Vec<u16>,
}

#[derive(Deserialize)]
struct Case {
    input_ids: Vec<i64>,
    encoder_hidden: Vec<f32>,
    encoder_routes: Vec<EncoderRoute>,
    decoder_routes: Vec<DecoderRoute>,
    step_logits: Vec<Vec<f32>>,
    greedy: Vec<i64>,
    beam: Vec<i64>,
}

fn check_fixture(name: &str) {
    let golden: Golden = serde_json::from_str(
        &std::fs::read_to_string(common::fixture(name).join("golden.json")).unwrap(),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let bundle_dir = common::convert_to(&common::fixture(name), dir.path());
    let bundle = Bundle::open(&bundle_dir).unwrap();
    let spec = bundle.config.model.clone();
    let model = common::switch_model(&bundle);
    let total_experts = bundle.open_store().unwrap().index().experts.len();
    let greedy = DecodeOptions {
        max_new_tokens: golden.max_new_tokens,
        num_beams: 1,
        length_penalty: 1.0,
        early_stopping: EarlyStopping::False,
        no_repeat_ngram_size: 0,
        decoder_start_token_id: 0,
        eos_token_id: 1,
        sampling: Sampling::Greedy,
        stop_token_ids: vec![1],
    };
    let beam = DecodeOptions {
        num_beams: golden.beam.num_beams,
        length_penalty: golden.beam.length_penalty.unwrap_or(1.0),
        early_stopping: match golden.beam.early_stopping {
            Some(true) => EarlyStopping::True,
            _ => EarlyStopping::False,
        },
        no_repeat_ngram_size: golden.beam.no_repeat_ngram_size.unwrap_or(0),
        ..greedy.clone()
    };

    for slots in [total_experts, 1] {
        let mut buffer = ExpertBuffer::new(bundle.open_store().unwrap(), &spec, slots);
        for (i, case) in golden.cases.iter().enumerate() {
            let what = format!("{name} case {i} with {slots} slots");
            // Encoder states and routing.
            let mut routes = Vec::new();
            let encoded = model
                .encode(&case.input_ids, &mut buffer, &mut routes)
                .unwrap();
            let hidden = Vec::<f32>::try_from(encoded.flatten(0, -1)).unwrap();
            assert_close(
                &format!("{what}: encoder states"),
                &hidden,
                &case.encoder_hidden,
            );
            assert_eq!(
                routes.len(),
                case.encoder_routes.len(),
                "{what}: encoder MoE layers"
            );
            for (got, want) in routes.iter().zip(&case.encoder_routes) {
                assert_eq!(got.layer, want.layer, "{what}");
                assert_eq!(
                    got.experts, want.experts,
                    "{what}: encoder block {} experts",
                    want.layer
                );
                assert_eq!(
                    got.dropped, want.dropped,
                    "{what}: encoder block {} drops",
                    want.layer
                );
            }

            // Greedy tokens and decoder routing at every step.
            let generation = generate(&model, &mut buffer, &case.input_ids, &greedy).unwrap();
            assert_eq!(generation.tokens, case.greedy, "{what}: greedy tokens");
            assert!(generation.tokens.len() >= 20);
            let decoder: Vec<&LayerRoute> = generation
                .routes
                .iter()
                .filter(|r| r.stack == Stack::Decoder)
                .collect();
            assert_eq!(
                decoder.len(),
                case.decoder_routes.len(),
                "{what}: decoder router calls"
            );
            for (step, (got, want)) in decoder.iter().zip(&case.decoder_routes).enumerate() {
                assert_eq!(got.layer, want.layer, "{what}: call {step}");
                assert_eq!(
                    got.experts, want.experts,
                    "{what}: decoder router call {step}"
                );
            }

            // Logits of the first steps along the greedy path.
            let mut state = model.start_decoder(&encoded, 1).unwrap();
            let mut token = 0;
            for (step, want) in case.step_logits.iter().enumerate() {
                let logits = model
                    .decode_step(&[token], &mut state, &mut buffer, &mut Vec::new())
                    .unwrap();
                let got = Vec::<f32>::try_from(logits.flatten(0, -1)).unwrap();
                assert_close(&format!("{what}: logits at step {step}"), &got, want);
                token = case.greedy[step];
            }

            // Beam search.
            let generation = generate(&model, &mut buffer, &case.input_ids, &beam).unwrap();
            assert_eq!(generation.tokens, case.beam, "{what}: beam tokens");
        }
        let stats = buffer.stats();
        assert_eq!(stats.hits + stats.misses, stats.accesses);
        if slots == 1 {
            assert!(stats.misses > 0);
        }
    }
}

#[test]
fn tied_embeddings_four_experts_with_capacity_drops() {
    check_fixture("tiny-tied-e4");
}

#[test]
fn untied_sharded_f16_sparse_step_two_eight_experts() {
    check_fixture("tiny-untied-e8");
}
