//! The recorder's output read by the tools that consume it — an
//! OpenMetrics recording backfilled by promtool into a real Prometheus —
//! and the recorder beside the torch bridge's Python children, and on a
//! disk that fills up (a tmpfs, mounted as root) (`--features external-tools`).

use std::path::PathBuf;

use super::*;
use crate::harness::prom::Prometheus;
use crate::harness::python::{Py, StubState};
use crate::harness::tools::run_tool;

/// With the torch bridge, process rows carry the allocator's figures.
#[test]
fn csv_process_rows_carry_torch_figures_when_bridged() {
    const CUDA_UUID: &str = "13131313-0000-0000-0000-000000000000";
    let (allocated, reserved) = (7_000_000_003u64, 9_000_000_005u64);
    let stats = serde_json::json!({
        "allocated_bytes.all.current": allocated,
        "reserved_bytes.all.current": reserved,
        "allocated_bytes.all.peak": allocated,
        "reserved_bytes.all.peak": reserved,
        "active_bytes.all.current": allocated,
        "inactive_split_bytes.all.current": 0,
        "num_alloc_retries": 0,
        "num_ooms": 0,
    });
    let state = StubState::new(&[(CUDA_UUID, stats)]);
    let py = Py::bridge(&state, "");
    let sc = Scenario::new(&scenario(12 << 30, &[(py.pid, 10 << 30)]));
    let out_path = sc.dir.path().join("run.csv");
    // The harness's bridge sends no socket messages (GPUMEM_BRIDGE_SOCKET
    // off), so its figures come by the fd fallback, which first looks for
    // a bridge 2 s after the process is seen: record for longer than that.
    let out = run(record(
        &sc,
        &[
            "-o",
            path_str(&out_path),
            "--duration",
            "4s",
            "--sample-interval",
            "200ms",
        ],
    ));
    assert_ok(&out, "record");
    let rows = read_csv(&out_path);
    let bridged: Vec<&Row> = rows
        .iter()
        .filter(|r| r.get("kind") == "process" && !r.get("torch_allocated_bytes").is_empty())
        .collect();
    assert!(!bridged.is_empty(), "torch figures in some process row");
    for r in bridged {
        assert_eq!(r.get("pid"), py.pid_str());
        assert_eq!(r.get("process"), "python3");
        assert_eq!(r.u64("used_bytes"), 10 << 30);
        assert_eq!(r.u64("torch_allocated_bytes"), allocated);
        assert_eq!(r.u64("torch_reserved_bytes"), reserved);
    }
}

/// The blocks promtool makes from an OpenMetrics recording load into a
/// real Prometheus, which answers the recorded figures at the recorded
/// instants, before and after a scenario change.
#[test]
fn openmetrics_backfills_into_prometheus() {
    let procs = Sleepers::new(1);
    let p = procs.pid(0);
    let (before, after) = (30_000_000_017u64, 60_000_000_019u64);
    let p_used = 25_000_000_023u64;
    let sc = Scenario::new(&scenario(before, &[(p, p_used)]));
    let om = sc.dir.path().join("run.om");
    let child = record(&sc, &["-o", path_str(&om), "--duration", "2500ms"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn record");
    std::thread::sleep(Duration::from_millis(1200));
    sc.write(&scenario(after, &[(p, p_used)]));
    let out = wait_output(child, Duration::from_secs(30));
    assert_ok(&out, "record");
    let text = std::fs::read_to_string(&om).unwrap();
    assert!(text.ends_with("# EOF\n"), "ends with # EOF");
    assert_eq!(text.matches("# EOF").count(), 1);

    // The recorded (timestamp, value) of GPU 0's used bytes.
    let used: Vec<(f64, u64)> = text
        .lines()
        .filter(|l| l.starts_with("gpu_memory_used_bytes{"))
        .map(|l| {
            let mut it = l.rsplitn(3, ' ');
            let ts: f64 = it.next().unwrap().parse().unwrap();
            let v: u64 = it.next().unwrap().parse().unwrap();
            (ts, v)
        })
        .collect();
    assert!(
        used.len() >= 15,
        "{} samples of gpu_memory_used_bytes",
        used.len()
    );
    let at_before = used
        .iter()
        .find(|(_, v)| *v == before)
        .expect("old figure")
        .0;
    let at_after = used
        .iter()
        .rev()
        .find(|(_, v)| *v == after)
        .expect("new figure")
        .0;
    let process_at = text
        .lines()
        .find(|l| l.starts_with("gpu_process_memory_used_bytes{"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|t| t.parse::<f64>().ok())
        .expect("a process sample");

    let data = sc.dir.path().join("data");
    let made = run_tool(
        "promtool",
        &[
            "tsdb",
            "create-blocks-from",
            "openmetrics",
            path_str(&om),
            path_str(&data),
        ],
        None,
    );
    assert!(made.status.success(), "promtool: {}", output_text(&made));
    let prom = Prometheus::start_with(
        "global:\n  scrape_interval: 15s\n",
        Some(&data),
        &["--storage.tsdb.retention.time=10y"],
    );
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let host = host.trim();
    let sel = format!(
        "gpu_memory_used_bytes{{instance=\"{host}\",job=\"gpumem-record\",gpu=\"0\",uuid=\"{UUID}\"}}"
    );
    // Blocks load at startup; the head is empty, so only they answer.
    for (at, want) in [(at_before, before), (at_after, after)] {
        let q = prom.query_at(&sel, at);
        assert!(q.ok(), "{:?}\n{}", q.error, prom.log());
        assert_eq!(
            q.values(),
            vec![want as f64],
            "at {at}: {:?}\n{}",
            q.result,
            prom.log()
        );
    }
    let q = prom.query_at(
        &format!("gpu_process_memory_used_bytes{{pid=\"{p}\"}}"),
        process_at,
    );
    assert_eq!(q.values(), vec![p_used as f64], "{:?}", q.result);
    assert_eq!(q.labels()[0]["process"], "sleep");
    let q = prom.query_at("gpu_up", at_before);
    assert_eq!(q.values(), vec![1.0]);
    // The dashboard's instance variable, and one of its joins on it.
    let q = prom.query_at("count by (instance) (gpu_info)", at_after);
    assert_eq!(q.labels()[0]["instance"], host, "{:?}", q.result);
    let q = prom.query_at(
        &format!(
            "gpu_info{{instance=~\"{host}\", gpu=~\".*\"}} * on(instance, gpu, uuid) group_left() gpu_memory_total_bytes{{instance=~\"{host}\", gpu=~\".*\"}}"
        ),
        at_after,
    );
    assert_eq!(q.values(), vec![TOTAL as f64], "{:?}", q.result);
    // The recorder's own families are not in the recording.
    let q = prom.query_at("count({__name__=~\"gpumem_exporter_.*\"})", at_after);
    assert!(q.result.is_empty(), "{:?}", q.result);
}

/// A tmpfs of 16 KiB, mounted for the test and unmounted after it.
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    fn mount() -> SmallDisk {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=16k", "tmpfs"])
            .arg(dir.path())
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "this test mounts a 16 KiB tmpfs to fill it, which needs root (as on the project's machines and CI): {}",
            output_text(&out)
        );
        SmallDisk { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

/// A disk that fills up mid-recording (ENOSPC): one line, exit 1, and the
/// file is a complete document of every sample before: CSV rows whole,
/// the trace valid JSON, the OpenMetrics ending in `# EOF` and accepted
/// by promtool.
#[test]
fn a_full_disk_keeps_a_complete_file() {
    let disk = SmallDisk::mount();
    let sc = Scenario::new(&scenario(1 << 30, &[]));
    for name in ["run.csv", "run.json", "run.om"] {
        let path = disk.path(name);
        let out = run(record(
            &sc,
            &[
                "-o",
                path_str(&path),
                "--duration",
                "60s",
                "--memory-sample-interval",
                "10ms",
            ],
        ));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {err}");
        // One line for the failure; then `record`'s summary (docs/record.md:
        // "gpumem-exporter record: …", its indented lines, and on a full
        // disk the one line saying the summary file could not be written).
        let own: Vec<&str> = err
            .lines()
            .filter(|l| {
                !l.starts_with("gpumem-exporter record: ")
                    && !l.starts_with("  ")
                    && !l.starts_with("gpumem-exporter: cannot write the summary ")
            })
            .collect();
        assert_eq!(own.len(), 1, "{name}: one line: {err}");
        assert!(
            err.contains("ended: writer_ended"),
            "{name}: the summary says why it ended: {err}"
        );
        assert!(
            err.contains("No space left on device") && err.contains("as a complete document"),
            "{name}: {err}"
        );
        let size = std::fs::metadata(&path).unwrap().len();
        assert!(size > 8 << 10, "{name}: {size} bytes kept");
        match name {
            "run.csv" => {
                let text = std::fs::read_to_string(&path).unwrap();
                assert!(text.ends_with('\n'), "whole rows");
                let rows = read_csv(&path);
                assert!(rows.len() > 20, "{} rows", rows.len());
                assert!(
                    rows.iter()
                        .all(|r| r.0.len() == COLUMNS.len() && r.u64("used_bytes") == 1 << 30)
                );
            }
            "run.json" => {
                let ev = read_trace(&path);
                assert!(events(&ev, "C", "memory", GPU0_TRACK).len() > 20);
            }
            _ => {
                let text = std::fs::read_to_string(&path).unwrap();
                assert!(text.ends_with("\n# EOF\n"), "ends with # EOF");
                let data = sc.dir.path().join("data");
                let made = run_tool(
                    "promtool",
                    &[
                        "tsdb",
                        "create-blocks-from",
                        "openmetrics",
                        path_str(&path),
                        path_str(&data),
                    ],
                    None,
                );
                assert!(made.status.success(), "promtool: {}", output_text(&made));
            }
        }
        std::fs::remove_file(&path).unwrap();
    }
}

/// The summary's torch fields with the bridge: the peak allocated and
/// the peak reserved are the largest the bridge reported over the
/// recording (its figures change half-way: the peaks rise, the current
/// figures fall), the cache's share is (reserved − allocated) / reserved
/// of those peaks, and the OOMs the bridge's count; on stderr and in the
/// JSON.
#[test]
fn the_summary_carries_torch_peaks_and_ooms_when_bridged() {
    const CUDA_UUID: &str = "13131313-0000-0000-0000-000000000000";
    let stats = |alloc: u64, reserved: u64, alloc_peak: u64, reserved_peak: u64, ooms: u64| {
        serde_json::json!({
            "allocated_bytes.all.current": alloc,
            "reserved_bytes.all.current": reserved,
            "allocated_bytes.all.peak": alloc_peak,
            "reserved_bytes.all.peak": reserved_peak,
            "active_bytes.all.current": alloc,
            "inactive_split_bytes.all.current": 0,
            "num_alloc_retries": 1,
            "num_ooms": ooms,
        })
    };
    let gib = 1u64 << 30;
    let state = StubState::new(&[(CUDA_UUID, stats(3 * gib, 5 * gib, 4 * gib, 6 * gib, 1))]);
    let py = Py::bridge(&state, "");
    let sc = Scenario::new(&scenario(12 << 30, &[(py.pid, 10 << 30)]));
    let out_path = sc.dir.path().join("run.csv");
    let child = record(
        &sc,
        &[
            "-o",
            path_str(&out_path),
            "--duration",
            "7s",
            "--sample-interval",
            "200ms",
        ],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .expect("record");
    // The fd fallback first looks 2 s after the process is seen: change
    // the figures once the first ones are in the recording.
    wait_for(Duration::from_secs(6), "the first torch figures", || {
        read_csv_if_any(&out_path)
            .iter()
            .any(|r| {
                r.get("kind") == "process"
                    && r.get("torch_allocated_bytes") == (3 * gib).to_string()
            })
            .then_some(())
    });
    state.write(&[(CUDA_UUID, stats(2 * gib, 8 * gib, 7 * gib, 9 * gib, 3))]);
    let out = wait_output(child, Duration::from_secs(20));
    assert_ok(&out, "record");
    let rows = read_csv(&out_path);
    assert!(
        rows.iter().any(|r| r.get("kind") == "process"
            && r.get("torch_allocated_bytes") == (2 * gib).to_string()),
        "the second figures recorded too"
    );
    let json = std::fs::read_to_string(sc.dir.path().join("run.csv.summary.json"))
        .expect("the summary beside the recording");
    let v: Value = serde_json::from_str(&json).expect("summary JSON");
    let procs = v["processes"].as_array().cloned().unwrap_or_default();
    assert_eq!(procs.len(), 1, "{json}");
    let p = &procs[0];
    assert_eq!(p["pid"], py.pid, "{json}");
    assert_eq!(p["torch_peak_allocated_bytes"], 7 * gib, "{json}");
    assert_eq!(p["torch_peak_reserved_bytes"], 9 * gib, "{json}");
    assert_eq!(p["torch_cache_share"], 2.0 / 9.0, "{json}");
    assert_eq!(p["torch_ooms"], 3, "{json}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("torch peak allocated 7168.0 MiB of peak reserved 9216.0 MiB, 3 OOMs"),
        "{stderr}"
    );
}

/// The complete rows of a CSV recording still being written (none yet:
/// nothing).
fn read_csv_if_any(path: &std::path::Path) -> Vec<Row> {
    let Ok(mut r) = csv::ReaderBuilder::new()
        .has_headers(true)
        .flexible(true)
        .from_path(path)
    else {
        return Vec::new();
    };
    r.records()
        .filter_map(Result::ok)
        .filter(|rec| rec.len() == COLUMNS.len())
        .map(|rec| Row(rec.iter().map(str::to_string).collect()))
        .collect()
}
