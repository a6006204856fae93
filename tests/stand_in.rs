//! Stand-ins (`--stand-in`): the low-bit copies are the store's experts (bit for bit when the
//! store is already at that width, within the quantization step otherwise); a decode step that
//! misses computes with them and the full expert is read for later (on an INT2 store with INT2
//! stand-ins every token equals a run without them, so the copy used is the right expert); the
//! encoder and a prompt prefill never use them; their bytes come out of the budget; a recorded
//! trace replays to the live hit counts; wrong flags are usage errors.

mod common;

use std::path::{Path, PathBuf};

use edgemoe::bundle::Bundle;
use edgemoe::cache::replay::replay;
use edgemoe::cache::trace::read_trace;
use edgemoe::cache::Policy;
use edgemoe::ids::Stack;
use edgemoe::offline::bit_plan::BitPlan;
use edgemoe::quant::QuantBits;
use edgemoe::runtime::codec::stored_matrices;
use edgemoe::runtime::stand_in::{stand_in_experts, StandIns};
use edgemoe::store::{AlignedBuf, ExpertEncoding};
use serde_json::Value;

fn int2() -> BitPlan {
    BitPlan::uniform(ExpertEncoding::Quant(QuantBits::Int2))
}

/// Every matrix of every expert, dequantized to f32, in blob order.
fn dequantized(entry: &edgemoe::store::ExpertEntry, bytes: &[u8]) -> Vec<(usize, usize, Vec<f32>)> {
    stored_matrices(entry, bytes)
        .unwrap()
        .into_iter()
        .map(|m| {
            let mut values = vec![0f32; m.rows() * m.cols()];
            m.dequantize_rows(0, m.rows(), &mut values).unwrap();
            (m.rows(), m.cols(), values)
        })
        .collect()
}

#[test]
fn stand_ins_are_the_stores_decoder_experts() {
    for fixture in ["tiny-untied-e8", "tiny-mixtral"] {
        for (bits, stand_in) in [
            (int2(), QuantBits::Int2),
            (BitPlan::default(), QuantBits::Int4),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let bundle = Bundle::open(&common::convert_with(
                &common::fixture(fixture),
                dir.path(),
                bits,
            ))
            .unwrap();
            let store = bundle.open_store().unwrap();
            let ids = stand_in_experts(&store);
            assert!(!ids.is_empty() && ids.iter().all(|id| id.stack == Stack::Decoder));
            let decoder_experts = store
                .index()
                .experts
                .iter()
                .filter(|e| e.id.stack == Stack::Decoder)
                .count();
            assert_eq!(ids.len(), decoder_experts, "{fixture}");
            let layout = bundle.config.model.expert_layout();
            let copies = StandIns::build(&store, &layout, &ids, stand_in).unwrap();
            assert_eq!(copies.len(), ids.len());
            let mut slot = AlignedBuf::new(store.max_padded_expert_bytes() as usize);
            for &id in &ids {
                let entry = store.entry(id).unwrap().clone();
                store.read_expert(id, slot.as_mut_slice()).unwrap();
                let full = dequantized(&entry, slot.as_slice());
                let weights = copies.weights(id).unwrap();
                let copy: Vec<(usize, usize, Vec<f32>)> = weights
                    .matrices()
                    .iter()
                    .map(|w| {
                        let m = w.stored().expect("stand-ins are stored matrices");
                        let mut values = vec![0f32; m.rows() * m.cols()];
                        m.dequantize_rows(0, m.rows(), &mut values).unwrap();
                        (m.rows(), m.cols(), values)
                    })
                    .collect();
                assert_eq!(full.len(), copy.len());
                for ((rows, cols, want), (r, c, got)) in full.iter().zip(&copy) {
                    assert_eq!((rows, cols), (r, c), "{fixture} {id}");
                    if stand_in == QuantBits::Int2 {
                        // An INT2 store requantized to INT2 is itself.
                        assert_eq!(want, got, "{fixture} {id}");
                        continue;
                    }
                    // INT4 of an f32 matrix: within half a step of its row's scale.
                    for (row_want, row_got) in want.chunks(*cols).zip(got.chunks(*cols)) {
                        let step = row_want.iter().fold(0f32, |m, w| m.max(w.abs())) / 7.0;
                        for (w, g) in row_want.iter().zip(row_got) {
                            assert!(
                                (w - g).abs() <= step * 0.5 + 1e-6,
                                "{fixture} {id}: {g} for {w} (step {step})"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// A run's statistics: `edgemoe ARGS --stats-json FILE` must succeed.
fn run_stats(args: &[&str], dir: &Path, name: &str) -> (String, Value) {
    let stats = dir.join(format!("{name}.json"));
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["--stats-json", stats.to_str().unwrap(), "-q", "--ids"]);
    let out = common::cli::run(&all, None);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        common::cli::stderr(&out)
    );
    let json = serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    (common::cli::stdout(&out), json)
}

/// Slow emulated storage and a tiny buffer: nearly every decoder access misses, and each read
/// takes longer than a tiny model's decode step.
const SLOW: [&str; 6] = [
    "--storage",
    "emulate",
    "--profile",
    "rpi4-sd",
    "--buffer-experts",
    "2",
];

fn documents(dir: &Path) -> PathBuf {
    let path = dir.join("documents.jsonl");
    let lines: Vec<String> = common::samsum_dialogues("test", 4)
        .into_iter()
        .map(|d| serde_json::json!({ "dialogue": d }).to_string())
        .collect();
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

#[test]
fn int2_stand_ins_of_an_int2_switch_store_change_no_token_and_the_full_expert_comes_later() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = common::convert_with(&common::fixture("tiny-untied-e8"), dir.path(), int2());
    let input = documents(dir.path());
    let base = [
        "summarize",
        "--model",
        bundle.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
        "--max-new-tokens",
        "12",
    ];
    let without: Vec<&str> = base.iter().chain(&SLOW).copied().collect();
    let (want, plain) = run_stats(&without, dir.path(), "plain");
    assert!(plain["stand_in"].is_null());
    let trace = dir.path().join("trace.jsonl");
    let mut with = without.clone();
    with.extend(["--stand-in", "int2", "--trace", trace.to_str().unwrap()]);
    let (got, stats) = run_stats(&with, dir.path(), "stand-in");
    assert_eq!(got, want, "the stand-ins changed the output");
    let s = &stats["stand_in"];
    assert_eq!(s["bits"], "int2");
    let used = s["used"].as_u64().unwrap();
    let started = s["reads_started"].as_u64().unwrap();
    assert!(used > 0 && started > 0, "{s}");
    assert!(
        stats["misses"].as_u64().unwrap() >= started,
        "every read started for later is a miss: {stats}"
    );
    // The full experts read for later were used: decoder hits exist beyond the stand-ins'.
    let decoder_sum = |key: &str| -> u64 {
        stats["per_layer"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|l| l["stack"] == "decoder")
            .map(|l| l[key].as_u64().unwrap())
            .sum()
    };
    let (decoder_hits, decoder_accesses) = (decoder_sum("hits"), decoder_sum("accesses"));
    assert!(
        used - s["unbuffered"].as_u64().unwrap() <= decoder_accesses,
        "stand-ins computed more than the decoder's accesses: {s} vs {decoder_accesses}"
    );
    assert!(decoder_hits > 0, "{stats}");

    // The trace replays to the live hit counts.
    let (header, events) = read_trace(&trace).unwrap();
    let replayed = replay(&header, &events, Policy::Edgemoe, 2, false);
    assert_eq!(
        (replayed.hits, replayed.misses),
        (
            stats["hits"].as_u64().unwrap(),
            stats["misses"].as_u64().unwrap()
        )
    );
}

#[test]
fn int2_stand_ins_of_an_int2_decoder_store_change_no_token_and_skip_the_prefill() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = common::convert_with(&common::fixture("tiny-olmoe"), dir.path(), int2());
    // A prompt of 40 ids: its prefill routes more tokens than a decode step may.
    let prompt: Vec<String> = (0..40)
        .map(|i| ((i * 7 + 3) % 97 + 2).to_string())
        .collect();
    let prompt = prompt.join(",");
    let base = [
        "generate",
        "--model",
        bundle.to_str().unwrap(),
        "--prompt-ids",
        &prompt,
    ];
    let run = |new_tokens: &str, stand_in: bool, name: &str| {
        let mut args: Vec<&str> = base.iter().chain(&SLOW).copied().collect();
        args.extend(["--max-new-tokens", new_tokens]);
        if stand_in {
            args.extend(["--stand-in", "int2"]);
        }
        run_stats(&args, dir.path(), name)
    };
    // One token: it comes from the prefill alone, which never uses a stand-in.
    let (_, prefill) = run("1", true, "prefill");
    assert!(prefill["misses"].as_u64().unwrap() > 0, "{prefill}");
    assert_eq!(prefill["stand_in"]["used"], 0, "{}", prefill["stand_in"]);

    let (want, _) = run("10", false, "plain");
    let (got, stats) = run("10", true, "stand-in");
    assert_eq!(got, want, "the stand-ins changed the output");
    assert!(stats["stand_in"]["used"].as_u64().unwrap() > 0, "{stats}");
}

#[test]
fn stand_ins_come_out_of_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = common::convert_to(&common::fixture("tiny-untied-e8"), dir.path());
    let input = documents(dir.path());
    let run = |stand_in: Option<&str>, name: &str| {
        let mut args = vec![
            "summarize",
            "--model",
            bundle.to_str().unwrap(),
            "--input",
            input.to_str().unwrap(),
            "--max-new-tokens",
            "4",
            "--budget",
            "1GiB",
        ];
        if let Some(bits) = stand_in {
            args.extend(["--stand-in", bits]);
        }
        run_stats(&args, dir.path(), name).1
    };
    let plain = run(None, "plain");
    let int4 = run(Some("int4"), "int4");
    let int2 = run(Some("int2"), "int2");
    let bytes = |s: &Value| s["stand_in"]["bytes"].as_u64().unwrap();
    let resident = |s: &Value| s["resident_bytes"].as_u64().unwrap();
    assert!(bytes(&int2) > 0 && bytes(&int4) > bytes(&int2));
    assert_eq!(resident(&int4), resident(&plain) + bytes(&int4));
    assert_eq!(resident(&int2), resident(&plain) + bytes(&int2));

    // A budget with room for exactly two slots without stand-ins has room for fewer with.
    let slot = plain["buffer_bytes"].as_u64().unwrap() / plain["buffer_slots"].as_u64().unwrap();
    let two = resident(&plain) + plain["working_bytes"].as_u64().unwrap() + 2 * slot;
    let budget = two.to_string();
    let args = [
        "summarize",
        "--model",
        bundle.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
        "--budget",
        &budget,
        "--buffer-experts",
        "2",
        "--max-new-tokens",
        "4",
    ];
    let (_, fits) = run_stats(&args, dir.path(), "fits");
    assert_eq!(fits["buffer_slots"], 2);
    let mut with: Vec<&str> = args.to_vec();
    with.extend(["--stand-in", "int4"]);
    let out = common::cli::run(&with, None);
    common::cli::assert_fails(&out, &["budget"]);
}

#[test]
fn wrong_stand_in_flags_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = common::convert_to(&common::fixture("tiny-tied-e4"), dir.path());
    let b = bundle.to_str().unwrap();
    for (extra, needles) in [
        (
            &["--stand-in", "f16"][..],
            &["--stand-in", "int2, int4 or int8"][..],
        ),
        (&["--stand-in", "3"][..], &["--stand-in"][..]),
        (
            &["--stand-in", "int4", "--mode", "io-free"][..],
            &["--stand-in", "io-free"][..],
        ),
    ] {
        let mut args = vec!["summarize", "--model", b, "--input", "-"];
        args.extend(extra);
        let out = common::cli::run(&args, Some("Anna: hi"));
        common::cli::assert_usage(&out, needles);
    }
}
