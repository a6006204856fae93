//! Subcommands of `edgemoe`: argument definitions and the glue from arguments to the library.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

use edgemoe::budget::{format_bytes, parse_bytes};
use edgemoe::bundle::{Bundle, EXPERTS_FILE, RESIDENT_FILE};
use edgemoe::config::Stack;
use edgemoe::convert::{convert, ConvertOptions};
use edgemoe::generate::DecodeOptions;
use edgemoe::stats::RunStats;
use edgemoe::summarize::{parse_documents, RunOptions, Summarizer};
use edgemoe::Error;

/// Where `./setup.sh` puts the converted demo model; the default `--model`.
pub const DEFAULT_BUNDLE: &str = "bundles/switch-samsum-tiny";

#[derive(Parser, Debug)]
#[command(
    name = "edgemoe",
    version,
    about = "Mixture-of-experts inference on memory-constrained boards"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Convert a Hugging Face Switch Transformers checkpoint into a model bundle.
    Convert(ConvertArgs),
    /// Summarize a document (or JSON lines of documents) with a bundle on a memory budget.
    Summarize(SummarizeArgs),
    /// Show a bundle's shape, resident and expert sizes, and expert bit widths.
    Inspect(InspectArgs),
}

#[derive(Args, Debug)]
struct ConvertArgs {
    /// Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long, value_name = "DIR")]
    hf: PathBuf,
    /// Bundle directory to write.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// tokenizer.json to bundle if the checkpoint directory has none.
    #[arg(long, value_name = "FILE")]
    tokenizer: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct SummarizeArgs {
    /// Model bundle directory (made by `edgemoe convert`).
    #[arg(long, value_name = "BUNDLE", default_value = DEFAULT_BUNDLE)]
    model: PathBuf,
    /// Input file, or `-` for standard input. Plain text is one document; JSON lines with a
    /// `dialogue` or `document` field give one summary per line.
    #[arg(long, value_name = "FILE", default_value = "-")]
    input: String,
    /// Memory budget for resident weights + expert buffer + working memory (e.g. 1.5GiB, 600MiB).
    #[arg(long, default_value = "1.5GiB", value_parser = parse_budget)]
    budget: u64,
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
    /// Write run statistics as JSON to this file.
    #[arg(long, value_name = "FILE")]
    stats_json: Option<PathBuf>,
    /// Print the generated token ids instead of the text.
    #[arg(long)]
    ids: bool,
    /// Do not print the statistics line on standard error.
    #[arg(long, short)]
    quiet: bool,
}

#[derive(Args, Debug)]
struct InspectArgs {
    /// Model bundle directory.
    bundle: PathBuf,
}

fn parse_budget(text: &str) -> std::result::Result<u64, String> {
    parse_bytes(text).map_err(|e| e.to_string())
}

pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Convert(args) => run_convert(args),
        Command::Summarize(args) => run_summarize(args),
        Command::Inspect(args) => run_inspect(args),
    }
}

fn run_convert(args: ConvertArgs) -> Result<()> {
    let report = convert(&ConvertOptions {
        hf_dir: args.hf.clone(),
        out_dir: args.out.clone(),
        tokenizer: args.tokenizer,
        show_progress: true,
    })?;
    println!(
        "converted {} → {}: {} experts ({} expert store), resident weights {}",
        args.hf.display(),
        args.out.display(),
        report.experts,
        format_bytes(report.expert_store_bytes),
        format_bytes(report.resident_file_bytes),
    );
    Ok(())
}

fn read_input(input: &str) -> Result<(String, String)> {
    if input == "-" {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .context("cannot read standard input")?;
        Ok((text, "standard input".into()))
    } else {
        let path = Path::new(input);
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Ok((text, path.display().to_string()))
    }
}

fn run_summarize(args: SummarizeArgs) -> Result<()> {
    if args.model == Path::new(DEFAULT_BUNDLE) && !args.model.exists() {
        anyhow::bail!(
            "no --model given and the demo bundle {DEFAULT_BUNDLE} does not exist: run ./setup.sh, or convert a checkpoint with `edgemoe convert --hf DIR --out DIR`"
        );
    }
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
    let options = RunOptions {
        budget_bytes: args.budget,
        decode,
        max_source_tokens: args
            .max_source_tokens
            .map(|n| n as usize)
            .unwrap_or(generation.max_source_tokens),
    };
    drop(bundle);
    let mut summarizer = Summarizer::open(&args.model, options)?;

    let mut generations = Vec::with_capacity(documents.len());
    let stdout = std::io::stdout();
    for document in &documents {
        let (summary, generation, source_tokens) = summarizer.summarize(document)?;
        let mut out = stdout.lock();
        if args.ids {
            let ids: Vec<String> = generation.tokens.iter().map(|t| t.to_string()).collect();
            writeln!(out, "{}", ids.join(" "))?;
        } else {
            writeln!(out, "{summary}")?;
        }
        out.flush()?;
        generations.push((source_tokens, generation));
    }
    let stats = RunStats::new(
        &generations,
        edgemoe::provider::ExpertProvider::stats(&summarizer.buffer),
        &summarizer.plan,
    );
    if !args.quiet {
        eprintln!("{}", stats.summary_line());
    }
    if let Some(path) = &args.stats_json {
        let json = serde_json::to_string_pretty(&stats)?;
        std::fs::write(path, json + "\n").map_err(|e| Error::io(path, e))?;
    }
    Ok(())
}

fn run_inspect(args: InspectArgs) -> Result<()> {
    let bundle = Bundle::open(&args.bundle)?;
    let store = bundle.open_store()?;
    let spec = &bundle.config.model;
    let model = bundle.load_model()?;
    let file_size = |name: &str| {
        std::fs::metadata(bundle.path(name))
            .map(|m| m.len())
            .unwrap_or(0)
    };
    println!("bundle        {}", args.bundle.display());
    println!(
        "architecture  {} (bundle format {}, source weights {})",
        bundle.config.architecture, bundle.config.format_version, bundle.config.source_dtype
    );
    println!(
        "shape         d_model {}, d_ff {}, {} heads × d_kv {}, vocab {}",
        spec.d_model, spec.d_ff, spec.num_heads, spec.d_kv, spec.vocab_size
    );
    for stack in [Stack::Encoder, Stack::Decoder] {
        let moe = spec.moe_blocks(stack);
        println!(
            "{:<13} {} blocks, MoE at blocks {:?} ({} experts each, capacity {})",
            stack.hf_prefix(),
            spec.num_layers(stack),
            moe,
            spec.num_experts,
            spec.expert_capacity
        );
    }
    let experts = &store.index().experts;
    println!(
        "resident      {} in memory (f32), {} on disk ({RESIDENT_FILE})",
        format_bytes(model.resident_bytes()),
        format_bytes(file_size(RESIDENT_FILE)),
    );
    println!(
        "experts       {} experts, {} of weights, {} store ({EXPERTS_FILE}), {} per slot",
        experts.len(),
        format_bytes(store.total_expert_bytes()),
        format_bytes(file_size(EXPERTS_FILE)),
        format_bytes(store.max_padded_expert_bytes()),
    );
    let mut widths: std::collections::BTreeMap<&str, (u32, usize)> = Default::default();
    for e in experts {
        widths
            .entry(e.encoding.name())
            .or_insert((e.encoding.bits(), 0))
            .1 += 1;
    }
    let widths: Vec<String> = widths
        .iter()
        .map(|(name, (bits, n))| format!("{n} × {name} ({bits} bits)"))
        .collect();
    println!("bit widths    {}", widths.join(", "));
    let g = &bundle.config.generation;
    println!(
        "generation    {} beams, max {} new tokens, length penalty {}, no-repeat n-gram {}, prefix {:?}",
        g.num_beams, g.max_new_tokens, g.length_penalty, g.no_repeat_ngram_size, g.input_prefix
    );
    Ok(())
}
