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
//! - **A tenant cannot write it.** Every user on a Slurm node is a
//!   tenant, and the mapping turns file content into labels: the
//!   directory is refused (no Slurm rows, counted as `unsafe_dir`, one
//!   clear log line) unless it is owned by root (or the exporter's own
//!   uid) and writable by neither group nor others; it is opened once per
//!   read and each file is opened relative to it with
//!   `O_NOFOLLOW|O_NONBLOCK` and checked to be a regular file by `fstat`
//!   on what was opened (`not_regular`), so neither a symlink to a
//!   root-only file nor a FIFO that never answers can be read.
//! - **Failure is data.** Whatever cannot be used is counted by reason
//!   (`gpumem_exporter_slurm_job_mapping_errors_total`) and logged at most
//!   once a minute; a missing directory is no job at all (the prolog
//!   creates it for the first job), not an error.
//!
//! Written by hand (std and libc's `openat`): a directory listing and small
//! text files need no library.

use std::ffi::CString;
use std::fs;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::attribute::JobOwners;
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

/// The jobstats layout's `<jobid> <uid>` rows: the owner check of a job
/// whose cgroup path names no uid (cgroup v2).
impl JobOwners for JobMap {
    fn owners(&self, job: &str) -> Vec<u32> {
        let state = self.state.load();
        let mut uids: Vec<u32> = state
            .allocations
            .iter()
            .filter(|a| a.job == job)
            .filter_map(|a| a.uid.as_deref()?.parse().ok())
            .collect();
        uids.sort_unstable();
        uids.dedup();
        uids
    }

    fn knows(&self, job: &str) -> bool {
        self.state.load().allocations.iter().any(|a| a.job == job)
    }
}

/// Why the job-mapping directory is not read at all.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum UnsafeDir {
    #[error("not a directory")]
    NotADirectory,
    #[error("owned by uid {0}, not root: whoever owns it can put any job id into slurm_job labels")]
    Owner(u32),
    #[error(
        "mode {0:04o} lets group or others write: any of them can put any job id into slurm_job labels"
    )]
    Writable(u32),
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
            let mut refusals = LogLimiter::every(Duration::from_secs(60));
            while let Some(store) = weak.upgrade() {
                let mut s = store.state();
                let before = s.errors;
                s.allocations = match read(&cfg.dir, cfg.format, &mut s.errors) {
                    Ok(found) => found.into(),
                    Err(e) => {
                        s.errors.unsafe_dir += 1;
                        if let Some(suppressed) = refusals.check(()) {
                            tracing::error!(
                                dir = %cfg.dir.display(),
                                suppressed,
                                "Slurm job-mapping directory refused: {e}; no Slurm rows until it is owned by root and writable by neither group nor others (counted in gpumem_exporter_slurm_job_mapping_errors_total{{reason=\"unsafe_dir\"}})"
                            );
                        }
                        Vec::new().into()
                    }
                };
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
/// what is skipped is counted in `errors`. A directory others may write
/// is refused whole.
pub(crate) fn read(
    dir: &Path,
    format: JobMappingFormat,
    errors: &mut JobMappingErrors,
) -> Result<Vec<JobAllocation>, UnsafeDir> {
    let handle = match fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(dir)
    {
        Ok(h) => h,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => return Err(UnsafeDir::NotADirectory),
        Err(_) => {
            errors.read += 1;
            return Ok(Vec::new());
        }
    };
    let Ok(meta) = handle.metadata() else {
        errors.read += 1;
        return Ok(Vec::new());
    };
    check_dir(&meta)?;
    // Listed by path, but every file is opened relative to the directory
    // just checked.
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(_) => {
            errors.read += 1;
            return Ok(Vec::new());
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
        let text = match read_limited(&handle, name) {
            Ok(Some(t)) => t,
            Ok(None) => {
                errors.too_large += 1;
                continue;
            }
            Err(e) if is_not_regular(&e) => {
                errors.not_regular += 1;
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
    Ok(out)
}

/// Owned by root (or this process's own uid, which could write it anyway)
/// and writable by neither group nor others.
fn check_dir(meta: &fs::Metadata) -> Result<(), UnsafeDir> {
    if !meta.is_dir() {
        return Err(UnsafeDir::NotADirectory);
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != 0 && meta.uid() != me {
        return Err(UnsafeDir::Owner(meta.uid()));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(UnsafeDir::Writable(mode));
    }
    Ok(())
}

/// The error [`read_limited`] gives for anything but a regular file.
fn not_regular() -> std::io::Error {
    std::io::Error::from_raw_os_error(libc::EINVAL)
}

/// Whether `e` says the entry was no regular file: a symlink (`ELOOP`
/// from `O_NOFOLLOW`), or what `fstat` found (a FIFO, a device, a
/// directory, a socket).
fn is_not_regular(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ELOOP | libc::EINVAL | libc::ENXIO | libc::EISDIR)
    )
}

/// The content of file `name` in `dir`, `None` when it is larger than
/// [`MAX_FILE_BYTES`]. Opened relative to the checked directory, never
/// following a symlink and never waiting (a FIFO opens at once with
/// `O_NONBLOCK` and is refused by the `fstat` on what was opened, before
/// any read).
fn read_limited(dir: &fs::File, name: &str) -> std::io::Result<Option<String>> {
    let c_name = CString::new(std::ffi::OsStr::new(name).as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: `dir` is an open directory fd and `c_name` a NUL-terminated
    // name; the fd returned (if any) is owned below.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            c_name.as_ptr(),
            libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by openat and is owned by nobody else.
    let file = fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    if !file.metadata()?.is_file() {
        return Err(not_regular());
    }
    let mut buf = Vec::new();
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut buf)?;
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
        let got = read(dir.path(), Dcgm, &mut errors).unwrap();
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
        let got = read(dir.path(), Jobstats, &mut errors).unwrap();
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

    /// A symlink to a file the exporter may read, a FIFO nobody writes, a
    /// directory and a socket: none is read, each is counted, the regular
    /// files beside them are; the read does not wait on the FIFO.
    #[test]
    fn only_regular_files_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let secret = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(secret.path(), "s3cr3t\n").unwrap();
        std::os::unix::fs::symlink(secret.path(), dir.path().join("0")).unwrap();
        let fifo = CString::new(dir.path().join("1").as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
        std::fs::create_dir(dir.path().join("2")).unwrap();
        let _socket = std::os::unix::net::UnixListener::bind(dir.path().join("3")).unwrap();
        std::fs::write(dir.path().join("4"), "1004\n").unwrap();
        let mut errors = JobMappingErrors::default();
        let got = read(dir.path(), Dcgm, &mut errors).unwrap();
        assert_eq!(got, vec![alloc(gpu("4"), "1004", None)]);
        assert_eq!(
            errors,
            JobMappingErrors {
                not_regular: 4,
                ..Default::default()
            }
        );
    }

    /// A directory group or others may write is refused whole, with what
    /// is wrong; so is a file where the directory should be.
    #[test]
    fn a_directory_others_may_write_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("0"), "7\n").unwrap();
        let mut errors = JobMappingErrors::default();
        for (mode, ok) in [
            (0o700, true),
            (0o755, true),
            (0o775, false),
            (0o757, false),
            (0o1777, false),
        ] {
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(mode)).unwrap();
            let got = read(dir.path(), Dcgm, &mut errors);
            if ok {
                assert_eq!(got.map(|v| v.len()), Ok(1), "mode {mode:o}");
            } else {
                assert_eq!(got, Err(UnsafeDir::Writable(mode)), "mode {mode:o}");
            }
        }
        assert_eq!(
            UnsafeDir::Writable(0o1777).to_string(),
            "mode 1777 lets group or others write: any of them can put any job id into slurm_job labels"
        );
        assert_eq!(
            read(&dir.path().join("0"), Dcgm, &mut errors),
            Err(UnsafeDir::NotADirectory)
        );
        assert_eq!(errors, JobMappingErrors::default());
    }

    #[test]
    fn missing_directory_is_no_job_and_too_many_files_are_counted() {
        let mut errors = JobMappingErrors::default();
        assert!(
            read(Path::new("/nonexistent/gpumem-jobmap"), Dcgm, &mut errors)
                .unwrap()
                .is_empty()
        );
        assert_eq!(errors, JobMappingErrors::default());

        let dir = tempfile::tempdir().unwrap();
        for i in 0..MAX_FILES + 5 {
            std::fs::write(dir.path().join(i.to_string()), "7\n").unwrap();
        }
        let got = read(dir.path(), Dcgm, &mut errors).unwrap();
        assert_eq!(got.len(), MAX_FILES);
        assert_eq!(errors.too_many, 1);
    }
}
