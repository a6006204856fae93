//! Device profiles: what a board gives the engine — memory budget, storage read bandwidth and
//! per-read latency, threads, device, default eviction policy and prefetch cap. Profiles are TOML
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
    threads: usize,
    device: String,
    policy: String,
    prefetch_cap: String,
}

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
            threads: file.threads,
            device,
            policy,
            prefetch_cap_bytes: size("prefetch_cap", &file.prefetch_cap)?,
        })
    }
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
        let e = DeviceProfile::load("no-such-board")
            .unwrap_err()
            .to_string();
        assert!(e.contains("no-such-board") && e.contains("rpi4-sd"), "{e}");
    }
}
