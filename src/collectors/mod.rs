//! The collectors, node_exporter style: each one is a folder here that
//! owns everything that is its own, and one row of [`REGISTRY`].
//!
//! A collector's folder holds:
//! - `mod.rs`: its reading type (what it leaves in a GPU's or process's
//!   sample, a [`Reading`](crate::model::Reading)), its per-GPU state, its
//!   read interval and its [`Collector`] impl;
//! - `calls.rs`: its NVML calls on a [`Handle`](crate::gpu::Handle)
//!   (nvml-wrapper's device and library through the NVML handle, state
//!   that must die with the library in its `state`), its `Operation`s
//!   (the `operation` label of each call), and, for unit tests, the
//!   in-process fake's answers from a script type of its own
//!   (`gpu::fake::Scripts`);
//! - `families.rs`: its metric families, encoded from the snapshot with
//!   the shared vocabulary of `crate::encoding`.
//!
//! The registry row ([`Def`]) gives its flag and config key
//! (`--collector.<name>`, `collectors.<name>`), default, help, the calls
//! and cost docs/metrics.md shows, whether it runs in a vGPU guest, its
//! constructor, its encode step (`expose/segments.rs` loops over the
//! registry and names no collector) and its operations (a test checks
//! that no two share a label).
//!
//! **A new collector is its folder, its `mod` line and its row in
//! [`REGISTRY`] here**, plus its docs (its row of docs/metrics.md's
//! collector table, which `tests.rs` holds to the registry, its families'
//! lines there, its key in config.example.yaml), and an answer in
//! `tests/fake-nvml` only where it makes a call that fake library lacks.
//! `collectors/tests.rs` holds a toy collector written this way: it joins
//! through its row alone, makes its own call on the handle, and its
//! family lands in the scrape body.
//!
//! `memory` and `processes` are rows too (their flags, keys and doc lines
//! come from the table) but no folder: device memory is what the sampler
//! is for, and the process list is the tick's own step that attribution
//! and the per-process collectors build on.
//!
//! This module sits below `config` (which builds the `collectors:` keys
//! and flags from the registry), `sample` (which runs the collectors) and
//! `expose` (which encodes them), and imports none of them.

mod collector;
pub(crate) mod gpm;
pub(crate) mod health;
pub(crate) mod power_thermal;
pub(crate) mod process_activity;
pub(crate) mod process_utilization;
mod registry;
pub(crate) mod utilization;

pub(crate) use collector::{Collector, Context, Failures, PerGpu};
pub(crate) use registry::Collectors;
pub use registry::Def;
pub(crate) use registry::Running;
pub(crate) use registry::{Json, ToJson, to_json};

/// Every collector, in the order docs/metrics.md lists them.
pub const REGISTRY: &[Def] = &[
    Def {
        name: registry::MEMORY,
        default: true,
        switchable: false,
        help: "device memory and peaks",
        calls: "`nvmlDeviceGetMemoryInfo_v2` (also in every memory sample)",
        cost: "8.8 µs",
        vgpu_guest: true,
        make: None,
        encode: None,
        json: None,
        operations: &[],
    },
    Def {
        name: registry::PROCESSES,
        default: true,
        switchable: true,
        help: "per-process memory and attribution",
        calls: "compute, graphics and MPS process lists (`_v3`)",
        cost: "12.3 µs per list",
        vgpu_guest: true,
        make: None,
        encode: None,
        json: None,
        operations: &[],
    },
    Def {
        name: "utilization",
        default: true,
        switchable: true,
        help: "GPU, memory-controller, encoder and decoder utilisation",
        calls: "`nvmlDeviceGetUtilizationRates`, `…GetEncoderUtilization`, `…GetDecoderUtilization`, `…GetSamples` (GPU utilisation samples, for `gpu_busy_seconds_total`)",
        cost: "6.2 µs without `…GetSamples`; `…GetSamples` 2.8 ms wall on the H200, so it is read at every full sample only while `utilization.gpu` is above 0, else every 10 s",
        vgpu_guest: true,
        make: Some(utilization::UtilizationCollector::boxed),
        encode: Some(utilization::families::encode),
        json: Some(utilization::json::JSON),
        operations: utilization::calls::OPERATIONS,
    },
    Def {
        name: "process_utilization",
        default: false,
        switchable: true,
        help: "per-process SM, memory, encoder and decoder utilisation, like nvidia-smi pmon",
        calls: "`nvmlDeviceGetProcessUtilization` (needs `processes`)",
        cost: "one NVML call of 0.7–1.4 ms per full sample (0.33 % of a core instead of 0.18 % on the H200): off by default",
        vgpu_guest: true,
        make: Some(process_utilization::ProcessUtilizationCollector::boxed),
        encode: Some(process_utilization::families::encode),
        json: Some(process_utilization::json::JSON),
        operations: process_utilization::calls::OPERATIONS,
    },
    Def {
        name: "process_activity",
        default: true,
        switchable: true,
        help: "when each process last ran a kernel, for idle holders (gpu_process_idle_seconds, gpu_memory_idle_held_bytes)",
        calls: "every 10 s `nvmlDeviceGetProcessUtilization` (needs `processes`); where the driver has no per-process samples, idle time comes from the GPU's own utilisation",
        cost: "one NVML call of 0.7–1.4 ms per GPU every 10 s on the H200 (0.07–0.14 ms a second per GPU)",
        vgpu_guest: true,
        make: Some(process_activity::ProcessActivityCollector::boxed),
        encode: None,
        json: None,
        operations: process_activity::calls::OPERATIONS,
    },
    Def {
        name: "power_thermal",
        default: true,
        switchable: true,
        help: "temperature, power, energy, clocks, P-state, clock event reasons",
        calls: "`nvmlDeviceGetTemperature`, `…GetPowerUsage`, `…GetEnforcedPowerLimit`, `…GetClockInfo` ×4, `…GetPerformanceState`, `…GetCurrentClocksEventReasons`; every 30 s `…GetTotalEnergyConsumption`",
        cost: "12 µs; the energy read 3.8 ms, hence every 30 s (≈ 0.13 ms/s)",
        vgpu_guest: true,
        make: Some(power_thermal::PowerThermalCollector::boxed),
        encode: Some(power_thermal::families::encode),
        json: Some(power_thermal::json::JSON),
        operations: power_thermal::calls::OPERATIONS,
    },
    Def {
        name: "health",
        default: true,
        switchable: true,
        help: "ECC errors, row remapping, retired pages, critical Xid events",
        calls: "`nvmlDeviceGetTotalEccErrors` ×4 (with ECC on), `…GetRemappedRows`, else `…GetRetiredPages` ×2 and `…GetRetiredPagesPendingStatus`; one `nvmlEventSetWait_v2(timeout 0)` for all GPUs; every 30 s `…GetEccMode`; skipped on a vGPU guest's GPUs (row remapping queries spam the guest's kernel log there)",
        cost: "9 µs; the ECC mode read 130 µs, hence every 30 s",
        vgpu_guest: false,
        make: Some(health::HealthCollector::boxed),
        encode: Some(health::families::encode),
        json: Some(health::json::JSON),
        operations: health::calls::OPERATIONS,
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
        encode: Some(gpm::families::encode),
        json: Some(gpm::json::JSON),
        operations: gpm::calls::OPERATIONS,
    },
];

/// The row of `name`, if there is one.
pub(crate) fn find(name: &str) -> Option<&'static Def> {
    REGISTRY.iter().find(|d| d.name == name)
}

impl Collectors {
    /// Whether the process lists are read (the `processes` collector).
    pub(crate) fn processes(&self) -> bool {
        find(registry::PROCESSES).is_some_and(|d| self.is_on(d))
    }

    /// The names of the collectors that run, in registry order (for logs).
    pub(crate) fn enabled(&self) -> Vec<&'static str> {
        REGISTRY
            .iter()
            .filter(|d| self.is_on(d))
            .map(|d| d.name)
            .collect()
    }
}

#[cfg(test)]
mod tests;
