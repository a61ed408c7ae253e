//! The `utilization` collector's NVML calls, and the in-process fake's
//! answers to them (a [`Utilization`] script: a `None` field answers
//! `not_supported`; a [`SampleScript`] for `nvmlDeviceGetSamples`, none
//! answers `not_supported`).

use super::Utilization;
use crate::gpu::keep;
use crate::gpu::{GpuError, Handle, Operation};

pub(crate) const UTILIZATION_RATES: Operation = Operation::new("utilization_rates");
pub(crate) const ENCODER_UTILIZATION: Operation = Operation::new("encoder_utilization");
pub(crate) const DECODER_UTILIZATION: Operation = Operation::new("decoder_utilization");

pub(crate) const UTILIZATION_SAMPLES: Operation = Operation::new("utilization_samples");

pub(crate) const OPERATIONS: &[Operation] = &[
    UTILIZATION_RATES,
    ENCODER_UTILIZATION,
    DECODER_UTILIZATION,
    UTILIZATION_SAMPLES,
];

/// The in-process fake's utilisation samples: (CPU timestamp µs, percent).
#[cfg(test)]
#[derive(Debug, Clone, Default)]
pub(crate) struct SampleScript(pub(crate) Vec<(u64, u32)>);

/// `nvmlDeviceGetSamples(NVML_GPU_UTILIZATION_SAMPLES)`: the samples newer
/// than `last_seen` µs (all NVML keeps when `None`) as (timestamp µs,
/// percent); none newer (NOT_FOUND) is an empty list.
pub(super) fn samples(h: Handle<'_>, last_seen: Option<u64>) -> Result<Vec<(u64, u32)>, GpuError> {
    let list = match h {
        Handle::Nvml(h) => {
            use nvml_wrapper::enum_wrappers::device::Sampling;
            use nvml_wrapper::enums::device::SampleValue;
            let dev = h.device(UTILIZATION_SAMPLES)?;
            match dev.samples(Sampling::GpuUtilization, last_seen) {
                Ok(list) => list
                    .into_iter()
                    .map(|s| {
                        let pct = match s.value {
                            SampleValue::U32(v) => v,
                            SampleValue::U64(v) => u32::try_from(v).unwrap_or(u32::MAX),
                            SampleValue::I64(v) => u32::try_from(v.max(0)).unwrap_or(u32::MAX),
                            SampleValue::F64(v) => v.clamp(0.0, 100.0) as u32,
                        };
                        (s.timestamp, pct)
                    })
                    .collect(),
                Err(e) => {
                    let e = GpuError::nvml(UTILIZATION_SAMPLES, &e);
                    if e.kind == crate::gpu::ErrorKind::NotFound {
                        Vec::new()
                    } else {
                        return Err(e);
                    }
                }
            }
        }
        #[cfg(test)]
        Handle::Fake(mut h) => {
            h.count("utilization_samples");
            let d = h.device(UTILIZATION_SAMPLES)?;
            let Some(script) = d.scripts.get::<SampleScript>() else {
                return Err(crate::gpu::fake::unsupported(UTILIZATION_SAMPLES));
            };
            script
                .0
                .iter()
                .copied()
                .filter(|(t, _)| last_seen.is_none_or(|l| *t > l))
                .collect()
        }
    };
    Ok(list)
}

/// The three calls on one GPU; each that fails leaves its field `None`
/// and is pushed to `failed`.
pub(super) fn read(h: Handle<'_>, failed: &mut Vec<GpuError>) -> Utilization {
    match h {
        Handle::Nvml(h) => match h.device(UTILIZATION_RATES) {
            Ok(dev) => {
                let rates = keep(dev.utilization_rates(), UTILIZATION_RATES, failed);
                Utilization {
                    gpu: rates.as_ref().map(|r| r.gpu),
                    memory: rates.as_ref().map(|r| r.memory),
                    encoder: keep(dev.encoder_utilization(), ENCODER_UTILIZATION, failed)
                        .map(|u| u.utilization),
                    decoder: keep(dev.decoder_utilization(), DECODER_UTILIZATION, failed)
                        .map(|u| u.utilization),
                    samples: None,
                }
            }
            Err(e) => {
                failed.push(e);
                Utilization::default()
            }
        },
        #[cfg(test)]
        Handle::Fake(mut h) => {
            h.count("utilization");
            match h.device(UTILIZATION_RATES) {
                Ok(d) => {
                    let u = d.scripts.get::<Utilization>().copied().unwrap_or_default();
                    for (op, missing) in [
                        (UTILIZATION_RATES, u.gpu.is_none()),
                        (ENCODER_UTILIZATION, u.encoder.is_none()),
                        (DECODER_UTILIZATION, u.decoder.is_none()),
                    ] {
                        if missing {
                            failed.push(crate::gpu::fake::unsupported(op));
                        }
                    }
                    u
                }
                Err(e) => {
                    failed.push(e);
                    Utilization::default()
                }
            }
        }
    }
}
