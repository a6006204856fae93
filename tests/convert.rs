//! Converting a checkpoint into a bundle, for every architecture: a checkpoint that disagrees
//! with its config (or is not one) is refused naming the field or the tensor, by the library and
//! by the command line (exit 1, one error line, no panic); the fused expert layout converts to
//! the same store as the per-expert one; `--bits` and `--plan` set the stored widths.

mod common;

use std::path::{Path, PathBuf};

use common::checkpoint::{assert_mentions, copy_dir, drop_tensor, edit_config};
use common::cli::{assert_fails, run, stderr, stdout};

use edgemoe::bundle::EXPERTS_FILE;
use edgemoe::ids::{ExpertId, Stack};
use edgemoe::offline::bit_plan::BitPlan;
use edgemoe::offline::convert::{convert, ConvertOptions};

/// One way to break a checkpoint.
enum Edit {
    /// Replace text in `config.json`; undone after the check.
    Config(&'static str, &'static str),
    /// Remove a tensor from `model.safetensors`; kept.
    DropTensor(&'static str),
    /// Overwrite `model.safetensors`; kept.
    Weights(&'static [u8]),
}

/// An edit and what the refusal must mention.
struct Refusal(Edit, &'static [&'static str]);

/// Applies each refusal in turn to a copy of `checkpoint` and checks that converting it fails
/// naming every needle, through the library and through `edgemoe convert`.
fn check_refusals(checkpoint: &Path, refusals: &[Refusal]) {
    let dir = tempfile::tempdir().unwrap();
    let hf = copy_dir(checkpoint, dir.path());
    let out = dir.path().join("out");
    for Refusal(edit, needles) in refusals {
        match edit {
            Edit::Config(from, to) => edit_config(&hf, from, to),
            Edit::DropTensor(name) => drop_tensor(&hf.join("model.safetensors"), name),
            Edit::Weights(bytes) => std::fs::write(hf.join("model.safetensors"), bytes).unwrap(),
        }
        let error = convert(&ConvertOptions {
            resident: Default::default(),
            hf_dir: hf.clone(),
            out_dir: out.clone(),
            tokenizer: (!hf.join("tokenizer.json").exists()).then(common::t5_tokenizer),
            bits: BitPlan::default(),
            show_progress: false,
        })
        .expect_err("conversion should fail")
        .to_string();
        assert_mentions(&error, needles);
        let cli = run(
            &[
                "convert",
                "--hf",
                hf.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
            ],
            None,
        );
        assert_fails(&cli, needles);
        if let Edit::Config(from, to) = edit {
            edit_config(&hf, to, from);
        }
    }
}

#[test]
fn switch_checkpoints_that_disagree_with_their_config_are_refused() {
    use Edit::*;
    check_refusals(
        &common::demo_checkpoint(),
        &[
            Refusal(
                Config("\"switch_transformers\"", "\"llama\""),
                &["config.json", "unsupported", "llama"],
            ),
            Refusal(
                Config(
                    "\"dense_act_fn\": \"relu\"",
                    "\"dense_act_fn\": \"gelu_new\"",
                ),
                &["config.json", "gelu_new"],
            ),
            // A config that promises more experts than the weights hold.
            Refusal(
                Config("\"num_experts\": 8", "\"num_experts\": 9"),
                &[
                    "router.classifier.weight",
                    "shape [8, 256], expected [9, 256]",
                ],
            ),
            // And one with fewer experts leaves tensors unaccounted for.
            Refusal(
                Config("\"num_experts\": 8", "\"num_experts\": 4"),
                &["expert_4", "the config and the weights disagree"],
            ),
            Refusal(
                Config("\"d_ff\": 512", "\"d_ff\": 256"),
                &["shape [512, 256], expected [256, 256]"],
            ),
            // A checkpoint missing one expert tensor names it.
            Refusal(
                DropTensor("decoder.block.1.layer.2.mlp.experts.expert_3.wo.weight"),
                &[
                    "decoder.block.1.layer.2.mlp.experts.expert_3.wo.weight",
                    "missing",
                ],
            ),
            Refusal(
                Weights(b"\x08\x00\x00\x00\x00\x00\x00\x00{}"),
                &["model.safetensors"],
            ),
            Refusal(
                Weights(b"garbage"),
                &["model.safetensors", "not a valid safetensors file"],
            ),
        ],
    );
}

#[test]
fn decoder_checkpoints_that_disagree_with_their_config_are_refused() {
    use Edit::*;
    check_refusals(
        &common::fixture("tiny-mixtral"),
        &[
            Refusal(
                Config("\"mixtral\"", "\"deepseek_v3\""),
                &["config.json", "unsupported", "deepseek_v3", "olmoe"],
            ),
            Refusal(
                Config("\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\""),
                &["config.json", "gelu"],
            ),
            Refusal(
                Config("\"rope_type\": \"default\"", "\"rope_type\": \"yarn\""),
                &["config.json", "yarn"],
            ),
            // More experts than the weights hold: the router (under Mixtral's checkpoint name).
            Refusal(
                Config("\"num_local_experts\": 8", "\"num_local_experts\": 9"),
                &[
                    "model.layers.0.block_sparse_moe.gate.weight",
                    "shape [8, 32], expected [9, 32]",
                ],
            ),
            // Fewer experts leave tensors unaccounted for.
            Refusal(
                Config("\"num_local_experts\": 8", "\"num_local_experts\": 6"),
                &["experts.6", "the config and the weights disagree"],
            ),
            // An expert width that disagrees with the weights.
            Refusal(
                Config("\"intermediate_size\": 32", "\"intermediate_size\": 48"),
                &["experts.0.w1.weight", "shape [32, 32], expected [48, 32]"],
            ),
            // A missing expert tensor is named.
            Refusal(
                DropTensor("model.layers.1.block_sparse_moe.experts.5.w3.weight"),
                &[
                    "model.layers.1.block_sparse_moe.experts.5.w3.weight",
                    "missing",
                ],
            ),
        ],
    );
    // Fused experts of the wrong shape name the fused tensor; a missing shared expert too.
    check_refusals(
        &common::fixture("tiny-olmoe"),
        &[Refusal(
            Config("\"intermediate_size\": 16", "\"intermediate_size\": 8"),
            &[
                "model.layers.0.mlp.experts.gate_up_proj",
                "shape [16, 32, 32], expected [16, 16, 32]",
            ],
        )],
    );
    check_refusals(
        &common::fixture("tiny-qwen2-moe"),
        &[Refusal(
            Config(
                "\"shared_expert_intermediate_size\": 40",
                "\"shared_expert_intermediate_size\": 20",
            ),
            &[
                "model.layers.0.mlp.shared_expert.gate_proj.weight",
                "expected [20, 32]",
            ],
        )],
    );
}

/// Rewrites the fused OLMoE fixture with one tensor per expert and matrix, as
/// `save_pretrained` writes by default.
fn per_expert_copy(fused: &Path, out: &Path) {
    let spec = edgemoe::offline::convert::read_hf_config(fused)
        .unwrap()
        .model;
    std::fs::create_dir_all(out).unwrap();
    for f in ["config.json", "generation_config.json", "tokenizer.json"] {
        std::fs::copy(fused.join(f), out.join(f)).unwrap();
    }
    let bytes = std::fs::read(fused.join("model.safetensors")).unwrap();
    let all = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in all.tensors() {
        if !name.contains(".mlp.experts.") {
            owned.push((name, view.shape().to_vec(), view.data().to_vec()));
        }
    }
    for layer in 0..2 {
        let (gate_up, down) = common::engine::fused_expert_names(layer);
        let gu = all.tensor(&gate_up).unwrap();
        let dn = all.tensor(&down).unwrap();
        let (e, two_ff, d) = (gu.shape()[0], gu.shape()[1], gu.shape()[2]);
        let ff = two_ff / 2;
        for expert in 0..e {
            let id = ExpertId {
                stack: Stack::Decoder,
                layer: layer as u16,
                expert: expert as u16,
            };
            let name = |m| common::engine::expert_tensor_name(&spec, id, m);
            let row = |first: usize, rows: usize, cols: usize, data: &[u8]| {
                data[first * cols * 4..(first + rows) * cols * 4].to_vec()
            };
            owned.push((
                name("gate"),
                vec![ff, d],
                row(expert * two_ff, ff, d, gu.data()),
            ));
            owned.push((
                name("up"),
                vec![ff, d],
                row(expert * two_ff + ff, ff, d, gu.data()),
            ));
            owned.push((name("down"), vec![d, ff], row(expert * d, d, ff, dn.data())));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, shape, data)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::tensor::serialize_to_file(views, None, &out.join("model.safetensors")).unwrap();
}

#[test]
fn fused_and_per_expert_layouts_give_the_same_store() {
    let dir = tempfile::tempdir().unwrap();
    let fused = common::fixture("tiny-olmoe");
    let split = dir.path().join("per-expert");
    per_expert_copy(&fused, &split);
    let a = common::convert_to(&fused, &dir.path().join("a"));
    let b = common::convert_to(&split, &dir.path().join("b"));
    assert_eq!(
        std::fs::read(a.join(EXPERTS_FILE)).unwrap(),
        std::fs::read(b.join(EXPERTS_FILE)).unwrap()
    );
}

/// `--bits 4` stores every expert as INT4 and the bundle runs; `--bits 3` is a usage error; a
/// plan naming a block the model lacks is refused — for the demo Switch model (64 experts,
/// `summarize`) and a decoder-only fixture (16 experts, `generate`).
#[test]
fn convert_with_bits_and_plans() {
    let dir = tempfile::tempdir().unwrap();
    let checkpoints: [(PathBuf, usize, &[&str]); 2] = [
        (common::demo_checkpoint(), 64, &["summarize"]),
        (
            common::fixture("tiny-mixtral"),
            16,
            &["generate", "--prompt", "The"],
        ),
    ];
    for (i, (hf, experts, command)) in checkpoints.iter().enumerate() {
        let out = dir.path().join(format!("int4-{i}"));
        let done = run(
            &[
                "convert",
                "--hf",
                hf.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
                "--bits",
                "4",
            ],
            None,
        );
        assert!(done.status.success(), "{}", stderr(&done));
        let inspect = stdout(&run(&["inspect", out.to_str().unwrap()], None));
        assert!(
            inspect.contains(&format!("{experts} × int4 (4 bits)")),
            "{inspect}"
        );
        let mut args = command.to_vec();
        args.extend(["--model", out.to_str().unwrap(), "-q"]);
        let summary = run(&args, Some("Anna: hi"));
        assert!(summary.status.success(), "{}", stderr(&summary));

        let bad = run(
            &[
                "convert",
                "--hf",
                hf.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
                "--bits",
                "3",
            ],
            None,
        );
        assert_eq!(bad.status.code(), Some(2));
        let plan = dir.path().join("plan.json");
        std::fs::write(
            &plan,
            r#"{"format": "edgemoe-bit-plan", "version": 1, "experts": [{"stack": "decoder", "block": 9, "expert": 0, "width": "int2"}]}"#,
        )
        .unwrap();
        let bad = run(
            &[
                "convert",
                "--hf",
                hf.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
                "--plan",
                plan.to_str().unwrap(),
            ],
            None,
        );
        assert_fails(&bad, &["decoder block 9"]);
    }
}
