//! Subcommands of `edgemoe`: argument definitions and the glue from arguments to the library.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

use edgemoe::bit_plan::BitPlan;
use edgemoe::budget::{format_bytes, parse_bytes};
use edgemoe::bundle::{Bundle, EXPERTS_FILE, RESIDENT_FILE};
use edgemoe::cache::replay::{replay, ReplayResult};
use edgemoe::cache::trace::read_trace;
use edgemoe::cache::Policy;
use edgemoe::calibrate::{build_dictionary, collect_decoder_paths, collect_paths, report};
use edgemoe::causal::{CompletionOptions, GenerateOptions, Sampling, TextGenerator, TextStream};
use edgemoe::config::{ModelSpec, Stack};
use edgemoe::convert::{convert, ConvertOptions};
use edgemoe::expert_store::{ExpertEncoding, StorageMode};
use edgemoe::generate::DecodeOptions;
use edgemoe::paths::PATHS_FILE;
use edgemoe::provider::ExpertProvider;
use edgemoe::stats::RunStats;
use edgemoe::summarize::{parse_documents, CacheOptions, RunOptions, Summarizer};
use edgemoe::Error;

/// Where `./setup.sh` puts the converted demo model; the default `--model`.
pub const DEFAULT_BUNDLE: &str = "bundles/switch-samsum-tiny";

/// Longest prompt (its last tokens) when `calibrate` and `tune-bits` feed a document to a
/// decoder-only model.
pub const DOCUMENT_PROMPT_TOKENS: usize = 512;

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
    /// Convert a Hugging Face checkpoint (Switch Transformers, Mixtral, Qwen2-MoE, OLMoE) into a
    /// model bundle.
    Convert(ConvertArgs),
    /// Summarize a document (or JSON lines of documents) with a bundle on a memory budget.
    Summarize(SummarizeArgs),
    /// Continue a prompt with a decoder-only bundle (Mixtral, Qwen2-MoE, OLMoE) on a memory
    /// budget, printing tokens as they are produced (greedy unless --temperature/--top-p).
    Generate(GenerateArgs),
    /// Show a bundle's shape, resident and expert sizes, and expert bit widths.
    Inspect(InspectArgs),
    /// Build the activation-path dictionary of a bundle from a corpus (writes paths.bin).
    Calibrate(CalibrateArgs),
    /// Replay an expert-access trace through eviction policies and buffer sizes.
    Replay(ReplayArgs),
    /// Summarize a reference corpus and print ROUGE and speed.
    Eval(EvalArgs),
    /// Score existing predictions against references (one text per line) with ROUGE.
    Rouge(RougeArgs),
    /// Choose each expert's bit width for a tolerable accuracy loss (writes a plan for
    /// `convert --plan`).
    TuneBits(TuneBitsArgs),
}

#[derive(Args, Debug)]
struct TuneBitsArgs {
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
    #[arg(long, value_name = "N", default_value_t = 20)]
    limit: usize,
    /// Most tokens generated per example (default: the model's generation config).
    #[arg(long, value_name = "N")]
    max_new_tokens: Option<usize>,
    /// Plan to write; the report (PLAN.report.json), the importance heat map
    /// (PLAN.importance.svg) and the measurement cache (PLAN.measurements.json) go beside it.
    #[arg(long, value_name = "PLAN.json")]
    out: PathBuf,
}

fn parse_fraction(text: &str) -> std::result::Result<f64, String> {
    let t = text.trim();
    let value = match t.strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().map(|v| v / 100.0),
        None => t.parse::<f64>(),
    }
    .map_err(|_| format!("invalid loss `{text}` (e.g. 5% or 0.05)"))?;
    if !(0.0..=1.0).contains(&value) {
        return Err(format!("loss `{text}` must be between 0% and 100%"));
    }
    Ok(value)
}

#[derive(Args, Debug)]
struct EvalArgs {
    /// Model bundle directory.
    #[arg(long, value_name = "BUNDLE", default_value = DEFAULT_BUNDLE)]
    model: PathBuf,
    /// JSON lines with `dialogue`/`document` and `summary`/`reference` fields.
    #[arg(long, value_name = "FILE.jsonl")]
    data: PathBuf,
    /// Use the first N examples.
    #[arg(long, value_name = "N")]
    limit: Option<usize>,
    /// Memory budget (see `summarize`).
    #[arg(long, default_value = "1.5GiB", value_parser = parse_budget)]
    budget: u64,
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

#[derive(Args, Debug)]
struct RougeArgs {
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
    /// Store every expert at this width: 8, 4, 2 (INT8/4/2, channel-wise), f16, bf16 or f32.
    #[arg(long, value_name = "WIDTH", value_parser = parse_width, conflicts_with = "plan")]
    bits: Option<ExpertEncoding>,
    /// Per-expert widths from a plan (written by `tune-bits`).
    #[arg(long, value_name = "PLAN.json")]
    plan: Option<PathBuf>,
}

fn parse_width(text: &str) -> std::result::Result<ExpertEncoding, String> {
    ExpertEncoding::parse(text).ok_or_else(|| {
        format!("unknown width `{text}` (expected 8, 4, 2, int8, int4, int2, f16, bf16 or f32)")
    })
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
    #[command(flatten)]
    cache: CacheArgs,
}

#[derive(Args, Debug)]
struct GenerateArgs {
    /// Model bundle directory (a decoder-only model converted by `edgemoe convert`).
    #[arg(long, value_name = "BUNDLE")]
    model: PathBuf,
    /// The prompt text (`-` reads it from standard input).
    #[arg(
        long,
        value_name = "TEXT",
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    prompt: Option<String>,
    /// The prompt as token ids (comma or space separated) instead of text.
    #[arg(long, value_name = "IDS", value_parser = parse_ids)]
    prompt_ids: Option<Ids>,
    /// Most tokens to generate (default: the model's generation config).
    #[arg(long, value_name = "N")]
    max_new_tokens: Option<usize>,
    /// Sample with this temperature (default: greedy; 1.0 when only --top-p is given).
    #[arg(long, value_name = "T", value_parser = parse_temperature)]
    temperature: Option<f64>,
    /// Sample from the smallest set of tokens whose probability reaches P (default 1.0 when
    /// sampling).
    #[arg(long, value_name = "P", value_parser = parse_top_p)]
    top_p: Option<f64>,
    /// Seed of the sampler (the same seed, prompt and model give the same tokens).
    #[arg(long, value_name = "S", default_value_t = 0)]
    seed: u64,
    /// Memory budget for resident weights + expert buffer + working memory.
    #[arg(long, default_value = "1.5GiB", value_parser = parse_budget)]
    budget: u64,
    /// Write run statistics as JSON to this file.
    #[arg(long, value_name = "FILE")]
    stats_json: Option<PathBuf>,
    /// Print the generated token ids instead of the text.
    #[arg(long)]
    ids: bool,
    /// Do not print the statistics line on standard error.
    #[arg(long, short)]
    quiet: bool,
    #[command(flatten)]
    cache: CacheArgs,
}

/// Token ids given on the command line.
#[derive(Debug, Clone)]
struct Ids(Vec<i64>);

fn parse_ids(text: &str) -> std::result::Result<Ids, String> {
    let ids = text
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<i64>()
                .map_err(|_| format!("invalid token id `{t}` (expected e.g. 1,15,42)"))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    if ids.is_empty() {
        return Err("no token ids".into());
    }
    Ok(Ids(ids))
}

fn parse_temperature(text: &str) -> std::result::Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(t) if t > 0.0 && t.is_finite() => Ok(t),
        _ => Err(format!("temperature `{text}` must be a positive number")),
    }
}

fn parse_top_p(text: &str) -> std::result::Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(p) if p > 0.0 && p <= 1.0 => Ok(p),
        _ => Err(format!("top-p `{text}` must be in (0, 1]")),
    }
}

/// Expert buffer options shared by every command that runs the model.
#[derive(Args, Debug)]
struct CacheArgs {
    /// Eviction policy: edgemoe, edgemoe-paper, lru, lfu or fifo.
    #[arg(long, default_value = "edgemoe")]
    policy: Policy,
    /// Do not start the prefetch thread (no dictionary prefetch, no read/compute overlap).
    #[arg(long)]
    no_prefetch: bool,
    /// Most speculative bytes prefetched per token (default: two experts per decoder MoE layer).
    #[arg(long, value_name = "SIZE", value_parser = parse_budget)]
    prefetch_cap: Option<u64>,
    /// Size the expert buffer in experts instead of from the budget (still checked against it).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    buffer_experts: Option<u32>,
    /// Record every expert access (demand, prefetch, cancel) into FILE (JSON lines).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// How expert reads reach the store: `direct` bypasses the page cache (O_DIRECT, as on a
    /// board whose RAM cannot cache the experts; falls back with a warning where refused),
    /// `cached` goes through it.
    #[arg(long, value_name = "MODE", default_value = "direct", value_parser = parse_storage)]
    storage: StorageMode,
}

fn parse_storage(text: &str) -> std::result::Result<StorageMode, String> {
    match text {
        "direct" => Ok(StorageMode::Direct),
        "cached" => Ok(StorageMode::Cached),
        other => Err(format!(
            "unknown storage mode `{other}` (expected direct or cached)"
        )),
    }
}

impl CacheArgs {
    fn options(&self) -> CacheOptions {
        CacheOptions {
            policy: self.policy,
            prefetch: !self.no_prefetch,
            prefetch_cap_bytes: self.prefetch_cap,
            buffer_experts: self.buffer_experts.map(|n| n as usize),
            trace: self.trace.clone(),
            storage: self.storage,
        }
    }
}

#[derive(Args, Debug)]
struct CalibrateArgs {
    /// Model bundle directory; the dictionary is written into it as paths.bin.
    #[arg(long, value_name = "BUNDLE", default_value = DEFAULT_BUNDLE)]
    model: PathBuf,
    /// Calibration corpus: JSON lines with a `dialogue` or `document` field.
    #[arg(long, value_name = "FILE.jsonl")]
    data: PathBuf,
    /// Use the first N documents of --data.
    #[arg(long, value_name = "N")]
    limit: Option<usize>,
    /// Held-out corpus to measure the dictionary on (default: the last 10% of --data's documents,
    /// which are then left out of calibration).
    #[arg(long, value_name = "FILE.jsonl")]
    eval_data: Option<PathBuf>,
    /// Use the first N documents of --eval-data.
    #[arg(long, value_name = "N", default_value_t = 100)]
    eval_limit: usize,
    /// Also write the accuracy report as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct ReplayArgs {
    /// Trace written by `summarize --trace`.
    #[arg(long, value_name = "FILE")]
    trace: PathBuf,
    /// Buffer sizes in experts.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8,16,32,64")]
    slots: Vec<usize>,
    /// Policies to replay (`all` = every online policy and belady).
    #[arg(long, value_delimiter = ',', default_value = "all")]
    policy: Vec<String>,
    /// Ignore the trace's prefetch and cancel events (pure demand paging).
    #[arg(long)]
    demand_only: bool,
    /// Print JSON (policy → slots → hit ratio, hits, misses) instead of a table.
    #[arg(long)]
    json: bool,
    /// Draw hit ratio against buffer size per policy into an SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
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
        Command::Generate(args) => run_generate(args),
        Command::Inspect(args) => run_inspect(args),
        Command::Calibrate(args) => run_calibrate(args),
        Command::Replay(args) => run_replay(args),
        Command::Eval(args) => run_eval(args),
        Command::Rouge(args) => run_rouge(args),
        Command::TuneBits(args) => run_tune_bits(args),
    }
}

fn run_convert(args: ConvertArgs) -> Result<()> {
    let bits = match (&args.plan, args.bits) {
        (Some(path), _) => BitPlan::load(path)?,
        (None, Some(width)) => BitPlan::uniform(width),
        (None, None) => BitPlan::default(),
    };
    let report = convert(&ConvertOptions {
        hf_dir: args.hf.clone(),
        out_dir: args.out.clone(),
        tokenizer: args.tokenizer,
        bits,
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

fn check_default_bundle(model: &Path) -> Result<()> {
    if model == Path::new(DEFAULT_BUNDLE) && !model.exists() {
        anyhow::bail!(
            "no --model given and the demo bundle {DEFAULT_BUNDLE} does not exist: run ./setup.sh, or convert a checkpoint with `edgemoe convert --hf DIR --out DIR`"
        );
    }
    Ok(())
}

fn run_summarize(args: SummarizeArgs) -> Result<()> {
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
    let options = RunOptions {
        budget_bytes: args.budget,
        decode,
        max_source_tokens: args
            .max_source_tokens
            .map(|n| n as usize)
            .unwrap_or(generation.max_source_tokens),
        cache: args.cache.options(),
    };
    drop(bundle);
    let mut summarizer = Summarizer::open(&args.model, options)?;
    for warning in &summarizer.warnings {
        eprintln!("warning: {warning}");
    }

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
    summarizer.buffer.finish_trace()?;
    let stats = RunStats::new(
        &generations,
        summarizer.buffer.stats(),
        &summarizer.plan,
        &summarizer.options.cache,
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

fn run_generate(args: GenerateArgs) -> Result<()> {
    let bundle = Bundle::open(&args.model)?;
    let tokenizer = bundle.tokenizer()?;
    let generation = bundle.config.generation.clone();
    let prompt_ids = match (&args.prompt, &args.prompt_ids) {
        (_, Some(Ids(ids))) => ids.clone(),
        (Some(prompt), None) => {
            let (text, _) = if prompt == "-" {
                read_input("-")?
            } else {
                (prompt.clone(), String::new())
            };
            tokenizer.encode_all(&text)?
        }
        (None, None) => anyhow::bail!("pass --prompt TEXT or --prompt-ids IDS"),
    };
    if prompt_ids.is_empty() {
        anyhow::bail!("empty prompt: it produced no tokens");
    }
    let sampling = match (args.temperature, args.top_p) {
        (None, None) => Sampling::Greedy,
        (t, p) => Sampling::TopP {
            temperature: t.unwrap_or(1.0),
            top_p: p.unwrap_or(1.0),
            seed: args.seed,
        },
    };
    let completion = CompletionOptions {
        max_new_tokens: args.max_new_tokens.unwrap_or(generation.max_new_tokens),
        sampling,
        stop_token_ids: generation.stop_token_ids.clone(),
    };
    let options = GenerateOptions {
        budget_bytes: args.budget,
        completion,
        max_prompt_tokens: prompt_ids.len(),
        cache: args.cache.options(),
    };
    drop(bundle);
    let mut generator = TextGenerator::open(&args.model, options)?;
    for warning in &generator.warnings {
        eprintln!("warning: {warning}");
    }
    let stdout = std::io::stdout();
    let mut stream = TextStream::default();
    let mut first = true;
    let ids = args.ids;
    let generated = {
        let TextGenerator {
            model,
            tokenizer,
            buffer,
            options,
            ..
        } = &mut generator;
        edgemoe::causal::complete(
            model,
            buffer,
            &prompt_ids,
            &options.completion,
            &mut |token| {
                let mut out = stdout.lock();
                let piece = if ids {
                    let sep = if first { "" } else { " " };
                    format!("{sep}{token}")
                } else {
                    stream.push(tokenizer, token)?
                };
                first = false;
                write!(out, "{piece}")
                    .and_then(|_| out.flush())
                    .map_err(|e| Error::io("standard output", e))
            },
        )?
    };
    {
        let mut out = stdout.lock();
        if !ids {
            write!(out, "{}", stream.finish(&generator.tokenizer)?)?;
        }
        writeln!(out)?;
        out.flush()?;
    }
    generator.buffer.finish_trace()?;
    let stats = RunStats::new(
        &[(prompt_ids.len(), generated)],
        generator.buffer.stats(),
        &generator.plan,
        &generator.options.cache,
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
    let resident_bytes = match &bundle.config.model {
        ModelSpec::Switch(spec) => {
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
            bundle.load_model()?.resident_bytes()
        }
        ModelSpec::DecoderOnly(spec) => {
            println!(
                "shape         hidden {}, {} heads ({} key/value) × head_dim {}, vocab {}, RoPE base {}",
                spec.hidden_size,
                spec.num_heads,
                spec.num_kv_heads,
                spec.head_dim,
                spec.vocab_size,
                spec.rope_theta
            );
            println!(
                "layers        {} layers, MoE at {:?}: {} experts of width {} each, top-{}{}{}",
                spec.num_layers,
                spec.moe_layers,
                spec.num_experts,
                spec.expert_intermediate_size,
                spec.top_k,
                if spec.norm_topk_prob {
                    " (weights renormalised)"
                } else {
                    ""
                },
                match spec.shared_expert_intermediate_size {
                    Some(s) => format!(", shared expert of width {s} (resident)"),
                    None => String::new(),
                }
            );
            bundle.load_decoder_only()?.resident_bytes()
        }
    };
    let experts = &store.index().experts;
    println!(
        "resident      {} in memory (f32), {} on disk ({RESIDENT_FILE})",
        format_bytes(resident_bytes),
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
    match bundle.config.model {
        ModelSpec::Switch(_) => println!(
            "generation    {} beams, max {} new tokens, length penalty {}, no-repeat n-gram {}, prefix {:?}",
            g.num_beams, g.max_new_tokens, g.length_penalty, g.no_repeat_ngram_size, g.input_prefix
        ),
        ModelSpec::DecoderOnly(_) => println!(
            "generation    greedy (or --temperature/--top-p), max {} new tokens, stops at {:?}",
            g.max_new_tokens, g.stop_token_ids
        ),
    }
    Ok(())
}

fn read_documents(path: &Path, limit: Option<usize>) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let mut documents = parse_documents(&text, &path.display().to_string())?;
    if let Some(n) = limit {
        documents.truncate(n);
    }
    Ok(documents)
}

fn run_calibrate(args: CalibrateArgs) -> Result<()> {
    check_default_bundle(&args.model)?;
    let mut documents = read_documents(&args.data, args.limit)?;
    let held_out_documents = match &args.eval_data {
        Some(path) => read_documents(path, Some(args.eval_limit))?,
        None => {
            if documents.len() < 2 {
                anyhow::bail!(
                    "{}: need at least 2 documents to hold one out (or pass --eval-data)",
                    args.data.display()
                );
            }
            let keep = documents.len() - (documents.len() / 10).max(1);
            documents.split_off(keep)
        }
    };
    let bundle = Bundle::open(&args.model)?;
    let spec = bundle.config.model.clone();
    let generation = bundle.config.generation.clone();
    // Calibration needs routing only: every expert fits, no prefetch, no dictionary use.
    let cache = CacheOptions {
        policy: Policy::Lru,
        prefetch: false,
        ..CacheOptions::default()
    };
    let (calibration, held_out) = match &spec {
        ModelSpec::Switch(_) => {
            let mut summarizer = Summarizer::open(
                &args.model,
                RunOptions {
                    budget_bytes: u64::MAX / 4,
                    decode: DecodeOptions::from_defaults(&generation),
                    max_source_tokens: generation.max_source_tokens,
                    cache,
                },
            )?;
            (
                collect_paths(&mut summarizer, &documents, "calibration", true)?,
                collect_paths(&mut summarizer, &held_out_documents, "held out", true)?,
            )
        }
        ModelSpec::DecoderOnly(_) => {
            // Each document is a prompt (its last DOCUMENT_PROMPT_TOKENS tokens), followed by
            // the model's greedy continuation.
            let mut generator = TextGenerator::open(
                &args.model,
                GenerateOptions {
                    budget_bytes: u64::MAX / 4,
                    completion: CompletionOptions {
                        max_new_tokens: generation.max_new_tokens,
                        sampling: Sampling::Greedy,
                        stop_token_ids: generation.stop_token_ids.clone(),
                    },
                    max_prompt_tokens: DOCUMENT_PROMPT_TOKENS,
                    cache,
                },
            )?;
            (
                collect_decoder_paths(&mut generator, &documents, "calibration", true)?,
                collect_decoder_paths(&mut generator, &held_out_documents, "held out", true)?,
            )
        }
    };
    let dict = build_dictionary(
        &calibration,
        spec.moe_blocks(Stack::Encoder).len(),
        spec.moe_blocks(Stack::Decoder).len(),
        spec.num_experts(),
        spec.top_k(),
    );
    let out = bundle.path(PATHS_FILE);
    dict.save(&out)?;
    let report = report(&dict, calibration.len(), &held_out);
    print!("{}", report.to_text());
    println!("\nwrote {}", out.display());
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n").map_err(|e| Error::io(path, e))?;
    }
    Ok(())
}

fn run_replay(args: ReplayArgs) -> Result<()> {
    let (header, events) = read_trace(&args.trace)?;
    let policies: Vec<Policy> = if args.policy.iter().any(|p| p == "all") {
        Policy::ONLINE
            .iter()
            .copied()
            .chain([Policy::Belady])
            .collect()
    } else {
        args.policy
            .iter()
            .map(|p| p.parse::<Policy>().map_err(anyhow::Error::msg))
            .collect::<Result<_>>()?
    };
    if args.slots.is_empty() || args.slots.contains(&0) {
        anyhow::bail!("--slots needs positive buffer sizes, e.g. --slots 4,8,16");
    }
    let mut results: Vec<ReplayResult> = Vec::new();
    for &policy in &policies {
        for &slots in &args.slots {
            results.push(replay(&header, &events, policy, slots, args.demand_only));
        }
    }
    let demands = events
        .iter()
        .filter(|e| e.kind == edgemoe::cache::AccessKind::Demand)
        .count();
    if args.json {
        let mut by_policy = serde_json::Map::new();
        for r in &results {
            let entry = by_policy
                .entry(r.policy.name())
                .or_insert_with(|| serde_json::Value::Object(Default::default()));
            entry[r.slots.to_string()] = serde_json::json!({
                "hit_ratio": r.hit_ratio, "hits": r.hits, "misses": r.misses
            });
        }
        println!("{}", serde_json::to_string_pretty(&by_policy)?);
    } else {
        println!(
            "{}: {} events, {} demand accesses; recorded with {} slots, policy {}, prefetch {}",
            args.trace.display(),
            events.len(),
            demands,
            header.slots,
            header.policy,
            if header.prefetch { "on" } else { "off" }
        );
        print!("{:<14}", "hit ratio");
        for slots in &args.slots {
            print!("{:>9}", format!("{slots} slots"));
        }
        println!();
        for &policy in &policies {
            print!("{:<14}", policy.name());
            for r in results.iter().filter(|r| r.policy == policy) {
                print!("{:>8.1}%", 100.0 * r.hit_ratio);
            }
            println!();
        }
    }
    if let Some(path) = &args.plot {
        let title = format!("hit ratio vs buffer size ({} demand accesses)", demands);
        edgemoe::plot::hit_ratio_vs_slots(&results, &title, path)?;
    }
    Ok(())
}

fn print_rouge(label: &str, r: &edgemoe::rouge::RougeScores) {
    println!(
        "{label}ROUGE-1 {:.2}  ROUGE-2 {:.2}  ROUGE-L {:.2}  (F-measure × 100)",
        100.0 * r.rouge1.fmeasure,
        100.0 * r.rouge2.fmeasure,
        100.0 * r.rouge_l.fmeasure
    );
}

fn run_eval(args: EvalArgs) -> Result<()> {
    check_default_bundle(&args.model)?;
    let examples = edgemoe::eval::read_examples(&args.data, args.limit)?;
    let bundle = Bundle::open(&args.model)?;
    let generation = bundle.config.generation.clone();
    let mut decode = DecodeOptions::from_defaults(&generation);
    if let Some(n) = args.max_new_tokens {
        decode.max_new_tokens = n;
    }
    if let Some(b) = args.beams {
        decode.num_beams = b as usize;
    }
    let mut summarizer = Summarizer::open(
        &args.model,
        RunOptions {
            budget_bytes: args.budget,
            decode,
            max_source_tokens: generation.max_source_tokens,
            cache: args.cache.options(),
        },
    )?;
    for warning in &summarizer.warnings {
        eprintln!("warning: {warning}");
    }
    let (report, predictions) =
        edgemoe::eval::evaluate(&mut summarizer, &examples, args.stem, true)?;
    summarizer.buffer.finish_trace()?;
    if let Some(path) = &args.predictions {
        let mut text = predictions.join("\n");
        text.push('\n');
        std::fs::write(path, text).map_err(|e| Error::io(path, e))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "{} documents from {}",
            report.documents,
            args.data.display()
        );
        print_rouge("", &report.rouge);
        println!("{}", report.run.summary_line());
    }
    Ok(())
}

fn run_rouge(args: RougeArgs) -> Result<()> {
    let (_, mean) = edgemoe::rouge::score_files(&args.pred, &args.reference, args.stem)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&mean)?);
    } else {
        print_rouge("", &mean);
    }
    Ok(())
}

fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("plan");
    path.with_file_name(format!("{stem}.{suffix}"))
}

fn run_tune_bits(args: TuneBitsArgs) -> Result<()> {
    let temp;
    let bundle_dir = match (&args.model, &args.hf) {
        (Some(model), _) => model.clone(),
        (None, Some(hf)) => {
            temp = tempfile::tempdir().context("cannot create a temporary directory")?;
            let out = temp.path().join("bundle");
            convert(&ConvertOptions {
                hf_dir: hf.clone(),
                out_dir: out.clone(),
                tokenizer: None,
                bits: BitPlan::default(),
                show_progress: true,
            })?;
            out
        }
        (None, None) => anyhow::bail!("pass --model BUNDLE or --hf DIR"),
    };
    let examples = edgemoe::eval::read_examples(&args.data, Some(args.limit))?;
    if let Some(parent) = args.out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    }
    let bundle = Bundle::open(&bundle_dir)?;
    let store = bundle.open_store()?;
    let source = store
        .index()
        .experts
        .first()
        .map(|e| e.encoding)
        .context("the bundle has no experts")?;
    if store.index().experts.iter().any(|e| e.encoding != source) {
        anyhow::bail!(
            "{}: experts are stored at mixed widths; tune from a full-precision bundle",
            bundle_dir.display()
        );
    }
    let widths = [
        ExpertEncoding::Quant(edgemoe::quant::QuantBits::Int8),
        ExpertEncoding::Quant(edgemoe::quant::QuantBits::Int4),
        ExpertEncoding::Quant(edgemoe::quant::QuantBits::Int2),
    ];
    let experts = edgemoe::resident_experts::ResidentExperts::load(&store, &widths)?;
    let tokenizer = bundle.tokenizer()?;
    let generation = bundle.config.generation.clone();
    let max_new_tokens = args.max_new_tokens.unwrap_or(generation.max_new_tokens);
    let (switch_model, decoder_model);
    let model = match &bundle.config.model {
        ModelSpec::Switch(_) => {
            switch_model = bundle.load_model()?;
            let mut decode = DecodeOptions::from_defaults(&generation);
            decode.num_beams = 1;
            decode.max_new_tokens = max_new_tokens;
            edgemoe::tune::TuneModel::Switch {
                model: &switch_model,
                decode,
            }
        }
        ModelSpec::DecoderOnly(_) => {
            decoder_model = bundle.load_decoder_only()?;
            edgemoe::tune::TuneModel::DecoderOnly {
                model: &decoder_model,
                completion: CompletionOptions {
                    max_new_tokens,
                    sampling: Sampling::Greedy,
                    stop_token_ids: generation.stop_token_ids.clone(),
                },
            }
        }
    };
    let mut tuner = edgemoe::tune::Tuner::new(
        model,
        experts,
        &tokenizer,
        &examples,
        edgemoe::tune::EvalSettings {
            prefix: generation.input_prefix.clone(),
            max_source_tokens: match bundle.config.model {
                ModelSpec::Switch(_) => generation.max_source_tokens,
                ModelSpec::DecoderOnly(_) => DOCUMENT_PROMPT_TOKENS,
            },
        },
        &sibling(&args.out, "measurements.json"),
        true,
    )?;
    let (plan, mut report) = tuner.tune(source, args.max_loss)?;
    let references: Vec<String> = examples.iter().map(|e| e.reference.clone()).collect();
    let fp_rouge2 = tuner.rouge2(None, &tokenizer, &references)?;
    let plan_rouge2 = tuner.rouge2(Some(&plan), &tokenizer, &references)?;
    let spec = &bundle.config.model;
    let ids = spec.all_experts();
    report.expert_bytes = ids
        .iter()
        .filter_map(|&id| plan.encoding(id))
        .map(|e| {
            let (_, len) = edgemoe::expert_store::layout_expert(spec, e);
            len
        })
        .sum();
    plan.save(&args.out)?;
    let importance: std::collections::BTreeMap<_, _> = ids
        .iter()
        .filter_map(|&id| {
            report
                .importance
                .get(&edgemoe::tune::expert_key(id))
                .map(|&v| (id, v))
        })
        .collect();
    if !importance.is_empty() {
        edgemoe::plot::importance_heatmap(
            &importance,
            &format!(
                "expert importance: proxy loss at {} (others at {})",
                report.lower.as_deref().unwrap_or("-"),
                report.upper
            ),
            &sibling(&args.out, "importance.svg"),
        )?;
    }
    let summary = serde_json::json!({
        "tune": report,
        "rouge2_full_precision": fp_rouge2,
        "rouge2_plan": plan_rouge2,
        "examples": examples.len(),
    });
    let report_path = sibling(&args.out, "report.json");
    std::fs::write(&report_path, serde_json::to_string_pretty(&summary)? + "\n")
        .map_err(|e| Error::io(&report_path, e))?;
    println!(
        "max loss {:.1}%: every expert at {} except {} at {} → proxy loss {:.2}%, experts {}",
        100.0 * args.max_loss,
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
        examples.len(),
        100.0 * fp_rouge2,
        100.0 * plan_rouge2
    );
    println!("wrote {} and {}", args.out.display(), report_path.display());
    Ok(())
}
