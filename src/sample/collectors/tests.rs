use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::attribute::ProcessLookup;
use crate::config::{SamplerConfig, Selection, Timing};
use crate::gpu::fake::{FakeDevice, FakeGpu};
use crate::model::ProcIdentity;
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

/// A collector written only against this module's API: per-GPU state,
/// its own call through `GpuSource`, its own read interval.
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
        match cx.gpu.memory(gpu) {
            Ok(m) => {
                let reads = reading.as_ref().map_or(0, |r| r.reads) + 1;
                *reading = Some(Arc::new(ToyReading {
                    reads,
                    used: m.used,
                }));
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
    });
    Box::leak(rows.into_boxed_slice())
}

struct NoLookup;

impl ProcessLookup for NoLookup {
    fn identify(&mut self, _pid: u32) -> Arc<ProcIdentity> {
        Arc::default()
    }
    fn retain(&mut self, _live: &dyn Fn(u32) -> bool) {}
}

fn config(collectors: Collectors) -> SamplerConfig {
    SamplerConfig {
        timing: Timing::every(Duration::from_secs(1)),
        selection: Selection::default(),
        collectors,
        procfs: "/proc".into(),
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
        crate::gpu::Operation::MemoryInfo,
        crate::gpu::ErrorKind::GpuLost,
    ));
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
        "docs/metrics.md's collector table differs from sample::collectors::REGISTRY; the table should read:\n{}",
        want.join("\n")
    );
}
