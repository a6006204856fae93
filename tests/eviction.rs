//! Eviction, checked from outside the slot table. The live expert buffer's hit counts, under
//! every online policy and several buffer sizes, equal those of a reference simulator written
//! apart from `engine/cache` (below: it sees only the experts the model asked for, through a
//! recording expert provider, and works out the layer executing, passes and documents itself).
//! Trace replay shares the table and policy code with the live buffer, so "replay equals live"
//! cannot catch the buffer feeding the policy wrong facts; this can. And the outputs are
//! identical under every policy, buffer size and prefetch on/off on random models whose outputs
//! really differ from one input to the next (asserted), with many inputs.

mod common;

use std::collections::{BTreeSet, HashMap};

use common::golden::{decoder_golden, greedy_options};

use edgemoe::bundle::Bundle;
use edgemoe::cache::{LayerMap, Policy};
use edgemoe::generation::decoding::DecodeOptions;
use edgemoe::generation::session::run_model;
use edgemoe::ids::{ExpertId, Stack};
use edgemoe::model::provider::{ExpertProvider, ExpertWeights};
use edgemoe::model::Model;
use edgemoe::offline::calibrate::{build_dictionary, paths_of};
use edgemoe::runtime::buffer::{BufferOptions, ExpertBuffer};
use edgemoe::runtime::predict::PredictorKind;

/// An expert provider that passes everything to an expert buffer and writes down each demand
/// with the number of decoder steps begun before it.
struct Recorder<'a> {
    inner: &'a mut ExpertBuffer,
    decoder_steps: u64,
    demands: Vec<(ExpertId, u64)>,
}

impl ExpertProvider for Recorder<'_> {
    fn expert(
        &mut self,
        id: ExpertId,
        next: Option<ExpertId>,
    ) -> edgemoe::Result<ExpertWeights<'_>> {
        self.demands.push((id, self.decoder_steps));
        self.inner.expert(id, next)
    }

    fn begin_step(&mut self, stack: Stack) {
        if stack == Stack::Decoder {
            self.decoder_steps += 1;
        }
        self.inner.begin_step(stack);
    }

    fn routed(
        &mut self,
        stack: Stack,
        block: usize,
        k: usize,
        experts: &[u16],
    ) -> edgemoe::Result<()> {
        self.inner.routed(stack, block, k, experts)
    }
}

/// Hits and misses of `policy` with `slots` slots on `demands`, computed from scratch: no
/// offline seeds, the layer executing = the demanded expert's decoder MoE layer (none in the
/// encoder), a pass = one (step, layer) run of demands, a document = an encoder pass after
/// decoding. Ties go to the least recently used.
fn simulate(
    policy: Policy,
    slots: usize,
    layers: &LayerMap,
    demands: &[(ExpertId, u64)],
) -> (u64, u64) {
    let index = |id: ExpertId| {
        layers
            .blocks(id.stack)
            .iter()
            .position(|&b| b == id.layer as usize)
            .unwrap()
    };
    let s = layers.decoder_moe_blocks.len() as f64;
    // resident expert → (inserted, last used)
    let mut resident: HashMap<ExpertId, (u64, u64)> = HashMap::new();
    let mut count: HashMap<ExpertId, f64> = HashMap::new();
    // Per layer, the experts of each of its passes so far.
    let mut history: HashMap<(Stack, u16), Vec<BTreeSet<u16>>> = HashMap::new();
    let mut last_pass = None;
    // Decoder steps of each document (the last one is being decoded).
    let mut documents: Vec<BTreeSet<u64>> = vec![BTreeSet::new()];
    // Per document, the step (from 0) at which it first used each decoder expert.
    let mut first_use: Vec<HashMap<ExpertId, usize>> = vec![HashMap::new()];
    let (mut hits, mut misses) = (0, 0);
    for (clock, &(id, step)) in demands.iter().enumerate() {
        let clock = clock as u64 + 1;
        if last_pass != Some((step, id.stack, id.layer)) {
            if id.stack == Stack::Encoder
                && last_pass.is_some_and(|(_, st, _)| st == Stack::Decoder)
            {
                documents.push(BTreeSet::new());
                first_use.push(HashMap::new());
            }
            history
                .entry((id.stack, id.layer))
                .or_default()
                .push(BTreeSet::new());
            last_pass = Some((step, id.stack, id.layer));
        }
        history
            .get_mut(&(id.stack, id.layer))
            .unwrap()
            .last_mut()
            .unwrap()
            .insert(id.expert);
        if id.stack == Stack::Decoder {
            documents.last_mut().unwrap().insert(step);
            let at = documents.last().unwrap().len() - 1;
            first_use.last_mut().unwrap().entry(id).or_insert(at);
        }
        *count.entry(id).or_default() += 1.0;
        let current = (id.stack == Stack::Decoder).then(|| index(id) as f64);
        if let Some(entry) = resident.get_mut(&id) {
            hits += 1;
            entry.1 = clock;
            continue;
        }
        misses += 1;
        if resident.len() == slots {
            // Layers until layer `i` of the decoder runs next, as edgemoe and edgemoe-fd read d.
            let until = |i: f64| match current {
                Some(c) => (i - c - 1.0).rem_euclid(s) + 1.0,
                None => i + 1.0,
            };
            let key = |x: ExpertId| -> f64 {
                let i = index(x) as f64;
                let f = count.get(&x).copied().unwrap_or(0.0);
                match policy {
                    Policy::Lru => 0.0,
                    Policy::Fifo => resident[&x].0 as f64,
                    Policy::Lfu => f,
                    Policy::EdgemoeFd if x.stack == Stack::Encoder => 0.0,
                    Policy::EdgemoeFd => f / until(i),
                    Policy::EdgemoePaper if x.stack == Stack::Encoder => 0.0,
                    Policy::EdgemoePaper => {
                        let d = (s - i + current.unwrap_or(s - 1.0)).rem_euclid(s);
                        if d == 0.0 {
                            f64::INFINITY
                        } else {
                            f / d
                        }
                    }
                    Policy::Edgemoe => {
                        -expected_reuse(x, id, current, layers, &history, &documents, None)
                    }
                    Policy::EdgemoeDocs => -expected_reuse(
                        x,
                        id,
                        current,
                        layers,
                        &history,
                        &documents,
                        Some(&first_use),
                    ),
                    Policy::Belady => unreachable!(),
                }
            };
            let victim = *resident
                .keys()
                .min_by(|&&a, &&b| {
                    key(a)
                        .total_cmp(&key(b))
                        .then(resident[&a].1.cmp(&resident[&b].1))
                })
                .unwrap();
            resident.remove(&victim);
        }
        resident.insert(id, (clock, clock));
    }
    (hits, misses)
}

/// `edgemoe`'s expected MoE-layer passes until `x` is demanded again, from the passes of its
/// layer: the chance that the next pass demands it given whether the last one did, then rounds
/// at a rate leaning on the "not demanded last time" chance. `now` is the expert being demanded,
/// `current` the decoder MoE layer executing. With `first_use` (`edgemoe-docs`), a decoder
/// expert that finished documents used comes back at the step where documents first used it on
/// average, in this document if that step is still to come and it has not been used here yet,
/// else in the next, after as many documents as it skips on average: if that is sooner, or
/// whatever it is while the next document's encoder runs.
fn expected_reuse(
    x: ExpertId,
    now: ExpertId,
    current: Option<f64>,
    layers: &LayerMap,
    history: &HashMap<(Stack, u16), Vec<BTreeSet<u16>>>,
    documents: &[BTreeSet<u64>],
    first_use: Option<&[HashMap<ExpertId, usize>]>,
) -> f64 {
    let index = |id: ExpertId| {
        layers
            .blocks(id.stack)
            .iter()
            .position(|&b| b == id.layer as usize)
            .unwrap() as f64
    };
    let (e, s, i) = (
        layers.encoder_moe_blocks.len() as f64,
        layers.decoder_moe_blocks.len() as f64,
        index(x),
    );
    let used: Vec<bool> = history[&(x.stack, x.layer)]
        .iter()
        .map(|p| p.contains(&x.expert))
        .collect();
    let uses = used.iter().filter(|&&u| u).count() as f64;
    let pairs =
        |a: bool, b: bool| used.windows(2).filter(|w| w[0] == a && w[1] == b).count() as f64;
    let share = uses / used.len() as f64;
    let (used_used, used_any) = (pairs(true, true), pairs(true, true) + pairs(true, false));
    let none_any = pairs(false, true) + pairs(false, false);
    // Uses not preceded by a use: the first pass's, and those after a pass without it.
    let fresh = uses - used_used;
    let again = ((used_used + share) / (used_any + 1.0)).min(1.0);
    let anew = ((fresh + share) / (none_any + 1.0)).min(1.0);
    let first = if *used.last().unwrap() { again } else { anew };
    let later = first.powf(0.25) * anew.powf(0.75);
    // Decoder steps expected of this document: the mean of the finished ones, at least one more.
    let done = documents.last().unwrap().len() as f64;
    let finished = &documents[..documents.len() - 1];
    let mean = finished.iter().map(|d| d.len() as f64).sum::<f64>() / finished.len().max(1) as f64;
    let steps = if finished.is_empty() {
        done + 1.0
    } else {
        mean.max(done + 1.0)
    };
    // The encoder MoE layer running, if the encoder runs.
    let encoding = (now.stack == Stack::Encoder).then(|| index(now));
    let (until, period) = match (x.stack, encoding, current) {
        (Stack::Decoder, _, Some(c)) => ((i - c - 1.0).rem_euclid(s) + 1.0, s),
        (Stack::Decoder, Some(at), None) => ((e - 1.0 - at) + i + 1.0, s),
        (Stack::Decoder, None, None) => (i + 1.0, s),
        (Stack::Encoder, Some(at), _) if i > at => (i - at, e + steps * s),
        (Stack::Encoder, Some(at), _) => ((e - at) + steps * s + i, e + steps * s),
        (Stack::Encoder, None, _) => ((steps - done).max(0.0) * s + i + 1.0, e + steps * s),
    };
    let by_passes = until + period * (1.0 - first) / later;
    let finished = documents.len() - 1;
    let Some(first_use) = first_use.filter(|_| x.stack == Stack::Decoder && finished > 0) else {
        return by_passes;
    };
    let using: Vec<f64> = first_use
        .iter()
        .filter_map(|d| d.get(&x).map(|&at| at as f64))
        .collect();
    if using.is_empty() {
        return by_passes;
    }
    let decoding = now.stack == Stack::Decoder;
    let seen = finished as f64 + if decoding { 1.0 } else { 0.0 };
    let share = (using.len() as f64 / seen).min(1.0);
    let usual = using.iter().sum::<f64>() / using.len() as f64;
    let step_now = if decoding { done - 1.0 } else { 0.0 };
    let used_here = decoding && first_use.last().unwrap().contains_key(&x);
    let to_its_step = if !used_here && usual >= step_now {
        (usual - step_now) * s
    } else {
        (steps - step_now).max(1.0) * s - s + e + usual * s
    };
    let document = e + steps * s;
    let by_documents = until + to_its_step + document * (1.0 - share) / share;
    // While a new document's encoder runs, its decoder is read by the documents alone.
    if encoding.is_some() {
        by_documents
    } else {
        by_passes.min(by_documents)
    }
}

/// A converted model with the documents (token ids) it is run on.
struct Subject {
    name: String,
    _dir: tempfile::TempDir,
    bundle: Bundle,
    model: Model,
    options: DecodeOptions,
    documents: Vec<Vec<i64>>,
}

impl Subject {
    fn open(
        name: &str,
        hf: &std::path::Path,
        documents: impl FnOnce(&Bundle) -> Vec<Vec<i64>>,
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let bundle = Bundle::open(&common::convert_to(hf, dir.path())).unwrap();
        let model = bundle.load_model(tch::Device::Cpu).unwrap();
        let options = if model.has_encoder() {
            let mut options = DecodeOptions::from_defaults(&bundle.config.generation);
            options.max_new_tokens = options.max_new_tokens.min(16);
            options
        } else {
            let mut options = greedy_options(&decoder_golden(name));
            options.max_new_tokens = options.max_new_tokens.min(16);
            options
        };
        let documents = documents(&bundle);
        Subject {
            name: name.to_string(),
            _dir: dir,
            bundle,
            model,
            options,
            documents,
        }
    }

    /// The demo model on SAMSum test dialogues.
    fn demo(dialogues: usize) -> Self {
        Subject::open("demo", &common::demo_checkpoint(), |bundle| {
            let tokenizer = bundle.tokenizer().unwrap();
            let generation = &bundle.config.generation;
            common::samsum_dialogues("test", dialogues)
                .iter()
                .map(|d| {
                    let text = edgemoe::generation::input::model_input(d, &generation.input_prefix);
                    tokenizer
                        .encode(&text, generation.max_source_tokens)
                        .unwrap()
                })
                .collect()
        })
    }

    /// A tiny random fixture on `n` random inputs of 4 to 40 tokens (Switch: ending in `</s>`),
    /// after the fixture's golden inputs for a decoder-only model.
    fn random(name: &str, n: usize) -> Self {
        Subject::open(name, &common::fixture(name), |bundle| {
            let vocab = bundle.config.model.vocab_size() as u64;
            let switch = bundle.config.model.has_encoder();
            let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ name.len() as u64;
            let mut next = move || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state
            };
            let mut docs: Vec<Vec<i64>> = if switch {
                Vec::new()
            } else {
                decoder_golden(name)
                    .cases
                    .iter()
                    .map(|c| c.input_ids.clone())
                    .collect()
            };
            while docs.len() < n {
                let len = 4 + (next() % 37) as usize;
                let mut ids: Vec<i64> = (0..len)
                    .map(|_| (2 + next() % (vocab - 2)) as i64)
                    .collect();
                if switch {
                    ids.push(1);
                }
                docs.push(ids);
            }
            docs
        })
    }

    fn total_experts(&self) -> usize {
        self.bundle.open_store().unwrap().index().experts.len()
    }

    fn buffer(
        &self,
        options: &BufferOptions,
        dictionary: Option<&edgemoe::dictionary::PathDictionary>,
    ) -> ExpertBuffer {
        ExpertBuffer::with_options(
            self.bundle.open_store().unwrap(),
            &self.bundle.config.model,
            options,
            dictionary.map(|d| std::sync::Arc::new(d.clone())),
        )
        .unwrap()
    }

    /// Every document's output tokens, with the experts from `provider`.
    fn run(
        &self,
        provider: &mut dyn ExpertProvider,
    ) -> Vec<edgemoe::generation::decoding::Generation> {
        self.documents
            .iter()
            .map(|ids| {
                run_model(&self.model, provider, ids, &self.options, &mut |_| Ok(())).unwrap()
            })
            .collect()
    }
}

fn no_prefetch(policy: Policy, slots: usize) -> BufferOptions {
    BufferOptions {
        slots,
        policy,
        prefetch: false,
        prefetch_cap_bytes: 0,
        predictor: PredictorKind::Dictionary,
        stand_in: None,
    }
}

/// Runs `subject` under every online policy at `sizes` (those below its expert count) and
/// compares the live hit counts with [`simulate`]'s on the recorded demands.
fn assert_live_hits_match_the_reference(subject: &Subject, sizes: &[usize]) {
    let layers = subject.bundle.config.model.layer_map();
    let total = subject.total_experts();
    let mut by_policy: HashMap<usize, BTreeSet<u64>> = HashMap::new();
    for &slots in sizes.iter().filter(|&&s| s < total) {
        for policy in Policy::ONLINE {
            let mut buffer = subject.buffer(&no_prefetch(policy, slots), None);
            let mut recorder = Recorder {
                inner: &mut buffer,
                decoder_steps: 0,
                demands: Vec::new(),
            };
            subject.run(&mut recorder);
            let demands = std::mem::take(&mut recorder.demands);
            let stats = buffer.stats();
            let what = format!("{}: {policy}, {slots} slots", subject.name);
            assert_eq!(stats.accesses as usize, demands.len(), "{what}");
            let distinct = demands.iter().map(|d| d.0).collect::<BTreeSet<_>>().len() as u64;
            assert!(
                stats.misses > distinct,
                "{what}: no evictions ({} misses)",
                stats.misses
            );
            assert_eq!(
                (stats.hits, stats.misses),
                simulate(policy, slots, &layers, &demands),
                "{what}: live hits/misses vs the reference"
            );
            by_policy.entry(slots).or_default().insert(stats.hits);
        }
    }
    // The policies disagree somewhere, or the comparison would not tell them apart.
    assert!(
        by_policy.values().any(|hits| hits.len() >= 3),
        "{}: policies hardly differ: {by_policy:?}",
        subject.name
    );
}

#[test]
fn live_hit_counts_equal_an_independent_simulation_switch() {
    assert_live_hits_match_the_reference(&Subject::demo(6), &[2, 3, 5, 8, 12]);
    for name in common::SWITCH_FIXTURES {
        assert_live_hits_match_the_reference(&Subject::random(name, 12), &[2, 3, 5, 8]);
    }
}

#[test]
fn live_hit_counts_equal_an_independent_simulation_decoder_only() {
    for name in common::DECODER_FIXTURES {
        assert_live_hits_match_the_reference(&Subject::random(name, 12), &[2, 3, 5, 8]);
    }
}

/// Every policy, buffer size (1 slot, 3, all experts) and prefetch on/off gives the outputs of
/// the all-resident run, on many inputs whose outputs differ.
fn assert_outputs_invariant(subject: &Subject) {
    let total = subject.total_experts();
    let spec = &subject.bundle.config.model;
    let mut all = ExpertBuffer::new(subject.bundle.open_store().unwrap(), spec, total);
    let reference = subject.run(&mut all);
    let outputs: Vec<Vec<i64>> = reference.iter().map(|g| g.tokens.clone()).collect();
    let distinct = outputs.iter().collect::<BTreeSet<_>>().len();
    assert!(
        distinct * 4 >= outputs.len() * 3,
        "{}: only {distinct} different outputs for {} inputs",
        subject.name,
        outputs.len()
    );
    let (encoder, decoder) = (
        spec.moe_blocks(Stack::Encoder).len(),
        spec.moe_blocks(Stack::Decoder).len(),
    );
    let paths: Vec<_> = reference
        .iter()
        .map(|g| paths_of(&g.routes, encoder, decoder))
        .collect();
    let dictionary = build_dictionary(&paths, encoder, decoder, spec.num_experts(), spec.top_k());
    for policy in Policy::ONLINE {
        for prefetch in [false, true] {
            for slots in [1, 3, total] {
                let what = format!(
                    "{}: {policy}, prefetch {prefetch}, {slots} slots",
                    subject.name
                );
                let options = BufferOptions {
                    slots,
                    policy,
                    prefetch,
                    prefetch_cap_bytes: u64::MAX / 2,
                    // Both predictors: the most speculative reads, the strictest invariance.
                    predictor: PredictorKind::Both,
                    stand_in: None,
                };
                let mut buffer = subject.buffer(&options, prefetch.then_some(&dictionary));
                let got: Vec<Vec<i64>> = subject
                    .run(&mut buffer)
                    .into_iter()
                    .map(|g| g.tokens)
                    .collect();
                assert_eq!(got, outputs, "{what}");
                let stats = buffer.stats();
                assert_eq!(stats.hits + stats.misses, stats.accesses, "{what}");
                // One slot holds the expert being computed on whenever a read could start.
                if prefetch && slots >= 2 {
                    assert!(stats.prefetch.issued > 0, "{what}: no prefetch");
                }
            }
        }
    }
}

#[test]
fn outputs_identical_under_every_policy_size_and_prefetch_on_inputs_that_differ_switch() {
    // tiny-tied-e4 (d_model 32) writes one of two outputs whatever the input: left out.
    assert_outputs_invariant(&Subject::random("tiny-untied-e8", 12));
}

#[test]
fn outputs_identical_under_every_policy_size_and_prefetch_on_inputs_that_differ_decoder_only() {
    for name in common::DECODER_FIXTURES {
        assert_outputs_invariant(&Subject::random(name, 10));
    }
}

/// `calibrate`'s pass counts, which seed the `edgemoe` policy, count the passes the policy
/// itself counts: on an all-resident run, the counts `build_dictionary` makes of the model's
/// routes equal those worked out here from the demands the buffer received (a pass = one
/// (step, stack, layer) run of demands; a repeat = a use right after its layer's pass before
/// used the expert too), on the demo model and a random fixture of each kind.
#[test]
fn calibration_counts_the_passes_the_policy_sees() {
    let subjects = [
        Subject::demo(4),
        Subject::random(common::SWITCH_FIXTURES[0], 6),
        Subject::random(common::DECODER_FIXTURES[0], 6),
    ];
    for subject in &subjects {
        let spec = &subject.bundle.config.model;
        let layers = spec.layer_map();
        let mut buffer = subject.buffer(&no_prefetch(Policy::Lru, subject.total_experts()), None);
        let mut recorder = Recorder {
            inner: &mut buffer,
            decoder_steps: 0,
            demands: Vec::new(),
        };
        let generations = subject.run(&mut recorder);
        // Per (stack, block): the experts of each of its passes, in order.
        let mut passes: HashMap<(Stack, u16), Vec<BTreeSet<u16>>> = HashMap::new();
        let mut last = None;
        for &(id, step) in &recorder.demands {
            let layer = passes.entry((id.stack, id.layer)).or_default();
            if last != Some((step, id.stack, id.layer)) {
                layer.push(BTreeSet::new());
                last = Some((step, id.stack, id.layer));
            }
            layer.last_mut().unwrap().insert(id.expert);
        }
        let (encoder, decoder) = (layers.encoder_layers(), layers.decoder_layers());
        let paths: Vec<_> = generations
            .iter()
            .map(|g| paths_of(&g.routes, encoder, decoder))
            .collect();
        let dictionary =
            build_dictionary(&paths, encoder, decoder, spec.num_experts(), spec.top_k());
        let mut nontrivial = false;
        for stack in [Stack::Encoder, Stack::Decoder] {
            let counted = &dictionary.stack(stack).passes;
            for (moe, &block) in layers.blocks(stack).iter().enumerate() {
                let what = format!("{}: {stack:?} block {block}", subject.name);
                let seen = &passes[&(stack, block as u16)];
                assert_eq!(counted.passes, seen.len() as u64, "{what}: passes");
                for expert in 0..spec.num_experts() as u16 {
                    let used: Vec<bool> = seen.iter().map(|p| p.contains(&expert)).collect();
                    let uses = used.iter().filter(|&&u| u).count() as u64;
                    let repeats = used.windows(2).filter(|w| w[0] && w[1]).count() as u64;
                    assert_eq!(
                        (
                            counted.uses[moe][expert as usize],
                            counted.repeats[moe][expert as usize]
                        ),
                        (uses, repeats),
                        "{what}, expert {expert}: (uses, repeats) from calibration vs the demands"
                    );
                    nontrivial |= repeats > 0 && repeats < uses;
                }
            }
        }
        assert!(
            nontrivial,
            "{}: no expert both repeated and not",
            subject.name
        );
    }
}
