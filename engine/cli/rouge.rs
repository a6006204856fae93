//! `edgemoe rouge`: score prediction files against references, and the ROUGE line `eval` prints
//! too.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use edgemoe::offline::rouge::{score_files, RougeScores};

#[derive(Args, Debug)]
pub struct RougeArgs {
    /// Predictions, one per line.
    #[arg(long, value_name = "FILE")]
    pred: PathBuf,
    /// References, one per line, aligned with --pred.
    #[arg(long = "ref", value_name = "FILE")]
    reference: PathBuf,
    /// Porter-stem tokens before matching.
    #[arg(long)]
    stem: bool,
    /// Print the figures as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(args: RougeArgs) -> Result<()> {
    let (_, mean) = score_files(&args.pred, &args.reference, args.stem)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&mean)?);
    } else {
        print_scores(&mean);
    }
    Ok(())
}

/// `ROUGE-1 … ROUGE-2 … ROUGE-L …` as F-measures × 100.
pub fn print_scores(r: &RougeScores) {
    println!(
        "ROUGE-1 {:.2}  ROUGE-2 {:.2}  ROUGE-L {:.2}  (F-measure × 100)",
        100.0 * r.rouge1.fmeasure,
        100.0 * r.rouge2.fmeasure,
        100.0 * r.rouge_l.fmeasure
    );
}
