//! The golden files made with transformers: the tiny Switch fixtures' (encoder states, routes,
//! logits, greedy and beam tokens), the tiny decoder-only fixtures' (routes, logits, greedy
//! tokens and text) and the demo model's SAMSum summaries.

use edgemoe::generation::decoding::DecodeOptions;
use edgemoe::generation::sampling::Sampling;
use serde::Deserialize;

use super::fixture;

fn read<T: serde::de::DeserializeOwned>(path: &std::path::Path) -> T {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

/// `tests/fixtures/<tiny Switch fixture>/golden.json`.
#[derive(Deserialize)]
pub struct SwitchGolden {
    pub beam: BeamConfig,
    pub max_new_tokens: usize,
    pub cases: Vec<SwitchCase>,
}

#[derive(Deserialize)]
pub struct BeamConfig {
    pub num_beams: usize,
    pub length_penalty: Option<f64>,
    pub early_stopping: Option<bool>,
    pub no_repeat_ngram_size: Option<usize>,
}

#[derive(Deserialize)]
pub struct EncoderRoute {
    pub layer: usize,
    pub experts: Vec<u16>,
    pub dropped: Vec<bool>,
}

#[derive(Deserialize)]
pub struct SwitchDecoderRoute {
    pub layer: usize,
    pub experts: Vec<u16>,
}

#[derive(Deserialize)]
pub struct SwitchCase {
    pub input_ids: Vec<i64>,
    pub encoder_hidden: Vec<f32>,
    pub encoder_routes: Vec<EncoderRoute>,
    pub decoder_routes: Vec<SwitchDecoderRoute>,
    pub step_logits: Vec<Vec<f32>>,
    pub greedy: Vec<i64>,
    pub beam: Vec<i64>,
}

pub fn switch_golden(name: &str) -> SwitchGolden {
    read(&fixture(name).join("golden.json"))
}

/// Greedy decoding as the Switch golden files were made: from id 0, `max_new_tokens`, stop at
/// `</s>` (id 1), the f32 cache.
pub fn switch_greedy_options(max_new_tokens: usize) -> DecodeOptions {
    DecodeOptions {
        max_new_tokens,
        num_beams: 1,
        length_penalty: 1.0,
        early_stopping: edgemoe::config::EarlyStopping::False,
        no_repeat_ngram_size: 0,
        decoder_start_token_id: 0,
        eos_token_id: 1,
        sampling: Sampling::Greedy,
        stop_token_ids: vec![1],
        kv_cache: Default::default(),
        cancellation: Default::default(),
    }
}

/// Beam search as `golden`'s beam config says, the rest as `greedy`.
pub fn switch_beam_options(golden: &SwitchGolden, greedy: &DecodeOptions) -> DecodeOptions {
    DecodeOptions {
        num_beams: golden.beam.num_beams,
        length_penalty: golden.beam.length_penalty.unwrap_or(1.0),
        early_stopping: match golden.beam.early_stopping {
            Some(true) => edgemoe::config::EarlyStopping::True,
            _ => edgemoe::config::EarlyStopping::False,
        },
        no_repeat_ngram_size: golden.beam.no_repeat_ngram_size.unwrap_or(0),
        ..greedy.clone()
    }
}

/// `tests/fixtures/<tiny decoder-only fixture>/golden.json`.
#[derive(Deserialize)]
pub struct DecoderGolden {
    pub max_new_tokens: usize,
    pub cases: Vec<DecoderCase>,
}

#[derive(Deserialize)]
pub struct DecoderRoute {
    pub layer: usize,
    /// Per token of the call: its k experts in router order.
    pub experts: Vec<Vec<u16>>,
}

#[derive(Deserialize)]
pub struct DecoderCase {
    pub prompt: String,
    pub input_ids: Vec<i64>,
    pub routes: Vec<DecoderRoute>,
    pub step_logits: Vec<Vec<f32>>,
    pub greedy: Vec<i64>,
    pub greedy_text: String,
}

pub fn decoder_golden(name: &str) -> DecoderGolden {
    read(&fixture(name).join("golden.json"))
}

/// Greedy decoding as the decoder-only golden files were made: `max_new_tokens`, stop at id 0.
pub fn greedy_options(golden: &DecoderGolden) -> DecodeOptions {
    DecodeOptions {
        max_new_tokens: golden.max_new_tokens,
        num_beams: 1,
        length_penalty: 1.0,
        early_stopping: edgemoe::config::EarlyStopping::False,
        no_repeat_ngram_size: 0,
        decoder_start_token_id: 0,
        eos_token_id: 0,
        sampling: Sampling::Greedy,
        stop_token_ids: vec![0],
        kv_cache: Default::default(),
        cancellation: Default::default(),
    }
}

/// `tests/fixtures/samsum_greedy.json`: the demo model's greedy summaries of the first SAMSum
/// test dialogues (`tests/fixtures/make_samsum_golden.py`).
#[derive(Deserialize)]
pub struct SamsumGolden {
    pub rows: Vec<SamsumRow>,
}

#[derive(Deserialize)]
pub struct SamsumRow {
    pub id: String,
    pub source_tokens: usize,
    pub source_sha256: String,
    pub output_ids: Vec<i64>,
}

pub fn samsum_golden() -> SamsumGolden {
    read(&fixture("samsum_greedy.json"))
}

/// A path dictionary calibrated on a decoder-only fixture's golden prompts (greedy runs with
/// every expert resident), for the speculative prefetch.
pub fn golden_dictionary(
    bundle: &edgemoe::bundle::Bundle,
    model: &edgemoe::model::DecoderOnlyModel,
    golden: &DecoderGolden,
) -> edgemoe::dictionary::PathDictionary {
    use edgemoe::generation::causal::complete;
    use edgemoe::ids::Stack;
    use edgemoe::offline::calibrate::{build_dictionary, paths_of};
    let spec = &bundle.config.model;
    let store = bundle.open_store().unwrap();
    let total_experts = store.index().experts.len();
    let mut reference = edgemoe::runtime::buffer::ExpertBuffer::new(store, spec, total_experts);
    let options = greedy_options(golden);
    let layers = spec.moe_blocks(Stack::Decoder).len();
    let paths: Vec<_> = golden
        .cases
        .iter()
        .map(|case| {
            let g = complete(
                model,
                &mut reference,
                &case.input_ids,
                &options,
                &mut |_| Ok(()),
            )
            .unwrap();
            paths_of(&g.routes, 0, layers)
        })
        .collect();
    build_dictionary(&paths, 0, layers, spec.num_experts(), spec.top_k())
}
