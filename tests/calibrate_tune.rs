//! The once-per-model work on a bundle, for every architecture: `calibrate` writes the
//! activation-path dictionary and changes speed, not tokens (the demo Switch model and a
//! decoder-only fixture still give their golden outputs on a small buffer); `tune-bits` plans
//! expert widths within a loss bound and the plan converts to exactly those widths.

mod common;

use common::cli::{run, stdout};
use common::golden::{decoder_golden, samsum_golden};

use edgemoe::bundle::Bundle;
use edgemoe::offline::bit_plan::BitPlan;
use edgemoe::quant::QuantBits;
use edgemoe::store::ExpertEncoding;

#[test]
fn calibrating_a_decoder_bundle_changes_speed_not_tokens() {
    let golden = decoder_golden("tiny-mixtral");
    let dir = tempfile::tempdir().unwrap();
    let bundle = common::convert_to(&common::fixture("tiny-mixtral"), dir.path());
    let b = bundle.to_str().unwrap();
    let case = &golden.cases[1];
    let corpus = dir.path().join("corpus.jsonl");
    let lines: Vec<String> = golden
        .cases
        .iter()
        .chain(&golden.cases)
        .map(|c| serde_json::json!({ "document": c.prompt }).to_string())
        .collect();
    std::fs::write(&corpus, lines.join("\n")).unwrap();
    let report = stdout(&run(
        &[
            "calibrate",
            "--model",
            b,
            "--data",
            corpus.to_str().unwrap(),
        ],
        None,
    ));
    assert!(report.contains("recall@k"), "{report}");
    assert!(bundle.join("paths.bin").exists());
    let out = run(
        &[
            "generate",
            "--model",
            b,
            "--prompt",
            &case.prompt,
            "--buffer-experts",
            "2",
        ],
        None,
    );
    assert_eq!(stdout(&out), format!("{}\n", case.greedy_text));
}

#[test]
fn calibrating_a_switch_bundle_changes_speed_not_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = common::convert_to(&common::demo_checkpoint(), dir.path());
    let b = bundle.to_str().unwrap();
    let report = stdout(&run(
        &[
            "calibrate",
            "--model",
            b,
            "--data",
            common::samsum("train").to_str().unwrap(),
            "--limit",
            "4",
            "--json",
            dir.path().join("report.json").to_str().unwrap(),
        ],
        None,
    ));
    assert!(report.contains("recall@k"), "{report}");
    assert!(bundle.join("paths.bin").exists());
    // Passes: one encoder pass per calibration document (3 of the 4, one held out), a decoder
    // pass per step; the demo decoder mostly keeps its experts from one step to the next.
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("report.json")).unwrap())
            .unwrap();
    assert_eq!(json["encoder"]["calibration_passes"], 3, "{json}");
    let steps = json["decoder"]["calibration_passes"].as_u64().unwrap();
    assert!(steps > 3 * 3, "{json}");
    let repeats = json["decoder"]["pass_repeat_share"].as_f64().unwrap();
    assert!(repeats > 0.0 && repeats < 1.0, "{json}");
    // Each predictor's precision and recall per MoE layer, on the held-out document: printed,
    // and in the report's `predictors[]`.
    for column in ["dictionary P / R", "gate P / R", "both P / R"] {
        assert!(report.contains(column), "{column}: {report}");
    }
    assert_predictor_scores(&json["predictors"], "calibrate --json");
    let first = std::fs::read_to_string(common::samsum("test")).unwrap();
    let stats = dir.path().join("stats.json");
    let out = run(
        &[
            "summarize",
            "--model",
            b,
            "--buffer-experts",
            "6",
            "--predictor",
            "both",
            "--stats-json",
            stats.to_str().unwrap(),
            "-q",
        ],
        Some(first.lines().next().unwrap()),
    );
    assert!(out.status.success(), "{}", common::cli::stderr(&out));
    let stats: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    assert_eq!(stats["predictor"], "both");
    assert_predictor_scores(&stats["predictors"], "summarize --stats-json");
    let out = run(
        &["summarize", "--model", b, "--buffer-experts", "6", "--ids"],
        Some(first.lines().next().unwrap()),
    );
    let printed: Vec<i64> = stdout(&out)
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect();
    assert_eq!(printed, samsum_golden().rows[0].output_ids);
}

/// `predictors[]` (of `calibrate --json` or `--stats-json`) scores every predictor on MoE
/// layers of both stacks (the gate has no layer before the first MoE block to look ahead
/// from), and each entry's precision and recall are its own counts' ratios.
fn assert_predictor_scores(scores: &serde_json::Value, what: &str) {
    let scores = scores
        .as_array()
        .unwrap_or_else(|| panic!("{what}: {scores}"));
    for predictor in ["dictionary", "gate", "both"] {
        for stack in ["encoder", "decoder"] {
            assert!(
                scores
                    .iter()
                    .any(|s| s["predictor"] == predictor && s["stack"] == stack),
                "{what}: no {predictor} scores for the {stack}: {scores:?}"
            );
        }
    }
    for s in scores {
        let count = |key: &str| s[key].as_u64().unwrap_or_else(|| panic!("{what}: {s}")) as f64;
        let (predicted, chosen, correct) = (count("predicted"), count("chosen"), count("correct"));
        assert!(
            count("calls") > 0.0 && correct <= predicted.min(chosen),
            "{what}: {s}"
        );
        let ratio = |key: &str, of: f64| {
            let value = s[key].as_f64().unwrap_or_else(|| panic!("{what}: {s}"));
            let expected = if of > 0.0 { correct / of } else { 0.0 };
            assert!((value - expected).abs() < 1e-9, "{what}: {key} of {s}");
        };
        ratio("precision", predicted);
        ratio("recall", chosen);
    }
}

#[test]
fn tune_bits_plans_swiglu_experts() {
    let dir = tempfile::tempdir().unwrap();
    let golden = decoder_golden("tiny-mixtral");
    let bundle = common::convert_to(&common::fixture("tiny-mixtral"), &dir.path().join("fp"));
    let data = dir.path().join("val.jsonl");
    let lines: Vec<String> = golden
        .cases
        .iter()
        .map(|c| serde_json::json!({"document": c.prompt, "summary": c.greedy_text}).to_string())
        .collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    let plan = dir.path().join("plan.json");
    let out = run(
        &[
            "tune-bits",
            "--model",
            bundle.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--max-loss",
            "10%",
            "--max-new-tokens",
            "12",
            "--out",
            plan.to_str().unwrap(),
        ],
        None,
    );
    let text = stdout(&out);
    assert!(text.contains("ROUGE-2"), "{text}");
    let report: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("plan.report.json")).unwrap(),
    )
    .unwrap();
    let tune = &report["tune"];
    // All-INT2 changes the greedy tokens of this model (22.7% proxy loss), INT4 does not: the
    // bounds are INT4/INT2 and every one of the 16 experts (one blob each) gets an importance.
    assert_eq!(tune["upper"], "int4", "{report}");
    assert_eq!(tune["lower"], "int2", "{report}");
    assert!(
        tune["uniform_loss"]["int2"].as_f64().unwrap() > 0.1,
        "{report}"
    );
    assert_eq!(tune["importance"].as_object().unwrap().len(), 16);
    assert!(tune["plan_loss"].as_f64().unwrap() <= 0.1);
    let loaded = BitPlan::load(&plan).unwrap();
    let planned = common::convert_with(
        &common::fixture("tiny-mixtral"),
        &dir.path().join("planned"),
        loaded.clone(),
    );
    let store = Bundle::open(&planned).unwrap().open_store().unwrap();
    let lower = store
        .index()
        .experts
        .iter()
        .filter(|e| e.encoding == ExpertEncoding::Quant(QuantBits::Int2))
        .count();
    assert_eq!(lower as u64, tune["k"].as_u64().unwrap());
    for e in &store.index().experts {
        assert_eq!(Some(e.encoding), loaded.encoding(e.id));
    }
}

/// `tune-bits` reuses its measurement cache only for the model, data and options it was made
/// with: the decoder fixtures share one tokenizer, so the same data tokenizes to the same
/// inputs for each, and a cache keyed on the inputs alone handed one model's measurements to
/// another (tiny-qwen2-moe was tuned with tiny-mixtral's losses).
#[test]
fn tune_bits_cache_is_keyed_on_the_model_and_options() {
    let dir = tempfile::tempdir().unwrap();
    let golden = decoder_golden("tiny-mixtral");
    let data = dir.path().join("val.jsonl");
    let lines: Vec<String> = golden
        .cases
        .iter()
        .map(|c| serde_json::json!({"document": c.prompt, "summary": c.greedy_text}).to_string())
        .collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    let plan = dir.path().join("plan.json");
    let cache = dir.path().join("plan.measurements.json");
    let tune = |bundle: &std::path::Path, new_tokens: &str| {
        stdout(&run(
            &[
                "tune-bits",
                "--model",
                bundle.to_str().unwrap(),
                "--data",
                data.to_str().unwrap(),
                "--max-loss",
                "10%",
                "--max-new-tokens",
                new_tokens,
                "--out",
                plan.to_str().unwrap(),
            ],
            None,
        ))
    };
    let int8_loss = || -> f64 {
        let report: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join("plan.report.json")).unwrap(),
        )
        .unwrap();
        report["tune"]["uniform_loss"]["int8"].as_f64().unwrap()
    };
    // Every cached loss replaced by a value no measurement gives: a reuse shows in the report.
    let poison = || {
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&cache).unwrap()).unwrap();
        for loss in json["losses"].as_object_mut().unwrap().values_mut() {
            *loss = serde_json::json!(0.4321);
        }
        std::fs::write(&cache, json.to_string()).unwrap();
    };
    // Both with f32 experts, so nothing but the model tells them apart.
    let f32 = || BitPlan::uniform(ExpertEncoding::Float(edgemoe::weights::WeightDtype::F32));
    let first = common::convert_with(
        &common::fixture("tiny-mixtral"),
        &dir.path().join("a"),
        f32(),
    );
    let second = common::convert_with(
        &common::fixture("tiny-qwen2-moe"),
        &dir.path().join("b"),
        f32(),
    );
    tune(&first, "8");
    poison();
    // The same model, data and options: the cache is used (and says so).
    let text = tune(&first, "8");
    assert!(text.contains("reused"), "{text}");
    assert_eq!(int8_loss(), 0.4321);
    // Another model with the same tokenizer and data: measured afresh.
    poison();
    let text = tune(&second, "8");
    assert!(!text.contains("reused"), "{text}");
    assert_ne!(int8_loss(), 0.4321);
    // Another decoding length: measured afresh.
    poison();
    tune(&second, "6");
    assert_ne!(int8_loss(), 0.4321);
}
