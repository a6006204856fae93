//! Resident weights at a chosen width (`convert --resident`) and experts computed in their
//! stored encoding.
//!
//! - f16 / bf16: against `tests/fixtures/half_golden.json` (transformers on the same weights
//!   rounded to f16/bf16, computed in f32; `make_half_golden.py`): identical greedy tokens and
//!   logits within the golden tolerance, while the unrounded model's logits are measurably
//!   different (so the rounding is really applied, and really computed on).
//! - INT8: the resident file holds INT8 codes with per-row scales, the engine holds them so
//!   (resident bytes about a quarter of f32) and the model stays close to f32.

mod common;

use common::golden::{decoder_golden, greedy_options, switch_golden, switch_greedy_options};
use edgemoe::bundle::Bundle;
use edgemoe::config::ModelSpec;
use edgemoe::generation::causal::complete;
use edgemoe::generation::seq2seq::generate;
use edgemoe::model::KvFormat;
use edgemoe::offline::bit_plan::BitPlan;
use edgemoe::offline::convert::ResidentWidth;
use edgemoe::runtime::buffer::ExpertBuffer;
use edgemoe::store::ExpertEncoding;
use edgemoe::weights::WeightDtype;

#[derive(serde::Deserialize)]
struct HalfGolden {
    entries: Vec<Entry>,
}

#[derive(serde::Deserialize)]
struct Entry {
    model: String,
    dtype: String,
    experts: String,
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    input_ids: Vec<i64>,
    greedy: Vec<i64>,
    step_logits: Vec<Vec<f32>>,
}

/// Greedy ids and the logits of the first steps along the greedy path of `bundle` on `case`.
fn run(bundle: &Bundle, case: &Case) -> (Vec<i64>, Vec<Vec<f32>>) {
    let spec = bundle.config.model.clone();
    let experts = bundle.open_store().unwrap().index().experts.len();
    let mut buffer = ExpertBuffer::new(bundle.open_store().unwrap(), &spec, experts);
    let steps = case.step_logits.len();
    match &spec {
        ModelSpec::Switch(_) => {
            let model = common::engine::load_switch(bundle);
            let options = switch_greedy_options(case.greedy.len().max(24));
            let tokens = generate(&model, &mut buffer, &case.input_ids, &options)
                .unwrap()
                .tokens;
            let encoded = model
                .encode(&case.input_ids, &mut buffer, &mut Vec::new())
                .unwrap();
            let mut state = model.start_decoder(&encoded, 1, KvFormat::F32).unwrap();
            let mut token = 0;
            let mut logits = Vec::new();
            for step in 0..steps {
                let l = model
                    .decode_step(&[token], &mut state, &mut buffer, &mut Vec::new())
                    .unwrap();
                logits.push(Vec::<f32>::try_from(l.flatten(0, -1)).unwrap());
                token = case.greedy[step];
            }
            (tokens, logits)
        }
        ModelSpec::DecoderOnly(_) => {
            let model = common::engine::load_decoder(bundle);
            let mut options = greedy_options(&decoder_golden("tiny-olmoe"));
            options.max_new_tokens = case.greedy.len().max(24);
            let tokens = complete(&model, &mut buffer, &case.input_ids, &options, &mut |_| {
                Ok(())
            })
            .unwrap()
            .tokens;
            let mut cache = model.new_cache(KvFormat::F32);
            let mut feed = case.input_ids.clone();
            let mut logits = Vec::new();
            for step in 0..steps {
                let l = model
                    .forward(&feed, &mut cache, &mut buffer, &mut Vec::new())
                    .unwrap();
                logits.push(Vec::<f32>::try_from(&l).unwrap());
                feed = vec![case.greedy[step]];
            }
            (tokens, logits)
        }
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The unrounded model's logits for the first steps of `case` (the fixture's own golden).
fn f32_golden_logits(model: &str, input_ids: &[i64]) -> Vec<Vec<f32>> {
    if model == "tiny-olmoe" {
        let golden = decoder_golden(model);
        let case = golden
            .cases
            .iter()
            .find(|c| c.input_ids == input_ids)
            .unwrap();
        case.step_logits.clone()
    } else {
        let golden = switch_golden(model);
        let case = golden
            .cases
            .iter()
            .find(|c| c.input_ids == input_ids)
            .unwrap();
        case.step_logits.clone()
    }
}

#[test]
fn f16_and_bf16_resident_weights_match_transformers_on_rounded_weights() {
    let golden: HalfGolden = serde_json::from_str(
        &std::fs::read_to_string(common::fixture("half_golden.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        golden.entries.len(),
        8,
        "2 models × 2 dtypes × 2 expert widths"
    );
    for entry in &golden.entries {
        let (resident, dtype) = match entry.dtype.as_str() {
            "f16" => (ResidentWidth::F16, WeightDtype::F16),
            "bf16" => (ResidentWidth::Bf16, WeightDtype::BF16),
            other => panic!("dtype {other}"),
        };
        let bits = match entry.experts.as_str() {
            "rounded" => BitPlan::uniform(ExpertEncoding::Float(dtype)),
            _ => BitPlan::default(),
        };
        let dir = tempfile::tempdir().unwrap();
        let out = common::convert_at(&common::fixture(&entry.model), dir.path(), bits, resident);
        let bundle = Bundle::open(&out).unwrap();
        assert_eq!(bundle.config.resident_width, entry.dtype);
        for (i, case) in entry.cases.iter().enumerate() {
            let what = format!(
                "{} {} experts {} case {i}",
                entry.model, entry.dtype, entry.experts
            );
            let (tokens, logits) = run(&bundle, case);
            assert_eq!(tokens, case.greedy, "{what}: greedy tokens");
            let unrounded = f32_golden_logits(&entry.model, &case.input_ids);
            let mut rounding_effect = 0f32;
            for (step, (got, want)) in logits.iter().zip(&case.step_logits).enumerate() {
                common::assert_close(&format!("{what}: logits at step {step}"), got, want);
                rounding_effect = rounding_effect.max(max_abs_diff(got, &unrounded[step]));
            }
            // Rounding moves the logits by 6e-4 to 1e-2 here: well above the tolerance.
            assert!(
                rounding_effect > 3.0 * common::TOLERANCE,
                "{what}: logits equal the unrounded model's ({rounding_effect}): not rounded?"
            );
        }
    }
}

/// How each integer resident width is stored, how small it must be, and how far its logits may
/// stray from f32's (as a share of the largest f32 logit).
const INTEGER_WIDTHS: [(ResidentWidth, safetensors::Dtype, f64, f32); 2] = [
    // INT8 channel-wise error is ~0.5%.
    (ResidentWidth::Int8, safetensors::Dtype::I8, 0.3, 0.1),
    // INT4 (two codes a byte) is 16× coarser: measured up to 0.51× on tiny-olmoe's random
    // weights (0.15× tiny-tied-e4, 0.24× tiny-qwen2-moe).
    (ResidentWidth::Int4, safetensors::Dtype::U8, 0.2, 0.6),
];

#[test]
fn integer_resident_weights_are_held_as_stored_and_stay_close_to_f32() {
    for name in ["tiny-tied-e4", "tiny-olmoe", "tiny-qwen2-moe"] {
        let hf = common::fixture(name);
        let dir32 = tempfile::tempdir().unwrap();
        let b32 = Bundle::open(&common::convert_to(&hf, dir32.path())).unwrap();
        let case = Case {
            input_ids: match &b32.config.model {
                ModelSpec::Switch(_) => switch_golden(name).cases[0].input_ids.clone(),
                ModelSpec::DecoderOnly(_) => decoder_golden(name).cases[0].input_ids.clone(),
            },
            greedy: vec![0; 2],
            step_logits: vec![vec![]; 2],
        };
        let (_, l32) = run(&b32, &case);
        let r32 = b32.load_model(tch::Device::Cpu).unwrap().resident_bytes();
        let mut logits_by_width = Vec::new();
        for (width, dtype, max_bytes_ratio, tolerance) in INTEGER_WIDTHS {
            let dir = tempfile::tempdir().unwrap();
            let out = common::convert_at(&hf, dir.path(), BitPlan::default(), width);
            let bundle = Bundle::open(&out).unwrap();
            assert_eq!(bundle.config.resident_width, width.name());

            // The file holds the integer matrices with their scales; the model holds them so.
            let bytes = std::fs::read(out.join("resident.safetensors")).unwrap();
            let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let matrices: Vec<String> = file
                .tensors()
                .into_iter()
                .filter(|(_, t)| t.dtype() == dtype)
                .map(|(n, _)| n)
                .collect();
            assert!(matrices.len() > 4, "{name}: {width:?} matrices");
            for n in &matrices {
                let scales = file.tensor(&format!("{n}.scales")).unwrap();
                assert_eq!(scales.dtype(), safetensors::Dtype::F32);
            }
            let held = bundle
                .load_model(tch::Device::Cpu)
                .unwrap()
                .resident_bytes();
            assert!(
                (held as f64) < max_bytes_ratio * r32 as f64,
                "{name}: {held} resident bytes at {width:?} vs {r32} at f32"
            );

            // Close to f32, not equal to it.
            let (_, logits) = run(&bundle, &case);
            for (a, b) in l32.iter().zip(&logits) {
                let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
                let diff = max_abs_diff(a, b);
                assert!(diff > 0.0, "{name}: {width:?} logits identical to f32");
                assert!(
                    diff < tolerance * scale.max(0.1),
                    "{name}: {width:?} logits differ by {diff} (scale {scale})"
                );
            }
            logits_by_width.push(logits);
        }
        // INT4 is computed as INT4, not as the INT8 path: its error is its own.
        let int8_vs_int4 = max_abs_diff(&logits_by_width[0][0], &logits_by_width[1][0]);
        let int8_vs_f32 = max_abs_diff(&logits_by_width[0][0], &l32[0]);
        assert!(
            int8_vs_int4 > 2.0 * int8_vs_f32,
            "{name}: INT4 logits {int8_vs_int4} from INT8's, INT8 {int8_vs_f32} from f32"
        );
    }
}
