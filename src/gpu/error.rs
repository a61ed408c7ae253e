//! NVML's errors as the exporter's labels: [`ErrorKind::of`] maps
//! nvml-wrapper's `NvmlError` to a kind, [`GpuError::nvml`] makes the pair.
//! The label types themselves sit below `model` and `gpu`
//! (`crate::gpu_error`); this file is the only place that sees
//! `NvmlError` to make them.
//!
//! [`ErrorKind::of`] is an explicit `match`, not the enum's `Debug` text:
//! label values are a public contract, and a dependency upgrade must not
//! rename them silently. nvml-wrapper's `NvmlError` is not
//! `#[non_exhaustive]`, so a new variant stops the build here until it is
//! given a kind.

use nvml_wrapper::error::NvmlError;

pub(crate) use crate::gpu_error::GpuError;
pub use crate::gpu_error::{ErrorKind, Operation};

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
}

impl GpuError {
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
}
