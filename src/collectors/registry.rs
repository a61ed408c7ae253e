//! The registry's machinery: a row ([`Def`]), the choice of which rows
//! run ([`Collectors`], built by config validation), and the running
//! instances beside their rows ([`Running`], the sampler's). The table
//! itself, [`REGISTRY`](super::REGISTRY), and [`find`](super::find) stand
//! beside the collectors' module lines in `collectors/mod.rs`; this file
//! imports nothing from there (no module loop).

use std::collections::BTreeMap;
use std::fmt;

use prometheus_client::encoding::DescriptorEncoder;

use super::collector::Collector;
use crate::gpu::Operation;
use crate::model::{Readings, Snapshot};

/// One collector: its row of [`REGISTRY`](super::REGISTRY).
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
    pub(crate) make: Option<fn() -> Box<dyn Collector>>,
    /// Its families, from a snapshot, in the place a scrape shows them
    /// (after the allocations, in registry order); `None` for the
    /// sampler's own steps, whose families `expose/` writes.
    pub(crate) encode: Option<Encode>,
    /// Its readings in `/api/v1/snapshot` (and so on the page), under its
    /// key in each GPU's (or process's) object; `None`: not in the JSON.
    pub(crate) json: Option<Json>,
    /// The `operation` label of every NVML call it makes (read by the
    /// test that no two collectors, nor the sampler, declare one label).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) operations: &'static [Operation],
}

/// A collector's encode step: its families of one snapshot.
pub(crate) type Encode = fn(&mut DescriptorEncoder, &Snapshot) -> Result<(), fmt::Error>;

/// A collector's JSON step: what it read of one GPU (or one process) as
/// the value of `key` in that GPU's (process's) object of
/// `/api/v1/snapshot` (`null` where it read nothing), written by serde in
/// the collector's folder. The page shows every GPU key it does not draw
/// itself as a line of figures, so a new collector is on the page too.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Json {
    pub(crate) key: &'static str,
    pub(crate) gpu: Option<ToJson>,
    pub(crate) process: Option<ToJson>,
}

/// One GPU's (or process's) readings → this collector's JSON value.
pub(crate) type ToJson = fn(&Readings) -> Option<Box<serde_json::value::RawValue>>;

/// `value` as a JSON value for a [`ToJson`] step (`None` if serde fails,
/// which plain numbers and strings do not).
pub(crate) fn to_json<T: serde::Serialize>(value: &T) -> Option<Box<serde_json::value::RawValue>> {
    serde_json::value::to_raw_value(value).ok()
}

/// The sampler's own steps, by name.
pub(super) const MEMORY: &str = "memory";
pub(super) const PROCESSES: &str = "processes";

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
}

/// The instances of the collectors that are on, beside their rows.
pub(crate) struct Running {
    registry: &'static [Def],
    /// Per row: its instance while it is on (rows without `make`: `None`).
    instances: Vec<Option<Box<dyn Collector>>>,
}

impl Running {
    pub(crate) fn new(registry: &'static [Def], on: &Collectors) -> Self {
        let mut r = Running {
            registry,
            instances: registry.iter().map(|_| None).collect(),
        };
        r.switch(on);
        r
    }

    /// Make instances of the collectors switched on, drop those switched
    /// off (their state and readings go with them).
    pub(crate) fn switch(&mut self, on: &Collectors) {
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
    pub(crate) fn restart(&mut self) {
        for (def, slot) in self.registry.iter().zip(self.instances.iter_mut()) {
            if let (Some(make), Some(_)) = (def.make, slot.as_ref()) {
                *slot = Some(make());
            }
        }
    }

    pub(crate) fn each(&mut self) -> impl Iterator<Item = &mut Box<dyn Collector>> {
        self.instances.iter_mut().flatten()
    }

    /// The instances that are on, beside their rows.
    pub(crate) fn each_with_def(
        &mut self,
    ) -> impl Iterator<Item = (&'static Def, &mut Box<dyn Collector>)> {
        self.registry
            .iter()
            .zip(self.instances.iter_mut())
            .filter_map(|(d, i)| Some((d, i.as_mut()?)))
    }

    /// The names of the collectors that are on but skipped on a vGPU
    /// guest's GPUs.
    pub(crate) fn skipped_in_vgpu_guests(&self) -> Vec<&'static str> {
        self.registry
            .iter()
            .zip(self.instances.iter())
            .filter(|(d, i)| i.is_some() && !d.vgpu_guest)
            .map(|(d, _)| d.name)
            .collect()
    }

    /// The readings of GPU `gpu`, in registry order.
    pub(crate) fn readings(&self, gpu: usize) -> Readings {
        let mut out = Readings::default();
        for c in self.instances.iter().flatten() {
            c.readings(gpu, &mut out);
        }
        out
    }

    /// The readings of process `pid` on GPU `gpu`.
    pub(crate) fn process_readings(&self, gpu: usize, pid: u32) -> crate::model::Readings {
        let mut out = crate::model::Readings::default();
        for c in self.instances.iter().flatten() {
            if let Some(r) = c.process_reading(gpu, pid) {
                out.put(r);
            }
        }
        out
    }
}
