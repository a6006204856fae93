//! Whether speculation pays, per MoE layer. A speculative read (an expert the path dictionary
//! predicts for the next layer) saves the stall of a demand read when the router then chooses
//! it and it arrives in time; it costs device time that demand reads may queue behind, and,
//! when the buffer is full, the expert it evicts — which costs a demand read if that expert is
//! needed soon after. [`Speculation`] books both, in milliseconds, per layer:
//!
//! - **saved**: for a speculative read the router chose, the device time of one read minus
//!   what the compute thread still waited for it;
//! - **cost**: for one it did not choose, the device time it took (a read cancelled before it
//!   started costs nothing) times the share of the device a read holds (one channel of the
//!   queue depth, or the bus for as long as it moves the read's bytes, whichever is more:
//!   [`ExpertStore::device_share`](crate::store::ExpertStore::device_share)); the time demand
//!   reads waited in the queue while it was in flight; and a whole read for every expert it
//!   evicted that is missed within the next step.
//!
//! A layer speculates while the running mean of `saved − cost` over its recent candidates, and
//! their sum since it last started, stay at or above zero. When either falls below, the layer
//! stops reading and keeps scoring its predictions as if it had read them ("shadow"
//! candidates: a chosen one would have saved a read, times the share of a read that
//! speculation on this layer actually saved; an unchosen one would have cost its device
//! share; either, a read for each costly eviction per read the layer has seen); it resumes
//! once that mean rises above a margin. Both switches need a minimum number of candidates
//! since the last one (hysteresis), except that a layer more than a whole read behind stops
//! at once.
//!
//! Within a layer that speculates, each prediction is read only if its expected saving beats
//! its expected cost ([`Speculation::worth_reading`]): its probability times the share of a
//! read this layer's right guesses have saved, against the chance it is wrong times its share
//! of the device. Until a layer has a right guess to measure, that share is the time from its
//! predictions to its routing (what a read started then overlaps) over a read's time, measured
//! on this layer or, before its first routing, on the others: on an SD card whose read is 17
//! times a layer's compute, the first reads are not taken on trust.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use crate::ids::{ExpertId, Stack};

use super::stats::LayerSpeculation;

/// Weight of the newest candidate in a layer's running means.
const ALPHA: f64 = 0.1;
/// Candidates a layer needs since its last switch before it switches again.
const MIN_SAMPLES: u64 = 8;
/// A stopped layer resumes when its mean net saving per candidate exceeds this share of a read.
const RESUME_MARGIN: f64 = 0.1;

#[derive(Debug, Clone)]
struct LayerBook {
    enabled: bool,
    /// Running mean of saved − cost per candidate, ms.
    net_ms: f64,
    /// Running mean of the share of a read a chosen speculative read saved (`None` until one
    /// is measured).
    realized: Option<f64>,
    /// Running mean of the time from a candidate to its layer's routing, ms.
    lead_ms: Option<f64>,
    since_switch: u64,
    /// Sum of saved − cost since the last switch, ms.
    net_since_switch: f64,
    /// Candidates for the next routing of this layer: (expert, read issued, when).
    pending: Vec<(ExpertId, bool, Instant)>,
    stats: LayerSpeculation,
}

impl LayerBook {
    fn new(stack: Stack, block: u16) -> Self {
        LayerBook {
            enabled: true,
            net_ms: 0.0,
            realized: None,
            lead_ms: None,
            since_switch: 0,
            net_since_switch: 0.0,
            pending: Vec::new(),
            stats: LayerSpeculation {
                stack: stack.hf_prefix().into(),
                block,
                enabled: true,
                ..LayerSpeculation::default()
            },
        }
    }

    /// Costly evictions per speculative read this layer has issued (at most 1).
    fn eviction_share(&self) -> f64 {
        (self.stats.costly_evictions as f64 / self.stats.issued.max(1) as f64).min(1.0)
    }

    fn sample(&mut self, net_ms: f64, read_ms: f64) {
        self.net_ms += ALPHA * (net_ms - self.net_ms);
        self.since_switch += 1;
        self.net_since_switch += net_ms;
        // Speculating and already more than a whole read behind since it started: on a slow
        // card one costly eviction is a whole read, and waiting for MIN_SAMPLES candidates
        // would lose several more (BENCHMARKS §11, 6 slots on rpi4-sd).
        let behind = self.enabled && self.net_since_switch < -read_ms;
        if self.since_switch < MIN_SAMPLES && !behind {
            return;
        }
        let switch = if self.enabled {
            self.net_ms < 0.0 || self.net_since_switch < 0.0
        } else {
            self.net_ms > RESUME_MARGIN * read_ms
        };
        if switch {
            self.enabled = !self.enabled;
            self.stats.enabled = self.enabled;
            self.stats.switches += 1;
            self.since_switch = 0;
            self.net_since_switch = 0.0;
        }
    }
}

/// The books of every layer that has had a prediction.
#[derive(Debug, Clone)]
pub struct Speculation {
    layers: BTreeMap<(Stack, u16), LayerBook>,
    /// Running mean of the device time of one read, ms (0 until a read is seen).
    read_ms: f64,
    /// The share of the device one read holds while it runs
    /// ([`ExpertStore::device_share`](crate::store::ExpertStore::device_share)): 1 on a
    /// one-channel card, and close to 1 on an NVMe drive whose reads are mostly transfer.
    device_share: f64,
    /// Speculative reads whose expert the router chose, not yet demanded: → its layer.
    chosen: HashMap<ExpertId, (Stack, u16)>,
    /// Speculative reads not started when their layer routed without them.
    cancelled: Vec<ExpertId>,
    /// Device time of finished speculative reads not yet resolved.
    read_time: HashMap<ExpertId, f64>,
    /// Experts a speculative read evicted: → (its layer, the step it happened).
    evicted: HashMap<ExpertId, ((Stack, u16), u64)>,
    /// Running mean of the time from a candidate to its layer's routing over every layer, ms.
    lead_ms: Option<f64>,
}

/// `mean` moved toward `value` by [`ALPHA`] (set to it if empty).
fn update(mean: &mut Option<f64>, value: f64) {
    *mean = Some(mean.map_or(value, |m| m + ALPHA * (value - m)));
}

impl Speculation {
    /// `device_share`: the share of the device one read holds (1 on a one-channel card).
    pub fn new(device_share: f64, read_ms_estimate: f64) -> Self {
        Speculation {
            layers: BTreeMap::new(),
            read_ms: read_ms_estimate.max(0.0),
            device_share: device_share.clamp(0.0, 1.0),
            chosen: HashMap::new(),
            cancelled: Vec::new(),
            read_time: HashMap::new(),
            evicted: HashMap::new(),
            lead_ms: None,
        }
    }

    /// The share of a read a right guess on `layer` is expected to save: what its right guesses
    /// saved, else the time its predictions lead its routing (or, before its first routing,
    /// every layer's) over a read's time, else all of it.
    fn expected_share(&self, layer: Option<&LayerBook>) -> f64 {
        if let Some(realized) = layer.and_then(|b| b.realized) {
            return realized;
        }
        match layer.and_then(|b| b.lead_ms).or(self.lead_ms) {
            Some(lead) if self.read_ms > 0.0 => (lead / self.read_ms).min(1.0),
            _ => 1.0,
        }
    }

    fn book(&mut self, id: ExpertId) -> &mut LayerBook {
        self.layers
            .entry((id.stack, id.layer))
            .or_insert_with(|| LayerBook::new(id.stack, id.layer))
    }

    /// Whether `id`'s layer speculates now.
    pub fn enabled(&self, id: ExpertId) -> bool {
        self.layers
            .get(&(id.stack, id.layer))
            .is_none_or(|b| b.enabled)
    }

    /// Whether reading `id`, predicted with `probability`, is expected to save more device time
    /// than it costs: a right guess saves the share of a read this layer's right guesses are
    /// expected to save (see the module), a wrong one costs the share of the device a read
    /// holds. On a queue-depth-1 card whose reads take much longer than a layer's compute, a
    /// right guess saves little and only near-certain predictions are read.
    pub fn worth_reading(&self, id: ExpertId, probability: f64) -> bool {
        let share = self.expected_share(self.layers.get(&(id.stack, id.layer)));
        probability * share > (1.0 - probability) * self.device_share
    }

    /// A prediction for `id`'s layer, read (`issued`) or not, made now.
    pub fn candidate(&mut self, id: ExpertId, issued: bool) {
        self.candidate_at(id, issued, Instant::now());
    }

    /// [`Self::candidate`] made at `at`.
    pub fn candidate_at(&mut self, id: ExpertId, issued: bool, at: Instant) {
        let book = self.book(id);
        if book.pending.iter().any(|(p, ..)| *p == id) {
            return;
        }
        book.pending.push((id, issued, at));
        if issued {
            book.stats.issued += 1;
        } else {
            book.stats.skipped += 1;
        }
    }

    /// A speculative read for `id` took the slot of `victim` at decoder step `step`.
    pub fn evicted(&mut self, id: ExpertId, victim: ExpertId, step: u64) {
        self.evicted.insert(victim, ((id.stack, id.layer), step));
    }

    /// A speculative read was taken back before it started.
    pub fn cancelled(&mut self, id: ExpertId) {
        self.cancelled.push(id);
    }

    /// Any read finished in `read_ms` of device time; `speculative` when it was one.
    pub fn read(&mut self, id: ExpertId, read_ms: f64, speculative: bool) {
        self.read_ms = if self.read_ms == 0.0 {
            read_ms
        } else {
            self.read_ms + ALPHA * (read_ms - self.read_ms)
        };
        if speculative {
            self.read_time.insert(id, read_ms);
        }
        // Read back in: no longer missing.
        self.evicted.remove(&id);
    }

    /// The router of `block` of `stack` chose `experts` now: this layer's candidates are
    /// settled.
    pub fn routed(&mut self, stack: Stack, block: u16, experts: &[u16]) {
        self.routed_at(stack, block, experts, Instant::now());
    }

    /// [`Self::routed`] at `at`.
    pub fn routed_at(&mut self, stack: Stack, block: u16, experts: &[u16], at: Instant) {
        let Some(mut book) = self.layers.remove(&(stack, block)) else {
            return;
        };
        if let Some(first) = book.pending.iter().map(|&(.., when)| when).min() {
            let lead = at.saturating_duration_since(first).as_secs_f64() * 1e3;
            update(&mut book.lead_ms, lead);
            update(&mut self.lead_ms, lead);
        }
        let (read_ms, device_share) = (self.read_ms, self.device_share);
        let share = self.expected_share(Some(&book));
        for (id, issued, _) in std::mem::take(&mut book.pending) {
            let chosen = experts.contains(&id.expert);
            if issued && chosen {
                book.stats.useful += 1;
                self.chosen.insert(id, (stack, block));
                continue;
            }
            let net = if issued {
                book.stats.wasted += 1;
                let device_ms = match self.cancelled.iter().position(|c| *c == id) {
                    Some(at) => {
                        self.cancelled.swap_remove(at);
                        0.0
                    }
                    // Still in flight: it will take about a read.
                    None => self.read_time.remove(&id).unwrap_or(read_ms),
                };
                let cost = device_ms * device_share;
                book.stats.cost_ms += cost;
                -cost
            } else {
                // A shadow candidate: what reading it would have saved or cost, and the
                // evictions this layer's reads have cost per read (on a small buffer, most of
                // what speculation costs).
                let evictions = book.eviction_share() * read_ms;
                if chosen {
                    read_ms * share - evictions
                } else {
                    -read_ms * device_share - evictions
                }
            };
            book.sample(net, read_ms);
        }
        self.layers.insert((stack, block), book);
    }

    /// The model demanded `id` after waiting `waited_ms` for it (0 when it was resident).
    /// Returns whether it settled a speculative read.
    pub fn demanded(&mut self, id: ExpertId, waited_ms: f64) -> bool {
        self.read_time.remove(&id);
        let Some(layer) = self.chosen.remove(&id) else {
            return false;
        };
        let read_ms = self.read_ms;
        let saved = (read_ms - waited_ms).max(0.0);
        if let Some(book) = self.layers.get_mut(&layer) {
            if read_ms > 0.0 {
                update(&mut book.realized, saved / read_ms);
            }
            book.stats.saved_ms += saved;
            book.sample(saved, read_ms);
        }
        true
    }

    /// A demand read waited `queued_ms` in the queue while the speculative reads `behind` were
    /// in flight: the wait is charged to their layers. Returns whether anything was charged.
    pub fn delayed(&mut self, behind: &[ExpertId], queued_ms: f64) -> bool {
        if behind.is_empty() || queued_ms <= 0.0 {
            return false;
        }
        let (share, read_ms) = (queued_ms / behind.len() as f64, self.read_ms);
        for id in behind {
            let book = self.book(*id);
            book.stats.cost_ms += share;
            book.sample(-share, read_ms);
        }
        true
    }

    /// The model demanded `id` and had to read it, at decoder step `step`. Returns whether
    /// a speculative read's eviction was charged for it.
    pub fn missed(&mut self, id: ExpertId, step: u64) -> bool {
        self.chosen.remove(&id);
        let Some((layer, when)) = self.evicted.remove(&id) else {
            return false;
        };
        if step > when + 1 {
            return false;
        }
        let read_ms = self.read_ms;
        if let Some(book) = self.layers.get_mut(&layer) {
            book.stats.costly_evictions += 1;
            book.stats.cost_ms += read_ms;
            book.sample(-read_ms, read_ms);
        }
        true
    }

    /// Every layer's figures, encoder first.
    pub fn per_layer(&self) -> Vec<LayerSpeculation> {
        self.layers.values().map(|b| b.stats.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn dec(expert: u16) -> ExpertId {
        ExpertId {
            stack: Stack::Decoder,
            layer: 1,
            expert,
        }
    }

    /// Candidates made `lead_ms` before their layer's routing, one routing per call.
    struct Clock {
        now: Instant,
        lead: Duration,
    }

    impl Clock {
        fn new(lead_ms: u64) -> Self {
            Clock {
                now: Instant::now(),
                lead: Duration::from_millis(lead_ms),
            }
        }

        fn candidate(&mut self, s: &mut Speculation, id: ExpertId, issued: bool) {
            s.candidate_at(id, issued, self.now);
        }

        fn routed(&mut self, s: &mut Speculation, experts: &[u16]) {
            self.now += self.lead;
            s.routed_at(Stack::Decoder, 1, experts, self.now);
        }
    }

    #[test]
    fn a_layer_whose_guesses_are_wrong_stops_and_resumes_when_they_improve() {
        // Predictions a whole read ahead of their routing: a right one would save a read.
        let mut clock = Clock::new(10);
        let mut s = Speculation::new(1.0, 10.0);
        // Every read wasted, a whole read each on one channel: stops at the second, once more
        // than a read behind.
        for step in 0..2 {
            assert!(s.enabled(dec(0)), "stopped early, at {step}");
            clock.candidate(&mut s, dec(0), true);
            s.read(dec(0), 10.0, true);
            clock.routed(&mut s, &[1]);
        }
        assert!(!s.enabled(dec(0)));
        // Shadow candidates the router now chooses bring it back.
        let mut resumed_after = None;
        for step in 0..40 {
            clock.candidate(&mut s, dec(1), false);
            clock.routed(&mut s, &[1]);
            if s.enabled(dec(1)) {
                resumed_after = Some(step);
                break;
            }
        }
        let resumed_after = resumed_after.expect("never resumed");
        assert!(resumed_after + 1 >= MIN_SAMPLES as usize, "{resumed_after}");
        let stats = &s.per_layer()[0];
        assert_eq!((stats.issued, stats.wasted, stats.switches), (2, 2, 2));
        assert_eq!(stats.skipped, resumed_after as u64 + 1);
        assert!((stats.cost_ms - 20.0).abs() < 1e-9);
    }

    #[test]
    fn a_layer_stops_as_soon_as_it_is_more_than_a_read_behind() {
        // A read holds a quarter of the device (four channels, reads all latency): a wasted
        // read costs a quarter of a read; the fifth puts the layer more than a read behind,
        // before MIN_SAMPLES candidates.
        let mut s = Speculation::new(0.25, 10.0);
        for step in 0..5 {
            assert!(s.enabled(dec(0)), "stopped early, at {step}");
            s.candidate(dec(0), true);
            s.read(dec(0), 10.0, true);
            s.routed(Stack::Decoder, 1, &[1]);
        }
        assert!(!s.enabled(dec(0)));
        // A right guess that saved half a read, then one costly eviction: 5 − 10 ms, behind
        // by less than a read, so the layer goes on until MIN_SAMPLES candidates say more.
        let mut s = Speculation::new(1.0, 10.0);
        s.candidate(dec(2), true);
        s.routed(Stack::Decoder, 1, &[2]);
        s.read(dec(2), 10.0, true);
        s.demanded(dec(2), 5.0);
        let victim = dec(7);
        s.candidate(dec(3), true);
        s.evicted(dec(3), victim, 1);
        s.missed(victim, 2);
        assert!(s.enabled(dec(3)));
        // A second costly eviction: 15 ms behind, more than a read.
        s.evicted(dec(3), victim, 2);
        s.missed(victim, 3);
        assert!(!s.enabled(dec(3)));
        // Its guesses stay right, but its reads cost an eviction each: it does not resume.
        for _ in 0..40 {
            s.candidate(dec(2), false);
            s.routed(Stack::Decoder, 1, &[2]);
        }
        assert!(!s.enabled(dec(2)));
    }

    #[test]
    fn a_layer_is_judged_on_its_sum_as_well_as_its_recent_mean() {
        // One early loss of 9 ms (a demand read queued behind it), then 7 right guesses that
        // saved 1 ms each: the recent mean is positive by MIN_SAMPLES candidates, the sum is
        // not (−2 ms), and the layer stops.
        let mut s = Speculation::new(1.0, 10.0);
        s.delayed(&[dec(0)], 9.0);
        for step in 0..7 {
            assert!(s.enabled(dec(0)), "stopped early, at {step}");
            s.candidate(dec(0), true);
            s.routed(Stack::Decoder, 1, &[0]);
            s.read(dec(0), 10.0, true);
            s.demanded(dec(0), 9.0);
        }
        assert!(!s.enabled(dec(0)));
        assert_eq!(s.per_layer()[0].switches, 1);
    }

    #[test]
    fn useful_reads_keep_a_layer_on_and_count_what_they_saved() {
        let mut s = Speculation::new(1.0, 10.0);
        for _ in 0..20 {
            s.candidate(dec(2), true);
            s.routed(Stack::Decoder, 1, &[2]);
            s.read(dec(2), 10.0, true);
            s.demanded(dec(2), 4.0);
        }
        assert!(s.enabled(dec(2)));
        let stats = &s.per_layer()[0];
        assert_eq!((stats.issued, stats.useful), (20, 20));
        assert!((stats.saved_ms - 120.0).abs() < 1e-9, "{}", stats.saved_ms);
    }

    #[test]
    fn until_a_right_guess_is_measured_the_lead_over_a_read_is_the_expected_saving() {
        // Nothing measured yet: a right guess is assumed to save a whole read.
        let mut s = Speculation::new(1.0, 10.0);
        assert!(s.worth_reading(dec(0), 0.6));
        // Predictions 1 ms ahead of their routing, reads of 10 ms: a right guess would save a
        // tenth of a read, so only predictions above 1 / (1 + 0.1) are read on one channel.
        let mut clock = Clock::new(1);
        clock.candidate(&mut s, dec(0), false);
        clock.routed(&mut s, &[0]);
        assert!(!s.worth_reading(dec(0), 0.85));
        assert!(s.worth_reading(dec(0), 0.95));
        // A layer not routed yet takes what the others measured.
        let other = ExpertId {
            stack: Stack::Decoder,
            layer: 3,
            expert: 0,
        };
        assert!(!s.worth_reading(other, 0.85));
        // A right guess measured: what it saved replaces the estimate.
        clock.candidate(&mut s, dec(2), true);
        clock.routed(&mut s, &[2]);
        s.read(dec(2), 10.0, true);
        s.demanded(dec(2), 2.0);
        assert!(s.worth_reading(dec(0), 0.6));
        assert!(!s.worth_reading(dec(0), 0.5));
        assert!(
            !s.worth_reading(other, 0.85),
            "another layer's saving is its own"
        );
    }

    #[test]
    fn only_predictions_whose_expected_saving_beats_their_device_share_are_read() {
        // Untried layer: a right guess is assumed to save a whole read.
        let s = Speculation::new(1.0, 10.0);
        assert!(s.worth_reading(dec(0), 0.6));
        assert!(!s.worth_reading(dec(0), 0.4));
        // A layer whose 200 speculative reads (10 ms each) were all chosen, each waited for
        // `waited` ms.
        let right_guesses = |device_share: f64, waited: f64| {
            let mut s = Speculation::new(device_share, 10.0);
            for _ in 0..200 {
                s.candidate(dec(2), true);
                s.routed(Stack::Decoder, 1, &[2]);
                s.read(dec(2), 10.0, true);
                s.demanded(dec(2), waited);
            }
            s
        };
        // Right guesses that saved 1 ms of a 10 ms read (the compute they overlapped): a
        // queue-depth-1 device reads only predictions above 1 / (1 + 0.1).
        let slow = right_guesses(1.0, 9.0);
        assert!(!slow.worth_reading(dec(2), 0.85));
        assert!(slow.worth_reading(dec(2), 0.95));
        // A device whose reads are all latency, over four channels: a wrong guess holds a
        // quarter of it.
        let deep = right_guesses(0.25, 0.0);
        assert!(deep.worth_reading(dec(2), 0.25));
        assert!(!deep.worth_reading(dec(2), 0.15));
        // The same four channels behind one bus that 512 KiB reads keep busy (a read holds
        // 0.95 of the device, `store::reader::device_share`): a guess as likely wrong as right
        // costs about what it saves, and is not read.
        let bus = right_guesses(0.95, 0.0);
        assert!(!bus.worth_reading(dec(2), 0.45));
        assert!(bus.worth_reading(dec(2), 0.55));
    }

    #[test]
    fn an_eviction_missed_soon_after_is_charged_to_the_layer() {
        let mut s = Speculation::new(0.5, 10.0);
        let victim = ExpertId {
            stack: Stack::Decoder,
            layer: 0,
            expert: 5,
        };
        s.candidate(dec(3), true);
        s.evicted(dec(3), victim, 7);
        s.missed(victim, 8);
        let stats = &s.per_layer()[0];
        assert_eq!(stats.costly_evictions, 1);
        assert!((stats.cost_ms - 10.0).abs() < 1e-9);
        // Much later, the eviction is not what made it miss.
        s.evicted(dec(3), victim, 7);
        s.missed(victim, 20);
        assert_eq!(s.per_layer()[0].costly_evictions, 1);
    }
}
