//! The expert buffer, for every architecture: outputs are token-identical under every policy,
//! with prefetch on and off, at every buffer size; a live run's trace replays to exactly its hit
//! counts (Belady bounding every online policy); a tiny buffer with prefetch survives many
//! tokens and shuts its thread down. The Switch side runs the trained demo model calibrated on
//! SAMSum; the decoder-only side the tiny fixtures with a dictionary calibrated on their golden
//! prompts.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use common::engine::{load_decoder, open_summarizer_with, summarize_all, CacheOptions};
use common::golden::{decoder_golden, golden_dictionary, greedy_options, DecoderGolden};

use edgemoe::bundle::Bundle;
use edgemoe::cache::replay::replay;
use edgemoe::cache::trace::{read_trace, AccessKind};
use edgemoe::cache::Policy;
use edgemoe::config::profile::DeviceProfile;
use edgemoe::config::ModelSpec;
use edgemoe::dictionary::PathDictionary;
use edgemoe::generation::causal::complete;
use edgemoe::ids::Stack;
use edgemoe::model::DecoderOnlyModel;
use edgemoe::offline::calibrate::{build_dictionary, collect_paths};
use edgemoe::runtime::buffer::{BufferOptions, ExpertBuffer};
use edgemoe::runtime::predict::PredictorKind;
use edgemoe::runtime::stats::ExpertStats;
use edgemoe::store::{ExpertStore, StorageMode};

/// The demo model converted and calibrated on 20 SAMSum train dialogues, shared by the tests.
fn calibrated_bundle() -> &'static Path {
    static BUNDLE: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &BUNDLE
        .get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let bundle = common::convert_to(&common::demo_checkpoint(), dir.path());
            let docs = common::samsum_dialogues("train", 20);
            let mut summarizer = open_summarizer_with(
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
            let opened = Bundle::open(&bundle).unwrap();
            let spec = &opened.config.model;
            let dictionary = build_dictionary(
                &paths,
                spec.moe_blocks(Stack::Encoder).len(),
                spec.moe_blocks(Stack::Decoder).len(),
                spec.num_experts(),
                spec.top_k(),
            );
            opened.save_path_dictionary(&dictionary).unwrap();
            (dir, bundle)
        })
        .1
}

fn big() -> u64 {
    1 << 30
}

/// An `edgemoe` buffer of `slots` with prefetch on and speculation uncapped, driven by the gate
/// lookahead (which the tests feed by hand through `ExpertBuffer::predicted`).
fn gate_buffer(store: ExpertStore, spec: &ModelSpec, slots: usize) -> ExpertBuffer {
    ExpertBuffer::with_options(
        store,
        spec,
        &BufferOptions {
            slots,
            policy: Policy::Edgemoe,
            prefetch: true,
            prefetch_cap_bytes: u64::MAX,
            predictor: PredictorKind::Gate,
            stand_in: None,
        },
        None,
    )
    .unwrap()
}

/// A buffer of `slots` under `policy` that reads only a layer's next expert ahead (speculation
/// capped at 0 bytes), or nothing ahead with `prefetch` false.
fn next_read_buffer(
    store: ExpertStore,
    spec: &ModelSpec,
    slots: usize,
    policy: Policy,
    prefetch: bool,
) -> ExpertBuffer {
    ExpertBuffer::with_options(
        store,
        spec,
        &BufferOptions {
            slots,
            policy,
            prefetch,
            prefetch_cap_bytes: 0,
            predictor: PredictorKind::Dictionary,
            stand_in: None,
        },
        None,
    )
    .unwrap()
}

/// Expert `expert` of the decoder's block `layer`.
fn decoder_expert(layer: usize, expert: u16) -> edgemoe::ids::ExpertId {
    edgemoe::ids::ExpertId {
        stack: Stack::Decoder,
        layer: layer as u16,
        expert,
    }
}

/// Waits until the buffer's queued reads have all started (a started read completes; a queued
/// one can still be taken back or upgraded).
fn wait_until_reads_start(buffer: &ExpertBuffer) {
    let started = std::time::Instant::now();
    while buffer.io().unwrap().queued().iter().sum::<usize>() > 0 {
        assert!(started.elapsed().as_secs() < 30, "the read never started");
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
}

/// Fixture `name` converted into a fresh temporary directory (returned with the bundle, which
/// lives in it).
fn converted(name: &str) -> (tempfile::TempDir, Bundle) {
    let dir = tempfile::tempdir().unwrap();
    let bundle = Bundle::open(&common::convert_to(&common::fixture(name), dir.path())).unwrap();
    (dir, bundle)
}

/// A decoder-only fixture converted, with its model, golden file and a dictionary calibrated on
/// its golden prompts.
struct DecoderFixture {
    name: &'static str,
    _dir: tempfile::TempDir,
    bundle: Bundle,
    model: DecoderOnlyModel,
    golden: DecoderGolden,
    dictionary: Arc<PathDictionary>,
}

impl DecoderFixture {
    fn open(name: &'static str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let bundle = Bundle::open(&common::convert_to(&common::fixture(name), dir.path())).unwrap();
        let model = load_decoder(&bundle);
        let golden = decoder_golden(name);
        let dictionary = Arc::new(golden_dictionary(&bundle, &model, &golden));
        DecoderFixture {
            name,
            _dir: dir,
            bundle,
            model,
            golden,
            dictionary,
        }
    }

    fn total_experts(&self) -> usize {
        self.bundle.open_store().unwrap().index().experts.len()
    }

    /// An expert buffer; the dictionary is given when `dictionary` is set.
    fn buffer(&self, options: &BufferOptions, dictionary: bool) -> ExpertBuffer {
        ExpertBuffer::with_options(
            self.bundle.open_store().unwrap(),
            &self.bundle.config.model,
            options,
            dictionary.then(|| self.dictionary.clone()),
        )
        .unwrap()
    }

    /// Runs every golden prompt greedily, asserting the golden tokens.
    fn run_golden(&self, buffer: &mut ExpertBuffer, what: &str) {
        let options = greedy_options(&self.golden);
        for case in &self.golden.cases {
            let g = complete(&self.model, buffer, &case.input_ids, &options, &mut |_| {
                Ok(())
            })
            .unwrap();
            assert_eq!(g.tokens, case.greedy, "{}: {what}", self.name);
        }
    }
}

/// Replays the trace at `trace` and asserts it was recorded with `(slots, policy, prefetch)`,
/// that the replay gives the live hit counts, and that Belady bounds every demand-only replay of
/// the same trace.
fn assert_replay_matches_live(
    trace: &Path,
    live: &ExpertStats,
    policy: Policy,
    prefetch: bool,
    slots: usize,
) {
    let (header, events) = read_trace(trace).unwrap();
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
    // Each stack's share of them too, against the live run's per-layer counts.
    for (stack, tally) in [("encoder", replayed.encoder), ("decoder", replayed.decoder)] {
        let (accesses, hits) = live
            .per_layer()
            .iter()
            .filter(|l| l.stack == stack)
            .fold((0, 0), |(a, h), l| (a + l.accesses, h + l.hits));
        assert_eq!(
            (tally.hits, tally.hits + tally.misses),
            (hits, accesses),
            "{stack}: {policy}, prefetch {prefetch}, {slots} slots"
        );
    }
    // Belady bounds every demand-only replay of the same trace.
    let best = replay(&header, &events, Policy::Belady, slots, true).hits;
    for p in Policy::ONLINE {
        assert!(replay(&header, &events, p, slots, true).hits <= best);
    }
    // The waits the trace records add up to the run's stall (every wait is a demand access's),
    // and every demand read waited for its bytes.
    let waited: f64 = events.iter().filter_map(|e| e.waited_ms).sum();
    assert!(
        (waited - live.stall_ms).abs() <= 1e-9 * live.stall_ms.max(1.0),
        "the trace's waits add up to {waited} ms, the run stalled {} ms",
        live.stall_ms
    );
    let waiting = events.iter().filter(|e| e.waited_ms.is_some()).count() as u64;
    assert!(
        waiting >= live.misses,
        "{waiting} waits for {} misses",
        live.misses
    );
    assert!(events
        .iter()
        .all(|e| e.kind == AccessKind::Demand || e.waited_ms.is_none()));
}

#[test]
fn switch_outputs_identical_under_every_policy_prefetch_and_size() {
    let bundle = calibrated_bundle();
    let docs = common::samsum_dialogues("test", 4);
    let reference = summarize_all(
        &mut open_summarizer_with(
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
                let mut s = open_summarizer_with(
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
fn decoder_outputs_identical_under_every_policy_prefetch_and_size() {
    for name in common::DECODER_FIXTURES {
        let fixture = DecoderFixture::open(name);
        let total = fixture.total_experts();
        for policy in Policy::ONLINE {
            for prefetch in [false, true] {
                for slots in [2, 5, total] {
                    let what = format!("{policy}, prefetch {prefetch}, {slots} slots");
                    let mut buffer = fixture.buffer(
                        &BufferOptions {
                            slots,
                            policy,
                            prefetch,
                            prefetch_cap_bytes: u64::MAX / 2,
                            predictor: PredictorKind::Dictionary,
                            stand_in: None,
                        },
                        prefetch,
                    );
                    fixture.run_golden(&mut buffer, &what);
                    let stats = buffer.stats();
                    assert_eq!(stats.hits + stats.misses, stats.accesses, "{name}: {what}");
                    if prefetch {
                        assert!(stats.prefetch.issued > 0, "{name}: {what}: no prefetch");
                    }
                }
            }
        }
    }
}

#[test]
fn switch_replay_of_a_live_trace_gives_the_live_hit_counts() {
    let bundle = calibrated_bundle();
    let docs = common::samsum_dialogues("test", 3);
    let dir = tempfile::tempdir().unwrap();
    // The last run reads from an emulated NVMe drive (four reads in flight): right guesses
    // still being read when the model needs them are waited for.
    let nvme = DeviceProfile::load("rpi5-nvme").unwrap();
    for (policy, prefetch, slots, emulate) in [
        (Policy::Edgemoe, true, 6, false),
        (Policy::Lru, false, 6, false),
        (Policy::Lfu, true, 12, false),
        (Policy::EdgemoePaper, false, 3, false),
        (Policy::Edgemoe, true, 6, true),
    ] {
        let trace = dir
            .path()
            .join(format!("{policy}-{prefetch}-{slots}-{emulate}.jsonl"));
        let device = CacheOptions {
            storage: StorageMode::Emulate,
            storage_device: Some((nvme.read_bytes_per_s, nvme.read_latency)),
            queue_depth: nvme.queue_depth,
            ..CacheOptions::default()
        };
        let mut s = open_summarizer_with(
            bundle,
            big(),
            CacheOptions {
                policy,
                prefetch,
                buffer_experts: Some(slots),
                trace: Some(trace.clone()),
                ..if emulate {
                    device
                } else {
                    CacheOptions::default()
                }
            },
            None,
        );
        summarize_all(&mut s, &docs);
        s.buffer.finish_trace().unwrap();
        let live = s.buffer.stats().clone();
        assert_replay_matches_live(&trace, &live, policy, prefetch, slots);
    }
}

#[test]
fn decoder_top_k_replay_of_a_live_trace_gives_the_live_hit_counts() {
    let dir = tempfile::tempdir().unwrap();
    for name in common::DECODER_FIXTURES {
        let fixture = DecoderFixture::open(name);
        for (policy, prefetch, slots) in [
            (Policy::Edgemoe, false, 6),
            (Policy::Lru, true, 5),
            (Policy::EdgemoePaper, true, 12),
        ] {
            let mut buffer = fixture.buffer(
                &BufferOptions {
                    slots,
                    policy,
                    prefetch,
                    prefetch_cap_bytes: 8 * 4096,
                    predictor: PredictorKind::Dictionary,
                    stand_in: None,
                },
                true,
            );
            let trace = dir.path().join(format!("{name}-{policy}-{prefetch}.jsonl"));
            buffer.record_trace(&trace).unwrap();
            fixture.run_golden(&mut buffer, "traced run");
            buffer.finish_trace().unwrap();
            let live = buffer.stats().clone();
            assert_replay_matches_live(&trace, &live, policy, prefetch, slots);
        }
    }
}

#[test]
fn switch_tiny_buffer_with_prefetch_survives_many_tokens_and_shuts_down() {
    let bundle = calibrated_bundle();
    let docs = common::samsum_dialogues("test", 6);
    let reference = summarize_all(
        &mut open_summarizer_with(
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
        let mut s = open_summarizer_with(bundle, big(), cache, Some(3));
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
        // One slot is the expert being computed on when reads could start: nothing to read
        // into (speculation starts once a layer's last expert is demanded).
        if slots > 1 {
            assert!(stats.prefetch.issued > 0, "{slots} slots: {stats:?}");
        }
        let exited = s.buffer.as_buffer().unwrap().prefetch_exit_flag().unwrap();
        assert!(!exited.load(Ordering::Acquire));
        drop(s);
        assert!(
            exited.load(Ordering::Acquire),
            "prefetch thread joined on drop"
        );
    }
}

#[test]
fn decoder_tiny_buffer_with_prefetch_keeps_its_slots_and_shuts_down() {
    for name in common::DECODER_FIXTURES {
        let fixture = DecoderFixture::open(name);
        for slots in [1, 2, 3] {
            let mut buffer = fixture.buffer(
                &BufferOptions {
                    slots,
                    policy: Policy::Edgemoe,
                    prefetch: true,
                    // No cap: as many speculative reads as the dictionary suggests.
                    prefetch_cap_bytes: u64::MAX / 2,
                    predictor: PredictorKind::Dictionary,
                    stand_in: None,
                },
                true,
            );
            fixture.run_golden(&mut buffer, &format!("{slots} slots"));
            assert_eq!(buffer.slot_count(), slots, "{name}: slots are fixed");
            let stats = buffer.stats().clone();
            assert_eq!(stats.hits + stats.misses, stats.accesses);
            if slots > 1 {
                assert!(stats.prefetch.issued > 0, "{name}: {stats:?}");
            }
            let exited = buffer.prefetch_exit_flag().unwrap();
            assert!(!exited.load(Ordering::Acquire));
            drop(buffer);
            assert!(
                exited.load(Ordering::Acquire),
                "{name}: prefetch thread joined on drop"
            );
        }
    }
}

/// A prefetch read that fails its checksum ends the run with that error, as a failed demand
/// read does, even when the expert is never demanded, and its bytes count as read. It was
/// dropped quietly: read again at every prediction, and left out of the statistics.
#[test]
fn a_prefetch_that_fails_its_checksum_is_reported_and_counted() {
    use edgemoe::ids::ExpertId;
    use edgemoe::model::provider::ExpertProvider;
    let dir = tempfile::tempdir().unwrap();
    let path = common::convert_to(&common::fixture("tiny-mixtral"), dir.path());
    let (a, b) = {
        let store = Bundle::open(&path).unwrap().open_store().unwrap();
        let ids: Vec<ExpertId> = store.index().experts.iter().map(|e| e.id).collect();
        (ids[0], ids[1])
    };
    common::checkpoint::flip_expert_byte(&path, b);
    let bundle = Bundle::open(&path).unwrap();
    let store = bundle.open_store().unwrap();
    let length = |id| store.entry(id).unwrap().length;
    let (a_bytes, b_bytes) = (length(a), length(b));
    let mut buffer = ExpertBuffer::with_options(
        bundle.open_store().unwrap(),
        &bundle.config.model,
        &BufferOptions {
            slots: 4,
            policy: Policy::Lru,
            prefetch: true,
            prefetch_cap_bytes: u64::MAX,
            predictor: PredictorKind::Dictionary,
            stand_in: None,
        },
        None,
    )
    .unwrap();
    // `a` read on demand; `b`, the next expert, handed to the prefetch thread.
    assert!(buffer.expert(a, Some(b)).is_ok());
    // `a` again (a hit) until the prefetch of `b` has come back: never demanded, it must still
    // be reported.
    let started = std::time::Instant::now();
    let error = loop {
        if let Err(e) = buffer.expert(a, None) {
            break e;
        }
        assert!(
            started.elapsed().as_secs() < 20,
            "the failed prefetch of {b} was never reported"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    match error {
        edgemoe::Error::Checksum { expert, .. } => assert_eq!(expert, b),
        other => panic!("expected the checksum error of {b}, got {other}"),
    }
    let stats = buffer.stats();
    assert_eq!(stats.prefetch.issued, 1);
    assert_eq!(stats.prefetch.failed, 1);
    assert_eq!(stats.prefetch.bytes_read, b_bytes);
    assert_eq!(stats.bytes_read, a_bytes + b_bytes);
}

/// Reading a layer's next expert ahead pins the one being computed, which is often the best
/// victim: during the encoder, such a read must not evict a decoder expert (needed right after
/// the encoder) when the expert in use, whose layer has run, could go instead.
#[test]
fn reading_the_next_expert_ahead_never_evicts_an_expert_needed_sooner() {
    use edgemoe::ids::ExpertId;
    use edgemoe::model::provider::ExpertProvider;
    let (_dir, bundle) = converted("tiny-untied-e8");
    let spec = &bundle.config.model;
    let (enc, dec) = (
        spec.moe_blocks(Stack::Encoder),
        spec.moe_blocks(Stack::Decoder),
    );
    let id = |stack, layer: usize, expert| ExpertId {
        stack,
        layer: layer as u16,
        expert,
    };
    let decoder_expert = id(Stack::Decoder, dec[0], 1);
    for policy in [Policy::Edgemoe, Policy::Lru, Policy::Lfu, Policy::EdgemoeFd] {
        let mut buffer = next_read_buffer(bundle.open_store().unwrap(), spec, 2, policy, true);
        // A decode step leaves a decoder expert in the buffer.
        buffer.begin_step(Stack::Decoder);
        buffer.routed(Stack::Decoder, dec[0], 1, &[1]).unwrap();
        buffer.expert(decoder_expert, None).unwrap();
        // The next document's first encoder layer routes to experts 0 and 3: expert 0 takes
        // the free slot; expert 3 could be read ahead only over the decoder expert.
        buffer.begin_step(Stack::Encoder);
        buffer
            .routed(Stack::Encoder, enc[0], 1, &[0, 3, 3, 0])
            .unwrap();
        let first = id(Stack::Encoder, enc[0], 0);
        buffer
            .expert(first, Some(id(Stack::Encoder, enc[0], 3)))
            .unwrap();
        let held = buffer.slot_contents();
        assert!(
            held.contains(&Some(decoder_expert)),
            "{policy}: reading ahead evicted the decoder expert: {held:?}"
        );
        // Demanded, expert 3 is read (and whatever the policy chooses goes).
        buffer.expert(id(Stack::Encoder, enc[0], 3), None).unwrap();
        assert!(buffer
            .slot_contents()
            .contains(&Some(id(Stack::Encoder, enc[0], 3))));
    }
}

/// Reading the next expert ahead evicts nothing that its demand read would not: under every
/// policy, a layer whose second expert was read ahead leaves the buffer holding what it holds
/// when that expert is read on demand. An encoder pass's later layer reading ahead over an
/// earlier layer's expert (both done for this forward call) while the policy would have let
/// the expert in use go made the next document's encoder miss it (BENCHMARKS §11.3).
#[test]
fn reading_the_next_expert_ahead_evicts_what_its_demand_read_would() {
    use edgemoe::ids::ExpertId;
    use edgemoe::model::provider::ExpertProvider;
    let (_dir, bundle) = converted("tiny-untied-e8");
    let spec = &bundle.config.model;
    let (enc, dec) = (
        spec.moe_blocks(Stack::Encoder),
        spec.moe_blocks(Stack::Decoder),
    );
    assert!(enc.len() >= 2, "two encoder MoE blocks");
    let id = |stack, layer: usize, expert| ExpertId {
        stack,
        layer: layer as u16,
        expert,
    };
    let decoder_expert = id(Stack::Decoder, dec[0], 1);
    let (earlier, in_use, next) = (
        id(Stack::Encoder, enc[0], 2),
        id(Stack::Encoder, enc[1], 0),
        id(Stack::Encoder, enc[1], 3),
    );
    let run = |policy: Policy, prefetch: bool| {
        let mut buffer = next_read_buffer(bundle.open_store().unwrap(), spec, 3, policy, prefetch);
        // A decode step, then the next document's encoder: its first MoE layer's expert, then
        // the second layer's two, the second read ahead while the first is computed.
        buffer.begin_step(Stack::Decoder);
        buffer.routed(Stack::Decoder, dec[0], 1, &[1]).unwrap();
        buffer.expert(decoder_expert, None).unwrap();
        buffer.begin_step(Stack::Encoder);
        buffer.routed(Stack::Encoder, enc[0], 1, &[2]).unwrap();
        buffer.expert(earlier, None).unwrap();
        buffer.routed(Stack::Encoder, enc[1], 1, &[0, 3]).unwrap();
        buffer.expert(in_use, Some(next)).unwrap();
        buffer.expert(next, None).unwrap();
        let mut held: Vec<_> = buffer.slot_contents().into_iter().flatten().collect();
        held.sort();
        (held, buffer.stats().prefetch.issued)
    };
    let mut read_ahead = 0;
    for policy in Policy::ONLINE {
        let (demand_paging, _) = run(policy, false);
        let (with_prefetch, issued) = run(policy, true);
        assert_eq!(
            with_prefetch, demand_paging,
            "{policy}: held after the layer, with the next expert read ahead ({issued} reads) \
             and without"
        );
        read_ahead += issued;
    }
    // Where the policy would evict another expert than the one in use, the read goes ahead.
    assert!(read_ahead > 0, "no policy read the next expert ahead");
}

/// Where one read holds most of the device, speculation runs in decode steps only: the same
/// confident prediction for the next MoE block starts a read after a one-token layer, and none
/// after an encoder layer or a prompt prefill of 20 tokens (which keep the device busy with
/// their own experts; the encoder's speculative reads took the decoder's slots). That is a
/// one-channel device (a store opened without a profile has queue depth 1), and a
/// several-channel one whose bus moves one read's bytes at a time (`rpi5-nvme`'s 442 MB/s
/// link; the bandwidth here is scaled down to the fixtures' small experts). Several channels
/// with transfer to spare serve speculation in any call.
#[test]
fn speculative_reads_start_in_decode_steps_only() {
    use edgemoe::ids::ExpertId;
    use edgemoe::model::provider::ExpertProvider;
    use std::time::Duration;
    let bus_bound = Some((1e6, Duration::from_micros(60)));
    let latency_bound = Some((1e10, Duration::from_micros(60)));
    // (fixture, stack, tokens routed, device channels, device model, speculative reads expected)
    let cases = [
        ("tiny-tied-e4", Stack::Decoder, 1, 1, None, 1),
        ("tiny-tied-e4", Stack::Encoder, 20, 1, None, 0),
        ("tiny-mixtral", Stack::Decoder, 1, 1, None, 1),
        ("tiny-mixtral", Stack::Decoder, 20, 1, None, 0),
        ("tiny-tied-e4", Stack::Decoder, 1, 4, bus_bound, 1),
        ("tiny-tied-e4", Stack::Encoder, 20, 4, bus_bound, 0),
        ("tiny-mixtral", Stack::Decoder, 20, 4, bus_bound, 0),
        ("tiny-tied-e4", Stack::Encoder, 20, 4, None, 1),
        ("tiny-mixtral", Stack::Decoder, 20, 4, None, 1),
        ("tiny-tied-e4", Stack::Encoder, 20, 4, latency_bound, 1),
        ("tiny-mixtral", Stack::Decoder, 20, 4, latency_bound, 1),
    ];
    for (fixture, stack, tokens, channels, device, expect_reads) in cases {
        let (_dir, bundle) = converted(fixture);
        let spec = &bundle.config.model;
        let blocks = spec.moe_blocks(stack);
        assert!(
            blocks.len() >= 2,
            "{fixture}: two MoE blocks in the {stack:?}"
        );
        let id = |layer: usize, expert| ExpertId {
            stack,
            layer: layer as u16,
            expert,
        };
        let mut store = bundle.open_store().unwrap();
        store.set_queue_depth(channels);
        store.set_device(device);
        let mut buffer = gate_buffer(store, spec, 4);
        buffer.begin_step(stack);
        // The gate lookahead: every token goes to expert 2 in the next MoE block (k = 1 here,
        // whatever the model's k: only the prediction's share per token matters).
        buffer
            .predicted(stack, blocks[1], 1, &vec![2; tokens])
            .unwrap();
        buffer
            .routed(stack, blocks[0], 1, &vec![0; tokens])
            .unwrap();
        // The layer's only expert is at hand: its predictions may start.
        buffer.expert(id(blocks[0], 0), None).unwrap();
        assert_eq!(
            buffer.stats().prefetch.issued,
            expect_reads,
            "{fixture}, {stack:?} call of {tokens} tokens, {channels} channels, device \
             {device:?}: speculative reads"
        );
    }
}

/// A speculative load that its layer's router then does not choose gives its slot back: the
/// buffer holds what demand paging alone would (kept, the policy valued it by the offline
/// frequencies the wrong prediction drew on, and on a small buffer it made the experts in use
/// miss for tens of tokens). Counted in `prefetch.refuted` and as wasted bytes, and traced as a
/// cancel, so replay frees the slot too.
#[test]
fn a_speculative_load_its_router_refutes_gives_its_slot_back() {
    use edgemoe::model::provider::ExpertProvider;
    let (dir, bundle) = converted("tiny-tied-e4");
    let spec = &bundle.config.model;
    let blocks = spec.moe_blocks(Stack::Decoder);
    let id = decoder_expert;
    let trace = dir.path().join("trace.jsonl");
    let mut buffer = gate_buffer(bundle.open_store().unwrap(), spec, 3);
    buffer.record_trace(&trace).unwrap();
    let (predicted, chosen) = (id(blocks[1], 2), id(blocks[1], 3));
    // Step 1: the gate predicts expert 2 for the second MoE block; its read starts once the
    // first block's expert is at hand (waited for here: a read not started yet would be taken
    // back unread when the block routes, which other tests cover).
    buffer.begin_step(Stack::Decoder);
    buffer
        .predicted(Stack::Decoder, blocks[1], 1, &[2])
        .unwrap();
    buffer.routed(Stack::Decoder, blocks[0], 1, &[0]).unwrap();
    buffer.expert(id(blocks[0], 0), None).unwrap();
    assert_eq!(buffer.stats().prefetch.issued, 1, "the speculative read");
    wait_until_reads_start(&buffer);
    // The second block routes to expert 3 instead; its demand read waits behind the started
    // one (one channel), so that one has arrived by the next step.
    buffer.routed(Stack::Decoder, blocks[1], 1, &[3]).unwrap();
    buffer.expert(chosen, None).unwrap();
    // Step 2: the same routing; by now the refuted load has arrived, and it is dropped.
    buffer.begin_step(Stack::Decoder);
    buffer.routed(Stack::Decoder, blocks[0], 1, &[0]).unwrap();
    buffer.expert(id(blocks[0], 0), None).unwrap();
    buffer.routed(Stack::Decoder, blocks[1], 1, &[3]).unwrap();
    buffer.expert(chosen, None).unwrap();
    let held = buffer.slot_contents();
    assert!(
        !held.contains(&Some(predicted)),
        "the refuted load still holds a slot: {held:?}"
    );
    assert!(held.contains(&Some(chosen)) && held.contains(&Some(id(blocks[0], 0))));
    let stats = buffer.stats().prefetch.clone();
    assert_eq!((stats.refuted, stats.cancelled), (1, 0), "{stats:?}");
    assert!(stats.wasted_bytes > 0, "{stats:?}");
    buffer.finish_trace().unwrap();
    let (_, events) = read_trace(&trace).unwrap();
    assert!(
        events
            .iter()
            .any(|e| e.kind == AccessKind::Cancel && e.id() == predicted),
        "the drop is traced as a cancel"
    );
}

/// At most the device's queue depth of speculative reads are in flight at once: predictions
/// beyond that are scored, not read, however many slots are free (`start_prefetch`'s headroom
/// check; without it every prediction would queue on the device ahead of the next demand).
#[test]
fn speculative_reads_in_flight_stay_within_the_queue_depth() {
    use edgemoe::model::provider::ExpertProvider;
    use edgemoe::store::ReadPacer;
    use std::time::Duration;
    let (_dir, bundle) = converted("tiny-tied-e4");
    let spec = &bundle.config.model;
    let blocks = spec.moe_blocks(Stack::Decoder);
    let id = decoder_expert;
    // (queue depth, speculative reads expected): three certain predictions, five slots.
    for (depth, expected) in [(1, 1), (2, 2), (4, 3)] {
        // Reads of 300 ms: none finishes while the predictions are handed out.
        let latency = Duration::from_millis(300);
        let mut store = bundle.open_store().unwrap();
        store.set_queue_depth(depth);
        store.set_pacer(Some(ReadPacer::with_queue_depth(1e12, latency, depth)));
        store.set_device(Some((1e12, latency)));
        let mut buffer = gate_buffer(store, spec, 5);
        buffer.begin_step(Stack::Decoder);
        // k = 3 for the one token: experts 1, 2 and 3 of the next block, each certain.
        buffer
            .predicted(Stack::Decoder, blocks[1], 3, &[1, 2, 3])
            .unwrap();
        buffer.routed(Stack::Decoder, blocks[0], 1, &[0]).unwrap();
        buffer.expert(id(blocks[0], 0), None).unwrap();
        let stats = buffer.stats().prefetch.clone();
        assert_eq!(
            stats.issued, expected,
            "queue depth {depth}: speculative reads started ({stats:?})"
        );
        let in_flight = buffer
            .slot_contents()
            .iter()
            .filter(|held| matches!(held, Some(e) if e.layer as usize == blocks[1]))
            .count() as u64;
        assert_eq!(in_flight, expected, "queue depth {depth}: slots taken");
    }
}

/// A layer whose speculative reads the router keeps refuting stops reading: after the few
/// candidates its books need, its predictions are scored without being read, and it is
/// reported stopped (`prefetch.per_layer[].enabled`).
#[test]
fn a_layer_whose_speculative_reads_are_refuted_stops_reading() {
    use edgemoe::model::provider::ExpertProvider;
    use edgemoe::store::ReadPacer;
    use std::time::Duration;
    let (_dir, bundle) = converted("tiny-tied-e4");
    let spec = &bundle.config.model;
    let blocks = spec.moe_blocks(Stack::Decoder);
    let id = decoder_expert;
    let latency = Duration::from_millis(2);
    let mut store = bundle.open_store().unwrap();
    store.set_queue_depth(1);
    store.set_pacer(Some(ReadPacer::new(1e12, latency)));
    store.set_device(Some((1e12, latency)));
    let mut buffer = gate_buffer(store, spec, 4);
    let steps = 24;
    let (predicted, chosen) = (id(blocks[1], 2), id(blocks[1], 3));
    let mut issued_by_step = Vec::new();
    let mut held = 0;
    for _ in 0..steps {
        // The gate predicts expert 2 for the second MoE block; the router picks 3. A refuted
        // load still being read when its layer routed keeps its slot until the layer routes
        // again, and a prediction of an expert held is no candidate.
        held += buffer.slot_contents().contains(&Some(predicted)) as u64;
        buffer.begin_step(Stack::Decoder);
        buffer
            .predicted(Stack::Decoder, blocks[1], 1, &[2])
            .unwrap();
        buffer.routed(Stack::Decoder, blocks[0], 1, &[0]).unwrap();
        buffer.expert(id(blocks[0], 0), None).unwrap();
        // Let a speculative read start (one taken back unread would cost nothing).
        wait_until_reads_start(&buffer);
        // ... and finish on the device, as it would during the layer's compute on a board (the
        // buffer takes it in at its next call).
        std::thread::sleep(3 * latency);
        buffer.routed(Stack::Decoder, blocks[1], 1, &[3]).unwrap();
        buffer.expert(chosen, None).unwrap();
        issued_by_step.push(buffer.stats().prefetch.issued);
    }
    let issued = *issued_by_step.last().unwrap();
    assert!(
        issued >= 1,
        "the first prediction is read: {issued_by_step:?}"
    );
    // Its books stop it within MIN_SAMPLES (8) candidates, at once when a whole read behind.
    assert_eq!(
        issued_by_step[steps / 2],
        issued,
        "reads after the layer should have stopped: {issued_by_step:?}"
    );
    let layer = buffer
        .stats()
        .prefetch
        .per_layer
        .iter()
        .find(|l| l.stack == Stack::Decoder.hf_prefix() && l.block as usize == blocks[1])
        .cloned()
        .expect("the predicted layer has books");
    assert!(!layer.enabled && layer.switches >= 1, "{layer:?}");
    assert_eq!(layer.issued, issued, "{layer:?}");
    assert_eq!(
        layer.issued + layer.skipped + held,
        steps as u64,
        "every prediction of an expert not held is a candidate, read or scored: {layer:?}"
    );
    assert_eq!(layer.useful, 0, "{layer:?}");
}

/// A damaged expert that a speculative read brings in is an error when the model then uses it,
/// although the model never reads it itself: the prefetch thread checks what it reads as a
/// demand read does. (`io_scheduler.rs` reaches this through the CLI, where whether speculation
/// reads an expert first depends on timing; here the read is certainly speculative.)
#[test]
fn a_damaged_expert_read_by_speculation_is_an_error_when_used() {
    use edgemoe::model::provider::ExpertProvider;
    let dir = tempfile::tempdir().unwrap();
    let path = common::convert_to(&common::fixture("tiny-tied-e4"), dir.path());
    let bundle = Bundle::open(&path).unwrap();
    let spec = &bundle.config.model;
    let blocks = spec.moe_blocks(Stack::Decoder);
    let id = decoder_expert;
    let damaged = id(blocks[1], 2);
    common::checkpoint::flip_expert_byte(&path, damaged);
    let mut buffer = gate_buffer(Bundle::open(&path).unwrap().open_store().unwrap(), spec, 4);
    buffer.begin_step(Stack::Decoder);
    buffer
        .predicted(Stack::Decoder, blocks[1], 1, &[2])
        .unwrap();
    buffer.routed(Stack::Decoder, blocks[0], 1, &[0]).unwrap();
    buffer.expert(id(blocks[0], 0), None).unwrap();
    assert_eq!(buffer.stats().prefetch.issued, 1, "the speculative read");
    // Started as a speculative read (a queued one the model demands becomes a demand read).
    wait_until_reads_start(&buffer);
    let result = buffer
        .routed(Stack::Decoder, blocks[1], 1, &[2])
        .and_then(|()| buffer.expert(damaged, None).map(|_| ()));
    match result {
        Err(edgemoe::Error::Checksum { expert, .. }) => assert_eq!(expert, damaged),
        Err(other) => panic!("expected the checksum error of {damaged}, got {other}"),
        Ok(()) => panic!("the damaged {damaged} was computed with"),
    }
    assert_eq!(buffer.stats().prefetch.failed, 1);
}
