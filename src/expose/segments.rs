//! Re-encoding only what a snapshot changed. A memory-only sample (ten a
//! second at the defaults) changes `gpu_info`, `gpu_up`, the
//! `gpu_memory_*_bytes` gauges, the kubelet's allocations and the
//! exporter's own counters; the per-process, MIG, torch and collector
//! families stay those of the last full sample, and they are most of the
//! body. A scrape that lands after a memory sample used to encode all of
//! it on the request path: that was the `/metrics` tail (issue 28).
//!
//! The body is written as segments in scrape order, each through its own
//! prometheus-client registry (the encoder keeps no state between
//! families, so the concatenation is byte for byte the single encode; the
//! golden files and `segmented_equals_whole` check it). The two segments
//! that only a full sample changes are kept in a [`Reuse`] with the inputs
//! they were made from — `Arc` clones of each GPU's identity, processes,
//! MIG instances and collector readings — and used again while the next
//! snapshot holds the very same `Arc`s (pointer equality: the sampler
//! shares them between snapshots until a full sample replaces them, and
//! the clones kept here stop an address from being reused). Anything else
//! the reused families read would have to join [`FullKey`].

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::registry::Registry;

use super::format::Format;
use super::{accounting, allocation, exporter, forecast, gpu, mig, process, torch};
use crate::collectors::{Def, REGISTRY};
use crate::model::{DeviceInfo, MigSample, OtherProcesses, ProcessSample, Readings, Snapshot};

/// Family groups, in scrape order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Group {
    /// `gpu_info`, `gpu_up`, `gpu_memory_*`: every sample.
    Devices,
    /// Per-process memory, torch, rollups and identity, MIG: full samples.
    Processes,
    /// The kubelet's and Slurm's allocations: copied in at each publish.
    Allocation,
    /// The ledger's counters (`accounting`) and the allocation rows':
    /// every publish.
    Accounting,
    /// The switchable collectors' families, in registry order: full
    /// samples.
    Collectors,
    /// `gpu_driver_info`.
    Driver,
    /// The exporter's own families (`gpumem_exporter_*`), last: every
    /// publish.
    Exporter,
}

impl Group {
    /// Every group, in scrape order.
    pub(super) const ALL: [Group; 7] = [
        Group::Devices,
        Group::Processes,
        Group::Allocation,
        Group::Accounting,
        Group::Collectors,
        Group::Driver,
        Group::Exporter,
    ];
}

/// One group's families; the collectors' from `registry`'s rows.
pub(super) fn encode_group(
    enc: &mut DescriptorEncoder,
    s: &Snapshot,
    group: Group,
    registry: &[Def],
) -> Result<(), fmt::Error> {
    match group {
        Group::Devices => {
            gpu::devices(enc, s)?;
            forecast::families(enc, s)
        }
        Group::Processes => {
            process::memory(enc, s)?;
            if s.torch.is_some() {
                torch::families(enc, s)?;
            }
            process::rollup_and_identity(enc, s)?;
            mig::families(enc, s)
        }
        Group::Allocation => allocation::families(enc, s),
        Group::Accounting => {
            accounting::families(enc, s)?;
            allocation::counters(enc, s)
        }
        Group::Collectors => {
            for encode in registry.iter().filter_map(|d| d.encode) {
                encode(enc, s)?;
            }
            Ok(())
        }
        Group::Driver => gpu::driver(enc, s),
        Group::Exporter => exporter::families(enc, s),
    }
}

#[derive(Debug)]
struct GroupCollector(Arc<Snapshot>, &'static [Group], &'static [Def]);

impl Collector for GroupCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), fmt::Error> {
        for &g in self.1 {
            encode_group(&mut enc, &self.0, g, self.2)?;
        }
        Ok(())
    }
}

/// Append some groups' families to `out`, without OpenMetrics' `# EOF`.
fn append(
    out: &mut String,
    snapshot: &Arc<Snapshot>,
    format: Format,
    groups: &'static [Group],
    collectors: &'static [Def],
) -> Result<(), fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(GroupCollector(
        Arc::clone(snapshot),
        groups,
        collectors,
    )));
    match format {
        Format::Text => prometheus_client::encoding::prometheus_text::encode(out, &registry),
        Format::OpenMetrics => prometheus_client::encoding::text::encode_registry(out, &registry),
    }
}

/// What the two full-sample groups read of a snapshot, held as `Arc`
/// clones and compared by address.
#[derive(Debug)]
struct FullKey {
    torch: bool,
    devices: Vec<DeviceKey>,
}

#[derive(Debug)]
struct DeviceKey {
    info: Arc<DeviceInfo>,
    processes: Arc<[ProcessSample]>,
    other: Option<OtherProcesses>,
    mig: Arc<[MigSample]>,
    readings: Readings,
}

impl FullKey {
    fn of(s: &Snapshot) -> Self {
        FullKey {
            torch: s.torch.is_some(),
            devices: s
                .devices
                .iter()
                .map(|d| DeviceKey {
                    info: Arc::clone(&d.info),
                    processes: Arc::clone(&d.processes),
                    other: d.other,
                    mig: Arc::clone(&d.mig),
                    readings: d.readings.clone(),
                })
                .collect(),
        }
    }

    /// `s` reads the very same data.
    fn holds_for(&self, s: &Snapshot) -> bool {
        self.torch == s.torch.is_some()
            && self.devices.len() == s.devices.len()
            && self.devices.iter().zip(&s.devices).all(|(k, d)| {
                Arc::ptr_eq(&k.info, &d.info)
                    && Arc::ptr_eq(&k.processes, &d.processes)
                    && k.other == d.other
                    && Arc::ptr_eq(&k.mig, &d.mig)
                    && k.readings.same_arcs(&d.readings)
            })
    }
}

#[derive(Debug)]
struct Kept {
    key: FullKey,
    processes: String,
    collectors: String,
}

/// The full-sample segments of the last body encoded, per format, and
/// the collector registry the bodies are encoded with.
#[derive(Debug)]
pub struct Reuse {
    kept: [Mutex<Option<Kept>>; 2],
    reused: AtomicU64,
    registry: &'static [Def],
}

impl Default for Reuse {
    fn default() -> Self {
        Reuse::with_registry(REGISTRY)
    }
}

impl Reuse {
    pub fn new() -> Self {
        Self::default()
    }

    /// Bodies whose collectors' families come from `registry`'s rows (the
    /// sampler's, when it was made with another registry: the toy
    /// collector's test).
    pub(crate) fn with_registry(registry: &'static [Def]) -> Self {
        Reuse {
            kept: Default::default(),
            reused: AtomicU64::new(0),
            registry,
        }
    }

    /// Bodies that reused the full-sample segments instead of encoding
    /// them (tests and benches look).
    pub fn reused(&self) -> u64 {
        self.reused.load(Ordering::Relaxed)
    }
}

/// Encode `snapshot` whole, reusing `reuse`'s full-sample segments when
/// they were made from the same data, and keeping this snapshot's.
pub fn encode_reusing(
    snapshot: &Arc<Snapshot>,
    format: Format,
    reuse: &Reuse,
) -> Result<String, fmt::Error> {
    let slot = &reuse.kept[match format {
        Format::Text => 0,
        Format::OpenMetrics => 1,
    }];
    // Held across the encode: two requests for two snapshots at once
    // take turns (each body is already encoded once per snapshot by the
    // body cache), and a poisoned lock only loses the kept segments.
    let mut kept = slot.lock().unwrap_or_else(|e| {
        let mut g = e.into_inner();
        *g = None;
        g
    });
    let fresh = match kept.as_ref() {
        Some(k) if k.key.holds_for(snapshot) => {
            reuse.reused.fetch_add(1, Ordering::Relaxed);
            false
        }
        _ => true,
    };
    if fresh {
        let mut processes = String::with_capacity(8192);
        append(
            &mut processes,
            snapshot,
            format,
            &[Group::Processes],
            reuse.registry,
        )?;
        let mut collectors = String::with_capacity(4096);
        append(
            &mut collectors,
            snapshot,
            format,
            &[Group::Collectors],
            reuse.registry,
        )?;
        *kept = Some(Kept {
            key: FullKey::of(snapshot),
            processes,
            collectors,
        });
    }
    let Some(k) = kept.as_ref() else {
        return Err(fmt::Error);
    };
    let mut out = String::with_capacity(k.processes.len() + k.collectors.len() + 8192);
    let registry = reuse.registry;
    append(&mut out, snapshot, format, &[Group::Devices], registry)?;
    out.push_str(&k.processes);
    append(
        &mut out,
        snapshot,
        format,
        &[Group::Allocation, Group::Accounting],
        registry,
    )?;
    out.push_str(&k.collectors);
    append(
        &mut out,
        snapshot,
        format,
        &[Group::Driver, Group::Exporter],
        registry,
    )?;
    if format == Format::OpenMetrics {
        prometheus_client::encoding::text::encode_eof(&mut out)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{DeviceSample, MemoryInfo};

    fn whole(s: &Arc<Snapshot>, format: Format) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(GroupCollector(
            Arc::clone(s),
            &Group::ALL,
            REGISTRY,
        )));
        let mut out = String::new();
        let r = match format {
            Format::Text => {
                prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)
            }
            Format::OpenMetrics => prometheus_client::encoding::text::encode(&mut out, &registry),
        };
        assert!(r.is_ok());
        out
    }

    fn memory(used: u64) -> MemoryInfo {
        MemoryInfo {
            total: 100 << 30,
            used,
            free: (100 << 30) - used,
            reserved: Some(1 << 20),
        }
    }

    fn one_gpu_three_processes() -> Snapshot {
        let mut s = Snapshot::empty(std::time::UNIX_EPOCH);
        let info = DeviceInfo {
            uuid: "GPU-1".into(),
            name: "Fake".into(),
            ..DeviceInfo::unknown(0)
        };
        let processes: Vec<ProcessSample> = (1..=3)
            .map(|pid| ProcessSample {
                pid,
                used_bytes: Some(u64::from(pid) << 20),
                ident: Arc::default(),
                gpu_instance_id: None,
                compute_instance_id: None,
                used_peak_bytes: None,
                torch: None,
                readings: Default::default(),
            })
            .collect();
        s.devices.push(DeviceSample {
            info: Arc::new(info),
            memory: Some(memory(3 << 20)),
            used_peak_bytes: Some(3 << 20),
            processes: processes.into(),
            other: None,
            mig: Arc::new([]),
            readings: Default::default(),
        });
        s
    }

    #[test]
    fn segmented_equals_whole_and_reuses_only_the_same_full_sample() {
        let full = Arc::new(one_gpu_three_processes());
        let reuse = Reuse::new();
        for format in [Format::Text, Format::OpenMetrics] {
            let r0 = reuse.reused();
            let first = encode_reusing(&full, format, &reuse).unwrap_or_default();
            assert_eq!(first, whole(&full, format), "{format:?}: whole body");
            assert_eq!(reuse.reused(), r0, "nothing to reuse yet");
            // A memory-only sample: same Arcs, other memory figures.
            let mut next = (*full).clone();
            next.devices = next
                .devices
                .iter()
                .map(|d| DeviceSample {
                    memory: Some(memory(7 << 30)),
                    ..d.clone()
                })
                .collect();
            let next = Arc::new(next);
            let body = encode_reusing(&next, format, &reuse).unwrap_or_default();
            assert_eq!(reuse.reused(), r0 + 1, "full-sample part reused");
            assert_eq!(body, whole(&next, format));
            assert!(
                body.contains(&(7u64 << 30).to_string()),
                "new memory figure"
            );
            // A full sample: new process list (another Arc, same content
            // or not) is encoded again.
            let mut third = (*next).clone();
            third.devices = third
                .devices
                .iter()
                .map(|d| DeviceSample {
                    processes: d.processes.iter().skip(1).cloned().collect(),
                    ..d.clone()
                })
                .collect();
            let third = Arc::new(third);
            let body = encode_reusing(&third, format, &reuse).unwrap_or_default();
            assert_eq!(reuse.reused(), r0 + 1, "new processes: encoded again");
            assert_eq!(body, whole(&third, format));
        }
    }
}
