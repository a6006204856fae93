//! A model bundle: the directory `convert` writes and every run reads.
//!
//! ```text
//! config.json           BundleConfig: format version, ModelSpec, generation defaults
//! resident.safetensors  every non-expert weight (source dtype), memory-mapped at load
//! experts.bin           the expert store (see `store/`)
//! tokenizer.json        the tokenizer the model was trained with
//! ```

use std::path::{Path, PathBuf};

use crate::config::BundleConfig;
use crate::error::{Error, Result};
use crate::model::Model;
use crate::store::ExpertStore;
use crate::tokenizer::Tokenizer;
use crate::weights::WeightFiles;

pub const CONFIG_FILE: &str = "config.json";
pub const RESIDENT_FILE: &str = "resident.safetensors";
pub const EXPERTS_FILE: &str = "experts.bin";
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// An opened bundle: its validated config; weights are loaded on demand.
pub struct Bundle {
    dir: PathBuf,
    pub config: BundleConfig,
}

impl Bundle {
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::io(
                dir,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "model bundle directory not found (create one with `edgemoe convert --hf DIR --out DIR`)",
                ),
            ));
        }
        for file in [CONFIG_FILE, RESIDENT_FILE, EXPERTS_FILE, TOKENIZER_FILE] {
            let path = dir.join(file);
            if !path.exists() {
                return Err(Error::io(
                    &path,
                    std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        "missing from the model bundle",
                    ),
                ));
            }
            // A directory or FIFO in a file's place is named as what it is, never opened.
            crate::io::check_regular_file(&path)?;
        }
        let config = BundleConfig::load(&dir.join(CONFIG_FILE))?;
        Ok(Bundle {
            dir: dir.to_path_buf(),
            config,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    /// The model's resident weights on `device` (decoder-only models run on the CPU).
    pub fn load_model(&self, device: tch::Device) -> Result<Model> {
        let files = WeightFiles::open_file(&self.path(RESIDENT_FILE))?;
        Model::load(&self.config.model, &files, device)
    }

    /// Fails unless the bundle holds an encoder-decoder model (what `summarize` and `eval` run).
    pub fn expect_encoder_decoder(&self) -> Result<()> {
        match self.config.model.as_switch() {
            Some(_) => Ok(()),
            None => Err(self.wrong_kind("a decoder-only model: use `edgemoe generate` with it")),
        }
    }

    /// Fails unless the bundle holds a decoder-only model (what `generate` runs).
    pub fn expect_decoder_only(&self) -> Result<()> {
        match self.config.model.as_decoder() {
            Some(_) => Ok(()),
            None => {
                Err(self.wrong_kind("an encoder-decoder model: use `edgemoe summarize` with it"))
            }
        }
    }

    fn wrong_kind(&self, what: &str) -> Error {
        Error::Unsupported {
            path: self.path(CONFIG_FILE),
            message: format!("architecture `{}` is {what}", self.config.architecture),
        }
    }

    pub fn open_store(&self) -> Result<ExpertStore> {
        ExpertStore::open(&self.path(EXPERTS_FILE), &self.config.model.expert_layout())
    }

    pub fn tokenizer(&self) -> Result<Tokenizer> {
        Tokenizer::load(&self.path(TOKENIZER_FILE))
    }
}
