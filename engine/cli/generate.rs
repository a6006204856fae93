//! `edgemoe generate`: continue a prompt with a decoder-only bundle, printing tokens as they come.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use edgemoe::bundle::Bundle;
use edgemoe::generation::causal::TextStream;
use edgemoe::generation::decoding::DecodeOptions;
use edgemoe::generation::report::RunStats;
use edgemoe::generation::sampling::Sampling;
use edgemoe::generation::session::{run_model, Session, SessionOptions};
use edgemoe::Error;

use super::args::{
    check_writes, parse_ids, parse_temperature, parse_top_p, read_input, CacheArgs, Ids, OutputArgs,
};

#[derive(Args, Debug)]
pub struct GenerateArgs {
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

pub fn run(args: GenerateArgs) -> Result<()> {
    if args.cache.device_flag().is_some_and(|d| d != "cpu") {
        return Err(super::usage(
            "decoder-only models run on the CPU in this build: pass --device cpu",
        ));
    }
    let inputs = [vec![("--model", args.model.as_path())], args.cache.inputs()].concat();
    args.cache.check()?;
    check_writes(
        &[args.output.outputs(), args.cache.outputs()].concat(),
        &inputs,
    )?;
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
    decode.kv_cache = settings.kv_cache;
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
    let mut session = Session::open(&bundle, options)?;
    for warning in &session.warnings {
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
    } = &mut session;
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
            write!(out, "{}", stream.finish(&session.tokenizer)?)?;
        }
        writeln!(out)?;
        out.flush()?;
    }
    session.buffer.finish_trace()?;
    let mut stats = RunStats::new(
        &[(prompt_ids.len(), generated)],
        session.stats(),
        &session.plan,
        &session.options.cache,
    );
    stats.kv_cache = session.options.decode.kv_cache;
    args.output.report(&stats)
}
