//! The `process_utilization` collector's NVML call, and the in-process
//! fake's answer (a `Vec<Sample>` script; none: `not_supported`).

use nvml_wrapper::error::NvmlError;

use super::{ProcessUtilization, Sample};
use crate::gpu::{GpuError, Handle, Operation};

pub(crate) const PROCESS_UTILIZATION: Operation = Operation::new("process_utilization");

pub(crate) const OPERATIONS: &[Operation] = &[PROCESS_UTILIZATION];

/// Process utilisation samples newer than `since_us` (NVML's sample
/// timestamps, µs), appended to `out`; none newer is `Ok` and empty.
pub(super) fn samples(h: Handle<'_>, since_us: u64, out: &mut Vec<Sample>) -> Result<(), GpuError> {
    match h {
        Handle::Nvml(h) => {
            let dev = h.device(PROCESS_UTILIZATION)?;
            match dev.process_utilization_stats(since_us) {
                Ok(samples) => {
                    out.extend(samples.into_iter().map(|p| Sample {
                        pid: p.pid,
                        timestamp_us: p.timestamp,
                        utilization: ProcessUtilization {
                            sm: p.sm_util,
                            memory: p.mem_util,
                            encoder: p.enc_util,
                            decoder: p.dec_util,
                        },
                    }));
                    Ok(())
                }
                // No sample newer than `since_us`: no process did any work.
                Err(NvmlError::NotFound) => Ok(()),
                Err(e) => Err(GpuError::nvml(PROCESS_UTILIZATION, &e)),
            }
        }
        #[cfg(test)]
        Handle::Fake(mut h) => {
            h.count("process_utilization");
            let samples = h
                .device(PROCESS_UTILIZATION)?
                .scripts
                .get::<Vec<Sample>>()
                .ok_or(crate::gpu::fake::unsupported(PROCESS_UTILIZATION))?;
            out.extend(samples.iter().filter(|p| p.timestamp_us > since_us));
            Ok(())
        }
    }
}
