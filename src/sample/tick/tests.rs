use super::*;
use crate::collectors;
use crate::collectors::health::calls::{Xid, XidWatched};
use crate::collectors::health::{Health, RemappedRows};
use crate::collectors::power_thermal::PowerThermal;
use crate::collectors::power_thermal::calls::{Failing, TEMPERATURE};
use crate::collectors::process_utilization::{ProcessUtilization, Sample};
use crate::collectors::utilization::Utilization;
use crate::config::Collectors;
use crate::gpu::fake::{FakeDevice, FakeGpu, memory, process};
use crate::gpu::{ErrorKind, Operation};
use crate::model::{MemoryInfo, MigInfo, OtherProcesses, ProcIdentity};

const GIB: u64 = 1 << 30;

/// A lookup that records what the sampler asks and names pid `n` "pn".
#[derive(Default)]
struct Recorder {
    identified: Vec<u32>,
    live_after_tick: Vec<u32>,
}

impl ProcessLookup for Recorder {
    fn identify(&mut self, pid: u32) -> Arc<ProcIdentity> {
        self.identified.push(pid);
        Arc::new(ProcIdentity {
            comm: Arc::from(format!("p{pid}")),
            ..ProcIdentity::default()
        })
    }
    fn retain(&mut self, live: &dyn Fn(u32) -> bool) {
        self.live_after_tick = (0..100).filter(|p| live(*p)).collect();
    }
    fn seen(&self, _pid: u32) -> crate::attribute::Seen {
        crate::attribute::Seen {
            start: Some(0),
            stale: None,
        }
    }
}

/// The bridge's stand-in: records which devices the sampler asks for.
#[derive(Clone, Default)]
struct TorchAsked(Arc<std::sync::Mutex<Asked>>);

/// Each pid asked for, with the device UUIDs it was asked for.
type Asked = Vec<(u32, Vec<String>)>;

impl TorchAsked {
    fn asked(&self) -> Vec<(u32, Vec<String>)> {
        self.0.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

impl crate::bridge::Figures for TorchAsked {
    fn stats(&mut self, pid: u32, _start: u64, uuids: &[&str]) -> Option<crate::model::TorchStats> {
        if let Ok(mut v) = self.0.lock() {
            v.push((pid, uuids.iter().map(|u| u.to_string()).collect()));
        }
        None
    }
    fn end_tick(&mut self, _live: &dyn Fn(u32) -> bool) {}
}

fn timing() -> Timing {
    Timing {
        sample_interval: Duration::from_secs(1),
        memory_sample_interval: Duration::from_millis(100),
        peak_window: Duration::from_secs(30),
        mig_rescan_interval: Duration::from_secs(10),
        limits_interval: Duration::from_secs(10),
    }
}

fn lost(operation: Operation) -> GpuError {
    GpuError::new(operation, ErrorKind::GpuLost)
}

/// The default collectors with `timing`.
fn with(timing: Timing) -> SamplerConfig {
    SamplerConfig {
        timing,
        selection: Selection::default(),
        collectors: Collectors::default(),
        procfs: "/proc".into(),
        cgroupfs: "/sys/fs/cgroup".into(),
    }
}

/// `timing()` and these collectors.
fn switched(collectors: Collectors) -> SamplerConfig {
    SamplerConfig {
        collectors,
        ..with(timing())
    }
}

/// Collector `name`'s switch set to `on`.
fn set(mut c: Collectors, name: &str, on: bool) -> Collectors {
    c.set(collectors::find(name).unwrap(), on);
    c
}

#[test]
fn a_full_tick_lists_selects_and_names_processes() {
    let mut d0 = FakeDevice::new(0, 80 * GIB, 10 * GIB);
    // pid 10 listed twice (compute and graphics): one entry.
    d0.processes = Ok(vec![
        process(30, GIB),
        process(10, 5 * GIB),
        process(20, 3 * GIB),
        process(10, 5 * GIB),
    ]);
    let gpu = FakeGpu::new(vec![d0, FakeDevice::new(1, 80 * GIB, 0)]);
    let selection = Selection {
        enabled: true,
        min_bytes: 0,
        top_n: 2,
        ..Selection::default()
    };
    let mut s = Sampler::new(gpu, Recorder::default(), with(timing())).with_selection(selection);
    let snap = s.tick();
    assert_eq!(snap.devices.len(), 2);
    let d = &snap.devices[0];
    assert!(d.up());
    assert_eq!(d.memory.map(|m| m.used), Some(10 * GIB));
    let listed: Vec<(u32, &str, Option<u64>)> = d
        .processes
        .iter()
        .map(|p| (p.pid, &*p.ident.comm, p.used_bytes))
        .collect();
    assert_eq!(
        listed,
        vec![(10, "p10", Some(5 * GIB)), (20, "p20", Some(3 * GIB))]
    );
    assert_eq!(
        d.other,
        Some(OtherProcesses {
            count: 1,
            used_bytes: GIB
        })
    );
    assert!(snap.devices[1].processes.is_empty());
    assert_eq!(snap.devices[1].other, None);
    // Only processes with a series are looked up, and kept in the cache.
    assert_eq!(s.procs.identified, vec![10, 20]);
    assert_eq!(s.procs.live_after_tick, vec![10, 20]);
    assert_eq!(snap.sample_duration.count, 1);
}

#[test]
fn a_gpu_that_fails_is_down_and_counted_while_the_others_report() {
    let mut d1 = FakeDevice::new(1, 80 * GIB, GIB);
    d1.memory = Err(lost(Operation::MEMORY_INFO));
    let gpu = FakeGpu::new(vec![FakeDevice::new(0, 80 * GIB, GIB), d1]);
    let mut s = Sampler::new(gpu, Recorder::default(), with(timing()));
    s.tick();
    let snap = s.tick();
    assert!(snap.devices[0].up());
    assert!(!snap.devices[1].up());
    assert_eq!(snap.devices[1].used_peak_bytes, None, "no fake peak");
    assert_eq!(
        snap.nvml_errors
            .get(&(Operation::MEMORY_INFO, ErrorKind::GpuLost)),
        Some(&2)
    );
    // Its processes are not queried while its memory fails.
    assert_eq!(s.gpu_mut().process_calls, 2, "GPU 0 only, twice");
    // It answers again: up, with no restart.
    s.gpu_mut().devices[1].memory = Ok(memory(80 * GIB, 2 * GIB));
    assert!(s.tick().devices[1].up());
}

#[test]
fn a_failed_process_query_leaves_the_gpu_down_for_that_sample() {
    let mut d0 = FakeDevice::new(0, 80 * GIB, GIB);
    d0.processes = Err(lost(Operation::RUNNING_COMPUTE_PROCESSES));
    let mut s = Sampler::new(FakeGpu::new(vec![d0]), Recorder::default(), with(timing()));
    let snap = s.tick();
    assert!(!snap.devices[0].up());
    assert!(snap.devices[0].processes.is_empty());
    assert_eq!(
        snap.nvml_errors
            .get(&(Operation::RUNNING_COMPUTE_PROCESSES, ErrorKind::GpuLost)),
        Some(&1)
    );
}

#[test]
fn peaks_include_memory_ticks_between_full_ticks() {
    let gpu = FakeGpu::new(vec![FakeDevice::new(0, 80 * GIB, 10 * GIB)]);
    let mut s = Sampler::new(gpu, Recorder::default(), with(timing()));
    s.tick();
    s.gpu_mut().devices[0].memory = Ok(memory(80 * GIB, 40 * GIB));
    s.tick_memory();
    s.gpu_mut().devices[0].memory = Ok(memory(80 * GIB, 12 * GIB));
    let snap = s.tick_memory();
    let d = &snap.devices[0];
    assert_eq!(d.memory.map(|m| m.used), Some(12 * GIB));
    assert_eq!(d.used_peak_bytes, Some(40 * GIB));
    assert_eq!(snap.memory_samples, 2);
    assert_eq!(
        snap.sample_duration.count, 1,
        "memory ticks are not full ones"
    );
}

#[test]
fn mig_instances_are_read_and_torch_is_asked_for_the_instance_first() {
    let mig = |uuid: &str, gi: u32| MigInfo {
        mig_uuid: uuid.into(),
        name: "MIG 3g.40gb".into(),
        gpu_instance_id: gi,
        compute_instance_id: 0,
    };
    let mut d0 = FakeDevice::new(0, 80 * GIB, 3 * GIB);
    d0.mig = vec![
        (mig("MIG-a", 1), Ok(memory(40 * GIB, 2 * GIB))),
        (mig("MIG-b", 2), Err(lost(Operation::MIG_MEMORY_INFO))),
    ];
    d0.processes = Ok(vec![
        RawProcess {
            pid: 7,
            used_bytes: Some(GIB),
            gpu_instance_id: Some(1),
            compute_instance_id: Some(0),
        },
        process(8, GIB),
    ]);
    let torch = TorchAsked::default();
    let mut s = Sampler::new(FakeGpu::new(vec![d0]), Recorder::default(), with(timing()))
        .with_bridge(Some(Box::new(torch.clone())));
    let snap = s.tick();
    let d = &snap.devices[0];
    assert_eq!(d.mig.len(), 2);
    assert_eq!(d.mig[0].memory.map(|m| m.used), Some(2 * GIB));
    assert_eq!(d.mig[1].memory, None);
    assert_eq!(
        snap.nvml_errors
            .get(&(Operation::MIG_MEMORY_INFO, ErrorKind::GpuLost)),
        Some(&1)
    );
    assert_eq!(
        torch.asked(),
        vec![
            (7, vec!["MIG-a".to_string(), "GPU-fake-0000".to_string()]),
            (8, vec!["GPU-fake-0000".to_string()]),
        ]
    );
}

fn mig(uuid: &str, gi: u32) -> MigInfo {
    MigInfo {
        mig_uuid: uuid.into(),
        name: "MIG 1g.18gb".into(),
        gpu_instance_id: gi,
        compute_instance_id: 0,
    }
}

fn on_instance(pid: u32, gi: u32) -> RawProcess {
    RawProcess {
        pid,
        used_bytes: Some(GIB),
        gpu_instance_id: Some(gi),
        compute_instance_id: Some(0),
    }
}

fn up_uuids(snap: &Snapshot) -> Vec<(String, String, bool)> {
    snap.devices
        .iter()
        .map(|d| (d.info.gpu.clone(), d.info.uuid.clone(), d.up()))
        .collect()
}

#[test]
fn healthy_then_lost_then_back_keeps_its_identity() {
    let gpu = FakeGpu::new(vec![FakeDevice::new(0, 80 * GIB, GIB)]);
    let mut s = Sampler::new(gpu, Recorder::default(), with(timing()));
    assert!(s.tick().devices[0].up());
    s.gpu_mut().devices[0].memory = Err(lost(Operation::MEMORY_INFO));
    let snap = s.tick();
    assert_eq!(
        up_uuids(&snap),
        vec![("0".into(), "GPU-fake-0000".into(), false)],
        "a lost GPU keeps its uuid on gpu_up 0"
    );
    s.gpu_mut().devices[0].memory = Ok(memory(80 * GIB, 3 * GIB));
    let snap = s.tick();
    assert_eq!(snap.devices[0].memory.map(|m| m.used), Some(3 * GIB));
    assert_eq!(s.gpu_mut().identify_calls, 1, "identity is read once");
    assert!(s.driver_gone().is_none());
}

#[test]
fn an_unknown_identity_is_retried_each_full_tick_until_known() {
    let mut d2 = FakeDevice::new(2, 80 * GIB, 7 * GIB);
    d2.identity_error = Some(lost(Operation::DEVICE_UUID));
    let gpu = FakeGpu::new(vec![
        FakeDevice::new(0, 80 * GIB, GIB),
        FakeDevice::new(1, 80 * GIB, 2 * GIB),
        d2,
    ]);
    let mut s = Sampler::new(gpu, Recorder::default(), with(timing()));
    let snap = s.tick();
    assert_eq!(
        up_uuids(&snap),
        vec![
            ("0".into(), "GPU-fake-0000".into(), true),
            ("1".into(), "GPU-fake-0001".into(), true),
            ("2".into(), String::new(), false),
        ]
    );
    assert!(!snap.devices[2].info.is_known());
    // Memory ticks do not retry identities, full ticks do.
    s.tick_memory();
    assert_eq!(s.gpu_mut().identify_calls, 3);
    let snap = s.tick();
    assert_eq!(s.gpu_mut().identify_calls, 4);
    assert_eq!(
        snap.nvml_errors
            .get(&(Operation::DEVICE_UUID, ErrorKind::GpuLost)),
        Some(&2)
    );
    assert_eq!(
        snap.nvml_errors
            .get(&(Operation::MEMORY_INFO, ErrorKind::GpuLost)),
        None,
        "no memory call on a GPU without identity"
    );
    s.gpu_mut().devices[2].identity_error = None;
    let snap = s.tick();
    assert_eq!(snap.devices[2].info.uuid, "GPU-fake-0002");
    assert_eq!(snap.devices[2].memory.map(|m| m.used), Some(7 * GIB));
    assert_eq!(s.gpu_mut().identify_calls, 5);
}

#[test]
fn mig_layouts_are_followed_two_three_then_off() {
    let mut d0 = FakeDevice::new(0, 80 * GIB, 3 * GIB);
    d0.mig = vec![
        (mig("MIG-a", 1), Ok(memory(18 * GIB, GIB))),
        (mig("MIG-b", 2), Ok(memory(18 * GIB, 0))),
    ];
    d0.processes = Ok(vec![on_instance(7, 1)]);
    let torch = TorchAsked::default();
    let mut s = Sampler::new(FakeGpu::new(vec![d0]), Recorder::default(), with(timing()))
        .with_bridge(Some(Box::new(torch.clone())));
    let snap = s.tick();
    let uuids = |snap: &Snapshot| -> Vec<String> {
        snap.devices[0]
            .mig
            .iter()
            .map(|m| m.info.mig_uuid.clone())
            .collect()
    };
    assert_eq!(uuids(&snap), vec!["MIG-a", "MIG-b"]);
    assert_eq!(s.gpu_mut().mig_layout_calls, 1);
    // A third instance with a process on it: the process names an
    // instance the layout lacks, so the layout is read in that tick.
    let d = &mut s.gpu_mut().devices[0];
    d.mig.push((mig("MIG-c", 3), Ok(memory(18 * GIB, 2 * GIB))));
    d.processes = Ok(vec![on_instance(7, 1), on_instance(8, 3)]);
    let snap = s.tick();
    assert_eq!(uuids(&snap), vec!["MIG-a", "MIG-b", "MIG-c"]);
    assert_eq!(snap.devices[0].mig[2].memory.map(|m| m.used), Some(2 * GIB));
    let pids: Vec<(u32, Option<u32>)> = snap.devices[0]
        .processes
        .iter()
        .map(|p| (p.pid, p.gpu_instance_id))
        .collect();
    assert_eq!(pids, vec![(7, Some(1)), (8, Some(3))]);
    assert_eq!(
        torch.asked().last(),
        Some(&(8, vec!["MIG-c".to_string(), "GPU-fake-0000".to_string()])),
        "torch is asked for the new instance"
    );
    assert_eq!(s.gpu_mut().mig_layout_calls, 2);
    // A steady layout is not read again before mig_rescan_interval.
    s.tick();
    assert_eq!(s.gpu_mut().mig_layout_calls, 2);
    // MIG turned off: the stale instance handles fail, the layout is
    // read again at once, and no instance is left.
    let d = &mut s.gpu_mut().devices[0];
    d.mig.clear();
    d.processes = Ok(vec![process(9, GIB)]);
    let snap = s.tick();
    assert!(snap.devices[0].mig.is_empty());
    assert!(snap.devices[0].up());
    assert_eq!(
        snap.nvml_errors
            .get(&(Operation::MIG_MEMORY_INFO, ErrorKind::InvalidArg)),
        Some(&3),
        "each stale handle failed once"
    );
    assert_eq!(s.gpu_mut().mig_layout_calls, 3);
}

#[test]
fn the_layout_is_read_again_every_rescan_interval() {
    let gpu = FakeGpu::new(vec![FakeDevice::new(0, 80 * GIB, GIB)]);
    let t = Timing {
        mig_rescan_interval: Duration::ZERO,
        ..timing()
    };
    let mut s = Sampler::new(gpu, Recorder::default(), with(t));
    s.tick();
    s.tick();
    s.tick_memory();
    s.tick();
    // Identity (1) + one rescan per later full tick (2).
    assert_eq!(s.gpu_mut().mig_layout_calls, 3);
}

#[test]
fn a_driver_gone_error_downs_every_gpu_and_a_reopen_enumerates_again() {
    let gpu = FakeGpu::new(vec![
        FakeDevice::new(0, 80 * GIB, GIB),
        FakeDevice::new(1, 80 * GIB, GIB),
    ]);
    let mut s = Sampler::new(gpu, Recorder::default(), with(timing()));
    assert!(s.tick().devices.iter().all(|d| d.up()));
    s.gpu_mut().devices[0].memory = Err(GpuError::new(
        Operation::MEMORY_INFO,
        ErrorKind::LibRmVersionMismatch,
    ));
    let snap = s.tick();
    assert!(snap.devices.iter().all(|d| !d.up()), "nothing is trusted");
    assert_eq!(
        s.driver_gone().map(|e| e.kind),
        Some(ErrorKind::LibRmVersionMismatch)
    );
    assert_eq!(
        snap.nvml_errors
            .get(&(Operation::MEMORY_INFO, ErrorKind::LibRmVersionMismatch)),
        Some(&1)
    );
    s.close_gpu();
    assert!(s.gpu_mut().closed);
    assert!(s.snapshot().devices.iter().all(|d| !d.up()));
    // The driver comes back with three GPUs, the old GPU 1 now at 0.
    let mut a = FakeDevice::new(1, 80 * GIB, 5 * GIB);
    a.info.gpu = "0".into();
    let mut b = FakeDevice::new(7, 80 * GIB, 6 * GIB);
    b.info.gpu = "1".into();
    let mut c = FakeDevice::new(8, 80 * GIB, 0);
    c.info.gpu = "2".into();
    s.count_reinit();
    s.replace_gpu(FakeGpu::new(vec![a, b, c]));
    assert!(s.driver_gone().is_none());
    let snap = s.tick();
    assert_eq!(
        up_uuids(&snap),
        vec![
            ("0".into(), "GPU-fake-0001".into(), true),
            ("1".into(), "GPU-fake-0007".into(), true),
            ("2".into(), "GPU-fake-0008".into(), true),
        ]
    );
    assert_eq!(snap.devices[0].memory.map(|m| m.used), Some(5 * GIB));
    assert_eq!(snap.nvml_reinit_attempts, 1);
    assert_eq!(
        snap.nvml_errors
            .get(&(Operation::MEMORY_INFO, ErrorKind::LibRmVersionMismatch)),
        Some(&1),
        "counters survive the re-open"
    );
}

/// The fake's collector calls so far: utilization, power_thermal, health,
/// process_utilization, xid_events.
fn collector_calls(s: &mut Sampler<FakeGpu, Recorder>) -> [u64; 5] {
    s.gpu_mut().calls_of([
        "utilization",
        "power_thermal",
        "health",
        "process_utilization",
        "xid_events",
    ])
}

fn all_on() -> Collectors {
    collectors::REGISTRY
        .iter()
        .fold(Collectors::default(), |c, d| set(c, d.name, true))
}

/// Every collector on; GPU 0 supports them all (utilisation, power,
/// remapped rows, two processes with samples for pid 7, three Xids),
/// GPU 1 none.
fn all_collectors_sampler() -> Sampler<FakeGpu, Recorder> {
    let mut d0 = FakeDevice::new(0, 80 * GIB, GIB);
    d0.scripts.set(Utilization {
        gpu: Some(93),
        memory: Some(41),
        encoder: None,
        decoder: None,
        samples: None,
    });
    d0.scripts.at::<PowerThermal>().temperature_c = Some(44);
    d0.scripts.at::<PowerThermal>().power_mw = Some(123_456);
    d0.scripts.at::<Health>().ecc_enabled = Some(true);
    d0.scripts.at::<Health>().remapped_rows = Some(RemappedRows {
        correctable: 0,
        uncorrectable: 1,
        pending: true,
        failed: false,
    });
    d0.processes = Ok(vec![process(7, GIB), process(8, GIB)]);
    let sample = |pid, ts, sm| Sample {
        pid,
        timestamp_us: ts,
        utilization: ProcessUtilization {
            sm,
            memory: 5,
            encoder: 0,
            decoder: 0,
        },
    };
    // pid 7: two samples, the later wins; pid 8: none (idle).
    d0.scripts.set(vec![sample(7, 10, 50), sample(7, 20, 90)]);
    d0.scripts.set(Xid(vec![79, 48, 79]));
    let d1 = FakeDevice::new(1, 80 * GIB, GIB); // supports nothing
    Sampler::new(
        FakeGpu::new(vec![d0, d1]),
        Recorder::default(),
        switched(all_on()),
    )
}

/// A memory-only sample carries the last full sample's readings as the
/// very same `Arc`s (every collector on, every reading there): what the
/// body cache compares to reuse the full sample's families.
#[test]
fn a_memory_only_sample_shares_the_full_samples_readings() {
    let mut s = all_collectors_sampler();
    let full = s.tick();
    let memory = s.tick_memory();
    let d = &memory.devices[0];
    assert!(d.readings.get::<Utilization>().is_some());
    assert!(d.readings.get::<crate::model::Busy>().is_some());
    for (a, b) in full.devices.iter().zip(&memory.devices) {
        assert!(a.readings.same_arcs(&b.readings), "GPU {}", a.info.gpu);
        assert!(Arc::ptr_eq(&a.processes, &b.processes));
    }
}

#[test]
fn collectors_read_what_the_gpu_supports_and_skip_the_rest() {
    let mut s = all_collectors_sampler();
    let snap = s.tick();
    let d = &snap.devices[0];
    assert_eq!(
        d.readings.get::<Utilization>().map(|u| (u.gpu, u.encoder)),
        Some((Some(93), None))
    );
    assert_eq!(
        d.readings.get::<PowerThermal>().and_then(|p| p.power_mw),
        Some(123_456)
    );
    let h = d.readings.get::<Health>().unwrap();
    assert_eq!(h.remapped_rows.map(|r| r.pending), Some(true));
    let xids: Vec<(u64, u64)> = h
        .xid_errors
        .as_ref()
        .unwrap()
        .iter()
        .map(|(k, v)| (*k, *v))
        .collect();
    assert_eq!(xids, vec![(48, 1), (79, 2)]);
    let utils: Vec<(u32, Option<u32>)> = d
        .processes
        .iter()
        .map(|p| (p.pid, p.readings.get::<ProcessUtilization>().map(|u| u.sm)))
        .collect();
    assert_eq!(utils, vec![(7, Some(90)), (8, Some(0))]);
    // GPU 1 supports none of it: no figures, no Xid family, and
    // nothing counted as an NVML error.
    let d = &snap.devices[1];
    assert_eq!(d.readings.get::<Utilization>().and_then(|u| u.gpu), None);
    assert_eq!(
        d.readings
            .get::<Health>()
            .and_then(|h| h.xid_errors.clone()),
        None
    );
    assert!(d.processes.is_empty());
    assert!(snap.nvml_errors.is_empty(), "{:?}", snap.nvml_errors);
    // 12, gpm's support query on each GPU (the in-process fake has none),
    // and process_activity's query on GPU 1.
    assert_eq!(s.errors.unsupported_logged(), 15);
}

#[test]
fn later_samples_ask_for_newer_figures_and_read_slow_ones_once() {
    let mut s = all_collectors_sampler();
    s.tick();
    // The next sample asks only for newer process samples: pid 7 idle.
    let snap = s.tick();
    assert_eq!(
        snap.devices[0].processes[0]
            .readings
            .get::<ProcessUtilization>()
            .map(|u| u.sm),
        Some(0)
    );
    assert_eq!(
        s.gpu_mut().scripts.get::<XidWatched>().map(|w| w.0.clone()),
        Some(vec![0]),
        "watched once"
    );
    assert_eq!(
        s.gpu_mut()
            .calls_of(["energy", "ecc_mode"])
            .iter()
            .sum::<u64>(),
        4,
        "energy and ECC mode once per GPU within SLOW_READ_INTERVAL"
    );
    assert_eq!(
        snap.devices[0]
            .readings
            .get::<Health>()
            .and_then(|h| h.ecc_enabled),
        Some(true),
        "the ECC mode is kept between slow reads"
    );
}

#[test]
fn switched_off_collectors_make_no_calls() {
    let gpu = FakeGpu::new(vec![FakeDevice::new(0, 80 * GIB, GIB)]);
    let off = ["processes", "utilization", "power_thermal", "health"]
        .into_iter()
        .fold(Collectors::default(), |c, name| set(c, name, false));
    // process_utilization needs processes: no calls either.
    let off = set(off, "process_utilization", true);
    let mut s = Sampler::new(gpu, Recorder::default(), switched(off));
    let snap = s.tick();
    assert!(snap.devices[0].up());
    assert_eq!(collector_calls(&mut s), [0; 5]);
    assert_eq!(s.gpu_mut().process_calls, 0);
    let d = &snap.devices[0];
    assert!(d.readings.is_empty());
    // Switched on by a reload: called from the next sample.
    s.reconfigure(switched(all_on()));
    s.tick();
    assert_eq!(collector_calls(&mut s), [1, 1, 1, 1, 1]);
    assert_eq!(s.gpu_mut().process_calls, 1);
}

#[test]
fn a_collector_call_that_fails_otherwise_is_counted_and_unsupported_is_not() {
    let mut d0 = FakeDevice::new(0, 80 * GIB, GIB);
    d0.scripts.at::<PowerThermal>().temperature_c = Some(40);
    let mut s = Sampler::new(
        FakeGpu::new(vec![d0]),
        Recorder::default(),
        switched(set(set(all_on(), "utilization", false), "health", false)),
    );
    s.tick();
    let snap = s.tick();
    assert!(snap.nvml_errors.is_empty(), "{:?}", snap.nvml_errors);
    assert_eq!(
        snap.devices[0]
            .readings
            .get::<PowerThermal>()
            .and_then(|p| p.temperature_c),
        Some(40)
    );
    s.gpu_mut().devices[0]
        .scripts
        .set(Failing(lost(TEMPERATURE)));
    let snap = s.tick();
    assert_eq!(
        snap.nvml_errors.get(&(TEMPERATURE, ErrorKind::GpuLost)),
        Some(&1)
    );
    assert_eq!(
        snap.devices[0]
            .readings
            .get::<PowerThermal>()
            .and_then(|p| p.temperature_c),
        None
    );
}

#[test]
fn a_vgpu_guest_skips_the_collectors_that_misbehave_there() {
    let mut guest = FakeDevice::new(0, 80 * GIB, GIB);
    guest.virtualization = crate::gpu::Virtualization::VgpuGuest;
    guest.scripts.set(Xid::default());
    let mut host = FakeDevice::new(1, 80 * GIB, GIB);
    host.scripts.set(Xid::default());
    let mut s = Sampler::new(
        FakeGpu::new(vec![guest, host]),
        Recorder::default(),
        switched(Collectors::default()),
    );
    let snap = s.tick();
    assert!(snap.devices.iter().all(|d| d.up()));
    // utilization, power_thermal on both GPUs; health only on the host's;
    // one Xid poll for all.
    assert_eq!(collector_calls(&mut s), [2, 2, 1, 0, 1]);
    assert!(snap.devices[0].readings.get::<Health>().is_none());
    assert!(snap.devices[1].readings.get::<Health>().is_some());
    assert!(snap.devices[0].readings.get::<PowerThermal>().is_some());
}

#[test]
fn a_unified_memory_gpu_reports_the_hosts_memory_without_nvml_errors() {
    let dir = tempfile::tempdir().unwrap();
    let meminfo = |available_kb: u64| {
        std::fs::write(
            dir.path().join("meminfo"),
            format!("MemTotal: 1000 kB\nMemFree: 10 kB\nMemAvailable: {available_kb} kB\n"),
        )
        .unwrap();
    };
    meminfo(600);
    let mut spark = FakeDevice::new(0, 0, 0);
    spark.memory = Err(crate::gpu::GpuError::new(
        Operation::MEMORY_INFO,
        ErrorKind::NotSupported,
    ));
    spark.processes = Ok(vec![process(7, GIB)]);
    let config = SamplerConfig {
        procfs: dir.path().to_path_buf(),
        cgroupfs: dir.path().to_path_buf(),
        ..switched(Collectors::default())
    };
    let mut s = Sampler::new(FakeGpu::new(vec![spark]), Recorder::default(), config);
    let snap = s.tick();
    let d = &snap.devices[0];
    assert!(d.up());
    assert_eq!(d.info.memory, crate::model::MemoryKind::Unified);
    let want = MemoryInfo {
        total: 1000 * 1024,
        reserved: None,
        used: 400 * 1024,
        free: 600 * 1024,
    };
    assert_eq!(d.memory, Some(want));
    assert_eq!(d.processes.len(), 1);
    meminfo(100);
    for _ in 0..50 {
        s.tick_memory();
    }
    let snap = s.tick();
    assert_eq!(snap.devices[0].memory.map(|m| m.used), Some(900 * 1024));
    assert_eq!(snap.devices[0].used_peak_bytes, Some(900 * 1024));
    assert!(snap.nvml_errors.is_empty(), "{:?}", snap.nvml_errors);
}

#[test]
fn an_unchanged_memory_sample_publishes_nothing_until_something_changes() {
    let gpu = FakeGpu::new(vec![
        FakeDevice::new(0, 80 * GIB, 10 * GIB),
        FakeDevice::new(1, 80 * GIB, 20 * GIB),
    ]);
    let mut s = Sampler::new(gpu, Recorder::default(), with(timing()));
    s.tick();
    assert!(s.tick_memory_if_changed().is_none(), "the same memory");
    assert!(s.tick_memory_if_changed().is_none(), "the same memory");
    // A new reading on one GPU is published, with every sample counted.
    s.gpu_mut().devices[1].memory = Ok(memory(80 * GIB, 21 * GIB));
    let changed = s.tick_memory_if_changed();
    let Some(snap) = changed else {
        panic!("a changed reading must be published");
    };
    assert_eq!(snap.devices[1].memory.map(|m| m.used), Some(21 * GIB));
    assert_eq!(snap.devices[1].used_peak_bytes, Some(21 * GIB));
    assert_eq!(snap.memory_samples, 3);
    assert!(s.tick_memory_if_changed().is_none(), "shown already");
    // Back down: the reading changes, the peak does not.
    s.gpu_mut().devices[1].memory = Ok(memory(80 * GIB, 20 * GIB));
    assert!(s.tick_memory_if_changed().is_some());
    assert!(s.tick_memory_if_changed().is_none());
    // A full sample always builds one.
    let full = s.tick();
    assert_eq!(full.memory_samples, 6, "unpublished samples are counted");
}

#[test]
fn a_down_gpu_that_keeps_failing_publishes_each_counted_error() {
    let gpu = FakeGpu::new(vec![FakeDevice::new(0, 80 * GIB, 10 * GIB)]);
    let mut s = Sampler::new(gpu, Recorder::default(), with(timing()));
    s.tick();
    s.gpu_mut().devices[0].memory = Err(lost(Operation::MEMORY_INFO));
    let first = s.tick_memory_if_changed();
    assert!(first.is_some_and(|f| !f.devices[0].up()));
    // Still down (nothing else changed), but the error count did.
    let second = s.tick_memory_if_changed();
    let errors = second.map(|s| {
        s.nvml_errors
            .get(&(Operation::MEMORY_INFO, ErrorKind::GpuLost))
            .copied()
    });
    assert_eq!(errors, Some(Some(2)));
}

#[test]
fn an_expiring_peak_or_an_old_snapshot_is_published_unchanged_memory_or_not() {
    let gpu = FakeGpu::new(vec![FakeDevice::new(0, 80 * GIB, 10 * GIB)]);
    let mut s = Sampler::new(gpu, Recorder::default(), with(timing()));
    s.tick();
    let start = Instant::now();
    s.gpu_mut().devices[0].memory = Ok(memory(80 * GIB, 30 * GIB));
    assert!(s.tick_memory_if_changed_at(start).is_some());
    s.gpu_mut().devices[0].memory = Ok(memory(80 * GIB, 10 * GIB));
    assert!(s.tick_memory_if_changed_at(start).is_some());
    assert!(s.tick_memory_if_changed_at(start).is_none());
    // The same reading a second later: published, the served sample's
    // time may not lag more.
    let later = start + UNCHANGED_REPUBLISH;
    let again = s.tick_memory_if_changed_at(later);
    assert_eq!(
        again.and_then(|s| s.devices[0].used_peak_bytes),
        Some(30 * GIB)
    );
    assert!(s.tick_memory_if_changed_at(later).is_none());
    // Once the 30 GiB leave the 30 s window the peak falls: published.
    let expired = s.tick_memory_if_changed_at(start + Duration::from_secs(31));
    assert_eq!(
        expired.and_then(|s| s.devices[0].used_peak_bytes),
        Some(10 * GIB)
    );
}

#[test]
fn an_idle_gpus_utilisation_samples_are_read_every_ten_seconds_a_busy_ones_every_sample() {
    use crate::collectors::utilization::calls::SampleScript;
    use crate::model::Busy;
    let mut d0 = FakeDevice::new(0, 80 * GIB, GIB);
    let idle = Utilization {
        gpu: Some(0),
        memory: Some(0),
        encoder: None,
        decoder: None,
        samples: None,
    };
    d0.scripts.set(idle);
    d0.scripts.set(SampleScript(vec![(1_000, 0), (2_000, 0)]));
    let mut s = Sampler::new(
        FakeGpu::new(vec![d0]),
        Recorder::default(),
        switched(set(Collectors::default(), "utilization", true)),
    );
    let reads =
        |s: &mut Sampler<FakeGpu, Recorder>| s.gpu_mut().calls_of(["utilization_samples"])[0];
    let busy = |snap: &Snapshot| {
        snap.devices[0]
            .readings
            .get::<Busy>()
            .and_then(|b| b.samples)
    };
    // The first read starts the count (from its newest sample).
    let first = s.tick();
    assert_eq!(reads(&mut s), 1);
    let counted = busy(&first);
    assert!(counted.is_some_and(|b| b.percent_us == 0));
    // Idle: not read again within 10 s; the last read is carried.
    s.gpu_mut().devices[0]
        .scripts
        .set(SampleScript(vec![(1_000, 0), (2_000, 0), (3_000, 40)]));
    let carried = s.tick();
    assert_eq!(reads(&mut s), 1);
    assert_eq!(busy(&carried), counted, "the same read, added once");
    // Busy now: read at every full sample.
    s.gpu_mut().devices[0].scripts.set(Utilization {
        gpu: Some(40),
        ..idle
    });
    let read = s.tick();
    assert_eq!(reads(&mut s), 2);
    let got = busy(&read);
    // The burst between the reads is counted at this one.
    assert!(got.is_some_and(|b| b.percent_us == 40 * 1_000));
    assert_ne!(got.map(|b| b.read), counted.map(|b| b.read));
    s.tick();
    assert_eq!(reads(&mut s), 3);
}
