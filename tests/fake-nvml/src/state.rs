//! Process-wide library state: NVML's init reference count and the scenario,
//! reloaded whenever its file changes.
//!
//! Every API call stats the file (one syscall) and reparses only when
//! (device, inode, size, mtime in ns) differ from the last parse, so a test
//! that writes a temp file and renames it over the scenario is seen by the
//! next call. A scenario that does not parse keeps the previous good one.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use nvml_wrapper_sys::bindings::{
    nvmlReturn_enum_NVML_ERROR_UNINITIALIZED, nvmlReturn_enum_NVML_ERROR_UNKNOWN,
    nvmlReturn_enum_NVML_SUCCESS, nvmlReturn_t,
};

use crate::scenario::{self, Scenario};

/// Environment variable naming the scenario file.
pub const CONFIG_ENV: &str = "FAKE_NVML_CONFIG";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct FileId {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
}

impl FileId {
    fn of(meta: &fs::Metadata) -> Self {
        FileId {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        }
    }
}

struct State {
    /// nvmlInit* successes minus nvmlShutdown calls.
    refcount: u32,
    /// Set by unit tests so they need not touch the environment.
    path_override: Option<PathBuf>,
    path: Option<PathBuf>,
    /// Identity of the file as last parsed (good or bad).
    file_id: Option<FileId>,
    /// Last scenario that parsed and validated.
    scenario: Option<Arc<Scenario>>,
    /// Whether the last stat failed, so a missing file is reported once, not per call.
    stat_failing: bool,
    /// GPUs the scenario had when the library was first initialised: like
    /// NVML, the device count is fixed until the next init.
    gpus_at_init: usize,
    /// One past the last process utilisation timeStamp any scenario handed
    /// out, so a rewrite within the same mtime tick still gives new samples.
    next_sample_us: u64,
}

static STATE: Mutex<State> = Mutex::new(State {
    refcount: 0,
    path_override: None,
    path: None,
    file_id: None,
    scenario: None,
    stat_failing: false,
    gpus_at_init: 0,
    next_sample_us: 0,
});

fn lock() -> MutexGuard<'static, State> {
    // A panic while holding the lock cannot leave State inconsistent in a way
    // that matters more than refusing every later call would.
    STATE.lock().unwrap_or_else(PoisonError::into_inner)
}

fn report(line: &str) {
    // One line per event, whatever the error text holds.
    let line = line.split_whitespace().collect::<Vec<_>>().join(" ");
    eprintln!("fake-nvml: {line}");
}

impl State {
    /// With no previous scenario (only possible inside nvmlInit) init reports.
    fn report_kept(&self, why: &str) {
        if self.scenario.is_some() {
            report(&format!("{why} (keeping the previous scenario)"));
        }
    }

    /// Reparses the scenario if its file changed (or always, with `force`).
    /// Returns why there is no fresh scenario, if something went wrong.
    fn refresh(&mut self, force: bool) -> Result<(), String> {
        let Some(path) = self.path.clone() else {
            return Err(format!("{CONFIG_ENV} is not set"));
        };
        let shown = path.display();
        let meta = match fs::metadata(&path) {
            Ok(meta) => meta,
            Err(e) => {
                let why = format!("{shown}: {e}");
                if force || !self.stat_failing {
                    self.report_kept(&why);
                }
                self.stat_failing = true;
                return Err(why);
            }
        };
        self.stat_failing = false;
        let id = FileId::of(&meta);
        if !force && self.file_id == Some(id) {
            return Ok(());
        }
        // Remember the identity seen *before* reading: a write that races
        // with the read changes it again and triggers another parse.
        self.file_id = Some(id);
        let parsed = fs::read_to_string(&path)
            .map_err(|e| e.to_string())
            .and_then(|text| scenario::parse(&text));
        match parsed {
            Ok(mut s) => {
                let mtime_us = u64::try_from(id.mtime_ns / 1000).unwrap_or(0);
                s.sample_base_us = mtime_us.max(self.next_sample_us);
                self.next_sample_us = s.sample_base_us.saturating_add(s.sample_span());
                crate::telemetry::note_scenario(&s);
                self.scenario = Some(Arc::new(s));
                Ok(())
            }
            Err(e) => {
                let why = format!("{shown}: {e}");
                self.report_kept(&why);
                Err(why)
            }
        }
    }
}

/// The gate every API call but init passes: UNINITIALIZED unless initialised,
/// otherwise the current scenario (reloaded if its file changed).
pub fn enter() -> Result<Arc<Scenario>, nvmlReturn_t> {
    let mut st = lock();
    if st.refcount == 0 {
        return Err(nvmlReturn_enum_NVML_ERROR_UNINITIALIZED);
    }
    // Errors were reported inside; the previous scenario stays in force.
    let _ = st.refresh(false);
    st.scenario
        .clone()
        .ok_or(nvmlReturn_enum_NVML_ERROR_UNKNOWN)
}

/// nvmlInit*: reread the scenario, honour `init_error` / `init_delay_ms`,
/// then count one more user.
pub fn init() -> nvmlReturn_t {
    let scenario = {
        let mut st = lock();
        let path = st.path_override.clone().or_else(|| {
            std::env::var_os(CONFIG_ENV)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        });
        if path != st.path {
            st.path = path;
            st.file_id = None;
            st.scenario = None;
        }
        let refreshed = st.refresh(true);
        match (st.scenario.clone(), refreshed) {
            (Some(s), _) => s,
            (None, Err(why)) => {
                report(&format!(
                    "nvmlInit: no usable scenario, returning NVML_ERROR_UNKNOWN: {why}"
                ));
                return nvmlReturn_enum_NVML_ERROR_UNKNOWN;
            }
            (None, Ok(())) => return nvmlReturn_enum_NVML_ERROR_UNKNOWN,
        }
    };
    // Sleep without the lock: other threads' calls are not held up.
    if !scenario.init_delay.is_zero() {
        std::thread::sleep(scenario.init_delay);
    }
    if let Some(code) = scenario.init_error {
        return code;
    }
    let mut st = lock();
    if st.refcount == 0 {
        st.gpus_at_init = scenario.gpus.len();
    }
    st.refcount = st.refcount.saturating_add(1);
    nvmlReturn_enum_NVML_SUCCESS
}

/// The device count NVML enumerated at the first init still in force.
pub fn gpus_at_init() -> usize {
    lock().gpus_at_init
}

/// nvmlShutdown: one user fewer; UNINITIALIZED if there was none.
pub fn shutdown() -> nvmlReturn_t {
    let mut st = lock();
    if st.refcount == 0 {
        return nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
    }
    st.refcount -= 1;
    if st.refcount == 0 {
        // Like NVML's, event sets do not outlive the library.
        crate::events::clear();
    }
    nvmlReturn_enum_NVML_SUCCESS
}

/// Points the library at a scenario file without touching the environment
/// (takes effect at the next nvmlInit*), and drops any leftover init count.
#[cfg(test)]
pub fn reset_for_test(path: Option<PathBuf>) {
    let mut st = lock();
    st.refcount = 0;
    st.path_override = path;
    st.path = None;
    st.file_id = None;
    st.scenario = None;
    st.stat_failing = false;
    st.gpus_at_init = 0;
    st.next_sample_us = 0;
    crate::events::clear();
}
