//! The decoder's attention caches stay within what the memory budget sets aside for them
//! (`SwitchModel::decoder_cache_bytes`, part of `working_bytes`), and that share is not padded:
//! at the end of a run the caches hold at least half of it. Beam search with reorders that keep
//! some beams twice and drop others (the caches' copies), on both Switch fixtures, over sources
//! longer and shorter than the run, with the cross-attention cache in every format.

mod common;

use edgemoe::bundle::Bundle;
use edgemoe::model::{KvFormat, RunShape};
use edgemoe::runtime::buffer::ExpertBuffer;

#[test]
fn decoder_caches_stay_within_their_share_of_the_working_memory() {
    for fixture in ["tiny-untied-e8", "tiny-tied-e4"] {
        let dir = tempfile::tempdir().unwrap();
        let bundle =
            Bundle::open(&common::convert_to(&common::fixture(fixture), dir.path())).unwrap();
        let spec = bundle.config.model.clone();
        let experts = bundle.open_store().unwrap().index().experts.len();
        let mut buffer = ExpertBuffer::new(bundle.open_store().unwrap(), &spec, experts);
        let model = common::engine::load_switch(&bundle);
        let runs = [(40, 6, 4), (16, 20, 3), (12, 12, 1)];
        for ((source_len, steps, beams), kv_cache) in runs
            .into_iter()
            .flat_map(|run| KvFormat::ALL.map(|format| (run, format)))
        {
            let what = format!(
                "{fixture}: {source_len} source tokens, {steps} steps, {beams} beams, {kv_cache} cross-attention cache"
            );
            let source: Vec<i64> = (0..source_len).map(|i| 3 + (i * 7) % 50).collect();
            let run = RunShape {
                max_source_tokens: source_len as usize,
                max_new_tokens: steps,
                beams,
                kv_cache,
            };
            let share = model.decoder_cache_bytes(run);
            let encoded = model.encode(&source, &mut buffer, &mut Vec::new()).unwrap();
            let mut state = model.start_decoder(&encoded, beams, kv_cache).unwrap();
            let mut tokens = vec![0i64; beams];
            for step in 0..steps {
                let logits = model
                    .decode_step(&tokens, &mut state, &mut buffer, &mut Vec::new())
                    .unwrap();
                // Beam 0 kept twice (its copy into a dropped beam's buffers), the rest shifted.
                let kept: Vec<i64> = (0..beams as i64).map(|b| (b - 1).max(0)).collect();
                model.reorder(&mut state, &kept).unwrap();
                let held = state.held_bytes();
                assert!(
                    held <= share,
                    "{what}: after step {step} the caches hold {held} bytes, above the {share} set aside"
                );
                // Each beam's next token: its most likely one, after the reorder.
                let best = logits.argmax(-1, false);
                tokens = kept.iter().map(|&b| best.int64_value(&[b])).collect();
            }
            let held = state.held_bytes();
            assert!(
                2 * held >= share,
                "{what}: the caches end at {held} bytes, under half of the {share} set aside"
            );
        }
    }
}
