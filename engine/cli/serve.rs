//! `edgemoe serve`: the long-running service over one bundle (`engine/serve/`). Resolves the
//! engine options as `summarize` and `generate` do (the same [`CacheArgs`]), the limits, the
//! API key, and runs the server until a stop signal.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::Args;

use edgemoe::bundle::Bundle;
use edgemoe::generation::decoding::DecodeOptions;
use edgemoe::generation::session::SessionOptions;
use edgemoe::serve::api::Limits;
use edgemoe::serve::{serve, session_options, ServeOptions};

use super::args::{
    check_default_bundle, check_writes, parse_budget, parse_count, CacheArgs, DEFAULT_BUNDLE,
};

/// The environment variable that gives the API key when `--api-key` does not.
const API_KEY_ENV: &str = "EDGEMOE_API_KEY";

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Model bundle directory (made by `edgemoe convert`): an encoder-decoder bundle serves
    /// POST /v1/summarize, a decoder-only one POST /v1/completions and /v1/chat/completions.
    #[arg(long, value_name = "BUNDLE", default_value = DEFAULT_BUNDLE)]
    model: PathBuf,
    /// Address to listen on (default: loopback only; 0.0.0.0 to listen on every interface).
    #[arg(long, value_name = "HOST", default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port; the address is printed on standard error).
    #[arg(long, value_name = "PORT", default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/*, /metrics and /stats (default: the
    /// EDGEMOE_API_KEY environment variable; none when both are unset).
    #[arg(long, value_name = "KEY")]
    api_key: Option<String>,
    /// Requests that may wait for the engine; one more is answered 503 with Retry-After.
    #[arg(long, value_name = "N", default_value = "8", value_parser = parse_count)]
    queue: usize,
    /// Largest request body.
    #[arg(long, value_name = "SIZE", default_value = "1MiB", value_parser = parse_budget)]
    limit_body: u64,
    /// Most documents in one summarization request.
    #[arg(long, value_name = "N", default_value = "32", value_parser = parse_count)]
    limit_documents: usize,
    /// Longest document (longer ones are truncated, as `summarize` does) or prompt (longer
    /// ones are refused), in tokens; working memory is sized for it (default: the model's
    /// max_source_tokens for a summarization model, its positions up to 1024 for a decoder-only one).
    #[arg(long, value_name = "N", value_parser = parse_count)]
    limit_input_tokens: Option<usize>,
    /// Most new tokens one request may ask for (default: 512, or the model's default if larger).
    #[arg(long, value_name = "N", value_parser = parse_count)]
    limit_new_tokens: Option<usize>,
    /// Widest beam search one request may ask for (default: 4, or the model's beams if more).
    #[arg(long, value_name = "N", value_parser = parse_count)]
    limit_beams: Option<usize>,
    /// Seconds from a request's arrival to its answer, queue wait included; a request still
    /// running then is stopped at its next token and answered 504.
    #[arg(long, value_name = "SECONDS", default_value = "300", value_parser = parse_seconds)]
    request_timeout: Duration,
    /// After SIGTERM: seconds queued and running requests may still take before they are
    /// cancelled.
    #[arg(long, value_name = "SECONDS", default_value = "10", value_parser = parse_seconds)]
    shutdown_grace: Duration,
    #[command(flatten)]
    cache: CacheArgs,
}

pub fn run(args: ServeArgs) -> Result<()> {
    let inputs = [vec![("--model", args.model.as_path())], args.cache.inputs()].concat();
    args.cache.check()?;
    check_writes(&args.cache.outputs(), &inputs)?;
    check_default_bundle(&args.model)?;
    // An empty key would serve without authentication although a key was asked for.
    let api_key = match args.api_key.clone() {
        Some(key) if key.is_empty() => {
            return Err(super::usage(
                "--api-key is empty: pass a key, or leave the flag out to serve without one",
            ))
        }
        Some(key) => Some(key),
        None => match std::env::var(API_KEY_ENV) {
            Ok(key) if key.is_empty() => {
                return Err(super::usage(format!(
                    "{API_KEY_ENV} is set but empty: set a key, or unset it to serve without one"
                )))
            }
            Ok(key) => Some(key),
            Err(_) => None,
        },
    };
    if api_key.as_deref().is_some_and(|k| k.trim() != k) {
        return Err(super::usage(
            "the API key starts or ends with whitespace: a bearer token cannot carry it",
        ));
    }
    let bundle = Bundle::open(&args.model)?;
    let generation = bundle.config.generation.clone();
    let encoder_decoder = bundle.config.model.as_switch().is_some();
    let settings = args.cache.resolve()?;
    if !encoder_decoder && settings.device != tch::Device::Cpu {
        return Err(super::usage(
            "decoder-only models run on the CPU in this build: pass --device cpu",
        ));
    }
    let limits = Limits {
        body_bytes: usize::try_from(args.limit_body).unwrap_or(usize::MAX),
        documents: args.limit_documents,
        input_tokens: args.limit_input_tokens.unwrap_or_else(|| {
            match bundle.config.model.as_decoder() {
                Some(decoder) => decoder.max_position_embeddings.min(1024),
                None => generation.max_source_tokens,
            }
        }),
        new_tokens: args
            .limit_new_tokens
            .unwrap_or(generation.max_new_tokens.max(512)),
        beams: args.limit_beams.unwrap_or(generation.num_beams.max(4)),
        deadline: args.request_timeout,
    };
    let base = SessionOptions {
        budget_bytes: settings.budget_bytes,
        max_input_tokens: limits.input_tokens,
        decode: DecodeOptions {
            kv_cache: settings.kv_cache,
            ..DecodeOptions::from_defaults(&generation)
        },
        cache: settings.cache,
        device: settings.device,
    };
    let options = ServeOptions {
        host: args.host,
        port: args.port,
        api_key,
        queue: args.queue,
        limits: limits.clone(),
        grace: args.shutdown_grace,
        profile: settings.profile.map(|p| p.name),
    };
    serve(bundle, session_options(base, &limits), options)?;
    Ok(())
}

/// Seconds, whole or fractional (`0.5`), greater than zero.
fn parse_seconds(text: &str) -> std::result::Result<Duration, String> {
    match text.trim().parse::<f64>() {
        Ok(s) if s > 0.0 && s.is_finite() && s <= 1e6 => Ok(Duration::from_secs_f64(s)),
        _ => Err(format!(
            "`{text}` is not a number of seconds (greater than 0, e.g. 30 or 0.5)"
        )),
    }
}
