//! `edgemoe inspect`: a bundle's shape, sizes on disk and in memory, and expert widths; with
//! `--verify`, every file of the bundle against its manifest and every expert blob against its
//! checksum, one line per file, failing if any is damaged.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use edgemoe::bundle::{Bundle, Outcome, EXPERTS_FILE, RESIDENT_FILE};
use edgemoe::units::format_bytes;
use edgemoe::Error;

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// Model bundle directory.
    bundle: PathBuf,
    /// Read every file of the bundle and check it against its checksum (every expert blob
    /// included); print OK or BAD per file and fail if any is BAD.
    #[arg(long)]
    verify: bool,
}

pub fn run(args: InspectArgs) -> Result<()> {
    if args.verify {
        return verify(&args.bundle);
    }
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
        "resident      {} matrices, {} in memory, {} on disk ({RESIDENT_FILE})",
        bundle.config.resident_width,
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

fn verify(dir: &std::path::Path) -> Result<()> {
    let checks = edgemoe::bundle::verify(dir)?;
    let mut bad = 0;
    for check in &checks {
        match &check.outcome {
            Outcome::Ok(what) => println!("OK   {}: {what}", check.name),
            Outcome::Unchecked(why) => println!("SKIP {}: {why}", check.name),
            Outcome::Bad(why) => {
                bad += 1;
                // The error names the file.
                println!("BAD  {why}");
            }
        }
    }
    if bad > 0 {
        return Err(Error::corrupt(dir, None, format!("{bad} of the checks above failed")).into());
    }
    Ok(())
}
