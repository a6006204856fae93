//! Subcommands of `edgemoe`: argument definitions and the glue from arguments to the library.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

use edgemoe::bundle::{Bundle, EXPERTS_FILE, RESIDENT_FILE};
use edgemoe::cache::replay::{replay, ReplayResult};
use edgemoe::cache::trace::read_trace;
use edgemoe::cache::Policy;
use edgemoe::config::profile::{DeviceKind, DeviceProfile};
use edgemoe::dictionary::PATHS_FILE;
use edgemoe::generation::causal::TextStream;
use edgemoe::generation::decoding::DecodeOptions;
use edgemoe::generation::input::parse_documents;
use edgemoe::generation::report::RunStats;
use edgemoe::generation::sampling::Sampling;
use edgemoe::generation::session::{run_model, CacheOptions, Session, SessionOptions};
use edgemoe::ids::Stack;
use edgemoe::offline::bit_plan::BitPlan;
use edgemoe::offline::calibrate::{build_dictionary, collect_paths, report};
use edgemoe::offline::convert::{convert, ConvertOptions};
use edgemoe::runtime::modes::Mode;
use edgemoe::store::{ExpertEncoding, StorageMode};
use edgemoe::units::{format_bytes, parse_bytes};
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
    /// Run engine modes × budgets on a corpus, each in its own process, and report.
    Bench(BenchArgs),
    /// Measure read throughput against read size and reads in flight (O_DIRECT).
    ProbeStorage(ProbeArgs),
}

#[derive(Args, Debug)]
struct ProbeArgs {
    /// A large file to read, or a directory on the device to probe (a test file is written
    /// there and removed).
    path: PathBuf,
    /// Size of the test file written into a directory.
    #[arg(long, value_parser = parse_budget, default_value = "256MiB")]
    size: u64,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 0.5)]
    seconds: f64,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct BenchArgs {
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
    #[arg(long, value_name = "N", default_value_t = 10)]
    limit: usize,
    /// Device profile (built-in name or TOML file).
    #[arg(long, value_name = "NAME|FILE", default_value = "rpi4-sd")]
    profile: String,
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
    #[arg(long, value_delimiter = ',')]
    buffer_experts: Vec<usize>,
    /// Storage: `emulate` paces reads to the profile (default), `direct`, `cached`.
    #[arg(long, default_value = "emulate", value_parser = parse_storage)]
    storage: StorageMode,
    /// Most tokens generated per document (default: the model's generation config).
    #[arg(long, value_name = "N")]
    max_new_tokens: Option<usize>,
    /// Memory a run may use beyond its budget inside the cgroup (binary, libtorch, allocator).
    #[arg(long, value_parser = parse_budget, default_value = "384MiB")]
    cgroup_overhead: u64,
    /// Do not confine runs to a memory cgroup.
    #[arg(long)]
    no_cgroup: bool,
    /// Output directory.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
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

/// What a run prints and writes besides its text.
#[derive(Args, Debug)]
struct OutputArgs {
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
    #[command(flatten)]
    output: OutputArgs,
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

/// How a run uses memory, storage and the expert buffer (every command that runs the model).
/// Explicit flags override the profile's values.
#[derive(Args, Debug)]
struct CacheArgs {
    /// Device profile: a built-in name (rpi4-sd, rpi5-sd, rpi5-nvme, jetson-tx2-ssd,
    /// jetson-tx2-hdd, jetson-orin-nano-nvme) or a TOML file. Sets budget, storage speed for
    /// `--storage emulate`, threads, device, policy and prefetch cap.
    #[arg(long, value_name = "NAME|FILE")]
    profile: Option<String>,
    /// Memory budget for resident weights + expert buffer + working memory (e.g. 1.5GiB,
    /// 600MiB; default: the profile's, else 1.5GiB).
    #[arg(long, value_parser = parse_budget)]
    budget: Option<u64>,
    /// Engine mode: edgemoe (default), io-free, io-exp, io-qexp, mmap, q, q+p, q+p+c.
    #[arg(long, default_value = "edgemoe")]
    mode: Mode,
    /// Bundle of the same model with quantized experts, for io-qexp, q, q+p and q+p+c.
    #[arg(long, value_name = "BUNDLE")]
    quantized: Option<PathBuf>,
    /// Eviction policy: edgemoe, edgemoe-paper, lru, lfu or fifo (default: the profile's, else
    /// edgemoe).
    #[arg(long)]
    policy: Option<Policy>,
    /// Do not start the prefetch thread (no dictionary prefetch, no read/compute overlap).
    #[arg(long)]
    no_prefetch: bool,
    /// Most speculative bytes prefetched per token (default: the profile's, else two experts
    /// per decoder MoE layer).
    #[arg(long, value_name = "SIZE", value_parser = parse_budget)]
    prefetch_cap: Option<u64>,
    /// Size the expert buffer in experts instead of from the budget (still checked against it).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    buffer_experts: Option<u32>,
    /// Record every expert access (demand, prefetch, cancel) into FILE (JSON lines).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// How expert reads reach the store: `direct` bypasses the page cache (O_DIRECT, falling
    /// back with a warning where refused), `cached` goes through it, `emulate` paces direct
    /// reads to the profile's bandwidth and per-read latency.
    #[arg(long, value_name = "MODE", default_value = "direct", value_parser = parse_storage)]
    storage: StorageMode,
    /// Compute threads (default: the profile's, else the cores minus one for the prefetch thread).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    threads: Option<u16>,
    /// Where the dense math runs: cpu, cuda or cuda:N (default: the profile's, else cpu).
    /// CUDA is untested on hardware: experts are decoded on the host and moved to the GPU.
    #[arg(long, value_name = "DEVICE")]
    device: Option<String>,
}

fn parse_storage(text: &str) -> std::result::Result<StorageMode, String> {
    match text {
        "direct" => Ok(StorageMode::Direct),
        "cached" => Ok(StorageMode::Cached),
        "emulate" => Ok(StorageMode::Emulate),
        other => Err(format!(
            "unknown storage mode `{other}` (expected direct, cached or emulate)"
        )),
    }
}

/// A run's resolved settings.
struct RunSettings {
    budget_bytes: u64,
    cache: CacheOptions,
    profile: Option<DeviceProfile>,
    device: tch::Device,
}

impl CacheArgs {
    /// Flags over profile over defaults; applies the thread count.
    fn resolve(&self) -> Result<RunSettings> {
        let profile = self
            .profile
            .as_deref()
            .map(DeviceProfile::load)
            .transpose()?;
        let device_name = self
            .device
            .clone()
            .or_else(|| {
                profile.as_ref().map(|p| match p.device {
                    DeviceKind::Cpu => "cpu".to_string(),
                    DeviceKind::Cuda => "cuda".to_string(),
                })
            })
            .unwrap_or_else(|| "cpu".into());
        let device =
            edgemoe::config::profile::parse_device(&device_name).with_context(
                || match &profile {
                    Some(p) if self.device.is_none() => format!("profile {}", p.name),
                    _ => "--device".to_string(),
                },
            )?;
        // A profile's thread count is the board's; on a smaller machine it is capped like the
        // default (see `default_threads`). An explicit --threads is taken as given.
        let threads = self
            .threads
            .map(usize::from)
            .or(profile.as_ref().map(|p| p.threads.min(default_threads())));
        if let Some(threads) = threads {
            tch::set_num_threads(threads as i32);
        }
        let budget_bytes = self
            .budget
            .or(profile.as_ref().map(|p| p.budget_bytes))
            .unwrap_or(3 << 29);
        Ok(RunSettings {
            budget_bytes,
            cache: CacheOptions {
                policy: self
                    .policy
                    .or(profile.as_ref().map(|p| p.policy))
                    .unwrap_or_else(|| edgemoe::runtime::modes::default_policy(self.mode)),
                prefetch: !self.no_prefetch,
                prefetch_cap_bytes: self
                    .prefetch_cap
                    .or(profile.as_ref().map(|p| p.prefetch_cap_bytes)),
                buffer_experts: self.buffer_experts.map(|n| n as usize),
                trace: self.trace.clone(),
                storage: self.storage,
                emulated_device: profile
                    .as_ref()
                    .map(|p| (p.read_bytes_per_s, p.read_latency)),
                mode: self.mode,
                quantized_bundle: self.quantized.clone(),
            },
            profile,
            device,
        })
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

/// Compute threads unless a flag or profile says otherwise: one core is left to the prefetch
/// thread and the OS. More libtorch (OpenMP) threads than free cores make them spin against
/// each other: measured here, 2 threads on 2 busy cores decoded 5–15× slower than 1.
fn default_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores.saturating_sub(1).max(1)
}

pub fn run(cli: Cli) -> Result<()> {
    tch::set_num_threads(default_threads() as i32);
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
        Command::Bench(args) => run_bench(args),
        Command::ProbeStorage(args) => run_probe(args),
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
    let settings = args.cache.resolve()?;
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
    let mut summarizer = Session::open(&bundle, options)?;
    for warning in &summarizer.warnings {
        eprintln!("warning: {warning}");
    }

    let mut generations = Vec::with_capacity(documents.len());
    let stdout = std::io::stdout();
    for document in &documents {
        let (summary, generation, source_tokens) = summarizer.summarize(document)?;
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
    summarizer.buffer.finish_trace()?;
    let mut stats = RunStats::new(
        &generations,
        summarizer.stats(),
        &summarizer.plan,
        &summarizer.options.cache,
    );
    stats.profile = settings.profile.map(|p| p.name);
    if !args.output.quiet {
        eprintln!("{}", stats.summary_line());
    }
    if let Some(path) = &args.output.stats_json {
        write_json(path, &stats)?;
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
    let mut decode = DecodeOptions::from_defaults(&generation);
    decode.sampling = sampling;
    if let Some(n) = args.max_new_tokens {
        decode.max_new_tokens = n;
    }
    let settings = args.cache.resolve()?;
    if settings.device != tch::Device::Cpu {
        anyhow::bail!("decoder-only models run on the CPU in this build: pass --device cpu");
    }
    let options = SessionOptions {
        budget_bytes: settings.budget_bytes,
        decode,
        max_input_tokens: prompt_ids.len(),
        cache: settings.cache,
        device: tch::Device::Cpu,
    };
    bundle.expect_decoder_only()?;
    let mut generator = Session::open(&bundle, options)?;
    for warning in &generator.warnings {
        eprintln!("warning: {warning}");
    }
    let stdout = std::io::stdout();
    let mut stream = TextStream::default();
    let mut first = true;
    let ids = args.output.ids;
    // The callback prints with the session's tokenizer while its model runs: borrow the two
    // fields apart.
    let Session {
        model,
        tokenizer,
        buffer,
        options,
        ..
    } = &mut generator;
    let generated = run_model(model, buffer, &prompt_ids, &options.decode, &mut |token| {
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
    })?;
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
        generator.stats(),
        &generator.plan,
        &generator.options.cache,
    );
    if !args.output.quiet {
        eprintln!("{}", stats.summary_line());
    }
    if let Some(path) = &args.output.stats_json {
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
    for line in bundle.config.model.describe() {
        println!("{line}");
    }
    let resident_bytes = bundle.load_model(tch::Device::Cpu)?.resident_bytes();
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
    println!("{}", bundle.config.describe_generation());
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
    // Decoder-only models take each document as a prompt (its last DOCUMENT_PROMPT_TOKENS
    // tokens), followed by the model's greedy continuation.
    let mut session = Session::open(
        &bundle,
        SessionOptions {
            max_input_tokens: generation.max_source_tokens.min(DOCUMENT_PROMPT_TOKENS),
            cache,
            ..SessionOptions::defaults(&bundle, u64::MAX / 4)
        },
    )?;
    let calibration = collect_paths(&mut session, &documents, "calibration", true)?;
    let held_out = collect_paths(&mut session, &held_out_documents, "held out", true)?;
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
        write_json(path, &report)?;
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
        edgemoe::bench::charts::hit_ratio_vs_slots(&results, &title, path)?;
    }
    Ok(())
}

fn print_rouge(label: &str, r: &edgemoe::offline::rouge::RougeScores) {
    println!(
        "{label}ROUGE-1 {:.2}  ROUGE-2 {:.2}  ROUGE-L {:.2}  (F-measure × 100)",
        100.0 * r.rouge1.fmeasure,
        100.0 * r.rouge2.fmeasure,
        100.0 * r.rouge_l.fmeasure
    );
}

fn run_eval(args: EvalArgs) -> Result<()> {
    check_default_bundle(&args.model)?;
    let examples = edgemoe::offline::eval::read_examples(&args.data, args.limit)?;
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
    bundle.expect_encoder_decoder()?;
    let mut summarizer = Session::open(
        &bundle,
        SessionOptions {
            budget_bytes: settings.budget_bytes,
            decode,
            max_input_tokens: generation.max_source_tokens,
            cache: settings.cache,
            device: settings.device,
        },
    )?;
    for warning in &summarizer.warnings {
        eprintln!("warning: {warning}");
    }
    let (report, predictions) =
        edgemoe::offline::eval::evaluate(&mut summarizer, &examples, args.stem, true)?;
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
    let (_, mean) = edgemoe::offline::rouge::score_files(&args.pred, &args.reference, args.stem)?;
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
    let examples = edgemoe::offline::eval::read_examples(&args.data, Some(args.limit))?;
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
    let experts = edgemoe::runtime::resident::ResidentExperts::load(&store, &widths)?;
    let tokenizer = bundle.tokenizer()?;
    let generation = bundle.config.generation.clone();
    let max_new_tokens = args.max_new_tokens.unwrap_or(generation.max_new_tokens);
    let model = bundle.load_model(tch::Device::Cpu)?;
    let mut decode = DecodeOptions::from_defaults(&generation);
    decode.num_beams = 1;
    decode.max_new_tokens = max_new_tokens;
    let model = edgemoe::offline::tune::TuneModel {
        model: &model,
        decode,
    };
    let mut tuner = edgemoe::offline::tune::Tuner::new(
        model,
        experts,
        &tokenizer,
        &examples,
        edgemoe::offline::tune::EvalSettings {
            prefix: generation.input_prefix.clone(),
            // Decoder-only models read documents as prompts: their last tokens.
            max_source_tokens: generation.max_source_tokens.min(DOCUMENT_PROMPT_TOKENS),
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
            let (_, len) = spec.expert_layout().blob(e);
            len
        })
        .sum();
    plan.save(&args.out)?;
    let importance: std::collections::BTreeMap<_, _> = ids
        .iter()
        .filter_map(|&id| {
            report
                .importance
                .get(&edgemoe::offline::tune::expert_key(id))
                .map(|&v| (id, v))
        })
        .collect();
    if !importance.is_empty() {
        edgemoe::bench::charts::importance_heatmap(
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
    write_json(&report_path, &summary)?;
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

fn run_bench(args: BenchArgs) -> Result<()> {
    use edgemoe::bench::matrix::{self as bench, BenchRow, BenchRun, Cgroup};
    let profile = DeviceProfile::load(&args.profile)?;
    std::fs::create_dir_all(args.out.join("runs")).map_err(|e| Error::io(&args.out, e))?;
    // The documents, as JSON lines for the child processes.
    let documents = read_documents(&args.data, Some(args.limit))?;
    let input = args.out.join("input.jsonl");
    let lines: Vec<String> = documents
        .iter()
        .map(|d| serde_json::json!({ "document": d }).to_string())
        .collect();
    std::fs::write(&input, lines.join("\n") + "\n").map_err(|e| Error::io(&input, e))?;
    let quantized = match (
        &args.quantized,
        args.modes.iter().any(|m| m.uses_quantized_store()),
    ) {
        (Some(q), _) => Some(q.clone()),
        (None, true) => {
            let q = args.out.join("quantized-int4");
            eprintln!(
                "writing an all-INT4 copy of {} into {}",
                args.model.display(),
                q.display()
            );
            edgemoe::offline::convert::requantize_bundle(
                &args.model,
                &q,
                &BitPlan::uniform(ExpertEncoding::Quant(edgemoe::quant::QuantBits::Int4)),
            )?;
            Some(q)
        }
        (None, false) => None,
    };
    let mut runs = Vec::new();
    for &mode in &args.modes {
        if args.buffer_experts.is_empty() {
            let budgets = if args.budgets.is_empty() {
                vec![profile.budget_bytes]
            } else {
                args.budgets.clone()
            };
            for b in budgets {
                runs.push(BenchRun {
                    mode,
                    budget_bytes: Some(b),
                    buffer_experts: None,
                });
            }
        } else {
            for &n in &args.buffer_experts {
                runs.push(BenchRun {
                    mode,
                    budget_bytes: None,
                    buffer_experts: Some(n),
                });
            }
        }
    }
    let exe = std::env::current_exe().context("cannot find the edgemoe executable")?;
    let progress = bench::progress(runs.len());
    let mut rows: Vec<BenchRow> = Vec::new();
    let mut outputs: Vec<(Mode, String)> = Vec::new();
    let mut cgroup_note = None;
    for (i, run) in runs.iter().enumerate() {
        let label = format!(
            "{} {}",
            run.mode,
            run.buffer_experts
                .map(|n| format!("{n} experts"))
                .unwrap_or_else(|| format_bytes(run.budget_bytes.unwrap_or(profile.budget_bytes)))
        );
        progress.set_message(label.clone());
        let budget = run.budget_bytes.unwrap_or(profile.budget_bytes);
        let stats_path = args
            .out
            .join("runs")
            .join(format!("{i:02}-{}.json", run.mode.name().replace('+', "p")));
        let mut command = std::process::Command::new(&exe);
        command
            .arg("summarize")
            .arg("--model")
            .arg(&args.model)
            .arg("--input")
            .arg(&input)
            .arg("--mode")
            .arg(run.mode.name())
            .arg("--profile")
            .arg(&args.profile)
            .arg("--device")
            .arg("cpu")
            .arg("--storage")
            .arg(match args.storage {
                StorageMode::Cached => "cached",
                StorageMode::Direct => "direct",
                StorageMode::Emulate => "emulate",
            })
            .arg("--budget")
            .arg(budget.to_string())
            .arg("--stats-json")
            .arg(&stats_path)
            .arg("--ids")
            .arg("-q");
        if let Some(n) = run.buffer_experts {
            command.arg("--buffer-experts").arg(n.to_string());
        }
        if let Some(n) = args.max_new_tokens {
            command.arg("--max-new-tokens").arg(n.to_string());
        }
        if let Some(q) = &quantized {
            command.arg("--quantized").arg(q);
        }
        for bundle in std::iter::once(&args.model).chain(quantized.as_ref()) {
            edgemoe::io::drop_cached_pages(&bundle.join(EXPERTS_FILE));
        }
        // io-free is the infinite-memory oracle: it is not confined.
        let confine = !args.no_cgroup && run.mode != Mode::IoFree;
        let cgroup = if !confine {
            None
        } else {
            Cgroup::create(i, budget + args.cgroup_overhead)
        };
        if cgroup.is_none() && confine && cgroup_note.is_none() {
            cgroup_note =
                Some("no writable memory cgroup here: runs are not confined to their budget");
            eprintln!("warning: {}", cgroup_note.unwrap_or_default());
        }
        let output = bench::run_child(command, cgroup.as_ref())?;
        progress.inc(1);
        if !output.status.success() {
            progress.suspend(|| {
                eprintln!(
                    "warning: {label} failed ({}): {}",
                    output.status,
                    String::from_utf8_lossy(&output.stderr).trim()
                )
            });
            continue;
        }
        let stats = RunStats::load(&stats_path)?;
        let ids = String::from_utf8_lossy(&output.stdout).into_owned();
        let reference_mode = if run.mode.uses_quantized_store() {
            Mode::IoQexp
        } else {
            Mode::IoFree
        };
        let reference = outputs
            .iter()
            .find(|(m, _)| *m == reference_mode)
            .or_else(|| {
                outputs
                    .iter()
                    .find(|(m, _)| m.uses_quantized_store() == run.mode.uses_quantized_store())
            });
        let matches = reference.map(|(_, r)| *r == ids);
        outputs.push((run.mode, ids));
        rows.push(BenchRow {
            mode: run.mode.name().into(),
            profile: profile.name.clone(),
            budget_bytes: budget,
            buffer_experts: run.buffer_experts,
            buffer_slots: stats.buffer_slots,
            decode_ms_per_token: stats.decode_ms_per_token,
            p50_ms: stats.p50_ms,
            p90_ms: stats.p90_ms,
            sample_ms: stats.samples.iter().map(|s| s.sample_ms).sum::<f64>()
                / stats.samples.len().max(1) as f64,
            sample_ms_all: stats.samples.iter().map(|s| s.sample_ms).collect(),
            peak_rss_bytes: stats.peak_rss_bytes,
            cgroup_peak_bytes: cgroup.as_ref().and_then(Cgroup::peak_bytes),
            bytes_read_per_token: stats.bytes_read_per_token,
            stall_ms_per_token: stats.stall_ms_per_token,
            hit_ratio: stats.hit_ratio,
            tokens: stats.tokens_generated as u64,
            outputs_match_reference: matches,
        });
    }
    progress.finish_and_clear();
    let results = args.out.join("results.json");
    write_json(&results, &rows)?;
    let mut md = format!(
        "{} documents from {}, profile {} ({}), storage {:?}{}\n\n",
        documents.len(),
        args.data.display(),
        profile.name,
        profile.description,
        args.storage,
        cgroup_note.map(|n| format!("; {n}")).unwrap_or_default()
    );
    md += &bench::markdown(&rows);
    let md_path = args.out.join("results.md");
    std::fs::write(&md_path, &md).map_err(|e| Error::io(&md_path, e))?;
    print!("{md}");
    let title = format!("{} · {}", profile.name, args.model.display());
    bench::plot_latency_bars(
        &rows,
        &format!("per-token latency · {title}"),
        &args.out.join("latency.svg"),
    )?;
    bench::plot_latency_vs_budget(
        &rows,
        &format!("latency vs memory · {title}"),
        &args.out.join("latency-vs-budget.svg"),
    )?;
    bench::plot_sample_cdf(
        &rows,
        &format!("per-sample latency · {title}"),
        &args.out.join("sample-cdf.svg"),
    )?;
    let ablation: Vec<BenchRow> = ["io-exp", "q", "q+p", "q+p+c"]
        .iter()
        .filter_map(|m| rows.iter().find(|r| r.mode == *m).cloned())
        .collect();
    if !ablation.is_empty() {
        bench::plot_latency_bars(
            &ablation,
            &format!("ablation · {title}"),
            &args.out.join("ablation.svg"),
        )?;
    }
    // The headline ratios.
    let first = |m: &str| {
        rows.iter()
            .find(|r| r.mode == m)
            .map(|r| r.decode_ms_per_token)
    };
    if let Some(e) = first("edgemoe") {
        for base in ["io-exp", "io-qexp", "mmap", "io-free"] {
            if let Some(b) = first(base) {
                println!(
                    "edgemoe vs {base}: {:.2}× ({:.2} vs {:.2} ms/token)",
                    b / e,
                    e,
                    b
                );
            }
        }
    }
    println!(
        "wrote {}, {} and plots in {}",
        results.display(),
        md_path.display(),
        args.out.display()
    );
    Ok(())
}

fn run_probe(args: ProbeArgs) -> Result<()> {
    use edgemoe::bench::probe::{measure, ProbeFile, IN_FLIGHT, READ_SIZES};
    if !(args.seconds > 0.0 && args.seconds <= 60.0) {
        anyhow::bail!("--seconds must be in (0, 60]");
    }
    let file = ProbeFile::prepare(&args.path, args.size)?;
    let duration = std::time::Duration::from_secs_f64(args.seconds);
    let mut results = Vec::new();
    for &size in &READ_SIZES {
        for &depth in &IN_FLIGHT {
            results.push(measure(&file, size, depth, duration)?);
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
        return Ok(());
    }
    println!(
        "{} ({}): MB/s by read size (rows) and reads in flight (columns), O_DIRECT",
        file.path.display(),
        format_bytes(file.size)
    );
    print!("{:>10}", "");
    for d in IN_FLIGHT {
        print!("{:>9}", format!("QD{d}"));
    }
    println!("{:>14}", "µs/read QD1");
    for &size in &READ_SIZES {
        print!("{:>10}", format_bytes(size));
        for r in results.iter().filter(|r| r.read_bytes == size) {
            print!("{:>9.1}", r.bytes_per_s / 1e6);
        }
        let qd1 = results
            .iter()
            .find(|r| r.read_bytes == size && r.in_flight == 1);
        println!("{:>14.0}", qd1.map_or(0.0, |r| r.latency_us));
    }
    println!("profile hint: storage_read_bandwidth = the 4 MiB row's best; storage_read_latency_us = the 4 KiB QD1 figure");
    Ok(())
}

/// Writes `value` as pretty JSON (with a final newline), naming the file in errors.
fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> Result<()> {
    let json = serde_json::to_string_pretty(value)?;
    std::fs::write(path, json + "\n").map_err(|e| Error::io(path, e))?;
    Ok(())
}
