//! `GET /metrics`: the counters in Prometheus' text exposition format (version 0.0.4):
//! `# HELP` and `# TYPE` lines, then the samples; histograms as cumulative `_bucket{le=…}`
//! lines with `_sum` and `_count`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use crate::generation::report::{peak_rss_bytes, rss_bytes};
use crate::runtime::stats::LayerStats;
use crate::serve::api::Stopped;

use super::{Histogram, Metrics};

impl Histogram {
    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(&self.counts) {
            cumulative += count;
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

impl Metrics {
    /// Prometheus' text exposition format.
    pub fn prometheus(&self) -> String {
        let mut out = String::new();
        let counters = self.counters();
        let gauge = |out: &mut String, name: &str, help: &str, value: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
            );
        };
        let counter = |out: &mut String, name: &str, help: &str, value: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
            );
        };
        let _ = writeln!(
            out,
            "# HELP edgemoe_model_info The model this server runs.\n# TYPE edgemoe_model_info gauge\nedgemoe_model_info{{model=\"{}\",architecture=\"{}\",kind=\"{}\",profile=\"{}\"}} 1",
            label(&self.model.name),
            label(&self.model.architecture),
            self.model.kind,
            label(self.model.profile.as_deref().unwrap_or("")),
        );
        gauge(
            &mut out,
            "edgemoe_ready",
            "1 once the model is loaded and requests are taken.",
            f64::from(u8::from(self.is_ready() && !self.is_stopping())),
        );
        let _ = writeln!(
            out,
            "# HELP edgemoe_requests_total Requests answered, by endpoint and HTTP status.\n# TYPE edgemoe_requests_total counter"
        );
        for ((endpoint, status), n) in &counters.requests {
            let _ = writeln!(
                out,
                "edgemoe_requests_total{{endpoint=\"{}\",status=\"{status}\"}} {n}",
                endpoint.path()
            );
        }
        let _ = writeln!(
            out,
            "# HELP edgemoe_requests_cancelled_total Requests stopped before they finished, by reason.\n# TYPE edgemoe_requests_cancelled_total counter"
        );
        for why in [Stopped::Disconnected, Stopped::Deadline, Stopped::Shutdown] {
            let n = counters.cancelled.get(why.name()).copied().unwrap_or(0);
            let _ = writeln!(
                out,
                "edgemoe_requests_cancelled_total{{reason=\"{}\"}} {n}",
                why.name()
            );
        }
        gauge(
            &mut out,
            "edgemoe_queue_depth",
            "Requests waiting for the engine.",
            self.queue_depth() as f64,
        );
        gauge(
            &mut out,
            "edgemoe_queue_capacity",
            "Requests the queue holds before answering 503 (--queue).",
            self.queue_capacity as f64,
        );
        gauge(
            &mut out,
            "edgemoe_requests_running",
            "Requests the engine is working on (0 or 1).",
            self.running.load(Ordering::Acquire) as f64,
        );
        counter(
            &mut out,
            "edgemoe_tokens_generated_total",
            "Tokens generated.",
            counters.tokens_generated as f64,
        );
        counter(
            &mut out,
            "edgemoe_input_tokens_total",
            "Document and prompt tokens read.",
            counters.input_tokens as f64,
        );
        counters.step_ms.write(
            &mut out,
            "edgemoe_decode_ms_per_token",
            "Wall time of one decoder step (one new token, all beams), in milliseconds.",
        );
        counters.request_s.write(
            &mut out,
            "edgemoe_request_duration_seconds",
            "Time from a request's arrival to its answer (queue wait included).",
        );
        if let Some(stats) = &counters.engine {
            gauge(
                &mut out,
                "edgemoe_expert_hit_ratio",
                "Expert demand requests served without a read of their own.",
                stats.hit_ratio,
            );
            counter(
                &mut out,
                "edgemoe_expert_accesses_total",
                "Expert demand requests.",
                stats.expert_accesses as f64,
            );
            counter(
                &mut out,
                "edgemoe_expert_hits_total",
                "Expert demand requests served without a read of their own.",
                stats.hits as f64,
            );
            // One sample per MoE layer, labelled with its stack and block.
            let per_layer = |out: &mut String,
                             name: &str,
                             kind: &str,
                             help: &str,
                             value: &dyn Fn(&LayerStats) -> String| {
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
                for layer in &stats.per_layer {
                    let _ = writeln!(
                        out,
                        "{name}{{stack=\"{}\",block=\"{}\"}} {}",
                        layer.stack,
                        layer.block,
                        value(layer)
                    );
                }
            };
            per_layer(
                &mut out,
                "edgemoe_layer_hit_ratio",
                "gauge",
                "Expert hit ratio of each MoE layer.",
                &|l| l.hit_ratio.to_string(),
            );
            per_layer(
                &mut out,
                "edgemoe_layer_accesses_total",
                "counter",
                "Expert demand requests of each MoE layer.",
                &|l| l.accesses.to_string(),
            );
            counter(
                &mut out,
                "edgemoe_bytes_read_total",
                "Bytes read from the expert store (demand and prefetch).",
                stats.bytes_read as f64,
            );
            counter(
                &mut out,
                "edgemoe_stall_seconds_total",
                "Time the compute thread waited for expert bytes.",
                stats.stall_ms / 1e3,
            );
            counter(
                &mut out,
                "edgemoe_prefetch_issued_total",
                "Expert reads started ahead of need.",
                stats.prefetch.issued as f64,
            );
            counter(
                &mut out,
                "edgemoe_prefetch_useful_total",
                "Prefetched experts a later demand used.",
                stats.prefetch.useful as f64,
            );
            counter(
                &mut out,
                "edgemoe_prefetch_wasted_bytes_total",
                "Bytes of prefetched experts evicted or dropped unused.",
                stats.prefetch.wasted_bytes as f64,
            );
            counter(
                &mut out,
                "edgemoe_prefetch_cancelled_total",
                "Prefetch requests dropped before their read started.",
                stats.prefetch.cancelled as f64,
            );
            counter(
                &mut out,
                "edgemoe_prefetch_refuted_total",
                "Prefetched experts dropped unused once their layer's router chose others.",
                stats.prefetch.refuted as f64,
            );
            for (name, help, value) in [
                (
                    "edgemoe_budget_bytes",
                    "The memory budget.",
                    stats.budget_bytes,
                ),
                (
                    "edgemoe_resident_bytes",
                    "Resident (non-expert) weights.",
                    stats.resident_bytes,
                ),
                (
                    "edgemoe_working_bytes",
                    "Working memory reserved for the largest request the limits allow.",
                    stats.working_bytes,
                ),
                (
                    "edgemoe_buffer_bytes",
                    "The expert buffer.",
                    stats.buffer_bytes,
                ),
                (
                    "edgemoe_buffer_slots",
                    "Slots of the expert buffer.",
                    stats.buffer_slots as u64,
                ),
            ] {
                gauge(&mut out, name, help, value as f64);
            }
        }
        let _ = writeln!(
            out,
            "# HELP edgemoe_buffer_layer_slots Expert-buffer slots holding an expert of each MoE layer.\n# TYPE edgemoe_buffer_layer_slots gauge"
        );
        let mut by_layer: BTreeMap<(&'static str, u16), usize> = BTreeMap::new();
        for id in counters.slots.iter().flatten() {
            *by_layer
                .entry((id.stack.hf_prefix(), id.layer))
                .or_default() += 1;
        }
        for ((stack, block), n) in by_layer {
            let _ = writeln!(
                out,
                "edgemoe_buffer_layer_slots{{stack=\"{stack}\",block=\"{block}\"}} {n}"
            );
        }
        drop(counters);
        gauge(
            &mut out,
            "edgemoe_rss_bytes",
            "Resident set size of the process.",
            rss_bytes() as f64,
        );
        gauge(
            &mut out,
            "edgemoe_peak_rss_bytes",
            "Peak resident set size of the process.",
            peak_rss_bytes() as f64,
        );
        out
    }
}

/// A Prometheus label value: backslash, quote and newline escaped.
fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::metrics::STEP_MS_BUCKETS;

    #[test]
    fn histogram_buckets_are_cumulative_in_the_text() {
        let mut h = Histogram::new(&STEP_MS_BUCKETS);
        for ms in [0.5, 3.0, 3.0, 40.0, 9000.0] {
            h.observe(ms);
        }
        let mut out = String::new();
        h.write(&mut out, "x", "help");
        assert!(out.contains("x_bucket{le=\"1\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"5\"} 3\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"50\"} 4\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"5000\"} 4\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"+Inf\"} 5\n"), "{out}");
        assert!(
            out.contains("x_count 5\n") && out.contains("x_sum 9046.5\n"),
            "{out}"
        );
    }

    #[test]
    fn labels_are_escaped() {
        assert_eq!(label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
