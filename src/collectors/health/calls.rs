//! The `health` collector's NVML calls: ECC counters, row remapping or
//! retired pages per GPU, the ECC mode (a slow read of its own), and
//! critical Xid events through one event set for every GPU (kept in the
//! handle's state: an NVML allocation freed before the library). The
//! in-process fake answers from a [`Health`] script per GPU (no
//! `remapped_rows` answers `not_supported`) and an [`Xid`] script of
//! events still to deliver (none: the GPU has no Xid events).

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{self, MemoryError, RetirementCause};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use nvml_wrapper::{Device, EventSet};

use super::{EccCounter, Health, RemappedRows, RetiredPages};
use crate::gpu::keep;
use crate::gpu::{ErrorKind, GpuError, Handle, Operation};

pub(crate) const ECC_MODE: Operation = Operation::new("ecc_mode");
pub(crate) const TOTAL_ECC_ERRORS: Operation = Operation::new("total_ecc_errors");
pub(crate) const REMAPPED_ROWS: Operation = Operation::new("remapped_rows");
pub(crate) const RETIRED_PAGES_SINGLE_BIT_ECC: Operation =
    Operation::new("retired_pages_single_bit_ecc");
pub(crate) const RETIRED_PAGES_DOUBLE_BIT_ECC: Operation =
    Operation::new("retired_pages_double_bit_ecc");
pub(crate) const RETIRED_PAGES_PENDING: Operation = Operation::new("retired_pages_pending");
pub(crate) const REGISTER_EVENTS: Operation = Operation::new("register_events");
pub(crate) const EVENT_SET_CREATE: Operation = Operation::new("event_set_create");
pub(crate) const EVENT_SET_WAIT: Operation = Operation::new("event_set_wait");

pub(crate) const OPERATIONS: &[Operation] = &[
    ECC_MODE,
    TOTAL_ECC_ERRORS,
    REMAPPED_ROWS,
    RETIRED_PAGES_SINGLE_BIT_ECC,
    RETIRED_PAGES_DOUBLE_BIT_ECC,
    RETIRED_PAGES_PENDING,
    REGISTER_EVENTS,
    EVENT_SET_CREATE,
    EVENT_SET_WAIT,
];

/// Fake only: critical Xid events still to deliver on a GPU; its absence
/// means the GPU has no Xid events.
#[cfg(test)]
#[derive(Debug, Clone, Default)]
pub(crate) struct Xid(pub Vec<u64>);

/// Fake only, source-wide: the GPUs registered for Xid events.
#[cfg(test)]
#[derive(Debug, Clone, Default)]
pub(crate) struct XidWatched(pub Vec<usize>);

/// The event set every watched GPU is registered on (NVML state).
#[derive(Default)]
struct XidEvents(Option<EventSet<'static>>);

/// The per-GPU calls without the ECC mode and Xid events; the ECC
/// counters are read only when `ecc_enabled`.
pub(super) fn read(h: Handle<'_>, ecc_enabled: bool, failed: &mut Vec<GpuError>) -> Health {
    match h {
        Handle::Nvml(h) => match h.device(REMAPPED_ROWS) {
            Ok(dev) => nvml_read(dev, ecc_enabled, failed),
            Err(e) => {
                failed.push(e);
                Health::default()
            }
        },
        #[cfg(test)]
        Handle::Fake(mut h) => {
            h.count("health");
            let health = match h.device(REMAPPED_ROWS) {
                Ok(d) => d.scripts.get::<Health>().cloned().unwrap_or_default(),
                Err(e) => {
                    failed.push(e);
                    return Health::default();
                }
            };
            if health.remapped_rows.is_none() {
                failed.push(crate::gpu::fake::unsupported(REMAPPED_ROWS));
            }
            Health {
                ecc_enabled: None,
                ecc_errors: if ecc_enabled {
                    health.ecc_errors
                } else {
                    [None; 4]
                },
                xid_errors: None,
                ..health
            }
        }
    }
}

/// Whether ECC is on (slow on the H200: 134 µs).
pub(super) fn ecc_mode(h: Handle<'_>) -> Result<bool, GpuError> {
    match h {
        Handle::Nvml(h) => h
            .device(ECC_MODE)?
            .is_ecc_enabled()
            .map(|m| m.currently_enabled)
            .map_err(|e| GpuError::nvml(ECC_MODE, &e)),
        #[cfg(test)]
        Handle::Fake(mut h) => {
            h.count("ecc_mode");
            h.device(ECC_MODE)?
                .scripts
                .get::<Health>()
                .and_then(|h| h.ecc_enabled)
                .ok_or(crate::gpu::fake::unsupported(ECC_MODE))
        }
    }
}

/// Start delivering the GPU's critical Xid events to [`xid_events`].
pub(super) fn watch_xid(h: Handle<'_>) -> Result<(), GpuError> {
    match h {
        Handle::Nvml(mut h) => {
            let dev = h.device(REGISTER_EVENTS)?;
            let supported = dev
                .supported_event_types()
                .map_err(|e| GpuError::nvml(REGISTER_EVENTS, &e))?;
            if !supported.contains(EventTypes::CRITICAL_XID_ERROR) {
                return Err(GpuError::new(REGISTER_EVENTS, ErrorKind::NotSupported));
            }
            let nvml = h.nvml();
            let events = h.state::<XidEvents>();
            let set = match events.0.take() {
                Some(set) => set,
                None => nvml
                    .create_event_set()
                    .map_err(|e| GpuError::nvml(EVENT_SET_CREATE, &e))?,
            };
            match dev.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
                Ok(set) => {
                    events.0 = Some(set);
                    Ok(())
                }
                // The set is freed with the error; the next watch makes
                // another (the GPUs registered on the old one are
                // registered again by the collector, which retries every
                // GPU not yet watched).
                Err(e) => Err(GpuError::nvml(REGISTER_EVENTS, &e.error)),
            }
        }
        #[cfg(test)]
        Handle::Fake(mut h) => {
            if h.device(REGISTER_EVENTS)?.scripts.get::<Xid>().is_none() {
                return Err(crate::gpu::fake::unsupported(REGISTER_EVENTS));
            }
            if let Some(i) = h.index() {
                h.scripts().at::<XidWatched>().0.push(i);
            }
            Ok(())
        }
    }
}

/// Critical Xid events that arrived since the last call, as (GPU, Xid),
/// without waiting, on the source-wide handle.
pub(super) fn xid_events(h: Handle<'_>, out: &mut Vec<(usize, u64)>) -> Result<(), GpuError> {
    match h {
        Handle::Nvml(mut h) => {
            let Some(set) = h.state::<XidEvents>().0.as_ref() else {
                return Ok(());
            };
            // Bounded: a storm of events is read over several samples.
            for _ in 0..256 {
                match set.wait(0) {
                    Ok(event) => {
                        // Events are rare: one index query each is cheap.
                        let index = event
                            .device
                            .index()
                            .map_err(|e| GpuError::nvml(Operation::DEVICE_INDEX, &e))?;
                        if let Some(XidError::Value(xid)) = event.event_data {
                            out.push((index as usize, xid));
                        }
                    }
                    Err(NvmlError::Timeout) => break,
                    Err(e) => return Err(GpuError::nvml(EVENT_SET_WAIT, &e)),
                }
            }
            Ok(())
        }
        #[cfg(test)]
        Handle::Fake(mut h) => {
            h.count("xid_events");
            let watched = h.scripts().at::<XidWatched>().0.clone();
            for i in watched {
                if let Some(Xid(list)) = h
                    .devices()
                    .get_mut(i)
                    .and_then(|d| d.scripts.get_mut::<Xid>())
                {
                    out.extend(list.drain(..).map(|x| (i, x)));
                }
            }
            Ok(())
        }
    }
}

fn nvml_read(dev: &Device<'static>, ecc_enabled: bool, failed: &mut Vec<GpuError>) -> Health {
    // Counters only mean something with ECC on (NVML answers
    // NOT_SUPPORTED otherwise); ask only then.
    let ecc_errors = EccCounter::ALL.map(|c| {
        let (kind, counter) = match c {
            EccCounter::CorrectedVolatile => (MemoryError::Corrected, device::EccCounter::Volatile),
            EccCounter::CorrectedAggregate => {
                (MemoryError::Corrected, device::EccCounter::Aggregate)
            }
            EccCounter::UncorrectedVolatile => {
                (MemoryError::Uncorrected, device::EccCounter::Volatile)
            }
            EccCounter::UncorrectedAggregate => {
                (MemoryError::Uncorrected, device::EccCounter::Aggregate)
            }
        };
        ecc_enabled
            .then(|| {
                keep(
                    dev.total_ecc_errors(kind, counter),
                    TOTAL_ECC_ERRORS,
                    failed,
                )
            })
            .flatten()
    });
    let remapped = keep(remapped_rows(dev), REMAPPED_ROWS, failed);
    // Page retirement is what GPUs before Ampere do instead of row
    // remapping: asked only where row remapping is not supported.
    let retired_pages = if remapped.is_none() {
        let single = keep(
            dev.retired_pages(RetirementCause::MultipleSingleBitEccErrors),
            RETIRED_PAGES_SINGLE_BIT_ECC,
            failed,
        );
        let double = keep(
            dev.retired_pages(RetirementCause::DoubleBitEccError),
            RETIRED_PAGES_DOUBLE_BIT_ECC,
            failed,
        );
        let pending = keep(
            dev.are_pages_pending_retired(),
            RETIRED_PAGES_PENDING,
            failed,
        );
        (single.is_some() || double.is_some() || pending.is_some()).then(|| RetiredPages {
            single_bit_ecc: single.map(|p| p.len() as u32),
            double_bit_ecc: double.map(|p| p.len() as u32),
            pending,
        })
    } else {
        None
    };
    Health {
        ecc_enabled: None,
        ecc_errors,
        remapped_rows: remapped,
        retired_pages,
        xid_errors: None,
    }
}

/// nvmlDeviceGetRemappedRows, which nvml-wrapper does not wrap.
fn remapped_rows(dev: &Device<'static>) -> Result<RemappedRows, NvmlError> {
    let sym = nvml_sym(dev.nvml().lib().nvmlDeviceGetRemappedRows.as_ref())?;
    let (mut corr, mut unc, mut pending, mut failed) = (0, 0, 0, 0);
    // SAFETY: a handle of this NVML instance and four valid out-pointers.
    nvml_try(unsafe { sym(dev.handle(), &mut corr, &mut unc, &mut pending, &mut failed) })?;
    Ok(RemappedRows {
        correctable: corr,
        uncorrectable: unc,
        pending: pending != 0,
        failed: failed != 0,
    })
}
