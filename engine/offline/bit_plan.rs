//! A bit-width plan: the stored encoding of every expert (`convert --plan`, written by
//! `tune-bits`). JSON:
//!
//! ```json
//! {"format": "edgemoe-bit-plan", "version": 1, "default": "int8",
//!  "experts": [{"stack": "decoder", "block": 1, "expert": 3, "width": "int2"}]}
//! ```
//!
//! Widths: `f32`, `f16`, `bf16`, `int8`, `int4`, `int2`. Experts not listed get `default`
//! (absent: the checkpoint's own dtype).

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ids::ExpertId;
use crate::ids::Stack;
use crate::io::read_json;
use crate::store::ExpertEncoding;

pub const PLAN_FORMAT: &str = "edgemoe-bit-plan";

#[derive(Debug, Clone, Serialize, Deserialize)]
struct PlanFile {
    format: String,
    version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    default: Option<String>,
    #[serde(default)]
    experts: Vec<PlanEntry>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct PlanEntry {
    stack: String,
    block: u16,
    expert: u16,
    width: String,
}

/// The encoding chosen for each expert.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BitPlan {
    pub default: Option<ExpertEncoding>,
    pub experts: BTreeMap<ExpertId, ExpertEncoding>,
}

fn parse_width(text: &str, path: &Path) -> Result<ExpertEncoding> {
    ExpertEncoding::parse(text).ok_or_else(|| {
        Error::format(
            path,
            format!("unknown width `{text}` (expected f32, f16, bf16, int8, int4 or int2)"),
        )
    })
}

impl BitPlan {
    /// Every expert at one width.
    pub fn uniform(encoding: ExpertEncoding) -> Self {
        BitPlan {
            default: Some(encoding),
            experts: BTreeMap::new(),
        }
    }

    pub fn encoding(&self, id: ExpertId) -> Option<ExpertEncoding> {
        self.experts.get(&id).copied().or(self.default)
    }

    pub fn load(path: &Path) -> Result<Self> {
        let file: PlanFile = read_json(path)?;
        if file.format != PLAN_FORMAT || file.version != 1 {
            return Err(Error::format(
                path,
                format!(
                    "not an edgemoe bit plan version 1 (format `{}`, version {})",
                    file.format, file.version
                ),
            ));
        }
        let default = file
            .default
            .as_deref()
            .map(|w| parse_width(w, path))
            .transpose()?;
        let mut experts = BTreeMap::new();
        for e in &file.experts {
            let stack = match e.stack.as_str() {
                "encoder" => Stack::Encoder,
                "decoder" => Stack::Decoder,
                other => {
                    return Err(Error::format(
                        path,
                        format!("unknown stack `{other}` (expected encoder or decoder)"),
                    ))
                }
            };
            let id = ExpertId {
                stack,
                layer: e.block,
                expert: e.expert,
            };
            let width = parse_width(&e.width, path)?;
            // Which of two entries was meant cannot be known: refused rather than last wins.
            if experts.insert(id, width).is_some() {
                return Err(Error::format(
                    path,
                    format!("{id} is listed more than once in `experts`"),
                ));
            }
        }
        Ok(BitPlan { default, experts })
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        let file = PlanFile {
            format: PLAN_FORMAT.into(),
            version: 1,
            default: self.default.map(|e| e.name().to_string()),
            experts: self
                .experts
                .iter()
                .map(|(id, e)| PlanEntry {
                    stack: id.stack.hf_prefix().into(),
                    block: id.layer,
                    expert: id.expert,
                    width: e.name().into(),
                })
                .collect(),
        };
        let json = serde_json::to_string_pretty(&file).expect("plan serializes");
        crate::atomic::write_file(path, (json + "\n").as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::QuantBits;

    #[test]
    fn round_trips_and_rejects_unknown_widths() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan.json");
        let mut plan = BitPlan::uniform(ExpertEncoding::Quant(QuantBits::Int8));
        let id = ExpertId {
            stack: Stack::Decoder,
            layer: 1,
            expert: 3,
        };
        plan.experts
            .insert(id, ExpertEncoding::Quant(QuantBits::Int2));
        plan.save(&path).unwrap();
        let back = BitPlan::load(&path).unwrap();
        assert_eq!(back, plan);
        assert_eq!(
            back.encoding(id),
            Some(ExpertEncoding::Quant(QuantBits::Int2))
        );
        std::fs::write(
            &path,
            r#"{"format": "edgemoe-bit-plan", "version": 1, "default": "int3"}"#,
        )
        .unwrap();
        assert!(BitPlan::load(&path)
            .unwrap_err()
            .to_string()
            .contains("int3"));
    }

    #[test]
    fn an_expert_listed_twice_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan.json");
        std::fs::write(
            &path,
            r#"{"format": "edgemoe-bit-plan", "version": 1, "experts": [
                {"stack": "decoder", "block": 1, "expert": 3, "width": "int2"},
                {"stack": "encoder", "block": 1, "expert": 3, "width": "int4"},
                {"stack": "decoder", "block": 1, "expert": 3, "width": "int8"}]}"#,
        )
        .unwrap();
        let id = ExpertId {
            stack: Stack::Decoder,
            layer: 1,
            expert: 3,
        };
        let error = BitPlan::load(&path).unwrap_err().to_string();
        assert!(
            error.contains("plan.json") && error.contains(&id.to_string()),
            "{error}"
        );
    }
}
