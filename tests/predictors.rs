//! The next-layer predictors (`--predictor`): the gate lookahead predicts exactly when nothing
//! changes the hidden state between two MoE layers, and not otherwise; no predictor changes an
//! output; every predictor is scored at every layer it reaches, for every forward call, with
//! the counts the routes give; `calibrate` reports them.

mod common;

use std::path::Path;

use common::engine::{
    load_decoder, load_switch, open_summarizer_with, summarize_all, CacheOptions,
};
use common::golden::{decoder_golden, greedy_options, switch_golden};

use edgemoe::bundle::Bundle;
use edgemoe::cache::Policy;
use edgemoe::generation::causal::complete;
use edgemoe::ids::{ExpertId, Stack};
use edgemoe::model::provider::{ExpertProvider, ExpertWeights};
use edgemoe::offline::calibrate::{calibrate, CalibrateOptions};
use edgemoe::runtime::buffer::{BufferOptions, ExpertBuffer};
use edgemoe::runtime::predict::{PredictorKind, PredictorLayerStats};

/// The gate's scores at decoder block `block` after running every golden prompt of the
/// `tiny-mixtral` checkpoint at `hf` through an expert buffer that prefetches by `predictor`.
fn gate_scores(hf: &Path, predictor: PredictorKind) -> (Vec<Vec<i64>>, PredictorLayerStats) {
    let dir = tempfile::tempdir().unwrap();
    let bundle = Bundle::open(&common::convert_to(hf, dir.path())).unwrap();
    let model = load_decoder(&bundle);
    let golden = decoder_golden("tiny-mixtral");
    let mut buffer = ExpertBuffer::with_options(
        bundle.open_store().unwrap(),
        &bundle.config.model,
        &BufferOptions {
            slots: 4,
            policy: Policy::Lru,
            prefetch: true,
            prefetch_cap_bytes: u64::MAX / 2,
            predictor,
            stand_in: None,
        },
        None,
    )
    .unwrap();
    let options = greedy_options(&golden);
    let mut outputs = Vec::new();
    for case in &golden.cases {
        let g = complete(&model, &mut buffer, &case.input_ids, &options, &mut |_| {
            Ok(())
        })
        .unwrap();
        outputs.push(g.tokens);
    }
    let report = buffer.stats().predictions.report();
    let gate = report
        .iter()
        .find(|s| s.predictor == PredictorKind::Gate && s.stack == "decoder" && s.block == 1)
        .unwrap_or_else(|| panic!("no gate scores for decoder block 1: {report:?}"))
        .clone();
    // Within one forward call only: nothing predicts block 0 from the gate.
    assert!(
        !report
            .iter()
            .any(|s| s.predictor == PredictorKind::Gate && s.block == 0),
        "{report:?}"
    );
    (outputs, gate)
}

#[test]
fn the_gate_predicts_exactly_when_the_hidden_state_does_not_change_between_moe_layers() {
    // tiny-mixtral has two MoE layers. With layer 0's experts writing zeros (w2, their down
    // projection) and layer 1's attention writing zeros (o_proj), the hidden state entering
    // layer 1's FFN is the one entering layer 0's: layer 1's norm and router, applied ahead,
    // must choose exactly what layer 1 then chooses, for every token of every prompt.
    let dir = tempfile::tempdir().unwrap();
    let hf = common::checkpoint::copy_dir(&common::fixture("tiny-mixtral"), dir.path());
    // Layer 1's norm gets weights unlike layer 0's (both are ones in the fixture), so that the
    // lookahead must use the next layer's norm, not the current one's.
    let changed =
        common::checkpoint::edit_tensors(&hf.join("model.safetensors"), &|name, dtype, data| {
            let zero = (name.starts_with("model.layers.0.block_sparse_moe.experts.")
                && name.ends_with(".w2.weight"))
                || name == "model.layers.1.self_attn.o_proj.weight";
            if zero {
                data.fill(0);
            } else if name == "model.layers.1.post_attention_layernorm.weight" {
                assert_eq!(dtype, safetensors::Dtype::BF16);
                for (i, x) in data.chunks_mut(2).enumerate() {
                    // bf16 4.0 and 0.25
                    x.copy_from_slice(if i % 3 == 0 {
                        &[0x80, 0x40]
                    } else {
                        &[0x80, 0x3e]
                    });
                }
            } else {
                return false;
            }
            true
        });
    assert_eq!(changed, 8 + 1 + 1);
    let (outputs, exact) = gate_scores(&hf, PredictorKind::Gate);
    assert!(exact.calls > 0 && exact.chosen > 0, "{exact:?}");
    // Every expert predicted is chosen. A prompt's prefill predicts only the experts chosen
    // for at least 10% of its tokens (the prefetch rule), so a rare choice may go unpredicted.
    assert_eq!(exact.correct, exact.predicted, "{exact:?}");
    assert_eq!(exact.precision, 1.0);
    assert!(exact.recall > 0.95, "{exact:?}");
    // The model's outputs differ between prompts (so the calls above are not one repeated
    // case), and the predictor that drives prefetch changes none of them.
    assert!(outputs.windows(2).any(|w| w[0] != w[1]), "{outputs:?}");
    assert_eq!(gate_scores(&hf, PredictorKind::Dictionary).0, outputs);

    // The unmodified checkpoint: the FFN and the attention in between move the hidden state,
    // and the lookahead is no longer exact (the test above is not passing by construction).
    let (_, approximate) = gate_scores(&common::fixture("tiny-mixtral"), PredictorKind::Gate);
    assert!(approximate.calls > 0);
    assert!(approximate.correct < approximate.chosen, "{approximate:?}");
}

/// `value` in `dtype`'s little-endian bytes (f32, f16 or bf16).
fn encode(value: f32, dtype: safetensors::Dtype) -> Vec<u8> {
    match dtype {
        safetensors::Dtype::F32 => value.to_le_bytes().to_vec(),
        safetensors::Dtype::F16 => half::f16::from_f32(value).to_le_bytes().to_vec(),
        safetensors::Dtype::BF16 => (value.to_bits() >> 16).to_le_bytes()[..2].to_vec(),
        other => panic!("dtype {other:?}"),
    }
}

#[test]
fn the_switch_gate_predicts_every_token_exactly_across_a_dense_block_that_changes_nothing() {
    // tiny-untied-e8's encoder: MoE blocks 1 and 3, a dense block 2 between. With block 1's
    // experts, block 2's attention and FFN and block 3's attention all writing zeros, block 3's
    // FFN sees the hidden state block 1's FFN saw; block 3's norm is made unlike block 1's.
    let dir = tempfile::tempdir().unwrap();
    let hf = common::checkpoint::copy_dir(&common::fixture("tiny-untied-e8"), dir.path());
    let mut changed = 0;
    for shard in std::fs::read_dir(&hf).unwrap() {
        let shard = shard.unwrap().path();
        if shard.extension().is_some_and(|e| e == "safetensors") {
            changed += common::checkpoint::edit_tensors(&shard, &|name, dtype, data| {
                let zero = (name.starts_with("encoder.block.1.layer.1.mlp.experts.")
                    && name.ends_with(".wo.weight"))
                    || name == "encoder.block.2.layer.0.SelfAttention.o.weight"
                    || name == "encoder.block.2.layer.1.mlp.wo.weight"
                    || name == "encoder.block.3.layer.0.SelfAttention.o.weight";
                if zero {
                    data.fill(0);
                } else if name == "encoder.block.3.layer.1.layer_norm.weight" {
                    let (high, low) = (encode(4.0, dtype), encode(0.25, dtype));
                    for (i, x) in data.chunks_mut(high.len()).enumerate() {
                        x.copy_from_slice(if i % 3 == 0 { &high } else { &low });
                    }
                } else {
                    return false;
                }
                true
            });
        }
    }
    assert_eq!(changed, 8 + 3 + 1);
    let bundle = Bundle::open(&common::convert_to(&hf, dir.path())).unwrap();
    let model = load_switch(&bundle);
    let buffer = ExpertBuffer::new(bundle.open_store().unwrap(), &bundle.config.model, 64);
    let mut recorder = Recorder {
        inner: buffer,
        predicted: Vec::new(),
        checked: 0,
    };
    for case in &switch_golden("tiny-untied-e8").cases {
        let _hidden = model
            .encode(&case.input_ids, &mut recorder, &mut Vec::new())
            .unwrap();
    }
    assert!(recorder.checked > 20, "{} tokens checked", recorder.checked);
}

/// Passes everything to an expert buffer and checks, token by token, that the gate's prediction
/// for a block equals what the block then chooses.
struct Recorder {
    inner: ExpertBuffer,
    /// The last prediction: (stack, block, experts per token).
    predicted: Vec<(Stack, usize, Vec<u16>)>,
    checked: usize,
}

impl ExpertProvider for Recorder {
    fn expert(
        &mut self,
        id: ExpertId,
        next: Option<ExpertId>,
    ) -> edgemoe::error::Result<ExpertWeights<'_>> {
        self.inner.expert(id, next)
    }

    fn routed(
        &mut self,
        stack: Stack,
        block: usize,
        k: usize,
        experts: &[u16],
    ) -> edgemoe::error::Result<()> {
        if let Some(i) = self
            .predicted
            .iter()
            .position(|(s, b, _)| (*s, *b) == (stack, block))
        {
            let (_, _, predicted) = self.predicted.remove(i);
            assert_eq!(predicted, experts, "{stack:?} block {block}");
            self.checked += experts.len();
        }
        self.inner.routed(stack, block, k, experts)
    }

    fn wants_lookahead(&self) -> bool {
        true
    }

    fn predicted(
        &mut self,
        stack: Stack,
        block: usize,
        _k: usize,
        experts: &[u16],
    ) -> edgemoe::error::Result<()> {
        self.predicted.push((stack, block, experts.to_vec()));
        Ok(())
    }
}

#[test]
fn predictors_change_no_summary_and_are_scored_on_every_forward_call() {
    // A tiny random Switch checkpoint (the trained demo model writes one sentence for most
    // dialogues; this one's routing and text depend on the input), calibrated on 20 train
    // dialogues; 12 test dialogues.
    let dir = tempfile::tempdir().unwrap();
    let bundle = common::convert_to(&common::fixture("tiny-untied-e8"), dir.path());
    let run = calibrate(&CalibrateOptions {
        bundle: bundle.clone(),
        data: common::samsum("train"),
        limit: Some(20),
        held_out: Some((common::samsum("validation"), 4)),
        show_progress: false,
    })
    .unwrap();
    // calibrate scores all three predictors on the held-out documents.
    for kind in PredictorKind::ALL {
        assert!(
            run.report
                .predictors
                .iter()
                .any(|s| s.predictor == kind && s.calls > 0),
            "calibrate: no {} scores: {:?}",
            kind.name(),
            run.report.predictors
        );
    }
    let docs = common::samsum_dialogues("test", 12);
    let spec = Bundle::open(&bundle).unwrap().config.model;
    let decoder_blocks = spec.moe_blocks(Stack::Decoder);
    let encoder_blocks = spec.moe_blocks(Stack::Encoder);
    let mut reference: Option<Vec<Vec<i64>>> = None;
    for predictor in PredictorKind::ALL {
        let mut session = open_summarizer_with(
            &bundle,
            1 << 30,
            CacheOptions {
                policy: Policy::Edgemoe,
                prefetch: true,
                buffer_experts: Some(6),
                predictor,
                ..CacheOptions::default()
            },
            Some(1),
        );
        let outputs = summarize_all(&mut session, &docs);
        match &reference {
            None => {
                let distinct: std::collections::BTreeSet<_> = outputs.iter().collect();
                assert!(
                    distinct.len() >= 3,
                    "too few distinct summaries: {outputs:?}"
                );
                reference = Some(outputs.clone());
            }
            Some(r) => assert_eq!(&outputs, r, "--predictor {}", predictor.name()),
        }
        // One decoder forward call per generated token (greedy, one beam), one encoder call
        // per document.
        let steps: u64 = outputs.iter().map(|o| o.len() as u64).sum();
        let report = session.stats().predictions.report();
        let calls = |kind: PredictorKind, stack: &str, block: usize| {
            report
                .iter()
                .find(|s| s.predictor == kind && s.stack == stack && s.block as usize == block)
                .map_or(0, |s| s.calls)
        };
        for kind in PredictorKind::ALL {
            // Every decoder MoE layer but the first is predicted at every step by every
            // predictor; the first by the dictionary (from the layer before, across the call's
            // boundary) only.
            for (i, &block) in decoder_blocks.iter().enumerate() {
                let want = if i == 0 && kind == PredictorKind::Gate {
                    0
                } else {
                    steps
                };
                assert_eq!(
                    calls(kind, "decoder", block),
                    want,
                    "{} at decoder block {block}",
                    kind.name()
                );
            }
            for &block in &encoder_blocks[1..] {
                assert_eq!(calls(kind, "encoder", block), docs.len() as u64);
            }
        }
        for s in &report {
            assert!(s.correct <= s.predicted.min(s.chosen), "{s:?}");
            assert!((0.0..=1.0).contains(&s.precision) && (0.0..=1.0).contains(&s.recall));
        }
    }
}
