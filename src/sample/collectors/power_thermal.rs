//! `power_thermal`: temperature, power draw and limit, clocks, P-state and
//! clock event reasons at every full sample; the energy counter, a slow
//! call (4.1 ms on the H200), every [`SLOW_READ_INTERVAL`] only.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Collector, Context, PerGpu};
use crate::gpu::readings;
use crate::model::Reading;

/// The energy counter (here) and the ECC mode (`health`) are read this
/// often, not at every full sample: on the H200
/// nvmlDeviceGetTotalEnergyConsumption takes 4.1 ms and
/// nvmlDeviceGetEccMode 134 µs, 25× the rest of a full sample's NVML time
/// (docs/results/gpu-collectors-h200-run1.txt). The energy counter is
/// exact as of its read; `rate()` over minutes is unaffected.
pub(super) const SLOW_READ_INTERVAL: Duration = Duration::from_secs(30);

#[derive(Default)]
struct Gpu {
    read: Option<Arc<readings::PowerThermal>>,
    /// When the energy counter was last read, and what it answered.
    energy_read_at: Option<Instant>,
    energy_mj: Option<u64>,
}

#[derive(Default)]
pub(super) struct PowerThermal {
    gpus: PerGpu<Gpu>,
}

impl PowerThermal {
    pub(super) fn boxed() -> Box<dyn Collector> {
        Box::<PowerThermal>::default()
    }
}

/// Whether a slow read last made at `at` is due again at `now`.
pub(super) fn slow_read_due(at: Option<Instant>, now: Instant) -> bool {
    at.is_none_or(|at| now.duration_since(at) >= SLOW_READ_INTERVAL)
}

impl Collector for PowerThermal {
    fn collect(&mut self, cx: &mut Context<'_>, gpu: usize) {
        let state = self.gpus.at(gpu);
        if slow_read_due(state.energy_read_at, cx.now) {
            let energy = cx.gpu.energy(gpu);
            state.energy_read_at = Some(cx.now);
            state.energy_mj = energy.map_err(|e| cx.failed(gpu, e)).ok();
        }
        let mut failed = Vec::new();
        let p = readings::PowerThermal {
            energy_mj: state.energy_mj,
            ..cx.gpu.power_thermal(gpu, &mut failed)
        };
        failed.into_iter().for_each(|e| cx.failed(gpu, e));
        state.read = Some(Arc::new(p));
    }

    fn forget(&mut self, gpu: usize) {
        self.gpus.at(gpu).read = None;
    }

    fn reading(&self, gpu: usize) -> Option<Arc<dyn Reading>> {
        let p = self.gpus.get(gpu)?.read.clone()?;
        Some(p)
    }
}
