//! The expert buffer on the trained demo model: outputs are token-identical under every policy,
//! with prefetch on and off, at every buffer size; a live run's trace replays to exactly its hit
//! counts; a tiny buffer with prefetch survives many tokens and shuts its thread down.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

use edgemoe::bundle::Bundle;
use edgemoe::cache::replay::replay;
use edgemoe::cache::trace::read_trace;
use edgemoe::cache::Policy;
use edgemoe::dictionary::PATHS_FILE;
use edgemoe::generation::decoding::DecodeOptions;
use edgemoe::generation::input::parse_documents;
use edgemoe::generation::session::{CacheOptions, Session, SessionOptions};
use edgemoe::ids::Stack;
use edgemoe::offline::calibrate::{build_dictionary, collect_paths};

/// The demo model converted and calibrated on 20 SAMSum train dialogues, shared by the tests.
fn calibrated_bundle() -> &'static Path {
    static BUNDLE: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &BUNDLE
        .get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let bundle = common::convert_to(&common::demo_checkpoint(), dir.path());
            let train = std::fs::read_to_string(common::samsum("train")).unwrap();
            let docs: Vec<String> = parse_documents(&train, "train").unwrap()[..20].to_vec();
            let mut summarizer = open(
                &bundle,
                big(),
                CacheOptions {
                    policy: Policy::Lru,
                    prefetch: false,
                    ..CacheOptions::default()
                },
                None,
            );
            let paths = collect_paths(&mut summarizer, &docs, "calibration", false).unwrap();
            let spec = Bundle::open(&bundle).unwrap().config.model;
            build_dictionary(
                &paths,
                spec.moe_blocks(Stack::Encoder).len(),
                spec.moe_blocks(Stack::Decoder).len(),
                spec.num_experts(),
                spec.top_k(),
            )
            .save(&bundle.join(PATHS_FILE))
            .unwrap();
            (dir, bundle)
        })
        .1
}

fn big() -> u64 {
    1 << 30
}

fn open(bundle: &Path, budget: u64, cache: CacheOptions, beams: Option<usize>) -> Session {
    let bundle = Bundle::open(bundle).unwrap();
    let generation = bundle.config.generation.clone();
    let mut decode = DecodeOptions::from_defaults(&generation);
    if let Some(b) = beams {
        decode.num_beams = b;
    }
    Session::open(
        &bundle,
        SessionOptions {
            budget_bytes: budget,
            decode,
            max_input_tokens: generation.max_source_tokens,
            cache,
            device: tch::Device::Cpu,
        },
    )
    .unwrap()
}

fn test_dialogues(n: usize) -> Vec<String> {
    let text = std::fs::read_to_string(common::samsum("test")).unwrap();
    parse_documents(&text, "test").unwrap()[..n].to_vec()
}

fn summarize_all(summarizer: &mut Session, docs: &[String]) -> Vec<Vec<i64>> {
    docs.iter()
        .map(|d| {
            let ids = summarizer.encode(d).unwrap();
            summarizer.run(&ids, &mut |_| Ok(())).unwrap().tokens
        })
        .collect()
}

#[test]
fn outputs_identical_under_every_policy_prefetch_and_size() {
    let bundle = calibrated_bundle();
    let docs = test_dialogues(4);
    let reference = summarize_all(
        &mut open(
            bundle,
            big(),
            CacheOptions {
                prefetch: false,
                ..CacheOptions::default()
            },
            None,
        ),
        &docs,
    );
    for policy in Policy::ONLINE {
        for prefetch in [false, true] {
            for slots in [2, 10, 64] {
                let mut s = open(
                    bundle,
                    big(),
                    CacheOptions {
                        policy,
                        prefetch,
                        buffer_experts: Some(slots),
                        ..CacheOptions::default()
                    },
                    None,
                );
                let got = summarize_all(&mut s, &docs);
                assert_eq!(
                    got, reference,
                    "{policy}, prefetch {prefetch}, {slots} slots"
                );
                let stats = s.buffer.stats();
                assert_eq!(stats.hits + stats.misses, stats.accesses);
                if prefetch && slots >= 10 {
                    assert!(
                        stats.prefetch.issued > 0,
                        "{policy} {slots}: no prefetch issued"
                    );
                }
            }
        }
    }
}

#[test]
fn replay_of_a_live_trace_gives_the_live_hit_counts() {
    let bundle = calibrated_bundle();
    let docs = test_dialogues(3);
    let dir = tempfile::tempdir().unwrap();
    for (policy, prefetch, slots) in [
        (Policy::Edgemoe, true, 6),
        (Policy::Lru, false, 6),
        (Policy::Lfu, true, 12),
        (Policy::EdgemoePaper, false, 3),
    ] {
        let trace = dir
            .path()
            .join(format!("{policy}-{prefetch}-{slots}.jsonl"));
        let mut s = open(
            bundle,
            big(),
            CacheOptions {
                policy,
                prefetch,
                buffer_experts: Some(slots),
                trace: Some(trace.clone()),
                ..CacheOptions::default()
            },
            None,
        );
        summarize_all(&mut s, &docs);
        s.buffer.finish_trace().unwrap();
        let live = s.buffer.stats().clone();
        let (header, events) = read_trace(&trace).unwrap();
        assert_eq!(
            (header.slots, header.policy, header.prefetch),
            (slots, policy, prefetch)
        );
        let replayed = replay(&header, &events, policy, slots, false);
        assert_eq!(
            (replayed.hits, replayed.misses),
            (live.hits, live.misses),
            "{policy}, prefetch {prefetch}, {slots} slots"
        );
        // Belady bounds every demand-only replay of the same trace.
        let best = replay(&header, &events, Policy::Belady, slots, true).hits;
        for p in Policy::ONLINE {
            assert!(replay(&header, &events, p, slots, true).hits <= best);
        }
    }
}

#[test]
fn tiny_buffer_with_prefetch_survives_many_tokens_and_shuts_down() {
    let bundle = calibrated_bundle();
    let docs = test_dialogues(6);
    let reference = summarize_all(
        &mut open(
            bundle,
            big(),
            CacheOptions {
                prefetch: false,
                ..CacheOptions::default()
            },
            Some(3),
        ),
        &docs,
    );
    for slots in [1, 2, 3] {
        let cache = CacheOptions {
            prefetch: true,
            buffer_experts: Some(slots),
            // No cap: as many speculative reads as the dictionary suggests.
            prefetch_cap_bytes: Some(u64::MAX / 2),
            ..CacheOptions::default()
        };
        let mut s = open(bundle, big(), cache, Some(3));
        let plan = s.plan;
        assert!(
            plan.resident_bytes + plan.working_bytes + plan.buffer_bytes() <= plan.budget_bytes
        );
        let got = summarize_all(&mut s, &docs);
        assert_eq!(got, reference, "{slots} slots");
        assert_eq!(
            s.buffer.as_buffer().unwrap().slot_count(),
            slots,
            "slots are fixed"
        );
        let stats = s.buffer.stats().clone();
        assert!(stats.accesses > 500, "{stats:?}");
        assert!(stats.prefetch.issued > 0);
        let exited = s.buffer.as_buffer().unwrap().prefetch_exit_flag().unwrap();
        assert!(!exited.load(Ordering::Acquire));
        drop(s);
        assert!(
            exited.load(Ordering::Acquire),
            "prefetch thread joined on drop"
        );
    }
}
