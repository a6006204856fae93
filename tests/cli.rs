//! The `edgemoe` binary end to end, for both architectures: convert, summarize and inspect a
//! Switch bundle; generate, stream, sample and inspect with a decoder-only one; each command
//! refuses the other architecture; rouge, eval, bench and probe-storage; and a clear error with
//! a non-zero exit (never a panic) for each kind of bad input or damaged bundle. (Converting
//! bad checkpoints: `convert.rs`; `calibrate` and `tune-bits`: `calibrate_tune.rs`.)

mod common;

use std::path::{Path, PathBuf};

use common::cli::{
    assert_fails, assert_usage, mkfifo, run, run_with_closed_stdout, run_within, stderr, stdout,
};
use common::golden::{decoder_golden, samsum_golden};

use edgemoe::bundle::EXPERTS_FILE;
use edgemoe::config::ModelSpec;
use edgemoe::ids::ExpertId;
use edgemoe::ids::Stack;
use edgemoe::store::ExpertStore;
use edgemoe::Error;

fn demo_bundle(dir: &Path) -> PathBuf {
    common::convert_to(&common::demo_checkpoint(), dir)
}

fn first_dialogue() -> String {
    let text = std::fs::read_to_string(common::samsum("test")).unwrap();
    text.lines().next().unwrap().to_string()
}

fn expected_first_ids() -> Vec<i64> {
    samsum_golden().rows[0].output_ids.clone()
}

#[test]
fn convert_summarize_and_inspect() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = dir.path().join("demo");
    let hf = common::demo_checkpoint();
    let out = run(
        &[
            "convert",
            "--hf",
            hf.to_str().unwrap(),
            "--out",
            bundle.to_str().unwrap(),
        ],
        None,
    );
    assert!(out.status.success(), "{}", stderr(&out));

    let stats_path = dir.path().join("stats.json");
    let out = run(
        &[
            "summarize",
            "--model",
            bundle.to_str().unwrap(),
            "--budget",
            "1GiB",
            "--stats-json",
            stats_path.to_str().unwrap(),
            "--ids",
        ],
        Some(&first_dialogue()),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let printed: Vec<i64> = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect();
    assert_eq!(printed, expected_first_ids());
    assert!(stderr(&out).contains("tokens/s") && stderr(&out).contains("hit ratio"));

    let stats: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats_path).unwrap()).unwrap();
    for key in [
        "tokens_generated",
        "decode_ms_per_token",
        "hit_ratio",
        "bytes_read",
        "peak_rss_bytes",
        "resident_bytes",
        "buffer_bytes",
        "output_ids",
    ] {
        assert!(stats.get(key).is_some(), "stats lack `{key}`: {stats}");
    }
    assert_eq!(stats["tokens_generated"], printed.len());
    assert_eq!(stats["output_ids"][0], serde_json::json!(printed));
    assert!(stats["bytes_read"].as_u64().unwrap() > 0);
    let budget = stats["budget_bytes"].as_u64().unwrap();
    let used = stats["resident_bytes"].as_u64().unwrap()
        + stats["working_bytes"].as_u64().unwrap()
        + stats["buffer_bytes"].as_u64().unwrap();
    assert!(used <= budget);

    // Text output, plain-text input, beam search.
    let out = run(
        &[
            "summarize",
            "--model",
            bundle.to_str().unwrap(),
            "--beams",
            "3",
            "-q",
        ],
        Some("Anna: are we meeting at 5?\nBob: yes, at the cinema.\n"),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!String::from_utf8(out.stdout).unwrap().trim().is_empty());

    let out = run(&["inspect", bundle.to_str().unwrap()], None);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("64 experts") && text.contains("64 × f16 (16 bits)"),
        "{text}"
    );
}

#[test]
fn json_lines_give_one_summary_per_line() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = demo_bundle(dir.path());
    let input = dir.path().join("in.jsonl");
    std::fs::write(
        &input,
        "{\"dialogue\": \"A: hi\\nB: hello\"}\n{\"document\": \"Tom: I'm late.\"}\n",
    )
    .unwrap();
    let out = run(
        &[
            "summarize",
            "--model",
            bundle.to_str().unwrap(),
            "--input",
            input.to_str().unwrap(),
            "-q",
        ],
        None,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(String::from_utf8(out.stdout).unwrap().lines().count(), 2);
}

#[test]
fn missing_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nothing-here");
    let out = run(
        &["summarize", "--model", missing.to_str().unwrap()],
        Some("hi"),
    );
    assert_fails(&out, &["nothing-here", "not found"]);

    let bundle = demo_bundle(dir.path());
    std::fs::remove_file(bundle.join("resident.safetensors")).unwrap();
    let out = run(
        &["summarize", "--model", bundle.to_str().unwrap()],
        Some("hi"),
    );
    assert_fails(&out, &["resident.safetensors", "missing"]);

    let out = run(
        &[
            "convert",
            "--hf",
            missing.to_str().unwrap(),
            "--out",
            dir.path().join("o").to_str().unwrap(),
        ],
        None,
    );
    assert_fails(&out, &["nothing-here", "not found"]);

    let input = dir.path().join("absent.txt");
    let bundle = demo_bundle(&dir.path().join("b2"));
    let out = run(
        &[
            "summarize",
            "--model",
            bundle.to_str().unwrap(),
            "--input",
            input.to_str().unwrap(),
        ],
        None,
    );
    assert_fails(&out, &["absent.txt"]);
}

#[test]
fn wrong_magic_and_version_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = demo_bundle(dir.path());
    let store = bundle.join(EXPERTS_FILE);
    let mut bytes = std::fs::read(&store).unwrap();
    bytes[8] = 99; // format version
    std::fs::write(&store, &bytes).unwrap();
    let out = run(
        &["summarize", "--model", bundle.to_str().unwrap()],
        Some("hi"),
    );
    assert_fails(&out, &["experts.bin", "version 99"]);

    bytes[0] = b'X'; // magic
    std::fs::write(&store, &bytes).unwrap();
    let out = run(
        &["summarize", "--model", bundle.to_str().unwrap()],
        Some("hi"),
    );
    assert_fails(&out, &["experts.bin", "bad magic"]);

    let config = bundle.join("config.json");
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("\"format_version\": 1", "\"format_version\": 7");
    std::fs::write(&config, text).unwrap();
    // As a newer engine would write it: its manifest matches (else the checksum answers).
    common::checkpoint::reseal(&bundle, "config.json");
    let out = run(&["inspect", bundle.to_str().unwrap()], None);
    assert_fails(&out, &["config.json", "format version 7"]);

    std::fs::write(&config, "{ not json").unwrap();
    common::checkpoint::reseal(&bundle, "config.json");
    let out = run(&["inspect", bundle.to_str().unwrap()], None);
    assert_fails(&out, &["config.json", "invalid JSON"]);
}

#[test]
fn truncated_store_names_the_first_missing_expert() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = demo_bundle(dir.path());
    let store = bundle.join(EXPERTS_FILE);
    let len = std::fs::metadata(&store).unwrap().len();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&store)
        .unwrap();
    file.set_len(len - 300_000).unwrap();
    let out = run(
        &["summarize", "--model", bundle.to_str().unwrap()],
        Some("hi"),
    );
    assert_fails(
        &out,
        &["experts.bin", "truncated", "expert 7 of decoder block 3"],
    );

    file.set_len(10).unwrap();
    let out = run(&["inspect", bundle.to_str().unwrap()], None);
    assert_fails(&out, &["experts.bin", "truncated"]);
}

fn spec_of(bundle: &Path) -> ModelSpec {
    edgemoe::bundle::Bundle::open(bundle).unwrap().config.model
}

fn flip_byte_of(bundle: &Path, id: ExpertId) {
    let store =
        ExpertStore::open(&bundle.join(EXPERTS_FILE), &spec_of(bundle).expert_layout()).unwrap();
    let offset = store.entry(id).unwrap().offset + 1000;
    drop(store);
    let path = bundle.join(EXPERTS_FILE);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[offset as usize] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
}

#[test]
fn flipped_byte_is_reported_naming_the_expert_when_read() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = demo_bundle(dir.path());
    let spec = spec_of(&bundle);
    let victim = ExpertId {
        stack: Stack::Decoder,
        layer: 2,
        expert: 5,
    };
    flip_byte_of(&bundle, victim);
    // Opening still works (checksums are verified on read); other experts read fine.
    let store = ExpertStore::open(&bundle.join(EXPERTS_FILE), &spec.expert_layout()).unwrap();
    let mut slot = vec![0u8; store.max_padded_expert_bytes() as usize];
    store
        .read_expert(
            ExpertId {
                expert: 4,
                ..victim
            },
            &mut slot,
        )
        .unwrap();
    match store.read_expert(victim, &mut slot) {
        Err(Error::Checksum { expert, .. }) => assert_eq!(expert, victim),
        other => panic!("expected a checksum error, got {other:?}"),
    }

    // Through the CLI: corrupt every expert of encoder block 0, which every input uses.
    for expert in 0..spec.num_experts() as u16 {
        flip_byte_of(
            &bundle,
            ExpertId {
                stack: Stack::Encoder,
                layer: 0,
                expert,
            },
        );
    }
    let out = run(
        &["summarize", "--model", bundle.to_str().unwrap()],
        Some("Anna: hi"),
    );
    assert_fails(
        &out,
        &["experts.bin", "checksum mismatch", "of encoder block 0"],
    );
}

#[test]
fn budget_too_small_says_the_minimum() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = demo_bundle(dir.path());
    let out = run(
        &[
            "summarize",
            "--model",
            bundle.to_str().unwrap(),
            "--budget",
            "20MiB",
        ],
        Some("Anna: hi"),
    );
    assert_fails(
        &out,
        &["budget 20.0 MiB is too small", "the minimum budget is"],
    );

    let out = run(
        &[
            "summarize",
            "--model",
            bundle.to_str().unwrap(),
            "--budget",
            "lots",
        ],
        Some("Anna: hi"),
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("invalid size `lots`"));
}

#[test]
fn empty_input_and_bad_flags() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = demo_bundle(dir.path());
    let out = run(
        &["summarize", "--model", bundle.to_str().unwrap()],
        Some("  \n\n"),
    );
    assert_fails(&out, &["empty input", "standard input"]);

    let out = run(
        &["summarize", "--model", bundle.to_str().unwrap()],
        Some("{\"summary\": \"no dialogue here\"}\n"),
    );
    assert_fails(&out, &["line 1", "dialogue"]);

    let out = run(
        &[
            "summarize",
            "--model",
            bundle.to_str().unwrap(),
            "--beams",
            "0",
        ],
        Some("x"),
    );
    assert_eq!(out.status.code(), Some(2));
    let out = run(&["summarize", "--no-such-flag"], Some("x"));
    assert_eq!(out.status.code(), Some(2));
    assert!(!stderr(&out).contains("panicked"));
}

#[test]
fn rouge_scores_files_and_eval_scores_a_corpus() {
    let dir = tempfile::tempdir().unwrap();
    let pred = dir.path().join("pred.txt");
    let reference = dir.path().join("ref.txt");
    std::fs::write(&pred, "the cat sat on the mat\nrunning fast\n").unwrap();
    std::fs::write(&reference, "the cat sat on a mat\nhe runs fast\n").unwrap();
    let out = run(
        &[
            "rouge",
            "--pred",
            pred.to_str().unwrap(),
            "--ref",
            reference.to_str().unwrap(),
            "--json",
        ],
        None,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let scores: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // Pair 1: 5 of 6 unigrams match; pair 2: "fast" only (1/2 and 1/3).
    let r1 = scores["rouge1"]["fmeasure"].as_f64().unwrap();
    let expected = (5.0 / 6.0 + 2.0 * 0.5 * (1.0 / 3.0) / (0.5 + 1.0 / 3.0)) / 2.0;
    assert!((r1 - expected).abs() < 1e-12, "{r1} vs {expected}");

    std::fs::write(&reference, "only one line\n").unwrap();
    let out = run(
        &[
            "rouge",
            "--pred",
            pred.to_str().unwrap(),
            "--ref",
            reference.to_str().unwrap(),
        ],
        None,
    );
    assert_fails(&out, &["pred.txt", "ref.txt"]);

    let bundle = demo_bundle(dir.path());
    let data = dir.path().join("two.jsonl");
    let text = std::fs::read_to_string(common::samsum("test")).unwrap();
    std::fs::write(&data, text.lines().take(2).collect::<Vec<_>>().join("\n")).unwrap();
    let out = run(
        &[
            "eval",
            "--model",
            bundle.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--json",
        ],
        None,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["documents"], 2);
    assert!(report["rouge"]["rouge1"]["fmeasure"].as_f64().unwrap() > 0.0);
    assert!(report["run"]["decode_ms_per_token"].as_f64().unwrap() > 0.0);

    std::fs::write(&data, "{\"dialogue\": \"A: hi\"}\n").unwrap();
    let out = run(
        &[
            "eval",
            "--model",
            bundle.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
        ],
        None,
    );
    assert_fails(&out, &["two.jsonl line 1", "summary"]);
}

/// ROUGE on one very long line: the LCS of two 1 MiB single-line texts of 524,288 tokens each
/// (a two-word alphabet, the worst case for matching pairs) took the table algorithm minutes to
/// hours; bit-parallel it takes seconds. Twice as many tokens is refused by name, not run.
#[test]
fn rouge_on_one_very_long_line_finishes_in_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let pred = dir.path().join("pred.txt");
    let reference = dir.path().join("ref.txt");
    std::fs::write(&pred, "a ".repeat(1 << 19)).unwrap();
    std::fs::write(&reference, "b a ".repeat(1 << 18)).unwrap();
    let args = [
        "rouge",
        "--pred",
        pred.to_str().unwrap(),
        "--ref",
        reference.to_str().unwrap(),
        "--json",
    ];
    let out = run_within(&args, 60);
    let scores: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    // Every `a` of the reference is matched in order: LCS 262,144 of 524,288 tokens each side.
    assert_eq!(scores["rouge_l"]["precision"], 0.5, "{scores}");
    assert_eq!(scores["rouge_l"]["recall"], 0.5, "{scores}");

    std::fs::write(&pred, "a ".repeat(1 << 20)).unwrap();
    let out = run_within(&args, 60);
    assert_fails(
        &out,
        &["pred.txt", "line 1", "1048576-token prediction", "ROUGE-L"],
    );
}

#[test]
fn bench_smoke_two_modes_with_emulated_storage() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = demo_bundle(dir.path());
    let out = dir.path().join("bench");
    let done = run(
        &[
            "bench",
            "--model",
            bundle.to_str().unwrap(),
            "--data",
            common::samsum("test").to_str().unwrap(),
            "--limit",
            "1",
            "--profile",
            "rpi5-nvme",
            "--modes",
            "io-exp,mmap,edgemoe",
            "--buffer-experts",
            "6",
            "--max-new-tokens",
            "8",
            "--policy",
            "lru",
            "--out",
            out.to_str().unwrap(),
        ],
        None,
    );
    assert!(done.status.success(), "{}", stderr(&done));
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(
        rows.len(),
        3,
        "a run failed: {}\n{}",
        std::fs::read_to_string(out.join("results.md")).unwrap_or_default(),
        stderr(&done)
    );
    // Where the runs were confined, mmap at 6 experts got what edgemoe holds with 6 slots:
    // less than edgemoe's whole budget, more than the 6 slots alone.
    let limit = |mode: &str| {
        rows.iter().find(|r| r["mode"] == mode).unwrap()["cgroup_limit_bytes"].as_u64()
    };
    if let (Some(mmap), Some(edgemoe)) = (limit("mmap"), limit("edgemoe")) {
        assert!(
            mmap < edgemoe && mmap > 6 * 512 * 1024,
            "{mmap} vs {edgemoe}"
        );
    }
    let md = std::fs::read_to_string(out.join("results.md")).unwrap();
    assert!(md.contains("process overhead"), "{md}");
    // `--policy` replaces the profile's (rpi5-nvme's is edgemoe) in every run.
    assert!(md.contains("policy lru"), "{md}");
    assert!(rows.iter().all(|r| r["policy"] == "lru"), "{rows:?}");
    for key in [
        "mode",
        "profile",
        "budget_bytes",
        "decode_ms_per_token",
        "p50_ms",
        "p90_ms",
        "sample_ms",
        "peak_rss_bytes",
        "bytes_read_per_token",
        "stall_ms_per_token",
        "hit_ratio",
    ] {
        assert!(rows[0].get(key).is_some(), "no `{key}` in {}", rows[0]);
    }
    assert_eq!(rows[1]["outputs_match_reference"], true);
    assert!(rows[0]["bytes_read_per_token"].as_f64().unwrap() > 0.0);
    for plot in [
        "latency.svg",
        "latency.png",
        "latency-vs-budget.svg",
        "latency-vs-budget.png",
        "sample-cdf.svg",
        "sample-cdf.png",
        "results.md",
    ] {
        assert!(out.join(plot).exists(), "{plot}");
    }

    let bad = run(
        &[
            "summarize",
            "--model",
            bundle.to_str().unwrap(),
            "--profile",
            "pi-zero",
        ],
        Some("hi"),
    );
    assert_usage(&bad, &["pi-zero", "rpi4-sd"]);
    let bad = run(
        &[
            "summarize",
            "--model",
            bundle.to_str().unwrap(),
            "--profile",
            "jetson-tx2-ssd",
        ],
        Some("hi"),
    );
    assert_fails(&bad, &["cuda", "--device cpu"]);
    let bad = run(
        &[
            "summarize",
            "--model",
            bundle.to_str().unwrap(),
            "--storage",
            "emulate",
        ],
        Some("hi"),
    );
    assert_usage(&bad, &["emulate", "--profile"]);
}

/// Every usage error — a value a flag cannot take, an unknown policy, mode, profile or device
/// name, flags that do not go together — exits 2 before any work starts (the model named here
/// does not exist, so a check made after opening it would fail differently). Several exited 1,
/// found only after the bundle was loaded.
#[test]
fn every_usage_error_exits_2_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-bundle");
    let m = missing.to_str().unwrap();
    let data = dir.path().join("data.jsonl");
    std::fs::write(&data, "{\"dialogue\": \"A: hi\", \"summary\": \"hi\"}\n").unwrap();
    let d = data.to_str().unwrap();
    let trace = dir.path().join("trace.jsonl");
    let t = trace.to_str().unwrap();
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["summarize", "--model", m, "--profile", "pi-zero"],
            &["pi-zero", "rpi4-sd"],
        ),
        (
            &["summarize", "--model", m, "--policy", "belady"],
            &["belady", "replay"],
        ),
        (&["summarize", "--model", m, "--policy", "mru"], &["mru"]),
        (&["summarize", "--model", m, "--mode", "turbo"], &["turbo"]),
        (
            &["summarize", "--model", m, "--kv-cache", "q4"],
            &["q4", "f32, f16 or int8"],
        ),
        (
            &["summarize", "--model", m, "--device", "gpu"],
            &["gpu", "cuda:N"],
        ),
        (
            &["summarize", "--model", m, "--device", "cuda:x"],
            &["cuda:x"],
        ),
        (
            &["summarize", "--model", m, "--storage", "emulate"],
            &["emulate", "--profile"],
        ),
        (
            &["summarize", "--model", m, "--mode", "io-free", "--trace", t],
            &["--trace", "io-free"],
        ),
        (
            &["summarize", "--model", m, "--mode", "q"],
            &["`q`", "--quantized"],
        ),
        (
            &[
                "summarize",
                "--model",
                m,
                "--prefetch-cap",
                "1MiB",
                "--no-prefetch",
            ],
            &["--prefetch-cap", "--no-prefetch"],
        ),
        (
            &[
                "generate", "--model", m, "--prompt", "x", "--device", "cuda",
            ],
            &["--device cpu"],
        ),
        (
            &["eval", "--model", m, "--data", d, "--limit", "0"],
            &["--limit"],
        ),
        (
            &["eval", "--model", m, "--data", d, "--policy", "belady"],
            &["belady"],
        ),
        (
            &["calibrate", "--model", m, "--data", d, "--limit", "0"],
            &["--limit"],
        ),
        (
            &["calibrate", "--model", m, "--data", d, "--eval-limit", "0"],
            &["--eval-limit"],
        ),
        (
            &[
                "tune-bits",
                "--model",
                m,
                "--data",
                d,
                "--max-loss",
                "5%",
                "--limit",
                "0",
                "--out",
                "p.json",
            ],
            &["--limit"],
        ),
        (
            &[
                "tune-bits",
                "--model",
                m,
                "--data",
                d,
                "--max-loss",
                "150%",
                "--out",
                "p.json",
            ],
            &["--max-loss"],
        ),
        (
            &[
                "bench", "--model", m, "--data", d, "--limit", "0", "--out", "o",
            ],
            &["--limit"],
        ),
        (
            &[
                "bench",
                "--model",
                m,
                "--data",
                d,
                "--profile",
                "pi-zero",
                "--out",
                "o",
            ],
            &["pi-zero"],
        ),
        (
            &[
                "bench",
                "--model",
                m,
                "--data",
                d,
                "--buffer-experts",
                "4,0",
                "--out",
                "o",
            ],
            &["--buffer-experts"],
        ),
        (
            &[
                "bench",
                "--model",
                m,
                "--data",
                d,
                "--modes",
                "edgemoe,turbo",
                "--out",
                "o",
            ],
            &["turbo"],
        ),
        (&["replay", "--trace", t, "--policy", "lru,mru"], &["mru"]),
        (
            &[
                "bench", "--model", m, "--data", d, "--policy", "belady", "--out", "o",
            ],
            &["belady", "replay"],
        ),
        (&["replay", "--trace", t, "--slots", "4,0"], &["--slots"]),
        (
            &["convert", "--hf", m, "--out", "o", "--bits", "3"],
            &["--bits"],
        ),
        (
            &["convert", "--hf", m, "--out", "o", "--resident", "int3"],
            &["--resident"],
        ),
    ];
    for (args, needles) in cases {
        let out = run(args, None);
        assert_usage(&out, needles);
    }
}

/// `bench` whose every run fails exits 1 saying so (it exited 0 with an empty table); when some
/// runs fail, the others' results are kept, the failures listed in `results.md` and counted on
/// standard error, exit 0.
#[test]
fn bench_fails_when_every_run_fails_and_keeps_partial_results() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = demo_bundle(dir.path());
    let data = dir.path().join("one.jsonl");
    std::fs::write(
        &data,
        "{\"dialogue\": \"Ann: the bus is late. Bob: ok.\"}\n",
    )
    .unwrap();
    let bench = |budgets: &str, out: &str| {
        let out = dir.path().join(out);
        let result = run(
            &[
                "bench",
                "--model",
                bundle.to_str().unwrap(),
                "--data",
                data.to_str().unwrap(),
                "--limit",
                "1",
                "--profile",
                "rpi5-nvme",
                "--modes",
                "edgemoe",
                "--budgets",
                budgets,
                "--max-new-tokens",
                "4",
                "--no-cgroup",
                "--out",
                out.to_str().unwrap(),
            ],
            None,
        );
        (result, out)
    };
    let (all_failed, _) = bench("1MiB", "all");
    assert_fails(&all_failed, &["every run", "1 of 1", "budget"]);

    let (partial, out) = bench("1MiB,1GiB", "partial");
    let err = stderr(&partial);
    assert!(partial.status.success(), "{err}");
    assert!(err.contains("1 of 2 runs failed"), "{err}");
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(rows.as_array().unwrap().len(), 1, "{rows}");
    assert_eq!(rows[0]["budget_bytes"], 1u64 << 30);
    let md = std::fs::read_to_string(out.join("results.md")).unwrap();
    assert!(
        md.contains("1 of 2 runs failed") && md.contains("budget"),
        "{md}"
    );
}

#[test]
fn probe_storage_measures_every_size_and_depth() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(
        &[
            "probe-storage",
            dir.path().to_str().unwrap(),
            "--size",
            "16MiB",
            "--seconds",
            "0.02",
            "--json",
        ],
        None,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows.as_array().unwrap().len(), 30);
    assert!(rows[0]["bytes_per_s"].as_f64().unwrap() > 0.0);
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "test file removed"
    );
    let missing = run(
        &["probe-storage", dir.path().join("nope").to_str().unwrap()],
        None,
    );
    assert_fails(&missing, &["nope"]);
}

/// `probe-storage --write-profile FILE` writes a profile with the measured storage figures
/// (queue depth included) over a built-in base, which `summarize --profile FILE` then takes; it
/// refuses to write over the file it probes or the profile it starts from.
#[test]
fn probe_storage_writes_a_profile_the_engine_loads() {
    let dir = tempfile::tempdir().unwrap();
    let probe = dir.path().join("probe");
    std::fs::create_dir(&probe).unwrap();
    let profile = dir.path().join("my-board.toml");
    let out = run(
        &[
            "probe-storage",
            probe.to_str().unwrap(),
            "--size",
            "16MiB",
            "--seconds",
            "0.02",
            "--write-profile",
            profile.to_str().unwrap(),
            "--base",
            "rpi5-nvme",
        ],
        None,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let p = edgemoe::config::profile::DeviceProfile::load(profile.to_str().unwrap()).unwrap();
    let base = edgemoe::config::profile::DeviceProfile::load("rpi5-nvme").unwrap();
    assert_eq!(p.name, "my-board");
    assert!((1..=16).contains(&p.queue_depth), "{}", p.queue_depth);
    assert!(p.read_bytes_per_s > 0.0);
    assert_eq!(
        (p.budget_bytes, p.threads),
        (base.budget_bytes, base.threads)
    );
    let text = std::fs::read_to_string(&profile).unwrap();
    assert!(text.contains("storage_queue_depth"), "{text}");
    // A run takes it by path: its reads are paced to it, and its statistics name it.
    let bundle = demo_bundle(&dir.path().join("b"));
    let stats = dir.path().join("stats.json");
    let out = run(
        &[
            "summarize",
            "--model",
            bundle.to_str().unwrap(),
            "--profile",
            profile.to_str().unwrap(),
            "--storage",
            "emulate",
            "--buffer-experts",
            "8",
            "--max-new-tokens",
            "4",
            "--stats-json",
            stats.to_str().unwrap(),
            "-q",
        ],
        Some(&first_dialogue()),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let stats: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    assert_eq!(stats["profile"], "my-board", "{stats}");
    assert_eq!(stats["mode"], "edgemoe", "{stats}");
    assert!(stats["stall_ms"].as_f64().unwrap() > 0.0, "{stats}");
    // Its own inputs are never overwritten.
    let before = std::fs::read(&profile).unwrap();
    let out = run(
        &[
            "probe-storage",
            probe.to_str().unwrap(),
            "--size",
            "16MiB",
            "--write-profile",
            profile.to_str().unwrap(),
            "--base",
            profile.to_str().unwrap(),
        ],
        None,
    );
    assert_fails(&out, &["--write-profile", "--base"]);
    assert_eq!(std::fs::read(&profile).unwrap(), before);
    let big = dir.path().join("big.bin");
    std::fs::write(&big, vec![7u8; 8 << 20]).unwrap();
    let out = run(
        &[
            "probe-storage",
            big.to_str().unwrap(),
            "--write-profile",
            big.to_str().unwrap(),
        ],
        None,
    );
    assert_fails(&out, &["--write-profile", "big.bin"]);
    assert_eq!(std::fs::metadata(&big).unwrap().len(), 8 << 20);
}

/// `probe-storage --size 0` (or any size below the 8 MiB a probe needs) is a usage error naming
/// `--size`, not "failed to fill whole buffer" after writing an empty file; so is a bad
/// `--seconds`.
#[test]
fn probe_storage_refuses_tiny_sizes_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    for size in ["0", "1", "4KiB", "8388607"] {
        let out = run(&["probe-storage", d, "--size", size], None);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "--size {size}: {err}");
        assert!(
            err.contains("--size") && err.contains("at least 8.00 MiB"),
            "{err}"
        );
    }
    for seconds in ["0", "-1", "61", "nan"] {
        let flag = format!("--seconds={seconds}");
        let out = run(&["probe-storage", d, &flag], None);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "--seconds {seconds}: {err}");
        assert!(err.contains("--seconds"), "{err}");
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// An interrupted `probe-storage` (SIGINT while the test file is written, SIGTERM while it is
/// read) removes its test file and dies of the signal; it left 256 MiB behind.
#[test]
fn interrupted_probe_storage_removes_its_test_file() {
    use std::os::unix::process::ExitStatusExt;
    for (signal, size, seconds) in [(libc::SIGINT, "2GiB", "0.5"), (libc::SIGTERM, "8MiB", "30")] {
        let dir = tempfile::tempdir().unwrap();
        let mut child = common::cli::start(&[
            "probe-storage",
            dir.path().to_str().unwrap(),
            "--size",
            size,
            "--seconds",
            seconds,
        ]);
        // Wait for the file to exist and (for the second case) to be fully written.
        let started = std::time::Instant::now();
        let want = if signal == libc::SIGINT { 1 } else { 8 << 20 };
        loop {
            let len = std::fs::read_dir(dir.path())
                .unwrap()
                .filter_map(|e| e.ok()?.metadata().ok())
                .map(|m| m.len())
                .max();
            if len.is_some_and(|len| len >= want) {
                break;
            }
            assert!(child.try_wait().unwrap().is_none(), "probe ended early");
            assert!(started.elapsed().as_secs() < 60, "no probe file appeared");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        if signal == libc::SIGTERM {
            std::thread::sleep(std::time::Duration::from_millis(300));
        }
        common::cli::send_signal(&child, signal);
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(signal), "{status:?}");
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert!(left.is_empty(), "left behind: {left:?}");
    }
}

#[test]
fn generate_streams_the_golden_text_and_samples_reproducibly() {
    let golden = decoder_golden("tiny-mixtral");
    let dir = tempfile::tempdir().unwrap();
    let bundle = common::convert_to(&common::fixture("tiny-mixtral"), dir.path());
    let b = bundle.to_str().unwrap();
    for case in &golden.cases {
        let out = run(
            &[
                "generate",
                "--model",
                b,
                "--prompt",
                &case.prompt,
                "--buffer-experts",
                "3",
                "--storage",
                "cached",
            ],
            None,
        );
        assert_eq!(stdout(&out), format!("{}\n", case.greedy_text));
        let stats = stderr(&out);
        assert!(stats.contains("24 tokens"), "{stats}");
    }
    let case = &golden.cases[1];
    let ids: Vec<String> = case.input_ids.iter().map(|t| t.to_string()).collect();
    let stats_path = dir.path().join("stats.json");
    let out = run(
        &[
            "generate",
            "--model",
            b,
            "--prompt-ids",
            &ids.join(","),
            "--ids",
            "--no-prefetch",
            "--stats-json",
            stats_path.to_str().unwrap(),
            "-q",
        ],
        None,
    );
    let expected: Vec<String> = case.greedy.iter().map(|t| t.to_string()).collect();
    assert_eq!(stdout(&out), format!("{}\n", expected.join(" ")));
    let stats: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats_path).unwrap()).unwrap();
    assert_eq!(stats["tokens_generated"], 24);
    assert_eq!(stats["samples"][0]["source_tokens"], case.input_ids.len());

    let sample = |seed: &str| {
        stdout(&run(
            &[
                "generate",
                "--model",
                b,
                "--prompt",
                "The",
                "--temperature",
                "1.5",
                "--top-p",
                "0.9",
                "--seed",
                seed,
                "--ids",
                "-q",
            ],
            None,
        ))
    };
    assert_eq!(sample("7"), sample("7"));
    assert_ne!(
        sample("7"),
        stdout(&run(
            &["generate", "--model", b, "--prompt", "The", "--ids", "-q"],
            None
        ))
    );

    let inspect = stdout(&run(&["inspect", b], None));
    assert!(
        inspect.contains("mixtral") && inspect.contains("top-2"),
        "{inspect}"
    );
}

#[test]
fn commands_refuse_the_other_architecture() {
    let dir = tempfile::tempdir().unwrap();
    let decoder = common::convert_to(&common::fixture("tiny-olmoe"), &dir.path().join("d"));
    let switch = common::convert_to(&common::fixture("tiny-tied-e4"), &dir.path().join("s"));
    let input = dir.path().join("doc.txt");
    std::fs::write(&input, "Anna: hi").unwrap();
    let out = run(
        &[
            "summarize",
            "--model",
            decoder.to_str().unwrap(),
            "--input",
            input.to_str().unwrap(),
        ],
        None,
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("olmoe") && err.contains("edgemoe generate"),
        "{err}"
    );
    let out = run(
        &[
            "generate",
            "--model",
            switch.to_str().unwrap(),
            "--prompt-ids",
            "5,6",
        ],
        None,
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("edgemoe summarize"), "{err}");
    let out = run(
        &[
            "generate",
            "--model",
            decoder.to_str().unwrap(),
            "--prompt-ids",
            "5,999",
        ],
        None,
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("999") && err.contains("vocabulary"), "{err}");
}

/// `--kv-cache` reaches the run of either architecture: the statistics name the format, and an
/// INT8 cache sets less working memory aside than f32.
#[test]
fn kv_cache_flag_reaches_the_run_of_either_architecture() {
    let dir = tempfile::tempdir().unwrap();
    let decoder = common::convert_to(&common::fixture("tiny-olmoe"), &dir.path().join("d"));
    let switch = common::convert_to(&common::fixture("tiny-untied-e8"), &dir.path().join("s"));
    let input = dir.path().join("doc.txt");
    std::fs::write(&input, "Anna: are you coming tonight? Ben: yes, at eight.").unwrap();
    let (s, d, i) = (
        switch.to_str().unwrap(),
        decoder.to_str().unwrap(),
        input.to_str().unwrap(),
    );
    let runs: [(&str, &[&str]); 2] = [
        ("summarize", &["--model", s, "--input", i]),
        (
            "generate",
            &[
                "--model",
                d,
                "--prompt-ids",
                "5,6,7",
                "--max-new-tokens",
                "4",
            ],
        ),
    ];
    for (command, args) in runs {
        let mut working = Vec::new();
        for format in ["f32", "int8"] {
            let stats = dir.path().join(format!("{command}-{format}.json"));
            let mut all = vec![command];
            all.extend_from_slice(args);
            all.extend([
                "--kv-cache",
                format,
                "--ids",
                "--stats-json",
                stats.to_str().unwrap(),
            ]);
            let out = run(&all, None);
            assert!(out.status.success(), "{command}: {}", stderr(&out));
            let stats: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
            assert_eq!(stats["kv_cache"], format, "{command}");
            working.push(stats["working_bytes"].as_u64().unwrap());
        }
        assert!(
            working[1] < working[0],
            "{command}: working bytes {working:?}"
        );
    }
}

/// Every command that prints ends quietly when its standard output is closed (`| head -1`):
/// killed by SIGPIPE like `cat`, never Rust's "failed printing to stdout" panic (exit 101).
#[test]
fn closed_stdout_ends_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    let bundle = demo_bundle(&dir.path().join("b"));
    let doc = dir.path().join("doc.txt");
    std::fs::write(&doc, first_dialogue()).unwrap();
    let data = dir.path().join("one.jsonl");
    let text = std::fs::read_to_string(common::samsum("test")).unwrap();
    std::fs::write(&data, text.lines().next().unwrap()).unwrap();
    let trace = dir.path().join("trace.jsonl");
    let b = bundle.to_str().unwrap();
    let out = run(
        &[
            "summarize",
            "--model",
            b,
            "--input",
            doc.to_str().unwrap(),
            "--max-new-tokens",
            "4",
            "--trace",
            trace.to_str().unwrap(),
        ],
        None,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    // The demo model's trace has both stacks: the table gives each one's hit ratios too, and
    // the misses per document (one document here).
    let table = stdout(&run(&["replay", "--trace", trace.to_str().unwrap()], None));
    for title in [
        "hit ratio",
        "decoder hit ratio",
        "encoder hit ratio",
        "demand misses",
        "misses / document",
    ] {
        assert_eq!(
            table.lines().filter(|l| l.starts_with(title)).count(),
            1,
            "{title}: {table}"
        );
    }
    // A policy named twice is replayed once: one row of one value per buffer size in each
    // block of the table, not a doubled row under the same headers.
    let twice = stdout(&run(
        &[
            "replay",
            "--trace",
            trace.to_str().unwrap(),
            "--policy",
            "lru,lru",
            "--slots",
            "2,4",
        ],
        None,
    ));
    let rows: Vec<&str> = twice.lines().filter(|l| l.starts_with("lru ")).collect();
    assert_eq!(rows.len(), 5, "{twice}");
    assert!(
        rows.iter().all(|r| r.split_whitespace().count() == 3),
        "{twice}"
    );
    let json = stdout(&run(
        &["replay", "--trace", trace.to_str().unwrap(), "--json"],
        None,
    ));
    let json: serde_json::Value = serde_json::from_str(&json).unwrap();
    let lru = &json["lru"]["2"];
    assert!(lru["misses"].as_u64().unwrap() > 0, "{json}");
    assert_eq!(
        lru["misses_per_document"].as_f64(),
        lru["misses"].as_f64(),
        "{json}"
    );
    let decoder = common::convert_to(&common::fixture("tiny-olmoe"), &dir.path().join("d"));
    let (doc, data, trace) = (
        doc.to_str().unwrap(),
        data.to_str().unwrap(),
        trace.to_str().unwrap(),
    );
    let commands: Vec<Vec<&str>> = vec![
        vec!["inspect", b],
        vec!["summarize", "--model", b, "--input", doc, "--ids", "-q"],
        vec!["summarize", "--model", b, "--input", doc, "-q"],
        vec![
            "generate",
            "--model",
            decoder.to_str().unwrap(),
            "--prompt-ids",
            "5,6",
            "--max-new-tokens",
            "3",
            "-q",
        ],
        vec!["replay", "--trace", trace],
        vec!["replay", "--trace", trace, "--json"],
        vec!["rouge", "--pred", doc, "--ref", doc],
        vec!["rouge", "--pred", doc, "--ref", doc, "--json"],
        vec!["eval", "--model", b, "--data", data, "--json"],
        vec!["eval", "--model", b, "--data", data],
    ];
    for args in commands {
        let out = run_with_closed_stdout(&args);
        let err = stderr(&out);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_ne!(out.status.code(), Some(101), "{args:?}: {err}");
        assert!(
            out.status.success() || out.status.signal() == Some(libc::SIGPIPE),
            "{args:?}: {:?} {err}",
            out.status
        );
        assert!(!err.contains("error:"), "{args:?}: {err}");
    }
}

/// A directory or FIFO where a bundle file or an input file should be is refused by name, at
/// once (opening a FIFO would block until some process writes to it).
#[test]
fn directories_and_fifos_are_refused_by_name_where_a_bundle_file_should_be() {
    let dir = tempfile::tempdir().unwrap();
    let doc = dir.path().join("doc.txt");
    std::fs::write(&doc, "Anna: hi").unwrap();
    let doc = doc.to_str().unwrap();
    let summarize = |bundle: &Path, input: &str| {
        run_within(
            &[
                "summarize",
                "--model",
                bundle.to_str().unwrap(),
                "--input",
                input,
            ],
            60,
        )
    };

    let bundle = demo_bundle(&dir.path().join("dir"));
    std::fs::remove_file(bundle.join("resident.safetensors")).unwrap();
    std::fs::create_dir(bundle.join("resident.safetensors")).unwrap();
    assert_fails(
        &summarize(&bundle, doc),
        &["resident.safetensors", "is a directory"],
    );

    for file in ["config.json", "experts.bin", "tokenizer.json"] {
        let bundle = demo_bundle(&dir.path().join(format!("fifo-{file}")));
        std::fs::remove_file(bundle.join(file)).unwrap();
        mkfifo(&bundle.join(file));
        assert_fails(
            &summarize(&bundle, doc),
            &[file, "not a regular file (FIFO)"],
        );
    }

    let bundle = demo_bundle(&dir.path().join("paths"));
    let _ = std::fs::remove_file(bundle.join("paths.bin"));
    mkfifo(&bundle.join("paths.bin"));
    assert_fails(&summarize(&bundle, doc), &["paths.bin", "FIFO"]);
    let inspect = run_within(&["inspect", bundle.to_str().unwrap()], 60);
    assert!(inspect.status.code().is_some(), "{}", stderr(&inspect));

    let bundle = demo_bundle(&dir.path().join("ok"));
    let input_dir = dir.path().join("input-dir");
    std::fs::create_dir(&input_dir).unwrap();
    assert_fails(
        &summarize(&bundle, input_dir.to_str().unwrap()),
        &["input-dir", "is a directory"],
    );
    // Input files the user names may be streams they chose (`<(cmd)`, /dev/stdin): a directory,
    // a socket or a block device is refused, a FIFO with a writer is read.
    let b = bundle.to_str().unwrap();
    for args in [
        vec!["eval", "--model", b, "--data", input_dir.to_str().unwrap()],
        vec!["rouge", "--pred", input_dir.to_str().unwrap(), "--ref", doc],
        vec!["replay", "--trace", input_dir.to_str().unwrap()],
        vec![
            "summarize",
            "--model",
            b,
            "--input",
            doc,
            "--profile",
            input_dir.to_str().unwrap(),
        ],
    ] {
        assert_fails(&run_within(&args, 60), &["input-dir", "is a directory"]);
    }
    let out = run(
        &[
            "summarize",
            "--model",
            b,
            "--input",
            "/dev/stdin",
            "--ids",
            "-q",
        ],
        Some("Anna: hi"),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stdout(&out).trim().is_empty());
    // `--input -` still reads standard input.
    let out = run(
        &["summarize", "--model", b, "--input", "-", "-q"],
        Some("Anna: hi"),
    );
    assert!(out.status.success(), "{}", stderr(&out));
}

/// An output path whose directory does not exist fails before anything runs: the error names
/// the flag and the path although the bundle does not exist either, and nothing is written.
#[test]
fn output_paths_are_checked_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let absent = dir.path().join("no-model");
    let absent = absent.to_str().unwrap();
    let out_file = dir.path().join("no-such-dir").join("out.json");
    let out_path = out_file.to_str().unwrap();
    let data = dir.path().join("data.jsonl");
    std::fs::write(&data, "{\"dialogue\": \"A: hi\", \"summary\": \"hi\"}\n").unwrap();
    let data = data.to_str().unwrap();
    let trace = dir.path().join("t.jsonl");
    std::fs::write(&trace, "").unwrap();
    let cases: Vec<(&str, Vec<&str>)> = vec![
        (
            "--predictions",
            vec![
                "eval",
                "--model",
                absent,
                "--data",
                data,
                "--predictions",
                out_path,
            ],
        ),
        (
            "--stats-json",
            vec!["summarize", "--model", absent, "--stats-json", out_path],
        ),
        (
            "--trace",
            vec!["summarize", "--model", absent, "--trace", out_path],
        ),
        (
            "--stats-json",
            vec![
                "generate",
                "--model",
                absent,
                "--prompt-ids",
                "5",
                "--stats-json",
                out_path,
            ],
        ),
        (
            "--json",
            vec![
                "calibrate",
                "--model",
                absent,
                "--data",
                data,
                "--json",
                out_path,
            ],
        ),
        (
            "--out",
            vec![
                "tune-bits",
                "--model",
                absent,
                "--data",
                data,
                "--max-loss",
                "0.1",
                "--out",
                out_path,
            ],
        ),
        (
            "--plot",
            vec![
                "replay",
                "--trace",
                trace.to_str().unwrap(),
                "--plot",
                out_path,
            ],
        ),
    ];
    for (flag, args) in cases {
        let out = run(&args, Some("Anna: hi"));
        assert_fails(&out, &[flag, "no-such-dir", "does not exist"]);
        assert!(!out_file.exists());
    }
    // A directory where the file should go, and a bench --out under a regular file.
    let stats_dir = dir.path().join("stats-dir");
    std::fs::create_dir(&stats_dir).unwrap();
    let out = run(
        &[
            "summarize",
            "--model",
            absent,
            "--stats-json",
            stats_dir.to_str().unwrap(),
        ],
        Some("Anna: hi"),
    );
    assert_fails(&out, &["--stats-json", "stats-dir", "is a directory"]);
    let bench_out = dir.path().join("data.jsonl").join("results");
    let out = run(
        &[
            "bench",
            "--model",
            absent,
            "--data",
            data,
            "--out",
            bench_out.to_str().unwrap(),
        ],
        None,
    );
    assert_fails(&out, &["--out", "data.jsonl", "not a directory"]);
}

/// Numbers the user typed size nothing without bound: a huge `replay --slots` is replayed as
/// "all experts" at once, a huge `--max-new-tokens` or `--buffer-experts` is a clean error or
/// capped, never an overflow panic or an abort.
#[test]
fn huge_numbers_on_the_command_line_allocate_nothing_unbounded() {
    use edgemoe::cache::trace::TraceWriter;
    use edgemoe::cache::{AccessKind, LayerMap, Policy, TraceEvent, TraceHeader};
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.jsonl");
    let mut writer = TraceWriter::create(
        &trace,
        &TraceHeader {
            edgemoe_trace: edgemoe::cache::trace::TRACE_VERSION,
            slots: 2,
            policy: Policy::Lru,
            prefetch: false,
            layers: LayerMap {
                encoder_moe_blocks: vec![],
                decoder_moe_blocks: vec![0, 1],
            },
            seeds: edgemoe::cache::Seeds::default(),
        },
    )
    .unwrap();
    for (layer, expert) in [(0, 0), (1, 1), (0, 2), (0, 0), (1, 1), (0, 2)] {
        writer
            .event(&TraceEvent {
                token: 0,
                kind: AccessKind::Demand,
                stack: Stack::Decoder,
                layer,
                expert,
                current: Some(layer),
                pinned: vec![],
                waited_ms: None,
            })
            .unwrap();
    }
    writer.finish().unwrap();
    let started = std::time::Instant::now();
    let out = run(
        &[
            "replay",
            "--trace",
            trace.to_str().unwrap(),
            "--slots",
            "2,18446744073709551615",
        ],
        None,
    );
    let text = stdout(&out);
    assert!(started.elapsed().as_secs() < 30);
    assert!(text.contains("3 (all experts)"), "{text}");
    assert!(!text.contains("18446744073709551615"), "{text}");
    let out = run(
        &[
            "replay",
            "--trace",
            trace.to_str().unwrap(),
            "--slots",
            "18446744073709551615",
            "--json",
        ],
        None,
    );
    let json: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(json["lru"]["3"]["hits"], 3, "{json}");
    // Each stack's share: all of this decoder-only trace's accesses are the decoder's.
    let at = &json["lru"]["3"];
    assert_eq!(
        [
            &at["decoder_hits"],
            &at["decoder_misses"],
            &at["encoder_hits"],
            &at["encoder_misses"]
        ],
        [3, 3, 0, 0],
        "{json}"
    );
    // A table by stack, and misses per document, only where both stacks have accesses.
    assert!(!text.contains("decoder hit ratio"), "{text}");
    assert!(!text.contains("misses / document"), "{text}");
    assert!(text.contains("demand misses"), "{text}");
    assert!(at.get("misses_per_document").is_none(), "{json}");

    let bundle = demo_bundle(dir.path());
    let out = run(
        &[
            "summarize",
            "--model",
            bundle.to_str().unwrap(),
            "--max-new-tokens",
            "18446744073709551615",
        ],
        Some("Anna: are we meeting at 5?\n"),
    );
    assert_fails(&out, &["budget"]);
    let out = run(
        &[
            "summarize",
            "--model",
            bundle.to_str().unwrap(),
            "--max-new-tokens",
            "4",
            "--buffer-experts",
            "4294967295",
            "-q",
        ],
        Some("Anna: are we meeting at 5?\n"),
    );
    assert!(out.status.success(), "{}", stderr(&out));

    // More compute threads than cores: a usage error (65,535 threads ran for minutes).
    let input = dir.path().join("hi.txt");
    std::fs::write(&input, "Anna: hi\n").unwrap();
    let out = run_within(
        &[
            "summarize",
            "--model",
            bundle.to_str().unwrap(),
            "--input",
            input.to_str().unwrap(),
            "--threads",
            "65535",
        ],
        60,
    );
    assert_usage(&out, &["--threads", "65535", "core"]);

    // tune-bits has no budget: a decoding length this machine cannot hold is refused up front
    // (it decoded on, growing, for hours).
    let data = dir.path().join("val.jsonl");
    std::fs::write(&data, "{\"dialogue\": \"A: hi\", \"summary\": \"hi\"}\n").unwrap();
    let plan = dir.path().join("plan.json");
    let out = run_within(
        &[
            "tune-bits",
            "--model",
            bundle.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--max-loss",
            "5%",
            "--max-new-tokens",
            "18446744073709551615",
            "--out",
            plan.to_str().unwrap(),
        ],
        60,
    );
    assert_fails(&out, &["--max-new-tokens", "working memory"]);

    // A probe file larger than the free space is refused before a byte is written.
    let probe = dir.path().join("probe");
    std::fs::create_dir(&probe).unwrap();
    let out = run_within(
        &[
            "probe-storage",
            probe.to_str().unwrap(),
            "--size",
            "1000000GiB",
        ],
        60,
    );
    assert_fails(&out, &["does not fit", "free"]);
    assert_eq!(std::fs::read_dir(&probe).unwrap().count(), 0);
}

/// The error line names each cause once: the library's errors already carry their cause, so the
/// binary must not repeat it (it printed "No such file or directory" twice).
#[test]
fn error_line_names_its_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("absent.txt");
    let out = run(
        &[
            "rouge",
            "--pred",
            missing.to_str().unwrap(),
            "--ref",
            missing.to_str().unwrap(),
        ],
        None,
    );
    assert_fails(&out, &["absent.txt"]);
    let err = stderr(&out);
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
}

/// `replay` labels Belady for what it bounds: over a trace recorded with prefetch, replayed
/// with its prefetches, it is the optimum of demand paging only (`belady-demand-only`, which
/// the other policies may pass); with `--demand-only`, or over a trace without prefetches, it
/// is the optimum (`belady (optimum)` in the table, `belady` in the JSON).
#[test]
fn replay_labels_belady_for_what_it_bounds() {
    use edgemoe::cache::trace::{read_trace, AccessKind};
    let dir = tempfile::tempdir().unwrap();
    let bundle = demo_bundle(&dir.path().join("b"));
    let doc = dir.path().join("doc.txt");
    std::fs::write(&doc, first_dialogue()).unwrap();
    let record = |name: &str, extra: &[&str]| {
        let trace = dir.path().join(name);
        let mut args = vec![
            "summarize",
            "--model",
            bundle.to_str().unwrap(),
            "--input",
            doc.to_str().unwrap(),
            "--max-new-tokens",
            "6",
            "--buffer-experts",
            "4",
            "--trace",
            trace.to_str().unwrap(),
            "-q",
        ];
        args.extend_from_slice(extra);
        let out = run(&args, None);
        assert!(out.status.success(), "{}", stderr(&out));
        trace
    };
    let with_prefetch = record("on.jsonl", &[]);
    let without = record("off.jsonl", &["--no-prefetch"]);
    let prefetches = |trace: &Path| {
        let (_, events) = read_trace(trace).unwrap();
        events
            .iter()
            .filter(|e| e.kind == AccessKind::Prefetch)
            .count()
    };
    assert!(prefetches(&with_prefetch) > 0, "the run read ahead");
    assert_eq!(prefetches(&without), 0);
    let replay = |trace: &Path, extra: &[&str]| {
        let mut args = vec![
            "replay",
            "--trace",
            trace.to_str().unwrap(),
            "--slots",
            "2,4",
        ];
        args.extend_from_slice(extra);
        stdout(&run(&args, None))
    };
    let row = |table: &str, name: &str| table.lines().any(|l| l.starts_with(name));
    let table = replay(&with_prefetch, &[]);
    assert!(row(&table, "belady-demand-only"), "{table}");
    assert!(!row(&table, "belady (optimum)"), "{table}");
    assert!(
        table.contains("the bound of demand paging"),
        "the label is explained: {table}"
    );
    for (trace, extra) in [
        (&with_prefetch, &["--demand-only"][..]),
        (&without, &[][..]),
    ] {
        let table = replay(trace, extra);
        assert!(row(&table, "belady (optimum)"), "{extra:?}: {table}");
        assert!(!table.contains("belady-demand-only"), "{extra:?}: {table}");
    }
    let keys = |trace: &Path, extra: &[&str]| -> Vec<String> {
        let mut args = extra.to_vec();
        args.push("--json");
        let json: serde_json::Value = serde_json::from_str(&replay(trace, &args)).unwrap();
        json.as_object().unwrap().keys().cloned().collect()
    };
    let on = keys(&with_prefetch, &[]);
    assert!(
        on.contains(&"belady-demand-only".to_string()) && !on.contains(&"belady".to_string()),
        "{on:?}"
    );
    let demand_only = keys(&with_prefetch, &["--demand-only"]);
    assert!(
        demand_only.contains(&"belady".to_string())
            && !demand_only.contains(&"belady-demand-only".to_string()),
        "{demand_only:?}"
    );
}
