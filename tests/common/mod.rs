//! Shared helpers of the integration tests: fixture paths and converting fixtures to bundles.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use edgemoe::offline::convert::{convert, ConvertOptions};

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn fixture(name: &str) -> PathBuf {
    root().join("tests/fixtures").join(name)
}

/// The demo checkpoint committed with the repository.
pub fn demo_checkpoint() -> PathBuf {
    root().join("models/switch-samsum-tiny")
}

/// The T5 tokenizer (the demo checkpoint's copy), for fixtures that have none.
pub fn t5_tokenizer() -> PathBuf {
    demo_checkpoint().join("tokenizer.json")
}

/// `../shared/data/samsum/<split>.jsonl`, beside the repository.
pub fn samsum(split: &str) -> PathBuf {
    root()
        .join("../shared/data/samsum")
        .join(format!("{split}.jsonl"))
}

/// Converts a Hugging Face directory into a bundle inside `dir`.
pub fn convert_to(hf: &Path, dir: &Path) -> PathBuf {
    let out = dir.join("bundle");
    convert(&ConvertOptions {
        hf_dir: hf.to_path_buf(),
        out_dir: out.clone(),
        tokenizer: Some(t5_tokenizer()),
        bits: Default::default(),
        show_progress: false,
    })
    .unwrap_or_else(|e| panic!("converting {}: {e}", hf.display()));
    out
}

pub fn edgemoe() -> std::process::Command {
    std::process::Command::new(env!("CARGO_BIN_EXE_edgemoe"))
}

/// Tolerance of the golden comparisons against transformers (relative, with 1 added to the
/// reference so values near zero compare absolutely).
pub const TOLERANCE: f32 = 1e-4;

/// Asserts `got` matches `want` element-wise within [`TOLERANCE`].
pub fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let worst = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / (1.0 + w.abs()))
        .fold(0.0f32, f32::max);
    assert!(
        worst <= TOLERANCE,
        "{what}: max relative difference {worst} > {TOLERANCE}"
    );
}

/// The Switch model of a bundle (tests call its encoder and decoder steps directly).
pub fn switch_model(bundle: &edgemoe::bundle::Bundle) -> edgemoe::model::SwitchModel {
    match bundle.load_model(tch::Device::Cpu).unwrap() {
        edgemoe::model::Model::Switch(model) => model,
        _ => panic!("{}: not a Switch bundle", bundle.dir().display()),
    }
}

/// The decoder-only model of a bundle.
pub fn decoder_only_model(bundle: &edgemoe::bundle::Bundle) -> edgemoe::model::DecoderOnlyModel {
    match bundle.load_model(tch::Device::Cpu).unwrap() {
        edgemoe::model::Model::DecoderOnly(model) => model,
        _ => panic!("{}: not a decoder-only bundle", bundle.dir().display()),
    }
}
