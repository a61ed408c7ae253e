//! NVML errors as types: [`ErrorKind`] (what went wrong) and [`Operation`]
//! (which call), turned into the `error` and `operation` labels of
//! `gpumem_exporter_nvml_errors_total` only at the edge ([`label`](ErrorKind::label)).
//!
//! [`ErrorKind::of`] is an explicit `match`, not the enum's `Debug` text:
//! label values are a public contract, and a dependency upgrade must not
//! rename them silently. nvml-wrapper's `NvmlError` is not
//! `#[non_exhaustive]`, so a new variant stops the build here until it is
//! given a kind. Behaviour asks the predicates ([`ErrorKind::is_unsupported`],
//! [`ErrorKind::is_driver_gone`], [`ErrorKind::is_layout_changed`]), never a
//! string: this file is the only place the label strings are written.
//!
//! Both enums order by their label, so the error counter's series come out
//! in the same (alphabetical) order as when the keys were strings.

use std::cmp::Ordering;
use std::fmt;

use nvml_wrapper::error::NvmlError;

/// What went wrong in an NVML call: one variant per `NvmlError` (minus the
/// library-loading ones, which never reach a sampled call), plus
/// [`ErrorKind::InvalidDeviceIndex`] for an index NVML never handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    Utf8Error,
    NulError,
    LibloadingError,
    FailedToLoadSymbol,
    StringTooLong,
    IncorrectBits,
    UnexpectedVariant,
    SetReleaseFailed,
    GetPciInfoFailed,
    PciInfoToCFailed,
    Uninitialized,
    InvalidArg,
    NotSupported,
    NoPermission,
    AlreadyInitialized,
    NotFound,
    InsufficientSize,
    InsufficientPower,
    DriverNotLoaded,
    Timeout,
    IrqIssue,
    LibraryNotFound,
    FunctionNotFound,
    CorruptedInfoRom,
    GpuLost,
    ResetRequired,
    OperatingSystem,
    LibRmVersionMismatch,
    InUse,
    InsufficientMemory,
    NoData,
    VgpuEccNotSupported,
    Unknown,
    /// Not an NVML error: a device or MIG index with no handle (never
    /// enumerated, or its layout was replaced).
    InvalidDeviceIndex,
}

impl ErrorKind {
    /// The kind of an NVML error.
    pub fn of(e: &NvmlError) -> ErrorKind {
        match e {
            NvmlError::Utf8Error(_) => ErrorKind::Utf8Error,
            NvmlError::NulError(_) => ErrorKind::NulError,
            NvmlError::LibloadingError(_) => ErrorKind::LibloadingError,
            NvmlError::FailedToLoadSymbol(_) => ErrorKind::FailedToLoadSymbol,
            NvmlError::StringTooLong { .. } => ErrorKind::StringTooLong,
            NvmlError::IncorrectBits(_) => ErrorKind::IncorrectBits,
            NvmlError::UnexpectedVariant(_) => ErrorKind::UnexpectedVariant,
            NvmlError::SetReleaseFailed => ErrorKind::SetReleaseFailed,
            NvmlError::GetPciInfoFailed => ErrorKind::GetPciInfoFailed,
            NvmlError::PciInfoToCFailed => ErrorKind::PciInfoToCFailed,
            NvmlError::Uninitialized => ErrorKind::Uninitialized,
            NvmlError::InvalidArg => ErrorKind::InvalidArg,
            NvmlError::NotSupported => ErrorKind::NotSupported,
            NvmlError::NoPermission => ErrorKind::NoPermission,
            #[allow(deprecated)]
            NvmlError::AlreadyInitialized => ErrorKind::AlreadyInitialized,
            NvmlError::NotFound => ErrorKind::NotFound,
            NvmlError::InsufficientSize(_) => ErrorKind::InsufficientSize,
            NvmlError::InsufficientPower => ErrorKind::InsufficientPower,
            NvmlError::DriverNotLoaded => ErrorKind::DriverNotLoaded,
            NvmlError::Timeout => ErrorKind::Timeout,
            NvmlError::IrqIssue => ErrorKind::IrqIssue,
            NvmlError::LibraryNotFound => ErrorKind::LibraryNotFound,
            NvmlError::FunctionNotFound => ErrorKind::FunctionNotFound,
            NvmlError::CorruptedInfoROM => ErrorKind::CorruptedInfoRom,
            NvmlError::GpuLost => ErrorKind::GpuLost,
            NvmlError::ResetRequired => ErrorKind::ResetRequired,
            NvmlError::OperatingSystem => ErrorKind::OperatingSystem,
            NvmlError::LibRmVersionMismatch => ErrorKind::LibRmVersionMismatch,
            NvmlError::InUse => ErrorKind::InUse,
            NvmlError::InsufficientMemory => ErrorKind::InsufficientMemory,
            NvmlError::NoData => ErrorKind::NoData,
            NvmlError::VgpuEccNotSupported => ErrorKind::VgpuEccNotSupported,
            NvmlError::Unknown => ErrorKind::Unknown,
        }
    }

    /// The stable snake_case `error` label.
    pub fn label(self) -> &'static str {
        match self {
            ErrorKind::Utf8Error => "utf8_error",
            ErrorKind::NulError => "nul_error",
            ErrorKind::LibloadingError => "libloading_error",
            ErrorKind::FailedToLoadSymbol => "failed_to_load_symbol",
            ErrorKind::StringTooLong => "string_too_long",
            ErrorKind::IncorrectBits => "incorrect_bits",
            ErrorKind::UnexpectedVariant => "unexpected_variant",
            ErrorKind::SetReleaseFailed => "set_release_failed",
            ErrorKind::GetPciInfoFailed => "get_pci_info_failed",
            ErrorKind::PciInfoToCFailed => "pci_info_to_c_failed",
            ErrorKind::Uninitialized => "uninitialized",
            ErrorKind::InvalidArg => "invalid_arg",
            ErrorKind::NotSupported => "not_supported",
            ErrorKind::NoPermission => "no_permission",
            ErrorKind::AlreadyInitialized => "already_initialized",
            ErrorKind::NotFound => "not_found",
            ErrorKind::InsufficientSize => "insufficient_size",
            ErrorKind::InsufficientPower => "insufficient_power",
            ErrorKind::DriverNotLoaded => "driver_not_loaded",
            ErrorKind::Timeout => "timeout",
            ErrorKind::IrqIssue => "irq_issue",
            ErrorKind::LibraryNotFound => "library_not_found",
            ErrorKind::FunctionNotFound => "function_not_found",
            // Spelled as earlier releases derived it from the variant name.
            ErrorKind::CorruptedInfoRom => "corrupted_info_r_o_m",
            ErrorKind::GpuLost => "gpu_lost",
            ErrorKind::ResetRequired => "reset_required",
            ErrorKind::OperatingSystem => "operating_system",
            ErrorKind::LibRmVersionMismatch => "lib_rm_version_mismatch",
            ErrorKind::InUse => "in_use",
            ErrorKind::InsufficientMemory => "insufficient_memory",
            ErrorKind::NoData => "no_data",
            ErrorKind::VgpuEccNotSupported => "vgpu_ecc_not_supported",
            ErrorKind::Unknown => "unknown",
            ErrorKind::InvalidDeviceIndex => "invalid_device_index",
        }
    }

    /// A call the GPU (or this driver) does not have: the family is left
    /// out for that GPU, logged once, not counted.
    pub fn is_unsupported(self) -> bool {
        matches!(
            self,
            ErrorKind::NotSupported | ErrorKind::FunctionNotFound | ErrorKind::FailedToLoadSymbol
        )
    }

    /// No call on this NVML instance can succeed any more: the driver was
    /// upgraded under the loaded library, unloaded, or NVML shut down. The
    /// sampler closes the source and opens NVML afresh, with backoff.
    pub fn is_driver_gone(self) -> bool {
        matches!(
            self,
            ErrorKind::LibRmVersionMismatch | ErrorKind::DriverNotLoaded | ErrorKind::Uninitialized
        )
    }

    /// A MIG instance call failed because the layout changed under the
    /// handle (instance destroyed, MIG turned off): rescan the layout.
    pub fn is_layout_changed(self) -> bool {
        matches!(
            self,
            ErrorKind::InvalidArg
                | ErrorKind::NotFound
                | ErrorKind::NotSupported
                | ErrorKind::InvalidDeviceIndex
        )
    }

    /// What to tell an operator when this kind says the driver is gone.
    pub fn driver_gone_advice(self) -> &'static str {
        match self {
            ErrorKind::LibRmVersionMismatch => {
                "the NVIDIA driver was upgraded without reloading its kernel module (NVML_ERROR_LIB_RM_VERSION_MISMATCH): reboot, or stop the GPU users and reload the nvidia modules"
            }
            ErrorKind::DriverNotLoaded => {
                "the NVIDIA kernel driver was unloaded (NVML_ERROR_DRIVER_NOT_LOADED): load it again (modprobe nvidia) or check `nvidia-smi`"
            }
            _ => "NVML stopped answering (NVML_ERROR_UNINITIALIZED)",
        }
    }
}

/// Orders by label (see the module doc).
impl Ord for ErrorKind {
    fn cmp(&self, other: &Self) -> Ordering {
        self.label().cmp(other.label())
    }
}

impl PartialOrd for ErrorKind {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// Declares [`Operation`]: each variant with its `operation` label.
macro_rules! operations {
    ($($(#[$doc:meta])* $variant:ident => $label:literal,)+) => {
        /// Which NVML call failed: the `operation` label.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Operation {
            $($(#[$doc])* $variant,)+
        }

        impl Operation {
            /// Every operation, in declaration order.
            pub const ALL: &[Operation] = &[$(Operation::$variant,)+];

            /// The stable snake_case `operation` label.
            pub fn label(self) -> &'static str {
                match self {
                    $(Operation::$variant => $label,)+
                }
            }
        }
    };
}

operations! {
    Init => "init",
    SystemDriverVersion => "system_driver_version",
    SystemNvmlVersion => "system_nvml_version",
    SystemCudaDriverVersion => "system_cuda_driver_version",
    DeviceCount => "device_count",
    DeviceByIndex => "device_by_index",
    DeviceUuid => "device_uuid",
    DeviceName => "device_name",
    DevicePciInfo => "device_pci_info",
    DeviceIndex => "device_index",
    MigMode => "mig_mode",
    MaxMigDeviceCount => "max_mig_device_count",
    MigDeviceByIndex => "mig_device_by_index",
    MigDeviceUuid => "mig_device_uuid",
    MigGpuInstanceId => "mig_gpu_instance_id",
    MigComputeInstanceId => "mig_compute_instance_id",
    MigMemoryInfo => "mig_memory_info",
    MemoryInfo => "memory_info",
    RunningComputeProcesses => "running_compute_processes",
    RunningGraphicsProcesses => "running_graphics_processes",
    MpsRunningComputeProcesses => "mps_running_compute_processes",
    UtilizationRates => "utilization_rates",
    EncoderUtilization => "encoder_utilization",
    DecoderUtilization => "decoder_utilization",
    ProcessUtilization => "process_utilization",
    Temperature => "temperature",
    PowerUsage => "power_usage",
    EnforcedPowerLimit => "enforced_power_limit",
    TotalEnergyConsumption => "total_energy_consumption",
    ClockInfoGraphics => "clock_info_graphics",
    ClockInfoSm => "clock_info_sm",
    ClockInfoMemory => "clock_info_memory",
    ClockInfoVideo => "clock_info_video",
    PerformanceState => "performance_state",
    ClockEventReasons => "clock_event_reasons",
    EccMode => "ecc_mode",
    TotalEccErrors => "total_ecc_errors",
    RemappedRows => "remapped_rows",
    RetiredPagesSingleBitEcc => "retired_pages_single_bit_ecc",
    RetiredPagesDoubleBitEcc => "retired_pages_double_bit_ecc",
    RetiredPagesPending => "retired_pages_pending",
    RegisterEvents => "register_events",
    EventSetCreate => "event_set_create",
    EventSetWait => "event_set_wait",
    VirtualizationMode => "virtualization_mode",
    GpmQueryDeviceSupport => "gpm_query_device_support",
    GpmSampleGet => "gpm_sample_get",
    GpmMigSampleGet => "gpm_mig_sample_get",
    GpmMetricsGet => "gpm_metrics_get",
}

/// Orders by label (see the module doc).
impl Ord for Operation {
    fn cmp(&self, other: &Self) -> Ordering {
        self.label().cmp(other.label())
    }
}

impl PartialOrd for Operation {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// A failed driver call: which one and why; the two labels of
/// `gpumem_exporter_nvml_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{operation}: {kind}")]
pub struct GpuError {
    pub operation: Operation,
    pub kind: ErrorKind,
}

impl GpuError {
    pub fn new(operation: Operation, kind: ErrorKind) -> GpuError {
        GpuError { operation, kind }
    }

    /// `operation` failed with `e`.
    pub fn nvml(operation: Operation, e: &NvmlError) -> GpuError {
        GpuError::new(operation, ErrorKind::of(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvml_wrapper::error::Bits;

    /// Every variant and its label: the whole set of values the `error`
    /// label can take from NVML.
    #[test]
    fn every_label_value() {
        let bad = vec![0xffu8];
        let utf8 = std::str::from_utf8(&bad).err();
        let nul = std::ffi::CString::new(vec![0u8]).err();
        let mut cases: Vec<(NvmlError, &str)> = vec![
            (
                NvmlError::FailedToLoadSymbol("x".into()),
                "failed_to_load_symbol",
            ),
            (
                NvmlError::StringTooLong {
                    max_len: 1,
                    actual_len: 2,
                },
                "string_too_long",
            ),
            (NvmlError::IncorrectBits(Bits::U32(1)), "incorrect_bits"),
            (NvmlError::UnexpectedVariant(99), "unexpected_variant"),
            (NvmlError::SetReleaseFailed, "set_release_failed"),
            (NvmlError::GetPciInfoFailed, "get_pci_info_failed"),
            (NvmlError::PciInfoToCFailed, "pci_info_to_c_failed"),
            (NvmlError::Uninitialized, "uninitialized"),
            (NvmlError::InvalidArg, "invalid_arg"),
            (NvmlError::NotSupported, "not_supported"),
            (NvmlError::NoPermission, "no_permission"),
            #[allow(deprecated)]
            (NvmlError::AlreadyInitialized, "already_initialized"),
            (NvmlError::NotFound, "not_found"),
            (NvmlError::InsufficientSize(Some(4)), "insufficient_size"),
            (NvmlError::InsufficientPower, "insufficient_power"),
            (NvmlError::DriverNotLoaded, "driver_not_loaded"),
            (NvmlError::Timeout, "timeout"),
            (NvmlError::IrqIssue, "irq_issue"),
            (NvmlError::LibraryNotFound, "library_not_found"),
            (NvmlError::FunctionNotFound, "function_not_found"),
            (NvmlError::CorruptedInfoROM, "corrupted_info_r_o_m"),
            (NvmlError::GpuLost, "gpu_lost"),
            (NvmlError::ResetRequired, "reset_required"),
            (NvmlError::OperatingSystem, "operating_system"),
            (NvmlError::LibRmVersionMismatch, "lib_rm_version_mismatch"),
            (NvmlError::InUse, "in_use"),
            (NvmlError::InsufficientMemory, "insufficient_memory"),
            (NvmlError::NoData, "no_data"),
            (NvmlError::VgpuEccNotSupported, "vgpu_ecc_not_supported"),
            (NvmlError::Unknown, "unknown"),
        ];
        if let Some(e) = utf8 {
            cases.push((NvmlError::Utf8Error(e), "utf8_error"));
        }
        if let Some(e) = nul {
            cases.push((NvmlError::NulError(e), "nul_error"));
        }
        assert_eq!(cases.len(), 32, "every variant but LibloadingError");
        for (e, want) in &cases {
            assert_eq!(ErrorKind::of(e).label(), *want, "{e:?}");
            assert_eq!(*want, derived(e), "the label earlier releases exported");
        }
    }

    /// How releases before the explicit match derived the label: the
    /// variant name from `Debug`, in snake_case. Kept to prove the match
    /// renamed nothing.
    fn derived(e: &NvmlError) -> String {
        let debug = format!("{e:?}");
        let head = debug.split(['(', ' ', '{']).next().unwrap_or("unknown");
        let mut out = String::new();
        for (i, ch) in head.chars().enumerate() {
            if ch.is_ascii_uppercase() {
                if i > 0 {
                    out.push('_');
                }
                out.push(ch.to_ascii_lowercase());
            } else {
                out.push(ch);
            }
        }
        out
    }

    /// The predicates behaviour hangs on, as a table: (kind, unsupported,
    /// driver gone, layout changed).
    #[test]
    fn predicates() {
        use ErrorKind::*;
        let table = [
            (NotSupported, true, false, true),
            (FunctionNotFound, true, false, false),
            (FailedToLoadSymbol, true, false, false),
            (LibRmVersionMismatch, false, true, false),
            (DriverNotLoaded, false, true, false),
            (Uninitialized, false, true, false),
            (InvalidArg, false, false, true),
            (NotFound, false, false, true),
            (InvalidDeviceIndex, false, false, true),
            (GpuLost, false, false, false),
            (Unknown, false, false, false),
        ];
        for (kind, unsupported, gone, changed) in table {
            assert_eq!(kind.is_unsupported(), unsupported, "{kind}");
            assert_eq!(kind.is_driver_gone(), gone, "{kind}");
            assert_eq!(kind.is_layout_changed(), changed, "{kind}");
        }
    }

    /// Operations order and print by label, and no two share one.
    #[test]
    fn operation_labels_are_unique_and_ordered_by_label() {
        let mut labels: Vec<&str> = Operation::ALL.iter().map(|o| o.label()).collect();
        let n = labels.len();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), n, "duplicate operation label");
        let mut ops = Operation::ALL.to_vec();
        ops.sort();
        let sorted: Vec<&str> = ops.iter().map(|o| o.label()).collect();
        assert_eq!(sorted, labels);
        assert_eq!(Operation::MemoryInfo.to_string(), "memory_info");
        assert!(
            (Operation::MemoryInfo, ErrorKind::GpuLost) < (Operation::MigMode, ErrorKind::Unknown)
        );
    }
}
