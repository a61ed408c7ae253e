//! The `utilization` collector's NVML calls, and the in-process fake's
//! answers to them (a [`Utilization`] script: a `None` field answers
//! `not_supported`).

use super::Utilization;
use crate::gpu::keep;
use crate::gpu::{GpuError, Handle, Operation};

pub(crate) const UTILIZATION_RATES: Operation = Operation::new("utilization_rates");
pub(crate) const ENCODER_UTILIZATION: Operation = Operation::new("encoder_utilization");
pub(crate) const DECODER_UTILIZATION: Operation = Operation::new("decoder_utilization");

pub(crate) const OPERATIONS: &[Operation] =
    &[UTILIZATION_RATES, ENCODER_UTILIZATION, DECODER_UTILIZATION];

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
