//! The scenario: serde types (what the YAML says, `*File`) and the validated
//! runtime form the C functions answer from. Validation is the only place that
//! rejects a scenario, so a bad edit never reaches the C side half-applied.

use std::ffi::c_char;
use std::time::Duration;

use nvml_wrapper_sys::bindings::{
    NVML_DEVICE_NAME_V2_BUFFER_SIZE, NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE,
    NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE, NVML_DEVICE_UUID_BUFFER_SIZE,
    NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE, NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE,
    nvmlGpmMetricId_t_NVML_GPM_METRIC_ANY_TENSOR_UTIL as NVML_GPM_METRIC_ANY_TENSOR_UTIL,
    nvmlGpmMetricId_t_NVML_GPM_METRIC_DRAM_BW_UTIL as NVML_GPM_METRIC_DRAM_BW_UTIL,
    nvmlGpmMetricId_t_NVML_GPM_METRIC_FP16_UTIL as NVML_GPM_METRIC_FP16_UTIL,
    nvmlGpmMetricId_t_NVML_GPM_METRIC_FP32_UTIL as NVML_GPM_METRIC_FP32_UTIL,
    nvmlGpmMetricId_t_NVML_GPM_METRIC_FP64_UTIL as NVML_GPM_METRIC_FP64_UTIL,
    nvmlGpmMetricId_t_NVML_GPM_METRIC_GRAPHICS_UTIL as NVML_GPM_METRIC_GRAPHICS_UTIL,
    nvmlGpmMetricId_t_NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC as NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC,
    nvmlGpmMetricId_t_NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC as NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC,
    nvmlGpmMetricId_t_NVML_GPM_METRIC_PCIE_RX_PER_SEC as NVML_GPM_METRIC_PCIE_RX_PER_SEC,
    nvmlGpmMetricId_t_NVML_GPM_METRIC_PCIE_TX_PER_SEC as NVML_GPM_METRIC_PCIE_TX_PER_SEC,
    nvmlGpmMetricId_t_NVML_GPM_METRIC_SM_OCCUPANCY as NVML_GPM_METRIC_SM_OCCUPANCY,
    nvmlGpmMetricId_t_NVML_GPM_METRIC_SM_UTIL as NVML_GPM_METRIC_SM_UTIL,
    nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_HOST_VGPU,
    nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_HOST_VSGA,
    nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_NONE,
    nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_PASSTHROUGH,
    nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_VGPU, nvmlGpuVirtualizationMode_t,
    nvmlPciInfo_t, nvmlProcessInfo_t, nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED,
    nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST, nvmlReturn_enum_NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    nvmlReturn_enum_NVML_ERROR_NO_PERMISSION, nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED,
    nvmlReturn_enum_NVML_ERROR_TIMEOUT, nvmlReturn_enum_NVML_ERROR_UNINITIALIZED,
    nvmlReturn_enum_NVML_ERROR_UNKNOWN, nvmlReturn_t,
};
use serde::Deserialize;

/// `NVML_VALUE_NOT_AVAILABLE` as NVML writes it into an unsigned long long.
pub const VALUE_NOT_AVAILABLE: u64 = u64::MAX;
/// gpuInstanceId / computeInstanceId of a process that is not in a MIG instance.
pub const NO_INSTANCE: u32 = 0xFFFF_FFFF;
/// What an H200 answers to nvmlDeviceGetMaxMigDeviceCount.
pub const MAX_MIG_DEVICES: usize = 7;
/// PCI ids of an H200 SXM (device/vendor and subsystem/vendor).
const PCI_DEVICE_ID: u32 = 0x2335_10DE;
const PCI_SUBSYSTEM_ID: u32 = 0x18BE_10DE;
/// Handles pack indices into 16-bit fields (see [`Scenario::resolve`]).
const MAX_ITEMS: usize = 0xFFFE;

// ---------------------------------------------------------------- YAML types

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScenarioFile {
    #[serde(default = "default_driver_version")]
    driver_version: String,
    #[serde(default = "default_nvml_version")]
    nvml_version: String,
    #[serde(default = "default_cuda_driver_version")]
    cuda_driver_version: i32,
    #[serde(default)]
    init_error: Option<InitErrorFile>,
    #[serde(default)]
    init_delay_ms: u64,
    #[serde(default)]
    runtime_error: Option<RuntimeErrorFile>,
    #[serde(default)]
    devices: Vec<DeviceFile>,
}

fn default_driver_version() -> String {
    "580.159.04".into()
}
fn default_nvml_version() -> String {
    "13.580.159.04".into()
}
fn default_cuda_driver_version() -> i32 {
    13000
}
fn default_name() -> String {
    "NVIDIA H200".into()
}
fn default_memory() -> MemoryFile {
    MemoryFile {
        total: 150_754_820_096,
        reserved: 644_939_776,
        used: 0,
    }
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum InitErrorFile {
    DriverNotLoaded,
    NoPermission,
    Unknown,
    LibRmVersionMismatch,
}

/// What every call after init answers while the driver is "gone".
#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum RuntimeErrorFile {
    LibRmVersionMismatch,
    DriverNotLoaded,
    Uninitialized,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum DeviceErrorFile {
    GpuLost,
    Unknown,
    NotSupported,
    NoPermission,
    Timeout,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeviceFile {
    uuid: String,
    #[serde(default = "default_name")]
    name: String,
    #[serde(default)]
    pci_bus_id: Option<String>,
    #[serde(default = "default_memory")]
    memory: MemoryFile,
    #[serde(default)]
    processes: Vec<ProcessFile>,
    #[serde(default)]
    error: Option<DeviceErrorFile>,
    #[serde(default)]
    handle_error: Option<DeviceErrorFile>,
    #[serde(default)]
    delay_ms: u64,
    #[serde(default)]
    mig_devices: Vec<MigFile>,
    // Telemetry and health: absent means the GPU answers NOT_SUPPORTED.
    #[serde(default)]
    utilization: UtilizationFile,
    #[serde(default)]
    process_utilization: Option<Vec<ProcessUtilizationFile>>,
    #[serde(default)]
    utilization_samples: Option<UtilizationSamplesFile>,
    #[serde(default)]
    temperature_c: Option<u32>,
    #[serde(default)]
    power_mw: Option<u32>,
    #[serde(default)]
    power_limit_mw: Option<u32>,
    #[serde(default)]
    energy_mj: Option<u64>,
    #[serde(default)]
    clocks_mhz: ClocksFile,
    #[serde(default)]
    performance_state: Option<u32>,
    #[serde(default)]
    clock_event_reasons: Option<u64>,
    #[serde(default)]
    ecc: Option<EccFile>,
    #[serde(default)]
    remapped_rows: Option<RemappedRowsFile>,
    #[serde(default)]
    retired_pages: Option<RetiredPagesFile>,
    #[serde(default)]
    xid_events: Option<Vec<u64>>,
    /// nvmlDeviceGetMemoryInfo(_v2) answer NOT_SUPPORTED (DGX Spark / GB10).
    #[serde(default)]
    unified_memory: bool,
    #[serde(default)]
    virtualization_mode: VirtualizationModeFile,
    #[serde(default)]
    gpm: Option<GpmFile>,
    /// nvmlGpmSampleGet does not advance: see [`Gpu::gpm_stale`].
    #[serde(default)]
    gpm_stale: bool,
    /// `[[unix_seconds, used], ...]`: used memory over time, see
    /// [`Gpu::used_timeline`].
    #[serde(default)]
    used_timeline: Option<Vec<(f64, u64)>>,
    /// `{"/sys/fs/cgroup/…": {soft, hard, used}}`: see [`Gpu::memory_limits`].
    #[serde(default)]
    memory_limits: std::collections::BTreeMap<String, MemoryLimits>,
}

/// What nvmlDeviceGetMemoryLimits_v1 answers for one cgroup directory.
#[derive(Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct MemoryLimits {
    #[serde(default)]
    pub soft: u64,
    /// Absent: no hard limit (`NVML_DEVICE_MEMORY_LIMIT_MAX`, all ones).
    #[serde(default = "no_hard_limit")]
    pub hard: u64,
    #[serde(default)]
    pub used: u64,
}

fn no_hard_limit() -> u64 {
    u64::MAX
}

/// nvmlDeviceGetVirtualizationMode's answer.
#[derive(Deserialize, Default, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum VirtualizationModeFile {
    #[default]
    None,
    Passthrough,
    Vgpu,
    HostVgpu,
    HostVsga,
}

/// GPM metric values as NVML computes them (percent 0..=100 for the
/// utilisations, MiB/s for the throughputs); each absent one answers
/// NOT_SUPPORTED in nvmlGpmMetricsGet.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct GpmFile {
    #[serde(default)]
    graphics_util: Option<f64>,
    #[serde(default)]
    sm_util: Option<f64>,
    #[serde(default)]
    sm_occupancy: Option<f64>,
    #[serde(default)]
    any_tensor_util: Option<f64>,
    #[serde(default)]
    dram_bw_util: Option<f64>,
    #[serde(default)]
    fp64_util: Option<f64>,
    #[serde(default)]
    fp32_util: Option<f64>,
    #[serde(default)]
    fp16_util: Option<f64>,
    #[serde(default)]
    pcie_tx_per_sec: Option<f64>,
    #[serde(default)]
    pcie_rx_per_sec: Option<f64>,
    #[serde(default)]
    nvlink_total_rx_per_sec: Option<f64>,
    #[serde(default)]
    nvlink_total_tx_per_sec: Option<f64>,
}

/// (NVML metric id, value) pairs; percentages checked to 0..=100.
fn gpm(at: &str, g: Option<GpmFile>) -> Result<Option<Vec<(u32, f64)>>, String> {
    let Some(g) = g else { return Ok(None) };
    let list = [
        (
            NVML_GPM_METRIC_GRAPHICS_UTIL,
            "graphics_util",
            g.graphics_util,
            true,
        ),
        (NVML_GPM_METRIC_SM_UTIL, "sm_util", g.sm_util, true),
        (
            NVML_GPM_METRIC_SM_OCCUPANCY,
            "sm_occupancy",
            g.sm_occupancy,
            true,
        ),
        (
            NVML_GPM_METRIC_ANY_TENSOR_UTIL,
            "any_tensor_util",
            g.any_tensor_util,
            true,
        ),
        (
            NVML_GPM_METRIC_DRAM_BW_UTIL,
            "dram_bw_util",
            g.dram_bw_util,
            true,
        ),
        (NVML_GPM_METRIC_FP64_UTIL, "fp64_util", g.fp64_util, true),
        (NVML_GPM_METRIC_FP32_UTIL, "fp32_util", g.fp32_util, true),
        (NVML_GPM_METRIC_FP16_UTIL, "fp16_util", g.fp16_util, true),
        (
            NVML_GPM_METRIC_PCIE_TX_PER_SEC,
            "pcie_tx_per_sec",
            g.pcie_tx_per_sec,
            false,
        ),
        (
            NVML_GPM_METRIC_PCIE_RX_PER_SEC,
            "pcie_rx_per_sec",
            g.pcie_rx_per_sec,
            false,
        ),
        (
            NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC,
            "nvlink_total_rx_per_sec",
            g.nvlink_total_rx_per_sec,
            false,
        ),
        (
            NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC,
            "nvlink_total_tx_per_sec",
            g.nvlink_total_tx_per_sec,
            false,
        ),
    ];
    let mut out = Vec::new();
    for (id, key, v, pct) in list {
        let Some(v) = v else { continue };
        if !v.is_finite() || v < 0.0 || (pct && v > 100.0) {
            return Err(format!("{at}.gpm.{key}: {v} is out of range"));
        }
        out.push((id, v));
    }
    Ok(Some(out))
}

/// `utilization_samples`: nvmlDeviceGetSamples(NVML_GPU_UTILIZATION_SAMPLES).
#[derive(Deserialize, Debug, Clone, Copy)]
#[serde(deny_unknown_fields)]
struct UtilizationSamplesFile {
    gpu: u32,
    #[serde(default = "default_sample_period_us")]
    period_us: u64,
}

fn default_sample_period_us() -> u64 {
    UTILIZATION_SAMPLE_PERIOD_US
}

/// What an H200 samples GPU utilisation at (1/6 s).
pub const UTILIZATION_SAMPLE_PERIOD_US: u64 = 166_667;

/// NVML's GPU utilisation samples of one GPU: a sample of `gpu` percent
/// every `period_us`, on the wall clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UtilizationSamples {
    pub gpu: u32,
    pub period_us: u64,
}

/// Percentages; each missing one makes its call NOT_SUPPORTED.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct UtilizationFile {
    #[serde(default)]
    gpu: Option<u32>,
    #[serde(default)]
    memory: Option<u32>,
    #[serde(default)]
    encoder: Option<u32>,
    #[serde(default)]
    decoder: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProcessUtilizationFile {
    pid: u32,
    #[serde(default)]
    sm: u32,
    #[serde(default)]
    memory: u32,
    #[serde(default)]
    encoder: u32,
    #[serde(default)]
    decoder: u32,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ClocksFile {
    #[serde(default)]
    graphics: Option<u32>,
    #[serde(default)]
    sm: Option<u32>,
    #[serde(default)]
    memory: Option<u32>,
    #[serde(default)]
    video: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EccFile {
    #[serde(default = "default_true")]
    enabled: bool,
    /// The mode after the next reboot; defaults to `enabled`.
    #[serde(default)]
    pending_enabled: Option<bool>,
    #[serde(default)]
    corrected_volatile: u64,
    #[serde(default)]
    corrected_aggregate: u64,
    #[serde(default)]
    uncorrected_volatile: u64,
    #[serde(default)]
    uncorrected_aggregate: u64,
}

fn default_true() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RemappedRowsFile {
    #[serde(default)]
    correctable: u32,
    #[serde(default)]
    uncorrectable: u32,
    #[serde(default)]
    pending: bool,
    #[serde(default)]
    failed: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RetiredPagesFile {
    #[serde(default)]
    single_bit_ecc: u32,
    #[serde(default)]
    double_bit_ecc: u32,
    #[serde(default)]
    pending: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MemoryFile {
    total: u64,
    #[serde(default)]
    reserved: u64,
    #[serde(default)]
    used: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProcessFile {
    pid: u32,
    /// `null` (or absent): NVML could not attribute memory to the process.
    #[serde(default)]
    used: Option<u64>,
    #[serde(default, rename = "type")]
    kind: ProcessKind,
    /// `[[unix_seconds, used], ...]`: the process's bytes over time, as a
    /// GPU's `used_timeline`; overrides `used`.
    #[serde(default)]
    used_timeline: Option<Vec<(f64, u64)>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MigFile {
    uuid: String,
    gpu_instance_id: u32,
    compute_instance_id: u32,
    memory: MemoryFile,
    #[serde(default)]
    processes: Vec<ProcessFile>,
    #[serde(default)]
    gpm: Option<GpmFile>,
}

/// Which process queries list a process.
#[derive(Deserialize, Default, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "snake_case")]
pub enum ProcessKind {
    #[default]
    Compute,
    Graphics,
    Both,
    Mps,
}

/// The three process queries NVML offers.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Query {
    Compute,
    Graphics,
    Mps,
}

impl ProcessKind {
    fn listed_by(self, query: Query) -> bool {
        matches!(
            (self, query),
            (ProcessKind::Compute | ProcessKind::Both, Query::Compute)
                | (ProcessKind::Graphics | ProcessKind::Both, Query::Graphics)
                | (ProcessKind::Mps, Query::Mps)
        )
    }
}

// ------------------------------------------------------------- runtime types

pub struct Scenario {
    /// µs since the epoch: the timeStamp of this scenario's first process
    /// utilisation sample (set by the loader from the file's mtime).
    pub sample_base_us: u64,
    pub driver_version: String,
    pub nvml_version: String,
    pub cuda_driver_version: i32,
    pub init_error: Option<nvmlReturn_t>,
    pub init_delay: Duration,
    /// Every call but init, shutdown and nvmlErrorString fails with it.
    pub runtime_error: Option<nvmlReturn_t>,
    pub gpus: Vec<Gpu>,
}

pub struct Gpu {
    pub uuid: String,
    pub name: String,
    pub pci: nvmlPciInfo_t,
    pub memory: Memory,
    pub processes: Vec<Process>,
    /// Every call taking this GPU's handle (or one of its MIG handles) fails with it.
    pub error: Option<nvmlReturn_t>,
    /// nvmlDeviceGetHandleByIndex_v2 fails with it.
    pub handle_error: Option<nvmlReturn_t>,
    pub delay: Duration,
    pub migs: Vec<Mig>,
    pub telemetry: Telemetry,
    pub health: Health,
    /// `xid_events`: None = events NOT_SUPPORTED.
    pub xid_events: Option<Vec<u64>>,
    /// Memory info answers NOT_SUPPORTED.
    pub unified_memory: bool,
    pub virtualization_mode: nvmlGpuVirtualizationMode_t,
    /// GPM metric values by NVML id; None = GPM NOT_SUPPORTED.
    pub gpm: Option<Vec<(u32, f64)>>,
    /// A stale GPM answer, as seen on an H200 with a second GPM client
    /// (`nvidia-smi dmon --gpm-metrics`) on the GPU: nvmlGpmSampleGet
    /// succeeds but the sample does not advance (it is a copy of the
    /// GPU's previous one), and nvmlGpmMetricsGet over two such samples
    /// answers the previous figures again, without an error.
    pub gpm_stale: bool,
    /// Used memory over time: (Unix seconds, bytes) knots in time order,
    /// linear between two, a repeated time a jump; before the first its
    /// value, after the last its value. Overrides `memory.used` for this
    /// GPU (the time is the process's clock, so a test may run the
    /// exporter under `faketime` to play minutes in seconds).
    pub used_timeline: Option<Vec<(f64, u64)>>,
    /// nvmlDeviceGetMemoryLimits_v1's answers, by the cgroup directory's
    /// full path as asked (`nameSpace`); any other path is `NOT_FOUND`.
    pub memory_limits: std::collections::BTreeMap<String, MemoryLimits>,
}

impl Gpu {
    /// Used bytes at Unix time `now`, from the timeline.
    pub fn used_at(timeline: &[(f64, u64)], now: f64) -> Option<u64> {
        let after = timeline.partition_point(|k| k.0 <= now);
        let last = after.checked_sub(1).and_then(|i| timeline.get(i)).copied();
        let Some(next) = timeline.get(after).copied() else {
            return last.map(|k| k.1);
        };
        let Some(a) = last else {
            return Some(next.1);
        };
        let f = (now - a.0) / (next.0 - a.0);
        Some((a.1 as f64 + f * (next.1 as f64 - a.1 as f64)).round() as u64)
    }
}

/// Utilisation, power, thermal and clocks; `None` = NOT_SUPPORTED.
#[derive(Clone, Debug, Default)]
pub struct Telemetry {
    pub gpu_util: Option<u32>,
    pub memory_util: Option<u32>,
    pub encoder_util: Option<u32>,
    pub decoder_util: Option<u32>,
    pub process_utilization: Option<Vec<ProcessUtilization>>,
    pub utilization_samples: Option<UtilizationSamples>,
    pub temperature_c: Option<u32>,
    pub power_mw: Option<u32>,
    pub power_limit_mw: Option<u32>,
    pub energy_mj: Option<u64>,
    pub clock_graphics: Option<u32>,
    pub clock_sm: Option<u32>,
    pub clock_memory: Option<u32>,
    pub clock_video: Option<u32>,
    pub performance_state: Option<u32>,
    pub clock_event_reasons: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessUtilization {
    pub pid: u32,
    pub sm: u32,
    pub memory: u32,
    pub encoder: u32,
    pub decoder: u32,
}

/// Memory health; `None` = NOT_SUPPORTED.
#[derive(Clone, Debug, Default)]
pub struct Health {
    pub ecc: Option<Ecc>,
    pub remapped_rows: Option<RemappedRows>,
    pub retired_pages: Option<RetiredPages>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ecc {
    pub enabled: bool,
    pub pending_enabled: bool,
    pub corrected_volatile: u64,
    pub corrected_aggregate: u64,
    pub uncorrected_volatile: u64,
    pub uncorrected_aggregate: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemappedRows {
    pub correctable: u32,
    pub uncorrectable: u32,
    pub pending: bool,
    pub failed: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetiredPages {
    pub single_bit_ecc: u32,
    pub double_bit_ecc: u32,
    pub pending: bool,
}

pub struct Mig {
    pub uuid: String,
    pub name: String,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
    pub memory: Memory,
    pub processes: Vec<Process>,
    pub gpm: Option<Vec<(u32, f64)>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Memory {
    pub total: u64,
    pub reserved: u64,
    pub used: u64,
}

impl Memory {
    /// v2 semantics, as measured on an H200: free = total − reserved − used.
    pub fn free(&self) -> u64 {
        self.total
            .saturating_sub(self.reserved)
            .saturating_sub(self.used)
    }
}

#[derive(Clone, Debug)]
pub struct Process {
    pub pid: u32,
    pub used: u64,
    pub kind: ProcessKind,
    /// Its bytes over the process's clock (see [`Gpu::used_timeline`]).
    pub used_timeline: Option<Vec<(f64, u64)>>,
}

impl Process {
    /// Its bytes now: from the timeline where it has one.
    pub fn used_now(&self) -> u64 {
        let Some(t) = &self.used_timeline else {
            return self.used;
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        Gpu::used_at(t, now).unwrap_or(self.used)
    }
}

impl Gpu {
    pub fn mig_enabled(&self) -> bool {
        !self.migs.is_empty()
    }
}

/// What a device handle points at, resolved against the current scenario.
#[derive(Clone, Copy)]
pub enum Target<'a> {
    Gpu {
        index: usize,
        gpu: &'a Gpu,
    },
    Mig {
        parent_index: usize,
        parent: &'a Gpu,
        mig: &'a Mig,
    },
}

impl<'a> Target<'a> {
    /// The physical GPU: owner of error injection, delay and PCI identity.
    pub fn gpu(&self) -> &'a Gpu {
        match *self {
            Target::Gpu { gpu, .. } => gpu,
            Target::Mig { parent, .. } => parent,
        }
    }

    pub fn uuid(&self) -> &'a str {
        match *self {
            Target::Gpu { gpu, .. } => &gpu.uuid,
            Target::Mig { mig, .. } => &mig.uuid,
        }
    }

    pub fn name(&self) -> &'a str {
        match *self {
            Target::Gpu { gpu, .. } => &gpu.name,
            Target::Mig { mig, .. } => &mig.name,
        }
    }

    pub fn memory(&self) -> Memory {
        match *self {
            Target::Gpu { gpu, .. } => match &gpu.used_timeline {
                Some(t) => {
                    let now = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0.0, |d| d.as_secs_f64());
                    Memory {
                        used: Gpu::used_at(t, now).unwrap_or(gpu.memory.used),
                        ..gpu.memory
                    }
                }
                None => gpu.memory,
            },
            Target::Mig { mig, .. } => mig.memory,
        }
    }

    /// The process table a query returns: a MIG-enabled GPU lists the
    /// processes of all its MIG devices, each with its instance ids.
    pub fn processes(&self, query: Query) -> Vec<nvmlProcessInfo_t> {
        let entry = |p: &Process, gi: u32, ci: u32| nvmlProcessInfo_t {
            pid: p.pid,
            usedGpuMemory: p.used_now(),
            gpuInstanceId: gi,
            computeInstanceId: ci,
        };
        let mut out = Vec::new();
        let mut push_mig = |mig: &Mig| {
            out.extend(
                mig.processes
                    .iter()
                    .filter(|p| p.kind.listed_by(query))
                    .map(|p| entry(p, mig.gpu_instance_id, mig.compute_instance_id)),
            );
        };
        match *self {
            Target::Gpu { gpu, .. } => {
                gpu.migs.iter().for_each(&mut push_mig);
                out.extend(
                    gpu.processes
                        .iter()
                        .filter(|p| p.kind.listed_by(query))
                        .map(|p| entry(p, NO_INSTANCE, NO_INSTANCE)),
                );
            }
            Target::Mig { mig, .. } => push_mig(mig),
        }
        out
    }
}

// ------------------------------------------------------------------ handles
//
// nvmlDevice_t is an opaque pointer nobody dereferences, so it carries indices:
// low 16 bits = GPU index + 1, next 16 bits = MIG index + 1 (0 for the GPU
// itself), and for a MIG handle bits 32..48 a tag of the instance's UUID, so a
// handle to an instance that was destroyed (the scenario's MIG list changed)
// is stale, as in NVML. Never null, and anything else resolves to None
// (INVALID_ARGUMENT).

pub fn gpu_handle(index: usize) -> usize {
    index + 1
}

pub fn mig_handle(parent_index: usize, mig_index: usize, uuid: &str) -> usize {
    (usize::from(uuid_tag(uuid)) << 32) | ((mig_index + 1) << 16) | (parent_index + 1)
}

/// 16-bit FNV-1a fold of a UUID (non-zero).
fn uuid_tag(uuid: &str) -> u16 {
    let mut h: u32 = 0x811C_9DC5;
    for b in uuid.bytes() {
        h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
    }
    ((h >> 16) as u16 ^ h as u16) | 1
}

impl Scenario {
    pub fn resolve(&self, handle: usize) -> Option<Target<'_>> {
        if (handle as u64) >> 48 != 0 {
            return None;
        }
        let gpu_part = handle & 0xFFFF;
        let mig_part = (handle >> 16) & 0xFFFF;
        let tag = ((handle as u64) >> 32) as u16;
        let index = gpu_part.checked_sub(1)?;
        let gpu = self.gpus.get(index)?;
        match mig_part.checked_sub(1) {
            None if tag == 0 => Some(Target::Gpu { index, gpu }),
            None => None,
            Some(m) => {
                let mig = gpu.migs.get(m).filter(|mig| uuid_tag(&mig.uuid) == tag)?;
                Some(Target::Mig {
                    parent_index: index,
                    parent: gpu,
                    mig,
                })
            }
        }
    }

    /// A GPU or MIG device by UUID, as its handle.
    pub fn handle_by_uuid(&self, uuid: &[u8]) -> Option<usize> {
        for (i, gpu) in self.gpus.iter().enumerate() {
            if gpu.uuid.as_bytes() == uuid {
                return Some(gpu_handle(i));
            }
            for (m, mig) in gpu.migs.iter().enumerate() {
                if mig.uuid.as_bytes() == uuid {
                    return Some(mig_handle(i, m, &mig.uuid));
                }
            }
        }
        None
    }
}

// --------------------------------------------------------------- validation

/// Parses and validates a scenario; the error is meant for one stderr line.
pub fn parse(text: &str) -> Result<Scenario, String> {
    // The first line names position and cause; the rest is a source snippet.
    let file: ScenarioFile = serde_saphyr::from_str(text).map_err(|e| {
        let full = e.to_string();
        full.lines().next().unwrap_or_default().trim().to_owned()
    })?;
    validate(file)
}

fn validate(file: ScenarioFile) -> Result<Scenario, String> {
    check_string(
        "driver_version",
        &file.driver_version,
        NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE,
    )?;
    check_string(
        "nvml_version",
        &file.nvml_version,
        NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE,
    )?;
    if file.devices.len() > MAX_ITEMS {
        return Err(format!("at most {MAX_ITEMS} devices"));
    }
    let mut uuids: Vec<String> = Vec::new();
    let mut gpus = Vec::with_capacity(file.devices.len());
    for (i, d) in file.devices.into_iter().enumerate() {
        let at = format!("devices[{i}]");
        check_uuid(&format!("{at}.uuid"), &d.uuid, &mut uuids)?;
        check_string(
            &format!("{at}.name"),
            &d.name,
            NVML_DEVICE_NAME_V2_BUFFER_SIZE,
        )?;
        let telemetry = telemetry(&at, &d)?;
        let health = health(&d);
        let bus_id = d
            .pci_bus_id
            .unwrap_or_else(|| format!("00000000:{:02X}:00.0", (i + 1) & 0xFF));
        let pci = pci_info(&bus_id).map_err(|e| format!("{at}.pci_bus_id {bus_id:?}: {e}"))?;
        if !d.mig_devices.is_empty() && !d.processes.is_empty() {
            return Err(format!(
                "{at}: a GPU with mig_devices runs its processes inside them; \
                 move `processes` under the mig device"
            ));
        }
        if d.mig_devices.len() > MAX_ITEMS {
            return Err(format!("{at}: at most {MAX_ITEMS} mig_devices"));
        }
        let mut migs: Vec<Mig> = Vec::with_capacity(d.mig_devices.len());
        for (m, md) in d.mig_devices.into_iter().enumerate() {
            let at = format!("{at}.mig_devices[{m}]");
            check_uuid(&format!("{at}.uuid"), &md.uuid, &mut uuids)?;
            if migs.iter().any(|o| {
                (o.gpu_instance_id, o.compute_instance_id)
                    == (md.gpu_instance_id, md.compute_instance_id)
            }) {
                return Err(format!(
                    "{at}: gpu_instance_id/compute_instance_id {}/{} used twice on this GPU",
                    md.gpu_instance_id, md.compute_instance_id
                ));
            }
            let name = format!("{} MIG", d.name);
            check_string(
                &format!("{at} name"),
                &name,
                NVML_DEVICE_NAME_V2_BUFFER_SIZE,
            )?;
            migs.push(Mig {
                uuid: md.uuid,
                name,
                gpu_instance_id: md.gpu_instance_id,
                compute_instance_id: md.compute_instance_id,
                memory: memory(md.memory),
                processes: processes(md.processes),
                gpm: gpm(&at, md.gpm)?,
            });
        }
        let gpm = gpm(&at, d.gpm)?;
        if let Some(t) = &d.used_timeline {
            if t.len() > 100_000 {
                return Err(format!("{at}.used_timeline: at most 100000 knots"));
            }
            if t.iter().any(|k| !k.0.is_finite()) || t.windows(2).any(|w| w[1].0 < w[0].0) {
                return Err(format!(
                    "{at}.used_timeline: times must be finite and in order"
                ));
            }
        }
        gpus.push(Gpu {
            unified_memory: d.unified_memory,
            virtualization_mode: match d.virtualization_mode {
                VirtualizationModeFile::None => {
                    nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_NONE
                }
                VirtualizationModeFile::Passthrough => {
                    nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_PASSTHROUGH
                }
                VirtualizationModeFile::Vgpu => {
                    nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_VGPU
                }
                VirtualizationModeFile::HostVgpu => {
                    nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_HOST_VGPU
                }
                VirtualizationModeFile::HostVsga => {
                    nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_HOST_VSGA
                }
            },
            gpm,
            gpm_stale: d.gpm_stale,
            used_timeline: d.used_timeline,
            memory_limits: d.memory_limits,
            telemetry,
            health,
            xid_events: d.xid_events,
            uuid: d.uuid,
            name: d.name,
            pci,
            memory: memory(d.memory),
            processes: processes(d.processes),
            error: d.error.map(device_error),
            handle_error: d.handle_error.map(device_error),
            delay: Duration::from_millis(d.delay_ms),
            migs,
        });
    }
    Ok(Scenario {
        sample_base_us: 0,
        driver_version: file.driver_version,
        nvml_version: file.nvml_version,
        cuda_driver_version: file.cuda_driver_version,
        init_error: file.init_error.map(|e| match e {
            InitErrorFile::DriverNotLoaded => nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED,
            InitErrorFile::NoPermission => nvmlReturn_enum_NVML_ERROR_NO_PERMISSION,
            InitErrorFile::Unknown => nvmlReturn_enum_NVML_ERROR_UNKNOWN,
            InitErrorFile::LibRmVersionMismatch => {
                nvmlReturn_enum_NVML_ERROR_LIB_RM_VERSION_MISMATCH
            }
        }),
        init_delay: Duration::from_millis(file.init_delay_ms),
        runtime_error: file.runtime_error.map(|e| match e {
            RuntimeErrorFile::LibRmVersionMismatch => {
                nvmlReturn_enum_NVML_ERROR_LIB_RM_VERSION_MISMATCH
            }
            RuntimeErrorFile::DriverNotLoaded => nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED,
            RuntimeErrorFile::Uninitialized => nvmlReturn_enum_NVML_ERROR_UNINITIALIZED,
        }),
        gpus,
    })
}

fn percent(what: &str, v: Option<u32>) -> Result<Option<u32>, String> {
    at_most(what, v, 100)
}

fn at_most(what: &str, v: Option<u32>, max: u32) -> Result<Option<u32>, String> {
    match v {
        Some(v) if v > max => Err(format!("{what}: {v} is above {max}")),
        v => Ok(v),
    }
}

fn telemetry(at: &str, d: &DeviceFile) -> Result<Telemetry, String> {
    let u = &d.utilization;
    let process_utilization = match &d.process_utilization {
        None => None,
        Some(list) => {
            let mut out = Vec::with_capacity(list.len());
            for (i, p) in list.iter().enumerate() {
                let at = format!("{at}.process_utilization[{i}]");
                let pct = |key: &str, v: u32| percent(&format!("{at}.{key}"), Some(v));
                pct("sm", p.sm)?;
                pct("memory", p.memory)?;
                pct("encoder", p.encoder)?;
                pct("decoder", p.decoder)?;
                out.push(ProcessUtilization {
                    pid: p.pid,
                    sm: p.sm,
                    memory: p.memory,
                    encoder: p.encoder,
                    decoder: p.decoder,
                });
            }
            Some(out)
        }
    };
    Ok(Telemetry {
        gpu_util: percent(&format!("{at}.utilization.gpu"), u.gpu)?,
        memory_util: percent(&format!("{at}.utilization.memory"), u.memory)?,
        encoder_util: percent(&format!("{at}.utilization.encoder"), u.encoder)?,
        decoder_util: percent(&format!("{at}.utilization.decoder"), u.decoder)?,
        process_utilization,
        utilization_samples: match d.utilization_samples {
            None => None,
            Some(f) => {
                percent(&format!("{at}.utilization_samples.gpu"), Some(f.gpu))?;
                if f.period_us == 0 || f.period_us > 10_000_000 {
                    return Err(format!(
                        "{at}.utilization_samples.period_us: {} is not within 1..=10000000",
                        f.period_us
                    ));
                }
                Some(UtilizationSamples {
                    gpu: f.gpu,
                    period_us: f.period_us,
                })
            }
        },
        temperature_c: d.temperature_c,
        power_mw: d.power_mw,
        power_limit_mw: d.power_limit_mw,
        energy_mj: d.energy_mj,
        clock_graphics: d.clocks_mhz.graphics,
        clock_sm: d.clocks_mhz.sm,
        clock_memory: d.clocks_mhz.memory,
        clock_video: d.clocks_mhz.video,
        performance_state: at_most(&format!("{at}.performance_state"), d.performance_state, 15)?,
        clock_event_reasons: d.clock_event_reasons,
    })
}

fn health(d: &DeviceFile) -> Health {
    Health {
        ecc: d.ecc.as_ref().map(|e| Ecc {
            enabled: e.enabled,
            pending_enabled: e.pending_enabled.unwrap_or(e.enabled),
            corrected_volatile: e.corrected_volatile,
            corrected_aggregate: e.corrected_aggregate,
            uncorrected_volatile: e.uncorrected_volatile,
            uncorrected_aggregate: e.uncorrected_aggregate,
        }),
        remapped_rows: d.remapped_rows.as_ref().map(|r| RemappedRows {
            correctable: r.correctable,
            uncorrectable: r.uncorrectable,
            pending: r.pending,
            failed: r.failed,
        }),
        retired_pages: d.retired_pages.as_ref().map(|r| RetiredPages {
            single_bit_ecc: r.single_bit_ecc,
            double_bit_ecc: r.double_bit_ecc,
            pending: r.pending,
        }),
    }
}

impl Scenario {
    /// The longest process utilisation list of any GPU: how many sample
    /// timestamps from `sample_base_us` on this scenario hands out.
    pub fn sample_span(&self) -> u64 {
        self.gpus
            .iter()
            .filter_map(|g| g.telemetry.process_utilization.as_ref())
            .map(|l| l.len() as u64)
            .max()
            .unwrap_or(0)
    }
}

fn device_error(e: DeviceErrorFile) -> nvmlReturn_t {
    match e {
        DeviceErrorFile::GpuLost => nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST,
        DeviceErrorFile::Unknown => nvmlReturn_enum_NVML_ERROR_UNKNOWN,
        DeviceErrorFile::NotSupported => nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED,
        DeviceErrorFile::NoPermission => nvmlReturn_enum_NVML_ERROR_NO_PERMISSION,
        DeviceErrorFile::Timeout => nvmlReturn_enum_NVML_ERROR_TIMEOUT,
    }
}

fn memory(m: MemoryFile) -> Memory {
    Memory {
        total: m.total,
        reserved: m.reserved,
        used: m.used,
    }
}

fn processes(list: Vec<ProcessFile>) -> Vec<Process> {
    list.into_iter()
        .map(|p| Process {
            pid: p.pid,
            used: p.used.unwrap_or(VALUE_NOT_AVAILABLE),
            kind: p.kind,
            used_timeline: p.used_timeline,
        })
        .collect()
}

/// Strings are handed to C: no NUL inside, and room for the terminator in
/// the buffer size NVML documents for them.
fn check_string(what: &str, s: &str, buffer: u32) -> Result<(), String> {
    if s.contains('\0') {
        return Err(format!("{what}: contains a NUL byte"));
    }
    if s.len() >= buffer as usize {
        return Err(format!(
            "{what}: {} bytes, NVML's buffer holds {}",
            s.len(),
            buffer - 1
        ));
    }
    Ok(())
}

fn check_uuid(what: &str, uuid: &str, seen: &mut Vec<String>) -> Result<(), String> {
    check_string(what, uuid, NVML_DEVICE_UUID_BUFFER_SIZE)?;
    if uuid.is_empty() {
        return Err(format!("{what}: empty"));
    }
    if seen.iter().any(|u| u == uuid) {
        return Err(format!("{what}: {uuid} used twice"));
    }
    seen.push(uuid.to_owned());
    Ok(())
}

/// "DDDDDDDD:BB:DD.F" (or 4-digit domain) → nvmlPciInfo_t with busId in
/// NVML's format (8-digit domain, upper-case hex) and busIdLegacy beside it.
fn pci_info(bus_id: &str) -> Result<nvmlPciInfo_t, String> {
    const FORMAT: &str = "want DDDDDDDD:BB:DD.F (hex)";
    let (domain, rest) = bus_id.split_once(':').ok_or(FORMAT)?;
    let (bus, rest) = rest.split_once(':').ok_or(FORMAT)?;
    let (device, function) = rest.split_once('.').ok_or(FORMAT)?;
    let hex = |s: &str, digits: usize, max: u32| -> Result<u32, String> {
        if s.is_empty() || s.len() > digits || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(FORMAT.into());
        }
        let v = u32::from_str_radix(s, 16).map_err(|e| e.to_string())?;
        if v > max {
            return Err(format!("{s} is above {max:#x}"));
        }
        Ok(v)
    };
    let domain = hex(domain, 8, 0xFFFF)?;
    let bus = hex(bus, 2, 0xFF)?;
    let device = hex(device, 2, 0x1F)?;
    let function = hex(function, 1, 7)?;
    let long = format!("{domain:08X}:{bus:02X}:{device:02X}.{function:X}");
    let legacy = format!("{domain:04X}:{bus:02X}:{device:02X}.{function:X}");
    Ok(nvmlPciInfo_t {
        busIdLegacy: c_array::<{ NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE as usize }>(&legacy),
        domain,
        bus,
        device,
        pciDeviceId: PCI_DEVICE_ID,
        pciSubSystemId: PCI_SUBSYSTEM_ID,
        busId: c_array::<{ NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE as usize }>(&long),
    })
}

/// NUL-terminated copy; callers pass strings shorter than N (checked above).
fn c_array<const N: usize>(s: &str) -> [c_char; N] {
    let mut out = [0 as c_char; N];
    for (dst, src) in out.iter_mut().take(N.saturating_sub(1)).zip(s.bytes()) {
        *dst = src as c_char;
    }
    out
}
