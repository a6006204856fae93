//! `edgemoe bench`: the paper's comparisons as a matrix of engine modes × memory budgets (or
//! buffer sizes), each run in a child process — inside a memory cgroup limited to the budget
//! where the machine allows it, so page-cache baselines pay for what they map — with the store's
//! cached pages dropped before every run. Writes `results.json`, `results.md` and SVG plots.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use indicatif::{ProgressBar, ProgressStyle};
use plotters::prelude::*;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::runtime::modes::Mode;
use crate::units::format_bytes;

/// One cell of the matrix.
#[derive(Debug, Clone)]
pub struct BenchRun {
    pub mode: Mode,
    /// Either a budget or a buffer size in experts (with the profile's budget).
    pub budget_bytes: Option<u64>,
    pub buffer_experts: Option<usize>,
}

/// A row of `results.json`.
#[derive(Debug, Clone, Serialize)]
pub struct BenchRow {
    pub mode: String,
    pub profile: String,
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
    pub bytes_read_per_token: f64,
    pub stall_ms_per_token: f64,
    pub hit_ratio: f64,
    pub tokens: u64,
    /// The generated ids equal those of the reference mode on the same weights
    /// (`io-free` for the bundle's store, `io-qexp` for the quantized one).
    pub outputs_match_reference: Option<bool>,
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

/// A progress bar over the matrix.
pub fn progress(total: usize) -> ProgressBar {
    let bar = ProgressBar::new(total as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg:>20} [{bar:40}] {pos}/{len} runs ({eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar
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

/// One colour per mode, the same in every chart.
fn mode_color(mode: &str) -> PaletteColor<Palette99> {
    Palette99::pick(Mode::ALL.iter().position(|m| m.name() == mode).unwrap_or(0))
}

fn chart_error(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::format(path, format!("cannot draw the chart: {e}"))
}

/// Per-token latency per mode at each budget (EdgeMoE Fig. 11/16 style bars).
pub fn plot_latency_bars(rows: &[BenchRow], title: &str, path: &Path) -> Result<()> {
    let root = SVGBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| chart_error(path, e))?;
    let labels: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{} {}",
                r.mode,
                r.buffer_experts
                    .map(|n| format!("{n}e"))
                    .unwrap_or_else(|| format_bytes(r.budget_bytes))
            )
        })
        .collect();
    let max = rows
        .iter()
        .map(|r| r.decode_ms_per_token)
        .fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(20)
        .x_label_area_size(120)
        .y_label_area_size(60)
        .build_cartesian_2d(0..rows.len(), 0f64..max * 1.1)
        .map_err(|e| chart_error(path, e))?;
    chart
        .configure_mesh()
        .y_desc("decode ms per token")
        .x_labels(rows.len())
        .x_label_formatter(&|i| labels.get(*i).cloned().unwrap_or_default())
        .x_label_style(
            ("sans-serif", 11)
                .into_font()
                .transform(FontTransform::Rotate270),
        )
        .draw()
        .map_err(|e| chart_error(path, e))?;
    chart
        .draw_series(rows.iter().enumerate().map(|(i, r)| {
            let color = mode_color(&r.mode);
            Rectangle::new([(i, 0.0), (i + 1, r.decode_ms_per_token)], color.filled())
        }))
        .map_err(|e| chart_error(path, e))?;
    root.present().map_err(|e| chart_error(path, e))?;
    drop(root);
    crate::bench::charts::png_beside(path)?;
    Ok(())
}

/// Latency against budget, one line per mode (EdgeMoE Fig. 14).
pub fn plot_latency_vs_budget(rows: &[BenchRow], title: &str, path: &Path) -> Result<()> {
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| chart_error(path, e))?;
    let x = |r: &BenchRow| {
        r.buffer_experts
            .map(|n| n as f64)
            .unwrap_or(r.budget_bytes as f64 / (1u64 << 20) as f64)
    };
    let xmax = rows.iter().map(x).fold(1.0, f64::max);
    let ymax = rows
        .iter()
        .map(|r| r.decode_ms_per_token)
        .fold(1.0, f64::max);
    let by_experts = rows.iter().any(|r| r.buffer_experts.is_some());
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(20)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..xmax * 1.05, 0f64..ymax * 1.1)
        .map_err(|e| chart_error(path, e))?;
    chart
        .configure_mesh()
        .x_desc(if by_experts {
            "buffer (experts)"
        } else {
            "budget (MiB)"
        })
        .y_desc("decode ms per token")
        .draw()
        .map_err(|e| chart_error(path, e))?;
    for mode in Mode::ALL.iter() {
        let mut points: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r.mode == mode.name())
            .map(|r| (x(r), r.decode_ms_per_token))
            .collect();
        if points.is_empty() {
            continue;
        }
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        let color = mode_color(mode.name()).stroke_width(2);
        chart
            .draw_series(LineSeries::new(points.clone(), color))
            .map_err(|e| chart_error(path, e))?
            .label(mode.name())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| chart_error(path, e))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| chart_error(path, e))?;
    root.present().map_err(|e| chart_error(path, e))?;
    drop(root);
    crate::bench::charts::png_beside(path)?;
    Ok(())
}

/// Cumulative distribution of per-sample latency per mode (EdgeMoE Fig. 12), at the first
/// budget of each mode.
pub fn plot_sample_cdf(rows: &[BenchRow], title: &str, path: &Path) -> Result<()> {
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| chart_error(path, e))?;
    let xmax = rows
        .iter()
        .flat_map(|r| r.sample_ms_all.iter().copied())
        .fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(20)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..xmax * 1.05, 0f64..1.0)
        .map_err(|e| chart_error(path, e))?;
    chart
        .configure_mesh()
        .x_desc("per-sample latency (ms)")
        .y_desc("CDF")
        .draw()
        .map_err(|e| chart_error(path, e))?;
    let mut seen = std::collections::HashSet::new();
    for r in rows {
        if !seen.insert(r.mode.clone()) {
            continue;
        }
        let mut v = r.sample_ms_all.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        let n = v.len().max(1) as f64;
        let points: Vec<(f64, f64)> = v
            .iter()
            .enumerate()
            .map(|(i, &ms)| (ms, (i + 1) as f64 / n))
            .collect();
        let color = mode_color(&r.mode).stroke_width(2);
        chart
            .draw_series(LineSeries::new(points, color))
            .map_err(|e| chart_error(path, e))?
            .label(r.mode.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|e| chart_error(path, e))?;
    root.present().map_err(|e| chart_error(path, e))?;
    drop(root);
    crate::bench::charts::png_beside(path)?;
    Ok(())
}
