//! `edgemoe bench`: the modes × budgets matrix; prints the results table and the headline ratios.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use edgemoe::bench::matrix::{run_bench, BenchOptions, BenchSizes};
use edgemoe::cache::Policy;
use edgemoe::runtime::modes::Mode;
use edgemoe::store::StorageMode;

use super::args::{
    parse_budget, parse_count, parse_online_policy, parse_profile, parse_storage, DEFAULT_BUNDLE,
};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Model bundle.
    #[arg(long, value_name = "BUNDLE", default_value = DEFAULT_BUNDLE)]
    model: PathBuf,
    /// Bundle of the same model with quantized experts for io-qexp/q/q+p/q+p+c (default: an
    /// all-INT4 copy made in --out).
    #[arg(long, value_name = "BUNDLE")]
    quantized: Option<PathBuf>,
    /// Documents: JSON lines with a `dialogue` or `document` field.
    #[arg(long, value_name = "FILE.jsonl")]
    data: PathBuf,
    /// Use the first N documents.
    #[arg(long, value_name = "N", default_value = "10", value_parser = parse_count)]
    limit: usize,
    /// Device profile (built-in name or TOML file).
    #[arg(long, value_name = "NAME|FILE", default_value = "rpi4-sd", value_parser = parse_profile)]
    profile: String,
    /// Eviction policy of every run, in place of the profile's: edgemoe, edgemoe-docs,
    /// edgemoe-fd, edgemoe-paper, lru, lfu or fifo.
    #[arg(long, value_parser = parse_online_policy)]
    policy: Option<Policy>,
    /// Modes to compare.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "io-free,io-exp,io-qexp,mmap,edgemoe,q,q+p,q+p+c"
    )]
    modes: Vec<Mode>,
    /// Memory budgets (default: the profile's).
    #[arg(long, value_delimiter = ',', value_parser = parse_budget, conflicts_with = "buffer_experts")]
    budgets: Vec<u64>,
    /// Buffer sizes in experts instead of budgets (for models far smaller than the board).
    #[arg(long, value_delimiter = ',', value_parser = parse_count)]
    buffer_experts: Vec<usize>,
    /// Storage: `emulate` paces reads to the profile (default), `direct`, `cached`.
    #[arg(long, default_value = "emulate", value_parser = parse_storage)]
    storage: StorageMode,
    /// Most tokens generated per document (default: the model's generation config).
    #[arg(long, value_name = "N")]
    max_new_tokens: Option<usize>,
    /// Memory a run may use beyond its budget inside the cgroup (binary, libtorch, allocator)
    /// (default: measured by a probe run without an expert buffer).
    #[arg(long, value_parser = parse_budget)]
    cgroup_overhead: Option<u64>,
    /// Do not confine runs to a memory cgroup.
    #[arg(long)]
    no_cgroup: bool,
    /// Output directory.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
}

pub fn run(args: BenchArgs) -> Result<()> {
    edgemoe::io::check_output_dir("--out", &args.out)?;
    let mut inputs = vec![
        ("--model", args.model.as_path()),
        ("--data", args.data.as_path()),
    ];
    if let Some(q) = &args.quantized {
        inputs.push(("--quantized", q.as_path()));
    }
    let profile_file = std::path::Path::new(&args.profile);
    if profile_file.is_file() {
        inputs.push(("--profile", profile_file));
    }
    edgemoe::atomic::refuse_overlap(("--out", &args.out), &inputs)?;
    let sizes = if args.buffer_experts.is_empty() {
        BenchSizes::Budgets(args.budgets)
    } else {
        BenchSizes::BufferExperts(args.buffer_experts)
    };
    let report = run_bench(&BenchOptions {
        executable: std::env::current_exe().context("cannot find the edgemoe executable")?,
        model: args.model,
        quantized: args.quantized,
        data: args.data,
        limit: args.limit,
        profile: args.profile,
        policy: args.policy,
        modes: args.modes,
        sizes,
        storage: args.storage,
        max_new_tokens: args.max_new_tokens,
        confine: !args.no_cgroup,
        cgroup_overhead_bytes: args.cgroup_overhead,
        out: args.out.clone(),
        show_progress: true,
    })?;
    print!("{}", report.markdown);
    for s in report.speedups() {
        println!(
            "edgemoe vs {}: {:.2}× ({:.2} vs {:.2} ms/token)",
            s.baseline,
            s.ratio(),
            s.edgemoe_ms_per_token,
            s.baseline_ms_per_token
        );
    }
    println!(
        "wrote {}, {} and plots in {}",
        report.results_json.display(),
        report.results_md.display(),
        args.out.display()
    );
    if !report.failed.is_empty() {
        eprintln!(
            "warning: {} of {} runs failed (listed in {}); the results hold the others",
            report.failed.len(),
            report.failed.len() + report.rows.len(),
            report.results_md.display()
        );
    }
    Ok(())
}
