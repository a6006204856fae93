//! `convert`: a Hugging Face checkpoint (`config.json`, `model.safetensors` or sharded
//! safetensors with their index, f32/f16/bf16, `tokenizer.json`) → a model bundle. Switch
//! Transformers and the decoder-only families Mixtral, Qwen2-MoE and OLMoE.
//!
//! Every tensor of the checkpoint must be accounted for: resident, expert, or a known redundant
//! copy (tied heads, RoPE tables). A tensor the engine would not use means the config and the
//! weights disagree, and is reported rather than ignored.
//!
//! Decoder-only experts are read from either layout transformers 5.x produces: one tensor per
//! expert and matrix (what `save_pretrained` writes by default: Mixtral's
//! `block_sparse_moe.experts.{e}.w1/w2/w3`, the others' `mlp.experts.{e}.{gate,up,down}_proj`),
//! or the fused `mlp.experts.gate_up_proj` `[E, 2·d_ff, d]` + `down_proj` `[E, d, d_ff]` of
//! its in-memory modules (`save_original_format=False`), sliced per expert. Either way each
//! expert becomes one blob `gate`, `up`, `down`. Resident tensors are renamed to 5.x's
//! in-memory names (Mixtral's router `block_sparse_moe.gate` → `mlp.gate`).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use safetensors::tensor::TensorView;
use tch::Tensor;

use crate::atomic::StagedDir;
use crate::bundle::{
    Bundle, BUNDLE_FILES, CONFIG_FILE, EXPERTS_FILE, RESIDENT_FILE, TOKENIZER_FILE,
};
use crate::config::{
    BundleConfig, DecoderFamily, DecoderSpec, GenerationDefaults, HfDecoderConfig,
    HfGenerationConfig, HfSwitchConfig, ModelSpec, SwitchSpec, TokenIdSources, ARCHITECTURE_SWITCH,
    BUNDLE_FORMAT_VERSION,
};
use crate::dictionary::PATHS_FILE;
use crate::error::{Error, Result};
use crate::ids::{ExpertId, Stack};
use crate::io::{read_bytes, read_json};
use crate::manifest::{Manifest, MANIFEST_FILE};
use crate::model::decoder_only;
use crate::model::switch;
use crate::offline::bit_plan::BitPlan;
use crate::quant::QuantBits;
use crate::store::{ExpertEncoding, ExpertStoreWriter};
use crate::tokenizer::Tokenizer;
use crate::weights::{matrix_scales_name, TensorBytes, WeightDtype, WeightFiles};

pub struct ConvertOptions {
    pub hf_dir: PathBuf,
    pub out_dir: PathBuf,
    /// Tokenizer to bundle when the checkpoint directory has no `tokenizer.json`.
    pub tokenizer: Option<PathBuf>,
    /// Stored width of each expert (empty: the checkpoint's dtype). Non-expert weights are
    /// never quantized.
    pub bits: BitPlan,
    /// Width of the resident (non-expert) matrices.
    pub resident: ResidentWidth,
    /// Replace `out_dir` even when it holds something that is not a bundle.
    pub force: bool,
    pub show_progress: bool,
}

/// Width of a bundle's resident (non-expert) matrices: embeddings, attention projections,
/// dense FFNs, routers, the LM head. Vectors (norms, biases) stay f32 whatever the width, and
/// T5's relative-position table (looked up, never multiplied) is f32 at `int8` and `int4`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ResidentWidth {
    /// The parity reference: widened from the checkpoint's dtype, computed by libtorch.
    #[default]
    F32,
    F16,
    Bf16,
    /// Channel-wise symmetric INT8 (one f32 scale per output row, in `{name}.scales`).
    Int8,
    /// Channel-wise symmetric INT4, two codes a byte as experts pack them (stored as U8
    /// `[rows, ⌈cols / 2⌉]`, scales as for INT8): llama.cpp's `Q4_0` width for the whole model,
    /// and where resident weights start to cost accuracy (BENCHMARKS §9.4).
    Int4,
}

impl ResidentWidth {
    pub const ALL: [ResidentWidth; 5] = [
        ResidentWidth::F32,
        ResidentWidth::F16,
        ResidentWidth::Bf16,
        ResidentWidth::Int8,
        ResidentWidth::Int4,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ResidentWidth::F32 => "f32",
            ResidentWidth::F16 => "f16",
            ResidentWidth::Bf16 => "bf16",
            ResidentWidth::Int8 => "int8",
            ResidentWidth::Int4 => "int4",
        }
    }

    /// The integer width of a quantized resident width.
    fn quant_bits(self) -> Option<QuantBits> {
        match self {
            ResidentWidth::Int8 => Some(QuantBits::Int8),
            ResidentWidth::Int4 => Some(QuantBits::Int4),
            _ => None,
        }
    }
}

impl std::str::FromStr for ResidentWidth {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        ResidentWidth::ALL
            .into_iter()
            .find(|w| w.name() == s)
            .ok_or_else(|| {
                format!("unknown resident width `{s}` (expected f32, f16, bf16, int8 or int4)")
            })
    }
}

/// One tensor of the resident file, owned.
struct ResidentTensor {
    name: String,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// `t` (stored as `name`) at `width`: matrices at the width (INT8 and INT4 add a scales
/// tensor), vectors as f32.
fn resident_at_width(
    name: &str,
    t: &TensorBytes<'_>,
    width: ResidentWidth,
) -> Result<Vec<ResidentTensor>> {
    let shape = t.shape.to_vec();
    let values = t.to_f32_tensor()?;
    let values = Vec::<f32>::try_from(values.f_flatten(0, -1)?)?;
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(Error::tensor(
            t.path,
            t.name,
            format!("element {i} is {}: the checkpoint is corrupt", values[i]),
        ));
    }
    let is_matrix = shape.len() == 2
        && !(width.quant_bits().is_some() && name.ends_with("relative_attention_bias.weight"));
    let one = |dtype, data| {
        Ok(vec![ResidentTensor {
            name: name.to_string(),
            dtype,
            shape: shape.clone(),
            data,
        }])
    };
    use safetensors::Dtype;
    match (width, is_matrix) {
        (ResidentWidth::F32, _) | (_, false) => one(
            Dtype::F32,
            values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        (ResidentWidth::F16, true) => one(
            Dtype::F16,
            values
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                .collect(),
        ),
        (ResidentWidth::Bf16, true) => one(
            Dtype::BF16,
            values
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
        ),
        (ResidentWidth::Int8 | ResidentWidth::Int4, true) => {
            let bits = width.quant_bits().expect("a quantized width");
            let (rows, cols) = (shape[0], shape[1]);
            let (codes, scales) = crate::quant::quantize(&values, rows, cols, bits)
                .map_err(|e| Error::tensor(t.path, t.name, e.to_string()))?;
            let (dtype, stored_shape) = match bits {
                QuantBits::Int8 => (Dtype::I8, shape.clone()),
                _ => (Dtype::U8, vec![rows, bits.row_bytes(cols)]),
            };
            Ok(vec![
                ResidentTensor {
                    name: name.to_string(),
                    dtype,
                    shape: stored_shape,
                    data: codes,
                },
                ResidentTensor {
                    name: matrix_scales_name(name),
                    dtype: Dtype::F32,
                    shape: vec![rows],
                    data: scales.iter().flat_map(|v| v.to_le_bytes()).collect(),
                },
            ])
        }
    }
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
    let raw: serde_json::Value = read_json(&config_path)?;
    let generation_path = hf_dir.join("generation_config.json");
    let generation_raw: HfGenerationConfig = if generation_path.exists() {
        read_json(&generation_path)?
    } else {
        HfGenerationConfig::default()
    };
    let generation = &generation_raw;
    let model_type = raw.get("model_type").and_then(|v| v.as_str());
    let invalid =
        |e: serde_json::Error| Error::format(&config_path, format!("invalid config: {e}"));
    let (model, generation) = match model_type {
        Some(ARCHITECTURE_SWITCH) => {
            let hf: HfSwitchConfig = serde_json::from_value(raw).map_err(invalid)?;
            let spec = SwitchSpec::from_hf(&hf, &config_path)?;
            let generation =
                GenerationDefaults::from_hf(&hf.special_tokens(), generation, &generation_path)?;
            (ModelSpec::Switch(spec), generation)
        }
        Some(t) if DecoderFamily::from_model_type(t).is_some() => {
            let hf: HfDecoderConfig = serde_json::from_value(raw).map_err(invalid)?;
            let spec = DecoderSpec::from_hf(&hf, &config_path)?;
            let tokens = hf.special_tokens();
            let generation = GenerationDefaults::from_hf(&tokens, generation, &generation_path)?
                .for_decoder_only(&tokens, spec.max_position_embeddings);
            (ModelSpec::DecoderOnly(spec), generation)
        }
        Some(other) => {
            let known: Vec<&str> = std::iter::once(ARCHITECTURE_SWITCH)
                .chain(DecoderFamily::ALL.iter().map(|f| f.model_type()))
                .collect();
            return Err(Error::Unsupported {
                path: config_path,
                message: format!(
                    "model_type `{other}` (this engine converts {})",
                    known.join(", ")
                ),
            });
        }
        None => {
            return Err(Error::Unsupported {
                path: config_path,
                message: "config has no `model_type`".into(),
            })
        }
    };
    model.validate(&config_path)?;
    generation.check_token_ids(
        model.vocab_size(),
        !model.has_encoder(),
        &TokenIdSources {
            config_path: &config_path,
            generation_path: &generation_path,
            generation: &generation_raw,
        },
    )?;
    Ok(BundleConfig {
        format_version: BUNDLE_FORMAT_VERSION,
        architecture: model.architecture().into(),
        model,
        generation,
        source_dtype: String::new(),
        resident_width: ResidentWidth::default().name().into(),
    })
}

/// One expert matrix as stored in the checkpoint (a whole tensor, or an expert's rows of a
/// fused one).
pub struct MatrixBytes<'a> {
    /// Checkpoint tensor it comes from (for errors).
    pub name: String,
    pub path: &'a Path,
    pub dtype: WeightDtype,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl<'a> MatrixBytes<'a> {
    fn whole(t: TensorBytes<'a>) -> Self {
        MatrixBytes {
            name: t.name.to_string(),
            path: t.path,
            dtype: t.dtype,
            rows: t.shape[0],
            cols: t.shape[1],
            data: t.data,
        }
    }

    /// Rows `first .. first + rows` of matrix `index` of a `[n, rows_each, cols]` tensor.
    fn rows_of(t: &TensorBytes<'a>, index: usize, first: usize, rows: usize) -> Self {
        let (rows_each, cols) = (t.shape[1], t.shape[2]);
        let size = t.dtype.size_bytes();
        let start = ((index * rows_each + first) * cols) * size;
        MatrixBytes {
            name: t.name.to_string(),
            path: t.path,
            dtype: t.dtype,
            rows,
            cols,
            data: &t.data[start..start + rows * cols * size],
        }
    }

    /// Fails naming the tensor (and `expert`) unless every element is finite: a NaN or an
    /// infinity in one expert silently empties every output that routes through it.
    fn check_finite(&self, expert: ExpertId) -> Result<()> {
        let word = |b: &[u8]| match *b {
            [a, b, c, d] => u32::from_le_bytes([a, b, c, d]),
            [a, b] => u16::from_le_bytes([a, b]) as u32,
            _ => 0,
        };
        // An all-ones exponent is an infinity or a NaN.
        let exponent: u32 = match self.dtype {
            WeightDtype::F32 => 0x7f80_0000,
            WeightDtype::F16 => 0x7c00,
            WeightDtype::BF16 => 0x7f80,
        };
        let size = self.dtype.size_bytes();
        match self
            .data
            .chunks_exact(size)
            .position(|b| word(b) & exponent == exponent)
        {
            None => Ok(()),
            Some(i) => Err(Error::tensor(
                self.path,
                &self.name,
                format!(
                    "{expert}: element {i} is not finite (NaN or infinity): the checkpoint is corrupt"
                ),
            )),
        }
    }

    fn to_f32_tensor(&self) -> Result<Tensor> {
        let stored = Tensor::f_from_data_size(
            self.data,
            &[self.rows as i64, self.cols as i64],
            self.dtype.kind(),
        )?;
        Ok(stored.f_to_kind(tch::Kind::Float)?)
    }
}

/// Where the bundle's tensors come from in a checkpoint.
struct Sources<'a> {
    files: &'a WeightFiles,
    spec: ModelSpec,
    /// (bundle name, checkpoint name, shape) of every resident tensor.
    resident: Vec<(String, String, Vec<usize>)>,
    /// MoE layers whose experts are fused (decoder-only).
    fused_layers: HashSet<usize>,
}

impl<'a> Sources<'a> {
    fn new(files: &'a WeightFiles, spec: &ModelSpec) -> Self {
        let (resident, fused_layers) = match spec {
            ModelSpec::Switch(s) => (
                switch::resident_tensors(s)
                    .into_iter()
                    .map(|(n, shape)| (n.clone(), n, shape))
                    .collect(),
                HashSet::new(),
            ),
            ModelSpec::DecoderOnly(d) => {
                // A tensor missing under every name is reported under the name the checkpoint's
                // style would use.
                let legacy = files.names().any(|n| n.contains(".block_sparse_moe."));
                let resident = decoder_only::resident_tensors(d)
                    .into_iter()
                    .map(|(name, shape)| {
                        let aliases = decoder_only::checkpoint_aliases(d, &name);
                        let source = std::iter::once(&name)
                            .chain(&aliases)
                            .find(|n| files.contains(n))
                            .cloned()
                            .unwrap_or_else(|| match aliases.first() {
                                Some(alias) if legacy => alias.clone(),
                                _ => name.clone(),
                            });
                        (name, source, shape)
                    })
                    .collect();
                let fused = d
                    .moe_layers
                    .iter()
                    .copied()
                    .filter(|&l| files.contains(&decoder_only::fused_expert_names(l).0))
                    .collect();
                (resident, fused)
            }
        };
        Sources {
            files,
            spec: spec.clone(),
            resident,
            fused_layers,
        }
    }

    /// Checkpoint names of every tensor the bundle takes or knowingly skips.
    fn expected(&self, experts: &[ExpertId]) -> HashSet<String> {
        let mut names: HashSet<String> = self.resident.iter().map(|r| r.1.clone()).collect();
        match &self.spec {
            ModelSpec::Switch(s) => {
                for &id in experts {
                    for m in ["wi", "wo"] {
                        names.insert(switch::expert_tensor_name(id, m));
                    }
                }
                names.extend(switch::redundant_tensors(s));
            }
            ModelSpec::DecoderOnly(d) => {
                for &id in experts {
                    if self.fused_layers.contains(&(id.layer as usize)) {
                        let (gate_up, down) = decoder_only::fused_expert_names(id.layer as usize);
                        names.insert(gate_up);
                        names.insert(down);
                    } else {
                        for m in decoder_only::EXPERT_MATRICES {
                            names.insert(decoder_only::expert_tensor_name(d.family, id, m));
                        }
                    }
                }
                names.extend(decoder_only::redundant_tensors(d));
            }
        }
        names
    }

    /// The matrices of expert `id` in blob order.
    fn expert(&self, id: ExpertId) -> Result<Vec<MatrixBytes<'a>>> {
        let files = self.files;
        let (d, ff) = (self.spec.d_model(), self.spec.expert_d_ff());
        match &self.spec {
            ModelSpec::Switch(_) => Ok(vec![
                MatrixBytes::whole(files.get(&switch::expert_tensor_name(id, "wi"), &[ff, d])?),
                MatrixBytes::whole(files.get(&switch::expert_tensor_name(id, "wo"), &[d, ff])?),
            ]),
            ModelSpec::DecoderOnly(spec) => {
                let layer = id.layer as usize;
                let e = id.expert as usize;
                if self.fused_layers.contains(&layer) {
                    let n = spec.num_experts;
                    let (gate_up, down) = decoder_only::fused_expert_names(layer);
                    let gate_up = files.get(&gate_up, &[n, 2 * ff, d])?;
                    let down = files.get(&down, &[n, d, ff])?;
                    Ok(vec![
                        MatrixBytes::rows_of(&gate_up, e, 0, ff),
                        MatrixBytes::rows_of(&gate_up, e, ff, ff),
                        MatrixBytes::rows_of(&down, e, 0, d),
                    ])
                } else {
                    let name = |m| decoder_only::expert_tensor_name(spec.family, id, m);
                    Ok(vec![
                        MatrixBytes::whole(files.get(&name("gate"), &[ff, d])?),
                        MatrixBytes::whole(files.get(&name("up"), &[ff, d])?),
                        MatrixBytes::whole(files.get(&name("down"), &[d, ff])?),
                    ])
                }
            }
        }
    }
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
    let tokenizer_path = options
        .tokenizer
        .clone()
        .unwrap_or_else(|| hf_dir.join("tokenizer.json"));
    let mut inputs = vec![("--hf", hf_dir.as_path())];
    if let Some(t) = &options.tokenizer {
        inputs.push(("--tokenizer", t.as_path()));
    }
    check_target(&options.out_dir, &inputs, options.force)?;
    let mut config = read_hf_config(hf_dir)?;
    let tokenizer_bytes = read_bytes(&tokenizer_path)?;
    Tokenizer::from_bytes(&tokenizer_path, &tokenizer_bytes)?.check_against(&config)?;
    let files = WeightFiles::open_hf_dir(hf_dir)?;
    if let ModelSpec::Switch(spec) = &mut config.model {
        // Untied transformers 5.x checkpoints give each stack its own embedding table.
        let untied = !spec.tie_word_embeddings;
        spec.separate_encoder_embeddings = untied && files.contains("encoder.embed_tokens.weight");
        spec.separate_decoder_embeddings = untied && files.contains("decoder.embed_tokens.weight");
    }
    let spec = config.model.clone();
    check_config_against_weights(&spec, &files, &hf_dir.join("config.json"))?;

    let sources = Sources::new(&files, &spec);
    let resident = &sources.resident;
    let experts = spec.all_experts();
    let expected = sources.expected(&experts);
    let mut unexpected: Vec<&str> = files.names().filter(|n| !expected.contains(*n)).collect();
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
    if let Some(unknown) = options.bits.experts.keys().find(|id| !experts.contains(id)) {
        return Err(Error::Input(format!(
            "the bit plan names {unknown}, which this model does not have"
        )));
    }

    // Everything is written into a staging directory beside the target and swapped in once
    // complete and checked: an old bundle there stays whole until then, whatever happens.
    let staged = StagedDir::beside(&options.out_dir)?;
    let out = staged.path();

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

    // Resident weights at the chosen width (the engine holds and computes them so).
    progress.set_message("resident");
    let resident_path = out.join(RESIDENT_FILE);
    let mut stored = Vec::with_capacity(resident.len());
    for (name, source, shape) in resident {
        let t = files.get(source, shape)?;
        stored.extend(resident_at_width(name, &t, options.resident)?);
        progress.inc(1);
    }
    let mut views = Vec::with_capacity(stored.len());
    for t in &stored {
        let view = TensorView::new(t.dtype, t.shape.clone(), &t.data)
            .map_err(|e| Error::tensor(&resident_path, &t.name, e.to_string()))?;
        views.push((t.name.clone(), view));
    }
    config.resident_width = options.resident.name().into();
    config.source_dtype = files
        .get(&resident[0].1, &resident[0].2)?
        .dtype
        .name()
        .into();
    safetensors::tensor::serialize_to_file(views, None, &resident_path)
        .map_err(|e| Error::format(&resident_path, format!("cannot write: {e}")))?;
    drop(stored);

    // Experts: one blob each, at the plan's width, else in their source dtype (f32 if their
    // matrices disagree).
    progress.set_message("experts");
    let mut plan = Vec::with_capacity(experts.len());
    for &id in &experts {
        let matrices = sources.expert(id)?;
        let source = if matrices.iter().all(|m| m.dtype == matrices[0].dtype) {
            matrices[0].dtype
        } else {
            WeightDtype::F32
        };
        let encoding = options
            .bits
            .encoding(id)
            .unwrap_or(ExpertEncoding::Float(source));
        plan.push((id, encoding));
    }
    let store_path = out.join(EXPERTS_FILE);
    let mut writer = ExpertStoreWriter::create(&store_path, &spec.expert_layout(), &plan)?;
    for &(id, encoding) in &plan {
        let sources = sources.expert(id)?;
        let (matrices, length) = spec.expert_layout().blob(encoding);
        let mut blob = vec![0u8; length as usize];
        for (m, t) in matrices.iter().zip(&sources) {
            t.check_finite(id)?;
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

    let tokenizer_out = out.join(TOKENIZER_FILE);
    std::fs::write(&tokenizer_out, &tokenizer_bytes).map_err(|e| Error::io(&tokenizer_out, e))?;
    let config_out = out.join(CONFIG_FILE);
    let json = serde_json::to_string_pretty(&config).expect("config serializes");
    std::fs::write(&config_out, json + "\n").map_err(|e| Error::io(&config_out, e))?;
    seal(out)?;
    progress.finish_and_clear();

    let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    let report = ConvertReport {
        spec,
        experts: experts.len(),
        resident_file_bytes: size(&resident_path),
        expert_store_bytes: size(&store_path),
    };
    staged.commit()?;
    Ok(report)
}

/// Fails naming the field of `config_path` and the tensor unless the layer counts and widths
/// of `spec` are those of the checkpoint's weights. Done before anything is sized from the
/// config: a config that claims a million layers or a huge width must be refused, not
/// allocated for (the sizes are bounded by [`ModelSpec::validate`], not proven).
fn check_config_against_weights(
    spec: &ModelSpec,
    files: &WeightFiles,
    config_path: &Path,
) -> Result<()> {
    // (field, its value, checkpoint prefix of the stack's layers)
    let mut layer_counts: Vec<(&str, usize, &str)> = Vec::new();
    // (tensor, expected shape, the config field that sets each dimension)
    let mut probes: Vec<(String, Vec<usize>, [&str; 2])> = Vec::new();
    match spec {
        ModelSpec::Switch(s) => {
            let d = s.d_model;
            layer_counts.extend([
                ("num_layers", s.num_encoder_layers, "encoder.block."),
                ("num_decoder_layers", s.num_decoder_layers, "decoder.block."),
            ]);
            let attention = "encoder.block.0.layer.0.SelfAttention";
            probes.extend([
                (
                    "shared.weight".to_string(),
                    vec![s.vocab_size, d],
                    ["vocab_size", "d_model"],
                ),
                (
                    format!("{attention}.relative_attention_bias.weight"),
                    vec![s.relative_attention_num_buckets, s.num_heads],
                    ["relative_attention_num_buckets", "num_heads"],
                ),
                (
                    format!("{attention}.q.weight"),
                    vec![s.inner_dim(), d],
                    ["d_kv", "d_model"],
                ),
            ]);
        }
        ModelSpec::DecoderOnly(dec) => {
            let h = dec.hidden_size;
            layer_counts.push(("num_hidden_layers", dec.num_layers, "model.layers."));
            let attention = "model.layers.0.self_attn";
            probes.extend([
                (
                    "model.embed_tokens.weight".to_string(),
                    vec![dec.vocab_size, h],
                    ["vocab_size", "hidden_size"],
                ),
                (
                    format!("{attention}.q_proj.weight"),
                    vec![dec.q_dim(), h],
                    ["num_attention_heads × head_dim", "hidden_size"],
                ),
                (
                    format!("{attention}.k_proj.weight"),
                    vec![dec.kv_dim(), h],
                    ["num_key_value_heads", "hidden_size"],
                ),
            ]);
        }
    }
    for (field, count, prefix) in layer_counts {
        let held = files
            .names()
            .filter_map(|name| name.strip_prefix(prefix)?.split('.').next()?.parse().ok())
            .map(|layer: usize| layer + 1)
            .max()
            .unwrap_or(0);
        if held != count {
            let first_extra = format!("{prefix}{}", count.min(held));
            let mut names: Vec<&str> = files
                .names()
                .filter(|n| n.starts_with(&format!("{first_extra}.")))
                .collect();
            names.sort();
            return Err(Error::tensor(
                files.describe(),
                names.first().copied().unwrap_or(&first_extra),
                format!(
                    "{} holds `{field}` = {count}, the weights have {held} layers ({prefix}0 to {prefix}{})",
                    config_path.display(),
                    held.saturating_sub(1)
                ),
            ));
        }
    }
    // The first MoE block's router and first expert: experts per block and expert width.
    let first_moe = [Stack::Encoder, Stack::Decoder]
        .into_iter()
        .find_map(|stack| Some((stack, *spec.moe_blocks(stack).first()?)));
    if let Some((stack, layer)) = first_moe {
        let id = ExpertId {
            stack,
            layer: layer as u16,
            expert: 0,
        };
        let (d, ff, experts) = (spec.d_model(), spec.expert_d_ff(), spec.num_experts());
        match spec {
            ModelSpec::Switch(_) => {
                let expert = switch::expert_tensor_name(id, "wi");
                let router = expert.replace(".experts.expert_0.wi.", ".router.classifier.");
                probes.push((router, vec![experts, d], ["num_experts", "d_model"]));
                probes.push((expert, vec![ff, d], ["d_ff", "d_model"]));
            }
            ModelSpec::DecoderOnly(dec) => {
                let (experts_field, width_field) = match dec.family {
                    DecoderFamily::Mixtral => ("num_local_experts", "intermediate_size"),
                    _ => ("num_experts", "moe_intermediate_size"),
                };
                let router = format!("model.layers.{layer}.mlp.gate.weight");
                let router = std::iter::once(router.clone())
                    .chain(decoder_only::checkpoint_aliases(dec, &router))
                    .find(|n| files.contains(n))
                    .unwrap_or(router);
                probes.push((router, vec![experts, d], [experts_field, "hidden_size"]));
                let expert = decoder_only::expert_tensor_name(dec.family, id, "gate");
                probes.push((expert, vec![ff, d], [width_field, "hidden_size"]));
            }
        }
    }
    for (name, expected, fields) in probes {
        // A missing tensor is reported where it is read, with everything else missing.
        let Some(shape) = files.shape(&name) else {
            continue;
        };
        if shape == expected.as_slice() {
            continue;
        }
        let axis = (0..2)
            .find(|&a| shape.get(a) != expected.get(a))
            .unwrap_or(0);
        return Err(Error::tensor(
            files.describe(),
            &name,
            format!(
                "shape {shape:?}, expected {expected:?}: `{}` in {} disagrees with the weights",
                fields[axis],
                config_path.display()
            ),
        ));
    }
    Ok(())
}

/// Records every file of the bundle being written in `dir` in its manifest (written last), then
/// opens it as a run would: config, lengths, tokenizer against the model, the expert store's
/// index. What fails here never reaches the target.
fn seal(dir: &Path) -> Result<()> {
    let mut manifest = Manifest::default();
    for name in BUNDLE_FILES {
        if dir.join(name).exists() && name != MANIFEST_FILE {
            manifest.record(dir, name)?;
        }
    }
    manifest.save(dir)?;
    let bundle = Bundle::open(dir)?;
    bundle.tokenizer()?;
    bundle.open_store()?;
    Ok(())
}

/// Fails before anything is written when the bundle directory `out` would overlap an input or
/// holds something that is not a bundle (unless `force`): convert replaces the whole directory.
fn check_target(out: &Path, inputs: &[(&str, &Path)], force: bool) -> Result<()> {
    crate::atomic::refuse_overlap(("--out", out), inputs)?;
    let meta = match std::fs::metadata(out) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(out, e)),
    };
    if !meta.is_dir() {
        return Err(Error::Input(format!(
            "--out {}: exists and is not a directory",
            out.display()
        )));
    }
    let foreign = crate::bundle::foreign_entries(out)?;
    if foreign.is_empty() || force {
        return Ok(());
    }
    let shown: Vec<&str> = foreign.iter().take(3).map(String::as_str).collect();
    Err(Error::Input(format!(
        "--out {}: not empty and not a model bundle (it holds {}{}); converting would replace the whole directory: choose another --out, or pass --force to replace it",
        out.display(),
        shown.join(", "),
        if foreign.len() > 3 { ", …" } else { "" }
    )))
}

/// A matrix's bytes in the store's encoding, and its per-row scales (quantized encodings).
fn stored_bytes(t: &MatrixBytes<'_>, encoding: ExpertEncoding) -> Result<(Vec<u8>, Vec<f32>)> {
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
            crate::quant::quantize(&weights, t.rows, t.cols, bits)
                .map_err(|e| Error::tensor(t.path, &t.name, e.to_string()))
        }
    }
}

/// Writes a copy of bundle `source` into `out` with its experts re-encoded by `bits`
/// (decoded to f32 and quantized again; non-expert files copied as they are), replacing `out`
/// whole once complete (a bundle there, or nothing; see [`convert`]).
pub fn requantize_bundle(source: &Path, out: &Path, bits: &BitPlan) -> Result<()> {
    let bundle = Bundle::open(source)?;
    check_target(out, &[("the source bundle", source)], false)?;
    let spec = bundle.config.model.clone();
    let store = bundle.open_store()?;
    let staged = StagedDir::beside(out)?;
    let dir = staged.path();
    let plan: Vec<_> = store
        .index()
        .experts
        .iter()
        .map(|e| (e.id, bits.encoding(e.id).unwrap_or(e.encoding)))
        .collect();
    let store_path = dir.join(EXPERTS_FILE);
    let mut writer = ExpertStoreWriter::create(&store_path, &spec.expert_layout(), &plan)?;
    let mut slot = crate::store::AlignedBuf::new(store.max_padded_expert_bytes() as usize);
    for &(id, encoding) in &plan {
        let entry = store.entry(id).expect("listed by the store").clone();
        store.read_expert(id, slot.as_mut_slice())?;
        let (matrices, length) = spec.expert_layout().blob(encoding);
        let mut blob = vec![0u8; length as usize];
        crate::runtime::codec::reencode_expert(
            &entry,
            slot.as_slice(),
            &matrices,
            encoding,
            &mut blob,
        )?;
        writer.write_next(&blob)?;
    }
    writer.finish()?;
    for file in [RESIDENT_FILE, TOKENIZER_FILE, PATHS_FILE] {
        if source.join(file).exists() {
            // What is copied is what the source's manifest records.
            bundle.check_file(file)?;
            let to = dir.join(file);
            std::fs::copy(source.join(file), &to).map_err(|e| Error::io(&to, e))?;
        }
    }
    let config_out = dir.join(CONFIG_FILE);
    let json = serde_json::to_string_pretty(&bundle.config).expect("config serializes");
    std::fs::write(&config_out, json + "\n").map_err(|e| Error::io(&config_out, e))?;
    seal(dir)?;
    staged.commit()
}
