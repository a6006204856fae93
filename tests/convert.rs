//! Converting a checkpoint into a bundle, for every architecture: a checkpoint that disagrees
//! with its config (or is not one) is refused naming the field or the tensor, by the library and
//! by the command line (exit 1, one error line, no panic); the fused expert layout converts to
//! the same store as the per-expert one; `--bits` and `--plan` set the stored widths.

mod common;

use std::path::{Path, PathBuf};

use common::checkpoint::{assert_mentions, copy_dir, drop_tensor, edit_config, poison_tensor};
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
    /// Replace text in `generation_config.json`; undone after the check.
    Generation(&'static str, &'static str),
    /// Set element 0 of a tensor of `model.safetensors` to NaN; kept.
    Poison(&'static str),
}

/// An edit and what the refusal must mention.
struct Refusal(Edit, &'static [&'static str]);

/// Replaces `from` with `to` in `hf/generation_config.json`, which must contain `from`.
fn edit_generation(hf: &Path, from: &str, to: &str) {
    let path = hf.join("generation_config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains(from), "{from}");
    std::fs::write(&path, text.replace(from, to)).unwrap();
}

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
            Edit::Generation(from, to) => edit_generation(&hf, from, to),
            Edit::Poison(name) => poison_tensor(&hf.join("model.safetensors"), name),
        }
        let error = convert(&ConvertOptions {
            resident: Default::default(),
            hf_dir: hf.clone(),
            out_dir: out.clone(),
            tokenizer: common::tokenizer_for(&hf, dir.path()),
            bits: BitPlan::default(),
            force: false,
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
        match edit {
            Edit::Config(from, to) => edit_config(&hf, to, from),
            Edit::Generation(from, to) => edit_generation(&hf, to, from),
            _ => {}
        }
        assert!(!out.exists(), "a refused convert wrote {}", out.display());
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
            // And one with fewer experts: the router names the field.
            Refusal(
                Config("\"num_experts\": 8", "\"num_experts\": 4"),
                &["router.classifier.weight", "`num_experts`", "disagrees"],
            ),
            // Hostile sizes are refused before anything is allocated for them, naming the
            // field (and the tensor they disagree with).
            Refusal(
                Config("\"num_layers\": 4", "\"num_layers\": 9223372036854775807"),
                &["config.json", "`num_layers`", "65536"],
            ),
            Refusal(
                Config("\"num_layers\": 4", "\"num_layers\": 65536"),
                &["config.json", "`num_layers` = 65536", "4 layers"],
            ),
            Refusal(
                Config("\"num_layers\": 4", "\"num_layers\": 3"),
                &["encoder.block.3", "`num_layers` = 3", "4 layers"],
            ),
            Refusal(
                Config(
                    "\"num_decoder_layers\": 4",
                    "\"num_decoder_layers\": 9223372036854775807",
                ),
                &["config.json", "`num_decoder_layers`", "65536"],
            ),
            Refusal(
                Config("\"d_kv\": 32", "\"d_kv\": 65536"),
                &["SelfAttention.q.weight", "`d_kv`", "config.json"],
            ),
            Refusal(
                Config("\"d_model\": 256", "\"d_model\": 1099511627776"),
                &["config.json", "`d_model`"],
            ),
            // T5's position buckets go negative for long distances (transformers fails too).
            Refusal(
                Config(
                    "\"relative_attention_max_distance\": 128",
                    "\"relative_attention_max_distance\": 16",
                ),
                &["config.json", "`relative_attention_max_distance` = 16"],
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
            // Nonsense values are refused naming the field (and the file that sets it).
            Refusal(
                Config(
                    "\"layer_norm_epsilon\": 1e-06",
                    "\"layer_norm_epsilon\": -1e-06",
                ),
                &["config.json", "`layer_norm_epsilon`", "positive"],
            ),
            Refusal(
                Config("\"layer_norm_epsilon\": 1e-06", "\"layer_norm_epsilon\": 0"),
                &["config.json", "`layer_norm_epsilon`", "positive"],
            ),
            Refusal(
                Config("\"num_heads\": 8", "\"num_heads\": 0"),
                &["config.json", "`num_heads`", "positive"],
            ),
            Refusal(
                Config("\"num_decoder_layers\": 4", "\"num_decoder_layers\": 0"),
                &["config.json", "`num_decoder_layers`", "positive"],
            ),
            Refusal(
                Generation(
                    "\"decoder_start_token_id\": 0",
                    "\"decoder_start_token_id\": 40000",
                ),
                &[
                    "generation_config.json",
                    "`decoder_start_token_id` 40000",
                    "32128",
                ],
            ),
            Refusal(
                Generation("\"eos_token_id\": 1", "\"eos_token_id\": -3"),
                &["generation_config.json", "`eos_token_id` -3"],
            ),
            Refusal(
                Generation("\"pad_token_id\": 0", "\"pad_token_id\": 32128"),
                &["generation_config.json", "`pad_token_id` 32128"],
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
    // Non-finite weights, resident or expert, are refused naming the tensor.
    const RESIDENT: &str = "encoder.block.0.layer.0.SelfAttention.q.weight";
    const EXPERT: &str = "decoder.block.1.layer.2.mlp.experts.expert_3.wo.weight";
    for refusal in [
        Refusal(Poison(RESIDENT), &[RESIDENT, "NaN"]),
        Refusal(Poison(EXPERT), &[EXPERT, "NaN"]),
    ] {
        check_refusals(&common::demo_checkpoint(), &[refusal]);
    }
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
            // Fewer experts: the router names the field.
            Refusal(
                Config("\"num_local_experts\": 8", "\"num_local_experts\": 6"),
                &[
                    "block_sparse_moe.gate.weight",
                    "`num_local_experts`",
                    "disagrees",
                ],
            ),
            // Hostile sizes are refused before anything is allocated for them.
            Refusal(
                Config(
                    "\"num_hidden_layers\": 2",
                    "\"num_hidden_layers\": 9223372036854775807",
                ),
                &["config.json", "`num_hidden_layers`", "65536"],
            ),
            Refusal(
                Config("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 65536"),
                &["config.json", "`num_hidden_layers` = 65536", "2 layers"],
            ),
            Refusal(
                Config("\"hidden_size\": 32", "\"hidden_size\": 1099511627776"),
                &["config.json", "`hidden_size`"],
            ),
            Refusal(
                Config("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 4"),
                &["k_proj.weight", "`num_key_value_heads`", "config.json"],
            ),
            // An expert width that disagrees with the weights.
            Refusal(
                Config("\"intermediate_size\": 32", "\"intermediate_size\": 48"),
                &["experts.0.w1.weight", "shape [32, 32], expected [48, 32]"],
            ),
            // Nonsense values are refused naming the field.
            Refusal(
                Config("\"rms_norm_eps\": 1e-05", "\"rms_norm_eps\": 0.0"),
                &["config.json", "`rms_norm_eps`", "positive"],
            ),
            Refusal(
                Config("\"rope_theta\": 1000000.0", "\"rope_theta\": -1.0"),
                &["config.json", "`rope_theta`", "positive"],
            ),
            Refusal(
                Config("\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 9"),
                &["config.json", "`num_experts_per_tok` 9", "8 experts"],
            ),
            Refusal(
                Config("\"num_attention_heads\": 4", "\"num_attention_heads\": 0"),
                &["config.json", "`num_attention_heads`", "positive"],
            ),
            Refusal(
                Config("\"bos_token_id\": 1", "\"bos_token_id\": 320"),
                &["config.json", "`bos_token_id` 320", "320"],
            ),
            Refusal(
                Generation("\"eos_token_id\": 0", "\"eos_token_id\": [0, 999]"),
                &["generation_config.json", "`eos_token_id` 999"],
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
    // Non-finite expert weights (bf16) are refused naming the tensor.
    check_refusals(
        &common::fixture("tiny-mixtral"),
        &[Refusal(
            Poison("model.layers.1.block_sparse_moe.experts.5.w3.weight"),
            &["model.layers.1.block_sparse_moe.experts.5.w3.weight", "NaN"],
        )],
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

#[test]
fn a_tokenizer_from_another_model_is_refused() {
    // T5's 32,100 tokens for a model with 512 embedding rows: ids past the embedding.
    let dir = tempfile::tempdir().unwrap();
    let hf = common::fixture("tiny-tied-e4");
    let out = dir.path().join("out");
    let t5 = common::t5_tokenizer();
    let cli = run(
        &[
            "convert",
            "--hf",
            hf.to_str().unwrap(),
            "--tokenizer",
            t5.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
        None,
    );
    assert_fails(
        &cli,
        &["tokenizer.json", "32099", "512 tokens", "another model"],
    );
    assert!(!out.exists());
    // A tokenizer whose ids fit but lacks the model's EOS.
    let small = dir.path().join("small.json");
    let mut t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&t5).unwrap()).unwrap();
    t["model"]["vocab"].as_array_mut().unwrap().truncate(1);
    t["model"]["unk_id"] = 0.into();
    t["added_tokens"] = serde_json::json!([]);
    t["post_processor"] = serde_json::Value::Null;
    std::fs::write(&small, t.to_string()).unwrap();
    let cli = run(
        &[
            "convert",
            "--hf",
            hf.to_str().unwrap(),
            "--tokenizer",
            small.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
        None,
    );
    assert_fails(&cli, &["small.json", "`eos_token_id` 1", "another model"]);
    assert!(!out.exists());

    // At load: a bundle whose tokenizer was swapped for a foreign one (manifest updated to
    // match, so only the cross-check can tell).
    let bundle = common::convert_to(&hf, dir.path());
    std::fs::copy(&t5, bundle.join("tokenizer.json")).unwrap();
    common::checkpoint::reseal(&bundle, "tokenizer.json");
    let error = edgemoe::bundle::Bundle::open(&bundle)
        .unwrap()
        .tokenizer()
        .err()
        .expect("a foreign tokenizer is refused at load")
        .to_string();
    assert_mentions(&error, &["tokenizer.json", "512 tokens", "another model"]);
}

/// The bundle config `convert` writes for fixture `name`, as JSON.
fn converted_config(name: &str) -> serde_json::Value {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let config = edgemoe::offline::convert::read_hf_config(&fixture).unwrap();
    serde_json::to_value(&config).unwrap()
}

#[test]
fn a_bundle_config_is_refused_where_convert_refuses_the_same_values() {
    let path = Path::new("bundle/config.json");
    let refusals = [
        (
            "tiny-tied-e4",
            "layer_norm_epsilon",
            serde_json::json!(-1.0),
        ),
        ("tiny-tied-e4", "layer_norm_epsilon", serde_json::json!(0.0)),
        (
            "tiny-tied-e4",
            "relative_attention_max_distance",
            serde_json::json!(8),
        ),
        (
            "tiny-tied-e4",
            "relative_attention_max_distance",
            serde_json::json!(1),
        ),
        ("tiny-mixtral", "rms_norm_eps", serde_json::json!(-1.0)),
        ("tiny-mixtral", "rope_theta", serde_json::json!(0.0)),
        ("tiny-mixtral", "rope_theta", serde_json::json!(-5.0)),
        (
            "tiny-mixtral",
            "attention_windows",
            serde_json::json!([0, 0]),
        ),
        ("tiny-olmoe", "clip_qkv", serde_json::json!(-1.0)),
        ("tiny-olmoe", "clip_qkv", serde_json::json!(0.0)),
    ];
    for (fixture, field, value) in refusals {
        let mut config = converted_config(fixture);
        edgemoe::config::BundleConfig::parse(path, &config.to_string())
            .expect("the converted config loads");
        config["model"][field] = value.clone();
        let error = edgemoe::config::BundleConfig::parse(path, &config.to_string())
            .expect_err(&format!("{fixture}: `{field}` = {value} should be refused"))
            .to_string();
        assert!(
            error.contains("bundle/config.json") && error.contains(&format!("`{field}`")),
            "{fixture}: `{field}` = {value}: {error}"
        );
    }
}
