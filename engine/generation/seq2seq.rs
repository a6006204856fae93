//! Decoding: greedy search and beam search, ported from Hugging Face `transformers` 5.x
//! (`GenerationMixin._sample` without sampling, and the vectorised `_beam_search` with its
//! length penalty, `early_stopping` heuristics and `no_repeat_ngram_size`), so that the engine
//! produces the same tokens as `model.generate(...)`.
//!
//! Scores stay in f32 and ranking uses libtorch's own `topk`/`argmax`, so ties break the same way.

use std::time::Instant;

use tch::{Kind, Tensor};

use crate::config::EarlyStopping;
use crate::error::Result;
use crate::model::provider::ExpertProvider;
use crate::model::SwitchModel;

use super::decoding::{DecodeOptions, Generation};
use super::sampling::greedy_token;

/// Summarizes/translates one source sequence.
pub fn generate(
    model: &SwitchModel,
    provider: &mut dyn ExpertProvider,
    input_ids: &[i64],
    options: &DecodeOptions,
) -> Result<Generation> {
    let _guard = tch::no_grad_guard();
    options.cancellation.check()?;
    let mut out = Generation::default();
    let started = Instant::now();
    let stalled = provider.stall_ms();
    let encoded = model.encode(input_ids, provider, &mut out.routes)?;
    out.encode_ms = started.elapsed().as_secs_f64() * 1e3;
    out.encode_stall_ms = provider.stall_ms() - stalled;
    if options.max_new_tokens == 0 {
        return Ok(out);
    }
    out.tokens = if options.num_beams <= 1 {
        greedy(model, provider, &encoded, options, &mut out)?
    } else {
        beam_search(model, provider, &encoded, options, &mut out)?
    };
    Ok(out)
}

/// Tokens that would repeat an n-gram already in `seq` (HF `NoRepeatNGramLogitsProcessor`).
pub fn banned_ngram_tokens(seq: &[i64], n: usize) -> Vec<i64> {
    if n == 0 || seq.len() + 1 < n {
        return Vec::new();
    }
    let prefix = &seq[seq.len() + 1 - n..];
    seq.windows(n)
        .filter(|w| &w[..n - 1] == prefix)
        .map(|w| w[n - 1])
        .collect()
}

/// Sets banned tokens of row `row` of `scores` `[b, V]` to -inf.
fn ban(scores: &mut Tensor, row: usize, tokens: &[i64]) -> Result<()> {
    if tokens.is_empty() {
        return Ok(());
    }
    let idx = Tensor::f_from_slice(tokens)?;
    let _ = scores
        .f_get(row as i64)?
        .f_index_fill_(0, &idx, f64::NEG_INFINITY)?;
    Ok(())
}

fn greedy(
    model: &SwitchModel,
    provider: &mut dyn ExpertProvider,
    encoded: &Tensor,
    options: &DecodeOptions,
    out: &mut Generation,
) -> Result<Vec<i64>> {
    let mut state = model.start_decoder(encoded, 1, options.kv_cache)?;
    let mut seq = vec![options.decoder_start_token_id];
    for _ in 0..options.max_new_tokens {
        options.cancellation.check()?;
        let step = Instant::now();
        let last = *seq.last().expect("starts with the start token");
        // Token selection runs on the host (logits are [1, V]).
        let mut logits = model
            .decode_step(&[last], &mut state, provider, &mut out.routes)?
            .f_to_device(tch::Device::Cpu)?;
        ban(
            &mut logits,
            0,
            &banned_ngram_tokens(&seq, options.no_repeat_ngram_size),
        )?;
        let next = greedy_token(&logits)?;
        seq.push(next);
        out.step_ms.push(step.elapsed().as_secs_f64() * 1e3);
        if next == options.eos_token_id {
            break;
        }
    }
    Ok(seq.split_off(1))
}

/// f32 values → a 1-D tensor (so that ranking uses libtorch's `topk`).
fn scores_tensor(values: &[f32]) -> Result<Tensor> {
    Ok(Tensor::f_from_slice(values)?)
}

/// Indices of the `k` largest values, best first, as `torch.topk` orders them.
fn topk_indices(values: &Tensor, k: usize) -> Result<Vec<i64>> {
    let (_, idx) = values.f_topk(k as i64, -1, true, true)?;
    Ok(Vec::<i64>::try_from(&idx)?)
}

const NEG_LARGE: f32 = -1.0e9;

struct Hypothesis {
    seq: Vec<i64>,
    score: f32,
    finished: bool,
}

fn beam_search(
    model: &SwitchModel,
    provider: &mut dyn ExpertProvider,
    encoded: &Tensor,
    options: &DecodeOptions,
    out: &mut Generation,
) -> Result<Vec<i64>> {
    let beams = options.num_beams;
    // HF keeps (1 + number of EOS tokens) × beams candidates, at least 2 × beams.
    let keep = 2 * beams;
    let max_length = 1 + options.max_new_tokens; // includes the start token
    let lp = options.length_penalty;
    let vocab = model.spec().vocab_size as i64;
    let mut state = model.start_decoder(encoded, beams, options.kv_cache)?;

    let start = options.decoder_start_token_id;
    let mut running: Vec<Vec<i64>> = vec![vec![start]; beams];
    let mut running_scores: Vec<f32> = (0..beams)
        .map(|b| if b == 0 { 0.0 } else { NEG_LARGE })
        .collect();
    let mut finished: Vec<Hypothesis> = (0..beams)
        .map(|_| Hypothesis {
            seq: vec![start],
            score: NEG_LARGE,
            finished: false,
        })
        .collect();
    let mut improvement_possible = true;
    let mut cur_len = 1usize;

    loop {
        options.cancellation.check()?;
        let step = Instant::now();
        let last: Vec<i64> = running
            .iter()
            .map(|s| *s.last().expect("non-empty"))
            .collect();
        let logits = model
            .decode_step(&last, &mut state, provider, &mut out.routes)?
            .f_to_device(tch::Device::Cpu)?; // [b, V]
        let mut log_probs = logits.f_log_softmax(-1, Kind::Float)?;
        for (row, seq) in running.iter().enumerate() {
            ban(
                &mut log_probs,
                row,
                &banned_ngram_tokens(seq, options.no_repeat_ngram_size),
            )?;
        }
        // log_probs + running_beam_scores[:, :, None], flattened over beams × vocabulary
        let accumulated = log_probs
            .f_add(&scores_tensor(&running_scores)?.f_unsqueeze(1)?)?
            .f_reshape([-1])?;
        let (top_scores, top_idx) = accumulated.f_topk(keep as i64, -1, true, true)?;
        let top_scores = Vec::<f32>::try_from(&top_scores)?;
        let top_idx = Vec::<i64>::try_from(&top_idx)?;
        let origin: Vec<usize> = top_idx.iter().map(|&i| (i / vocab) as usize).collect();
        let candidates: Vec<Vec<i64>> = top_idx
            .iter()
            .zip(&origin)
            .map(|(&i, &b)| {
                let mut s = running[b].clone();
                s.push(i % vocab);
                s
            })
            .collect();
        let hits: Vec<bool> = candidates
            .iter()
            .map(|s| {
                *s.last().expect("non-empty") == options.eos_token_id || cur_len + 1 >= max_length
            })
            .collect();

        // Next running beams: the best candidates that did not stop.
        let run_scores: Vec<f32> = top_scores
            .iter()
            .zip(&hits)
            .map(|(&s, &h)| s + if h { NEG_LARGE } else { 0.0 })
            .collect();
        let next = topk_indices(&scores_tensor(&run_scores)?, beams)?;
        let beam_origin: Vec<i64> = next.iter().map(|&k| origin[k as usize] as i64).collect();
        let next_running: Vec<Vec<i64>> = next
            .iter()
            .map(|&k| candidates[k as usize].clone())
            .collect();
        running_scores = next.iter().map(|&k| run_scores[k as usize]).collect();

        // Finished hypotheses: merge the best `beams` candidates that just stopped.
        let all_finished = finished.iter().all(|h| h.finished);
        let penalty = (cur_len as f64).powf(lp) as f32;
        let mut merged_scores: Vec<f32> = finished.iter().map(|h| h.score).collect();
        for (k, &score) in top_scores.iter().enumerate() {
            let just_finished = hits[k] && k < beams;
            let mut s = score / penalty;
            if all_finished && options.early_stopping == EarlyStopping::True {
                s += NEG_LARGE;
            }
            if !improvement_possible {
                s += NEG_LARGE;
            }
            if !just_finished {
                s += NEG_LARGE;
            }
            merged_scores.push(s);
        }
        let best = topk_indices(&scores_tensor(&merged_scores)?, beams)?;
        let mut new_finished = Vec::with_capacity(beams);
        for &m in &best {
            let m = m as usize;
            new_finished.push(if m < beams {
                let h = &finished[m];
                Hypothesis {
                    seq: h.seq.clone(),
                    score: h.score,
                    finished: h.finished,
                }
            } else {
                let k = m - beams;
                Hypothesis {
                    seq: candidates[k].clone(),
                    score: merged_scores[m],
                    finished: hits[k] && k < beams,
                }
            });
        }
        finished = new_finished;

        model.reorder(&mut state, &beam_origin)?;
        running = next_running;
        cur_len += 1;
        out.step_ms.push(step.elapsed().as_secs_f64() * 1e3);

        // Can a running beam still beat the worst finished one?
        let best_length = if options.early_stopping == EarlyStopping::Never && lp > 0.0 {
            max_length - 1
        } else {
            cur_len - 1
        };
        let best_possible = running_scores[0] / (best_length as f64).powf(lp) as f32;
        let worst_finished = finished
            .iter()
            .map(|h| h.score)
            .fold(f32::INFINITY, f32::min);
        improvement_possible &= finished.iter().any(|h| {
            let worst = if h.finished {
                worst_finished
            } else {
                NEG_LARGE
            };
            best_possible > worst
        });
        let all_done =
            finished.iter().all(|h| h.finished) && options.early_stopping == EarlyStopping::True;
        if !improvement_possible || all_done || hits.iter().all(|&h| h) {
            break;
        }
    }
    let mut best = finished.swap_remove(0).seq;
    Ok(best.split_off(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bans_tokens_that_complete_a_seen_ngram() {
        // seq ends with [5, 6]; the trigram [5, 6, 7] was seen, so 7 is banned.
        assert_eq!(banned_ngram_tokens(&[0, 5, 6, 7, 5, 6], 3), vec![7]);
        assert_eq!(banned_ngram_tokens(&[0, 5, 6], 3), Vec::<i64>::new());
        assert_eq!(banned_ngram_tokens(&[0, 5, 5], 2), vec![5]);
        assert!(banned_ngram_tokens(&[0, 5], 0).is_empty());
        assert!(banned_ngram_tokens(&[0], 3).is_empty());
    }
}
