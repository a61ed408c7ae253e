//! What a failed driver call was, as labels: [`ErrorKind`] (what went
//! wrong) and [`Operation`] (which call), the two labels of
//! `gpumem_exporter_nvml_errors_total`, and [`GpuError`], the pair.
//!
//! This sits below both `model` (whose error counters are keyed by the
//! pair) and `gpu` (which maps nvml-wrapper's `NvmlError` to a kind: the
//! only code that sees NVML's own types, `gpu/error.rs`). Label values are
//! a public contract: every `error` label is written in
//! [`ErrorKind::label`], every `operation` label in an [`Operation`]
//! constant — the sampler's own calls here ([`Operation::CORE`]), each
//! collector's calls in its own folder, listed in its registry row so
//! that a test can see that no two share a label. Behaviour asks the
//! predicates ([`ErrorKind::is_unsupported`], [`ErrorKind::is_driver_gone`],
//! [`ErrorKind::is_layout_changed`]), never a string.
//!
//! Both order by their label, so the error counter's series come out in
//! the same (alphabetical) order as when the keys were strings.

use std::cmp::Ordering;
use std::fmt;

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

/// Which NVML call failed: the `operation` label. Made only through
/// named constants ([`Operation::new`] is `const` so that a collector can
/// declare its own beside its calls); two operations are the same when
/// their labels are, and they order by label (the derived order of the
/// one field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Operation(&'static str);

impl Operation {
    /// An operation with this `operation` label (snake_case, the NVML call
    /// without its `nvmlDevice`/`nvml` prefix).
    pub const fn new(label: &'static str) -> Operation {
        Operation(label)
    }

    /// The stable snake_case `operation` label.
    pub fn label(self) -> &'static str {
        self.0
    }
}

/// The sampler's own calls (opening NVML, discovery, memory, processes,
/// MIG); the collectors' are declared in their folders.
impl Operation {
    pub const INIT: Operation = Operation::new("init");
    pub const SYSTEM_DRIVER_VERSION: Operation = Operation::new("system_driver_version");
    pub const SYSTEM_NVML_VERSION: Operation = Operation::new("system_nvml_version");
    pub const SYSTEM_CUDA_DRIVER_VERSION: Operation = Operation::new("system_cuda_driver_version");
    pub const DEVICE_COUNT: Operation = Operation::new("device_count");
    pub const MEMORY_LIMITS: Operation = Operation::new("memory_limits");
    pub const DEVICE_BY_INDEX: Operation = Operation::new("device_by_index");
    pub const DEVICE_UUID: Operation = Operation::new("device_uuid");
    pub const DEVICE_NAME: Operation = Operation::new("device_name");
    pub const DEVICE_PCI_INFO: Operation = Operation::new("device_pci_info");
    pub const DEVICE_INDEX: Operation = Operation::new("device_index");
    pub const MIG_MODE: Operation = Operation::new("mig_mode");
    pub const MAX_MIG_DEVICE_COUNT: Operation = Operation::new("max_mig_device_count");
    pub const MIG_DEVICE_BY_INDEX: Operation = Operation::new("mig_device_by_index");
    pub const MIG_DEVICE_UUID: Operation = Operation::new("mig_device_uuid");
    pub const MIG_GPU_INSTANCE_ID: Operation = Operation::new("mig_gpu_instance_id");
    pub const MIG_COMPUTE_INSTANCE_ID: Operation = Operation::new("mig_compute_instance_id");
    pub const MIG_MEMORY_INFO: Operation = Operation::new("mig_memory_info");
    pub const MEMORY_INFO: Operation = Operation::new("memory_info");
    pub const RUNNING_COMPUTE_PROCESSES: Operation = Operation::new("running_compute_processes");
    pub const RUNNING_GRAPHICS_PROCESSES: Operation = Operation::new("running_graphics_processes");
    pub const MPS_RUNNING_COMPUTE_PROCESSES: Operation =
        Operation::new("mps_running_compute_processes");
    pub const VIRTUALIZATION_MODE: Operation = Operation::new("virtualization_mode");

    /// Every operation above, in declaration order.
    pub const CORE: &[Operation] = &[
        Operation::INIT,
        Operation::SYSTEM_DRIVER_VERSION,
        Operation::SYSTEM_NVML_VERSION,
        Operation::SYSTEM_CUDA_DRIVER_VERSION,
        Operation::DEVICE_COUNT,
        Operation::DEVICE_BY_INDEX,
        Operation::DEVICE_UUID,
        Operation::DEVICE_NAME,
        Operation::DEVICE_PCI_INFO,
        Operation::DEVICE_INDEX,
        Operation::MIG_MODE,
        Operation::MAX_MIG_DEVICE_COUNT,
        Operation::MIG_DEVICE_BY_INDEX,
        Operation::MIG_DEVICE_UUID,
        Operation::MIG_GPU_INSTANCE_ID,
        Operation::MIG_COMPUTE_INSTANCE_ID,
        Operation::MIG_MEMORY_INFO,
        Operation::MEMORY_INFO,
        Operation::RUNNING_COMPUTE_PROCESSES,
        Operation::RUNNING_GRAPHICS_PROCESSES,
        Operation::MPS_RUNNING_COMPUTE_PROCESSES,
        Operation::VIRTUALIZATION_MODE,
    ];
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
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn operations_print_and_order_by_label() {
        assert_eq!(Operation::MEMORY_INFO.to_string(), "memory_info");
        assert!(
            (Operation::MEMORY_INFO, ErrorKind::GpuLost)
                < (Operation::MIG_MODE, ErrorKind::Unknown)
        );
    }
}
