//! Parity with Hugging Face transformers on the tiny random fixtures of every architecture, at
//! the largest and the smallest expert buffer:
//! - Switch Transformers (`tests/fixtures/make_tiny_switch.py`): router choices at every MoE
//!   layer, encoder states and logits within 1e-4, greedy and beam outputs token-identical.
//! - Mixtral, Qwen2-MoE, OLMoE (`tests/fixtures/make_tiny_decoders.py`, transformers 5.23):
//!   router top-k choices at every MoE layer for the prefill and each step, logits of the first
//!   steps within 1e-4, 24 greedy tokens and their text identical — with every expert resident
//!   and with a 2-slot buffer, prefetch (dictionary and next-expert) off and on.

mod common;

use std::sync::Arc;

use common::assert_close;
use common::golden::{
    decoder_golden, golden_dictionary, greedy_options, switch_beam_options, switch_golden,
    switch_greedy_options,
};

use edgemoe::bundle::Bundle;
use edgemoe::cache::Policy;
use edgemoe::config::ModelSpec;
use edgemoe::dictionary::PathDictionary;
use edgemoe::generation::causal::complete;
use edgemoe::generation::seq2seq::generate;
use edgemoe::ids::Stack;
use edgemoe::model::{KvFormat, LayerRoute};
use edgemoe::runtime::buffer::{BufferOptions, ExpertBuffer};
use edgemoe::runtime::predict::PredictorKind;

/// Converts fixture `name` and checks it against its golden file, whatever its architecture.
fn check_fixture(name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let bundle = Bundle::open(&common::convert_to(&common::fixture(name), dir.path())).unwrap();
    match &bundle.config.model {
        ModelSpec::Switch(_) => check_switch(name, &bundle),
        ModelSpec::DecoderOnly(_) => check_decoder(name, &bundle),
    }
}

fn check_switch(name: &str, bundle: &Bundle) {
    let golden = switch_golden(name);
    let spec = bundle.config.model.clone();
    let model = common::engine::load_switch(bundle);
    let total_experts = bundle.open_store().unwrap().index().experts.len();
    let greedy = switch_greedy_options(golden.max_new_tokens);
    let beam = switch_beam_options(&golden, &greedy);

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
            let mut state = model.start_decoder(&encoded, 1, KvFormat::F32).unwrap();
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

fn check_decoder(name: &str, bundle: &Bundle) {
    let golden = decoder_golden(name);
    let spec = bundle.config.model.clone();
    let decoder = spec.as_decoder().unwrap().clone();
    let model = common::engine::load_decoder(bundle);
    let tokenizer = bundle.tokenizer().unwrap();
    let total_experts = bundle.open_store().unwrap().index().experts.len();
    let options = greedy_options(&golden);
    assert_eq!(bundle.config.generation.stop_token_ids, vec![0]);

    // A dictionary calibrated on the golden prompts drives the speculative prefetch.
    let dictionary: Arc<PathDictionary> = Arc::new(golden_dictionary(bundle, &model, &golden));
    assert_eq!(
        dictionary.decoder.tokens() as usize,
        golden
            .cases
            .iter()
            .map(|c| c.input_ids.len() + c.greedy.len() - 1)
            .sum::<usize>()
    );

    for (slots, prefetch) in [
        (total_experts, false),
        (2, false),
        (total_experts, true),
        (2, true),
    ] {
        let mut buffer = ExpertBuffer::with_options(
            bundle.open_store().unwrap(),
            &spec,
            &BufferOptions {
                slots,
                policy: Policy::Edgemoe,
                prefetch,
                prefetch_cap_bytes: u64::MAX / 2,
                predictor: PredictorKind::Both,
                stand_in: None,
            },
            prefetch.then(|| dictionary.clone()),
        )
        .unwrap();
        for (i, case) in golden.cases.iter().enumerate() {
            let what = format!("{name} case {i}, {slots} slots, prefetch {prefetch}");
            assert_eq!(
                tokenizer.encode_all(&case.prompt).unwrap(),
                case.input_ids,
                "{what}: prompt ids"
            );
            let mut streamed = Vec::new();
            let g = complete(&model, &mut buffer, &case.input_ids, &options, &mut |t| {
                streamed.push(t);
                Ok(())
            })
            .unwrap();
            assert_eq!(g.tokens, case.greedy, "{what}: greedy tokens");
            assert_eq!(streamed, g.tokens, "{what}: streamed tokens");
            assert!(g.tokens.len() >= 20);
            assert_eq!(tokenizer.decode(&g.tokens).unwrap(), case.greedy_text);

            // Router choices: the prefill (one k-tuple per prompt token), then each step.
            assert_eq!(g.routes.len(), case.routes.len(), "{what}: router calls");
            for (call, (got, want)) in g.routes.iter().zip(&case.routes).enumerate() {
                assert_eq!(got.stack, Stack::Decoder);
                assert_eq!(got.layer, want.layer, "{what}: call {call}");
                assert_eq!(got.k, decoder.top_k);
                let flat: Vec<u16> = want.experts.iter().flatten().copied().collect();
                assert_eq!(got.experts, flat, "{what}: router call {call}");
            }
            assert_eq!(g.routes[0].tokens(), case.input_ids.len());

            // Logits after the prompt and after each of the first greedy tokens.
            let mut cache = model.new_cache(KvFormat::F32);
            let mut feed = case.input_ids.clone();
            for (step, want) in case.step_logits.iter().enumerate() {
                let logits = model
                    .forward(&feed, &mut cache, &mut buffer, &mut Vec::new())
                    .unwrap();
                let got = Vec::<f32>::try_from(&logits).unwrap();
                assert_close(&format!("{what}: logits at step {step}"), &got, want);
                feed = vec![case.greedy[step]];
            }
        }
        // The prompt fed whole, in two pieces (the second attends over a cache the first
        // filled) and one token at a time (each attends over the cache alone): the same logits.
        for (i, case) in golden.cases.iter().enumerate() {
            let ids = &case.input_ids;
            let half = ids.len() / 2;
            for pieces in [vec![&ids[..half], &ids[half..]], ids.chunks(1).collect()] {
                let what = format!("{name} case {i}, prompt in {} pieces", pieces.len());
                let mut cache = model.new_cache(KvFormat::F32);
                let mut logits = None;
                for piece in pieces {
                    logits = Some(
                        model
                            .forward(piece, &mut cache, &mut buffer, &mut Vec::new())
                            .unwrap(),
                    );
                }
                let got = Vec::<f32>::try_from(&logits.unwrap()).unwrap();
                assert_close(&what, &got, &case.step_logits[0]);
            }
        }
        let stats = buffer.stats();
        assert_eq!(stats.hits + stats.misses, stats.accesses);
        if slots == 2 {
            assert!(stats.misses > 0, "{name}: a 2-slot buffer misses");
        }
        if prefetch {
            assert!(stats.prefetch.issued > 0, "{name}: prefetch issued reads");
            assert!(stats.dictionary.predictions > 0);
        }
    }
}

#[test]
fn every_tiny_fixture_is_listed_with_its_architecture() {
    let mut on_disk: Vec<String> = std::fs::read_dir(common::fixture(""))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("tiny-"))
        .collect();
    on_disk.sort();
    let mut listed: Vec<String> = common::SWITCH_FIXTURES
        .iter()
        .chain(&common::DECODER_FIXTURES)
        .map(|n| n.to_string())
        .collect();
    listed.sort();
    assert_eq!(on_disk, listed, "tests/common/mod.rs lists every fixture");
    for name in common::SWITCH_FIXTURES {
        let config = edgemoe::offline::convert::read_hf_config(&common::fixture(name)).unwrap();
        assert!(
            config.model.as_decoder().is_none(),
            "{name} is a Switch model"
        );
    }
    for name in common::DECODER_FIXTURES {
        let config = edgemoe::offline::convert::read_hf_config(&common::fixture(name)).unwrap();
        assert!(
            config.model.as_decoder().is_some(),
            "{name} is decoder-only"
        );
    }
}

#[test]
fn switch_tied_embeddings_four_experts_with_capacity_drops() {
    check_fixture("tiny-tied-e4");
}

#[test]
fn switch_untied_sharded_f16_sparse_step_two_eight_experts() {
    check_fixture("tiny-untied-e8");
}

#[test]
fn mixtral_top2_renormalised_gqa_sliding_window_bf16() {
    check_fixture("tiny-mixtral");
}

#[test]
fn qwen2_moe_top3_shared_expert_biases_dense_layer_sharded_f16() {
    check_fixture("tiny-qwen2-moe");
}

#[test]
fn olmoe_qk_norm_clip_tied_fused_experts() {
    check_fixture("tiny-olmoe");
}
