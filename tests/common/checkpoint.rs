//! Copies of checkpoints and bundles that a test may damage or edit.

use std::path::{Path, PathBuf};

/// A copy of the (flat) directory `source` as `dir/<its name>`.
pub fn copy_dir(source: &Path, dir: &Path) -> PathBuf {
    let copy = dir.join(source.file_name().unwrap());
    std::fs::create_dir_all(&copy).unwrap();
    for entry in std::fs::read_dir(source).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), copy.join(entry.file_name())).unwrap();
    }
    copy
}

/// Replaces `from` with `to` in `hf/config.json`, which must contain `from`.
pub fn edit_config(hf: &Path, from: &str, to: &str) {
    let path = hf.join("config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains(from), "{from}");
    std::fs::write(&path, text.replace(from, to)).unwrap();
}

/// Rewrites the safetensors file `weights` without the tensor `gone`.
pub fn drop_tensor(weights: &Path, gone: &str) {
    let bytes = std::fs::read(weights).unwrap();
    let all = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<_> = all
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != gone)
        .collect();
    assert!(
        kept.len() < all.len(),
        "{gone} is not in {}",
        weights.display()
    );
    std::fs::write(weights, safetensors::serialize(kept, None).unwrap()).unwrap();
}

/// Flips one bit of expert `id`'s blob in `bundle`'s expert store (its checksum then fails).
pub fn flip_expert_byte(bundle: &Path, id: edgemoe::ids::ExpertId) {
    let path = bundle.join(edgemoe::bundle::EXPERTS_FILE);
    let spec = edgemoe::bundle::Bundle::open(bundle).unwrap().config.model;
    let store = edgemoe::store::ExpertStore::open(&path, &spec.expert_layout()).unwrap();
    let entry = store.entry(id).unwrap();
    let offset = entry.offset + entry.length / 2;
    drop(store);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[offset as usize] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
}

/// Asserts `message` mentions every `needle`.
pub fn assert_mentions(message: &str, needles: &[&str]) {
    for needle in needles {
        assert!(
            message.contains(needle),
            "expected `{needle}` in: {message}"
        );
    }
}
