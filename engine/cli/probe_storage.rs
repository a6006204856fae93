//! `edgemoe probe-storage`: read throughput by read size and reads in flight, as a table or JSON;
//! with `--write-profile`, a device profile with the measured bandwidth, latency and queue depth.

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::Args;

use edgemoe::bench::probe::{
    measure, storage_figures, ProbeFile, IN_FLIGHT, MIN_PROBE_BYTES, READ_SIZES,
};
use edgemoe::config::profile::{derive_profile_toml, DeviceProfile};
use edgemoe::error::Error;
use edgemoe::units::format_bytes;

use super::args::parse_budget;

#[derive(Args, Debug)]
pub struct ProbeArgs {
    /// A large file to read, or a directory on the device to probe (a test file is written
    /// there and removed).
    path: PathBuf,
    /// Size of the test file written into a directory (at least 8MiB).
    #[arg(long, value_parser = parse_probe_size, default_value = "256MiB")]
    size: u64,
    /// Seconds per measurement, in (0, 60].
    #[arg(long, default_value_t = 0.5, value_parser = parse_seconds)]
    seconds: f64,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Write a device profile with the measured storage figures (bandwidth, latency, queue
    /// depth) to FILE, the rest taken from `--base`; pass it as `--profile FILE`.
    #[arg(long, value_name = "FILE")]
    write_profile: Option<PathBuf>,
    /// The profile (built-in name or TOML file) whose memory budget, threads, device, policy
    /// and prefetch cap the written profile keeps.
    #[arg(
        long,
        value_name = "NAME|FILE",
        default_value = "rpi5-sd",
        requires = "write_profile"
    )]
    base: String,
    /// The written profile's name (default: FILE's name without `.toml`).
    #[arg(long, requires = "write_profile")]
    name: Option<String>,
}

fn parse_probe_size(text: &str) -> std::result::Result<u64, String> {
    let size = parse_budget(text)?;
    if size < MIN_PROBE_BYTES {
        return Err(format!(
            "`{text}` is too small: the probe reads up to 4 MiB at a time and needs a file of at least {}",
            format_bytes(MIN_PROBE_BYTES)
        ));
    }
    Ok(size)
}

fn parse_seconds(text: &str) -> std::result::Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(s) if s > 0.0 && s <= 60.0 => Ok(s),
        _ => Err(format!("`{text}` must be a number of seconds in (0, 60]")),
    }
}

/// Fails unless the profile can go to `out` without losing anything: `out` is not in a model
/// bundle's directory, and is new, a stream, or a storage profile already (rewritten with new
/// figures).
fn refuse_to_replace(out: &Path) -> Result<()> {
    let dir = edgemoe::atomic::canonical(out)?
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    if edgemoe::bundle::looks_like_bundle(&dir) {
        return Err(Error::Input(format!(
            "--write-profile {}: lies inside the model bundle {}, which holds only the files `convert` writes; choose another --write-profile",
            out.display(),
            dir.display()
        ))
        .into());
    }
    if std::fs::metadata(out).is_ok_and(|m| m.is_file()) {
        let text = std::fs::read_to_string(out).unwrap_or_default();
        if DeviceProfile::parse(&text, out).is_err() {
            return Err(Error::Input(format!(
                "--write-profile {}: exists and is not a device profile; writing would replace it: choose another --write-profile",
                out.display()
            ))
            .into());
        }
    }
    Ok(())
}

pub fn run(args: ProbeArgs) -> Result<()> {
    if let Some(out) = &args.write_profile {
        edgemoe::io::check_output_path("--write-profile", out)?;
        // Never over what is read: the probed file, or the base profile's file.
        let mut inputs: Vec<(&str, &Path)> = Vec::new();
        if args.path.is_file() {
            inputs.push(("PATH", &args.path));
        }
        let base = Path::new(&args.base);
        if base.is_file() {
            inputs.push(("--base", base));
        }
        edgemoe::atomic::refuse_overlap(("--write-profile", out), &inputs)?;
        refuse_to_replace(out)?;
        // A bad base is found before the probe runs.
        DeviceProfile::load(&args.base)?;
    }
    let file = ProbeFile::prepare(&args.path, args.size)?;
    let duration = std::time::Duration::from_secs_f64(args.seconds);
    let mut results = Vec::new();
    for &size in &READ_SIZES {
        for &depth in &IN_FLIGHT {
            results.push(measure(&file, size, depth, duration)?);
        }
    }
    if let Some(out) = &args.write_profile {
        let measured = storage_figures(&results)
            .ok_or_else(|| anyhow::anyhow!("the probe measured nothing"))?;
        let name = args.name.clone().unwrap_or_else(|| {
            out.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "my-board".into())
        });
        let text = derive_profile_toml(&args.base, &name, &measured)?;
        edgemoe::atomic::write_file(out, text.as_bytes())?;
        eprintln!(
            "wrote {}: {}/s, {:.0} µs per read, {} read(s) in flight (pass --profile {})",
            out.display(),
            format_bytes(measured.read_bytes_per_s as u64),
            measured.read_latency_us,
            measured.queue_depth,
            out.display()
        );
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
    println!("profile hint: storage_read_bandwidth = the 4 MiB row's best; storage_read_latency_us = the 4 KiB QD1 figure; storage_queue_depth = the reads in flight past which the 1 MiB row gains under 10% (--write-profile FILE writes them)");
    Ok(())
}
