//! `probe-storage`: measure read throughput against read size and reads in flight, bypassing
//! the page cache, so a user can write a device profile for their own board (as in LLM in a
//! flash, Figure 2b: large reads and several in flight reach the sequential bandwidth).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::config::profile::MeasuredStorage;
use crate::error::{Error, Result};
use crate::interrupt::RemoveOnInterrupt;
use crate::store::AlignedBuf;
use crate::units::format_bytes;

pub const READ_SIZES: [u64; 6] = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20];
pub const IN_FLIGHT: [usize; 5] = [1, 2, 4, 8, 16];

#[derive(Debug, Clone, Serialize)]
pub struct ProbeResult {
    pub read_bytes: u64,
    pub in_flight: usize,
    pub bytes_per_s: f64,
    pub reads_per_s: f64,
    /// Mean time of one read.
    pub latency_us: f64,
}

/// Smallest probe: the largest read (4 MiB) twice over.
pub const MIN_PROBE_BYTES: u64 = 8 << 20;

/// A test file: `path` itself if it is a file, else a new file of `size` bytes in the directory
/// (removed when dropped, or when the run is interrupted).
pub struct ProbeFile {
    pub path: PathBuf,
    pub size: u64,
    created: bool,
    _interrupted: Option<RemoveOnInterrupt>,
}

impl ProbeFile {
    pub fn prepare(path: &Path, size: u64) -> Result<Self> {
        if path.is_file() {
            let size = std::fs::metadata(path)
                .map_err(|e| Error::io(path, e))?
                .len();
            if size < MIN_PROBE_BYTES {
                return Err(Error::Input(format!(
                    "{}: {size} bytes is too small to probe (need at least 8 MiB)",
                    path.display()
                )));
            }
            return Ok(ProbeFile {
                path: path.to_path_buf(),
                size,
                created: false,
                _interrupted: None,
            });
        }
        if !path.is_dir() {
            return Err(Error::io(
                path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
            ));
        }
        if size < MIN_PROBE_BYTES {
            return Err(Error::Input(format!(
                "a probe file of {} is too small (need at least {})",
                format_bytes(size),
                format_bytes(MIN_PROBE_BYTES)
            )));
        }
        // A size the device cannot hold is refused before a byte is written (it would fill the
        // disk and then fail).
        let free = free_bytes(path)?;
        if size > free {
            return Err(Error::Input(format!(
                "a probe file of {} does not fit in {}: {} free",
                format_bytes(size),
                path.display(),
                format_bytes(free)
            )));
        }
        let file_path = path.join(format!("edgemoe-probe-{}.bin", std::process::id()));
        // Owned (removed on drop, and on an interrupt) before it exists: a write that fails
        // half-way (a full disk) or a Ctrl-C while it is written leaves nothing behind.
        let mut probe = ProbeFile {
            _interrupted: Some(RemoveOnInterrupt::new(&file_path)),
            path: file_path,
            size: 0,
            created: true,
        };
        let file_path = probe.path.clone();
        let mut file = File::create(&file_path).map_err(|e| Error::io(&file_path, e))?;
        let mut chunk = vec![0u8; 1 << 20];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for b in chunk.iter_mut() {
            state ^= state << 7;
            state ^= state >> 9;
            *b = state as u8;
        }
        let mut written = 0;
        while written < size {
            file.write_all(&chunk)
                .map_err(|e| Error::io(&file_path, e))?;
            written += chunk.len() as u64;
        }
        file.sync_all().map_err(|e| Error::io(&file_path, e))?;
        probe.size = written;
        Ok(probe)
    }
}

/// Bytes an unprivileged user may still write on the filesystem holding `dir`.
fn free_bytes(dir: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let name = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| Error::Input(format!("{}: a path with a NUL byte", dir.display())))?;
    // SAFETY: statvfs fills a struct we own from a NUL-terminated path.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(name.as_ptr(), &mut stat) } != 0 {
        return Err(Error::io(dir, std::io::Error::last_os_error()));
    }
    Ok((stat.f_bavail as u64).saturating_mul(stat.f_frsize as u64))
}

impl Drop for ProbeFile {
    fn drop(&mut self) {
        if self.created {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Throughput growth below which more reads in flight are not worth keeping (10%).
pub const DEPTH_GAIN: f64 = 1.10;

/// A profile's storage figures from a probe's results: the bandwidth is the best throughput of
/// the largest reads; the latency is the mean time of one 4 KiB read alone; the queue depth is
/// the number of reads in flight past which doubling them gains less than [`DEPTH_GAIN`] (for
/// reads of 1 MiB, the size of an expert of a real model, or the largest measured).
pub fn storage_figures(results: &[ProbeResult]) -> Option<MeasuredStorage> {
    let largest = results.iter().map(|r| r.read_bytes).max()?;
    let smallest = results.iter().map(|r| r.read_bytes).min()?;
    let read_bytes_per_s = results
        .iter()
        .filter(|r| r.read_bytes == largest)
        .map(|r| r.bytes_per_s)
        .fold(0.0, f64::max);
    let read_latency_us = results
        .iter()
        .find(|r| r.read_bytes == smallest && r.in_flight == 1)?
        .latency_us;
    let depth_size = if results.iter().any(|r| r.read_bytes == 1 << 20) {
        1 << 20
    } else {
        largest
    };
    let mut by_depth: Vec<(usize, f64)> = results
        .iter()
        .filter(|r| r.read_bytes == depth_size)
        .map(|r| (r.in_flight, r.bytes_per_s))
        .collect();
    by_depth.sort_by_key(|&(d, _)| d);
    let mut queue_depth = by_depth.first()?.0;
    for pair in by_depth.windows(2) {
        let ((_, slow), (deeper, fast)) = (pair[0], pair[1]);
        if fast < slow * DEPTH_GAIN {
            break;
        }
        queue_depth = deeper;
    }
    Some(MeasuredStorage {
        read_bytes_per_s,
        read_latency_us,
        queue_depth,
    })
}

/// Random aligned reads of `read_bytes` with `in_flight` threads for `duration`.
pub fn measure(
    file: &ProbeFile,
    read_bytes: u64,
    in_flight: usize,
    duration: Duration,
) -> Result<ProbeResult> {
    let (direct, warning) = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&file.path)
    {
        Ok(f) => (f, false),
        Err(_) => (
            File::open(&file.path).map_err(|e| Error::io(&file.path, e))?,
            true,
        ),
    };
    let _ = warning;
    let direct = Arc::new(direct);
    let reads = Arc::new(AtomicU64::new(0));
    let busy_ns = Arc::new(AtomicU64::new(0));
    let blocks = (file.size / read_bytes).max(1);
    let started = Instant::now();
    let mut threads = Vec::new();
    for t in 0..in_flight {
        let (direct, reads, busy_ns) = (direct.clone(), reads.clone(), busy_ns.clone());
        threads.push(std::thread::spawn(move || -> std::io::Result<()> {
            let mut buf = AlignedBuf::new(read_bytes as usize);
            let mut state = 0x2545_f491_4f6c_dd1du64 ^ (t as u64 + 1).wrapping_mul(0x9e37_79b9);
            while started.elapsed() < duration {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let offset = (state % blocks) * read_bytes;
                let t0 = Instant::now();
                direct.read_exact_at(buf.as_mut_slice(), offset)?;
                busy_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
                reads.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        }));
    }
    for t in threads {
        t.join()
            .map_err(|_| Error::Internal("a probe thread panicked".into()))?
            .map_err(|e| Error::io(&file.path, e))?;
    }
    let secs = started.elapsed().as_secs_f64();
    let n = reads.load(Ordering::Relaxed);
    Ok(ProbeResult {
        read_bytes,
        in_flight,
        bytes_per_s: n as f64 * read_bytes as f64 / secs,
        reads_per_s: n as f64 / secs,
        latency_us: busy_ns.load(Ordering::Relaxed) as f64 / n.max(1) as f64 / 1e3,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(read_bytes: u64, in_flight: usize, mb_per_s: f64) -> ProbeResult {
        ProbeResult {
            read_bytes,
            in_flight,
            bytes_per_s: mb_per_s * 1e6,
            reads_per_s: mb_per_s * 1e6 / read_bytes as f64,
            latency_us: read_bytes as f64 / mb_per_s,
        }
    }

    #[test]
    fn the_queue_depth_is_where_more_reads_stop_paying() {
        // NVMe-like: gains up to 4 in flight, then under 10%.
        let mut results = Vec::new();
        for (size, scale) in [(4 << 10, 0.1), (1 << 20, 1.0), (4 << 20, 1.1)] {
            for (depth, mb) in [(1, 200.0), (2, 330.0), (4, 430.0), (8, 450.0), (16, 455.0)] {
                results.push(result(size, depth, mb * scale));
            }
        }
        let m = storage_figures(&results).unwrap();
        assert_eq!(m.queue_depth, 4);
        assert!((m.read_bytes_per_s - 455.0 * 1.1 * 1e6).abs() < 1.0);
        assert!((m.read_latency_us - 4096.0 / 20.0).abs() < 1e-6);
        // SD-like: nothing gained from a second read.
        let flat: Vec<ProbeResult> = [1, 2, 4]
            .iter()
            .flat_map(|&d| [result(4 << 10, d, 5.0), result(1 << 20, d, 40.0 + d as f64)])
            .collect();
        assert_eq!(storage_figures(&flat).unwrap().queue_depth, 1);
        assert!(storage_figures(&[]).is_none());
    }
}
