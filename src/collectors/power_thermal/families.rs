//! The `power_thermal` collector's families: temperature, power draw and
//! limit, energy, clocks, P-state and the clock event (throttle) reasons.

use std::fmt;

use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use super::{Clock, PowerThermal};
use crate::encoding::{Labels, gauge, gpu_labels};
use crate::model::{DeviceSample, Snapshot};

/// NVML's clocks event reason bits (nvmlClocksEventReason*) and their
/// `reason` label values.
const CLOCK_EVENT_REASONS: [(u64, &str); 9] = [
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
];

fn power(d: &DeviceSample) -> Option<&PowerThermal> {
    d.readings.get::<PowerThermal>()
}

/// Every family of this collector; each is absent when no GPU has it.
pub(crate) fn encode(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    type Pick = fn(&PowerThermal) -> Option<f64>;
    let gauges: [(&str, &str, Pick); 4] = [
        (
            "gpu_temperature_celsius",
            "GPU core temperature in degrees Celsius.",
            |p| p.temperature_c.map(f64::from),
        ),
        (
            "gpu_power_usage_watts",
            "Power drawn by the GPU board, in watts (nvidia-smi power.draw).",
            |p| p.power_mw.map(|mw| f64::from(mw) / 1000.0),
        ),
        (
            "gpu_power_limit_watts",
            "Power limit the driver enforces, in watts (nvidia-smi enforced.power.limit).",
            |p| p.power_limit_mw.map(|mw| f64::from(mw) / 1000.0),
        ),
        (
            "gpu_performance_state",
            "Performance state: 0 (P0, maximum performance) to 15 (P15, minimum).",
            |p| p.performance_state.map(f64::from),
        ),
    ];
    for (name, help, pick) in gauges {
        if !s.devices.iter().any(|d| power(d).and_then(pick).is_some()) {
            continue;
        }
        let mut m = gauge(enc, name, help)?;
        for d in &s.devices {
            if let Some(v) = power(d).and_then(pick) {
                m.encode_family(&gpu_labels(d))?.encode_gauge(&v)?;
            }
        }
    }

    if s.devices
        .iter()
        .any(|d| power(d).and_then(|p| p.energy_mj).is_some())
    {
        let mut m = enc.encode_descriptor(
            "gpu_energy_consumed_joules",
            "Energy used by the GPU since the driver was loaded, in joules.",
            None,
            MetricType::Counter,
        )?;
        for d in &s.devices {
            if let Some(mj) = power(d).and_then(|p| p.energy_mj) {
                m.encode_family(&gpu_labels(d))?
                    .encode_counter::<NoLabelSet, _, u64>(&(mj as f64 / 1000.0), None)?;
            }
        }
    }

    if s.devices
        .iter()
        .any(|d| power(d).is_some_and(|p| p.clocks_mhz.iter().any(Option::is_some)))
    {
        let mut m = gauge(
            enc,
            "gpu_clock_hertz",
            "Current clock of each domain (sm, memory, graphics, video), in hertz.",
        )?;
        for d in &s.devices {
            let Some(p) = power(d) else { continue };
            for c in Clock::ALL {
                if let Some(mhz) = p.clocks_mhz[c as usize] {
                    let Labels([g, u]) = gpu_labels(d);
                    m.encode_family(&Labels([g, u, ("clock", c.label())]))?
                        .encode_gauge(&(u64::from(mhz) * 1_000_000))?;
                }
            }
        }
    }

    if s.devices
        .iter()
        .any(|d| power(d).and_then(|p| p.clock_event_reasons).is_some())
    {
        let mut m = gauge(
            enc,
            "gpu_clock_event_active",
            "1 while this reason holds the clocks down (NVML clocks event reasons: power cap, thermal, idle, ...), else 0.",
        )?;
        for d in &s.devices {
            let Some(mask) = power(d).and_then(|p| p.clock_event_reasons) else {
                continue;
            };
            for (bit, reason) in CLOCK_EVENT_REASONS {
                let Labels([g, u]) = gpu_labels(d);
                m.encode_family(&Labels([g, u, ("reason", reason)]))?
                    .encode_gauge(&u32::from(mask & bit != 0))?;
            }
        }
    }
    Ok(())
}
