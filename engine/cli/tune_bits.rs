//! `edgemoe tune-bits`: choose each expert's width for a tolerable loss and print the outcome.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use edgemoe::bench::charts::importance_heatmap;
use edgemoe::offline::tune::{beside_plan, tune_bits, TuneBitsOptions, TuneSource};
use edgemoe::units::format_bytes;

use super::args::{check_writes, parse_count, parse_fraction};

#[derive(Args, Debug)]
pub struct TuneBitsArgs {
    /// Model bundle (its stored experts are the full-precision reference).
    #[arg(
        long,
        value_name = "BUNDLE",
        conflicts_with = "hf",
        required_unless_present = "hf"
    )]
    model: Option<PathBuf>,
    /// Or a Hugging Face checkpoint directory (converted at its own precision first).
    #[arg(long, value_name = "DIR")]
    hf: Option<PathBuf>,
    /// Validation data: JSON lines with `dialogue`/`document` and `summary` fields.
    #[arg(long, value_name = "FILE.jsonl")]
    data: PathBuf,
    /// Tolerable loss, e.g. 5% or 0.05.
    #[arg(long, value_parser = parse_fraction)]
    max_loss: f64,
    /// Use the first N validation examples.
    #[arg(long, value_name = "N", default_value = "20", value_parser = parse_count)]
    limit: usize,
    /// Most tokens generated per example (default: the model's generation config); at least 1,
    /// since the widths are chosen by how the generated tokens change.
    #[arg(long, value_name = "N", value_parser = parse_count)]
    max_new_tokens: Option<usize>,
    /// Plan to write; the report (PLAN.report.json), the importance heat map
    /// (PLAN.importance.svg) and the measurement cache (PLAN.measurements.json) go beside it.
    #[arg(long, value_name = "PLAN.json")]
    out: PathBuf,
}

pub fn run(args: TuneBitsArgs) -> Result<()> {
    let inputs: Vec<(&str, &std::path::Path)> = [
        ("--model", args.model.as_deref()),
        ("--hf", args.hf.as_deref()),
        ("--data", Some(args.data.as_path())),
    ]
    .into_iter()
    .filter_map(|(flag, path)| path.map(|p| (flag, p)))
    .collect();
    // The plan and every file written beside it.
    let beside = |suffix| beside_plan(&args.out, suffix);
    let (report, measurements, heat_map, heat_map_png) = (
        beside("report.json"),
        beside("measurements.json"),
        beside("importance.svg"),
        beside("importance.png"),
    );
    let outputs = [
        ("--out", args.out.as_path()),
        ("--out (its report)", &report),
        ("--out (its measurement cache)", &measurements),
        ("--out (its heat map)", &heat_map),
        ("--out (its heat map)", &heat_map_png),
    ];
    check_writes(&outputs, &inputs)?;
    let source = match (args.model, args.hf) {
        (Some(model), _) => TuneSource::Bundle(model),
        (None, Some(hf)) => TuneSource::Checkpoint(hf),
        (None, None) => anyhow::bail!("pass --model BUNDLE or --hf DIR"),
    };
    let run = tune_bits(&TuneBitsOptions {
        source,
        data: args.data,
        limit: args.limit,
        max_loss: args.max_loss,
        max_new_tokens: args.max_new_tokens,
        plan_path: args.out,
        heat_map: Some(importance_heatmap),
        show_progress: true,
    })?;
    let report = &run.report;
    if run.reused_measurements > 0 {
        println!(
            "reused {} measurements cached for this model, data and options",
            run.reused_measurements
        );
    }
    println!(
        "max loss {:.1}%: every expert at {} except {} at {} → proxy loss {:.2}%, experts {}",
        100.0 * report.max_loss,
        report.upper,
        report.k,
        report.lower.as_deref().unwrap_or("-"),
        100.0 * report.plan_loss,
        format_bytes(report.expert_bytes)
    );
    println!(
        "uniform widths (proxy loss): {}",
        report
            .uniform_loss
            .iter()
            .map(|(w, l)| format!("{w} {:.2}%", 100.0 * l))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "ROUGE-2 on {} validation examples: full precision {:.2}, plan {:.2}",
        run.examples,
        100.0 * run.rouge2_full_precision,
        100.0 * run.rouge2_plan
    );
    println!(
        "wrote {} and {}",
        run.plan_path.display(),
        run.report_path.display()
    );
    Ok(())
}
