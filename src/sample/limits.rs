//! The cgroup-keyed limit sources, read by the sampler on their own slow
//! interval (`limits.interval`), never per memory sample: the driver's
//! per-cgroup memory limits (`nvmlDeviceGetMemoryLimits_v1`, an NVML call,
//! so on this thread) and the kernel's `dmem` controller (`dmem.max`).
//!
//! Asked only about the cgroups attribution vouched for
//! (`ProcIdentity::cgroup`: every directory on the path root's), so a
//! tenant's delegated cgroup gets no limit from here. Per GPU, each such
//! cgroup and its ancestors are asked at most once per read (a memo by
//! directory): a pod's containers share their pod's answer.
//!
//! - **driver**: from the process's directory up, the first that has a
//!   limit (soft above 0 or hard below `NVML_DEVICE_MEMORY_LIMIT_MAX`);
//!   `NOT_FOUND` means "none here". A driver without the call (580) is
//!   said once in the log and in `gpumem_exporter_limit_sources`; never
//!   counted as an NVML failure. Other failures are counted.
//! - **dmem**: where the cgroup v2 root lists the `dmem` controller; each
//!   directory's `dmem.max` lines (`<region> <bytes|max>`), the region
//!   naming the GPU by PCI address (`drm/0000:3b:00.0/vram0`). Limits
//!   nest, so the lowest on the path counts.

use std::collections::{BTreeSet, HashMap};
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::device::DeviceState;
use super::errors::Errors;
use crate::attribute::cgroupfs::CgroupFs;
use crate::gpu::{ErrorKind, GpuSource};
use crate::model::{CgroupLimit, LimitKind, LimitSource, LimitSources};

/// Directories asked above a process's own, at most.
const MAX_DEPTH: usize = 16;
/// Bytes of a `dmem.max` read, at most.
const MAX_DMEM_FILE: u64 = 64 << 10;

/// What the driver or `dmem` said of one directory on one GPU.
type Found = Vec<(LimitSource, LimitKind, u64)>;

pub(crate) struct CgroupLimits {
    every: Duration,
    cgroupfs: PathBuf,
    read_at: Option<Instant>,
    rows: Arc<Vec<CgroupLimit>>,
    sources: LimitSources,
    said: bool,
}

impl CgroupLimits {
    pub(crate) fn new(every: Duration, cgroupfs: PathBuf) -> Self {
        CgroupLimits {
            every,
            cgroupfs: v2_top(cgroupfs),
            read_at: None,
            rows: Arc::default(),
            sources: LimitSources::default(),
            said: false,
        }
    }

    /// A reload may change the interval and the cgroup root.
    pub(crate) fn configure(&mut self, every: Duration, cgroupfs: PathBuf) {
        let cgroupfs = v2_top(cgroupfs);
        if cgroupfs != self.cgroupfs {
            self.read_at = None;
        }
        self.every = every;
        self.cgroupfs = cgroupfs;
    }

    pub(crate) fn rows(&self) -> Arc<Vec<CgroupLimit>> {
        Arc::clone(&self.rows)
    }

    pub(crate) fn sources(&self) -> LimitSources {
        self.sources
    }

    /// Read every GPU's limits when the interval has passed since the last
    /// read (the first full sample reads at once).
    pub(crate) fn read_if_due(
        &mut self,
        gpu: &mut dyn GpuSource,
        devices: &[DeviceState],
        errors: &mut Errors,
        now: Instant,
    ) {
        if self
            .read_at
            .is_some_and(|at| now.saturating_duration_since(at) < self.every)
        {
            return;
        }
        self.read_at = Some(now);
        let driver = gpu.has_memory_limits();
        let dmem = dmem_mounted(&self.cgroupfs);
        self.sources.set(LimitSource::Driver, driver);
        self.sources.set(LimitSource::Dmem, dmem);
        if !self.said {
            self.said = true;
            tracing::info!(
                driver = if driver { "on" } else { "absent" },
                dmem = if dmem { "on" } else { "absent" },
                "per-cgroup memory limits: the driver's (nvmlDeviceGetMemoryLimits_v1, drivers R615 and later) and the kernel's dmem controller, read every {:?} for the root-owned cgroups of GPU processes",
                self.every
            );
        }
        let mut rows = Vec::new();
        if driver || dmem {
            for d in devices.iter().filter(|d| d.memory.is_some()) {
                let cgroups: BTreeSet<&Arc<str>> = d
                    .processes
                    .iter()
                    .filter_map(|p| p.ident.cgroup.as_ref())
                    .collect();
                if cgroups.is_empty() {
                    continue;
                }
                let mut memo = Memo::default();
                for cg in cgroups {
                    if driver {
                        self.driver(gpu, d, cg, &mut memo, errors, &mut rows);
                    }
                    if dmem {
                        self.dmem(d, cg, &mut memo, &mut rows);
                    }
                }
            }
        }
        rows.sort_by(|a, b| {
            (&a.cgroup, &a.uuid, a.source, a.kind).cmp(&(&b.cgroup, &b.uuid, b.source, b.kind))
        });
        self.rows = Arc::new(rows);
    }

    /// The driver's limits of `cg` on GPU `d`: the first directory from
    /// `cg` up that has one.
    fn driver(
        &self,
        gpu: &mut dyn GpuSource,
        d: &DeviceState,
        cg: &Arc<str>,
        memo: &mut Memo,
        errors: &mut Errors,
        out: &mut Vec<CgroupLimit>,
    ) {
        let total = d.memory.map_or(u64::MAX, |m| m.total);
        for dir in ancestors(cg) {
            let found = memo.driver.entry(dir.to_string()).or_insert_with(|| {
                let Ok(path) = CString::new(self.full(dir).into_os_string().into_encoded_bytes())
                else {
                    return Vec::new();
                };
                match gpu.memory_limits(d.index, &path) {
                    Ok(l) => {
                        let mut f = Vec::new();
                        if l.hard < total && l.hard != crate::gpu::limits::NO_HARD_LIMIT {
                            f.push((LimitSource::Driver, LimitKind::Hard, l.hard));
                        }
                        if l.soft > 0 {
                            f.push((LimitSource::Driver, LimitKind::Soft, l.soft));
                        }
                        f
                    }
                    Err(e) if e.kind == ErrorKind::NotFound || e.kind.is_unsupported() => {
                        Vec::new()
                    }
                    Err(e) => {
                        errors.count(e);
                        Vec::new()
                    }
                }
            });
            if !found.is_empty() {
                push(out, cg, dir, &d.info.uuid, found);
                return;
            }
        }
    }

    /// The lowest `dmem.max` for GPU `d` on the path of `cg`.
    fn dmem(&self, d: &DeviceState, cg: &Arc<str>, memo: &mut Memo, out: &mut Vec<CgroupLimit>) {
        let Some(bus) = pci_address(&d.info.pci_bus_id) else {
            return;
        };
        let mut lowest: Option<(&str, u64)> = None;
        for dir in ancestors(cg) {
            let max = *memo.dmem.entry(dir.to_string()).or_insert_with(|| {
                read_small(&self.full(dir).join("dmem.max")).and_then(|t| dmem_max(&t, &bus))
            });
            if let Some(bytes) = max
                && lowest.is_none_or(|(_, b)| bytes < b)
            {
                lowest = Some((dir, bytes));
            }
        }
        if let Some((dir, bytes)) = lowest {
            push(
                out,
                cg,
                dir,
                &d.info.uuid,
                &[(LimitSource::Dmem, LimitKind::Hard, bytes)],
            );
        }
    }

    /// Directory `dir` (a cgroup v2 path) in the v2 hierarchy.
    fn full(&self, dir: &str) -> PathBuf {
        self.cgroupfs.join(dir.trim_start_matches('/'))
    }
}

#[derive(Default)]
struct Memo {
    driver: HashMap<String, Found>,
    dmem: HashMap<String, Option<u64>>,
}

fn push(
    out: &mut Vec<CgroupLimit>,
    cg: &Arc<str>,
    at: &str,
    uuid: &str,
    found: &[(LimitSource, LimitKind, u64)],
) {
    let at: Arc<str> = Arc::from(at);
    let uuid: Arc<str> = Arc::from(uuid);
    for &(source, kind, bytes) in found {
        out.push(CgroupLimit {
            cgroup: Arc::clone(cg),
            at: Arc::clone(&at),
            uuid: Arc::clone(&uuid),
            source,
            kind,
            bytes,
        });
    }
}

/// `cg` and its parents, the root (`/`) left out, at most [`MAX_DEPTH`].
fn ancestors(cg: &str) -> impl Iterator<Item = &str> {
    let mut next = Some(cg.trim_end_matches('/'));
    std::iter::from_fn(move || {
        let here = next.filter(|d| !d.is_empty())?;
        next = here.rfind('/').map(|i| &here[..i]);
        Some(here)
    })
    .take(MAX_DEPTH)
}

/// The top of the cgroup v2 hierarchy under the cgroup root: the root
/// itself where it is a cgroup2 mount, else `unified/` (systemd's hybrid
/// layout), as attribution places a `0::` line.
fn v2_top(cgroupfs: PathBuf) -> PathBuf {
    let top = CgroupFs::new(cgroupfs.clone()).hierarchy("");
    top.unwrap_or(cgroupfs)
}

/// Whether the cgroup v2 root under `cgroupfs` lists the `dmem` controller.
fn dmem_mounted(cgroupfs: &Path) -> bool {
    read_small(&cgroupfs.join("cgroup.controllers"))
        .is_some_and(|t| t.split_whitespace().any(|c| c == "dmem"))
}

fn read_small(path: &Path) -> Option<String> {
    use std::io::Read;
    let mut s = String::new();
    std::fs::File::open(path)
        .ok()?
        .take(MAX_DMEM_FILE)
        .read_to_string(&mut s)
        .ok()?;
    Some(s)
}

/// NVML's PCI bus id (`00000000:3B:00.0`) as the kernel writes a PCI
/// address (`0000:3b:00.0`).
fn pci_address(bus_id: &str) -> Option<String> {
    let (domain, rest) = bus_id.trim().split_once(':')?;
    let domain = u32::from_str_radix(domain, 16).ok()?;
    Some(format!("{domain:04x}:{}", rest.to_ascii_lowercase()))
}

/// The limit `dmem.max` sets for the device at PCI address `bus`
/// (`<region> <bytes|max>` lines, the region `drm/<address>/<name>`); a
/// device with several regions is limited by their sum. `None`: no limit.
fn dmem_max(text: &str, bus: &str) -> Option<u64> {
    let mut sum: Option<u64> = None;
    for line in text.lines() {
        let Some((region, value)) = line.trim().rsplit_once(char::is_whitespace) else {
            continue;
        };
        if !region.split('/').any(|part| part == bus) {
            continue;
        }
        let Ok(bytes) = value.trim().parse::<u64>() else {
            // `max`: this region has no limit, so neither has the device.
            return None;
        };
        sum = Some(sum.unwrap_or(0).saturating_add(bytes));
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ancestors_walk_up_without_the_root() {
        let got: Vec<&str> = ancestors("/kubepods.slice/pod1/cri-abc").collect();
        assert_eq!(
            got,
            [
                "/kubepods.slice/pod1/cri-abc",
                "/kubepods.slice/pod1",
                "/kubepods.slice"
            ]
        );
        assert_eq!(ancestors("/").count(), 0);
        assert_eq!(ancestors("").count(), 0);
        assert_eq!(ancestors(&"/a".repeat(40)).count(), MAX_DEPTH);
    }

    #[test]
    fn pci_addresses_as_the_kernel_writes_them() {
        for (nvml, kernel) in [
            ("00000000:3B:00.0", Some("0000:3b:00.0")),
            ("0000:01:00.0", Some("0000:01:00.0")),
            ("00000001:C1:00.0", Some("0001:c1:00.0")),
            ("garbage", None),
            ("zz:01:00.0", None),
        ] {
            assert_eq!(pci_address(nvml).as_deref(), kernel, "{nvml}");
        }
    }

    #[test]
    fn dmem_max_lines() {
        let bus = "0000:3b:00.0";
        for (text, want) in [
            ("drm/0000:3b:00.0/vram0 1073741824\n", Some(1 << 30)),
            ("drm/0000:3b:00.0/vram0 max\n", None),
            ("drm/0000:01:00.0/vram0 5\n", None),
            (
                "drm/0000:3b:00.0/vram0 10\ndrm/0000:3b:00.0/vram1 20\n",
                Some(30),
            ),
            (
                "drm/0000:3b:00.0/vram0 10\ndrm/0000:3b:00.0/vram1 max\n",
                None,
            ),
            ("", None),
            ("nonsense\n", None),
            ("drm/0000:3b:00.0/vram0 -1\n", None),
        ] {
            assert_eq!(dmem_max(text, bus), want, "{text:?}");
        }
    }
}
