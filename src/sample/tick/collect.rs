//! The collectors' part of a full tick (utilization, power_thermal,
//! health, process_utilization, Xid events): which calls are made, what a
//! GPU that does not support one gets (the family left out, logged once),
//! and the reads that are too slow for every sample.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Sampler;
use crate::attribute::ProcessLookup;
use crate::gpu::{GpuSource, NOT_SUPPORTED};
use crate::model::{Health, PowerThermal, ProcessUtilization};

/// The energy counter and the ECC mode are read this often, not at every
/// full sample: on the H200 nvmlDeviceGetTotalEnergyConsumption takes
/// 4.1 ms and nvmlDeviceGetEccMode 134 µs, 25× the rest of a full sample's
/// NVML time (docs/results/gpu-collectors-h200-run1.txt). The energy counter
/// is exact as of its read; `rate()` over minutes is unaffected.
pub const SLOW_READ_INTERVAL: Duration = Duration::from_secs(30);

impl<G: GpuSource, P: ProcessLookup> Sampler<G, P> {
    /// Collector calls that failed: a call the GPU does not support leaves
    /// its family out for that GPU, logged once and not counted; any other
    /// failure is counted.
    pub(super) fn collector_failures(&mut self, gpu: usize) {
        let mut unsupported: Vec<&'static str> = Vec::new();
        for e in self.failed.drain(..) {
            if NOT_SUPPORTED.contains(&e.error) {
                if self.unsupported_logged.insert((gpu, e.operation)) {
                    unsupported.push(e.operation);
                }
            } else {
                self.errors.count(e);
            }
        }
        if !unsupported.is_empty() {
            tracing::info!(
                gpu,
                calls = unsupported.join(","),
                "not supported by this GPU; the families of these calls are not exported for it"
            );
        }
    }

    /// The utilization, power_thermal and health collectors of GPU `i`.
    pub(super) fn read_collectors(&mut self, i: usize, now: Instant) {
        let c = self.collectors;
        let mut failed = std::mem::take(&mut self.failed);
        let slow_due = (c.power_thermal || c.health)
            && self.devices[i]
                .slow_read_at
                .is_none_or(|at| now.duration_since(at) >= SLOW_READ_INTERVAL);
        if slow_due {
            let energy = self.gpu.energy(i).map_err(|e| failed.push(e)).ok();
            let ecc = self.gpu.ecc_mode(i).map_err(|e| failed.push(e)).ok();
            let dev = &mut self.devices[i];
            (dev.energy_mj, dev.ecc_enabled, dev.slow_read_at) = (energy, ecc, Some(now));
        }
        let (energy_mj, ecc_enabled) = (self.devices[i].energy_mj, self.devices[i].ecc_enabled);
        let utilization = c.utilization.then(|| self.gpu.utilization(i, &mut failed));
        let power = c.power_thermal.then(|| PowerThermal {
            energy_mj,
            ..self.gpu.power_thermal(i, &mut failed)
        });
        let health = c.health.then(|| Health {
            ecc_enabled,
            ..self.gpu.health(i, ecc_enabled == Some(true), &mut failed)
        });
        self.failed = failed;
        self.collector_failures(i);
        let dev = &mut self.devices[i];
        dev.utilization = utilization;
        dev.power = power;
        dev.health = health;
    }

    /// Process utilisation samples of GPU `i` newer than the last seen,
    /// latest per pid; `None` when the query failed or is not supported.
    pub(super) fn read_process_utilization(
        &mut self,
        i: usize,
    ) -> Option<HashMap<u32, ProcessUtilization>> {
        self.putil.clear();
        let since = self.devices[i].putil_since;
        match self.gpu.process_utilization(i, since, &mut self.putil) {
            Ok(()) => {
                let mut latest: HashMap<u32, (u64, ProcessUtilization)> = HashMap::new();
                for p in &self.putil {
                    let e = latest
                        .entry(p.pid)
                        .or_insert((p.timestamp_us, p.utilization));
                    if p.timestamp_us >= e.0 {
                        *e = (p.timestamp_us, p.utilization);
                    }
                }
                let newest = self.putil.iter().map(|p| p.timestamp_us).max();
                if let Some(t) = newest {
                    self.devices[i].putil_since = t.max(since);
                }
                Some(latest.into_iter().map(|(pid, (_, u))| (pid, u)).collect())
            }
            Err(e) => {
                self.failed.push(e);
                self.collector_failures(i);
                None
            }
        }
    }

    /// Register GPUs for critical Xid events (once each), read the events
    /// that arrived, and hand each GPU's counts to its health figures.
    pub(super) fn read_xid(&mut self) {
        for i in 0..self.devices.len() {
            let dev = &self.devices[i];
            if dev.xid_watched.is_some() || !dev.info.is_known() || dev.memory.is_none() {
                continue;
            }
            match self.gpu.watch_xid(i) {
                Ok(()) => self.devices[i].xid_watched = Some(true),
                Err(e) => {
                    if NOT_SUPPORTED.contains(&e.error) {
                        self.devices[i].xid_watched = Some(false);
                    }
                    self.failed.push(e);
                    self.collector_failures(i);
                }
            }
        }
        self.xids.clear();
        if let Err(e) = self.gpu.xid_events(&mut self.xids) {
            self.errors.count(e);
        }
        for &(i, xid) in &self.xids {
            if let Some(dev) = self.devices.get_mut(i) {
                tracing::warn!(gpu = i, uuid = %dev.info.uuid, xid, "critical Xid event");
                *Arc::make_mut(&mut dev.xid_errors).entry(xid).or_insert(0) += 1;
            }
        }
        for dev in &mut self.devices {
            if let (Some(h), Some(true)) = (dev.health.as_mut(), dev.xid_watched) {
                h.xid_errors = Some(Arc::clone(&dev.xid_errors));
            }
        }
    }
}
