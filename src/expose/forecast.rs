//! The forecast families: when a GPU's memory, and a PyTorch process's
//! reserved memory under its limit, would be full at the growth of the
//! present regime of the exporter's own one-second history (`history.rs`,
//! `trend/regime.rs`). Written with the device families, re-encoded at
//! every sample (the figure counts down between two seconds). A series
//! exists only while its figure grows, and a family with no series is
//! left out whole, so a host whose memory is flat serves none of them.

use std::fmt;

use prometheus_client::encoding::DescriptorEncoder;

use crate::encoding::{Ids, gauge, gpu_labels, process_labels};
use crate::model::{Forecast, Snapshot};

type Pick = fn(&Forecast) -> f64;

const GPU: [(&str, &str, Pick); 2] = [
    (
        "gpu_memory_full_in_seconds",
        "Seconds until free memory reaches 0 at the growth of the present regime of used memory (the exporter's own 1 s history: the change point where the current growth began, not a fixed window). Present only while used memory grows; see gpu_memory_growth_bytes_per_second.",
        |f| f.full_in_seconds,
    ),
    (
        "gpu_memory_growth_bytes_per_second",
        "Growth of used memory in the present regime (least-squares slope since its change point), bytes per second. Present only while it grows.",
        |f| f.growth_bytes_per_second,
    ),
];

const TORCH: [(&str, &str, Pick); 2] = [
    (
        "gpu_process_torch_limit_in_seconds",
        "Seconds until gpu_process_torch_reserved_bytes reaches gpu_process_torch_memory_limit_bytes at the growth of its present regime (the exporter's own 1 s history of it). Present only while a limit is set and reserved grows.",
        |f| f.full_in_seconds,
    ),
    (
        "gpu_process_torch_reserved_growth_bytes_per_second",
        "Growth of gpu_process_torch_reserved_bytes in its present regime, bytes per second, for a process with a memory limit. Present only while it grows.",
        |f| f.growth_bytes_per_second,
    ),
];

pub(super) fn families(enc: &mut DescriptorEncoder, s: &Snapshot) -> fmt::Result {
    if s.forecasts.gpus.iter().any(Option::is_some) {
        for (name, help, pick) in GPU {
            let mut m = gauge(enc, name, help)?;
            for (i, d) in s.devices.iter().enumerate() {
                if let Some(f) = s.forecasts.gpu(i) {
                    m.encode_family(&gpu_labels(d))?.encode_gauge(&pick(&f))?;
                }
            }
        }
    }
    if s.forecasts.torch.is_empty() || s.series.mode != crate::model::SeriesMode::Pid {
        return Ok(());
    }
    let mut ids = Ids::default();
    for (name, help, pick) in TORCH {
        let mut m = gauge(enc, name, help)?;
        for t in &s.forecasts.torch {
            let Some(d) = s.devices.get(t.gpu) else {
                continue;
            };
            let Ok(at) = d.processes.binary_search_by_key(&t.pid, |p| p.pid) else {
                continue;
            };
            let p = &d.processes[at];
            let (pid, gi, ci) = ids.all(p);
            m.encode_family(&process_labels(d, p, pid, gi, ci))?
                .encode_gauge(&pick(&t.forecast))?;
        }
    }
    Ok(())
}
