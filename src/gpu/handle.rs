//! What a collector's calls are made on ([`Handle`]): NVML's device and
//! library with the state that must die before the library
//! ([`NvmlHandle`], made by `nvml.rs`), or, in unit tests, the in-process
//! fake's (`fake.rs`). Apart from `nvml.rs` so that `gpu/` and its NVML
//! source do not import each other: this imports nothing of `gpu/`.

use std::any::{Any, TypeId};
use std::collections::HashMap;

use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};

use crate::gpu_error::{ErrorKind, GpuError, Operation};

/// What a collector's calls are made on: NVML's handle, or (unit tests)
/// the in-process fake's scripted device.
pub enum Handle<'a> {
    Nvml(NvmlHandle<'a>),
    #[cfg(test)]
    Fake(super::fake::Handle<'a>),
}

/// The value of a collector's call, or `None` with its error pushed (a
/// collector that makes several calls per GPU keeps the rest).
pub(crate) fn keep<T>(
    r: Result<T, NvmlError>,
    operation: Operation,
    failed: &mut Vec<GpuError>,
) -> Option<T> {
    r.map_err(|e| failed.push(GpuError::nvml(operation, &e)))
        .ok()
}

/// The collectors' state that holds NVML allocations (a GPM sample, an
/// event set): one value per type, made on first use, dropped with the
/// handles, before the library shuts down.
#[derive(Default)]
pub(crate) struct State(HashMap<TypeId, Box<dyn Any>>);

impl State {
    /// The value of type `T`, made with `Default` when first asked.
    fn of<T: Default + 'static>(&mut self) -> &mut T {
        let slot = self
            .0
            .entry(TypeId::of::<T>())
            .or_insert_with(|| Box::new(T::default()));
        match slot.downcast_mut::<T>() {
            Some(t) => t,
            // The key is the type's own id, so the value is always a `T`.
            None => unreachable!("nvml::State slot of another type"),
        }
    }
}

/// One GPU (or the whole library, for event sets) for a collector's
/// calls: nvml-wrapper's `Device` and `Nvml`, and [`State`] for what must
/// be freed before the library is.
pub struct NvmlHandle<'a> {
    pub(super) nvml: &'static Nvml,
    pub(super) device: Option<&'a Device<'static>>,
    pub(super) state: &'a mut State,
}

impl<'a> NvmlHandle<'a> {
    /// The GPU asked for; `operation` fails with `invalid_device_index` on
    /// the source-wide handle.
    pub fn device(&self, operation: Operation) -> Result<&'a Device<'static>, GpuError> {
        self.device
            .ok_or(GpuError::new(operation, ErrorKind::InvalidDeviceIndex))
    }

    /// The library, for the calls that take it (GPM metrics, event sets).
    pub fn nvml(&self) -> &'static Nvml {
        self.nvml
    }

    /// The collector's state of type `T` (see [`State`]). `T` holds only
    /// values made from this library instance, hence `'static` handles.
    pub fn state<T: Default + 'static>(&mut self) -> &mut T {
        self.state.of::<T>()
    }
}
