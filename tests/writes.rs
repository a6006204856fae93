//! Writing is all or nothing: `convert` refuses an output that overlaps its inputs (symbolic
//! links resolved) or a folder that is not a bundle (unless `--force`) before it touches
//! anything, and replaces an existing bundle only once the new one is complete: a re-convert
//! that fails, or is killed at any moment, leaves the old bundle loadable and whole. The other
//! commands refuse, before writing anything, an output file that is one of their inputs (every
//! bundle included) or another of their outputs, or lies inside one; `tune-bits` checks the
//! files it writes beside its plan, `bench` writes only into a new or empty folder or an
//! earlier bench's, and `probe-storage` writes no profile into a bundle or over another file.

mod common;

use std::path::{Path, PathBuf};

use edgemoe::offline::bit_plan::BitPlan;

use common::checkpoint::{copy_dir, drop_tensor, poison_tensor, snapshot};
use common::cli::{assert_fails, assert_usage, run, stdout};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Asserts `bundle` verifies completely (every file against its manifest, every expert blob)
/// and loads: config, tokenizer, resident weights, expert store.
fn assert_bundle_whole(bundle: &Path) {
    for check in edgemoe::bundle::verify(bundle).unwrap() {
        assert!(
            matches!(check.outcome, edgemoe::bundle::Outcome::Ok(_)),
            "{}: {:?}",
            check.name,
            check.outcome
        );
    }
    let opened = edgemoe::bundle::Bundle::open(bundle).unwrap();
    opened.tokenizer().unwrap();
    opened.open_store().unwrap();
    opened.load_model(tch::Device::Cpu).unwrap();
}

/// The staging directories left beside `dir`'s entries (by a killed convert).
fn leftovers(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".partial"))
        .collect()
}

#[test]
fn an_output_overlapping_an_input_is_refused_and_the_input_kept() {
    let dir = tempfile::tempdir().unwrap();
    let hf = copy_dir(&common::demo_checkpoint(), dir.path());
    let bundle = common::convert_to(&hf, dir.path());
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&hf, &link).unwrap();
    let checkpoint_before = snapshot(&hf);
    let bundle_before = snapshot(&bundle);
    let plan_dir = dir.path().join("with-plan");
    std::fs::create_dir(&plan_dir).unwrap();
    let plan = plan_dir.join("plan.json");
    edgemoe::offline::bit_plan::BitPlan::default()
        .save(&plan)
        .unwrap();
    let tokenizer = bundle.join("tokenizer.json");
    let inside = link.join("sub");
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (
            vec!["--hf", s(&hf), "--out", s(&hf)],
            vec!["--out", "is the same path as --hf"],
        ),
        // Through a symbolic link, either way round.
        (
            vec!["--hf", s(&link), "--out", s(&hf)],
            vec!["is the same path as --hf", s(&link)],
        ),
        (
            vec!["--hf", s(&hf), "--out", s(&link)],
            vec!["is the same path as --hf", s(&link)],
        ),
        (
            vec!["--hf", s(&hf), "--out", s(&inside)],
            vec!["lies inside --hf"],
        ),
        (
            vec!["--hf", s(&hf), "--out", s(dir.path())],
            vec!["contains --hf"],
        ),
        (
            vec![
                "--hf",
                s(&hf),
                "--tokenizer",
                s(&tokenizer),
                "--out",
                s(&bundle),
            ],
            vec!["contains --tokenizer", s(&tokenizer)],
        ),
        (
            vec!["--hf", s(&hf), "--plan", s(&plan), "--out", s(&plan_dir)],
            vec!["contains --plan", s(&plan)],
        ),
    ];
    for (args, needles) in cases {
        let out = run(&[&["convert"][..], &args].concat(), None);
        assert_fails(&out, &needles);
        assert!(
            snapshot(&hf) == checkpoint_before,
            "{args:?} changed the checkpoint"
        );
        assert!(
            snapshot(&bundle) == bundle_before,
            "{args:?} changed the bundle"
        );
        assert!(plan.exists() && std::fs::read_dir(&plan_dir).unwrap().count() == 1);
        assert!(leftovers(dir.path()).is_empty() && leftovers(&hf).is_empty());
    }
}

#[test]
fn other_commands_refuse_an_output_that_is_an_input() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = common::convert_to(&common::demo_checkpoint(), dir.path());
    let data = dir.path().join("data.jsonl");
    std::fs::write(&data, "{\"dialogue\": \"A: hi\", \"summary\": \"hi\"}\n").unwrap();
    let inside = bundle.join("stats.json");
    let before = (snapshot(&bundle), std::fs::read(&data).unwrap());
    let model = ["--model", s(&bundle)];
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (
            vec!["summarize", "--input", s(&data), "--stats-json", s(&data)],
            vec!["--stats-json", "is the same path as --input"],
        ),
        (
            vec!["summarize", "--input", s(&data), "--stats-json", s(&inside)],
            vec!["--stats-json", "lies inside --model"],
        ),
        (
            vec!["eval", "--data", s(&data), "--predictions", s(&data)],
            vec!["--predictions", "is the same path as --data"],
        ),
        (
            vec!["eval", "--data", s(&data), "--trace", s(&data)],
            vec!["--trace", "is the same path as --data"],
        ),
        (
            vec!["calibrate", "--data", s(&data), "--json", s(&data)],
            vec!["--json", "is the same path as --data"],
        ),
    ];
    for (args, needles) in cases {
        let out = run(&[&args[..], &model].concat(), None);
        assert_fails(&out, &needles);
        assert!(
            (snapshot(&bundle), std::fs::read(&data).unwrap()) == before,
            "{args:?} changed its input"
        );
    }
    // Streams are not files to overwrite: standard input in, /dev/null out.
    stdout(&run(
        &[
            &[
                "summarize",
                "--max-new-tokens",
                "1",
                "--stats-json",
                "/dev/null",
            ][..],
            &model,
        ]
        .concat(),
        Some("A: hi"),
    ));
}

/// Every output of a run is checked against every input, the `--quantized` bundle included,
/// and against the run's other outputs: two outputs on one path would lose one.
#[test]
fn every_output_is_checked_against_every_input_and_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let hf = common::demo_checkpoint();
    let bundle = common::convert_to(&hf, dir.path());
    let int4 = edgemoe::store::ExpertEncoding::Quant(edgemoe::quant::QuantBits::Int4);
    let quantized = common::convert_with(&hf, &dir.path().join("q"), BitPlan::uniform(int4));
    let data = dir.path().join("data.jsonl");
    std::fs::write(&data, "{\"dialogue\": \"A: hi\", \"summary\": \"hi\"}\n").unwrap();
    let shared = dir.path().join("shared.txt");
    let before = (snapshot(&bundle), snapshot(&quantized));
    let quantized_config = quantized.join("config.json");
    let quantized_tokenizer = quantized.join("tokenizer.json");
    let run_args = ["--model", s(&bundle), "--max-new-tokens", "2"];
    let with_quantized = ["--quantized", s(&quantized), "--mode", "q+p"];
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (
            [
                &["summarize", "--input", s(&data), "--stats-json"][..],
                &[s(&quantized_config)],
                &with_quantized,
            ]
            .concat(),
            vec!["--stats-json", "lies inside --quantized"],
        ),
        (
            [
                &["eval", "--data", s(&data), "--predictions"][..],
                &[s(&quantized_tokenizer)],
                &with_quantized,
            ]
            .concat(),
            vec!["--predictions", "lies inside --quantized"],
        ),
        (
            vec![
                "summarize",
                "--input",
                s(&data),
                "--trace",
                s(&shared),
                "--stats-json",
                s(&shared),
            ],
            vec!["--trace", "is the same path as --stats-json", "both"],
        ),
        (
            vec![
                "eval",
                "--data",
                s(&data),
                "--predictions",
                s(&shared),
                "--trace",
                s(&shared),
            ],
            vec!["--trace", "is the same path as --predictions", "both"],
        ),
    ];
    for (args, needles) in cases {
        let out = run(&[&args[..], &run_args].concat(), None);
        assert_fails(&out, &needles);
        assert!(
            (snapshot(&bundle), snapshot(&quantized)) == before,
            "{args:?} changed a bundle"
        );
        assert!(!shared.exists(), "{args:?} wrote {}", shared.display());
    }
}

/// `tune-bits` checks every file it writes beside its plan (report, measurement cache, heat
/// map) against its inputs, and refuses to tune on no generated tokens.
#[test]
fn tune_bits_keeps_its_inputs_and_needs_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = common::convert_to(&common::demo_checkpoint(), dir.path());
    // Validation data named like the report of plan `q.json`.
    let data = dir.path().join("q.report.json");
    let line = "{\"dialogue\": \"A: hi\", \"summary\": \"hi\"}\n";
    std::fs::write(&data, line).unwrap();
    let plan = dir.path().join("q.json");
    let args = |data: &Path, max_new_tokens| {
        run(
            &[
                "tune-bits",
                "--model",
                s(&bundle),
                "--data",
                s(data),
                "--max-loss",
                "5%",
                "--limit",
                "1",
                "--max-new-tokens",
                max_new_tokens,
                "--out",
                s(&plan),
            ],
            None,
        )
    };
    assert_fails(
        &args(&data, "2"),
        &[
            "--out (its report)",
            "is the same path as --data",
            "q.report.json",
        ],
    );
    assert_eq!(std::fs::read_to_string(&data).unwrap(), line);
    assert!(!plan.exists());
    let data = dir.path().join("val.jsonl");
    std::fs::write(&data, line).unwrap();
    let out = args(&data, "0");
    assert_usage(&out, &["--max-new-tokens", "at least 1"]);
    assert!(!plan.exists());
}

/// `bench` writes into a new or empty `--out`, or one an earlier bench wrote, and checks it
/// before writing anything: a folder of the user's, or a `quantized-int4` that is not a bundle,
/// is refused whole.
#[test]
fn bench_writes_only_over_an_earlier_bench() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = common::convert_to(&common::demo_checkpoint(), dir.path());
    let data = dir.path().join("data.jsonl");
    std::fs::write(&data, "{\"dialogue\": \"A: hi\"}\n").unwrap();
    let bench = |out: &Path| {
        run(
            &[
                "bench",
                "--model",
                s(&bundle),
                "--data",
                s(&data),
                "--limit",
                "1",
                "--max-new-tokens",
                "2",
                "--no-cgroup",
                "--storage",
                "cached",
                "--modes",
                "q",
                "--buffer-experts",
                "4",
                "--out",
                s(out),
            ],
            None,
        )
    };
    let mine = dir.path().join("mine");
    std::fs::create_dir_all(mine.join("quantized-int4")).unwrap();
    std::fs::write(mine.join("input.jsonl"), "keep me").unwrap();
    std::fs::write(mine.join("quantized-int4/notes.txt"), "keep me").unwrap();
    let before = snapshot(&mine);
    assert_fails(
        &bench(&mine),
        &["--out", "not the output of an earlier bench", "input.jsonl"],
    );
    assert!(snapshot(&mine) == before);
    // Shaped like an earlier bench's output, but its quantized-int4 is no bundle.
    std::fs::create_dir(mine.join("runs")).unwrap();
    assert_fails(
        &bench(&mine),
        &[
            "quantized-int4",
            "not a model bundle",
            "notes.txt",
            "--quantized",
        ],
    );
    assert!(snapshot(&mine) == before);
    // A new folder, then the same one again.
    let out = dir.path().join("bench");
    stdout(&bench(&out));
    stdout(&bench(&out));
    assert!(out.join("results.json").is_file());
}

/// `probe-storage --write-profile` never writes into a model bundle, nor over a file that is not
/// a device profile.
#[test]
fn probe_storage_writes_no_profile_over_a_bundle_or_a_foreign_file() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = common::convert_to(&common::demo_checkpoint(), dir.path());
    let data = dir.path().join("data.jsonl");
    std::fs::write(&data, "keep me").unwrap();
    let before = snapshot(&bundle);
    let experts = bundle.join("experts.bin");
    let config = bundle.join("config.json");
    let new_in_bundle = bundle.join("board.toml");
    let cases: Vec<(&Path, Vec<&str>)> = vec![
        (
            &config,
            vec!["--write-profile", "config.json", "model bundle"],
        ),
        (&new_in_bundle, vec!["--write-profile", "model bundle"]),
        (
            &data,
            vec!["--write-profile", "data.jsonl", "not a device profile"],
        ),
    ];
    for (profile, needles) in cases {
        let out = run(
            &[
                "probe-storage",
                s(&experts),
                "--seconds",
                "0.02",
                "--write-profile",
                s(profile),
            ],
            None,
        );
        assert_fails(&out, &needles);
        assert!(
            snapshot(&bundle) == before,
            "{profile:?} changed the bundle"
        );
        assert_eq!(std::fs::read_to_string(&data).unwrap(), "keep me");
    }
}

#[test]
fn a_folder_that_is_not_a_bundle_is_kept_unless_forced() {
    let dir = tempfile::tempdir().unwrap();
    let hf = common::demo_checkpoint();
    let folder = dir.path().join("mine");
    std::fs::create_dir(&folder).unwrap();
    std::fs::write(folder.join("notes.txt"), "keep me").unwrap();
    let args = ["convert", "--hf", s(&hf), "--out", s(&folder)];
    assert_fails(
        &run(&args, None),
        &["not empty and not a model bundle", "notes.txt", "--force"],
    );
    assert_eq!(
        std::fs::read_to_string(folder.join("notes.txt")).unwrap(),
        "keep me"
    );
    stdout(&run(&[&args[..], &["--force"]].concat(), None));
    assert!(!folder.join("notes.txt").exists());
    assert_bundle_whole(&folder);
    // An empty folder and an existing bundle need no --force.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    stdout(&run(&["convert", "--hf", s(&hf), "--out", s(&empty)], None));
    stdout(&run(&args, None));
    assert_bundle_whole(&empty);
    assert_bundle_whole(&folder);
    assert!(leftovers(dir.path()).is_empty());
}

#[test]
fn a_failed_reconvert_keeps_the_old_bundle() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = common::convert_to(&common::demo_checkpoint(), dir.path());
    // A calibrated bundle: paths.bin goes too when a re-convert succeeds, never before.
    let opened = edgemoe::bundle::Bundle::open(&bundle).unwrap();
    let spec = &opened.config.model;
    opened
        .save_path_dictionary(&edgemoe::dictionary::PathDictionary::new(
            spec.moe_blocks(edgemoe::ids::Stack::Encoder).len(),
            spec.moe_blocks(edgemoe::ids::Stack::Decoder).len(),
            spec.num_experts(),
            spec.top_k(),
        ))
        .unwrap();
    let before = snapshot(&bundle);
    let broken = |name: &str| copy_dir(&common::demo_checkpoint(), &dir.path().join(name));
    // Failing late, after the resident weights are written: an expert tensor missing, a NaN
    // in the last expert; failing early: a plan naming an expert the model lacks.
    let missing = broken("missing");
    drop_tensor(
        &missing.join("model.safetensors"),
        "decoder.block.3.layer.2.mlp.experts.expert_7.wo.weight",
    );
    let nan = broken("nan");
    poison_tensor(
        &nan.join("model.safetensors"),
        "decoder.block.3.layer.2.mlp.experts.expert_7.wo.weight",
    );
    let plan = dir.path().join("plan.json");
    std::fs::write(
        &plan,
        r#"{"format": "edgemoe-bit-plan", "version": 1, "experts": [{"stack": "decoder", "block": 9, "expert": 0, "width": "int8"}]}"#,
    )
    .unwrap();
    let demo = common::demo_checkpoint();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--hf", s(&missing)], "expert_7.wo.weight"),
        (vec!["--hf", s(&nan)], "NaN"),
        (
            vec!["--hf", s(&demo), "--plan", s(&plan)],
            "which this model",
        ),
    ];
    for (args, needle) in cases {
        let out = run(
            &[&["convert", "--out", s(&bundle)][..], &args].concat(),
            None,
        );
        assert_fails(&out, &[needle]);
        assert!(
            snapshot(&bundle) == before,
            "{args:?} changed the old bundle"
        );
        assert_bundle_whole(&bundle);
        assert!(
            leftovers(dir.path()).is_empty(),
            "{args:?} left a staging directory"
        );
    }
}

#[test]
fn a_killed_convert_leaves_the_old_bundle_whole() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = dir.path().join("bundle");
    let demo = common::demo_checkpoint();
    let convert = |bits: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_edgemoe"))
            .args([
                "convert",
                "--hf",
                s(&demo),
                "--out",
                s(&bundle),
                "--bits",
                bits,
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap()
    };
    // How long a whole convert takes here, to kill the next ones at fractions of it.
    let start = std::time::Instant::now();
    assert!(convert("f32").wait().unwrap().success());
    let whole = start.elapsed();
    assert_bundle_whole(&bundle);
    // The re-converts store INT8 experts: after each kill the bundle is wholly the old one or
    // wholly the new one, and verifies either way.
    let mut mid_write = 0;
    for tenth in 1..=12 {
        let mut child = convert("8");
        std::thread::sleep(whole * tenth / 10);
        let exited = child.try_wait().unwrap().is_some();
        child.kill().ok(); // SIGKILL
        child.wait().unwrap();
        assert_bundle_whole(&bundle);
        let left = leftovers(dir.path());
        if !exited && !left.is_empty() {
            mid_write += 1;
        }
        for path in left {
            std::fs::remove_dir_all(path).unwrap();
        }
    }
    // Some kills landed while the new bundle was being written (else the test proved nothing).
    assert!(
        mid_write > 0,
        "no kill landed during a write (a whole convert took {whole:?})"
    );
}
