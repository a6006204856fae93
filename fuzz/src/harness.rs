//! One function per parser of edgemoe's inputs, each taking arbitrary bytes and running them
//! through the parser and what consumes its result, the way the engine would. None may panic,
//! hang or allocate without bound, whatever the bytes: an error is the right answer to a bad
//! input. The AFL++ targets (`src/bin/*.rs`) call these; the engine's `tests/fuzz_corpus.rs`
//! includes this file and replays the committed corpus and every regression input through them.
//!
//! Parsers that read files get the bytes written to a scratch file (in `/dev/shm` where it
//! exists), one per process and thread.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use edgemoe::cache::replay::{distinct_experts, replay};
use edgemoe::cache::trace::read_trace;
use edgemoe::cache::Policy;
use edgemoe::config::profile::DeviceProfile;
use edgemoe::config::{BundleConfig, ModelSpec};
use edgemoe::dictionary::PathDictionary;
use edgemoe::generation::input::{json_records, parse_documents};
use edgemoe::ids::{ExpertId, Stack};
use edgemoe::manifest::{Manifest, MANIFEST_FILE};
use edgemoe::model::Model;
use edgemoe::offline::eval::parse_examples;
use edgemoe::store::format::HEADER_BYTES;
use edgemoe::store::{ExpertLayout, ExpertStore};
use edgemoe::weights::WeightFiles;

/// The bundle configs the safetensors target loads weights for (written by `convert` from the
/// tiny Switch and Mixtral fixtures).
const SPECS: [&str; 2] = [
    include_str!("../specs/tiny-tied-e4.json"),
    include_str!("../specs/tiny-mixtral.json"),
];

/// Work done once per process, before the fuzzing loop (AFL++ forks after it).
pub fn init() {
    specs();
    tch::set_num_threads(1);
}

fn specs() -> &'static [ModelSpec] {
    static SPECS_PARSED: OnceLock<Vec<ModelSpec>> = OnceLock::new();
    SPECS_PARSED.get_or_init(|| {
        SPECS
            .iter()
            .map(|text| {
                let path = scratch("spec.json");
                std::fs::write(&path, text).expect("scratch file");
                BundleConfig::load(&path).expect("a fixture's config").model
            })
            .collect()
    })
}

/// A scratch file named `name` for this process and thread.
pub fn scratch(name: &str) -> PathBuf {
    thread_local! {
        static DIR: PathBuf = {
            let base = if Path::new("/dev/shm").is_dir() {
                PathBuf::from("/dev/shm")
            } else {
                std::env::temp_dir()
            };
            let dir = base.join(format!(
                "edgemoe-fuzz-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ).replace(['(', ')'], ""));
            std::fs::create_dir_all(&dir).expect("scratch directory");
            dir
        };
    }
    DIR.with(|dir| dir.join(name))
}

fn write_scratch(name: &str, data: &[u8]) -> PathBuf {
    let path = scratch(name);
    std::fs::write(&path, data).expect("scratch file");
    path
}

/// The expert layout the store target checks against: two SwiGLU-shaped decoder experts of
/// layer 1 (as in the store's unit tests), so a small file is a valid store.
pub fn store_layout() -> ExpertLayout {
    ExpertLayout {
        matrices: vec![("wi", 4, 8), ("wo", 8, 4)],
        experts: (0..2)
            .map(|expert| ExpertId {
                stack: Stack::Decoder,
                layer: 1,
                expert,
            })
            .collect(),
    }
}

/// `experts.bin`: header, index, blobs, and every expert read back (checksums verified). When
/// bit 0 of the reserved byte 12 is set, the header's index checksum is recomputed first, so
/// mutations of the index reach its decoder and the layout checks instead of stopping at the
/// checksum.
pub fn store(data: &[u8]) {
    let mut bytes = data.to_vec();
    if bytes.len() >= HEADER_BYTES && bytes[12] & 1 == 1 {
        let claimed = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
        let end = usize::try_from(claimed)
            .ok()
            .and_then(|len| HEADER_BYTES.checked_add(len))
            .filter(|&end| end <= bytes.len());
        if let Some(end) = end {
            let crc = crc32fast::hash(&bytes[HEADER_BYTES..end]);
            bytes[24..28].copy_from_slice(&crc.to_le_bytes());
        }
    }
    let path = write_scratch("experts.bin", &bytes);
    let Ok(store) = ExpertStore::open(&path, &store_layout()) else {
        return;
    };
    let _ = store.total_expert_bytes();
    let mut slot = vec![0u8; store.max_padded_expert_bytes() as usize];
    let ids: Vec<ExpertId> = store.index().experts.iter().map(|e| e.id).collect();
    for id in ids {
        let _ = store.read_expert(id, &mut slot);
    }
}

/// `paths.bin`: the path dictionary, then what the predictor and the policy's seeds ask of it
/// (frequencies, pass shares and predictions for the first layers of each stack, path coverage,
/// token count).
pub fn paths(data: &[u8]) {
    let path = write_scratch("paths.bin", data);
    let Ok(dict) = PathDictionary::load(&path) else {
        return;
    };
    for stack in [Stack::Encoder, Stack::Decoder] {
        let paths = dict.stack(stack);
        let _ = paths.tokens();
        let _ = paths.top_path_coverage(0.1);
        let layers = paths.num_layers.min(8);
        let history: Vec<u16> = (0..layers * paths.top_k.min(8))
            .map(|i| (i % paths.num_experts.max(1)) as u16)
            .collect();
        for layer in 0..=layers {
            let _ = paths.frequencies(layer);
            let _ = paths.pass_shares(layer);
            if history.len() >= layer * paths.top_k {
                let _ = paths.predict(layer, &history);
            }
        }
    }
}

/// A device profile (TOML), as `--profile FILE` reads it.
pub fn profile(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = DeviceProfile::parse(text, Path::new("fuzz.toml"));
    }
}

/// An access trace (JSON lines), then `replay` of it through every policy at a few sizes, with
/// and without its prefetch events (traces of at most 2,000 events: replay is linear in the
/// trace, and the fuzzer's inputs are short).
pub fn trace(data: &[u8]) {
    let path = write_scratch("trace.jsonl", data);
    let Ok((header, events)) = read_trace(&path) else {
        return;
    };
    let distinct = distinct_experts(&events);
    if events.len() > 2_000 {
        return;
    }
    for policy in Policy::ONLINE.iter().copied().chain([Policy::Belady]) {
        for slots in [1, 2, 3, distinct.max(1)] {
            for demand_only in [false, true] {
                let _ = replay(&header, &events, policy, slots, demand_only);
            }
        }
    }
}

/// A bundle's `config.json`, then what opening a bundle derives from it: the expert layout,
/// every expert id, the layer map, the description `inspect` prints.
pub fn config(data: &[u8]) {
    let path = write_scratch("config.json", data);
    let Ok(config) = BundleConfig::load(&path) else {
        return;
    };
    let spec = &config.model;
    let _ = spec.describe();
    let _ = config.describe_generation();
    let _ = spec.expert_layout();
    let _ = spec.all_experts();
    let _ = spec.layer_map();
    let _ = spec.expert_params();
    for stack in [Stack::Encoder, Stack::Decoder] {
        let _ = spec.moe_blocks(stack);
    }
}

/// `resident.safetensors`: the header through the loader, every tensor's bytes checked against
/// its own shape, then the resident weights of the tiny Switch and Mixtral models loaded from it
/// (names, shapes, dtypes and INT8 scales checked as a bundle's are).
pub fn safetensors(data: &[u8]) {
    let path = write_scratch("resident.safetensors", data);
    let Ok(files) = WeightFiles::open_file(&path) else {
        return;
    };
    let names: Vec<String> = files.names().take(64).map(str::to_string).collect();
    for name in &names {
        if let Ok(tensor) = files.get(name, &[]) {
            let _ = tensor.data.len();
        }
    }
    for spec in specs() {
        let _ = Model::load(spec, &files, tch::Device::Cpu);
    }
}

/// A bundle's `manifest.json`, then what opening and `inspect --verify` do with it: every
/// listed file's length checked, every listed file's sum compared. The manifest's own CRC is
/// recomputed first when the input parses as a manifest (a crafted file carries a correct one;
/// the checksum is no signature), so mutated names and sums reach the checks after it.
pub fn manifest(data: &[u8]) {
    let dir = scratch("bundle");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch bundle");
    std::fs::write(dir.join("config.json"), b"{}").expect("scratch file");
    match std::str::from_utf8(data)
        .ok()
        .and_then(|t| serde_json::from_str::<Manifest>(t).ok())
    {
        Some(parsed) if data.first() != Some(&b' ') => {
            if parsed.save(&dir).is_err() {
                return;
            }
        }
        _ => std::fs::write(dir.join(MANIFEST_FILE), data).expect("scratch file"),
    }
    let Ok(Some(manifest)) = Manifest::load(&dir) else {
        return;
    };
    let _ = manifest.check_lengths(&dir, &[]);
    for name in manifest.files.keys().take(64) {
        let _ = manifest.check_file(&dir, name);
        let _ = manifest.check_bytes(&dir, name, b"{}");
    }
}

/// A bundle's `tokenizer.json` through the `tokenizers` crate, then what the engine asks of it:
/// encoding (bounded, whole, and a prompt's last tokens) and decoding, ids in and out of range.
pub fn tokenizer(data: &[u8]) {
    let path = scratch("tokenizer.json");
    let Ok(tokenizer) = edgemoe::tokenizer::Tokenizer::from_bytes(&path, data) else {
        return;
    };
    let text = "Maya: did you see the 3 cats?\r\nTom: yes! ünïcödé and emoji 🙂";
    let _ = tokenizer.encode(text, 16);
    let _ = tokenizer.encode_all(text);
    let _ = tokenizer.encode_last(text, 8);
    let _ = tokenizer.decode(&[0, 1, 2, 3, 31, 255, 5000, -1, i64::MAX]);
}

/// Input documents and examples: JSON lines, a JSON array, or plain text, as `summarize`,
/// `eval`, `calibrate` and `tune-bits` read them.
pub fn jsonl(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = json_records(text, "fuzz");
    let _ = parse_documents(text, "fuzz");
    let _ = parse_examples(text, "fuzz", None);
    let _ = parse_examples(text, "fuzz", Some(1));
}
