//! Weight files: the one place that memory-maps, reading safetensors files (a Hugging Face
//! checkpoint, single or sharded, or a bundle's `resident.safetensors`).
//!
//! Resident weights are *copied* out of the map at load time, f32 tensors as f32 and f16/bf16/INT8
//! matrices in their stored form ([`TensorLoader::take_stored`]): the copy lets the map (and its
//! page-cache pages) go once loading is done, and owned anonymous memory is never evicted by the
//! kernel the way clean file-backed pages are (boards run without swap, so resident weights stay
//! in RAM).
//!
//! A model takes its weights through a [`TensorLoader`], which exists only inside
//! [`WeightFiles::load_all`]: once the model has taken what it needs, a tensor left in the
//! files is an error naming it (the file and the model disagree).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, SafeTensors};
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::quant::matrix::{MatrixFormat, PackedMatrix};
use crate::quant::QuantBits;

/// Element type of a stored weight, as the engine names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum WeightDtype {
    F32,
    F16,
    BF16,
}

impl WeightDtype {
    pub fn from_safetensors(dtype: Dtype) -> Option<Self> {
        match dtype {
            Dtype::F32 => Some(WeightDtype::F32),
            Dtype::F16 => Some(WeightDtype::F16),
            Dtype::BF16 => Some(WeightDtype::BF16),
            _ => None,
        }
    }

    pub fn to_safetensors(self) -> Dtype {
        match self {
            WeightDtype::F32 => Dtype::F32,
            WeightDtype::F16 => Dtype::F16,
            WeightDtype::BF16 => Dtype::BF16,
        }
    }

    pub fn kind(self) -> Kind {
        match self {
            WeightDtype::F32 => Kind::Float,
            WeightDtype::F16 => Kind::Half,
            WeightDtype::BF16 => Kind::BFloat16,
        }
    }

    pub fn size_bytes(self) -> usize {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::F16 | WeightDtype::BF16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "f32",
            WeightDtype::F16 => "f16",
            WeightDtype::BF16 => "bf16",
        }
    }
}

/// A whole file mapped read-only: the `mmap` baseline maps the expert store with it and asks
/// which pages a touch would fault in.
pub struct MappedBytes {
    map: Mmap,
}

const PAGE: usize = 4096;

impl MappedBytes {
    pub fn open(path: &Path) -> Result<Self> {
        let file = crate::io::open_file(path)?;
        // SAFETY: read-only map of a file the engine does not modify while it runs (the same
        // contract as the safetensors loader below).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Ok(MappedBytes { map })
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.map
    }

    /// Bytes of `start..start + len` whose pages are not in memory (the page-ins a touch
    /// will cause), by `mincore`; 0 where the kernel does not answer.
    pub fn missing_bytes(&self, start: usize, len: usize) -> u64 {
        let first = start / PAGE * PAGE;
        let pages = (start + len - first).div_ceil(PAGE);
        let Some(resident) = self.mincore(first, pages) else {
            return 0;
        };
        resident.iter().filter(|&&r| r & 1 == 0).count() as u64 * PAGE as u64
    }

    /// Which pages of `start..start + len` (clipped to the map) are in memory now; `None` where
    /// the kernel does not answer.
    pub fn resident_pages(&self, start: usize, len: usize) -> Option<PageMap> {
        let first = (start / PAGE).min(self.map.len().div_ceil(PAGE));
        let end = (start.saturating_add(len))
            .min(self.map.len())
            .div_ceil(PAGE);
        let pages = end.saturating_sub(first);
        self.mincore(first * PAGE, pages)
            .map(|resident| PageMap { first, resident })
    }

    /// `mincore` over `pages` pages from byte `first` (a page boundary).
    fn mincore(&self, first: usize, pages: usize) -> Option<Vec<u8>> {
        if pages == 0 {
            return Some(Vec::new());
        }
        let mut resident = vec![0u8; pages];
        // SAFETY: the range lies inside the live mapping; `resident` has one byte per page.
        let rc = unsafe {
            libc::mincore(
                self.map.as_ptr().add(first) as *mut libc::c_void,
                pages * PAGE,
                resident.as_mut_ptr(),
            )
        };
        (rc == 0).then_some(resident)
    }
}

/// A snapshot of which pages of a window of a [`MappedBytes`] were in memory.
pub struct PageMap {
    /// Index of the window's first page.
    first: usize,
    /// Bit 0 of each byte, as `mincore` writes it: resident.
    resident: Vec<u8>,
}

impl PageMap {
    fn is_resident(&self, page: usize) -> Option<bool> {
        let i = page.checked_sub(self.first)?;
        self.resident.get(i).map(|r| r & 1 == 1)
    }

    /// Bytes of the pages resident in `self` that `before` saw absent: what the kernel read in
    /// between (faults, and its read-ahead past what was touched). Pages outside `before`'s
    /// window are not counted.
    pub fn paged_in_since(&self, before: &PageMap) -> u64 {
        let new = (self.first..self.first + self.resident.len())
            .filter(|&p| self.is_resident(p) == Some(true) && before.is_resident(p) == Some(false))
            .count();
        new as u64 * PAGE as u64
    }

    /// Bytes of `start..start + len` whose pages are not resident in this snapshot (pages
    /// outside its window count as not resident).
    pub fn missing_bytes(&self, start: usize, len: usize) -> u64 {
        if len == 0 {
            return 0;
        }
        let missing = (start / PAGE..(start + len).div_ceil(PAGE))
            .filter(|&p| self.is_resident(p) != Some(true))
            .count();
        missing as u64 * PAGE as u64
    }
}

/// One memory-mapped safetensors file and its parsed header.
struct MappedFile {
    path: PathBuf,
    map: Mmap,
    header_len: usize,
    metadata: Metadata,
}

impl MappedFile {
    fn open(path: &Path) -> Result<Self> {
        let file = crate::io::open_file(path)?;
        // SAFETY: the map is read-only and lives as long as this struct. Files under a model
        // directory are not expected to change while the engine runs; if one is truncated
        // concurrently, reads may fault, which is the documented risk of every mmap loader.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let (header_len, metadata) = SafeTensors::read_metadata(&map)
            .map_err(|e| Error::format(path, format!("not a valid safetensors file: {e}")))?;
        Ok(MappedFile {
            path: path.to_path_buf(),
            map,
            header_len,
            metadata,
        })
    }

    fn bytes(&self, name: &str) -> Option<(&[u8], Dtype, &[usize])> {
        let info = self.metadata.info(name)?;
        let start = 8 + self.header_len + info.data_offsets.0;
        let end = 8 + self.header_len + info.data_offsets.1;
        Some((&self.map[start..end], info.dtype, &info.shape))
    }
}

/// A borrowed view of one stored tensor.
pub struct TensorBytes<'a> {
    pub name: &'a str,
    pub path: &'a Path,
    pub dtype: WeightDtype,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

/// A set of safetensors files addressed by tensor name.
pub struct WeightFiles {
    files: Vec<MappedFile>,
    location: HashMap<String, usize>,
}

impl WeightFiles {
    /// Opens a single safetensors file.
    pub fn open_file(path: &Path) -> Result<Self> {
        let file = MappedFile::open(path)?;
        let location = file
            .metadata
            .tensors()
            .into_keys()
            .map(|name| (name, 0))
            .collect();
        Ok(WeightFiles {
            files: vec![file],
            location,
        })
    }

    /// Opens a Hugging Face checkpoint directory: `model.safetensors`, or the shards listed in
    /// `model.safetensors.index.json`.
    pub fn open_hf_dir(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        if single.exists() {
            return Self::open_file(&single);
        }
        if !index_path.exists() {
            return Err(Error::io(
                &single,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no model.safetensors (nor model.safetensors.index.json for a sharded checkpoint)",
                ),
            ));
        }
        #[derive(serde::Deserialize)]
        struct ShardIndex {
            weight_map: BTreeMap<String, String>,
        }
        let index: ShardIndex = crate::io::read_json(&index_path)?;
        let mut shard_names: Vec<&String> = index.weight_map.values().collect();
        shard_names.sort();
        shard_names.dedup();
        let mut files = Vec::new();
        let mut shard_of = HashMap::new();
        for name in shard_names {
            if name.contains('/') || name.contains("..") {
                return Err(Error::format(
                    &index_path,
                    format!("shard name `{name}` must be a file in the checkpoint directory"),
                ));
            }
            shard_of.insert(name.clone(), files.len());
            files.push(MappedFile::open(&dir.join(name))?);
        }
        let mut location = HashMap::new();
        for (tensor, shard) in &index.weight_map {
            let i = shard_of[shard];
            if files[i].metadata.info(tensor).is_none() {
                return Err(Error::tensor(
                    &files[i].path,
                    tensor,
                    "listed in model.safetensors.index.json but not in this shard",
                ));
            }
            location.insert(tensor.clone(), i);
        }
        Ok(WeightFiles { files, location })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.location.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.location.keys().map(String::as_str)
    }

    /// `name`'s shape, or `None` when no file holds it.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.raw(name).ok().map(|raw| raw.shape)
    }

    /// Where a missing tensor would have been looked for (for error messages).
    pub fn describe(&self) -> PathBuf {
        match self.files.as_slice() {
            [one] => one.path.clone(),
            [first, ..] => first.path.parent().unwrap_or(&first.path).to_path_buf(),
            [] => PathBuf::from("<no weight files>"),
        }
    }

    /// `name`'s bytes, safetensors dtype and shape, with the file it is in.
    fn raw(&self, name: &str) -> Result<RawTensor<'_>> {
        let Some((key, &i)) = self.location.get_key_value(name) else {
            return Err(Error::tensor(self.describe(), name, "missing"));
        };
        let file = &self.files[i];
        let (data, dtype, shape) = file
            .bytes(name)
            .ok_or_else(|| Error::tensor(&file.path, name, "missing"))?;
        Ok(RawTensor {
            name: key.as_str(),
            path: &file.path,
            dtype,
            shape,
            data,
        })
    }

    /// The raw bytes of `name`, checked against `expected_shape`.
    pub fn get(&self, name: &str, expected_shape: &[usize]) -> Result<TensorBytes<'_>> {
        let raw = self.raw(name)?;
        let dtype = WeightDtype::from_safetensors(raw.dtype).ok_or_else(|| {
            Error::tensor(
                raw.path,
                name,
                format!("dtype {:?} (expected F32, F16 or BF16)", raw.dtype),
            )
        })?;
        raw.check_shape(expected_shape)?;
        Ok(TensorBytes {
            name: raw.name,
            path: raw.path,
            dtype,
            shape: raw.shape,
            data: raw.data,
        })
    }

    /// Loads `name` as an owned f32 tensor of `expected_shape`.
    pub fn load_f32(&self, name: &str, expected_shape: &[usize]) -> Result<Tensor> {
        let bytes = self.get(name, expected_shape)?;
        bytes.to_f32_tensor()
    }

    /// Runs `build` with a loader over these files, then fails, naming the tensor, on any tensor
    /// of the files that `build` did not take.
    pub fn load_all<T>(&self, build: impl FnOnce(&mut TensorLoader<'_>) -> Result<T>) -> Result<T> {
        let mut loader = TensorLoader {
            files: self,
            taken: HashSet::new(),
        };
        let value = build(&mut loader)?;
        loader.finish()?;
        Ok(value)
    }
}

/// Takes tensors out of a [`WeightFiles`] by name and remembers which it took; see
/// [`WeightFiles::load_all`].
pub struct TensorLoader<'a> {
    files: &'a WeightFiles,
    taken: HashSet<&'a str>,
}

impl<'a> TensorLoader<'a> {
    /// The raw bytes of `name`, checked against `expected_shape`.
    pub fn take(&mut self, name: &str, expected_shape: &[usize]) -> Result<TensorBytes<'a>> {
        let bytes = self.files.get(name, expected_shape)?;
        self.taken.insert(bytes.name);
        Ok(bytes)
    }

    /// `name` as an owned f32 tensor of `expected_shape`.
    pub fn take_f32(&mut self, name: &str, expected_shape: &[usize]) -> Result<Tensor> {
        self.take(name, expected_shape)?.to_f32_tensor()
    }

    /// `name` as the engine holds it: a matrix stored as f16, bf16, INT8 (I8) or INT4 (U8
    /// `[rows, ⌈cols / 2⌉]`, two codes a byte), the integer ones with per-row scales in
    /// `{name}.scales` (see [`matrix_scales_name`]), stays in that form; anything else (f32, and
    /// 1-D f16/bf16 vectors) becomes an owned f32 tensor.
    pub fn take_stored(&mut self, name: &str, expected_shape: &[usize]) -> Result<Stored> {
        let raw = self.files.raw(name)?;
        let format = match (raw.dtype, expected_shape.len()) {
            (Dtype::I8, 2) => Some(MatrixFormat::Quant(QuantBits::Int8)),
            (Dtype::U8, 2) => Some(MatrixFormat::Quant(QuantBits::Int4)),
            (Dtype::F16, 2) => Some(MatrixFormat::F16),
            (Dtype::BF16, 2) => Some(MatrixFormat::Bf16),
            _ => None,
        };
        match format {
            // Packed INT4 rows: the stored shape counts bytes, not values.
            Some(MatrixFormat::Quant(bits)) if bits != QuantBits::Int8 => {
                raw.check_shape(&[expected_shape[0], bits.row_bytes(expected_shape[1])])?
            }
            _ => raw.check_shape(expected_shape)?,
        }
        let stored = match format {
            Some(format) => {
                let (rows, cols) = (expected_shape[0], expected_shape[1]);
                let scales = match format {
                    MatrixFormat::Quant(_) => {
                        let scales = self.take_f32(&matrix_scales_name(name), &[rows])?;
                        Vec::<f32>::try_from(&scales)?
                    }
                    _ => Vec::new(),
                };
                let m = PackedMatrix::new(format, rows, cols, raw.data, scales)
                    .map_err(|e| Error::tensor(raw.path, name, e.to_string()))?;
                Stored::Matrix(m)
            }
            None => Stored::F32(self.files.get(name, expected_shape)?.to_f32_tensor()?),
        };
        self.taken.insert(raw.name);
        Ok(stored)
    }

    /// Fails on the first (by name) tensor not taken.
    fn finish(self) -> Result<()> {
        let mut left: Vec<&str> = self
            .files
            .names()
            .filter(|n| !self.taken.contains(n))
            .collect();
        left.sort_unstable();
        match left.first() {
            None => Ok(()),
            Some(&name) => {
                let file = &self.files.files[self.files.location[name]];
                let message = match left.len() {
                    1 => "not used by the model".to_string(),
                    n => format!("not used by the model ({n} unused tensors)"),
                };
                Err(Error::tensor(&file.path, name, message))
            }
        }
    }
}

/// A tensor as [`TensorLoader::take_stored`] gives it.
pub enum Stored {
    F32(Tensor),
    Matrix(PackedMatrix),
}

/// The tensor holding the per-row scales of integer matrix `name` in a resident file.
pub fn matrix_scales_name(name: &str) -> String {
    format!("{name}.scales")
}

struct RawTensor<'a> {
    name: &'a str,
    path: &'a Path,
    dtype: Dtype,
    shape: &'a [usize],
    data: &'a [u8],
}

impl RawTensor<'_> {
    fn check_shape(&self, expected: &[usize]) -> Result<()> {
        if self.shape != expected {
            return Err(Error::tensor(
                self.path,
                self.name,
                format!("shape {:?}, expected {expected:?}", self.shape),
            ));
        }
        Ok(())
    }
}

impl TensorBytes<'_> {
    /// An owned f32 copy (f16/bf16 are widened exactly).
    pub fn to_f32_tensor(&self) -> Result<Tensor> {
        let shape: Vec<i64> = self.shape.iter().map(|&d| d as i64).collect();
        let stored = Tensor::f_from_data_size(self.data, &shape, self.dtype.kind())?;
        Ok(stored.f_to_kind(Kind::Float)?.f_to_device(Device::Cpu)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    /// A file holding `a` `[2]` and `b` `[1]` (f32).
    fn two_tensors(dir: &Path) -> PathBuf {
        let path = dir.join("two.safetensors");
        let (a, b) = ([0u8; 8], [0u8; 4]);
        let views = vec![
            ("a", TensorView::new(Dtype::F32, vec![2], &a).unwrap()),
            ("b", TensorView::new(Dtype::F32, vec![1], &b).unwrap()),
        ];
        safetensors::tensor::serialize_to_file(views, None, &path).unwrap();
        path
    }

    #[test]
    fn load_all_fails_naming_a_tensor_left_unused() {
        let dir = tempfile::tempdir().unwrap();
        let path = two_tensors(dir.path());
        let files = WeightFiles::open_file(&path).unwrap();

        let taken = files.load_all(|t| {
            let _a = t.take_f32("a", &[2])?;
            t.take("b", &[1]).map(|b| b.name.to_string())
        });
        assert_eq!(taken.unwrap(), "b");

        let err = files
            .load_all(|t| t.take_f32("a", &[2]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("two.safetensors"), "{err}");
        assert!(err.contains("tensor `b`: not used by the model"), "{err}");

        let err = files.load_all(|_| Ok(())).unwrap_err().to_string();
        assert!(
            err.contains("tensor `a`: not used by the model (2 unused tensors)"),
            "{err}"
        );

        // A failed take is reported as itself, not as leftovers.
        let err = files
            .load_all(|t| t.take_f32("a", &[3]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("tensor `a`: shape [2], expected [3]"), "{err}");
    }
}
