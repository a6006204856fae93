//! `convert`: a Hugging Face Switch Transformers checkpoint (`config.json`, `model.safetensors`
//! or sharded safetensors with their index, f32/f16/bf16, `tokenizer.json`) → a model bundle.
//!
//! Every tensor of the checkpoint must be accounted for: resident, expert, or a known copy of
//! `shared.weight`. A tensor the engine would not use means the config and the weights disagree,
//! and is reported rather than ignored.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use safetensors::tensor::TensorView;

use crate::bit_plan::BitPlan;
use crate::bundle::{CONFIG_FILE, EXPERTS_FILE, RESIDENT_FILE, TOKENIZER_FILE};
use crate::config::{
    read_json, BundleConfig, GenerationDefaults, HfGenerationConfig, HfSwitchConfig, ModelSpec,
    ARCHITECTURE_SWITCH, BUNDLE_FORMAT_VERSION,
};
use crate::error::{Error, Result};
use crate::expert_store::{layout_expert, ExpertEncoding, ExpertStoreWriter};
use crate::model::switch::{all_experts, expert_tensor_name, redundant_tensors, resident_tensors};
use crate::tokenizer::Tokenizer;
use crate::weights::{TensorBytes, WeightDtype, WeightFiles};

pub struct ConvertOptions {
    pub hf_dir: PathBuf,
    pub out_dir: PathBuf,
    /// Tokenizer to bundle when the checkpoint directory has no `tokenizer.json`.
    pub tokenizer: Option<PathBuf>,
    /// Stored width of each expert (empty: the checkpoint's dtype). Non-expert weights are
    /// never quantized.
    pub bits: BitPlan,
    pub show_progress: bool,
}

#[derive(Debug, Clone)]
pub struct ConvertReport {
    pub spec: ModelSpec,
    pub experts: usize,
    pub resident_file_bytes: u64,
    pub expert_store_bytes: u64,
}

/// Reads and validates a Hugging Face directory's config files.
pub fn read_hf_config(hf_dir: &Path) -> Result<BundleConfig> {
    let config_path = hf_dir.join("config.json");
    let hf: HfSwitchConfig = read_json(&config_path)?;
    let spec = ModelSpec::from_hf(&hf, &config_path)?;
    let generation_path = hf_dir.join("generation_config.json");
    let generation: HfGenerationConfig = if generation_path.exists() {
        read_json(&generation_path)?
    } else {
        HfGenerationConfig::default()
    };
    let generation = GenerationDefaults::from_hf(&hf, &generation, &generation_path)?;
    Ok(BundleConfig {
        format_version: BUNDLE_FORMAT_VERSION,
        architecture: ARCHITECTURE_SWITCH.into(),
        model: spec,
        generation,
        source_dtype: String::new(),
    })
}

pub fn convert(options: &ConvertOptions) -> Result<ConvertReport> {
    let hf_dir = &options.hf_dir;
    if !hf_dir.is_dir() {
        return Err(Error::io(
            hf_dir,
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "Hugging Face checkpoint directory not found",
            ),
        ));
    }
    let mut config = read_hf_config(hf_dir)?;
    let tokenizer_path = options
        .tokenizer
        .clone()
        .unwrap_or_else(|| hf_dir.join("tokenizer.json"));
    Tokenizer::load(&tokenizer_path)?;
    let files = WeightFiles::open_hf_dir(hf_dir)?;
    // Untied transformers 5.x checkpoints give each stack its own embedding table.
    let untied = !config.model.tie_word_embeddings;
    config.model.separate_encoder_embeddings =
        untied && files.contains("encoder.embed_tokens.weight");
    config.model.separate_decoder_embeddings =
        untied && files.contains("decoder.embed_tokens.weight");
    let spec = config.model.clone();

    let resident = resident_tensors(&spec);
    let experts = all_experts(&spec);
    let mut expected: HashSet<String> = resident.iter().map(|(n, _)| n.clone()).collect();
    for &id in &experts {
        for m in ["wi", "wo"] {
            expected.insert(expert_tensor_name(id, m));
        }
    }
    let redundant: HashSet<String> = redundant_tensors(&spec).into_iter().collect();
    let mut unexpected: Vec<&str> = files
        .names()
        .filter(|n| !expected.contains(*n) && !redundant.contains(*n))
        .collect();
    unexpected.sort();
    if let Some(name) = unexpected.first() {
        return Err(Error::tensor(
            files.describe(),
            *name,
            format!(
                "not part of the model described by config.json ({} unexpected tensors); the config and the weights disagree",
                unexpected.len()
            ),
        ));
    }

    std::fs::create_dir_all(&options.out_dir).map_err(|e| Error::io(&options.out_dir, e))?;
    // A bundle is valid only once config.json is written (last), so remove a stale one first.
    let config_out = options.out_dir.join(CONFIG_FILE);
    if config_out.exists() {
        std::fs::remove_file(&config_out).map_err(|e| Error::io(&config_out, e))?;
    }

    let progress = if options.show_progress {
        ProgressBar::new((resident.len() + experts.len()) as u64)
    } else {
        ProgressBar::hidden()
    };
    progress.set_style(
        ProgressStyle::with_template("{msg:>10} [{bar:40}] {pos}/{len} tensors ({eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );

    // Resident weights keep their source dtype; they are widened to f32 when loaded.
    progress.set_message("resident");
    let resident_path = options.out_dir.join(RESIDENT_FILE);
    let mut views = Vec::with_capacity(resident.len());
    for (name, shape) in &resident {
        let t = files.get(name, shape)?;
        let view = TensorView::new(t.dtype.to_safetensors(), shape.clone(), t.data)
            .map_err(|e| Error::tensor(t.path, name, e.to_string()))?;
        views.push((name.clone(), view));
        progress.inc(1);
    }
    config.source_dtype = files
        .get("shared.weight", &resident[0].1)?
        .dtype
        .name()
        .into();
    safetensors::tensor::serialize_to_file(views, None, &resident_path)
        .map_err(|e| Error::format(&resident_path, format!("cannot write: {e}")))?;

    // Experts: one blob each, at the plan's width, else in their source dtype (f32 if wi and
    // wo disagree).
    progress.set_message("experts");
    let mut plan = Vec::with_capacity(experts.len());
    for &id in &experts {
        let (wi, wo) = expert_tensors(&files, &spec, id)?;
        let source = if wi.dtype == wo.dtype {
            wi.dtype
        } else {
            WeightDtype::F32
        };
        let encoding = options
            .bits
            .encoding(id)
            .unwrap_or(ExpertEncoding::Float(source));
        plan.push((id, encoding));
    }
    if let Some(unknown) = options.bits.experts.keys().find(|id| !experts.contains(id)) {
        return Err(Error::Input(format!(
            "the bit plan names {unknown}, which this model does not have"
        )));
    }
    let store_path = options.out_dir.join(EXPERTS_FILE);
    let mut writer = ExpertStoreWriter::create(&store_path, &spec, &plan)?;
    for &(id, encoding) in &plan {
        let (wi, wo) = expert_tensors(&files, &spec, id)?;
        let (matrices, length) = layout_expert(&spec, encoding);
        let mut blob = vec![0u8; length as usize];
        for (m, t) in matrices.iter().zip([&wi, &wo]) {
            let (bytes, scales) = stored_bytes(t, encoding)?;
            blob[m.offset as usize..(m.offset + m.bytes) as usize].copy_from_slice(&bytes);
            let at = m.scales_offset as usize;
            for (i, s) in scales.iter().enumerate() {
                blob[at + 4 * i..at + 4 * i + 4].copy_from_slice(&s.to_le_bytes());
            }
        }
        writer.write_next(&blob)?;
        progress.inc(1);
    }
    writer.finish()?;

    let tokenizer_out = options.out_dir.join(TOKENIZER_FILE);
    std::fs::copy(&tokenizer_path, &tokenizer_out).map_err(|e| Error::io(&tokenizer_out, e))?;
    let json = serde_json::to_string_pretty(&config).expect("config serializes");
    std::fs::write(&config_out, json + "\n").map_err(|e| Error::io(&config_out, e))?;
    progress.finish_and_clear();

    let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    Ok(ConvertReport {
        spec,
        experts: experts.len(),
        resident_file_bytes: size(&resident_path),
        expert_store_bytes: size(&store_path),
    })
}

fn expert_tensors<'a>(
    files: &'a WeightFiles,
    spec: &ModelSpec,
    id: crate::expert_store::ExpertId,
) -> Result<(TensorBytes<'a>, TensorBytes<'a>)> {
    Ok((
        files.get(&expert_tensor_name(id, "wi"), &[spec.d_ff, spec.d_model])?,
        files.get(&expert_tensor_name(id, "wo"), &[spec.d_model, spec.d_ff])?,
    ))
}

/// A matrix's bytes in the store's encoding, and its per-row scales (quantized encodings).
fn stored_bytes(t: &TensorBytes<'_>, encoding: ExpertEncoding) -> Result<(Vec<u8>, Vec<f32>)> {
    match encoding {
        ExpertEncoding::Float(dtype) if dtype == t.dtype => Ok((t.data.to_vec(), Vec::new())),
        ExpertEncoding::Float(dtype) => {
            let converted = t.to_f32_tensor()?.f_to_kind(dtype.kind())?;
            let mut bytes = vec![0u8; converted.numel() * dtype.size_bytes()];
            converted.f_copy_data_u8(&mut bytes, converted.numel())?;
            Ok((bytes, Vec::new()))
        }
        ExpertEncoding::Quant(bits) => {
            let weights = Vec::<f32>::try_from(t.to_f32_tensor()?.f_flatten(0, -1)?)?;
            let (rows, cols) = (t.shape[0], t.shape[1]);
            crate::quant::quantize(&weights, rows, cols, bits)
                .map_err(|e| Error::tensor(t.path, t.name, e.to_string()))
        }
    }
}

/// Writes a copy of bundle `source` into `out` with its experts re-encoded by `bits`
/// (decoded to f32 and quantized again; non-expert files copied as they are).
pub fn requantize_bundle(source: &Path, out: &Path, bits: &BitPlan) -> Result<()> {
    use crate::bundle::Bundle;
    let bundle = Bundle::open(source)?;
    let spec = bundle.config.model.clone();
    let store = bundle.open_store()?;
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let config_out = out.join(CONFIG_FILE);
    if config_out.exists() {
        std::fs::remove_file(&config_out).map_err(|e| Error::io(&config_out, e))?;
    }
    let plan: Vec<_> = store
        .index()
        .experts
        .iter()
        .map(|e| (e.id, bits.encoding(e.id).unwrap_or(e.encoding)))
        .collect();
    let store_path = out.join(EXPERTS_FILE);
    let mut writer = ExpertStoreWriter::create(&store_path, &spec, &plan)?;
    let mut slot = crate::provider::AlignedBuf::new(store.max_padded_expert_bytes() as usize);
    let mut wi = tch::Tensor::zeros(
        [spec.d_ff as i64, spec.d_model as i64],
        (tch::Kind::Float, tch::Device::Cpu),
    );
    let mut wo = tch::Tensor::zeros(
        [spec.d_model as i64, spec.d_ff as i64],
        (tch::Kind::Float, tch::Device::Cpu),
    );
    for &(id, encoding) in &plan {
        let entry = store.entry(id).expect("listed by the store").clone();
        store.read_expert(id, slot.as_mut_slice())?;
        crate::provider::decode_expert(&entry, slot.as_slice(), &mut wi, &mut wo)?;
        let (matrices, length) = layout_expert(&spec, encoding);
        let mut blob = vec![0u8; length as usize];
        for (m, t) in matrices.iter().zip([&wi, &wo]) {
            let values = Vec::<f32>::try_from(t.f_flatten(0, -1)?)?;
            let bytes = values
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>();
            let view = TensorBytes {
                name: &m.name,
                path: &store_path,
                dtype: WeightDtype::F32,
                shape: &[m.rows as usize, m.cols as usize],
                data: &bytes,
            };
            let (packed, scales) = stored_bytes(&view, encoding)?;
            blob[m.offset as usize..(m.offset + m.bytes) as usize].copy_from_slice(&packed);
            let at = m.scales_offset as usize;
            for (i, s) in scales.iter().enumerate() {
                blob[at + 4 * i..at + 4 * i + 4].copy_from_slice(&s.to_le_bytes());
            }
        }
        writer.write_next(&blob)?;
    }
    writer.finish()?;
    for file in [RESIDENT_FILE, TOKENIZER_FILE, crate::paths::PATHS_FILE] {
        let from = source.join(file);
        if from.exists() {
            let to = out.join(file);
            std::fs::copy(&from, &to).map_err(|e| Error::io(&to, e))?;
        }
    }
    let json = serde_json::to_string_pretty(&bundle.config).expect("config serializes");
    std::fs::write(&config_out, json + "\n").map_err(|e| Error::io(&config_out, e))
}
