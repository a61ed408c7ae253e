//! Host memory for unified-memory GPUs (DGX Spark / GB10), where NVML
//! answers NOT_SUPPORTED for memory info because CPU and GPU share the
//! host's RAM: the figures come from `<path.procfs>/meminfo`, as nvtop,
//! nvitop, all-smi and gpud do. total = MemTotal, free = MemAvailable
//! (what can be allocated without swapping, page cache included), used =
//! total − available; no reserved figure.
//!
//! Hand-written: two `Key:   N kB` lines are all we need, and a crate for
//! that would read far more of /proc than this.

use std::path::Path;

use crate::model::MemoryInfo;

/// Why the host's memory could not be read.
#[derive(Debug, thiserror::Error)]
pub(super) enum MeminfoError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} has no {key} line")]
    Missing { path: String, key: &'static str },
}

/// `<procfs>/meminfo` as unified memory.
pub(super) fn read(procfs: &Path) -> Result<MemoryInfo, MeminfoError> {
    let path = procfs.join("meminfo");
    let text = std::fs::read_to_string(&path).map_err(|source| MeminfoError::Read {
        path: path.display().to_string(),
        source,
    })?;
    parse(&text).map_err(|key| MeminfoError::Missing {
        path: path.display().to_string(),
        key,
    })
}

/// The figures of a meminfo text; `Err(key)` names the line missing.
pub(super) fn parse(text: &str) -> Result<MemoryInfo, &'static str> {
    const TOTAL: &str = "MemTotal";
    const AVAILABLE: &str = "MemAvailable";
    let total = field(text, TOTAL).ok_or(TOTAL)?;
    // Never above the total, even in a file written by hand.
    let available = field(text, AVAILABLE).ok_or(AVAILABLE)?.min(total);
    Ok(MemoryInfo {
        total,
        reserved: None,
        used: total - available,
        free: available,
    })
}

/// `Key:   N kB` → N × 1024 bytes (the kernel's "kB" is KiB).
fn field(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(key)?.strip_prefix(':')?;
        let mut words = rest.split_whitespace();
        let n: u64 = words.next()?.parse().ok()?;
        match words.next() {
            Some("kB") => n.checked_mul(1024),
            None => Some(n),
            Some(_) => None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first lines of a DGX Spark's /proc/meminfo (128 GB LPDDR5X).
    const SPARK: &str = "MemTotal:       128452000 kB\n\
                         MemFree:        90118412 kB\n\
                         MemAvailable:   112233444 kB\n\
                         Buffers:           10240 kB\n\
                         Cached:         20480000 kB\n";

    #[test]
    fn total_available_and_used() {
        assert_eq!(
            parse(SPARK),
            Ok(MemoryInfo {
                total: 128_452_000 * 1024,
                reserved: None,
                used: (128_452_000 - 112_233_444) * 1024,
                free: 112_233_444 * 1024,
            })
        );
    }

    #[test]
    fn missing_or_odd_lines() {
        assert_eq!(parse("MemTotal: 10 kB\n"), Err("MemAvailable"));
        assert_eq!(parse("MemAvailable: 10 kB\n"), Err("MemTotal"));
        // A prefix of another key is not the key.
        assert_eq!(
            parse("MemTotalX: 1 kB\nMemTotal: 8 kB\nMemAvailable: 2 kB\n").map(|m| m.used),
            Ok(6 * 1024)
        );
        assert_eq!(
            parse("MemTotal: 8 MB\nMemAvailable: 2 kB\n"),
            Err("MemTotal")
        );
        // Available above total (a hand-written file): used 0, not wrapped.
        assert_eq!(
            parse("MemTotal: 4 kB\nMemAvailable: 9 kB\n").map(|m| (m.used, m.free)),
            Ok((0, 4096))
        );
    }
}
