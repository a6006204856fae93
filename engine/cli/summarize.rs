//! `edgemoe summarize`: one summary per document, from a file or standard input.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use edgemoe::bundle::Bundle;
use edgemoe::generation::decoding::DecodeOptions;
use edgemoe::generation::input::parse_documents;
use edgemoe::generation::report::RunStats;
use edgemoe::generation::session::{Session, SessionOptions};

use super::args::{
    check_default_bundle, check_writes, read_input, CacheArgs, OutputArgs, DEFAULT_BUNDLE,
};

#[derive(Args, Debug)]
pub struct SummarizeArgs {
    /// Model bundle directory (made by `edgemoe convert`).
    #[arg(long, value_name = "BUNDLE", default_value = DEFAULT_BUNDLE)]
    model: PathBuf,
    /// Input file, or `-` for standard input. Plain text is one document; JSON lines with a
    /// `dialogue` or `document` field give one summary per line.
    #[arg(long, value_name = "FILE", default_value = "-")]
    input: String,
    /// Most tokens to generate per document (default: the model's generation config).
    #[arg(long, value_name = "N")]
    max_new_tokens: Option<usize>,
    /// Beam width (default: the model's generation config; 1 = greedy).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=64))]
    beams: Option<u16>,
    /// Longest source in tokens; longer documents are truncated (default: 512).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    max_source_tokens: Option<u32>,
    /// Forbid repeating n-grams of this size (default: the model's generation config).
    #[arg(long, value_name = "N")]
    no_repeat_ngram_size: Option<usize>,
    #[command(flatten)]
    output: OutputArgs,
    #[command(flatten)]
    cache: CacheArgs,
}

pub fn run(args: SummarizeArgs) -> Result<()> {
    let mut inputs = vec![("--model", args.model.as_path())];
    if args.input != "-" {
        inputs.push(("--input", std::path::Path::new(&args.input)));
    }
    inputs.extend(args.cache.inputs());
    args.cache.check()?;
    check_writes(
        &[args.output.outputs(), args.cache.outputs()].concat(),
        &inputs,
    )?;
    check_default_bundle(&args.model)?;
    let (text, source) = read_input(&args.input)?;
    let documents = parse_documents(&text, &source)?;

    let bundle = Bundle::open(&args.model)?;
    let generation = &bundle.config.generation;
    let mut decode = DecodeOptions::from_defaults(generation);
    if let Some(n) = args.max_new_tokens {
        decode.max_new_tokens = n;
    }
    if let Some(b) = args.beams {
        decode.num_beams = b as usize;
    }
    if let Some(n) = args.no_repeat_ngram_size {
        decode.no_repeat_ngram_size = n;
    }
    let settings = args.cache.resolve()?;
    decode.kv_cache = settings.kv_cache;
    let options = SessionOptions {
        budget_bytes: settings.budget_bytes,
        decode,
        max_input_tokens: args
            .max_source_tokens
            .map(|n| n as usize)
            .unwrap_or(generation.max_source_tokens),
        cache: settings.cache,
        device: settings.device,
    };
    bundle.expect_encoder_decoder()?;
    let mut session = Session::open(&bundle, options)?;
    for warning in &session.warnings {
        eprintln!("warning: {warning}");
    }

    let mut generations = Vec::with_capacity(documents.len());
    let stdout = std::io::stdout();
    for document in &documents {
        let (summary, generation, source_tokens) = session.summarize(document)?;
        let mut out = stdout.lock();
        if args.output.ids {
            let ids: Vec<String> = generation.tokens.iter().map(|t| t.to_string()).collect();
            writeln!(out, "{}", ids.join(" "))?;
        } else {
            writeln!(out, "{summary}")?;
        }
        out.flush()?;
        generations.push((source_tokens, generation));
    }
    session.buffer.finish_trace()?;
    let mut stats = RunStats::new(
        &generations,
        session.stats(),
        &session.plan,
        &session.options.cache,
    );
    stats.profile = settings.profile.map(|p| p.name);
    stats.kv_cache = session.options.decode.kv_cache;
    args.output.report(&stats)
}
