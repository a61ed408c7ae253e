//! Which Slurm job holds which GPU: the job-mapping directory a Slurm
//! prolog writes and its epilog removes (deploy/slurm/), read on a timer.
//!
//! Two layouts people already write (`slurm.job_mapping_format`):
//! - `dcgm` (dcgm-exporter's `--hpc-job-mapping-dir`): one file per GPU,
//!   named by its NVML index (`0`) or, for a MIG device, by
//!   `<gpu index>.<gpu instance id>`; each line one job id (several jobs
//!   may share a GPU).
//! - `jobstats` (Princeton jobstats' `/run/gpustat`): one file per GPU,
//!   named by its index, its `GPU-` UUID or a `MIG-` UUID, holding
//!   `<jobid> <uid>`.
//!
//! - **Its own thread, its own interval.** [`spawn`] reads the directory
//!   every `slurm.job_mapping_interval` (5 s) and publishes the result by
//!   swapping an `Arc`; a snapshot copies the latest one when published
//!   (`publish::Shared`). A scrape or a sample never reads the directory
//!   (dcgm-exporter reads it in every scrape).
//! - **No NVML here.** File names are parsed into device ids, matched to
//!   GPUs and MIG instances when a snapshot is encoded
//!   (`expose::allocation`), as the kubelet's are.
//! - **Bounded.** At most [`MAX_FILES`] files per read and
//!   [`MAX_FILE_BYTES`] per file; job ids are short and of a closed set of
//!   characters, so a label value cannot grow without bound.
//! - **Failure is data.** Whatever cannot be used is counted by reason
//!   (`gpumem_exporter_slurm_job_mapping_errors_total`) and logged at most
//!   once a minute; a missing directory is no job at all (the prolog
//!   creates it for the first job), not an error.
//!
//! Written by hand (std only): a directory listing and small text files
//! need no library.

use std::fs;
use std::io::Read;
use std::path::Path;
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::config::{JobMappingConfig, JobMappingFormat};
use crate::model::{AllocatedDevice, JobAllocation, JobMappingErrors, JobMappingState};
use crate::ratelimit::LogLimiter;

/// Files read per pass at most (a node has at most a few dozen GPUs and
/// MIG devices; the rest is counted as `too_many`).
pub(crate) const MAX_FILES: usize = 1024;
/// Bytes read per file at most (a file holds a few job ids).
pub(crate) const MAX_FILE_BYTES: u64 = 4096;
/// The longest job id accepted.
const MAX_JOB_ID: usize = 64;

/// The latest read and the counters, shared between the reader thread and
/// whoever publishes snapshots.
#[derive(Debug, Default)]
pub(crate) struct JobMap {
    state: ArcSwap<JobMappingState>,
}

impl JobMap {
    /// The latest read and the counters.
    pub(crate) fn state(&self) -> JobMappingState {
        JobMappingState::clone(&self.state.load())
    }
}

/// Start the reader thread: a first read at once, then one every
/// `cfg.interval`. It ends when the store is dropped.
pub(crate) fn spawn(cfg: JobMappingConfig, store: &Arc<JobMap>) -> std::io::Result<JoinHandle<()>> {
    let weak: Weak<JobMap> = Arc::downgrade(store);
    tracing::info!(
        dir = %cfg.dir.display(),
        format = ?cfg.format,
        interval = ?cfg.interval,
        "Slurm job-mapping reader starting"
    );
    std::thread::Builder::new()
        .name("slurm-jobmap".into())
        .spawn(move || {
            let mut warnings = LogLimiter::every(Duration::from_secs(60));
            while let Some(store) = weak.upgrade() {
                let mut s = store.state();
                let before = s.errors;
                s.allocations = read(&cfg.dir, cfg.format, &mut s.errors).into();
                s.reads_total += 1;
                if s.errors != before
                    && let Some(suppressed) = warnings.check(())
                {
                    tracing::warn!(
                        dir = %cfg.dir.display(),
                        errors = ?s.errors,
                        suppressed,
                        "Slurm job-mapping directory: entries skipped (counted in gpumem_exporter_slurm_job_mapping_errors_total)"
                    );
                }
                store.state.store(Arc::new(s));
                drop(store);
                std::thread::sleep(cfg.interval);
            }
        })
}

/// One pass over `dir`: the devices jobs hold, sorted, without duplicates;
/// what is skipped is counted in `errors`.
pub(crate) fn read(
    dir: &Path,
    format: JobMappingFormat,
    errors: &mut JobMappingErrors,
) -> Vec<JobAllocation> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(_) => {
            errors.read += 1;
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    let mut files = 0usize;
    for entry in entries {
        let Ok(entry) = entry else {
            errors.read += 1;
            continue;
        };
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            errors.name += 1;
            continue;
        };
        // A prolog writes `.<name>.tmp` and renames it into place.
        if name.starts_with('.') {
            continue;
        }
        files += 1;
        if files > MAX_FILES {
            errors.too_many += 1;
            break;
        }
        let Some(device) = device_of(name, format) else {
            errors.name += 1;
            continue;
        };
        let text = match read_limited(&entry.path()) {
            Ok(Some(t)) => t,
            Ok(None) => {
                errors.too_large += 1;
                continue;
            }
            // Removed by an epilog between the listing and the read.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(_) => {
                errors.read += 1;
                continue;
            }
        };
        let mut malformed = false;
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            match parse_line(line, format) {
                Some((job, uid)) => out.push(JobAllocation {
                    device: device.clone(),
                    job,
                    uid,
                }),
                None => malformed = true,
            }
        }
        if malformed {
            errors.content += 1;
        }
    }
    out.sort();
    out.dedup();
    out
}

/// A file's content, `None` when it is larger than [`MAX_FILE_BYTES`].
fn read_limited(path: &Path) -> std::io::Result<Option<String>> {
    let mut buf = Vec::new();
    fs::File::open(path)?
        .take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut buf)?;
    if buf.len() as u64 > MAX_FILE_BYTES {
        return Ok(None);
    }
    Ok(Some(String::from_utf8_lossy(&buf).into_owned()))
}

/// The device a file name stands for in `format`.
pub(crate) fn device_of(name: &str, format: JobMappingFormat) -> Option<AllocatedDevice> {
    let index = |s: &str| !s.is_empty() && s.len() <= 4 && s.bytes().all(|b| b.is_ascii_digit());
    if index(name) {
        return Some(AllocatedDevice::GpuIndex { gpu: name.into() });
    }
    let uuid = |s: &str, prefix: &str| {
        s.strip_prefix(prefix).is_some_and(|rest| {
            !rest.is_empty()
                && rest.len() <= 64
                && rest.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
        })
    };
    match format {
        JobMappingFormat::Dcgm => {
            let (gpu, gi) = name.split_once('.')?;
            if !index(gpu) || !index(gi) {
                return None;
            }
            Some(AllocatedDevice::MigOfGpuIndex {
                gpu: gpu.into(),
                gpu_instance_id: gi.parse().ok()?,
            })
        }
        JobMappingFormat::Jobstats if uuid(name, "GPU-") => {
            Some(AllocatedDevice::Gpu { uuid: name.into() })
        }
        JobMappingFormat::Jobstats if uuid(name, "MIG-") => Some(AllocatedDevice::Mig {
            mig_uuid: name.into(),
        }),
        JobMappingFormat::Jobstats => None,
    }
}

/// One line: `<jobid>` (dcgm) or `<jobid> <uid>` (jobstats; the uid may be
/// missing).
fn parse_line(line: &str, format: JobMappingFormat) -> Option<(String, Option<String>)> {
    let mut fields = line.split_whitespace();
    let job = fields.next().filter(|j| is_job_id(j))?;
    let uid = match format {
        JobMappingFormat::Dcgm => None,
        JobMappingFormat::Jobstats => match fields.next() {
            None => None,
            Some(u) if !u.is_empty() && u.len() <= 10 && u.bytes().all(|b| b.is_ascii_digit()) => {
                Some(u.to_owned())
            }
            Some(_) => return None,
        },
    };
    if fields.next().is_some() {
        return None;
    }
    Some((job.to_owned(), uid))
}

/// A job id as prologs write it: `SLURM_JOB_ID` (digits), an array task
/// (`<id>_<task>`), or a SLUID; nothing a label should not hold.
fn is_job_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_JOB_ID
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'+' || b == b'.')
}

#[cfg(test)]
mod tests {
    use super::*;
    use JobMappingFormat::*;

    fn alloc(device: AllocatedDevice, job: &str, uid: Option<&str>) -> JobAllocation {
        JobAllocation {
            device,
            job: job.into(),
            uid: uid.map(Into::into),
        }
    }

    fn gpu(i: &str) -> AllocatedDevice {
        AllocatedDevice::GpuIndex { gpu: i.into() }
    }

    #[test]
    fn dcgm_layout() {
        let dir = tempfile::tempdir().unwrap();
        let w = |n: &str, c: &str| std::fs::write(dir.path().join(n), c).unwrap();
        w("0", "1001\n1002\n");
        w("1", "");
        w("2.3", "1003\n");
        w(".3.tmp", "999\n");
        w("GPU-0a0a", "1004\n");
        w("4", "10 05\n1006\n");
        std::fs::write(
            dir.path().join("5"),
            vec![b'1'; MAX_FILE_BYTES as usize + 1],
        )
        .unwrap();
        let mut errors = JobMappingErrors::default();
        let got = read(dir.path(), Dcgm, &mut errors);
        assert_eq!(
            got,
            vec![
                alloc(gpu("0"), "1001", None),
                alloc(gpu("0"), "1002", None),
                alloc(gpu("4"), "1006", None),
                alloc(
                    AllocatedDevice::MigOfGpuIndex {
                        gpu: "2".into(),
                        gpu_instance_id: 3
                    },
                    "1003",
                    None
                ),
            ]
        );
        assert_eq!(
            errors,
            JobMappingErrors {
                name: 1,
                content: 1,
                too_large: 1,
                ..Default::default()
            }
        );
    }

    #[test]
    fn jobstats_layout() {
        let dir = tempfile::tempdir().unwrap();
        let w = |n: &str, c: &str| std::fs::write(dir.path().join(n), c).unwrap();
        w("0", "1001 1000\n");
        w("GPU-0a0a0a0a-0000-0000-0000-000000000000", "1002 1001\n");
        w("MIG-11111111-0000-0000-0000-000000000000", "1003\n");
        w("2.1", "1004 0\n");
        w("3", "1005 bob\n");
        let mut errors = JobMappingErrors::default();
        let got = read(dir.path(), Jobstats, &mut errors);
        assert_eq!(
            got,
            vec![
                alloc(
                    AllocatedDevice::Gpu {
                        uuid: "GPU-0a0a0a0a-0000-0000-0000-000000000000".into()
                    },
                    "1002",
                    Some("1001")
                ),
                alloc(
                    AllocatedDevice::Mig {
                        mig_uuid: "MIG-11111111-0000-0000-0000-000000000000".into()
                    },
                    "1003",
                    None
                ),
                alloc(gpu("0"), "1001", Some("1000")),
            ]
        );
        assert_eq!(
            errors,
            JobMappingErrors {
                name: 1,
                content: 1,
                ..Default::default()
            }
        );
    }

    #[test]
    fn missing_directory_is_no_job_and_too_many_files_are_counted() {
        let mut errors = JobMappingErrors::default();
        assert!(read(Path::new("/nonexistent/gpumem-jobmap"), Dcgm, &mut errors).is_empty());
        assert_eq!(errors, JobMappingErrors::default());

        let dir = tempfile::tempdir().unwrap();
        for i in 0..MAX_FILES + 5 {
            std::fs::write(dir.path().join(i.to_string()), "7\n").unwrap();
        }
        let got = read(dir.path(), Dcgm, &mut errors);
        assert_eq!(got.len(), MAX_FILES);
        assert_eq!(errors.too_many, 1);
    }
}
