//! The collectors, node_exporter style: [`REGISTRY`] is the one table
//! (name, default, flag help, NVML calls, cost) from which the
//! `--collector.<name>` / `--no-collector.<name>` flags, the `collectors:`
//! config keys, SIGHUP's switching and the collector table of
//! docs/metrics.md all come. Each switchable collector is one module here
//! that owns its per-GPU state, its calls through [`GpuSource`] and its
//! read interval, and leaves a [`Reading`](crate::model::Reading) of its
//! own type in each GPU's (or process's) sample; its family group in
//! `expose/` encodes that reading.
//!
//! A new collector is: its module here and one row in [`REGISTRY`]; its
//! NVML calls as a [`GpuSource`] method (the only code that calls NVML
//! stays in `gpu/`), and its families in `expose/`.
//!
//! `memory` and `processes` are rows too (their flags, keys and doc lines
//! come from the table) but no module: device memory is what the sampler
//! is for, and the process list is the tick's own step that attribution
//! and the per-process collectors build on.

mod gpm;
mod health;
mod power_thermal;
mod process_utilization;
mod utilization;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use super::errors::Errors;
use crate::gpu::{GpuError, GpuSource, RawProcess};
use crate::model::Reading;

/// One collector: its row of [`REGISTRY`].
#[derive(Debug, Clone, Copy)]
pub struct Def {
    /// The name in `--collector.<name>` and `collectors.<name>`.
    pub name: &'static str,
    /// On unless switched off.
    pub default: bool,
    /// `false`: always on; switching it off is refused.
    pub switchable: bool,
    /// What it reads (the flag's help, docs/metrics.md's description).
    pub help: &'static str,
    /// The NVML calls it makes per GPU per full sample (docs/metrics.md).
    pub calls: &'static str,
    /// What it costs, measured on the H200 (docs/metrics.md).
    pub cost: &'static str,
    /// Whether it runs on a GPU of a vGPU guest (`false`: its calls
    /// misbehave there; skipped on such a GPU, said once at discovery).
    pub vgpu_guest: bool,
    /// A fresh instance (no state); `None` for the sampler's own steps
    /// (`memory`, `processes`).
    pub make: Option<fn() -> Box<dyn Collector>>,
}

/// Every collector, in the order docs/metrics.md lists them.
pub const REGISTRY: &[Def] = &[
    Def {
        name: MEMORY,
        default: true,
        switchable: false,
        help: "device memory and peaks",
        calls: "`nvmlDeviceGetMemoryInfo_v2` (also in every memory sample)",
        cost: "8.8 µs",
        vgpu_guest: true,
        make: None,
    },
    Def {
        name: PROCESSES,
        default: true,
        switchable: true,
        help: "per-process memory and attribution",
        calls: "compute, graphics and MPS process lists (`_v3`)",
        cost: "12.3 µs per list",
        vgpu_guest: true,
        make: None,
    },
    Def {
        name: "utilization",
        default: true,
        switchable: true,
        help: "GPU, memory-controller, encoder and decoder utilisation",
        calls: "`nvmlDeviceGetUtilizationRates`, `…GetEncoderUtilization`, `…GetDecoderUtilization`",
        cost: "6.2 µs",
        vgpu_guest: true,
        make: Some(utilization::Utilization::boxed),
    },
    Def {
        name: "process_utilization",
        default: false,
        switchable: true,
        help: "per-process SM, memory, encoder and decoder utilisation, like nvidia-smi pmon",
        calls: "`nvmlDeviceGetProcessUtilization` (needs `processes`)",
        cost: "+2.8 ms per sample in the exporter (0.41 % of a core instead of 0.14 %): off by default",
        vgpu_guest: true,
        make: Some(process_utilization::ProcessUtilization::boxed),
    },
    Def {
        name: "power_thermal",
        default: true,
        switchable: true,
        help: "temperature, power, energy, clocks, P-state, clock event reasons",
        calls: "`nvmlDeviceGetTemperature`, `…GetPowerUsage`, `…GetEnforcedPowerLimit`, `…GetClockInfo` ×4, `…GetPerformanceState`, `…GetCurrentClocksEventReasons`; every 30 s `…GetTotalEnergyConsumption`",
        cost: "12 µs; the energy read 3.8 ms, hence every 30 s (≈ 0.13 ms/s)",
        vgpu_guest: true,
        make: Some(power_thermal::PowerThermal::boxed),
    },
    Def {
        name: "health",
        default: true,
        switchable: true,
        help: "ECC errors, row remapping, retired pages, critical Xid events",
        calls: "`nvmlDeviceGetTotalEccErrors` ×4 (with ECC on), `…GetRemappedRows`, else `…GetRetiredPages` ×2 and `…GetRetiredPagesPendingStatus`; one `nvmlEventSetWait_v2(timeout 0)` for all GPUs; every 30 s `…GetEccMode`; skipped on a vGPU guest's GPUs (row remapping queries spam the guest's kernel log there)",
        cost: "9 µs; the ECC mode read 130 µs, hence every 30 s",
        vgpu_guest: false,
        make: Some(health::Health::boxed),
    },
    Def {
        name: "gpm",
        default: false,
        switchable: true,
        help: "GPU Performance Monitoring (Hopper and later): SM activity and occupancy, tensor, DRAM bandwidth, FP16/32/64 activity, PCIe and NVLink bytes/s, per GPU and MIG instance",
        calls: "once `nvmlGpmQueryDeviceSupport`; `nvmlGpmSampleGet` (and `nvmlGpmMigSampleGet` per MIG GPU instance), `nvmlGpmMetricsGet` (11 metrics) against the previous full sample's",
        cost: "+254 µs per GPU per full sample in the exporter on the H200 (tick 196 → 450 µs, `scripts/gpu/gpm.py`; 0.025 % of a core at 1 s): off by default until it has run on more than one GPU model",
        vgpu_guest: true,
        make: Some(gpm::GpmCollector::boxed),
    },
];

/// The sampler's own steps, by name.
const MEMORY: &str = "memory";
const PROCESSES: &str = "processes";

/// The row of `name`, if there is one.
pub fn find(name: &str) -> Option<&'static Def> {
    REGISTRY.iter().find(|d| d.name == name)
}

/// Which collectors run: the choices made (file keys, flags), each
/// collector's registry default for the rest. Built by config validation,
/// which refuses unknown names and switching off an unswitchable one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Collectors {
    chosen: BTreeMap<&'static str, bool>,
}

impl Collectors {
    /// Switch `def` on or off (last choice wins). Only choices that differ
    /// from the default are kept, so two sets that run the same collectors
    /// are equal.
    pub fn set(&mut self, def: &Def, on: bool) {
        if on == def.default || !def.switchable {
            self.chosen.remove(def.name);
        } else {
            self.chosen.insert(def.name, on);
        }
    }

    /// Whether `def` runs.
    pub fn is_on(&self, def: &Def) -> bool {
        !def.switchable || self.chosen.get(def.name).copied().unwrap_or(def.default)
    }

    /// Whether the process lists are read (the `processes` collector).
    pub fn processes(&self) -> bool {
        find(PROCESSES).is_some_and(|d| self.is_on(d))
    }

    /// The names of the collectors that run, in registry order (for logs).
    pub fn enabled(&self) -> Vec<&'static str> {
        REGISTRY
            .iter()
            .filter(|d| self.is_on(d))
            .map(|d| d.name)
            .collect()
    }
}

/// What a collector works with during one full sample.
pub struct Context<'a> {
    /// The GPU source (the only way to NVML).
    pub gpu: &'a mut dyn GpuSource,
    /// When this full sample started.
    pub now: Instant,
    errors: &'a mut Errors,
}

impl<'a> Context<'a> {
    pub(super) fn new(gpu: &'a mut dyn GpuSource, now: Instant, errors: &'a mut Errors) -> Self {
        Context { gpu, now, errors }
    }

    /// A call on GPU `gpu` failed: a call the GPU does not support leaves
    /// its family out for that GPU (logged once, with the other calls of
    /// this sample, and not counted); any other failure is counted.
    pub fn failed(&mut self, gpu: usize, e: GpuError) {
        self.errors.collector_failed(gpu, e);
    }

    /// A call not tied to one GPU failed: counted.
    pub fn count(&mut self, e: GpuError) {
        self.errors.count(e);
    }
}

/// A switchable collector. One instance serves every GPU and keeps its
/// per-GPU state itself (index = NVML index); it is made afresh when NVML
/// is re-opened and when it is switched on.
pub trait Collector: Send {
    /// A full sample of GPU `gpu`, which is known and answered its memory
    /// query in this sample.
    fn collect(&mut self, cx: &mut Context<'_>, gpu: usize);

    /// The processes NVML listed on `gpu` in this full sample (called only
    /// while the `processes` collector is on and the list was read).
    fn processes(&mut self, _cx: &mut Context<'_>, _gpu: usize, _listed: &[RawProcess]) {}

    /// After every GPU of a full sample; `answering[i]` says whether GPU
    /// `i` was collected in it.
    fn finish(&mut self, _cx: &mut Context<'_>, _answering: &[bool]) {}

    /// GPU `gpu` did not answer (or NVML was closed): its readings go.
    fn forget(&mut self, gpu: usize);

    /// What this collector read of GPU `gpu` in the last full sample.
    fn reading(&self, gpu: usize) -> Option<Arc<dyn Reading>>;

    /// What it read of process `pid` on GPU `gpu`, for per-process
    /// collectors.
    fn process_reading(&self, _gpu: usize, _pid: u32) -> Option<Arc<dyn Reading>> {
        None
    }
}

/// Per-GPU state of a collector, grown as GPUs are seen.
#[derive(Debug, Default)]
pub struct PerGpu<T>(Vec<T>);

impl<T: Default> PerGpu<T> {
    /// The state of GPU `gpu`, made when first asked.
    pub fn at(&mut self, gpu: usize) -> &mut T {
        if self.0.len() <= gpu {
            self.0.resize_with(gpu + 1, T::default);
        }
        &mut self.0[gpu]
    }

    pub fn get(&self, gpu: usize) -> Option<&T> {
        self.0.get(gpu)
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = (usize, &mut T)> {
        self.0.iter_mut().enumerate()
    }
}

/// The instances of the collectors that are on, beside their rows.
pub(super) struct Running {
    registry: &'static [Def],
    /// Per row: its instance while it is on (rows without `make`: `None`).
    instances: Vec<Option<Box<dyn Collector>>>,
}

impl Running {
    pub(super) fn new(registry: &'static [Def], on: &Collectors) -> Self {
        let mut r = Running {
            registry,
            instances: registry.iter().map(|_| None).collect(),
        };
        r.switch(on);
        r
    }

    /// Make instances of the collectors switched on, drop those switched
    /// off (their state and readings go with them).
    pub(super) fn switch(&mut self, on: &Collectors) {
        for (def, slot) in self.registry.iter().zip(self.instances.iter_mut()) {
            match (def.make, on.is_on(def)) {
                (Some(make), true) => {
                    if slot.is_none() {
                        *slot = Some(make());
                    }
                }
                _ => *slot = None,
            }
        }
    }

    /// Start every instance over (NVML re-opened: new handles, new GPUs).
    pub(super) fn restart(&mut self) {
        for (def, slot) in self.registry.iter().zip(self.instances.iter_mut()) {
            if let (Some(make), Some(_)) = (def.make, slot.as_ref()) {
                *slot = Some(make());
            }
        }
    }

    pub(super) fn each(&mut self) -> impl Iterator<Item = &mut Box<dyn Collector>> {
        self.instances.iter_mut().flatten()
    }

    /// The instances that are on, beside their rows.
    pub(super) fn each_with_def(
        &mut self,
    ) -> impl Iterator<Item = (&'static Def, &mut Box<dyn Collector>)> {
        self.registry
            .iter()
            .zip(self.instances.iter_mut())
            .filter_map(|(d, i)| Some((d, i.as_mut()?)))
    }

    /// The names of the collectors that are on but skipped on a vGPU
    /// guest's GPUs.
    pub(super) fn skipped_in_vgpu_guests(&self) -> Vec<&'static str> {
        self.registry
            .iter()
            .zip(self.instances.iter())
            .filter(|(d, i)| i.is_some() && !d.vgpu_guest)
            .map(|(d, _)| d.name)
            .collect()
    }

    /// The readings of GPU `gpu`, in registry order.
    pub(super) fn readings(&self, gpu: usize) -> crate::model::Readings {
        let mut out = crate::model::Readings::default();
        for c in self.instances.iter().flatten() {
            if let Some(r) = c.reading(gpu) {
                out.put(r);
            }
        }
        out
    }

    /// The readings of process `pid` on GPU `gpu`.
    pub(super) fn process_readings(&self, gpu: usize, pid: u32) -> crate::model::Readings {
        let mut out = crate::model::Readings::default();
        for c in self.instances.iter().flatten() {
            if let Some(r) = c.process_reading(gpu, pid) {
                out.put(r);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests;
