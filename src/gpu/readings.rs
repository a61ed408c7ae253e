//! What the collectors' NVML calls answer, as plain data: the
//! [`GpuSource`](super::GpuSource) methods return these, the collectors in
//! `sample/collectors/` keep them per GPU, and each collector's family
//! group in `expose/` encodes them. A field is `None` when its call failed
//! or is not supported: the family is then absent for that GPU, never a
//! fake 0. Label meaning travels in small enums ([`Clock`],
//! [`EccCounter`]) with a `label()`, not in arrays kept in step by hand.

use std::collections::BTreeMap;
use std::sync::Arc;

/// Busy percentages of one GPU over NVML's last sampling period
/// (`utilization` collector). A field is `None` when its call failed or is
/// not supported: the family is then absent for this GPU, never a fake 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Utilization {
    /// nvidia-smi `utilization.gpu`: time a kernel was running, percent.
    pub gpu: Option<u32>,
    /// nvidia-smi `utilization.memory`: memory controller busy, percent.
    pub memory: Option<u32>,
    pub encoder: Option<u32>,
    pub decoder: Option<u32>,
}

/// One process's busy percentages (`nvidia-smi pmon -s um`), from NVML's
/// process utilisation samples; 0 when the process had no sample since the
/// previous full sample (it did no work).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcessUtilization {
    pub sm: u32,
    pub memory: u32,
    pub encoder: u32,
    pub decoder: u32,
}

/// A clock of [`PowerThermal::clocks_mhz`]: the `clock` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clock {
    Graphics,
    Sm,
    Memory,
    Video,
}

impl Clock {
    /// Every clock, in the order the families list them.
    pub const ALL: [Clock; 4] = [Clock::Graphics, Clock::Sm, Clock::Memory, Clock::Video];

    pub fn label(self) -> &'static str {
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

/// An ECC counter of [`Health::ecc_errors`]: the `type` and `scope` labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EccCounter {
    CorrectedVolatile,
    CorrectedAggregate,
    UncorrectedVolatile,
    UncorrectedAggregate,
}

impl EccCounter {
    /// Every counter, in the order the family lists them.
    pub const ALL: [EccCounter; 4] = [
        EccCounter::CorrectedVolatile,
        EccCounter::CorrectedAggregate,
        EccCounter::UncorrectedVolatile,
        EccCounter::UncorrectedAggregate,
    ];

    /// The `type` label: corrected or uncorrected.
    pub fn error_type(self) -> &'static str {
        match self {
            EccCounter::CorrectedVolatile | EccCounter::CorrectedAggregate => "corrected",
            EccCounter::UncorrectedVolatile | EccCounter::UncorrectedAggregate => "uncorrected",
        }
    }

    /// The `scope` label: volatile (since the driver loaded) or aggregate
    /// (the GPU's life).
    pub fn scope(self) -> &'static str {
        match self {
            EccCounter::CorrectedVolatile | EccCounter::UncorrectedVolatile => "volatile",
            EccCounter::CorrectedAggregate | EccCounter::UncorrectedAggregate => "aggregate",
        }
    }
}

/// Memory health (`health` collector). `None`: not supported or failed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Health {
    pub ecc_enabled: Option<bool>,
    /// ECC error counts, indexed by [`EccCounter`] (`ecc_errors[c as usize]`).
    pub ecc_errors: [Option<u64>; 4],
    /// Row remapping (Ampere and later).
    pub remapped_rows: Option<RemappedRows>,
    /// Page retirement (before Ampere).
    pub retired_pages: Option<RetiredPages>,
    /// Critical Xid events seen since the exporter started watching this
    /// GPU, by Xid; `None` when the GPU does not deliver Xid events.
    pub xid_errors: Option<Arc<BTreeMap<u64, u64>>>,
}

/// nvmlDeviceGetRemappedRows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemappedRows {
    pub correctable: u32,
    pub uncorrectable: u32,
    /// A remap is pending: the GPU needs a reset to apply it.
    pub pending: bool,
    /// A remap failed: the GPU should be serviced.
    pub failed: bool,
}

/// Retired pages by cause, and whether a retirement waits for a reboot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetiredPages {
    pub single_bit_ecc: Option<u32>,
    pub double_bit_ecc: Option<u32>,
    pub pending: Option<bool>,
}

/// A GPM (GPU Performance Monitoring) metric the `gpm` collector asks for:
/// the families of `expose/gpm.rs`, NVML's metric id, and its unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpmMetric {
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
pub enum GpmUnit {
    /// 0.0–100.0.
    Percent,
    /// MiB (2^20 bytes) per second.
    MibPerSecond,
}

impl GpmMetric {
    /// Every metric, in the order the families list them (and the order
    /// of [`Gpm::values`]).
    pub const ALL: [GpmMetric; 11] = [
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

    /// NVML's `nvmlGpmMetricId_t` (nvml.h), for docs/metrics.md.
    pub fn nvml_id(self) -> u32 {
        match self {
            GpmMetric::SmActivity => 2,      // NVML_GPM_METRIC_SM_UTIL
            GpmMetric::SmOccupancy => 3,     // NVML_GPM_METRIC_SM_OCCUPANCY
            GpmMetric::TensorActivity => 5,  // NVML_GPM_METRIC_ANY_TENSOR_UTIL
            GpmMetric::DramBandwidth => 10,  // NVML_GPM_METRIC_DRAM_BW_UTIL
            GpmMetric::Fp64Activity => 11,   // NVML_GPM_METRIC_FP64_UTIL
            GpmMetric::Fp32Activity => 12,   // NVML_GPM_METRIC_FP32_UTIL
            GpmMetric::Fp16Activity => 13,   // NVML_GPM_METRIC_FP16_UTIL
            GpmMetric::PcieTransmit => 20,   // NVML_GPM_METRIC_PCIE_TX_PER_SEC
            GpmMetric::PcieReceive => 21,    // NVML_GPM_METRIC_PCIE_RX_PER_SEC
            GpmMetric::NvlinkReceive => 60,  // NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC
            GpmMetric::NvlinkTransmit => 61, // NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC
        }
    }

    pub fn unit(self) -> GpmUnit {
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
pub struct Gpm {
    pub values: [Option<f64>; 11],
}

/// Never NaN (the source keeps only finite values), so equality is one.
impl Eq for Gpm {}

/// What the `gpm` collector read of one GPU: the GPU's own figures, and
/// each MIG GPU instance's (by GPU instance id).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpmReading {
    pub gpu: Option<Gpm>,
    pub instances: Vec<(u32, Gpm)>,
}

impl Eq for GpmReading {}

/// nvmlDeviceGetVirtualizationMode, as far as the sampler cares.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Virtualization {
    /// Bare metal, passthrough, or a hypervisor host.
    #[default]
    None,
    /// A vGPU guest: some calls misbehave there (row remapping queries
    /// spam the kernel log, nvidia_gpu_exporter #384).
    VgpuGuest,
}
