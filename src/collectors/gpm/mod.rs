//! `gpm`: NVML's GPU Performance Monitoring (Hopper and later): SM
//! activity and occupancy, tensor-core, DRAM bandwidth and FP16/32/64
//! activity, PCIe and NVLink bytes per second, per GPU and per MIG GPU
//! instance. A GPM metric is the difference of two samples: each full
//! sample takes one per GPU (and instance), and the figures are the
//! averages since the previous full sample (the NVML handle's state keeps that
//! sample, see `calls.rs`), so the first full sample has none.
//!
//! Support is asked once per GPU (`nvmlGpmQueryDeviceSupport`); a GPU
//! without it is logged once and never sampled.
//!
//! **No silent stale reading.** An answer equal, metric for metric and bit
//! for bit, to the previous answer of the same GPU (or instance), with any
//! figure above 0, is not served: those are ratios of hardware counters
//! over two different intervals, which a busy GPU never repeats to 16
//! digits, so such an answer comes from samples that did not advance (seen
//! on an H200 with `nvidia-smi dmon --gpm-metrics` beside the exporter: the
//! same figures for over 4 s while the GPU kept computing, no error). Its
//! families are absent for that sample, it is counted
//! (`gpumem_exporter_gpm_stale_readings_total`) and logged once per GPU. An
//! idle GPU's answer (every figure 0) repeats and is served. Cost on the H200 (driver
//! 580), measured in the exporter by scripts/gpu/gpm.py: +254 µs per GPU
//! per full sample (196 → 450 µs); off by default until it has run on
//! more than one GPU model.

pub(crate) mod calls;
pub(crate) mod families;
pub(crate) mod json;

use std::sync::Arc;

use super::{Collector, Context, PerGpu};
use crate::gpu::{ErrorKind, GpuError};
use crate::model::Reading;

/// A GPM (GPU Performance Monitoring) metric the `gpm` collector asks for:
/// the families of `families.rs`, NVML's metric id, and its unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GpmMetric {
    SmActivity,
    SmOccupancy,
    TensorActivity,
    DramBandwidth,
    Fp16Activity,
    Fp32Activity,
    Fp64Activity,
    PcieTransmit,
    PcieReceive,
    NvlinkTransmit,
    NvlinkReceive,
}

/// NVML's unit of a GPM metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GpmUnit {
    /// 0.0–100.0.
    Percent,
    /// MiB (2^20 bytes) per second.
    MibPerSecond,
}

impl GpmMetric {
    /// Every metric, in the order the families list them (and the order
    /// of [`Gpm::values`]).
    pub(crate) const ALL: [GpmMetric; 11] = [
        GpmMetric::SmActivity,
        GpmMetric::SmOccupancy,
        GpmMetric::TensorActivity,
        GpmMetric::DramBandwidth,
        GpmMetric::Fp16Activity,
        GpmMetric::Fp32Activity,
        GpmMetric::Fp64Activity,
        GpmMetric::PcieTransmit,
        GpmMetric::PcieReceive,
        GpmMetric::NvlinkTransmit,
        GpmMetric::NvlinkReceive,
    ];

    pub(crate) fn unit(self) -> GpmUnit {
        match self {
            GpmMetric::PcieTransmit
            | GpmMetric::PcieReceive
            | GpmMetric::NvlinkTransmit
            | GpmMetric::NvlinkReceive => GpmUnit::MibPerSecond,
            _ => GpmUnit::Percent,
        }
    }
}

/// GPM metrics between two GPM samples of one GPU or MIG instance, in
/// NVML's units ([`GpmMetric::unit`]), indexed by [`GpmMetric`]
/// (`values[m as usize]`); `None` where the metric is not supported.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Gpm {
    pub values: [Option<f64>; 11],
}

/// Never NaN (the source keeps only finite values), so equality is one.
impl Eq for Gpm {}

/// What the `gpm` collector read of one GPU: the GPU's own figures, and
/// each MIG GPU instance's (by GPU instance id); and the stale answers of
/// this GPU so far (not served).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct GpmReading {
    pub gpu: Option<Gpm>,
    pub instances: Vec<(u32, Gpm)>,
    pub stale: u64,
}

impl Gpm {
    /// Any figure above 0 (a GPU doing something).
    fn busy(&self) -> bool {
        self.values.iter().flatten().any(|v| *v != 0.0)
    }

    /// The same answer, bit for bit.
    fn same(&self, other: &Gpm) -> bool {
        self.values
            .iter()
            .zip(&other.values)
            .all(|(a, b)| a.map(f64::to_bits) == b.map(f64::to_bits))
    }
}

impl Eq for GpmReading {}

#[derive(Default)]
struct Gpu {
    /// `None` until asked, then whether the GPU has GPM.
    supported: Option<bool>,
    /// The GPU's own sample, and the MIG GPU instances' samples (by id),
    /// that answered NOT_SUPPORTED (logged once): not asked again.
    gpu_unsupported: bool,
    instances_unsupported: Vec<u32>,
    read: Option<Arc<GpmReading>>,
    /// The last answer of the GPU (key `None`) and of each instance.
    last: Vec<(Option<u32>, Gpm)>,
    /// Stale answers so far; whether that was logged.
    stale: u64,
    stale_logged: bool,
}

impl Gpu {
    /// `g`, unless it repeats the last answer of `key` while busy: then
    /// `None`, counted, logged once.
    fn fresh(&mut self, gpu: usize, key: Option<u32>, g: Gpm) -> Option<Gpm> {
        let repeated = match self.last.iter().position(|l| l.0 == key) {
            Some(i) => {
                let same = self.last[i].1.same(&g) && g.busy();
                self.last[i].1 = g;
                same
            }
            None => {
                self.last.push((key, g));
                false
            }
        };
        if !repeated {
            return Some(g);
        }
        self.stale += 1;
        if !self.stale_logged {
            self.stale_logged = true;
            tracing::warn!(
                gpu,
                "GPM answered exactly the figures of the previous sample while busy (samples that did not advance, e.g. another GPM client on the GPU); such answers are not served and are counted in gpumem_exporter_gpm_stale_readings_total"
            );
        }
        None
    }
}

#[derive(Default)]
pub(super) struct GpmCollector {
    gpus: PerGpu<Gpu>,
}

impl GpmCollector {
    pub(super) fn boxed() -> Box<dyn Collector> {
        Box::<GpmCollector>::default()
    }
}

impl Collector for GpmCollector {
    fn collect(&mut self, cx: &mut Context<'_>, gpu: usize) {
        let state = self.gpus.at(gpu);
        if state.supported.is_none() {
            match cx.call(gpu, calls::GPM_QUERY_DEVICE_SUPPORT, calls::supported) {
                Ok(true) => state.supported = Some(true),
                Ok(false) => {
                    state.supported = Some(false);
                    cx.failed(
                        gpu,
                        GpuError::new(calls::GPM_QUERY_DEVICE_SUPPORT, ErrorKind::NotSupported),
                    );
                }
                Err(e) => {
                    if e.kind.is_unsupported() {
                        state.supported = Some(false);
                    }
                    cx.failed(gpu, e);
                }
            }
        }
        if state.supported != Some(true) {
            state.read = None;
            return;
        }
        let mut reading = GpmReading::default();
        if !state.gpu_unsupported {
            match cx.call(gpu, calls::GPM_SAMPLE_GET, |h| calls::sample(h, gpu, None)) {
                Ok(g) => reading.gpu = g.and_then(|g| state.fresh(gpu, None, g)),
                Err(e) => {
                    state.gpu_unsupported = e.kind.is_unsupported();
                    cx.failed(gpu, e);
                }
            }
        }
        for gi in cx.mig_gpu_instances(gpu) {
            if state.instances_unsupported.contains(&gi) {
                continue;
            }
            match cx.call(gpu, calls::GPM_MIG_SAMPLE_GET, |h| {
                calls::sample(h, gpu, Some(gi))
            }) {
                Ok(Some(g)) => {
                    if let Some(g) = state.fresh(gpu, Some(gi), g) {
                        reading.instances.push((gi, g));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    if e.kind.is_unsupported() {
                        state.instances_unsupported.push(gi);
                    }
                    cx.failed(gpu, e);
                }
            }
        }
        reading.stale = state.stale;
        state.read = (reading != GpmReading::default()).then(|| Arc::new(reading));
    }

    fn forget(&mut self, gpu: usize) {
        self.gpus.at(gpu).read = None;
    }

    fn reading(&self, gpu: usize) -> Option<Arc<dyn Reading>> {
        let r = self.gpus.get(gpu)?.read.clone()?;
        Some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_busy_answer_is_not_served_and_counted() {
        let busy = Gpm {
            values: [
                Some(85.5),
                Some(42.0),
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
            ],
        };
        let mut moved = busy;
        moved.values[0] = Some(85.500_000_000_1);
        let idle = Gpm {
            values: [Some(0.0); 11],
        };
        let mut g = Gpu::default();
        assert_eq!(g.fresh(0, None, busy), Some(busy), "the first answer");
        assert_eq!(g.fresh(0, None, busy), None, "the same figures again, busy");
        assert_eq!(g.fresh(0, None, busy), None, "and again");
        assert_eq!(g.stale, 2);
        assert_eq!(g.fresh(0, None, moved), Some(moved), "moved on");
        // Each instance is compared with its own previous answer.
        assert_eq!(g.fresh(0, Some(1), moved), Some(moved));
        assert_eq!(g.fresh(0, Some(2), idle), Some(idle));
        assert_eq!(
            g.fresh(0, Some(2), idle),
            Some(idle),
            "idle repeats: served"
        );
        assert_eq!(g.stale, 2);
        assert!(g.stale_logged);
    }
}
