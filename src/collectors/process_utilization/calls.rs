//! The `process_utilization` collector's NVML call, and the in-process
//! fake's answer (a `Vec<Sample>` script; none: `not_supported`).

use nvml_wrapper::Device;
use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use nvml_wrapper_sys::bindings::nvmlProcessUtilizationSample_t;

use super::{ProcessUtilization, Sample};
use crate::gpu::{GpuError, Handle, Operation};

pub(crate) const PROCESS_UTILIZATION: Operation = Operation::new("process_utilization");

pub(crate) const OPERATIONS: &[Operation] = &[PROCESS_UTILIZATION];

/// Process utilisation samples newer than `since_us` (NVML's sample
/// timestamps, µs), appended to `out`; none newer is `Ok` and empty.
pub(super) fn samples(h: Handle<'_>, since_us: u64, out: &mut Vec<Sample>) -> Result<(), GpuError> {
    samples_as(PROCESS_UTILIZATION, h, since_us, out)
}

/// [`samples`], its failures and calls counted under `op` (the
/// `process_activity` collector makes the same query on its own
/// interval).
pub(crate) fn samples_as(
    op: Operation,
    h: Handle<'_>,
    since_us: u64,
    out: &mut Vec<Sample>,
) -> Result<(), GpuError> {
    match h {
        Handle::Nvml(h) => {
            let dev = h.device(op)?;
            match process_utilization(dev, since_us, out) {
                Ok(()) => Ok(()),
                // No sample newer than `since_us`: no process did any work.
                Err(NvmlError::NotFound) => Ok(()),
                Err(e) => Err(GpuError::nvml(op, &e)),
            }
        }
        #[cfg(test)]
        Handle::Fake(mut h) => {
            h.count(op.label());
            let samples = h
                .device(op)?
                .scripts
                .get::<Vec<Sample>>()
                .ok_or(crate::gpu::fake::unsupported(op))?;
            out.extend(samples.iter().filter(|p| p.timestamp_us > since_us));
            Ok(())
        }
    }
}

/// The room asked for in the first try: a GPU's processes times the few
/// samples each has since the last read.
const FIRST_TRY: usize = 64;

/// nvmlDeviceGetProcessUtilization in one call where a buffer as large as
/// the last answer's (or [`FIRST_TRY`]) is room enough. nvml-wrapper's
/// `process_utilization_stats` always asks for the count first with a
/// null buffer, and on the H200 each call costs 0.7–1.4 ms of CPU in the
/// driver (BENCHMARKS.md, "where the idle CPU goes"): a second call only
/// when the first answers INSUFFICIENT_SIZE, with the size it gave.
fn process_utilization(
    dev: &Device<'static>,
    since_us: u64,
    out: &mut Vec<Sample>,
) -> Result<(), NvmlError> {
    let sym = nvml_sym(dev.nvml().lib().nvmlDeviceGetProcessUtilization.as_ref())?;
    let mut room = out.capacity().max(FIRST_TRY);
    for _ in 0..3 {
        let mut buf: Vec<nvmlProcessUtilizationSample_t> = vec![
            nvmlProcessUtilizationSample_t {
                pid: 0,
                timeStamp: 0,
                smUtil: 0,
                memUtil: 0,
                encUtil: 0,
                decUtil: 0,
            };
            room
        ];
        let mut count = u32::try_from(room).unwrap_or(u32::MAX);
        // SAFETY: a handle of this NVML instance, a buffer of `count`
        // samples and a valid in/out count.
        match nvml_try(unsafe { sym(dev.handle(), buf.as_mut_ptr(), &mut count, since_us) }) {
            Ok(()) => {
                buf.truncate(count as usize);
                out.extend(buf.iter().map(|p| Sample {
                    pid: p.pid,
                    timestamp_us: p.timeStamp,
                    utilization: ProcessUtilization {
                        sm: p.smUtil,
                        memory: p.memUtil,
                        encoder: p.encUtil,
                        decoder: p.decUtil,
                    },
                }));
                return Ok(());
            }
            // `count` now holds the size needed (more samples may come
            // before the next try: a little room on top).
            Err(NvmlError::InsufficientSize(_)) => room = (count as usize).max(room) + 16,
            Err(e) => return Err(e),
        }
    }
    Err(NvmlError::InsufficientSize(None))
}
