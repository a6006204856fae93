//! The trained demo checkpoint against transformers: greedy summaries of the first 50 SAMSum
//! test dialogues are token-identical to `tests/fixtures/samsum_greedy.json` (produced by
//! `tests/fixtures/make_samsum_golden.py`), at a budget that holds every expert and at one that
//! holds only a few. The source token ids are checked through their SHA-256 (the corpus itself
//! stays in ../shared).

mod common;

use edgemoe::bundle::Bundle;
use edgemoe::generation::decoding::DecodeOptions;
use edgemoe::generation::input::parse_documents;
use edgemoe::generation::session::{CacheOptions, Session, SessionOptions};
use serde::Deserialize;
use sha2::{Digest, Sha256};

#[derive(Deserialize)]
struct Expected {
    rows: Vec<Row>,
}

#[derive(Deserialize)]
struct Row {
    id: String,
    source_tokens: usize,
    source_sha256: String,
    output_ids: Vec<i64>,
}

fn digest(ids: &[i64]) -> String {
    let text: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    format!("{:x}", Sha256::digest(text.join(" ").as_bytes()))
}

#[test]
fn greedy_summaries_match_transformers_at_two_budgets() {
    let expected: Expected = serde_json::from_str(
        &std::fs::read_to_string(common::fixture("samsum_greedy.json")).unwrap(),
    )
    .unwrap();
    let text =
        std::fs::read_to_string(common::samsum("test")).expect("../shared/data/samsum/test.jsonl");
    let dialogues = parse_documents(&text, "test.jsonl").unwrap();
    let ids: Vec<String> = text
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();

    let dir = tempfile::tempdir().unwrap();
    let bundle_dir = common::convert_to(&common::demo_checkpoint(), dir.path());
    let bundle = Bundle::open(&bundle_dir).unwrap();
    let generation = bundle.config.generation.clone();
    // 1.5 GiB holds all 64 experts; 88 MiB leaves room for about ten slots.
    for budget_mib in [1536u64, 88] {
        let mut summarizer = Session::open(
            &bundle,
            SessionOptions {
                budget_bytes: budget_mib << 20,
                decode: DecodeOptions::from_defaults(&generation),
                max_input_tokens: generation.max_source_tokens,
                // The default buffer: edgemoe policy, prefetch thread on.
                cache: CacheOptions::default(),
                device: tch::Device::Cpu,
            },
        )
        .unwrap();
        let slots = summarizer.plan.slots;
        for (i, row) in expected.rows.iter().enumerate() {
            assert_eq!(ids[i], row.id, "dialogue order");
            let source = summarizer.encode(&dialogues[i]).unwrap();
            assert_eq!(
                source.len(),
                row.source_tokens,
                "dialogue {} source length",
                row.id
            );
            assert_eq!(
                digest(&source),
                row.source_sha256,
                "dialogue {} source ids",
                row.id
            );
            let generated = summarizer.run(&source, &mut |_| Ok(())).unwrap();
            assert_eq!(
                generated.tokens, row.output_ids,
                "dialogue {} at {budget_mib} MiB ({slots} slots)",
                row.id
            );
        }
        let stats = summarizer.buffer.stats();
        eprintln!(
            "{budget_mib} MiB: {slots} slots, hit ratio {:.3}",
            stats.hit_ratio()
        );
        if budget_mib == 88 {
            assert!(
                slots < 64,
                "the small budget must not hold every expert ({slots} slots)"
            );
        }
    }
}
