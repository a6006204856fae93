//! `edgemoe replay`: a recorded expert-access trace through eviction policies and buffer sizes.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use edgemoe::cache::replay::{replay, ReplayResult};
use edgemoe::cache::trace::read_trace;
use edgemoe::cache::Policy;

use super::args::parse_count;

#[derive(Args, Debug)]
pub struct ReplayArgs {
    /// Trace written by `summarize --trace`.
    #[arg(long, value_name = "FILE")]
    trace: PathBuf,
    /// Buffer sizes in experts.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8,16,32,64", value_parser = parse_count)]
    slots: Vec<usize>,
    /// Policies to replay (`all` = every online policy and belady).
    #[arg(long, value_delimiter = ',', default_value = "all", value_parser = parse_replay_policy)]
    policy: Vec<String>,
    /// Ignore the trace's prefetch and cancel events (pure demand paging).
    #[arg(long)]
    demand_only: bool,
    /// Print JSON (policy → slots → hit ratio, hits, misses, each stack's hits and misses, and
    /// for an encoder-decoder trace the misses per document) instead of a table.
    #[arg(long)]
    json: bool,
    /// Draw hit ratio against buffer size per policy into an SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
}

/// `all` or a policy name.
fn parse_replay_policy(text: &str) -> std::result::Result<String, String> {
    if text != "all" {
        text.parse::<Policy>()?;
    }
    Ok(text.to_string())
}

pub fn run(args: ReplayArgs) -> Result<()> {
    if let Some(path) = &args.plot {
        edgemoe::io::check_output_path("--plot", path)?;
        edgemoe::atomic::refuse_overlap(("--plot", path), &[("--trace", &args.trace)])?;
    }
    let (header, events) = read_trace(&args.trace)?;
    let policies: Vec<Policy> = if args.policy.iter().any(|p| p == "all") {
        Policy::ONLINE
            .iter()
            .copied()
            .chain([Policy::Belady])
            .collect()
    } else {
        // Each policy once, in the order first named (its table row and JSON key are its name).
        let mut policies = Vec::new();
        for name in &args.policy {
            let policy = name.parse::<Policy>().map_err(anyhow::Error::msg)?;
            if !policies.contains(&policy) {
                policies.push(policy);
            }
        }
        policies
    };
    // More slots than the trace has distinct experts behave like exactly that many: such sizes
    // are replayed (and reported) as "all experts", once.
    let all_experts = edgemoe::cache::replay::distinct_experts(&events).max(1);
    let mut sizes: Vec<usize> = Vec::new();
    for &s in &args.slots {
        let s = s.min(all_experts);
        if !sizes.contains(&s) {
            sizes.push(s);
        }
    }
    let args = ReplayArgs {
        slots: sizes,
        ..args
    };
    let label = |slots: usize| {
        if slots == all_experts {
            format!("{slots} (all experts)")
        } else {
            format!("{slots} slots")
        }
    };
    // Per document, misses do not depend on how long the outputs are; hit ratios do (the
    // decoder's later steps mostly hit, BENCHMARKS.md §12.5).
    let documents = edgemoe::cache::replay::documents(&events);
    let per_document =
        |r: &ReplayResult| (documents > 0).then(|| r.misses as f64 / documents as f64);
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
    // Belady is the optimum of demand paging. Replayed with the trace's prefetches, the other
    // policies get hits that demand paging cannot, and can pass it: then it is no bound of
    // theirs, and is labelled for what it is.
    let prefetched = !args.demand_only
        && events
            .iter()
            .any(|e| e.kind == edgemoe::cache::AccessKind::Prefetch);
    let name = |policy: Policy| match policy {
        Policy::Belady if prefetched => "belady-demand-only",
        Policy::Belady => "belady (optimum)",
        other => other.name(),
    };
    if args.json {
        let mut by_policy = serde_json::Map::new();
        for r in &results {
            let entry = by_policy
                .entry(match r.policy {
                    Policy::Belady if prefetched => "belady-demand-only",
                    other => other.name(),
                })
                .or_insert_with(|| serde_json::Value::Object(Default::default()));
            let mut cell = serde_json::json!({
                "hit_ratio": r.hit_ratio, "hits": r.hits, "misses": r.misses,
                "encoder_hits": r.encoder.hits, "encoder_misses": r.encoder.misses,
                "decoder_hits": r.decoder.hits, "decoder_misses": r.decoder.misses,
            });
            if let Some(m) = per_document(r) {
                cell["misses_per_document"] = m.into();
            }
            entry[r.slots.to_string()] = cell;
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
        let table = |title: &str, cell: &dyn Fn(&ReplayResult) -> Option<String>| {
            print!("{title:<20}");
            for slots in &args.slots {
                print!("{:>9}", label(*slots));
            }
            println!();
            for &policy in &policies {
                print!("{:<20}", name(policy));
                for r in results.iter().filter(|r| r.policy == policy) {
                    print!("{:>9}", cell(r).unwrap_or_else(|| "-".into()));
                }
                println!();
            }
        };
        let percent = |x: Option<f64>| x.map(|x| format!("{:.1}%", 100.0 * x));
        table("hit ratio", &|r| percent(Some(r.hit_ratio)));
        // Where both stacks have accesses, what each policy's hits are made of: a policy can
        // keep the decoder's experts (decode stalls) at the encoder's expense (prompt stalls).
        if results
            .first()
            .is_some_and(|r| r.encoder.hit_ratio().is_some() && r.decoder.hit_ratio().is_some())
        {
            table("decoder hit ratio", &|r| percent(r.decoder.hit_ratio()));
            table("encoder hit ratio", &|r| percent(r.encoder.hit_ratio()));
        }
        table("demand misses", &|r| Some(r.misses.to_string()));
        if documents > 0 {
            table("misses / document", &|r| {
                per_document(r).map(|m| format!("{m:.1}"))
            });
        }
        if prefetched && policies.contains(&Policy::Belady) {
            println!(
                "belady-demand-only: Belady's optimum over the demand accesses alone (prefetches \
                 ignored), the bound of demand paging; the policies above replay the trace's \
                 prefetches too and may pass it (`--demand-only` compares like with like)"
            );
        }
    }
    if let Some(path) = &args.plot {
        let title = if prefetched {
            format!(
                "hit ratio vs buffer size ({demands} demand accesses, prefetches replayed; belady: demand paging only)"
            )
        } else {
            format!("hit ratio vs buffer size ({demands} demand accesses)")
        };
        edgemoe::bench::charts::hit_ratio_vs_slots(&results, &title, path)?;
    }
    Ok(())
}
