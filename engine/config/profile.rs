//! Device profiles: what a board gives the engine — memory budget, storage read bandwidth and
//! per-read latency and queue depth (reads the device serves at once), threads, device, default
//! eviction policy and prefetch cap. Profiles are TOML
//! files (`profiles/*.toml`, compiled into the binary so a board needs no repository); a path to
//! a file works too. Explicit command-line flags override a profile.

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::cache::Policy;
use crate::error::{Error, Result};
use crate::units::parse_bytes;

/// The built-in profiles: (name, TOML text).
pub const BUILT_IN: [(&str, &str); 6] = [
    ("rpi4-sd", include_str!("../../profiles/rpi4-sd.toml")),
    ("rpi5-sd", include_str!("../../profiles/rpi5-sd.toml")),
    ("rpi5-nvme", include_str!("../../profiles/rpi5-nvme.toml")),
    (
        "jetson-tx2-ssd",
        include_str!("../../profiles/jetson-tx2-ssd.toml"),
    ),
    (
        "jetson-tx2-hdd",
        include_str!("../../profiles/jetson-tx2-hdd.toml"),
    ),
    (
        "jetson-orin-nano-nvme",
        include_str!("../../profiles/jetson-orin-nano-nvme.toml"),
    ),
];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProfileFile {
    name: String,
    description: Option<String>,
    memory_budget: String,
    storage_read_bandwidth: String,
    storage_read_latency_us: f64,
    /// Absent in profiles written before it existed: one read at a time.
    #[serde(default = "one")]
    storage_queue_depth: usize,
    threads: usize,
    device: String,
    policy: String,
    prefetch_cap: String,
}

fn one() -> usize {
    1
}

/// Most reads in flight a profile may ask for.
pub const MAX_QUEUE_DEPTH: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

/// `cpu`, `cuda` or `cuda:N` → a libtorch device, checking that CUDA is there when asked for.
pub fn parse_device(text: &str) -> Result<tch::Device> {
    let device = match text {
        "cpu" => return Ok(tch::Device::Cpu),
        "cuda" => tch::Device::Cuda(0),
        other => match other
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok())
        {
            Some(n) => tch::Device::Cuda(n),
            None => {
                return Err(Error::Input(format!(
                    "unknown device `{other}` (expected cpu, cuda or cuda:N)"
                )))
            }
        },
    };
    if !tch::Cuda::is_available() {
        return Err(Error::Input(format!(
            "device `{text}`: no CUDA device is available to this libtorch (pass --device cpu)"
        )));
    }
    Ok(device)
}

/// A validated profile.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceProfile {
    pub name: String,
    pub description: String,
    pub budget_bytes: u64,
    /// Sequential read bandwidth, bytes per second.
    pub read_bytes_per_s: f64,
    /// Fixed cost of one read.
    pub read_latency: Duration,
    /// Reads worth keeping in flight: the I/O scheduler's readers, the emulated device's
    /// channels.
    pub queue_depth: usize,
    pub threads: usize,
    pub device: DeviceKind,
    pub policy: Policy,
    pub prefetch_cap_bytes: u64,
}

impl DeviceProfile {
    /// A built-in profile by name, or a TOML file by path.
    pub fn load(name_or_path: &str) -> Result<Self> {
        if let Some((_, text)) = BUILT_IN.iter().find(|(n, _)| *n == name_or_path) {
            return Self::parse(text, Path::new(&format!("<built-in {name_or_path}>")));
        }
        let path = Path::new(name_or_path);
        if !path.exists() {
            let names: Vec<&str> = BUILT_IN.iter().map(|(n, _)| *n).collect();
            return Err(Error::Input(format!(
                "unknown profile `{name_or_path}`: not a file, and not one of {}",
                names.join(", ")
            )));
        }
        let text = crate::io::read_input_text(path)?;
        Self::parse(&text, path)
    }

    /// Parses and validates profile TOML; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let bad = |message: String| Error::format(path, message);
        let file: ProfileFile =
            toml::from_str(text).map_err(|e| bad(format!("invalid profile: {e}")))?;
        let size = |field: &str, value: &str| {
            parse_bytes(value).map_err(|_| bad(format!("`{field}` = {value:?} is not a size")))
        };
        let budget_bytes = size("memory_budget", &file.memory_budget)?;
        let bandwidth = size("storage_read_bandwidth", &file.storage_read_bandwidth)?;
        if budget_bytes == 0 || bandwidth == 0 {
            return Err(bad(
                "`memory_budget` and `storage_read_bandwidth` must be positive".into(),
            ));
        }
        if !(0.0..=1e7).contains(&file.storage_read_latency_us) {
            return Err(bad(format!(
                "`storage_read_latency_us` = {} must be between 0 and 10 s",
                file.storage_read_latency_us
            )));
        }
        if file.storage_queue_depth == 0 || file.storage_queue_depth > MAX_QUEUE_DEPTH {
            return Err(bad(format!(
                "`storage_queue_depth` = {} must be 1–{MAX_QUEUE_DEPTH}",
                file.storage_queue_depth
            )));
        }
        if file.threads == 0 || file.threads > 256 {
            return Err(bad(format!("`threads` = {} must be 1–256", file.threads)));
        }
        let device = match file.device.as_str() {
            "cpu" => DeviceKind::Cpu,
            "cuda" => DeviceKind::Cuda,
            other => {
                return Err(bad(format!(
                    "`device` = {other:?} (expected \"cpu\" or \"cuda\")"
                )))
            }
        };
        let policy: Policy = file.policy.parse().map_err(bad)?;
        if policy == Policy::Belady {
            return Err(bad("`policy` = \"belady\" exists for replay only".into()));
        }
        Ok(DeviceProfile {
            name: file.name,
            description: file.description.unwrap_or_default(),
            budget_bytes,
            read_bytes_per_s: bandwidth as f64,
            read_latency: Duration::from_secs_f64(file.storage_read_latency_us / 1e6),
            queue_depth: file.storage_queue_depth,
            threads: file.threads,
            device,
            policy,
            prefetch_cap_bytes: size("prefetch_cap", &file.prefetch_cap)?,
        })
    }
}

/// What `probe-storage` measured on a board's storage.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MeasuredStorage {
    pub read_bytes_per_s: f64,
    pub read_latency_us: f64,
    pub queue_depth: usize,
}

/// The TOML of a profile named `name`: `base`'s text (a built-in name or a file, as
/// [`DeviceProfile::load`] takes) with its storage figures replaced by `measured`. The result is
/// checked by parsing it back.
pub fn derive_profile_toml(base: &str, name: &str, measured: &MeasuredStorage) -> Result<String> {
    let (text, origin) = match BUILT_IN.iter().find(|(n, _)| *n == base) {
        Some((_, text)) => (text.to_string(), format!("built-in profile {base}")),
        None => (
            crate::io::read_input_text(Path::new(base))?,
            format!("profile {base}"),
        ),
    };
    let base_path = Path::new(base);
    DeviceProfile::parse(&text, base_path)?;
    let mut table: toml::Table = toml::from_str(&text)
        .map_err(|e| Error::format(base_path, format!("invalid profile: {e}")))?;
    let description = table
        .get("description")
        .and_then(|d| d.as_str())
        .unwrap_or("")
        .to_string();
    table.insert("name".into(), name.into());
    table.insert(
        "description".into(),
        format!("{description} (storage measured by probe-storage)").into(),
    );
    table.insert(
        "storage_read_bandwidth".into(),
        format!("{}B", measured.read_bytes_per_s.round() as u64).into(),
    );
    table.insert(
        "storage_read_latency_us".into(),
        (measured.read_latency_us.round().clamp(0.0, 1e7) as i64).into(),
    );
    table.insert(
        "storage_queue_depth".into(),
        (measured.queue_depth.clamp(1, MAX_QUEUE_DEPTH) as i64).into(),
    );
    let body = toml::to_string(&table)
        .map_err(|e| Error::Internal(format!("cannot write a profile: {e}")))?;
    let out = format!(
        "# Written by `edgemoe probe-storage --write-profile` from the {origin}: storage bandwidth\n\
         # (largest reads, best depth), latency (4 KiB reads, one in flight) and queue depth\n\
         # (reads in flight past which throughput grows by less than 10%) measured here.\n{body}"
    );
    DeviceProfile::parse(&out, Path::new(name))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_in_profiles_are_valid() {
        for (name, _) in BUILT_IN {
            let p = DeviceProfile::load(name).unwrap();
            assert_eq!(p.name, name);
        }
        let pi4 = DeviceProfile::load("rpi4-sd").unwrap();
        assert_eq!(pi4.read_bytes_per_s, 30.0 * 1024.0 * 1024.0);
        assert_eq!(pi4.read_latency, Duration::from_micros(310));
        assert_eq!(pi4.queue_depth, 1);
        assert!(DeviceProfile::load("rpi5-nvme").unwrap().queue_depth > 1);
    }

    #[test]
    fn a_profile_without_a_queue_depth_reads_one_at_a_time() {
        let old = BUILT_IN[0].1.replace("storage_queue_depth = 1\n", "");
        assert!(!old.contains("storage_queue_depth"));
        let p = DeviceProfile::parse(&old, Path::new("old.toml")).unwrap();
        assert_eq!(p.queue_depth, 1);
    }

    #[test]
    fn a_derived_profile_keeps_the_base_and_takes_the_measurements() {
        let measured = MeasuredStorage {
            read_bytes_per_s: 123_456_789.0,
            read_latency_us: 77.4,
            queue_depth: 8,
        };
        let text = derive_profile_toml("rpi5-sd", "my-board", &measured).unwrap();
        let p = DeviceProfile::parse(&text, Path::new("my-board.toml")).unwrap();
        let base = DeviceProfile::load("rpi5-sd").unwrap();
        assert_eq!(p.name, "my-board");
        assert_eq!(p.read_bytes_per_s, 123_456_789.0);
        assert_eq!(p.read_latency, Duration::from_micros(77));
        assert_eq!(p.queue_depth, 8);
        assert_eq!(
            (p.budget_bytes, p.threads, p.policy, p.prefetch_cap_bytes),
            (
                base.budget_bytes,
                base.threads,
                base.policy,
                base.prefetch_cap_bytes
            )
        );
    }

    #[test]
    fn devices_parse() {
        assert_eq!(parse_device("cpu").unwrap(), tch::Device::Cpu);
        assert!(parse_device("tpu").unwrap_err().to_string().contains("tpu"));
        if !tch::Cuda::is_available() {
            let e = parse_device("cuda:1").unwrap_err().to_string();
            assert!(
                e.contains("no CUDA device") && e.contains("--device cpu"),
                "{e}"
            );
        }
    }

    #[test]
    fn bad_profiles_are_clear_errors() {
        let good = BUILT_IN[0].1;
        let check = |text: &str, needle: &str| {
            let e = DeviceProfile::parse(text, Path::new("my.toml"))
                .unwrap_err()
                .to_string();
            assert!(e.contains("my.toml") && e.contains(needle), "{e}");
        };
        check(&good.replace("\"cpu\"", "\"tpu\""), "tpu");
        check(&good.replace("\"1.5GiB\"", "\"lots\""), "memory_budget");
        check(&good.replace("threads = 3", "threads = 0"), "threads");
        check(&good.replace("\"edgemoe\"", "\"random\""), "random");
        check(
            &good.replace("threads = 3", "threads = 3\ncolour = \"red\""),
            "colour",
        );
        check(
            &good.replace("storage_read_latency_us = 310\n", ""),
            "storage_read_latency_us",
        );
        check(
            &good.replace("storage_queue_depth = 1", "storage_queue_depth = 0"),
            "storage_queue_depth",
        );
        let e = DeviceProfile::load("no-such-board")
            .unwrap_err()
            .to_string();
        assert!(e.contains("no-such-board") && e.contains("rpi4-sd"), "{e}");
    }
}
