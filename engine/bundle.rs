//! A model bundle: the directory `convert` writes and every run reads.
//!
//! ```text
//! config.json           BundleConfig: format version, ModelSpec, generation defaults
//! resident.safetensors  every non-expert weight (source dtype), memory-mapped at load
//! experts.bin           the expert store (see `store/`)
//! tokenizer.json        the tokenizer the model was trained with
//! paths.bin             the activation-path dictionary (`calibrate`; optional)
//! manifest.json         length and CRC-32 of every file above (see `manifest.rs`)
//! ```
//!
//! Integrity: opening a bundle checks every file's length against the manifest and
//! `config.json`'s checksum; the resident weights, the tokenizer and `paths.bin` are checked
//! when they are loaded (each is read whole then anyway), and every expert blob carries its own
//! CRC-32, checked on every read. A mismatch is [`Error::Corrupt`] naming the file.
//! [`verify`] checks everything, every expert blob included (`inspect --verify`). A bundle
//! written before manifests existed has none and loads unchecked, except its experts.

use std::path::{Path, PathBuf};

use crate::config::BundleConfig;
use crate::dictionary::{PathDictionary, PATHS_FILE};
use crate::error::{Error, Result};
use crate::manifest::{Manifest, MANIFEST_FILE};
use crate::model::Model;
use crate::store::ExpertStore;
use crate::tokenizer::Tokenizer;
use crate::weights::WeightFiles;

pub const CONFIG_FILE: &str = "config.json";
pub const RESIDENT_FILE: &str = "resident.safetensors";
pub const EXPERTS_FILE: &str = "experts.bin";
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// The files `convert` writes, each required.
pub const REQUIRED_FILES: [&str; 4] = [CONFIG_FILE, RESIDENT_FILE, EXPERTS_FILE, TOKENIZER_FILE];

/// Every file a bundle may hold.
pub const BUNDLE_FILES: [&str; 6] = [
    CONFIG_FILE,
    RESIDENT_FILE,
    EXPERTS_FILE,
    TOKENIZER_FILE,
    PATHS_FILE,
    MANIFEST_FILE,
];

/// Whether directory `dir` holds a model bundle (or most of one): its config with its manifest
/// or expert store.
pub fn looks_like_bundle(dir: &Path) -> bool {
    dir.join(CONFIG_FILE).is_file()
        && (dir.join(MANIFEST_FILE).is_file() || dir.join(EXPERTS_FILE).is_file())
}

/// The entries of directory `dir` that are no bundle file (sorted): what replacing `dir` with a
/// bundle would destroy.
pub fn foreign_entries(dir: &Path) -> Result<Vec<String>> {
    let mut foreign = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_file = entry.file_type().map(|t| t.is_file()).unwrap_or(false);
        if !(is_file && BUNDLE_FILES.contains(&name.as_str())) {
            foreign.push(name);
        }
    }
    foreign.sort();
    Ok(foreign)
}

/// An opened bundle: its validated config; weights are loaded on demand.
pub struct Bundle {
    dir: PathBuf,
    pub config: BundleConfig,
    /// `None` for a bundle written before manifests existed.
    manifest: Option<Manifest>,
    /// Runs on this bundle do without its path dictionary (see [`Bundle::without_path_dictionary`]).
    skip_path_dictionary: bool,
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
        for file in REQUIRED_FILES {
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
        let manifest = Manifest::load(dir)?;
        if let Some(m) = &manifest {
            // The expert store checks its own length against its index, naming the first
            // expert a truncated store lacks; `paths.bin` is optional (deleting it leaves the
            // bundle uncalibrated) and checked when loaded.
            m.check_lengths(dir, &[EXPERTS_FILE, PATHS_FILE])?;
        }
        let config_path = dir.join(CONFIG_FILE);
        let bytes = crate::io::read_bytes(&config_path)?;
        if let Some(m) = &manifest {
            m.check_bytes(dir, CONFIG_FILE, &bytes)?;
        }
        let text =
            String::from_utf8(bytes).map_err(|_| Error::format(&config_path, "not UTF-8 text"))?;
        let config = BundleConfig::parse(&config_path, &text)?;
        Ok(Bundle {
            dir: dir.to_path_buf(),
            config,
            manifest,
            skip_path_dictionary: false,
        })
    }

    /// Whether the bundle has a manifest (bundles written before them do not).
    pub fn has_manifest(&self) -> bool {
        self.manifest.is_some()
    }

    /// Fails unless file `name` is what the manifest records (reading it whole); nothing to
    /// check without a manifest.
    pub fn check_file(&self, name: &str) -> Result<()> {
        match &self.manifest {
            Some(m) => m.check_file(&self.dir, name),
            None => Ok(()),
        }
    }

    /// The bytes of file `name`, checked against the manifest.
    fn read_checked(&self, name: &str) -> Result<Vec<u8>> {
        let bytes = crate::io::read_bytes(&self.path(name))?;
        if let Some(m) = &self.manifest {
            m.check_bytes(&self.dir, name, &bytes)?;
        }
        Ok(bytes)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    /// The model's resident weights on `device` (decoder-only models run on the CPU).
    pub fn load_model(&self, device: tch::Device) -> Result<Model> {
        // Read once here (1 MiB at a time); the map below then finds the pages cached.
        if let Some(m) = &self.manifest {
            m.check_file(&self.dir, RESIDENT_FILE)?;
        }
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

    /// The bundle's tokenizer, checked against the manifest and against the model.
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        let tokenizer = Tokenizer::from_bytes(
            &self.path(TOKENIZER_FILE),
            &self.read_checked(TOKENIZER_FILE)?,
        )?;
        tokenizer.check_against(&self.config)?;
        Ok(tokenizer)
    }

    /// The activation-path dictionary, if the bundle has been calibrated.
    pub fn path_dictionary(&self) -> Result<Option<PathDictionary>> {
        let path = self.path(PATHS_FILE);
        if self.skip_path_dictionary || std::fs::symlink_metadata(&path).is_err() {
            return Ok(None);
        }
        let bytes = self.read_checked(PATHS_FILE).map_err(|e| match e {
            Error::Corrupt {
                path,
                expert,
                message,
            } => Error::Corrupt {
                path,
                expert,
                message: format!("{message} (run `edgemoe calibrate` again to rebuild it)"),
            },
            e => e,
        })?;
        Ok(Some(PathDictionary::from_bytes(&path, &bytes)?))
    }

    /// This bundle with its path dictionary left out of runs: `calibrate` builds a new one and
    /// must not depend on the old one (nor fail because it is damaged).
    pub fn without_path_dictionary(mut self) -> Self {
        self.skip_path_dictionary = true;
        self
    }

    /// Writes `paths.bin` and records it in the manifest, each atomically and in that order: a
    /// run killed in between leaves a `paths.bin` the manifest does not match, which `calibrate`
    /// (which ignores the old dictionary) replaces.
    pub fn save_path_dictionary(&self, dictionary: &PathDictionary) -> Result<PathBuf> {
        let bytes = dictionary.to_bytes();
        let path = self.path(PATHS_FILE);
        crate::atomic::write_file(&path, &bytes)?;
        // Read again: the manifest on disk is the one to extend.
        if let Some(mut manifest) = Manifest::load(&self.dir)? {
            manifest.record_bytes(PATHS_FILE, &bytes);
            manifest.save(&self.dir)?;
        }
        Ok(path)
    }
}

/// How one file of a bundle fared in [`verify`].
#[derive(Debug, Clone)]
pub struct FileCheck {
    /// The file (`experts.bin <expert>` for one damaged blob).
    pub name: String,
    pub outcome: Outcome,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Checked and intact: what was checked.
    Ok(String),
    /// Nothing to check it against (no manifest): why.
    Unchecked(String),
    /// Damaged or missing: the error.
    Bad(String),
}

/// Checks every file of the bundle in `dir` against its manifest and every expert blob against
/// its CRC-32, reading everything; one entry per file (and per damaged blob). Fails only when
/// `dir` is no bundle at all.
pub fn verify(dir: &Path) -> Result<Vec<FileCheck>> {
    if !dir.is_dir() {
        return Err(Error::io(
            dir,
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "model bundle directory not found",
            ),
        ));
    }
    let mut checks = Vec::new();
    let mut push = |name: &str, outcome: Outcome| {
        checks.push(FileCheck {
            name: name.to_string(),
            outcome,
        })
    };
    let checked = |r: Result<String>| match r {
        Ok(what) => Outcome::Ok(what),
        Err(e) => Outcome::Bad(e.to_string()),
    };
    let manifest = match Manifest::load(dir) {
        Ok(Some(m)) => {
            push(
                MANIFEST_FILE,
                Outcome::Ok(format!("{} files listed", m.files.len())),
            );
            Some(m)
        }
        Ok(None) => {
            push(
                MANIFEST_FILE,
                Outcome::Unchecked("absent: a bundle written before checksums; only the expert blobs can be checked (convert the model again to add them)".into()),
            );
            None
        }
        Err(e) => {
            push(MANIFEST_FILE, checked(Err(e)));
            None
        }
    };
    let mut names: Vec<String> = REQUIRED_FILES.iter().map(|n| n.to_string()).collect();
    if dir.join(PATHS_FILE).exists() {
        names.push(PATHS_FILE.into());
    }
    if let Some(m) = &manifest {
        for listed in m.files.keys() {
            if !names.contains(listed) {
                names.push(listed.clone());
            }
        }
    }
    let mut config_ok = true;
    for name in &names {
        let path = dir.join(name);
        let exists = std::fs::symlink_metadata(&path).is_ok();
        let outcome = match &manifest {
            // Without its (optional) path dictionary a bundle runs uncalibrated.
            _ if name == PATHS_FILE && !exists => {
                Outcome::Ok("absent: the bundle is not calibrated".into())
            }
            Some(m) => checked(m.check_file(dir, name).map(|()| {
                format!(
                    "{} bytes, CRC-32 {}",
                    m.files[name].bytes, m.files[name].crc32
                )
            })),
            None if exists => Outcome::Unchecked("no manifest to check it against".into()),
            None => checked(Err(Error::io(
                &path,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "missing from the model bundle",
                ),
            ))),
        };
        config_ok &= !(name == CONFIG_FILE && matches!(outcome, Outcome::Bad(_)));
        push(name, outcome);
    }
    // `experts.bin` blob by blob, as the (intact) config lays it out.
    if !config_ok {
        return Ok(checks);
    }
    let store = BundleConfig::load(&dir.join(CONFIG_FILE)).and_then(|config| {
        ExpertStore::open(&dir.join(EXPERTS_FILE), &config.model.expert_layout())
    });
    match store {
        Err(e) => push(&format!("{EXPERTS_FILE} blobs"), checked(Err(e))),
        Ok(store) => {
            let mut slot = crate::store::AlignedBuf::new(store.max_padded_expert_bytes() as usize);
            let experts = &store.index().experts;
            let mut bad = 0;
            for e in experts {
                if let Err(err) = store.read_expert(e.id, slot.as_mut_slice()) {
                    bad += 1;
                    push(&format!("{EXPERTS_FILE} {}", e.id), checked(Err(err)));
                }
            }
            if bad == 0 {
                push(
                    &format!("{EXPERTS_FILE} blobs"),
                    Outcome::Ok(format!(
                        "{} experts, each matches its CRC-32",
                        experts.len()
                    )),
                );
            }
        }
    }
    Ok(checks)
}
