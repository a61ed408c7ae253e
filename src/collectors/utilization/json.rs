//! The `utilization` collector in `/api/v1/snapshot`: each GPU's
//! `utilization` object, ratios 0–1 (`null` where a call is not
//! supported; the whole object `null` where none is).

use serde::Serialize;
use serde_json::value::RawValue;

use super::Utilization;
use crate::collectors::{Json, to_json};
use crate::model::Readings;

pub(crate) const JSON: Json = Json {
    key: "utilization",
    gpu: Some(gpu),
    process: None,
};

#[derive(Serialize)]
struct Ratios {
    gpu_ratio: Option<f64>,
    memory_ratio: Option<f64>,
    encoder_ratio: Option<f64>,
    decoder_ratio: Option<f64>,
}

fn ratio(percent: u32) -> f64 {
    f64::from(percent) / 100.0
}

fn gpu(r: &Readings) -> Option<Box<RawValue>> {
    let u = r.get::<Utilization>()?;
    // The collector on, but no figure supported: as if off.
    if (Utilization {
        samples: None,
        ..*u
    }) == Utilization::default()
    {
        return None;
    }
    to_json(&Ratios {
        gpu_ratio: u.gpu.map(ratio),
        memory_ratio: u.memory.map(ratio),
        encoder_ratio: u.encoder.map(ratio),
        decoder_ratio: u.decoder.map(ratio),
    })
}
