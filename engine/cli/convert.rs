//! `edgemoe convert`: a Hugging Face checkpoint into a bundle, at one width or a plan's.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use edgemoe::offline::bit_plan::BitPlan;
use edgemoe::offline::convert::{convert, ConvertOptions, ResidentWidth};
use edgemoe::store::ExpertEncoding;
use edgemoe::units::format_bytes;

use super::args::parse_width;

#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long, value_name = "DIR")]
    hf: PathBuf,
    /// Bundle directory to write. Built beside it and swapped in once complete: a bundle already
    /// there is replaced whole, or kept whole if anything fails.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Replace --out even if it is a folder that holds something other than a bundle.
    #[arg(long)]
    force: bool,
    /// tokenizer.json to bundle if the checkpoint directory has none.
    #[arg(long, value_name = "FILE")]
    tokenizer: Option<PathBuf>,
    /// Store every expert at this width: 8, 4, 2 (INT8/4/2, channel-wise), f16, bf16 or f32.
    #[arg(long, value_name = "WIDTH", value_parser = parse_width, conflicts_with = "plan")]
    bits: Option<ExpertEncoding>,
    /// Per-expert widths from a plan (written by `tune-bits`).
    #[arg(long, value_name = "PLAN.json")]
    plan: Option<PathBuf>,
    /// Width of the resident (non-expert) matrices: f32 (the parity reference), f16, bf16, int8
    /// or int4 (channel-wise; int4 costs accuracy, measure it). Norms and biases stay f32.
    #[arg(long, value_name = "WIDTH", default_value = "f32")]
    resident: ResidentWidth,
}

pub fn run(args: ConvertArgs) -> Result<()> {
    let bits = match (&args.plan, args.bits) {
        (Some(path), _) => {
            edgemoe::atomic::refuse_overlap(("--out", &args.out), &[("--plan", path)])?;
            BitPlan::load(path)?
        }
        (None, Some(width)) => BitPlan::uniform(width),
        (None, None) => BitPlan::default(),
    };
    let report = convert(&ConvertOptions {
        hf_dir: args.hf.clone(),
        out_dir: args.out.clone(),
        tokenizer: args.tokenizer,
        bits,
        resident: args.resident,
        force: args.force,
        show_progress: true,
    })?;
    println!(
        "converted {} → {}: {} experts ({} expert store), resident weights {} ({})",
        args.hf.display(),
        args.out.display(),
        report.experts,
        format_bytes(report.expert_store_bytes),
        format_bytes(report.resident_file_bytes),
        args.resident.name(),
    );
    Ok(())
}
