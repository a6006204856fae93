//! What a bench matrix found: a row per run (`results.json`), the markdown table
//! (`results.md`), runs that failed, and the headline speed-ups of `edgemoe` over the baselines.

use std::path::PathBuf;

use serde::Serialize;

use crate::units::format_bytes;

/// A row of `results.json`.
#[derive(Debug, Clone, Serialize)]
pub struct BenchRow {
    pub mode: String,
    pub profile: String,
    /// The eviction policy the run used (the profile's, or `bench --policy`).
    pub policy: String,
    pub budget_bytes: u64,
    pub buffer_experts: Option<usize>,
    pub buffer_slots: usize,
    pub decode_ms_per_token: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    /// Mean per-document latency (encoder + decoder).
    pub sample_ms: f64,
    pub sample_ms_all: Vec<f64>,
    pub peak_rss_bytes: u64,
    /// Peak memory of the run's cgroup (page cache included), where a cgroup could be used.
    pub cgroup_peak_bytes: Option<u64>,
    /// The memory limit of the run's cgroup, where one was used.
    pub cgroup_limit_bytes: Option<u64>,
    pub bytes_read_per_token: f64,
    pub stall_ms_per_token: f64,
    /// The part of `stall_ms_per_token` spent inside decoder steps (encoder passes left out).
    pub decode_stall_ms_per_token: f64,
    pub hit_ratio: f64,
    pub tokens: u64,
    /// The generated ids equal those of the reference mode on the same weights
    /// (`io-free` for the bundle's store, `io-qexp` for the quantized one).
    pub outputs_match_reference: Option<bool>,
}

/// A run whose child process failed; it has no row.
#[derive(Debug, Clone)]
pub struct FailedRun {
    /// Mode and size, e.g. `q+p 6 experts`.
    pub label: String,
    /// The child's exit status.
    pub status: String,
    pub stderr: String,
}

impl FailedRun {
    /// Why it failed, on one line: the child's `error:` line, else its last line of output.
    pub fn reason(&self) -> String {
        let mut lines = self.stderr.lines().map(str::trim).filter(|l| !l.is_empty());
        lines
            .clone()
            .filter_map(|l| l.strip_prefix("error: "))
            .next_back()
            .or_else(|| lines.next_back())
            .unwrap_or("no output")
            .to_string()
    }
}

impl std::fmt::Display for FailedRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} failed ({}): {}",
            self.label, self.status, self.stderr
        )
    }
}

/// A finished matrix and the files it wrote (charts beside them in the same directory).
#[derive(Debug, Clone)]
pub struct BenchReport {
    pub rows: Vec<BenchRow>,
    pub documents: usize,
    /// The content of `results.md`: a line on the setup, then the table.
    pub markdown: String,
    pub results_json: PathBuf,
    pub results_md: PathBuf,
    pub failed: Vec<FailedRun>,
    /// Why runs were not confined to their budget, if they were meant to be and were not.
    pub cgroup_note: Option<String>,
}

/// `edgemoe` against one baseline, at each mode's first row.
#[derive(Debug, Clone, PartialEq)]
pub struct Speedup {
    pub baseline: String,
    pub edgemoe_ms_per_token: f64,
    pub baseline_ms_per_token: f64,
}

impl Speedup {
    /// How many times faster `edgemoe` decodes.
    pub fn ratio(&self) -> f64 {
        self.baseline_ms_per_token / self.edgemoe_ms_per_token
    }
}

impl BenchReport {
    /// The headline ratios: `edgemoe` against io-exp, io-qexp, mmap and io-free, where they ran.
    pub fn speedups(&self) -> Vec<Speedup> {
        let first = |m: &str| {
            self.rows
                .iter()
                .find(|r| r.mode == m)
                .map(|r| r.decode_ms_per_token)
        };
        let Some(edgemoe) = first("edgemoe") else {
            return Vec::new();
        };
        ["io-exp", "io-qexp", "mmap", "io-free"]
            .iter()
            .filter_map(|&base| {
                first(base).map(|b| Speedup {
                    baseline: base.into(),
                    edgemoe_ms_per_token: edgemoe,
                    baseline_ms_per_token: b,
                })
            })
            .collect()
    }
}

/// The markdown table of `results.md`.
pub fn markdown(rows: &[BenchRow]) -> String {
    let mut out = String::from(
        "| mode | profile | budget | slots | ms/token mean | p50 | p90 | ms/sample | peak RSS | cgroup peak | read/token | stall ms/token | hit ratio | same outputs |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        out += &format!(
            "| {} | {} | {}{} | {} | {:.2} | {:.2} | {:.2} | {:.0} | {} | {} | {} | {:.2} | {:.3} | {} |\n",
            r.mode,
            r.profile,
            format_bytes(r.budget_bytes),
            r.buffer_experts.map(|n| format!(" ({n} experts)")).unwrap_or_default(),
            r.buffer_slots,
            r.decode_ms_per_token,
            r.p50_ms,
            r.p90_ms,
            r.sample_ms,
            format_bytes(r.peak_rss_bytes),
            r.cgroup_peak_bytes.map(format_bytes).unwrap_or_else(|| "-".into()),
            format_bytes(r.bytes_read_per_token as u64),
            r.stall_ms_per_token,
            r.hit_ratio,
            match r.outputs_match_reference {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "-",
            }
        );
    }
    out
}
