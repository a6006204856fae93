//! Argument groups several commands share — how a run uses memory, storage and the expert buffer
//! ([`CacheArgs`], resolved flags over profile over defaults), what a run prints and writes
//! ([`OutputArgs`]), the default bundle and reading the input — and the value parsers.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;

use edgemoe::atomic::refuse_overlaps;
use edgemoe::cache::Policy;
use edgemoe::config::profile::{DeviceKind, DeviceProfile, BUILT_IN};
use edgemoe::generation::report::RunStats;
use edgemoe::generation::session::CacheOptions;
use edgemoe::io::check_output_path;
use edgemoe::model::KvFormat;
use edgemoe::quant::QuantBits;
use edgemoe::runtime::modes::Mode;
use edgemoe::runtime::predict::PredictorKind;
use edgemoe::store::{ExpertEncoding, StorageMode};
use edgemoe::units::parse_bytes;

use super::usage;

/// Where `./setup.sh` puts the converted demo model; the default `--model`.
pub const DEFAULT_BUNDLE: &str = "bundles/switch-samsum-tiny";

/// Fails with what to do when `--model` was left at the demo bundle and it is not there.
pub fn check_default_bundle(model: &Path) -> Result<()> {
    if model == Path::new(DEFAULT_BUNDLE) && !model.exists() {
        anyhow::bail!(
            "no --model given and the demo bundle {DEFAULT_BUNDLE} does not exist: run ./setup.sh, or convert a checkpoint with `edgemoe convert --hf DIR --out DIR`"
        );
    }
    Ok(())
}

/// The text of a file, or of standard input for `-`, with a name for errors.
pub fn read_input(input: &str) -> Result<(String, String)> {
    if input == "-" {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .context("cannot read standard input")?;
        Ok((text, "standard input".into()))
    } else {
        let path = Path::new(input);
        let text = edgemoe::io::read_input_text(path)?;
        Ok((text, path.display().to_string()))
    }
}

/// Compute threads unless a flag or profile says otherwise: one core is left to the prefetch
/// thread and the OS (the helper threads of `quant::parallel`; libtorch itself runs on one thread).
pub fn default_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores.saturating_sub(1).max(1)
}

/// What a run prints and writes besides its text.
#[derive(Args, Debug)]
pub struct OutputArgs {
    /// Write run statistics as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub stats_json: Option<PathBuf>,
    /// Print the generated token ids instead of the text.
    #[arg(long)]
    pub ids: bool,
    /// Do not print the statistics line on standard error.
    #[arg(long, short)]
    pub quiet: bool,
}

impl OutputArgs {
    /// The files this run writes, by flag.
    pub fn outputs(&self) -> Vec<(&'static str, &Path)> {
        self.stats_json
            .iter()
            .map(|path| ("--stats-json", path.as_path()))
            .collect()
    }

    /// Prints the statistics line (unless `--quiet`) and writes `--stats-json`.
    pub fn report(&self, stats: &RunStats) -> Result<()> {
        if !self.quiet {
            eprintln!("{}", stats.summary_line());
        }
        if let Some(path) = &self.stats_json {
            stats.save(path)?;
        }
        Ok(())
    }
}

/// How a run uses memory, storage and the expert buffer (every command that runs the model).
/// Explicit flags override the profile's values.
#[derive(Args, Debug)]
pub struct CacheArgs {
    /// Device profile: a built-in name (rpi4-sd, rpi5-sd, rpi5-nvme, jetson-tx2-ssd,
    /// jetson-tx2-hdd, jetson-orin-nano-nvme) or a TOML file. Sets budget, storage speed for
    /// `--storage emulate`, threads, device, policy and prefetch cap.
    #[arg(long, value_name = "NAME|FILE", value_parser = parse_profile)]
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
    /// Eviction policy: edgemoe, edgemoe-docs, edgemoe-fd, edgemoe-paper, lru, lfu or fifo
    /// (default: the profile's, else edgemoe).
    #[arg(long, value_parser = parse_online_policy)]
    policy: Option<Policy>,
    /// Do not prefetch: no I/O scheduler, no dictionary prefetch, no read/compute overlap.
    #[arg(long)]
    no_prefetch: bool,
    /// What predicts the experts to prefetch: dictionary (the activation-path dictionary,
    /// `paths.bin`), gate (the next MoE layer's router applied ahead to the current hidden
    /// state) or both. Every predictor is scored in `--stats-json` whichever drives prefetch.
    #[arg(long, value_name = "PREDICTOR", default_value = "dictionary")]
    predictor: PredictorKind,
    /// Most speculative bytes prefetched per token (default: the profile's, else two experts
    /// per decoder MoE layer).
    #[arg(long, value_name = "SIZE", value_parser = parse_budget, conflicts_with = "no_prefetch")]
    prefetch_cap: Option<u64>,
    /// Keep a copy of every decoder expert at this width (int2, int4 or int8) within the budget,
    /// and compute a decode step's expert with it when the full one is not in the buffer, while
    /// the full one is read for later steps. Faster on slow storage, and lossy: off by default.
    #[arg(long, value_name = "BITS", value_parser = parse_stand_in)]
    stand_in: Option<QuantBits>,
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
    /// How the attention cache holds its keys and values, read whole at every decode step (an
    /// encoder-decoder's cross-attention, a decoder-only model's self-attention): f32 (default,
    /// the reference's), f16 or int8 (blocks of 32 with a scale). Narrower is smaller, often
    /// faster, and lossy.
    #[arg(long, value_name = "FORMAT", default_value = "f32")]
    kv_cache: KvFormat,
    /// Compute threads (default: the profile's, else the cores minus one for the prefetch thread).
    #[arg(long, value_name = "N", value_parser = parse_threads)]
    threads: Option<u16>,
    /// Where the dense math runs: cpu, cuda or cuda:N (default: the profile's, else cpu).
    /// CUDA is untested on hardware: experts are decoded on the host and moved to the GPU.
    #[arg(long, value_name = "DEVICE", value_parser = parse_device_name)]
    device: Option<String>,
}

/// A run's resolved settings.
pub struct RunSettings {
    pub budget_bytes: u64,
    /// `--kv-cache`: for [`edgemoe::generation::decoding::DecodeOptions::kv_cache`].
    pub kv_cache: KvFormat,
    pub cache: CacheOptions,
    pub profile: Option<DeviceProfile>,
    pub device: tch::Device,
}

impl CacheArgs {
    /// Checked before any work starts: flags that do not go together (a [`Usage`] error, exit
    /// status 2). What the run reads and writes is checked by [`check_writes`] with
    /// [`CacheArgs::inputs`] and [`CacheArgs::outputs`].
    pub fn check(&self) -> Result<()> {
        if self.trace.is_some() && !self.mode.has_buffer() {
            return Err(usage(format!(
                "--trace records expert-buffer accesses: mode `{}` has no expert buffer (use edgemoe, q+p or q+p+c)",
                self.mode
            )));
        }
        if self.stand_in.is_some() && !self.mode.has_buffer() {
            return Err(usage(format!(
                "--stand-in computes with copies of experts missing from the expert buffer: mode `{}` has none (use edgemoe, q+p or q+p+c)",
                self.mode
            )));
        }
        if self.mode.uses_quantized_store() && self.quantized.is_none() {
            return Err(usage(format!(
                "mode `{}` needs a quantized bundle of the same model (--quantized BUNDLE)",
                self.mode
            )));
        }
        if self.storage == StorageMode::Emulate && self.profile.is_none() {
            return Err(usage(
                "--storage emulate paces reads to a device profile: pass --profile NAME|FILE",
            ));
        }
        Ok(())
    }

    /// What these flags make a run read besides its model: the `--quantized` bundle and a
    /// `--profile` file.
    pub fn inputs(&self) -> Vec<(&'static str, &Path)> {
        let profile_file = self
            .profile
            .as_deref()
            .map(Path::new)
            .filter(|path| path.is_file());
        [
            ("--quantized", self.quantized.as_deref()),
            ("--profile", profile_file),
        ]
        .into_iter()
        .filter_map(|(flag, path)| path.map(|p| (flag, p)))
        .collect()
    }

    /// The files these flags make a run write: the `--trace`.
    pub fn outputs(&self) -> Vec<(&'static str, &Path)> {
        self.trace
            .iter()
            .map(|path| ("--trace", path.as_path()))
            .collect()
    }

    /// The device asked for by flag, if any.
    pub fn device_flag(&self) -> Option<&str> {
        self.device.as_deref()
    }

    /// Flags over profile over defaults; applies the thread count.
    pub fn resolve(&self) -> Result<RunSettings> {
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
        edgemoe::quant::parallel::set_compute_threads(threads.unwrap_or_else(default_threads));
        let budget_bytes = self
            .budget
            .or(profile.as_ref().map(|p| p.budget_bytes))
            .unwrap_or(3 << 29);
        Ok(RunSettings {
            budget_bytes,
            kv_cache: self.kv_cache,
            cache: CacheOptions {
                policy: self
                    .policy
                    .or(profile.as_ref().map(|p| p.policy))
                    .unwrap_or_else(|| edgemoe::runtime::modes::default_policy(self.mode)),
                prefetch: !self.no_prefetch,
                prefetch_cap_bytes: self
                    .prefetch_cap
                    .or(profile.as_ref().map(|p| p.prefetch_cap_bytes)),
                predictor: self.predictor,
                buffer_experts: self.buffer_experts.map(|n| n as usize),
                trace: self.trace.clone(),
                storage: self.storage,
                storage_device: profile
                    .as_ref()
                    .map(|p| (p.read_bytes_per_s, p.read_latency)),
                queue_depth: profile.as_ref().map_or(1, |p| p.queue_depth),
                mode: self.mode,
                quantized_bundle: self.quantized.clone(),
                stand_in: self.stand_in,
            },
            profile,
            device,
        })
    }
}

/// A stand-in width: `int2`, `int4` or `int8` (or `2`, `4`, `8`).
pub fn parse_stand_in(text: &str) -> std::result::Result<QuantBits, String> {
    match ExpertEncoding::parse(text) {
        Some(ExpertEncoding::Quant(bits)) => Ok(bits),
        _ => Err(format!(
            "`{text}` is not a stand-in width: int2, int4 or int8"
        )),
    }
}

/// Checked before any work starts: every output of a run can be written (its directory exists
/// and is writable, it is no directory), and none overwrites an input or another output.
pub fn check_writes(outputs: &[(&str, &Path)], inputs: &[(&str, &Path)]) -> Result<()> {
    for &(name, path) in outputs {
        check_output_path(name, path)?;
    }
    refuse_overlaps(outputs, inputs)?;
    Ok(())
}

/// A built-in profile name, or the path of an existing file (read and validated later: a bad
/// file is an error in the file, not in the flag).
pub fn parse_profile(text: &str) -> std::result::Result<String, String> {
    if BUILT_IN.iter().any(|(name, _)| *name == text) || Path::new(text).exists() {
        return Ok(text.to_string());
    }
    let names: Vec<&str> = BUILT_IN.iter().map(|(name, _)| *name).collect();
    Err(format!(
        "unknown profile `{text}`: not a file, and not one of {}",
        names.join(", ")
    ))
}

/// An eviction policy a run can use: every policy but `belady`, which needs the future.
pub fn parse_online_policy(text: &str) -> std::result::Result<Policy, String> {
    match text.parse::<Policy>() {
        Ok(Policy::Belady) => {
            Err("policy `belady` needs the future: it is available in `edgemoe replay` only".into())
        }
        other => other,
    }
}

/// `cpu`, `cuda` or `cuda:N` (whether CUDA is there is checked when the run starts).
pub fn parse_device_name(text: &str) -> std::result::Result<String, String> {
    let cuda_index = text
        .strip_prefix("cuda:")
        .is_some_and(|n| n.parse::<usize>().is_ok());
    if text == "cpu" || text == "cuda" || cuda_index {
        Ok(text.to_string())
    } else {
        Err(format!(
            "unknown device `{text}` (expected cpu, cuda or cuda:N)"
        ))
    }
}

/// Compute threads: from 1 to the cores this process may use. More only wait for each other
/// (libtorch's OpenMP threads spin), and a huge count spawned tens of thousands of threads.
pub fn parse_threads(text: &str) -> std::result::Result<u16, String> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    match text.trim().parse::<u64>() {
        Ok(n) if n >= 1 && n <= cores as u64 => Ok(n as u16),
        Ok(n) => Err(format!(
            "{n} compute threads: expected 1 to the {cores} core(s) available here"
        )),
        Err(e) => Err(format!("`{text}` is not a thread count: {e}")),
    }
}

/// A positive count (`--limit`, buffer sizes in experts): 0 is refused.
pub fn parse_count(text: &str) -> std::result::Result<usize, String> {
    match text.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("`{text}` is not a count: {e}")),
    }
}

pub fn parse_budget(text: &str) -> std::result::Result<u64, String> {
    parse_bytes(text).map_err(|e| e.to_string())
}

pub fn parse_storage(text: &str) -> std::result::Result<StorageMode, String> {
    match text {
        "direct" => Ok(StorageMode::Direct),
        "cached" => Ok(StorageMode::Cached),
        "emulate" => Ok(StorageMode::Emulate),
        other => Err(format!(
            "unknown storage mode `{other}` (expected direct, cached or emulate)"
        )),
    }
}

pub fn parse_width(text: &str) -> std::result::Result<ExpertEncoding, String> {
    ExpertEncoding::parse(text).ok_or_else(|| {
        format!("unknown width `{text}` (expected 8, 4, 2, int8, int4, int2, f16, bf16 or f32)")
    })
}

/// A loss as `5%` or `0.05`.
pub fn parse_fraction(text: &str) -> std::result::Result<f64, String> {
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

/// Token ids given on the command line.
#[derive(Debug, Clone)]
pub struct Ids(pub Vec<i64>);

pub fn parse_ids(text: &str) -> std::result::Result<Ids, String> {
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

pub fn parse_temperature(text: &str) -> std::result::Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(t) if t > 0.0 && t.is_finite() => Ok(t),
        _ => Err(format!("temperature `{text}` must be a positive number")),
    }
}

pub fn parse_top_p(text: &str) -> std::result::Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(p) if p > 0.0 && p <= 1.0 => Ok(p),
        _ => Err(format!("top-p `{text}` must be in (0, 1]")),
    }
}
