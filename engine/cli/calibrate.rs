//! `edgemoe calibrate`: build a bundle's path dictionary and print how well it predicts.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use edgemoe::io::write_json;
use edgemoe::offline::calibrate::{calibrate, CalibrateOptions};

use super::args::{check_default_bundle, parse_count, DEFAULT_BUNDLE};

#[derive(Args, Debug)]
pub struct CalibrateArgs {
    /// Model bundle directory; the dictionary is written into it as paths.bin.
    #[arg(long, value_name = "BUNDLE", default_value = DEFAULT_BUNDLE)]
    model: PathBuf,
    /// Calibration corpus: JSON lines with a `dialogue` or `document` field.
    #[arg(long, value_name = "FILE.jsonl")]
    data: PathBuf,
    /// Use the first N documents of --data.
    #[arg(long, value_name = "N", value_parser = parse_count)]
    limit: Option<usize>,
    /// Held-out corpus to measure the dictionary on (default: the last 10% of --data's documents,
    /// which are then left out of calibration).
    #[arg(long, value_name = "FILE.jsonl")]
    eval_data: Option<PathBuf>,
    /// Use the first N documents of --eval-data.
    #[arg(long, value_name = "N", default_value = "100", value_parser = parse_count)]
    eval_limit: usize,
    /// Also write the accuracy report as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

pub fn run(args: CalibrateArgs) -> Result<()> {
    if let Some(path) = &args.json {
        edgemoe::io::check_output_path("--json", path)?;
        let mut inputs = vec![
            ("--model", args.model.as_path()),
            ("--data", args.data.as_path()),
        ];
        if let Some(eval) = &args.eval_data {
            inputs.push(("--eval-data", eval.as_path()));
        }
        edgemoe::atomic::refuse_overlap(("--json", path), &inputs)?;
    }
    check_default_bundle(&args.model)?;
    let run = calibrate(&CalibrateOptions {
        bundle: args.model,
        data: args.data,
        limit: args.limit,
        held_out: args.eval_data.map(|path| (path, args.eval_limit)),
        show_progress: true,
    })?;
    print!("{}", run.report.to_text());
    println!("\nwrote {}", run.dictionary_path.display());
    if let Some(path) = &args.json {
        write_json(path, &run.report)?;
    }
    Ok(())
}
