//! Event sets for critical Xid errors: each Xid in a GPU's `xid_events` is
//! delivered once per event set that registered the GPU, in list order.
//!
//! A set remembers, per registered GPU (by UUID), how many of its Xids it has
//! delivered; a scenario rewrite that appends to the list delivers the new
//! ones (a shorter list delivers nothing until it grows past that count).
//! Sets live until nvmlEventSetFree or the last nvmlShutdown, as in NVML.

use std::collections::BTreeMap;
use std::ffi::{c_uint, c_ulonglong};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use nvml_wrapper_sys::bindings::*;

use crate::scenario::{self, NO_INSTANCE};
use crate::{INVALID_ARGUMENT, NOT_SUPPORTED, SUCCESS, guard, put, state, with_gpu, with_scenario};

/// The only event type the fake supports.
pub const XID: c_ulonglong = nvmlEventTypeXidCriticalError as c_ulonglong;
/// An empty wait sleeps for its timeout, but never longer than this.
pub const MAX_WAIT: Duration = Duration::from_millis(100);
/// Set handles are tagged so a device handle passed as a set is rejected.
const SET_TAG: usize = 0xE5 << 40;

const TIMEOUT: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_TIMEOUT;

struct Registration {
    uuid: String,
    types: c_ulonglong,
    delivered: usize,
}

#[derive(Default)]
struct Set {
    registrations: Vec<Registration>,
}

struct Sets {
    next: usize,
    sets: BTreeMap<usize, Set>,
}

static SETS: Mutex<Sets> = Mutex::new(Sets {
    next: 1,
    sets: BTreeMap::new(),
});

fn lock() -> MutexGuard<'static, Sets> {
    SETS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Drops every set (the last nvmlShutdown); their handles become invalid.
pub fn clear() {
    lock().sets.clear();
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    with_scenario("nvmlEventSetCreate", |_| {
        if set.is_null() {
            return INVALID_ARGUMENT;
        }
        let mut sets = lock();
        let id = sets.next;
        sets.next = (id + 1) & 0xFF_FFFF_FFFF;
        sets.sets.insert(id, Set::default());
        unsafe { put(set, std::ptr::without_provenance_mut(SET_TAG | id)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    with_scenario("nvmlEventSetFree", |_| match set_id(set) {
        Some(id) if lock().sets.remove(&id).is_some() => SUCCESS,
        _ => INVALID_ARGUMENT,
    })
}

fn set_id(set: nvmlEventSet_t) -> Option<usize> {
    let v = set.addr();
    (v & !0xFF_FFFF_FFFF == SET_TAG).then_some(v & 0xFF_FFFF_FFFF)
}

/// `nvmlEventTypeXidCriticalError` on a GPU whose scenario has `xid_events`
/// (even `[]`); NOT_SUPPORTED otherwise and on MIG device handles.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    event_types: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_gpu("nvmlDeviceGetSupportedEventTypes", device, |_, g| unsafe {
        crate::put_some(event_types, g.xid_events.as_ref().map(|_| XID))
    })
}

/// INVALID_ARGUMENT for an unknown set or no types; NOT_SUPPORTED for a GPU
/// without `xid_events` or types other than XidCriticalError. Registering a
/// GPU again adds the types and keeps what was delivered.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    event_types: c_ulonglong,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    with_gpu("nvmlDeviceRegisterEvents", device, |_, g| {
        let mut sets = lock();
        let Some(s) = set_id(set).and_then(|id| sets.sets.get_mut(&id)) else {
            return INVALID_ARGUMENT;
        };
        if event_types == 0 {
            return INVALID_ARGUMENT;
        }
        if g.xid_events.is_none() || event_types & !XID != 0 {
            return NOT_SUPPORTED;
        }
        match s.registrations.iter_mut().find(|r| r.uuid == g.uuid) {
            Some(r) => r.types |= event_types,
            None => s.registrations.push(Registration {
                uuid: g.uuid.clone(),
                types: event_types,
                delivered: 0,
            }),
        }
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeoutms: c_uint,
) -> nvmlReturn_t {
    guard("nvmlEventSetWait_v2", || unsafe {
        wait(set, data, timeoutms)
    })
}

/// The v1 name (same arguments); nvml-wrapper loads it only with its
/// `legacy-functions` feature.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeoutms: c_uint,
) -> nvmlReturn_t {
    guard("nvmlEventSetWait", || unsafe { wait(set, data, timeoutms) })
}

/// The next undelivered Xid of the first registered GPU (registration order)
/// that has one. The wait first sleeps the largest `delay_ms` of the
/// registered GPUs; with nothing to deliver, a registered GPU's `error` is
/// the answer (a lost GPU's pending Xids still come first), else it sleeps
/// `timeoutms` (at most [`MAX_WAIT`]) and answers NVML_ERROR_TIMEOUT.
unsafe fn wait(set: nvmlEventSet_t, data: *mut nvmlEventData_t, timeoutms: c_uint) -> nvmlReturn_t {
    let scenario = match state::enter() {
        Ok(s) => s,
        Err(code) => return code,
    };
    if let Some(code) = scenario.runtime_error {
        return code;
    }
    let Some(id) = set_id(set) else {
        return INVALID_ARGUMENT;
    };
    if data.is_null() {
        return INVALID_ARGUMENT;
    }
    let find = |uuid: &str| {
        scenario
            .gpus
            .iter()
            .enumerate()
            .find(|(_, g)| g.uuid == uuid)
    };

    // A hanging GPU hangs the wait; sleep without holding the lock.
    let delay = {
        let sets = lock();
        let Some(s) = sets.sets.get(&id) else {
            return INVALID_ARGUMENT;
        };
        s.registrations
            .iter()
            .filter_map(|r| find(&r.uuid).map(|(_, g)| g.delay))
            .max()
            .unwrap_or_default()
    };
    if !delay.is_zero() {
        std::thread::sleep(delay);
    }

    let mut error = None;
    {
        let mut sets = lock();
        let Some(s) = sets.sets.get_mut(&id) else {
            return INVALID_ARGUMENT;
        };
        for r in &mut s.registrations {
            let Some((index, g)) = find(&r.uuid) else {
                continue;
            };
            let next = g.xid_events.as_ref().and_then(|l| l.get(r.delivered));
            match next {
                Some(&xid) => {
                    r.delivered += 1;
                    let event = nvmlEventData_t {
                        device: std::ptr::without_provenance_mut(scenario::gpu_handle(index)),
                        eventType: XID,
                        eventData: xid,
                        gpuInstanceId: NO_INSTANCE,
                        computeInstanceId: NO_INSTANCE,
                    };
                    return unsafe { put(data, event) };
                }
                _ => error = error.or(g.error),
            }
        }
    }
    if let Some(code) = error {
        return code;
    }
    std::thread::sleep(Duration::from_millis(timeoutms.into()).min(MAX_WAIT));
    TIMEOUT
}
