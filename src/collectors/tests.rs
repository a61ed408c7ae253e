use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::attribute::ProcessLookup;
use crate::config::{SamplerConfig, Selection, Timing};
use crate::gpu::fake::{FakeDevice, FakeGpu};
use crate::model::ProcIdentity;
use crate::model::Reading;
use crate::sample::Sampler;

const GIB: u64 = 1 << 30;

/// What the toy collector leaves in a GPU's sample.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ToyReading {
    /// Reads made so far on this GPU.
    reads: u32,
    /// The GPU's used memory at the last read.
    used: u64,
}

/// The toy's one NVML call: the recipe's `calls.rs`.
mod toy_calls {
    use crate::gpu::{GpuError, Handle, Operation};

    pub(super) const TOY_MEMORY_INFO: Operation = Operation::new("toy_memory_info");

    /// Used bytes of the GPU: NVML's memory info, or the fake's answer.
    pub(super) fn used(h: Handle<'_>) -> Result<u64, GpuError> {
        match h {
            Handle::Nvml(h) => h
                .device(TOY_MEMORY_INFO)?
                .memory_info()
                .map(|m| m.used)
                .map_err(|e| GpuError::nvml(TOY_MEMORY_INFO, &e)),
            Handle::Fake(mut h) => {
                h.count("toy");
                h.device(TOY_MEMORY_INFO)?
                    .memory
                    .map(|m| m.used)
                    .map_err(|e| GpuError::new(TOY_MEMORY_INFO, e.kind))
            }
        }
    }
}

/// The toy's families: the recipe's `families.rs`.
mod toy_families {
    use std::fmt;

    use prometheus_client::encoding::DescriptorEncoder;

    use super::ToyReading;
    use crate::encoding::{gauge, gpu_labels};
    use crate::model::Snapshot;

    pub(super) fn encode(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
        if !s
            .devices
            .iter()
            .any(|d| d.readings.get::<ToyReading>().is_some())
        {
            return Ok(());
        }
        let mut f = gauge(enc, "gpu_toy_reads", "Reads the toy collector made.")?;
        for d in &s.devices {
            if let Some(r) = d.readings.get::<ToyReading>() {
                f.encode_family(&gpu_labels(d))?
                    .encode_gauge(&i64::from(r.reads))?;
            }
        }
        Ok(())
    }

    /// The recipe's `json.rs`: its object in `/api/v1/snapshot`.
    pub(super) const JSON: crate::collectors::Json = crate::collectors::Json {
        key: "toy",
        gpu: Some(gpu),
        process: None,
    };

    #[derive(serde::Serialize)]
    struct Figures {
        reads: u32,
        used_bytes: u64,
    }

    fn gpu(r: &crate::model::Readings) -> Option<Box<serde_json::value::RawValue>> {
        let t = r.get::<ToyReading>()?;
        crate::collectors::to_json(&Figures {
            reads: t.reads,
            used_bytes: t.used,
        })
    }
}

/// A collector written only against this module's API: per-GPU state,
/// its own call through a handle, its own read interval.
#[derive(Default)]
struct Toy {
    gpus: PerGpu<(Option<Instant>, Option<Arc<ToyReading>>)>,
}

impl Toy {
    const EVERY: Duration = Duration::from_secs(3600);

    fn boxed() -> Box<dyn Collector> {
        Box::<Toy>::default()
    }
}

impl Collector for Toy {
    fn collect(&mut self, cx: &mut Context<'_>, gpu: usize) {
        let (read_at, reading) = self.gpus.at(gpu);
        if read_at.is_some_and(|at| cx.now.duration_since(at) < Toy::EVERY) {
            return;
        }
        *read_at = Some(cx.now);
        match cx.call(gpu, toy_calls::TOY_MEMORY_INFO, toy_calls::used) {
            Ok(used) => {
                let reads = reading.as_ref().map_or(0, |r| r.reads) + 1;
                *reading = Some(Arc::new(ToyReading { reads, used }));
            }
            Err(e) => cx.failed(gpu, e),
        }
    }

    fn forget(&mut self, gpu: usize) {
        self.gpus.at(gpu).1 = None;
    }

    fn reading(&self, gpu: usize) -> Option<Arc<dyn Reading>> {
        let r = self.gpus.get(gpu)?.1.clone()?;
        Some(r)
    }
}

/// The registry with one more row: the toy.
fn toy_registry() -> &'static [Def] {
    let mut rows = REGISTRY.to_vec();
    rows.push(Def {
        name: "toy",
        default: true,
        switchable: true,
        help: "a toy",
        calls: "`nvmlDeviceGetMemoryInfo_v2` every hour",
        cost: "none",
        vgpu_guest: true,
        make: Some(Toy::boxed),
        encode: Some(toy_families::encode),
        json: Some(toy_families::JSON),
        operations: &[toy_calls::TOY_MEMORY_INFO],
    });
    Box::leak(rows.into_boxed_slice())
}

struct NoLookup;

impl ProcessLookup for NoLookup {
    fn identify(&mut self, _pid: u32) -> Arc<ProcIdentity> {
        Arc::default()
    }
    fn seen(&self, _pid: u32) -> crate::attribute::Seen {
        crate::attribute::Seen {
            start: None,
            stale: None,
        }
    }
    fn retain(&mut self, _live: &dyn Fn(u32) -> bool) {}
}

fn config(collectors: Collectors) -> SamplerConfig {
    SamplerConfig {
        timing: Timing::every(Duration::from_secs(1)),
        selection: Selection::default(),
        collectors,
        procfs: "/proc".into(),
        cgroupfs: "/sys/fs/cgroup".into(),
    }
}

#[test]
fn a_toy_collector_joins_through_the_registry_alone() {
    let registry = toy_registry();
    let toy = &registry[registry.len() - 1];
    let gpu = FakeGpu::new(vec![
        FakeDevice::new(0, 80 * GIB, GIB),
        FakeDevice::new(1, 80 * GIB, 3 * GIB),
    ]);
    let mut s = Sampler::with_registry(gpu, NoLookup, config(Collectors::default()), registry);
    let snap = s.tick();
    // Encoded by the scrape path from its row alone, after the other
    // collectors' families and before the driver's.
    let reuse = crate::expose::Reuse::with_registry(registry);
    let body =
        crate::expose::encode_reusing(&Arc::new(snap.clone()), crate::expose::Format::Text, &reuse)
            .unwrap_or_default();
    assert!(
        body.contains("gpu_toy_reads{gpu=\"1\",uuid=\"GPU-fake-0001\"} 1\n"),
        "{body}"
    );
    let (toy_at, driver_at) = (
        body.find("# HELP gpu_toy_reads"),
        body.find("# HELP gpu_driver_info"),
    );
    assert!(toy_at.is_some() && toy_at < driver_at, "{body}");
    assert!(
        !crate::expose::encode(&Arc::new(snap.clone()), crate::expose::Format::Text)
            .unwrap_or_default()
            .contains("gpu_toy_reads")
    );
    // In /api/v1/snapshot from its row alone too: each GPU's "toy" object,
    // and the collectors list the page draws its line from.
    let json = crate::expose::json::Reuse::with_registry(registry);
    let doc = crate::expose::json::snapshot_reusing(&snap, Duration::from_secs(1), &json)
        .unwrap_or_default();
    let doc: serde_json::Value = serde_json::from_slice(&doc).unwrap_or_default();
    assert_eq!(
        doc["gpus"][1]["toy"],
        serde_json::json!({"reads": 1, "used_bytes": 3 * GIB}),
        "{doc}"
    );
    assert_eq!(
        doc["collectors"].as_array().and_then(|c| c.last()),
        Some(&serde_json::json!({"key": "toy", "help": "a toy"}))
    );
    let plain = crate::expose::json::snapshot_reusing(
        &snap,
        Duration::from_secs(1),
        &crate::expose::json::Reuse::default(),
    )
    .unwrap_or_default();
    assert!(!String::from_utf8_lossy(&plain).contains("\"toy\""));
    let got: Vec<Option<ToyReading>> = snap
        .devices
        .iter()
        .map(|d| d.readings.get::<ToyReading>().cloned())
        .collect();
    let want = |reads, used| Some(ToyReading { reads, used });
    assert_eq!(got, vec![want(1, GIB), want(1, 3 * GIB)]);
    // Its own interval: the next full sample keeps the reading; a memory
    // sample carries it too.
    s.gpu_mut().devices[0].memory = Ok(crate::gpu::fake::memory(80 * GIB, 2 * GIB));
    let snap = s.tick();
    assert_eq!(
        snap.devices[0].readings.get::<ToyReading>(),
        want(1, GIB).as_ref()
    );
    let snap = s.tick_memory();
    assert_eq!(
        snap.devices[0].readings.get::<ToyReading>(),
        want(1, GIB).as_ref()
    );
    // A GPU that does not answer has no reading.
    s.gpu_mut().devices[1].memory = Err(crate::gpu::GpuError::new(
        crate::gpu::Operation::MEMORY_INFO,
        crate::gpu::ErrorKind::GpuLost,
    ));
    assert_eq!(
        s.gpu_mut().calls_of(["toy"]),
        [2],
        "one read per GPU in the hour"
    );
    let snap = s.tick();
    assert_eq!(snap.devices[1].readings.get::<ToyReading>(), None);
    // Switched off by a reload: gone, state and all; on again: read afresh.
    let mut off = Collectors::default();
    off.set(toy, false);
    assert!(!off.is_on(toy) && Collectors::default().is_on(toy));
    s.reconfigure(config(off));
    assert_eq!(s.tick().devices[0].readings.get::<ToyReading>(), None);
    s.reconfigure(config(Collectors::default()));
    assert_eq!(
        s.tick().devices[0].readings.get::<ToyReading>(),
        want(1, 2 * GIB).as_ref()
    );
}

/// Every `operation` label, the sampler's own and each row's, once.
#[test]
fn operation_labels_are_unique() {
    let mut labels: Vec<&str> = crate::gpu::Operation::CORE
        .iter()
        .chain(REGISTRY.iter().flat_map(|d| d.operations))
        .map(|o| o.label())
        .collect();
    let n = labels.len();
    assert_eq!(n, 51, "the sampler's 22 and the collectors' 29");
    labels.sort_unstable();
    labels.dedup();
    assert_eq!(labels.len(), n, "an operation label is declared twice");
}

#[test]
fn choices_and_defaults() {
    let c = Collectors::default();
    let names = c.enabled();
    assert_eq!(
        names,
        vec![
            "memory",
            "processes",
            "utilization",
            "process_activity",
            "power_thermal",
            "health"
        ]
    );
    let mut c = Collectors::default();
    let memory = find("memory").unwrap();
    c.set(memory, false);
    assert!(c.is_on(memory), "memory always runs");
    c.set(find("processes").unwrap(), false);
    assert!(!c.processes());
    assert!(find("gpu_temp").is_none());
}

/// One row of docs/metrics.md's collector table, as the registry says it.
fn doc_row(d: &Def) -> String {
    let default = match (d.switchable, d.default) {
        (false, _) => format!("always on (`--no-collector.{}` is refused)", d.name),
        (true, true) => "on".to_string(),
        (true, false) => "**off**".to_string(),
    };
    format!("| `{}` | {default} | {} | {} |", d.name, d.calls, d.cost)
}

#[test]
fn the_docs_table_is_the_registry() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/metrics.md");
    let text = std::fs::read_to_string(path).unwrap();
    let header = "| collector | default | NVML calls per GPU per full sample | cost on the H200 |";
    let rows: Vec<&str> = text
        .lines()
        .skip_while(|l| *l != header)
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .collect();
    let want: Vec<String> = REGISTRY.iter().map(doc_row).collect();
    assert_eq!(
        rows,
        want,
        "docs/metrics.md's collector table differs from collectors::REGISTRY; the table should read:\n{}",
        want.join("\n")
    );
}
