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

/// Rewrites the safetensors file `weights` with element 0 of tensor `name` set to NaN.
pub fn poison_tensor(weights: &Path, name: &str) {
    let changed = edit_tensors(weights, &|n, dtype, data| {
        if n != name {
            return false;
        }
        let nan: &[u8] = match dtype {
            safetensors::Dtype::F32 => &f32::NAN.to_le_bytes(),
            safetensors::Dtype::F16 => &[0x00, 0x7e],
            safetensors::Dtype::BF16 => &[0xc0, 0x7f],
            other => panic!("{name}: dtype {other:?}"),
        };
        data[..nan.len()].copy_from_slice(nan);
        true
    });
    assert_eq!(changed, 1, "{name} is not in {}", weights.display());
}

/// Rewrites the safetensors file `weights`, letting `edit` change any tensor's bytes (given its
/// name and dtype); returns how many it changed.
pub fn edit_tensors(
    weights: &Path,
    edit: &dyn Fn(&str, safetensors::Dtype, &mut [u8]) -> bool,
) -> usize {
    let bytes = std::fs::read(weights).unwrap();
    let all = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut changed = 0;
    let owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = all
        .tensors()
        .into_iter()
        .map(|(n, t)| {
            let mut data = t.data().to_vec();
            if edit(&n, t.dtype(), &mut data) {
                changed += 1;
            }
            (n, t.dtype(), t.shape().to_vec(), data)
        })
        .collect();
    let views: Vec<_> = owned
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(weights, safetensors::serialize(views, None).unwrap()).unwrap();
    changed
}

/// Flips the lowest bit of the byte in the middle of `file`.
pub fn flip_middle_byte(file: &Path) {
    let mut bytes = std::fs::read(file).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 1;
    std::fs::write(file, bytes).unwrap();
}

/// SHA-256 of every file under `dir` (recursively, by path relative to it): equal snapshots
/// mean nothing under `dir` changed.
pub fn snapshot(dir: &Path) -> std::collections::BTreeMap<PathBuf, [u8; 32]> {
    use sha2::Digest;
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let digest = sha2::Sha256::digest(std::fs::read(&path).unwrap());
                out.insert(path.strip_prefix(dir).unwrap().to_path_buf(), digest.into());
            }
        }
    }
    out
}

/// Records file `name` of `bundle` in its manifest as it is now: a test that edits a bundle
/// file to reach a check behind the checksums (a loader's, a cross-check) makes the edit look
/// like what `convert` wrote.
pub fn reseal(bundle: &Path, name: &str) {
    let mut manifest = edgemoe::manifest::Manifest::load(bundle).unwrap().unwrap();
    manifest.record(bundle, name).unwrap();
    manifest.save(bundle).unwrap();
}
