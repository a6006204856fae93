//! `edgemoe eval`: summarize a reference corpus and print ROUGE and speed.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use edgemoe::bundle::Bundle;
use edgemoe::generation::decoding::DecodeOptions;
use edgemoe::generation::session::{Session, SessionOptions};
use edgemoe::offline::eval::{evaluate, read_examples};

use super::args::{check_default_bundle, check_writes, parse_count, CacheArgs, DEFAULT_BUNDLE};
use super::rouge::print_scores;

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// Model bundle directory.
    #[arg(long, value_name = "BUNDLE", default_value = DEFAULT_BUNDLE)]
    model: PathBuf,
    /// JSON lines with `dialogue`/`document` and `summary`/`reference` fields.
    #[arg(long, value_name = "FILE.jsonl")]
    data: PathBuf,
    /// Use the first N examples.
    #[arg(long, value_name = "N", value_parser = parse_count)]
    limit: Option<usize>,
    /// Most tokens to generate per document (default: the model's generation config).
    #[arg(long, value_name = "N")]
    max_new_tokens: Option<usize>,
    /// Beam width (default: the model's generation config).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=64))]
    beams: Option<u16>,
    /// Porter-stem tokens before matching (rouge-score's `use_stemmer=True`).
    #[arg(long)]
    stem: bool,
    /// Print the figures as JSON.
    #[arg(long)]
    json: bool,
    /// Also write the predictions, one per line.
    #[arg(long, value_name = "FILE")]
    predictions: Option<PathBuf>,
    #[command(flatten)]
    cache: CacheArgs,
}

pub fn run(args: EvalArgs) -> Result<()> {
    let mut inputs = vec![
        ("--model", args.model.as_path()),
        ("--data", args.data.as_path()),
    ];
    inputs.extend(args.cache.inputs());
    let mut outputs = args.cache.outputs();
    if let Some(path) = &args.predictions {
        outputs.insert(0, ("--predictions", path.as_path()));
    }
    args.cache.check()?;
    check_writes(&outputs, &inputs)?;
    check_default_bundle(&args.model)?;
    let examples = read_examples(&args.data, args.limit)?;
    let bundle = Bundle::open(&args.model)?;
    let generation = bundle.config.generation.clone();
    let mut decode = DecodeOptions::from_defaults(&generation);
    if let Some(n) = args.max_new_tokens {
        decode.max_new_tokens = n;
    }
    if let Some(b) = args.beams {
        decode.num_beams = b as usize;
    }
    let settings = args.cache.resolve()?;
    decode.kv_cache = settings.kv_cache;
    bundle.expect_encoder_decoder()?;
    let mut session = Session::open(
        &bundle,
        SessionOptions {
            budget_bytes: settings.budget_bytes,
            decode,
            max_input_tokens: generation.max_source_tokens,
            cache: settings.cache,
            device: settings.device,
        },
    )?;
    for warning in &session.warnings {
        eprintln!("warning: {warning}");
    }
    let (report, predictions) = evaluate(&mut session, &examples, args.stem, true)?;
    session.buffer.finish_trace()?;
    if let Some(path) = &args.predictions {
        let mut text = predictions.join("\n");
        text.push('\n');
        edgemoe::atomic::write_file(path, text.as_bytes())?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "{} documents from {}",
            report.documents,
            args.data.display()
        );
        print_scores(&report.rouge);
        println!("{}", report.run.summary_line());
    }
    Ok(())
}
