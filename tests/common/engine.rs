//! The engine calls the tests share, in one place: opening a [`Session`], loading a bundle's
//! model as its concrete architecture (tests call its encoder and decoder steps directly), and
//! the checkpoint's expert tensor names (`expert_tensor_name`, `fused_expert_names`).

use std::path::Path;

use edgemoe::bundle::Bundle;
use edgemoe::config::ModelSpec;
use edgemoe::generation::decoding::{DecodeOptions, Generation};
use edgemoe::ids::ExpertId;
use edgemoe::model::{DecoderOnlyModel, Model, SwitchModel};
use edgemoe::weights::WeightFiles;

pub use edgemoe::generation::input::parse_documents;
pub use edgemoe::generation::session::{CacheOptions, Session, SessionOptions};

/// Opens a session on `bundle` with `options`.
pub fn open_summarizer(bundle: &Path, options: SessionOptions) -> Session {
    let opened = Bundle::open(bundle).unwrap_or_else(|e| panic!("{}: {e}", bundle.display()));
    Session::open(&opened, options).unwrap_or_else(|e| panic!("opening {}: {e}", bundle.display()))
}

/// Opens a summarization session with the bundle's generation defaults, `budget` bytes, `cache`
/// and, if given, `beams` instead of the default beam count.
pub fn open_summarizer_with(
    bundle: &Path,
    budget: u64,
    cache: CacheOptions,
    beams: Option<usize>,
) -> Session {
    let generation = Bundle::open(bundle).unwrap().config.generation;
    let mut decode = DecodeOptions::from_defaults(&generation);
    if let Some(b) = beams {
        decode.num_beams = b;
    }
    open_summarizer(
        bundle,
        SessionOptions {
            budget_bytes: budget,
            decode,
            max_input_tokens: generation.max_source_tokens,
            cache,
            device: tch::Device::Cpu,
        },
    )
}

/// The encoder's token ids for `document`.
pub fn encode_document(session: &Session, document: &str) -> Vec<i64> {
    session.encode(document).unwrap()
}

/// Generates from encoder token ids.
pub fn generate_ids(session: &mut Session, ids: &[i64]) -> Generation {
    session.run(ids, &mut |_| Ok(())).unwrap()
}

/// The summary token ids of each document.
pub fn summarize_all(session: &mut Session, documents: &[String]) -> Vec<Vec<i64>> {
    documents
        .iter()
        .map(|d| {
            let ids = encode_document(session, d);
            generate_ids(session, &ids).tokens
        })
        .collect()
}

/// A Switch bundle's model.
pub fn load_switch(bundle: &Bundle) -> SwitchModel {
    match bundle.load_model(tch::Device::Cpu).unwrap() {
        Model::Switch(model) => model,
        _ => panic!("{}: not a Switch bundle", bundle.dir().display()),
    }
}

/// A decoder-only bundle's model.
pub fn load_decoder(bundle: &Bundle) -> DecoderOnlyModel {
    match bundle.load_model(tch::Device::Cpu).unwrap() {
        Model::DecoderOnly(model) => model,
        _ => panic!("{}: not a decoder-only bundle", bundle.dir().display()),
    }
}

/// The checkpoint tensor that holds `matrix` of expert `id` (one tensor per expert and matrix).
pub fn expert_tensor_name(spec: &ModelSpec, id: ExpertId, matrix: &str) -> String {
    match spec {
        ModelSpec::Switch(_) => edgemoe::model::switch::expert_tensor_name(id, matrix),
        ModelSpec::DecoderOnly(d) => {
            edgemoe::model::decoder_only::expert_tensor_name(d.family, id, matrix)
        }
    }
}

/// The matrices of one expert, in the order the expert provider hands them out.
pub fn expert_matrices(spec: &ModelSpec) -> &'static [&'static str] {
    match spec {
        ModelSpec::Switch(_) => &["wi", "wo"],
        ModelSpec::DecoderOnly(_) => &["gate", "up", "down"],
    }
}

/// The fused expert tensors of decoder layer `layer` (OLMoE's layout): `(gate_up, down)`.
pub fn fused_expert_names(layer: usize) -> (String, String) {
    edgemoe::model::decoder_only::fused_expert_names(layer)
}

/// The source weights of `matrix` of expert `id` (its `shape` as the provider hands it out), as
/// f32: from the per-expert tensor, or sliced out of a layer's fused tensors (OLMoE).
pub fn source_expert_matrix(
    files: &WeightFiles,
    spec: &ModelSpec,
    id: ExpertId,
    matrix: &str,
    shape: &[usize],
) -> Vec<f32> {
    let name = expert_tensor_name(spec, id, matrix);
    let tensor = if files.contains(&name) {
        files.load_f32(&name, shape).unwrap()
    } else {
        let (gate_up, down) = fused_expert_names(id.layer as usize);
        let (experts, rows, cols) = (spec.num_experts(), shape[0], shape[1]);
        let expert = id.expert as i64;
        match matrix {
            "gate" | "up" => {
                let first = if matrix == "gate" { 0 } else { rows as i64 };
                files
                    .load_f32(&gate_up, &[experts, 2 * rows, cols])
                    .unwrap_or_else(|e| panic!("{id} {matrix}: neither {name} nor {e}"))
                    .get(expert)
                    .narrow(0, first, rows as i64)
            }
            _ => files
                .load_f32(&down, &[experts, rows, cols])
                .unwrap_or_else(|e| panic!("{id} {matrix}: neither {name} nor {e}"))
                .get(expert),
        }
    };
    Vec::<f32>::try_from(tensor.contiguous().flatten(0, -1)).unwrap()
}
