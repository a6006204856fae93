//! `edgemoe bench`: the paper's comparisons as a matrix of engine modes × memory budgets (or
//! buffer sizes), each run in a child process — inside a memory cgroup limited to the budget
//! where the machine allows it, so page-cache baselines pay for what they map — with the
//! bundles' cached pages (expert store and resident weights) dropped before every run, so that
//! each run reads, and its cgroup is charged for, every page it touches. Each child's
//! `--stats-json` file is read back as [`RunStats`]; the matrix is written as `results.json`,
//! `results.md` and SVG/PNG charts.
//!
//! The cgroup of a run holds its budget plus the process's own memory (binary, libtorch,
//! allocator), measured once per matrix by a probe run that holds no expert buffer (`io-exp` on
//! the first document, in a cgroup of its own: its peak minus resident weights — counted once,
//! though the peak also holds the cached file they were copied from — working memory and its
//! one expert) unless given. With `--buffer-experts N`, `mmap`'s cgroup holds what `edgemoe`
//! holds with N slots — that overhead, the resident weights, the working memory and N slots, or
//! what the `edgemoe` run with N slots was measured to hold where that is more (`mmap` runs
//! last) — so the page cache gets the memory the buffer would have had, not the profile's whole
//! budget.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use indicatif::{ProgressBar, ProgressStyle};

use crate::bench::charts::{plot_latency_bars, plot_latency_vs_budget, plot_sample_cdf};
use crate::bench::report::{BenchReport, BenchRow, FailedRun};
use crate::bundle::{EXPERTS_FILE, RESIDENT_FILE};
use crate::cache::Policy;
use crate::config::profile::DeviceProfile;
use crate::error::{Error, Result};
use crate::generation::report::RunStats;
use crate::io::write_json;
use crate::offline::bit_plan::BitPlan;
use crate::offline::calibrate::read_documents;
use crate::offline::convert::requantize_bundle;
use crate::quant::QuantBits;
use crate::runtime::modes::Mode;
use crate::store::{ExpertEncoding, StorageMode};
use crate::units::format_bytes;

/// The folder of the all-INT4 copy of the model made in `out` when no quantized bundle is given.
const QUANTIZED_DIR: &str = "quantized-int4";
/// The documents as the runs read them: with [`RUNS_DIR`], written first by every bench, so the
/// two mark a folder as an earlier bench's output, whose files a new bench may replace.
const INPUT_FILE: &str = "input.jsonl";
/// Each run's statistics.
const RUNS_DIR: &str = "runs";

/// How the runs of each mode are sized.
#[derive(Debug, Clone, PartialEq)]
pub enum BenchSizes {
    /// Memory budgets; none = the profile's.
    Budgets(Vec<u64>),
    /// Buffer sizes in experts, each run with the profile's budget (for models far smaller than
    /// the board).
    BufferExperts(Vec<usize>),
}

/// What a bench matrix runs and where it writes.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// The `edgemoe` binary each run is a child of (`summarize`).
    pub executable: PathBuf,
    pub model: PathBuf,
    /// Bundle of the same model with quantized experts for io-qexp/q/q+p/q+p+c; `None` makes an
    /// all-INT4 copy in `out` when a mode needs one.
    pub quantized: Option<PathBuf>,
    /// Documents: JSON lines with a `dialogue` or `document` field.
    pub data: PathBuf,
    /// Use the first N documents.
    pub limit: usize,
    /// Device profile (built-in name or TOML file), passed on to every run.
    pub profile: String,
    /// Eviction policy of every run in place of the profile's (`None`: the profile's).
    pub policy: Option<Policy>,
    pub modes: Vec<Mode>,
    pub sizes: BenchSizes,
    pub storage: StorageMode,
    /// Most tokens generated per document (default: the model's generation config).
    pub max_new_tokens: Option<usize>,
    /// Whether to confine runs to a memory cgroup of their budget plus the process overhead.
    pub confine: bool,
    /// Memory a run may use beyond its budget inside the cgroup (binary, libtorch, allocator);
    /// `None` measures it with a probe run.
    pub cgroup_overhead_bytes: Option<u64>,
    pub out: PathBuf,
    /// A progress bar, and warnings on standard error as they happen.
    pub show_progress: bool,
}

/// One cell of the matrix.
#[derive(Debug, Clone)]
pub struct BenchRun {
    pub mode: Mode,
    /// Either a budget or a buffer size in experts (with the profile's budget).
    pub budget_bytes: Option<u64>,
    pub buffer_experts: Option<usize>,
}

/// The cells, mode by mode, each mode at every size; `mmap` last, so that where it is sized in
/// experts its cgroup can hold what the `edgemoe` run of the same size was measured to hold
/// ([`cgroup_limit`]).
pub fn plan_runs(modes: &[Mode], sizes: &BenchSizes, profile_budget_bytes: u64) -> Vec<BenchRun> {
    let mut runs = Vec::new();
    let (mapped, others): (Vec<Mode>, Vec<Mode>) = modes.iter().partition(|&&m| m == Mode::Mmap);
    for mode in others.into_iter().chain(mapped) {
        match sizes {
            BenchSizes::Budgets(budgets) if budgets.is_empty() => runs.push(BenchRun {
                mode,
                budget_bytes: Some(profile_budget_bytes),
                buffer_experts: None,
            }),
            BenchSizes::Budgets(budgets) => runs.extend(budgets.iter().map(|&b| BenchRun {
                mode,
                budget_bytes: Some(b),
                buffer_experts: None,
            })),
            BenchSizes::BufferExperts(sizes) => runs.extend(sizes.iter().map(|&n| BenchRun {
                mode,
                budget_bytes: None,
                buffer_experts: Some(n),
            })),
        }
    }
    runs
}

/// Where the harness can confine a run: a cgroup v1 memory group or a v2 group.
pub struct Cgroup {
    dir: PathBuf,
    v2: bool,
}

impl Cgroup {
    /// Creates `edgemoe-bench-<pid>-<n>` with a memory limit, if the machine lets us.
    pub fn create(n: usize, limit_bytes: u64) -> Option<Cgroup> {
        let name = format!("edgemoe-bench-{}-{n}", std::process::id());
        let v1 = Path::new("/sys/fs/cgroup/memory");
        if v1.join("memory.limit_in_bytes").exists() {
            let dir = v1.join(&name);
            std::fs::create_dir(&dir).ok()?;
            std::fs::write(dir.join("memory.limit_in_bytes"), limit_bytes.to_string()).ok()?;
            return Some(Cgroup { dir, v2: false });
        }
        let v2 = Path::new("/sys/fs/cgroup");
        if v2.join("cgroup.controllers").exists() {
            let dir = v2.join(&name);
            std::fs::create_dir(&dir).ok()?;
            std::fs::write(dir.join("memory.max"), limit_bytes.to_string()).ok()?;
            return Some(Cgroup { dir, v2: true });
        }
        None
    }

    fn procs(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    pub fn peak_bytes(&self) -> Option<u64> {
        let file = if self.v2 {
            "memory.peak"
        } else {
            "memory.max_usage_in_bytes"
        };
        std::fs::read_to_string(self.dir.join(file))
            .ok()?
            .trim()
            .parse()
            .ok()
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Runs `command` (an `edgemoe summarize` invocation) inside `cgroup` if given.
pub fn run_child(mut command: Command, cgroup: Option<&Cgroup>) -> Result<std::process::Output> {
    if let Some(group) = cgroup {
        use std::os::unix::process::CommandExt;
        let procs = group.procs();
        // SAFETY: the closure only opens and writes a file (async-signal-safe enough for the
        // child between fork and exec; no locks are taken).
        unsafe {
            command.pre_exec(move || {
                let mut f = OpenOptions::new().write(true).open(&procs)?;
                f.write_all(b"0")
            });
        }
    }
    command
        .output()
        .map_err(|e| Error::Internal(format!("cannot run the benchmark child process: {e}")))
}

fn progress(total: usize, show: bool) -> ProgressBar {
    let bar = if show {
        ProgressBar::new(total as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{msg:>20} [{bar:40}] {pos}/{len} runs ({eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar
}

fn storage_flag(storage: StorageMode) -> &'static str {
    match storage {
        StorageMode::Cached => "cached",
        StorageMode::Direct => "direct",
        StorageMode::Emulate => "emulate",
    }
}

/// The `--quantized` bundle the runs use: the given one, or an all-INT4 copy of the model in
/// `out` when a mode reads the quantized store.
fn quantized_bundle(options: &BenchOptions) -> Result<Option<PathBuf>> {
    if let Some(q) = &options.quantized {
        return Ok(Some(q.clone()));
    }
    if !options.modes.iter().any(|m| m.uses_quantized_store()) {
        return Ok(None);
    }
    let q = options.out.join(QUANTIZED_DIR);
    if options.show_progress {
        eprintln!(
            "writing an all-INT4 copy of {} into {}",
            options.model.display(),
            q.display()
        );
    }
    requantize_bundle(
        &options.model,
        &q,
        &BitPlan::uniform(ExpertEncoding::Quant(QuantBits::Int4)),
    )?;
    Ok(Some(q))
}

/// A row of `results.json` from a run's statistics.
fn row(run: &BenchRun, profile: &str, budget_bytes: u64, stats: &RunStats) -> BenchRow {
    let sample_ms_all: Vec<f64> = stats.samples.iter().map(|s| s.sample_ms).collect();
    BenchRow {
        mode: run.mode.name().into(),
        profile: profile.into(),
        policy: stats.policy.clone(),
        budget_bytes,
        buffer_experts: run.buffer_experts,
        buffer_slots: stats.buffer_slots,
        decode_ms_per_token: stats.decode_ms_per_token,
        p50_ms: stats.p50_ms,
        p90_ms: stats.p90_ms,
        sample_ms: sample_ms_all.iter().sum::<f64>() / sample_ms_all.len().max(1) as f64,
        sample_ms_all,
        peak_rss_bytes: stats.peak_rss_bytes,
        cgroup_peak_bytes: None,
        cgroup_limit_bytes: None,
        bytes_read_per_token: stats.bytes_read_per_token,
        stall_ms_per_token: stats.stall_ms_per_token,
        decode_stall_ms_per_token: stats.decode_stall_ms_per_token,
        hit_ratio: stats.hit_ratio,
        tokens: stats.tokens_generated as u64,
        outputs_match_reference: None,
    }
}

/// What a run of the model holds besides its expert buffer, from a probe run's statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    /// The process's own memory: binary, libraries, allocator, thread stacks.
    pub overhead_bytes: u64,
    pub resident_bytes: u64,
    pub working_bytes: u64,
}

impl Footprint {
    /// From a run without an expert buffer: its peak memory (its cgroup's peak where it ran in
    /// one — what a cgroup limit is checked against — else its peak RSS) less the resident
    /// weights, working memory and the expert(s) it held (`buffer_bytes`).
    ///
    /// `resident_file_cached_bytes`: the page cache of the bundle's resident weights file that
    /// the probe read (and its cgroup was charged for). The engine copies resident weights out
    /// of the file into its own memory, so a cgroup's peak holds them twice — the copy and,
    /// until reclaimed, the cache of the file — and only the copy is held: counted in the
    /// overhead, the cached file gave an `mmap` run that much page cache for experts on top of
    /// what `edgemoe` held (BENCHMARKS.md §12.3). Peak RSS counts no page cache.
    pub fn from_probe(
        stats: &RunStats,
        cgroup_peak_bytes: Option<u64>,
        resident_file_cached_bytes: u64,
    ) -> Footprint {
        let peak = match cgroup_peak_bytes {
            Some(peak) => peak.saturating_sub(resident_file_cached_bytes),
            None => stats.peak_rss_bytes,
        };
        Footprint {
            overhead_bytes: peak
                .saturating_sub(stats.resident_bytes + stats.working_bytes + stats.buffer_bytes),
            resident_bytes: stats.resident_bytes,
            working_bytes: stats.working_bytes,
        }
    }
}

/// Bytes of the file at `path` in the page cache now (`mincore`); 0 for a file that cannot be
/// mapped.
fn cached_bytes(path: &Path) -> u64 {
    let Ok(map) = crate::weights::MappedBytes::open(path) else {
        return 0;
    };
    let len = map.as_slice().len();
    if len == 0 {
        return 0;
    }
    (len as u64).saturating_sub(map.missing_bytes(0, len))
}

/// Headroom over a probe-measured overhead: two runs of the same binary differ by a few MiB
/// of allocator arenas and thread stacks, and an `mmap` run held exactly at the probe's peak is
/// killed by the cgroup instead of measured when its anonymous memory lands above it.
pub const OVERHEAD_SLACK_BYTES: u64 = 8 << 20;

/// The memory limit of `run`'s cgroup: its budget plus the process overhead, except an `mmap`
/// run sized in experts, which gets what `edgemoe` holds with that many slots of `slot_bytes`:
/// the probe's overhead, resident weights, working memory and the slots (plus
/// [`OVERHEAD_SLACK_BYTES`]), or `edgemoe_held`, what the `edgemoe` run with as many slots was
/// measured to hold, where that is more. The probe sees one document and holds no buffer (no
/// reader threads, no slot table), and `edgemoe` held up to 9 MiB more than the estimate on the
/// demo model, where `mmap`'s own process outgrew the estimate and was killed.
pub fn cgroup_limit(
    run: &BenchRun,
    budget_bytes: u64,
    footprint: &Footprint,
    slot_bytes: u64,
    edgemoe_held: Option<u64>,
) -> u64 {
    match (run.mode, run.buffer_experts) {
        (Mode::Mmap, Some(n)) => (footprint.overhead_bytes
            + footprint.resident_bytes
            + footprint.working_bytes
            + n as u64 * slot_bytes
            + OVERHEAD_SLACK_BYTES)
            .max(edgemoe_held.unwrap_or(0)),
        _ => budget_bytes + footprint.overhead_bytes,
    }
}

/// The `summarize` child of one run (its cgroup is set by [`run_child`]).
fn summarize_command(
    options: &BenchOptions,
    input: &Path,
    mode: Mode,
    budget: u64,
    stats_path: &Path,
) -> Command {
    let mut command = Command::new(&options.executable);
    command
        .arg("summarize")
        .arg("--model")
        .arg(&options.model)
        .arg("--input")
        .arg(input)
        .arg("--mode")
        .arg(mode.name())
        .arg("--profile")
        .arg(&options.profile)
        .arg("--device")
        .arg("cpu")
        .arg("--storage")
        .arg(storage_flag(options.storage))
        .arg("--budget")
        .arg(budget.to_string())
        .arg("--stats-json")
        .arg(stats_path)
        .arg("--ids")
        .arg("-q");
    if let Some(n) = options.max_new_tokens {
        command.arg("--max-new-tokens").arg(n.to_string());
    }
    if let Some(policy) = options.policy {
        command.arg("--policy").arg(policy.name());
    }
    command
}

/// Drops the cached pages of each bundle's expert store and resident weights, so that the next
/// run reads them from the device and its cgroup is charged for them. Page cache is charged to
/// the cgroup that first reads a page: without the drop, the resident weights a previous run
/// (or the probe) read stay charged to that run's group, and an `mmap` run, whose limit counts
/// the resident weights, got their size in page cache for experts on top of what `edgemoe`
/// held (BENCHMARKS.md §12.3).
fn start_cold<'a>(bundles: impl IntoIterator<Item = &'a PathBuf>) {
    for bundle in bundles {
        for file in [EXPERTS_FILE, RESIDENT_FILE] {
            crate::io::drop_cached_pages(&bundle.join(file));
        }
    }
}

/// Measures the process overhead with an `io-exp` run on the first document, in a cgroup of
/// its own (limited far above its needs) where the machine allows it.
fn probe_footprint(
    options: &BenchOptions,
    document: &str,
    budget: u64,
    cgroup_index: usize,
) -> Result<Footprint> {
    let out = &options.out;
    let input = out.join("probe.jsonl");
    let line = serde_json::json!({ "document": document }).to_string() + "\n";
    crate::atomic::write_file(&input, line.as_bytes())?;
    let stats_path = out.join("runs").join("probe-io-exp.json");
    start_cold([&options.model]);
    let cgroup = Cgroup::create(
        cgroup_index,
        budget.saturating_mul(4).saturating_add(4 << 30),
    );
    let output = run_child(
        summarize_command(options, &input, Mode::IoExp, budget, &stats_path),
        cgroup.as_ref(),
    )?;
    if !output.status.success() {
        return Err(Error::Internal(format!(
            "the probe run that measures the process overhead failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok(Footprint::from_probe(
        &RunStats::load(&stats_path)?,
        cgroup.as_ref().and_then(Cgroup::peak_bytes),
        cached_bytes(&options.model.join(RESIDENT_FILE)),
    ))
}

/// Runs the matrix and writes `input.jsonl`, `runs/*.json`, `results.json`, `results.md` and the
/// charts into `out`. A run that fails is reported (in [`BenchReport::failed`] and `results.md`)
/// and left out of the results, which keep every run that succeeded; when every run fails there
/// is nothing to report and the benchmark is an error quoting the first failure. A run whose
/// statistics cannot be read back is an error.
pub fn run_bench(options: &BenchOptions) -> Result<BenchReport> {
    check_out_dir(options)?;
    let profile = DeviceProfile::load(&options.profile)?;
    let out = &options.out;
    std::fs::create_dir_all(out.join(RUNS_DIR)).map_err(|e| Error::io(out, e))?;
    // The documents, as JSON lines for the child processes.
    let documents = read_documents(&options.data, Some(options.limit))?;
    let input = out.join(INPUT_FILE);
    let lines: Vec<String> = documents
        .iter()
        .map(|d| serde_json::json!({ "document": d }).to_string())
        .collect();
    crate::atomic::write_file(&input, (lines.join("\n") + "\n").as_bytes())?;
    let quantized = quantized_bundle(options)?;
    let runs = plan_runs(&options.modes, &options.sizes, profile.budget_bytes);
    let slot_bytes = crate::bundle::Bundle::open(&options.model)?
        .open_store()?
        .max_padded_expert_bytes();
    // The process overhead and the model's resident and working bytes, measured by a probe
    // where runs are confined and the overhead was not given, or an mmap run is sized in
    // experts; a given overhead replaces the measured one.
    let mmap_in_experts = runs
        .iter()
        .any(|r| r.mode == Mode::Mmap && r.buffer_experts.is_some());
    let probe = options.confine && (options.cgroup_overhead_bytes.is_none() || mmap_in_experts);
    let mut footprint = match documents.first() {
        Some(first) if probe => probe_footprint(options, first, profile.budget_bytes, runs.len())?,
        _ => Footprint {
            overhead_bytes: 0,
            resident_bytes: 0,
            working_bytes: 0,
        },
    };
    if let Some(overhead) = options.cgroup_overhead_bytes {
        footprint.overhead_bytes = overhead;
    }

    let progress = progress(runs.len(), options.show_progress);
    let mut rows: Vec<BenchRow> = Vec::new();
    let mut failed = Vec::new();
    // Each run's generated ids, to compare with the reference mode's.
    let mut outputs: Vec<(Mode, String)> = Vec::new();
    let mut cgroup_note = None;
    // Buffer size → bytes the edgemoe run of that size held (its cgroup's peak).
    let mut held_by_edgemoe: std::collections::HashMap<usize, u64> = Default::default();
    for (i, run) in runs.iter().enumerate() {
        let budget = run.budget_bytes.unwrap_or(profile.budget_bytes);
        let label = format!(
            "{} {}",
            run.mode,
            run.buffer_experts
                .map(|n| format!("{n} experts"))
                .unwrap_or_else(|| format_bytes(budget))
        );
        progress.set_message(label.clone());
        let stats_path = out
            .join("runs")
            .join(format!("{i:02}-{}.json", run.mode.name().replace('+', "p")));
        let mut command = summarize_command(options, &input, run.mode, budget, &stats_path);
        if let Some(n) = run.buffer_experts {
            command.arg("--buffer-experts").arg(n.to_string());
        }
        if let Some(q) = &quantized {
            command.arg("--quantized").arg(q);
        }
        start_cold(std::iter::once(&options.model).chain(quantized.as_ref()));
        // io-free is the infinite-memory oracle: it is not confined.
        let confine = options.confine && run.mode != Mode::IoFree;
        let edgemoe_held = run
            .buffer_experts
            .and_then(|n| held_by_edgemoe.get(&n).copied());
        let limit = cgroup_limit(run, budget, &footprint, slot_bytes, edgemoe_held);
        let cgroup = if confine {
            Cgroup::create(i, limit)
        } else {
            None
        };
        if cgroup.is_none() && confine && cgroup_note.is_none() {
            let note = "no writable memory cgroup here: runs are not confined to their budget";
            if options.show_progress {
                eprintln!("warning: {note}");
            }
            cgroup_note = Some(note.to_string());
        }
        let output = run_child(command, cgroup.as_ref())?;
        progress.inc(1);
        if !output.status.success() {
            let failure = FailedRun {
                label,
                status: output.status.to_string(),
                stderr: String::from_utf8_lossy(&output.stderr).trim().to_string(),
            };
            if options.show_progress {
                progress.suspend(|| eprintln!("warning: {failure}"));
            }
            failed.push(failure);
            continue;
        }
        // What an edgemoe run held: its cgroup's peak less the cache of the resident weights
        // file, which it read and copied (see `Footprint::from_probe`).
        if let (Mode::Edgemoe, Some(n), Some(peak)) = (
            run.mode,
            run.buffer_experts,
            cgroup.as_ref().and_then(Cgroup::peak_bytes),
        ) {
            let cached = cached_bytes(&options.model.join(RESIDENT_FILE));
            held_by_edgemoe.insert(n, peak.saturating_sub(cached));
        }
        let stats = RunStats::load(&stats_path)?;
        let ids = String::from_utf8_lossy(&output.stdout).into_owned();
        // The reference is the mode that reads the same store without a buffer: io-free for the
        // bundle's, io-qexp for the quantized one; else the first run on the same store.
        let reference_mode = if run.mode.uses_quantized_store() {
            Mode::IoQexp
        } else {
            Mode::IoFree
        };
        let reference = outputs
            .iter()
            .find(|(m, _)| *m == reference_mode)
            .or_else(|| {
                outputs
                    .iter()
                    .find(|(m, _)| m.uses_quantized_store() == run.mode.uses_quantized_store())
            });
        let outputs_match_reference = reference.map(|(_, r)| *r == ids);
        outputs.push((run.mode, ids));
        rows.push(BenchRow {
            cgroup_peak_bytes: cgroup.as_ref().and_then(Cgroup::peak_bytes),
            cgroup_limit_bytes: cgroup.as_ref().map(|_| limit),
            outputs_match_reference,
            ..row(run, &profile.name, budget, &stats)
        });
    }
    progress.finish_and_clear();
    if rows.is_empty() {
        if let Some(first) = failed.first() {
            return Err(Error::Input(format!(
                "every run of the benchmark failed ({} of {}), nothing to report; the first, {} ({}): {}",
                failed.len(),
                runs.len(),
                first.label,
                first.status,
                first.reason()
            )));
        }
    }

    let results_json = out.join("results.json");
    write_json(&results_json, &rows)?;
    let confinement = if !options.confine {
        "; runs not confined".to_string()
    } else {
        format!(
            "; cgroups: budget + {} process overhead ({}){}",
            format_bytes(footprint.overhead_bytes),
            if options.cgroup_overhead_bytes.is_some() {
                "given"
            } else {
                "measured by an io-exp probe run"
            },
            if mmap_in_experts {
                ", mmap at N experts: what edgemoe holds with N slots"
            } else {
                ""
            }
        )
    };
    let mut markdown = format!(
        "{} documents from {}, profile {} ({}), policy {}, storage {:?}{}{}\n\n{}",
        documents.len(),
        options.data.display(),
        profile.name,
        profile.description,
        options.policy.unwrap_or(profile.policy),
        options.storage,
        confinement,
        cgroup_note
            .as_ref()
            .map(|n| format!("; {n}"))
            .unwrap_or_default(),
        crate::bench::report::markdown(&rows)
    );
    if !failed.is_empty() {
        markdown.push_str(&format!(
            "\n{} of {} runs failed:\n\n",
            failed.len(),
            runs.len()
        ));
        for f in &failed {
            markdown.push_str(&format!("- {} ({}): {}\n", f.label, f.status, f.reason()));
        }
    }
    let results_md = out.join("results.md");
    crate::atomic::write_file(&results_md, markdown.as_bytes())?;
    write_charts(
        &rows,
        &format!("{} · {}", profile.name, options.model.display()),
        out,
    )?;
    Ok(BenchReport {
        rows,
        documents: documents.len(),
        markdown,
        results_json,
        results_md,
        failed,
        cgroup_note,
    })
}

/// Fails before anything is written when bench would write over files it did not write: when
/// `out` is neither new, nor empty, nor an earlier bench's output (which holds `input.jsonl` and
/// `runs/`), or, where the all-INT4 copy is made in it, its `quantized-int4` is not a bundle.
pub fn check_out_dir(options: &BenchOptions) -> Result<()> {
    let out = &options.out;
    let shown = |names: &[String]| {
        let first: Vec<&str> = names.iter().take(3).map(String::as_str).collect();
        format!(
            "{}{}",
            first.join(", "),
            if names.len() > 3 { ", …" } else { "" }
        )
    };
    match std::fs::metadata(out) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(out, e)),
        Ok(meta) if !meta.is_dir() => {
            return Err(Error::Input(format!(
                "--out {}: exists and is not a directory",
                out.display()
            )))
        }
        Ok(_) => {}
    }
    let mut entries = Vec::new();
    for entry in std::fs::read_dir(out).map_err(|e| Error::io(out, e))? {
        let entry = entry.map_err(|e| Error::io(out, e))?;
        entries.push(entry.file_name().to_string_lossy().into_owned());
    }
    entries.sort();
    let earlier_bench = out.join(INPUT_FILE).is_file() && out.join(RUNS_DIR).is_dir();
    if !entries.is_empty() && !earlier_bench {
        return Err(Error::Input(format!(
            "--out {}: not empty and not the output of an earlier bench (it holds {}); bench would write over files it did not write: choose a new or empty --out",
            out.display(),
            shown(&entries)
        )));
    }
    let makes_copy =
        options.quantized.is_none() && options.modes.iter().any(|m| m.uses_quantized_store());
    let copy = out.join(QUANTIZED_DIR);
    if makes_copy && std::fs::symlink_metadata(&copy).is_ok() {
        let foreign = if copy.is_dir() {
            crate::bundle::foreign_entries(&copy)?
        } else {
            vec![QUANTIZED_DIR.to_string()]
        };
        if !foreign.is_empty() {
            return Err(Error::Input(format!(
                "--out {}: {} is not a model bundle (it holds {}); bench writes its all-INT4 copy of --model there: move it away, choose another --out, or pass --quantized BUNDLE",
                out.display(),
                copy.display(),
                shown(&foreign)
            )));
        }
    }
    Ok(())
}

/// `latency.svg`, `latency-vs-budget.svg`, `sample-cdf.svg` and, when any of its modes ran,
/// `ablation.svg` (each with a PNG beside it).
fn write_charts(rows: &[BenchRow], title: &str, out: &Path) -> Result<()> {
    plot_latency_bars(
        rows,
        &format!("per-token latency · {title}"),
        &out.join("latency.svg"),
    )?;
    plot_latency_vs_budget(
        rows,
        &format!("latency vs memory · {title}"),
        &out.join("latency-vs-budget.svg"),
    )?;
    plot_sample_cdf(
        rows,
        &format!("per-sample latency · {title}"),
        &out.join("sample-cdf.svg"),
    )?;
    let ablation: Vec<BenchRow> = ["io-exp", "q", "q+p", "q+p+c"]
        .iter()
        .filter_map(|m| rows.iter().find(|r| r.mode == *m).cloned())
        .collect();
    if !ablation.is_empty() {
        plot_latency_bars(
            &ablation,
            &format!("ablation · {title}"),
            &out.join("ablation.svg"),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mmap_runs_after_the_edgemoe_runs_it_is_sized_by() {
        let runs = plan_runs(
            &[Mode::Mmap, Mode::Edgemoe, Mode::IoExp],
            &BenchSizes::BufferExperts(vec![6, 10]),
            1 << 30,
        );
        let order: Vec<(Mode, Option<usize>)> =
            runs.iter().map(|r| (r.mode, r.buffer_experts)).collect();
        assert_eq!(
            order,
            [
                (Mode::Edgemoe, Some(6)),
                (Mode::Edgemoe, Some(10)),
                (Mode::IoExp, Some(6)),
                (Mode::IoExp, Some(10)),
                (Mode::Mmap, Some(6)),
                (Mode::Mmap, Some(10)),
            ]
        );
    }

    #[test]
    fn the_probe_counts_resident_weights_once() {
        let stats = RunStats {
            peak_rss_bytes: 1_300,
            resident_bytes: 1_000,
            working_bytes: 50,
            buffer_bytes: 10,
            ..crate::generation::report::tests::example()
        };
        // In a cgroup: the copy of the resident weights and the cached file they were copied
        // from (900 of its bytes still cached) are both in the peak; only the copy is held.
        let footprint = Footprint::from_probe(&stats, Some(200 + 1_000 + 50 + 10 + 900), 900);
        assert_eq!(
            footprint,
            Footprint {
                overhead_bytes: 200,
                resident_bytes: 1_000,
                working_bytes: 50,
            }
        );
        // Peak RSS holds no page cache.
        assert_eq!(
            Footprint::from_probe(&stats, None, 900).overhead_bytes,
            1_300 - 1_060
        );
    }

    #[test]
    fn cached_bytes_are_what_the_page_cache_holds_of_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("resident.safetensors");
        std::fs::write(&path, vec![7u8; 64 << 10]).unwrap();
        // Just written: its pages are in the cache.
        assert_eq!(cached_bytes(&path), 64 << 10);
        assert_eq!(cached_bytes(&dir.path().join("missing")), 0);
    }

    #[test]
    fn mmap_in_experts_gets_what_edgemoe_holds_with_that_many_slots() {
        let footprint = Footprint {
            overhead_bytes: 200,
            resident_bytes: 1000,
            working_bytes: 50,
        };
        let run = |mode, buffer_experts| BenchRun {
            mode,
            budget_bytes: None,
            buffer_experts,
        };
        // mmap at 6 experts of 10 bytes: overhead + resident + working + 6 slots.
        assert_eq!(
            cgroup_limit(&run(Mode::Mmap, Some(6)), 5000, &footprint, 10, None),
            200 + 1000 + 50 + 60 + OVERHEAD_SLACK_BYTES
        );
        // Or what edgemoe was measured to hold with 6 slots, where that is more.
        let held = 200 + 1000 + 50 + 60 + OVERHEAD_SLACK_BYTES + 1;
        assert_eq!(
            cgroup_limit(&run(Mode::Mmap, Some(6)), 5000, &footprint, 10, Some(held)),
            held
        );
        assert_eq!(
            cgroup_limit(&run(Mode::Mmap, Some(6)), 5000, &footprint, 10, Some(100)),
            200 + 1000 + 50 + 60 + OVERHEAD_SLACK_BYTES
        );
        // Every other run: its budget plus the overhead.
        assert_eq!(
            cgroup_limit(
                &run(Mode::Edgemoe, Some(6)),
                5000,
                &footprint,
                10,
                Some(9000)
            ),
            5200
        );
        assert_eq!(
            cgroup_limit(&run(Mode::Mmap, None), 5000, &footprint, 10, Some(9000)),
            5200
        );
    }
}
