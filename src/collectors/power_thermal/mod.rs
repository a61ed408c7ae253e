//! `power_thermal`: temperature, power draw and limit, clocks, P-state and
//! clock event reasons at every full sample; the energy counter, a slow
//! call (4.1 ms on the H200), every [`SLOW_READ_INTERVAL`] only.

pub(crate) mod calls;
pub(crate) mod families;
pub(crate) mod json;

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Collector, Context, PerGpu};
use crate::model::Reading;

/// A clock of [`PowerThermal::clocks_mhz`]: the `clock` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Clock {
    Graphics,
    Sm,
    Memory,
    Video,
}

impl Clock {
    /// Every clock, in the order the families list them.
    pub(crate) const ALL: [Clock; 4] = [Clock::Graphics, Clock::Sm, Clock::Memory, Clock::Video];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Clock::Graphics => "graphics",
            Clock::Sm => "sm",
            Clock::Memory => "memory",
            Clock::Video => "video",
        }
    }
}

/// Temperature, power, energy, clocks and performance state
/// (`power_thermal` collector). `None`: not supported or failed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PowerThermal {
    pub temperature_c: Option<u32>,
    pub power_mw: Option<u32>,
    pub power_limit_mw: Option<u32>,
    /// Energy since the driver was loaded, in millijoules.
    pub energy_mj: Option<u64>,
    /// Current clocks in MHz, indexed by [`Clock`] (`clocks_mhz[c as usize]`).
    pub clocks_mhz: [Option<u32>; 4],
    /// P-state: 0 (maximum performance) to 15.
    pub performance_state: Option<u32>,
    /// The clocks event (throttle) reasons bitmask, decoded by the encoder.
    pub clock_event_reasons: Option<u64>,
}

/// The energy counter (here) and the ECC mode (`health`) are read this
/// often, not at every full sample: on the H200
/// nvmlDeviceGetTotalEnergyConsumption takes 4.1 ms and
/// nvmlDeviceGetEccMode 134 µs, 25× the rest of a full sample's NVML time
/// (docs/results/gpu-collectors-h200-run1.txt). The energy counter is
/// exact as of its read; `rate()` over minutes is unaffected.
pub(crate) const SLOW_READ_INTERVAL: Duration = Duration::from_secs(30);

#[derive(Default)]
struct Gpu {
    read: Option<Arc<PowerThermal>>,
    /// When the energy counter was last read, and what it answered.
    energy_read_at: Option<Instant>,
    energy_mj: Option<u64>,
}

#[derive(Default)]
pub(super) struct PowerThermalCollector {
    gpus: PerGpu<Gpu>,
}

impl PowerThermalCollector {
    pub(super) fn boxed() -> Box<dyn Collector> {
        Box::<PowerThermalCollector>::default()
    }
}

/// Whether a slow read last made at `at` is due again at `now`.
pub(crate) fn slow_read_due(at: Option<Instant>, now: Instant) -> bool {
    at.is_none_or(|at| now.duration_since(at) >= SLOW_READ_INTERVAL)
}

impl Collector for PowerThermalCollector {
    fn collect(&mut self, cx: &mut Context<'_>, gpu: usize) {
        let state = self.gpus.at(gpu);
        if slow_read_due(state.energy_read_at, cx.now) {
            let energy = cx.call(gpu, calls::TOTAL_ENERGY_CONSUMPTION, calls::energy);
            state.energy_read_at = Some(cx.now);
            state.energy_mj = energy.map_err(|e| cx.failed(gpu, e)).ok();
        }
        let p = PowerThermal {
            energy_mj: state.energy_mj,
            ..cx.read_all(gpu, calls::TEMPERATURE, calls::read)
        };
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
