//! `edgemoe inspect`: a bundle's shape, sizes on disk and in memory, and expert widths.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use edgemoe::bundle::{Bundle, EXPERTS_FILE, RESIDENT_FILE};
use edgemoe::units::format_bytes;

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// Model bundle directory.
    bundle: PathBuf,
}

pub fn run(args: InspectArgs) -> Result<()> {
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
