//! The trained demo checkpoint against transformers: greedy summaries of the first 50 SAMSum
//! test dialogues are token-identical to `tests/fixtures/samsum_greedy.json` (produced by
//! `tests/fixtures/make_samsum_golden.py`), at a budget that holds every expert and at one that
//! holds only a few. The source token ids are checked through their SHA-256 (the corpus itself
//! stays in ../shared). (The demo is the one trained checkpoint; the tiny random fixtures of
//! every architecture are compared with transformers in `parity.rs`.)

mod common;

use common::engine::{
    encode_document, generate_ids, open_summarizer, parse_documents, CacheOptions, SessionOptions,
};

use edgemoe::bundle::Bundle;
use edgemoe::generation::decoding::DecodeOptions;
use sha2::{Digest, Sha256};

fn digest(ids: &[i64]) -> String {
    let text: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    format!("{:x}", Sha256::digest(text.join(" ").as_bytes()))
}

#[test]
fn greedy_summaries_match_transformers_at_two_budgets() {
    let expected = common::golden::samsum_golden();
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
    let generation = Bundle::open(&bundle_dir).unwrap().config.generation;
    // 1.5 GiB holds all 64 experts; 88 MiB leaves room for about ten slots.
    for budget_mib in [1536u64, 88] {
        let mut summarizer = open_summarizer(
            &bundle_dir,
            SessionOptions {
                budget_bytes: budget_mib << 20,
                decode: DecodeOptions::from_defaults(&generation),
                max_input_tokens: generation.max_source_tokens,
                // The default buffer: edgemoe policy, prefetch thread on.
                cache: CacheOptions::default(),
                device: tch::Device::Cpu,
            },
        );
        let slots = summarizer.plan.slots;
        for (i, row) in expected.rows.iter().enumerate() {
            assert_eq!(ids[i], row.id, "dialogue order");
            let source = encode_document(&summarizer, &dialogues[i]);
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
            let generated = generate_ids(&mut summarizer, &source);
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
