//! Shared helpers of the integration tests, one copy each: fixture paths and the architectures'
//! fixtures, converting a checkpoint to a bundle, the golden files, running the binary, editable
//! checkpoint copies, and the engine calls that other work is renaming (sessions, model loading,
//! expert tensor names), kept in [`engine`] so a rename touches one place.
#![allow(dead_code)]

pub mod checkpoint;
pub mod cli;
pub mod engine;
pub mod golden;
pub mod http;

use std::path::{Path, PathBuf};

use edgemoe::offline::bit_plan::BitPlan;
use edgemoe::offline::convert::{convert, ConvertOptions, ResidentWidth};

/// The tiny random Switch Transformers fixtures (`tests/fixtures/make_tiny_switch.py`).
pub const SWITCH_FIXTURES: [&str; 2] = ["tiny-tied-e4", "tiny-untied-e8"];

/// The tiny random decoder-only fixtures (`tests/fixtures/make_tiny_decoders.py`): Mixtral,
/// Qwen2-MoE, OLMoE.
pub const DECODER_FIXTURES: [&str; 3] = ["tiny-mixtral", "tiny-qwen2-moe", "tiny-olmoe"];

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn fixture(name: &str) -> PathBuf {
    root().join("tests/fixtures").join(name)
}

/// The demo checkpoint committed with the repository (a trained Switch model).
pub fn demo_checkpoint() -> PathBuf {
    root().join("models/switch-samsum-tiny")
}

/// The T5 tokenizer (the demo checkpoint's copy).
pub fn t5_tokenizer() -> PathBuf {
    demo_checkpoint().join("tokenizer.json")
}

/// The tokenizer to convert checkpoint `hf` with: none (its own `tokenizer.json`), or for the
/// tiny Switch fixtures, which have none and a vocabulary smaller than T5's, the T5 tokenizer
/// cut down to their `vocab_size` (its first pieces; `convert` refuses a tokenizer whose ids
/// pass the model's vocabulary), written into `dir`.
pub fn tokenizer_for(hf: &Path, dir: &Path) -> Option<PathBuf> {
    if hf.join("tokenizer.json").exists() {
        return None;
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    let vocab = config["vocab_size"].as_u64().unwrap();
    let mut t5: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(t5_tokenizer()).unwrap()).unwrap();
    t5["model"]["vocab"]
        .as_array_mut()
        .unwrap()
        .truncate(vocab as usize);
    t5["added_tokens"]
        .as_array_mut()
        .unwrap()
        .retain(|t| t["id"].as_u64().unwrap() < vocab);
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(format!("t5-tokenizer-{vocab}.json"));
    std::fs::write(&path, t5.to_string()).unwrap();
    Some(path)
}

/// `../shared/data/samsum/<split>.jsonl`, beside the repository.
pub fn samsum(split: &str) -> PathBuf {
    root()
        .join("../shared/data/samsum")
        .join(format!("{split}.jsonl"))
}

/// The first `n` dialogues of a SAMSum split.
pub fn samsum_dialogues(split: &str, n: usize) -> Vec<String> {
    let text = std::fs::read_to_string(samsum(split)).unwrap();
    engine::parse_documents(&text, split).unwrap()[..n].to_vec()
}

/// Converts a Hugging Face directory into `dir/bundle` at full precision.
pub fn convert_to(hf: &Path, dir: &Path) -> PathBuf {
    convert_with(hf, dir, BitPlan::default())
}

/// Converts a Hugging Face directory into `dir/bundle` with the expert widths of `bits`. The
/// checkpoint's own `tokenizer.json` is bundled; a cut-down T5 one for fixtures that have none
/// (the tiny Switch fixtures, see [`tokenizer_for`]).
pub fn convert_with(hf: &Path, dir: &Path, bits: BitPlan) -> PathBuf {
    convert_at(hf, dir, bits, ResidentWidth::F32)
}

/// [`convert_with`], with the resident matrices at `resident`.
pub fn convert_at(hf: &Path, dir: &Path, bits: BitPlan, resident: ResidentWidth) -> PathBuf {
    let out = dir.join("bundle");
    convert(&ConvertOptions {
        resident,
        hf_dir: hf.to_path_buf(),
        out_dir: out.clone(),
        tokenizer: tokenizer_for(hf, dir),
        bits,
        force: false,
        show_progress: false,
    })
    .unwrap_or_else(|e| panic!("converting {}: {e}", hf.display()));
    out
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
