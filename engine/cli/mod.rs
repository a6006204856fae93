//! The `edgemoe` command line: the clap types of every command and the dispatch to the command's
//! file, which resolves its arguments, calls the library and prints. Shared argument groups and
//! value parsers are in [`args`].

mod args;
mod bench;
mod calibrate;
mod convert;
mod eval;
mod generate;
mod inspect;
mod probe_storage;
mod replay;
mod rouge;
mod serve;
mod summarize;
mod tune_bits;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// A usage error found after clap has parsed the arguments — flags that do not go together, a
/// value this command cannot take — checked before any work starts. Reported like clap's own
/// usage errors: one `error:` line and exit status 2.
#[derive(Debug)]
pub struct Usage(pub String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// Fails with a [`Usage`] error.
pub fn usage(message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Usage(message.into()))
}

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
    Convert(convert::ConvertArgs),
    /// Summarize a document (or JSON lines of documents) with a bundle on a memory budget.
    Summarize(summarize::SummarizeArgs),
    /// Continue a prompt with a decoder-only bundle (Mixtral, Qwen2-MoE, OLMoE) on a memory
    /// budget, printing tokens as they are produced (greedy unless --temperature/--top-p).
    Generate(generate::GenerateArgs),
    /// Serve a bundle over HTTP: POST /v1/summarize (encoder-decoder bundles) or the
    /// OpenAI-compatible /v1/completions and /v1/chat/completions (decoder-only), with
    /// /health, Prometheus /metrics and a live dashboard at /.
    Serve(serve::ServeArgs),
    /// Show a bundle's shape, resident and expert sizes, and expert bit widths (--verify: check
    /// every file and expert blob against its checksum).
    Inspect(inspect::InspectArgs),
    /// Build the activation-path dictionary of a bundle from a corpus (writes paths.bin).
    Calibrate(calibrate::CalibrateArgs),
    /// Replay an expert-access trace through eviction policies and buffer sizes.
    Replay(replay::ReplayArgs),
    /// Summarize a reference corpus and print ROUGE and speed.
    Eval(eval::EvalArgs),
    /// Score existing predictions against references (one text per line) with ROUGE.
    Rouge(rouge::RougeArgs),
    /// Choose each expert's bit width for a tolerable accuracy loss (writes a plan for
    /// `convert --plan`).
    TuneBits(tune_bits::TuneBitsArgs),
    /// Run engine modes × budgets on a corpus, each in its own process, and report.
    Bench(bench::BenchArgs),
    /// Measure read throughput against read size and reads in flight (O_DIRECT).
    ProbeStorage(probe_storage::ProbeArgs),
}

pub fn run(cli: Cli) -> Result<()> {
    // The engine's own pool runs every matrix product (`quant::parallel`); libtorch's OpenMP
    // threads would only spin beside it.
    tch::set_num_threads(1);
    match cli.command {
        Command::Convert(args) => convert::run(args),
        Command::Summarize(args) => summarize::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Calibrate(args) => calibrate::run(args),
        Command::Replay(args) => replay::run(args),
        Command::Eval(args) => eval::run(args),
        Command::Rouge(args) => rouge::run(args),
        Command::TuneBits(args) => tune_bits::run(args),
        Command::Bench(args) => bench::run(args),
        Command::ProbeStorage(args) => probe_storage::run(args),
    }
}
