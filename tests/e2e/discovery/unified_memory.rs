//! A unified-memory GPU (DGX Spark / GB10): NVML answers NOT_SUPPORTED for
//! memory info, and the exporter serves the host's memory from the fake
//! /proc root's meminfo instead — exact bytes, a change of MemAvailable
//! followed, no NVML error over 50 memory samples, `gpu_up 1`, the GPU
//! marked on `gpu_info`, reserved absent, processes as NVML lists them.

use std::time::Duration;

use crate::harness::*;

pub(crate) const GB10: &str = "GPU-9b100000-0000-0000-0000-000000000000";
pub(crate) const H200: &str = "GPU-9b100000-0000-0000-0000-000000000001";

/// A GB10-like GPU (memory NOT_SUPPORTED, a process, utilisation) beside
/// an H200 with device memory.
pub(crate) fn scenario() -> String {
    format!(
        "devices:
  - uuid: {GB10}
    name: NVIDIA GB10
    unified_memory: true
    processes: [{{pid: 4400001, used: 3221225472}}]
    utilization: {{gpu: 55, memory: 0}}
  - uuid: {H200}
    memory: {{total: 150754820096, reserved: 644939776, used: 1000}}
"
    )
}

/// A /proc/meminfo as a 128 GB DGX Spark writes it (kB = KiB).
pub(crate) fn meminfo(total_kb: u64, available_kb: u64) -> String {
    format!(
        "MemTotal:       {total_kb:>9} kB\n\
         MemFree:        {:>9} kB\n\
         MemAvailable:   {available_kb:>9} kB\n\
         Buffers:            10240 kB\n\
         Cached:          20480000 kB\n\
         SwapTotal:              0 kB\n",
        available_kb / 2
    )
}

/// Write `<dir>/proc/meminfo` atomically; returns the /proc root.
pub(crate) fn write_meminfo(sc: &Scenario, text: &str) -> String {
    let root = sc.dir.path().join("proc");
    std::fs::create_dir_all(&root).unwrap();
    let tmp = root.join("meminfo.tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, root.join("meminfo")).unwrap();
    root.to_str().unwrap().to_string()
}

const TOTAL_KB: u64 = 128_452_000;

#[test]
fn host_memory_is_served_for_a_unified_memory_gpu_without_nvml_errors() {
    let sc = Scenario::new(&scenario());
    let root = write_meminfo(&sc, &meminfo(TOTAL_KB, 112_233_444));
    let ex = Exporter::start(
        &sc,
        &[
            "--sample-interval",
            "200ms",
            "--memory-sample-interval",
            "20ms",
            "--path.procfs",
            &root,
        ],
    );
    let gb10 = [("gpu", "0"), ("uuid", GB10)];
    let m = wait_for(Duration::from_secs(10), "50 memory samples", || {
        let m = ex.metrics();
        (m.get_u64("gpumem_exporter_memory_samples_total", &[]) >= Some(50)).then_some(m)
    });
    let (total, available) = (TOTAL_KB * 1024, 112_233_444 * 1024);
    assert_eq!(m.get_u64("gpu_memory_total_bytes", &gb10), Some(total));
    assert_eq!(m.get_u64("gpu_memory_free_bytes", &gb10), Some(available));
    assert_eq!(
        m.get_u64("gpu_memory_used_bytes", &gb10),
        Some(total - available)
    );
    assert_eq!(
        m.get_u64("gpu_memory_used_peak_bytes", &gb10),
        Some(total - available)
    );
    assert!(
        m.find("gpu_memory_reserved_bytes", &gb10).is_empty(),
        "reserved is absent, never a fake 0:\n{}",
        m.text
    );
    assert_eq!(m.get("gpu_up", &gb10), Some(1.0));
    assert_eq!(
        m.get(
            "gpu_info",
            &[
                ("gpu", "0"),
                ("uuid", GB10),
                ("name", "NVIDIA GB10"),
                ("pci_bus_id", "00000000:01:00.0"),
                ("memory", "unified"),
            ]
        ),
        Some(1.0),
        "{}",
        m.text
    );
    // The H200 beside it: device memory, no memory label.
    let info = m.find("gpu_info", &[("uuid", H200)]);
    assert_eq!(info.len(), 1);
    assert!(!info[0].0.contains_key("memory"), "{info:?}");
    assert_eq!(
        m.get_u64("gpu_memory_reserved_bytes", &[("gpu", "1"), ("uuid", H200)]),
        Some(644_939_776)
    );
    // Per-process figures as NVML has them, and the utilisation.
    let procs = m.find("gpu_process_memory_used_bytes", &gb10);
    assert_eq!(procs.len(), 1, "{procs:?}");
    assert_eq!(procs[0].0["pid"], "4400001");
    assert_eq!(procs[0].1, 3_221_225_472.0);
    assert_eq!(m.get("gpu_utilization_ratio", &gb10), Some(0.55));
    // No NVML error over those 50+ memory samples, and one log line.
    assert!(
        m.find("gpumem_exporter_nvml_errors_total", &[]).is_empty(),
        "{}",
        m.text
    );
    ex.assert_logged_once("unified memory, shared with the host");

    // MemAvailable falls by 20 GiB: used follows, and so does the peak.
    let available2 = 91_262_564;
    write_meminfo(&sc, &meminfo(TOTAL_KB, available2));
    let m = wait_for(Duration::from_secs(5), "the new MemAvailable", || {
        let m = ex.metrics();
        (m.get_u64("gpu_memory_free_bytes", &gb10) == Some(available2 * 1024)).then_some(m)
    });
    let used2 = total - available2 * 1024;
    assert_eq!(m.get_u64("gpu_memory_used_bytes", &gb10), Some(used2));
    assert_eq!(m.get_u64("gpu_memory_used_peak_bytes", &gb10), Some(used2));
    assert_eq!(m.get_u64("gpu_memory_total_bytes", &gb10), Some(total));
    assert!(m.find("gpumem_exporter_nvml_errors_total", &[]).is_empty());

    // The JSON API (and so the page) says what this memory is.
    let r = ex.get("/api/v1/snapshot");
    assert_eq!(r.status, 200);
    let doc: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    let g = &doc["gpus"][0];
    assert_eq!(g["memory_kind"], "unified", "{g}");
    assert_eq!(g["memory_note"], "unified memory, shared with the host");
    assert_eq!(g["memory"]["reserved_bytes"], serde_json::Value::Null);
    assert_eq!(g["memory"]["used_bytes"], used2);
    assert_eq!(g["memory"]["total_bytes"], total);
    let h = &doc["gpus"][1];
    assert!(h.get("memory_kind").is_none(), "{h}");
    assert_eq!(h["memory"]["reserved_bytes"], 644_939_776);
}

#[test]
fn a_unified_memory_gpu_whose_meminfo_is_unreadable_is_down_and_uncounted() {
    let sc = Scenario::new(&scenario());
    let root = sc.dir.path().join("empty-proc");
    std::fs::create_dir_all(&root).unwrap();
    let ex = Exporter::start(
        &sc,
        &[
            "--sample-interval",
            "200ms",
            "--path.procfs",
            root.to_str().unwrap(),
        ],
    );
    let gb10 = [("gpu", "0"), ("uuid", GB10)];
    let m = wait_for(Duration::from_secs(5), "both GPUs sampled", || {
        let m = ex.metrics();
        (m.get("gpu_up", &[("gpu", "1"), ("uuid", H200)]) == Some(1.0)).then_some(m)
    });
    assert_eq!(m.get("gpu_up", &gb10), Some(0.0));
    assert!(m.find("gpu_memory_used_bytes", &gb10).is_empty());
    assert!(m.find("gpumem_exporter_nvml_errors_total", &[]).is_empty());
    std::thread::sleep(Duration::from_millis(500));
    ex.assert_logged_once("host memory cannot be read");
    // meminfo appears: the GPU is up with the host's figures.
    std::fs::write(root.join("meminfo"), meminfo(1000, 250)).unwrap();
    wait_for(Duration::from_secs(5), "meminfo read", || {
        let m = ex.metrics();
        (m.get_u64("gpu_memory_used_bytes", &gb10) == Some(750 * 1024)).then_some(())
    });
}
