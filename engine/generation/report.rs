//! Run statistics: what a run did and cost, as JSON (`--stats-json`, read back by `bench`) and
//! as a one-line summary.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::generation::decoding::Generation;
use crate::generation::session::CacheOptions;
use crate::model::KvFormat;
use crate::runtime::budget::BudgetPlan;
use crate::runtime::stats::{
    DictionaryStats, ExpertStats, LayerStats, PredictorKind, PredictorLayerStats, PrefetchStats,
    StandInStats,
};
use crate::units::format_bytes;

/// Per-document figures.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SampleStats {
    pub source_tokens: usize,
    pub tokens_generated: usize,
    pub encode_ms: f64,
    /// Of `encode_ms`, the time waited for expert bytes.
    pub encode_stall_ms: f64,
    /// Encoder + decoder wall time of this document.
    pub sample_ms: f64,
    pub decode_ms_per_token: f64,
}

/// The compute kernels a run used (detected on this CPU at run time).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct KernelStats {
    /// The GEMV kernel set of decode steps: `avx512+vnni`, `avx2+vnni`, `avx2`,
    /// `neon-dotprod`, `neon` or `scalar`.
    pub gemv: String,
    /// The integer GEMM of many-row products (an encoder pass, a prompt) on integer weights:
    /// `avx512-vnni`, `avx2`, `neon-dotprod` or `neon-i8mm`; `null` where there is none and such
    /// products take dequantized tiles and libtorch's f32 GEMM (the key itself is required).
    #[serde(deserialize_with = "Option::deserialize")]
    pub int_gemm: Option<String>,
    /// The float GEMM of many-row products on float weights (and on integer weights without an
    /// integer GEMM), up to `FLOAT_GEMM_MAX_ROWS` activation rows: `avx512` or `avx2`; `null`
    /// where there is none and such products take libtorch's f32 GEMM on tiles (the key itself
    /// is required).
    #[serde(deserialize_with = "Option::deserialize")]
    pub float_gemm: Option<String>,
}

impl KernelStats {
    /// This CPU's kernels.
    pub fn detected() -> Self {
        KernelStats {
            gemv: crate::quant::matrix::matmul_kernel().into(),
            int_gemm: crate::quant::matrix::int_gemm_kernel().map(Into::into),
            float_gemm: crate::quant::matrix::float_gemm_kernel().map(Into::into),
        }
    }
}

/// The statistics of one run: the `--stats-json` file. Its key names are an interface (scripts
/// and `bench` read them); every field is required when it is read back.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RunStats {
    pub documents: usize,
    pub tokens_generated: usize,
    /// Mean wall time of one decoder step (one new token, all beams).
    pub decode_ms_per_token: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub tokens_per_s: f64,
    pub encode_ms: f64,
    pub hit_ratio: f64,
    pub expert_accesses: u64,
    pub hits: u64,
    pub misses: u64,
    /// Same as `misses`: demand requests that read on the compute thread.
    pub demand_misses: u64,
    /// Hit ratio of each MoE layer.
    pub per_layer: Vec<LayerStats>,
    pub bytes_read: u64,
    /// `bytes_read` / decoder steps.
    pub bytes_read_per_token: f64,
    pub read_ms: f64,
    /// Time the compute thread waited for expert bytes (its reads + reads in flight).
    pub stall_ms: f64,
    /// `stall_ms` / decoder steps: the encoder passes' (prompt prefills') waits included.
    pub stall_ms_per_token: f64,
    /// Of `stall_ms`, the waits inside decoder steps: the encoder passes' (prompt prefills')
    /// are left out, so that this over `decode_ms_per_token` × steps is the share of decoding
    /// spent waiting for experts.
    pub decode_stall_ms: f64,
    /// `decode_stall_ms` / decoder steps.
    pub decode_stall_ms_per_token: f64,
    pub mode: String,
    /// Device profile the run used, if any (`null` in the file; the key itself is required).
    #[serde(deserialize_with = "Option::deserialize")]
    pub profile: Option<String>,
    pub policy: String,
    pub prefetch_enabled: bool,
    pub prefetch: PrefetchStats,
    /// Top-1 accuracy of the path dictionary on this run's tokens.
    pub dictionary: DictionaryStats,
    /// The predictor whose predictions started speculative reads (`--predictor`).
    pub predictor: PredictorKind,
    /// Precision and recall of each predictor per MoE layer: each forward call's predicted
    /// experts for the layer against the experts its router chose (modes with an expert buffer;
    /// `dictionary` needs a calibrated bundle, `gate` predicts within a forward call only).
    pub predictors: Vec<PredictorLayerStats>,
    /// What the stand-ins did (`--stand-in`; `null` without them, the key itself is required).
    #[serde(deserialize_with = "Option::deserialize")]
    pub stand_in: Option<StandInStats>,
    pub peak_rss_bytes: u64,
    pub budget_bytes: u64,
    pub resident_bytes: u64,
    pub working_bytes: u64,
    pub buffer_bytes: u64,
    pub buffer_slots: usize,
    pub kernels: KernelStats,
    /// How the cross-attention cache held its keys and values (`--kv-cache`: `f32`, `f16` or
    /// `int8`; `f32` in files written before the key).
    #[serde(default)]
    pub kv_cache: KvFormat,
    /// Generated ids of each document (without the decoder start token).
    pub output_ids: Vec<Vec<i64>>,
    pub samples: Vec<SampleStats>,
}

/// Peak resident set size of this process (`VmHWM`), 0 where `/proc` is unavailable.
pub fn peak_rss_bytes() -> u64 {
    proc_status_bytes("VmHWM:")
}

/// Resident set size of this process now (`VmRSS`), 0 where `/proc` is unavailable.
pub fn rss_bytes() -> u64 {
    proc_status_bytes("VmRSS:")
}

/// A `kB` line of `/proc/self/status`, in bytes.
fn proc_status_bytes(key: &str) -> u64 {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return 0;
    };
    status
        .lines()
        .find_map(|line| line.strip_prefix(key))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map(|kib| kib * 1024)
        .unwrap_or(0)
}

/// The `q`-quantile (0..=1) of `values` by nearest rank; 0 for no values.
pub fn percentile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

impl RunStats {
    /// Reads a `--stats-json` file; a missing key is an error naming the file.
    pub fn load(path: &Path) -> Result<RunStats> {
        crate::io::read_json(path)
    }

    /// Writes the `--stats-json` file (pretty JSON).
    pub fn save(&self, path: &Path) -> Result<()> {
        crate::io::write_json(path, self)
    }

    pub fn new(
        generations: &[(usize, Generation)],
        experts: &ExpertStats,
        plan: &BudgetPlan,
        cache: &CacheOptions,
    ) -> Self {
        let steps: Vec<f64> = generations
            .iter()
            .flat_map(|(_, g)| g.step_ms.iter().copied())
            .collect();
        let decode_ms: f64 = steps.iter().sum();
        let samples: Vec<SampleStats> = generations
            .iter()
            .map(|(source_tokens, g)| {
                let decode: f64 = g.step_ms.iter().sum();
                SampleStats {
                    source_tokens: *source_tokens,
                    tokens_generated: g.tokens.len(),
                    encode_ms: g.encode_ms,
                    encode_stall_ms: g.encode_stall_ms,
                    sample_ms: g.encode_ms + decode,
                    decode_ms_per_token: decode / g.step_ms.len().max(1) as f64,
                }
            })
            .collect();
        let tokens_generated = generations.iter().map(|(_, g)| g.tokens.len()).sum();
        let steps_total = steps.len().max(1) as f64;
        let encode_stall_ms: f64 = generations.iter().map(|(_, g)| g.encode_stall_ms).sum();
        // Clamped: a sum of differences can end a rounding below zero.
        let decode_stall_ms = (experts.stall_ms - encode_stall_ms).max(0.0);
        RunStats {
            documents: generations.len(),
            tokens_generated,
            decode_ms_per_token: decode_ms / steps.len().max(1) as f64,
            p50_ms: percentile(&steps, 0.5),
            p90_ms: percentile(&steps, 0.9),
            tokens_per_s: if decode_ms > 0.0 {
                tokens_generated as f64 / (decode_ms / 1e3)
            } else {
                0.0
            },
            encode_ms: generations.iter().map(|(_, g)| g.encode_ms).sum(),
            hit_ratio: experts.hit_ratio(),
            expert_accesses: experts.accesses,
            hits: experts.hits,
            misses: experts.misses,
            demand_misses: experts.misses,
            per_layer: experts.per_layer(),
            bytes_read: experts.bytes_read,
            bytes_read_per_token: experts.bytes_read as f64 / steps_total,
            read_ms: experts.read_ms,
            stall_ms: experts.stall_ms,
            stall_ms_per_token: experts.stall_ms / steps_total,
            decode_stall_ms,
            decode_stall_ms_per_token: decode_stall_ms / steps_total,
            mode: cache.mode.name().into(),
            profile: None,
            policy: cache.policy.name().into(),
            prefetch_enabled: cache.prefetch,
            prefetch: experts.prefetch.clone(),
            dictionary: experts.dictionary.clone(),
            predictor: cache.predictor,
            predictors: experts.predictions.report(),
            stand_in: experts.stand_in.clone(),
            peak_rss_bytes: peak_rss_bytes(),
            budget_bytes: plan.budget_bytes,
            resident_bytes: plan.resident_bytes,
            working_bytes: plan.working_bytes,
            buffer_bytes: plan.buffer_bytes(),
            buffer_slots: plan.slots,
            kernels: KernelStats::detected(),
            kv_cache: KvFormat::F32,
            output_ids: generations.iter().map(|(_, g)| g.tokens.clone()).collect(),
            samples,
        }
    }

    /// `64 tokens, 41.2 tokens/s (24.3 ms/token) · expert hit ratio 87.5% (224/256) · read 12.0 MiB · peak RSS 310 MiB`
    pub fn summary_line(&self) -> String {
        format!(
            "{} tokens, {:.1} tokens/s ({:.1} ms/token) · expert hit ratio {:.1}% ({}/{}) · read {} from the expert store, stalled {:.1} ms · mode {}, {} policy, prefetch {}{} · buffer {} slots ({}) of budget {} · peak RSS {}",
            self.tokens_generated,
            self.tokens_per_s,
            self.decode_ms_per_token,
            100.0 * self.hit_ratio,
            self.hits,
            self.expert_accesses,
            format_bytes(self.bytes_read),
            self.stall_ms,
            self.mode,
            self.policy,
            if self.prefetch_enabled {
                format!("on ({} issued, {} useful)", self.prefetch.issued, self.prefetch.useful)
            } else {
                "off".into()
            },
            match &self.stand_in {
                Some(s) => format!(
                    ", {} stand-ins computed {} accesses",
                    s.bits, s.used
                ),
                None => String::new(),
            },
            self.buffer_slots,
            format_bytes(self.buffer_bytes),
            format_bytes(self.budget_bytes),
            format_bytes(self.peak_rss_bytes),
        )
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let v = [5.0, 1.0, 4.0, 2.0, 3.0];
        assert_eq!(percentile(&v, 0.5), 3.0);
        assert_eq!(percentile(&v, 0.9), 5.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }

    #[test]
    fn reads_peak_rss() {
        assert!(peak_rss_bytes() > 0);
    }

    /// A complete statistics file (other modules' tests build on it).
    pub(crate) fn example() -> RunStats {
        RunStats {
            documents: 2,
            tokens_generated: 17,
            decode_ms_per_token: 12.5,
            p50_ms: 11.0,
            p90_ms: 20.25,
            tokens_per_s: 80.0,
            encode_ms: 30.5,
            hit_ratio: 0.75,
            expert_accesses: 64,
            hits: 48,
            misses: 16,
            demand_misses: 16,
            per_layer: vec![LayerStats {
                stack: "decoder".into(),
                block: 3,
                accesses: 64,
                hits: 48,
                hit_ratio: 0.75,
            }],
            bytes_read: 1 << 20,
            bytes_read_per_token: 61680.9,
            read_ms: 4.0,
            stall_ms: 5.5,
            stall_ms_per_token: 0.3,
            decode_stall_ms: 2.5,
            decode_stall_ms_per_token: 0.15,
            mode: "q+p+c".into(),
            profile: Some("rpi5-nvme".into()),
            policy: "edgemoe".into(),
            prefetch_enabled: true,
            prefetch: PrefetchStats {
                issued: 9,
                useful: 7,
                cancelled: 1,
                refuted: 1,
                failed: 0,
                bytes_read: 4096,
                wasted_bytes: 512,
                per_layer: vec![],
            },
            dictionary: DictionaryStats {
                predictions: 30,
                top1_correct: 21,
                top1_accuracy: 0.7,
            },
            predictor: PredictorKind::Gate,
            predictors: vec![PredictorLayerStats {
                predictor: PredictorKind::Both,
                stack: "decoder".into(),
                block: 3,
                calls: 16,
                predicted: 20,
                chosen: 16,
                correct: 12,
                precision: 0.6,
                recall: 0.75,
            }],
            stand_in: Some(StandInStats {
                bits: "int2".into(),
                experts: 32,
                bytes: 2 << 20,
                load_bytes: 16 << 20,
                load_ms: 12.5,
                used: 40,
                reads_started: 9,
                unbuffered: 1,
            }),
            peak_rss_bytes: 300 << 20,
            budget_bytes: 1 << 30,
            resident_bytes: 200 << 20,
            working_bytes: 50 << 20,
            buffer_bytes: 64 << 20,
            buffer_slots: 6,
            kernels: KernelStats {
                gemv: "neon-dotprod".into(),
                int_gemm: Some("neon-i8mm".into()),
                float_gemm: Some("avx512".into()),
            },
            kv_cache: KvFormat::Int8,
            output_ids: vec![vec![1, 2, 3], vec![]],
            samples: vec![SampleStats {
                source_tokens: 40,
                tokens_generated: 17,
                encode_ms: 30.5,
                encode_stall_ms: 3.0,
                sample_ms: 250.0,
                decode_ms_per_token: 12.5,
            }],
        }
    }

    #[test]
    fn stats_read_back_equal_and_keep_their_keys() {
        let stats = example();
        let json = serde_json::to_value(&stats).unwrap();
        // The key names scripts read: a rename must be deliberate.
        let mut keys: Vec<&str> = json
            .as_object()
            .unwrap()
            .keys()
            .map(|k| k.as_str())
            .collect();
        keys.sort_unstable();
        let mut expected = vec![
            "documents",
            "tokens_generated",
            "decode_ms_per_token",
            "p50_ms",
            "p90_ms",
            "tokens_per_s",
            "encode_ms",
            "hit_ratio",
            "expert_accesses",
            "hits",
            "misses",
            "demand_misses",
            "per_layer",
            "bytes_read",
            "bytes_read_per_token",
            "read_ms",
            "stall_ms",
            "stall_ms_per_token",
            "decode_stall_ms",
            "decode_stall_ms_per_token",
            "mode",
            "profile",
            "policy",
            "prefetch_enabled",
            "prefetch",
            "dictionary",
            "predictor",
            "predictors",
            "stand_in",
            "peak_rss_bytes",
            "budget_bytes",
            "resident_bytes",
            "working_bytes",
            "buffer_bytes",
            "buffer_slots",
            "kernels",
            "kv_cache",
            "output_ids",
            "samples",
        ];
        expected.sort_unstable();
        assert_eq!(keys, expected);
        assert_eq!(
            json["samples"][0].as_object().unwrap().len(),
            6,
            "{}",
            json["samples"][0]
        );
        assert_eq!(json["kv_cache"], "int8");
        let back: RunStats = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(back, stats);
        // A file written before `kv_cache` was a key: the f32 cache every run had then.
        let mut older = json;
        older.as_object_mut().unwrap().remove("kv_cache");
        let back: RunStats = serde_json::from_value(older).unwrap();
        assert_eq!(back.kv_cache, KvFormat::F32);

        let no_profile = RunStats {
            profile: None,
            kernels: KernelStats {
                gemv: "neon".into(),
                int_gemm: None,
                float_gemm: None,
            },
            ..example()
        };
        let text = serde_json::to_string_pretty(&no_profile).unwrap();
        assert_eq!(serde_json::from_str::<RunStats>(&text).unwrap(), no_profile);
    }

    #[test]
    fn a_missing_key_fails_naming_the_file_and_key() {
        let dir = tempfile::tempdir().unwrap();
        for (path, key) in [
            (&[][..], "p50_ms"),
            (&[][..], "profile"),
            (&["prefetch"][..], "useful"),
            (&["dictionary"][..], "top1_accuracy"),
            (&["kernels"][..], "int_gemm"),
            (&["kernels"][..], "float_gemm"),
        ] {
            let mut json = serde_json::to_value(example()).unwrap();
            let mut object = &mut json;
            for p in path {
                object = &mut object[*p];
            }
            object.as_object_mut().unwrap().remove(key);
            let file = dir.path().join("stats.json");
            std::fs::write(&file, json.to_string()).unwrap();
            let error = RunStats::load(&file).unwrap_err().to_string();
            assert!(
                error.contains("stats.json") && error.contains(&format!("missing field `{key}`")),
                "{error}"
            );
        }
    }
}
