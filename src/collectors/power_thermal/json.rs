//! The `power_thermal` collector in `/api/v1/snapshot`: each GPU's
//! `power_thermal` object in the families' units (°C, watts, joules,
//! hertz); `null` for a figure not supported.

use serde::Serialize;
use serde_json::value::RawValue;

use super::{Clock, PowerThermal};
use crate::collectors::{Json, to_json};
use crate::model::Readings;

pub(crate) const JSON: Json = Json {
    key: "power_thermal",
    gpu: Some(gpu),
    process: None,
};

#[derive(Serialize)]
struct Figures {
    temperature_celsius: Option<u32>,
    power_watts: Option<f64>,
    power_limit_watts: Option<f64>,
    energy_joules: Option<f64>,
    graphics_clock_hertz: Option<u64>,
    sm_clock_hertz: Option<u64>,
    memory_clock_hertz: Option<u64>,
    video_clock_hertz: Option<u64>,
    performance_state: Option<u32>,
    clock_event_reasons: Option<u64>,
}

fn gpu(r: &Readings) -> Option<Box<RawValue>> {
    let p = r.get::<PowerThermal>()?;
    let watts = |mw: u32| f64::from(mw) / 1000.0;
    let hertz = |c: Clock| p.clocks_mhz[c as usize].map(|m| u64::from(m) * 1_000_000);
    to_json(&Figures {
        temperature_celsius: p.temperature_c,
        power_watts: p.power_mw.map(watts),
        power_limit_watts: p.power_limit_mw.map(watts),
        energy_joules: p.energy_mj.map(|mj| mj as f64 / 1000.0),
        graphics_clock_hertz: hertz(Clock::Graphics),
        sm_clock_hertz: hertz(Clock::Sm),
        memory_clock_hertz: hertz(Clock::Memory),
        video_clock_hertz: hertz(Clock::Video),
        performance_state: p.performance_state,
        clock_event_reasons: p.clock_event_reasons,
    })
}
