//! Call counting: how often each export was called, so a test can prove that
//! a switched-off collector makes no such call.
//!
//! Every export counts itself (whatever it answers, before init too). When
//! `FAKE_NVML_CALLS` names a file, the counts are written there as sorted
//! lines `nvmlDeviceGetTemperature 42`, through a temp file renamed over it
//! (a reader never sees half a file). The write happens on the first call,
//! then on the first call at least [`WRITE_EVERY`] after the last write, and
//! at every `nvmlShutdown`, so the file lags the library by at most that
//! interval while the caller keeps calling. Written by hand: a map and a
//! rename need no library.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Environment variable naming the call-count file.
pub const CALLS_ENV: &str = "FAKE_NVML_CALLS";
/// The file is rewritten at most this often (and at nvmlShutdown).
pub const WRITE_EVERY: Duration = Duration::from_millis(100);

struct Calls {
    counts: BTreeMap<&'static str, u64>,
    /// `None` until the environment was read (or a test set it).
    path: Option<Option<PathBuf>>,
    last_write: Option<Instant>,
    /// Whether the last write failed, so a failure is reported once.
    write_failing: bool,
}

static CALLS: Mutex<Calls> = Mutex::new(Calls {
    counts: BTreeMap::new(),
    path: None,
    last_write: None,
    write_failing: false,
});

fn lock() -> MutexGuard<'static, Calls> {
    CALLS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Counts one call of `name`, and writes the file if it is due.
pub fn hit(name: &'static str) {
    let mut c = lock();
    *c.counts.entry(name).or_insert(0) += 1;
    let due = c.last_write.is_none_or(|t| t.elapsed() >= WRITE_EVERY);
    if due {
        c.write();
    }
}

/// Writes the file now (nvmlShutdown).
pub fn flush() {
    lock().write();
}

impl Calls {
    fn write(&mut self) {
        let path = self
            .path
            .get_or_insert_with(|| {
                std::env::var_os(CALLS_ENV)
                    .filter(|v| !v.is_empty())
                    .map(PathBuf::from)
            })
            .clone();
        let Some(path) = path else { return };
        self.last_write = Some(Instant::now());
        let mut text = String::new();
        for (name, n) in &self.counts {
            let _ = writeln!(text, "{name} {n}");
        }
        let mut tmp = path.clone().into_os_string();
        tmp.push(format!(".tmp{}", std::process::id()));
        let tmp = PathBuf::from(tmp);
        let written = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, &path));
        match written {
            Ok(()) => self.write_failing = false,
            Err(e) => {
                if !self.write_failing {
                    eprintln!("fake-nvml: {CALLS_ENV}={}: {e}", path.display());
                }
                self.write_failing = true;
            }
        }
    }
}

/// The counts so far (unit tests).
#[cfg(test)]
pub fn snapshot() -> BTreeMap<&'static str, u64> {
    lock().counts.clone()
}

/// Counts from zero and writes to `path` (None: no file), not the environment.
#[cfg(test)]
pub fn reset_for_test(path: Option<PathBuf>) {
    let mut c = lock();
    c.counts.clear();
    c.path = Some(path);
    c.last_write = None;
    c.write_failing = false;
}
