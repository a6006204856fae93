//! Every file of a bundle is covered by a checksum: one flipped byte in the resident weights,
//! the tokenizer, the config or `paths.bin` fails the run that loads it, naming the file (exit
//! 1, one error line), where it used to change the output silently; `inspect --verify` reads
//! everything, every expert blob included, and reports each file OK or BAD. Bundles written
//! before manifests existed still load.

mod common;

use std::path::{Path, PathBuf};

use common::checkpoint::{copy_dir, flip_middle_byte};
use common::cli::{assert_fails, run, stderr, stdout};

use edgemoe::bundle::Bundle;
use edgemoe::dictionary::PathDictionary;
use edgemoe::ids::Stack;

/// The demo bundle, calibrated with an (empty) path dictionary so that it has a `paths.bin`,
/// recorded in its manifest the way `calibrate` records it.
fn calibrated_demo(dir: &Path) -> PathBuf {
    let bundle = common::convert_to(&common::demo_checkpoint(), dir);
    let opened = Bundle::open(&bundle).unwrap();
    let spec = &opened.config.model;
    opened
        .save_path_dictionary(&PathDictionary::new(
            spec.moe_blocks(Stack::Encoder).len(),
            spec.moe_blocks(Stack::Decoder).len(),
            spec.num_experts(),
            spec.top_k(),
        ))
        .unwrap();
    bundle
}

fn summarize(bundle: &Path) -> std::process::Output {
    run(
        &[
            "summarize",
            "--model",
            bundle.to_str().unwrap(),
            "--max-new-tokens",
            "2",
            "--storage",
            "cached",
        ],
        Some("Amanda: I baked cookies. Do you want some?\nJerry: Sure!"),
    )
}

fn verify(bundle: &Path) -> std::process::Output {
    run(&["inspect", "--verify", bundle.to_str().unwrap()], None)
}

/// The `inspect --verify` lines that start with `status`.
fn lines_with<'a>(out: &'a str, status: &str) -> Vec<&'a str> {
    out.lines().filter(|l| l.starts_with(status)).collect()
}

#[test]
fn a_flipped_byte_in_any_bundle_file_is_named_at_load_and_by_verify() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = calibrated_demo(&dir.path().join("clean"));
    stdout(&summarize(&bundle));
    let report = stdout(&verify(&bundle));
    assert!(lines_with(&report, "BAD").is_empty(), "{report}");
    for file in [
        "manifest.json",
        "config.json",
        "resident.safetensors",
        "experts.bin",
        "tokenizer.json",
        "paths.bin",
        "experts.bin blobs",
    ] {
        assert_eq!(
            lines_with(&report, &format!("OK   {file}:")).len(),
            1,
            "{report}"
        );
    }

    for file in [
        "resident.safetensors",
        "tokenizer.json",
        "config.json",
        "paths.bin",
    ] {
        let copy = copy_dir(&bundle, &dir.path().join(file));
        flip_middle_byte(&copy.join(file));
        let path = copy.join(file);
        let shown = path.to_str().unwrap();
        assert_fails(&summarize(&copy), &[shown, "checksum mismatch"]);
        let out = verify(&copy);
        assert_fails(&out, &["1 of the checks above failed"]);
        let report = String::from_utf8(out.stdout).unwrap();
        let bad = lines_with(&report, "BAD");
        assert_eq!(bad.len(), 1, "{file}: {report}");
        assert!(bad[0].contains(shown) && bad[0].contains("checksum mismatch"));
        // Everything else checks out (the blobs are not checked without an intact config).
        let ok = if file == "config.json" { 5 } else { 6 };
        assert_eq!(lines_with(&report, "OK").len(), ok, "{file}: {report}");
    }

    // A flipped byte in an expert blob: the whole file and the expert are named.
    let copy = copy_dir(&bundle, &dir.path().join("experts"));
    flip_middle_byte(&copy.join("experts.bin"));
    let out = verify(&copy);
    assert_fails(&out, &["2 of the checks above failed"]);
    let report = String::from_utf8(out.stdout).unwrap();
    let bad = lines_with(&report, "BAD");
    assert!(
        bad[0].contains("experts.bin: checksum mismatch"),
        "{report}"
    );
    assert!(bad[1].contains("checksum mismatch (index says"), "{report}");

    // A damaged manifest is told apart from the files it lists.
    let copy = copy_dir(&bundle, &dir.path().join("manifest"));
    let manifest = copy.join("manifest.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(&manifest, text.replacen("\"bytes\": 1", "\"bytes\": 2", 1)).unwrap();
    assert_fails(
        &summarize(&copy),
        &[manifest.to_str().unwrap(), "checksum mismatch"],
    );
}

#[test]
fn a_truncated_or_foreign_file_is_named_when_the_bundle_opens() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = calibrated_demo(&dir.path().join("clean"));
    let copy = copy_dir(&bundle, &dir.path().join("short"));
    let resident = copy.join("resident.safetensors");
    let bytes = std::fs::read(&resident).unwrap();
    std::fs::write(&resident, &bytes[..bytes.len() - 1]).unwrap();
    assert_fails(
        &run(&["inspect", copy.to_str().unwrap()], None),
        &[resident.to_str().unwrap(), "(truncated or replaced)"],
    );
    // A paths.bin the manifest does not list (another bundle's, or calibrated before the
    // bundle was converted again) is refused, and calibrate's own replacement is accepted.
    let copy = copy_dir(&bundle, &dir.path().join("foreign"));
    let mut manifest = edgemoe::manifest::Manifest::load(&copy).unwrap().unwrap();
    manifest.files.remove("paths.bin");
    manifest.save(&copy).unwrap();
    assert_fails(
        &summarize(&copy),
        &["paths.bin", "not listed in manifest.json", "calibrate"],
    );
    let opened = Bundle::open(&copy).unwrap().without_path_dictionary();
    let spec = &opened.config.model;
    opened
        .save_path_dictionary(&PathDictionary::new(
            spec.moe_blocks(Stack::Encoder).len(),
            spec.moe_blocks(Stack::Decoder).len(),
            spec.num_experts(),
            spec.top_k(),
        ))
        .unwrap();
    stdout(&summarize(&copy));
    // Without paths.bin a bundle is uncalibrated, not damaged.
    std::fs::remove_file(copy.join("paths.bin")).unwrap();
    stdout(&summarize(&copy));
    let report = stdout(&verify(&copy));
    assert!(report.contains("OK   paths.bin: absent"), "{report}");
}

#[test]
fn a_bundle_without_a_manifest_still_loads() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = common::convert_to(&common::demo_checkpoint(), dir.path());
    let with = stdout(&summarize(&bundle));
    std::fs::remove_file(bundle.join("manifest.json")).unwrap();
    let out = summarize(&bundle);
    assert_eq!(stdout(&out), with);
    assert!(!stderr(&out).contains("error"), "{}", stderr(&out));
    let report = stdout(&verify(&bundle));
    assert!(report.contains("SKIP manifest.json: absent"), "{report}");
    assert_eq!(
        lines_with(&report, "SKIP").len(),
        5,
        "the manifest and the four files: {report}"
    );
    assert!(
        report.contains("OK   experts.bin blobs: 64 experts"),
        "{report}"
    );
    // Its expert blobs are still checked.
    flip_middle_byte(&bundle.join("experts.bin"));
    assert_fails(&verify(&bundle), &["1 of the checks above failed"]);
}
