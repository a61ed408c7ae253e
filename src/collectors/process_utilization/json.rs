//! The `process_utilization` collector in `/api/v1/snapshot`: each
//! process's `utilization` object, ratios 0–1, like nvidia-smi pmon.

use serde::Serialize;
use serde_json::value::RawValue;

use super::ProcessUtilization;
use crate::collectors::{Json, to_json};
use crate::model::Readings;

pub(crate) const JSON: Json = Json {
    key: "utilization",
    gpu: None,
    process: Some(process),
};

#[derive(Serialize)]
struct Ratios {
    sm_ratio: f64,
    memory_ratio: f64,
    encoder_ratio: f64,
    decoder_ratio: f64,
}

fn process(r: &Readings) -> Option<Box<RawValue>> {
    let u = r.get::<ProcessUtilization>()?;
    let ratio = |p: u32| f64::from(p) / 100.0;
    to_json(&Ratios {
        sm_ratio: ratio(u.sm),
        memory_ratio: ratio(u.memory),
        encoder_ratio: ratio(u.encoder),
        decoder_ratio: ratio(u.decoder),
    })
}
