//! A bundle's `resident.safetensors` holds exactly what the model takes: every architecture's
//! fixture (tied and untied embeddings, router biases, dense layers, Qwen2-MoE's shared expert
//! and attention biases, fused experts) converts to a bundle that loads, and the same bundle
//! with one tensor more is refused naming it — by the library and by the commands, cleanly.

mod common;

use std::path::Path;

use edgemoe::bundle::{Bundle, RESIDENT_FILE};
use edgemoe::Error;
use safetensors::tensor::{Dtype, TensorView};

/// Loads the bundle's model, whichever architecture it is.
fn load(bundle: &Path) -> edgemoe::Result<()> {
    Bundle::open(bundle)?.load_model(tch::Device::Cpu).map(drop)
}

/// Rewrites the bundle's resident file with `extra` (an f32 `[2]`) added (and recorded in the
/// manifest, so that the loader's check is the one that answers).
fn add_tensor(bundle: &Path, extra: &str) {
    let path = bundle.join(RESIDENT_FILE);
    let bytes = std::fs::read(&path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let zeros = [0u8; 8];
    let mut tensors = file.tensors();
    assert!(tensors.iter().all(|(n, _)| n != extra), "{extra} is there");
    tensors.push((
        extra.to_string(),
        TensorView::new(Dtype::F32, vec![2], &zeros).unwrap(),
    ));
    let rewritten = safetensors::serialize(tensors, None).unwrap();
    std::fs::write(&path, rewritten).unwrap();
    common::checkpoint::reseal(bundle, RESIDENT_FILE);
}

/// Converts `fixture`, loads it, then adds each of `extras` in turn and expects a refusal.
fn check(fixture: &str, extras: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let bundle = common::convert_to(&common::fixture(fixture), dir.path());
    let pristine = std::fs::read(bundle.join(RESIDENT_FILE)).unwrap();
    load(&bundle).unwrap_or_else(|e| panic!("{fixture}: {e}"));
    for extra in extras {
        std::fs::write(bundle.join(RESIDENT_FILE), &pristine).unwrap();
        add_tensor(&bundle, extra);
        match load(&bundle) {
            Err(Error::Tensor {
                path,
                name,
                message,
            }) => {
                assert_eq!(&name, extra, "{fixture}");
                assert!(
                    path.ends_with(RESIDENT_FILE),
                    "{fixture}: {}",
                    path.display()
                );
                assert_eq!(message, "not used by the model", "{fixture}");
            }
            other => panic!("{fixture} with `{extra}`: {:?}", other.err()),
        }
    }
}

#[test]
fn switch_bundles_with_an_extra_tensor_are_refused() {
    // Tied embeddings: a head the model would not use is refused like any stray tensor.
    check("tiny-tied-e4", &["encoder.block.0.foo", "lm_head.weight"]);
    // Untied, router biases, dense blocks: a router bias on a dense block is not the model's.
    check(
        "tiny-untied-e8",
        &["encoder.block.0.layer.1.mlp.router.classifier.bias"],
    );
}

#[test]
fn decoder_only_bundles_with_an_extra_tensor_are_refused() {
    check("tiny-mixtral", &["model.layers.0.self_attn.q_proj.bias"]);
    check(
        "tiny-qwen2-moe",
        &["model.layers.0.foo", "model.rotary_emb.inv_freq"],
    );
    check("tiny-olmoe", &["lm_head.weight"]);
}

#[test]
fn commands_name_the_unused_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("doc.txt");
    std::fs::write(&input, "Anna: hi").unwrap();
    let input = input.to_str().unwrap();
    for (fixture, extra, command) in [
        (
            "tiny-tied-e4",
            "encoder.block.0.foo",
            ["summarize", "--input", input],
        ),
        (
            "tiny-olmoe",
            "model.layers.0.foo",
            ["generate", "--prompt-ids", "5,6"],
        ),
    ] {
        let bundle = common::convert_to(&common::fixture(fixture), &dir.path().join(fixture));
        add_tensor(&bundle, extra);
        let mut args = command.to_vec();
        args.extend(["--model", bundle.to_str().unwrap()]);
        let out = common::cli::run(&args, None);
        let expected = format!("resident.safetensors: tensor `{extra}`: not used by the model");
        common::cli::assert_fails(&out, &[&expected]);
    }
}
