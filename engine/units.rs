//! Sizes as people write them: `1.5GiB` ↔ bytes. A leaf: it imports nothing from the crate
//! (the error type formats budgets with it), so a size that does not parse is an
//! [`InvalidSize`], which converts into the crate's `Error::Input`.

use std::fmt;

/// A size that does not parse; its text says what was wrong and what is expected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidSize(pub String);

impl fmt::Display for InvalidSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InvalidSize {}

/// Parses `1.5GiB`, `512MiB`, `2GB`, `800M`, `1048576` (bytes). Binary units (KiB, MiB, GiB)
/// are powers of 1024; decimal ones (KB, MB, GB) powers of 1000; a bare `K`/`M`/`G` is binary.
pub fn parse_bytes(text: &str) -> Result<u64, InvalidSize> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number.parse().map_err(|_| {
        InvalidSize(format!(
            "invalid size `{text}`: expected e.g. 1.5GiB, 512MiB or a number of bytes"
        ))
    })?;
    let multiplier: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        other => {
            return Err(InvalidSize(format!(
                "invalid size `{text}`: unknown unit `{other}` (use B, KiB, MiB, GiB, KB, MB or GB)"
            )))
        }
    };
    let bytes = value * multiplier;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(InvalidSize(format!("invalid size `{text}`")));
    }
    Ok(bytes.round() as u64)
}

/// `1.50 GiB`, `12.0 MiB`, `512 B`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    let digits = if value < 10.0 { 2 } else { 1 };
    format!("{value:.digits$} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_bytes("1.5GiB").unwrap(), 1_610_612_736);
        assert_eq!(parse_bytes("512MiB").unwrap(), 536_870_912);
        assert_eq!(parse_bytes("2GB").unwrap(), 2_000_000_000);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes(" 64 k ").unwrap(), 65536);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("1.5 parsecs").is_err());
        assert!(parse_bytes("").is_err());
    }

    #[test]
    fn formats_units() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(1_610_612_736), "1.50 GiB");
        assert_eq!(format_bytes(12 * 1024 * 1024), "12.0 MiB");
    }
}
