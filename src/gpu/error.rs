//! NVML errors as the `error` label of `gpumem_exporter_nvml_errors_total`.
//!
//! An explicit `match`, not the enum's `Debug` text: label values are a
//! public contract, and a dependency upgrade must not rename them
//! silently. nvml-wrapper's `NvmlError` is not `#[non_exhaustive]`, so a
//! new variant stops the build here until it is given a label.

use nvml_wrapper::error::NvmlError;

/// `error` label for an index NVML never handed out (not an NVML error).
pub const INVALID_DEVICE_INDEX: &str = "invalid_device_index";

/// The stable snake_case label of an NVML error.
pub fn label(e: &NvmlError) -> &'static str {
    match e {
        NvmlError::Utf8Error(_) => "utf8_error",
        NvmlError::NulError(_) => "nul_error",
        NvmlError::LibloadingError(_) => "libloading_error",
        NvmlError::FailedToLoadSymbol(_) => "failed_to_load_symbol",
        NvmlError::StringTooLong { .. } => "string_too_long",
        NvmlError::IncorrectBits(_) => "incorrect_bits",
        NvmlError::UnexpectedVariant(_) => "unexpected_variant",
        NvmlError::SetReleaseFailed => "set_release_failed",
        NvmlError::GetPciInfoFailed => "get_pci_info_failed",
        NvmlError::PciInfoToCFailed => "pci_info_to_c_failed",
        NvmlError::Uninitialized => "uninitialized",
        NvmlError::InvalidArg => "invalid_arg",
        NvmlError::NotSupported => "not_supported",
        NvmlError::NoPermission => "no_permission",
        #[allow(deprecated)]
        NvmlError::AlreadyInitialized => "already_initialized",
        NvmlError::NotFound => "not_found",
        NvmlError::InsufficientSize(_) => "insufficient_size",
        NvmlError::InsufficientPower => "insufficient_power",
        NvmlError::DriverNotLoaded => "driver_not_loaded",
        NvmlError::Timeout => "timeout",
        NvmlError::IrqIssue => "irq_issue",
        NvmlError::LibraryNotFound => "library_not_found",
        NvmlError::FunctionNotFound => "function_not_found",
        // Spelled as earlier releases derived it from the variant name.
        NvmlError::CorruptedInfoROM => "corrupted_info_r_o_m",
        NvmlError::GpuLost => "gpu_lost",
        NvmlError::ResetRequired => "reset_required",
        NvmlError::OperatingSystem => "operating_system",
        NvmlError::LibRmVersionMismatch => "lib_rm_version_mismatch",
        NvmlError::InUse => "in_use",
        NvmlError::InsufficientMemory => "insufficient_memory",
        NvmlError::NoData => "no_data",
        NvmlError::VgpuEccNotSupported => "vgpu_ecc_not_supported",
        NvmlError::Unknown => "unknown",
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
            assert_eq!(label(e), *want, "{e:?}");
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
