//! The encoders on snapshots from the real [`crate::sample::Sampler`] over
//! the in-process fake GPU.

use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use super::format::{Classifier, Encoder, SampleKind, Stamp};
use super::*;
use crate::attribute::ProcessLookup;
use crate::config::{SamplerConfig, Timing};
use crate::gpu::GpuError;
use crate::gpu::fake::{FakeDevice, FakeGpu, process};
use crate::model::Snapshot;
use crate::model::{ProcIdentity, TorchStats, TorchSteps};
use crate::sample::Sampler;

const GIB: u64 = 1 << 30;

/// Names pid n "p,n" (a comma, to check quoting); torch figures for
/// pid 7; pid 9 a zombie.
struct Names;
impl ProcessLookup for Names {
    fn identify(&mut self, pid: u32) -> Arc<ProcIdentity> {
        Arc::new(ProcIdentity {
            comm: Arc::from(format!("p,{pid}")),
            user: Arc::from("alice"),
            ..ProcIdentity::default()
        })
    }
    fn retain(&mut self, _live: &dyn Fn(u32) -> bool) {}
    fn seen(&self, pid: u32) -> crate::attribute::Seen {
        crate::attribute::Seen {
            start: Some(0),
            stale: (pid == 9).then_some(crate::model::Stale {
                reason: crate::model::StaleReason::Zombie,
                since: UNIX_EPOCH,
            }),
        }
    }
}

/// The bridge's stand-in: torch figures for pid 7.
struct Torch7;
impl crate::bridge::Figures for Torch7 {
    fn end_tick(&mut self, _live: &dyn Fn(u32) -> bool) {}
    fn stats(&mut self, pid: u32, _start: u64, _uuids: &[&str]) -> Option<TorchStats> {
        (pid == 7).then_some(TorchStats {
            allocated: 3 * GIB,
            reserved: 4 * GIB,
            // 40 steps of which the last 16, 2 MiB apart, are the window.
            steps: Some(TorchSteps {
                total: 40,
                allocated: Some(3 * GIB),
                growth: crate::trend::slope(&[(0, 0), (1, 2 << 20)]),
                pace: Some((15, 1500)),
                window: 16,
            }),
            ..TorchStats::default()
        })
    }
}

fn sampler() -> Sampler<FakeGpu, Names> {
    let mut d = FakeDevice::new(0, 80 * GIB, 10 * GIB);
    d.processes = Ok(vec![process(7, 6 * GIB), process(9, GIB)]);
    let t = Timing {
        sample_interval: Duration::from_secs(1),
        memory_sample_interval: Duration::from_millis(100),
        peak_window: Duration::from_secs(30),
        mig_rescan_interval: Duration::from_secs(30),
        limits_interval: Duration::from_secs(30),
    };
    let config = SamplerConfig {
        timing: t,
        selection: Default::default(),
        collectors: Default::default(),
        procfs: "/proc".into(),
        cgroupfs: "/sys/fs/cgroup".into(),
    };
    Sampler::new(FakeGpu::new(vec![d]), Names, config).with_bridge(Some(Box::new(Torch7)))
}

/// Encode each snapshot as the writer does; the text of each sample.
fn encode_all(enc: &mut dyn Encoder, snaps: &[Snapshot]) -> Vec<String> {
    let mut kinds = Classifier::default();
    snaps
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let s = Arc::new(s.clone());
            // Distinct, increasing times whatever the clock did.
            let at = Stamp::new(UNIX_EPOCH + Duration::from_millis(1_000_000 + 100 * i as u64));
            let mut out = Vec::new();
            enc.sample(&s, kinds.next(&s), &at, &mut out).unwrap();
            String::from_utf8(out).unwrap()
        })
        .collect()
}

#[test]
fn memory_and_full_samples_are_told_apart() {
    let mut s = sampler();
    let mut c = Classifier::default();
    assert_eq!(c.next(&s.tick()), SampleKind::Full);
    assert_eq!(c.next(&s.tick_memory()), SampleKind::Memory);
    assert_eq!(c.next(&s.tick_memory()), SampleKind::Memory);
    assert_eq!(c.next(&s.tick()), SampleKind::Full);
    // Published while NVML is closed: no tick at all.
    assert_eq!(c.next(&s.snapshot()), SampleKind::Full);
}

#[test]
fn csv_writes_process_rows_at_full_samples_only_and_quotes_names() {
    let mut s = sampler();
    let snaps = [s.tick(), s.tick_memory()];
    let mut enc = csv::Csv::default();
    let header = String::from_utf8(enc.header().unwrap()).unwrap();
    assert_eq!(header, csv::COLUMNS.join(",") + "\n");
    let text = encode_all(&mut enc, &snaps);
    let u = "GPU-fake-0000";
    let free = 80 * GIB - 10 * GIB;
    let reserved = 0;
    // 10 GiB used, 7 GiB listed: 3 GiB unattributed; pid 9's 1 GiB held
    // by a zombie (exited, zombie, uninterruptible, reparented,
    // owner_deleted), at every gpu row since that full sample.
    let held = format!("{},0,{},0,0,0", 3 * GIB, GIB);
    let full = format!(
        // used_byte_seconds and busy_seconds are the ledger's: this
        // snapshot went through no ledger, so the GPU row has none and
        // each process row the 0 of a process not yet counted.
        "1970-01-01T00:16:40.000Z,1000.000,gpu,0,{u},{},{reserved},{free},{},,,,,,,,,,,,,,,{held}\n\
         1970-01-01T00:16:40.000Z,1000.000,process,0,{u},{},,,,7,\"p,7\",alice,,,{},{},,,40,{},2097152,0,,,,,,,\n\
         1970-01-01T00:16:40.000Z,1000.000,process,0,{u},{},,,,9,\"p,9\",alice,,,,,,,,,,0,,,,,,,\n",
        10 * GIB,
        80 * GIB,
        6 * GIB,
        3 * GIB,
        4 * GIB,
        3 * GIB,
        GIB
    );
    assert_eq!(text[0], full);
    assert_eq!(
        text[1],
        format!(
            "1970-01-01T00:16:40.100Z,1000.100,gpu,0,{u},{},{reserved},{free},{},,,,,,,,,,,,,,,{held}\n",
            10 * GIB,
            80 * GIB
        )
    );
}

#[test]
fn openmetrics_stamps_every_sample_and_helps_once() {
    let mut s = sampler();
    let snaps = [s.tick(), s.tick_memory(), s.tick()];
    let mut enc = openmetrics::OpenMetrics::new("host \"a\"");
    let text = encode_all(&mut enc, &snaps);
    let target = r#"{instance="host \"a\"",job="gpumem-record""#;
    assert!(
        text[0].contains(&format!("\ngpu_up{target},gpu=\"0\",")),
        "{}",
        text[0]
    );
    assert!(
        text[0].contains(&format!("\ngpu_driver_info{target},driver_version=")),
        "{}",
        text[0]
    );
    for (block, ts) in text.iter().zip(["1000.000", "1000.100", "1000.200"]) {
        assert!(!block.contains("# EOF"));
        for line in block.lines().filter(|l| !l.starts_with('#')) {
            assert!(line.ends_with(&format!(" {ts}")), "{line}");
            assert!(line.contains(target), "{line}");
        }
        assert!(block.contains("# TYPE gpu_memory_used_bytes gauge\n"));
        assert!(!block.contains("gpumem_exporter_"), "no exporter families");
    }
    assert!(text[0].contains("# HELP gpu_memory_used_bytes "));
    assert!(!text[2].contains("# HELP"), "HELP once per family");
    assert!(text[0].contains("gpu_process_memory_used_bytes{"));
    assert!(
        !text[1].contains("gpu_process"),
        "a memory sample: GPU families only"
    );
    assert!(text[2].contains("gpu_process_memory_used_bytes{"));
    // A clock that does not move forward: the sample is left out.
    let snap = Arc::new(s.tick_memory());
    let at = Stamp::new(UNIX_EPOCH + Duration::from_millis(1_000_200));
    let mut out = Vec::new();
    assert_eq!(
        enc.sample(&snap, SampleKind::Memory, &at, &mut out)
            .unwrap(),
        0
    );
    assert!(out.is_empty());
    assert_eq!(enc.skipped, 1);
}

fn events(text: &str) -> Vec<serde_json::Value> {
    text.split(",\n")
        .filter(|e| !e.is_empty())
        .map(|e| serde_json::from_str(e.trim_start_matches('\n')).unwrap())
        .collect()
}

#[test]
fn trace_drops_a_process_that_left_to_0_but_not_one_on_a_gpu_down() {
    let mut s = sampler();
    let first = s.tick();
    s.gpu_mut().devices[0].processes = Ok(vec![process(7, 6 * GIB)]);
    let left = s.tick();
    s.gpu_mut().devices[0].memory = Err(GpuError::new(
        crate::gpu::Operation::MEMORY_INFO,
        crate::gpu::ErrorKind::GpuLost,
    ));
    let down = s.tick();
    let down_again = s.tick();
    let start = Stamp::new(UNIX_EPOCH);
    let mut enc = trace::Trace::new(&start);
    let text = encode_all(&mut enc, &[first, left, down, down_again]);
    let all: Vec<serde_json::Value> = text.iter().flat_map(|t| events(t)).collect();
    let of = |name: &str, pid: u64| -> Vec<&serde_json::Value> {
        all.iter()
            .filter(|e| e["name"] == name && e["pid"] == pid)
            .collect()
    };
    let gone = of("gpu 0 used", 9);
    assert_eq!(gone.len(), 2);
    assert_eq!(gone[0]["args"]["bytes"], GIB);
    assert_eq!(gone[1]["args"]["bytes"], 0);
    let stays = of("gpu 0 used", 7);
    assert_eq!(stays.len(), 2, "nothing made up while the GPU is down");
    assert_eq!(of("gpu 0 torch allocated", 7)[0]["args"]["bytes"], 3 * GIB);
    assert_eq!(of("gpu 0 torch reserved", 7)[0]["args"]["bytes"], 4 * GIB);
    assert_eq!(of("process_name", 7)[0]["args"]["name"], "p,7 (alice)");
    let down = of("GPU not answering", trace::GPU_PID_BASE);
    assert_eq!(down.len(), 1, "said once");
    assert_eq!(down[0]["ph"], "i");
    assert_eq!(of("memory", trace::GPU_PID_BASE).len(), 2);
    // Used minus the listed, and pid 9's GiB held by a zombie; then pid 9
    // gone: 4 GiB unattributed, nothing stale; nothing while down.
    let held = of("unattributed and stale", trace::GPU_PID_BASE);
    let args: Vec<&serde_json::Value> = held.iter().map(|e| &e["args"]).collect();
    let zero = |unattributed: u64, zombie: u64| {
        serde_json::json!({
            "unattributed_bytes": unattributed,
            "stale_exited_bytes": 0, "stale_zombie_bytes": zombie,
            "stale_uninterruptible_bytes": 0, "stale_reparented_bytes": 0,
            "stale_owner_deleted_bytes": 0,
        })
    };
    assert_eq!(args, [&zero(3 * GIB, GIB), &zero(4 * GIB, 0)]);
    assert_eq!(held[0]["ph"], "C");
}
