//! End-to-end `gpumem-exporter record`: the real binary on the fake NVML
//! writes CSV, Chrome trace and OpenMetrics files; the tests read them back
//! (the csv crate, serde_json, promtool and a real Prometheus on the
//! backfilled blocks), change the scenario while it records, signal it, run
//! commands under it, and give it bad input (existing files, directories,
//! /dev/full, a full tmpfs, unknown formats, bad durations, commands that
//! do not exist).

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::harness::*;

#[cfg(feature = "external-tools")]
mod external;
#[cfg(feature = "external-tools")]
mod strict;

const UUID: &str = "GPU-13131313-0000-0000-0000-000000000000";
const TOTAL: u64 = 150_754_820_096;
const RESERVED: u64 = 644_939_776;
/// The trace pid of GPU 0 (docs/record.md).
const GPU0_TRACK: u64 = 4_194_304;

const COLUMNS: [&str; 29] = [
    "time",
    "unix_seconds",
    "kind",
    "gpu",
    "uuid",
    "used_bytes",
    "reserved_bytes",
    "free_bytes",
    "total_bytes",
    "pid",
    "process",
    "user",
    "namespace",
    "pod",
    "torch_allocated_bytes",
    "torch_reserved_bytes",
    "container",
    "resource",
    "torch_steps",
    "torch_step_allocated_bytes",
    "torch_step_growth_bytes",
    "used_byte_seconds",
    "busy_seconds",
    "unattributed_bytes",
    "stale_exited_bytes",
    "stale_zombie_bytes",
    "stale_uninterruptible_bytes",
    "stale_reparented_bytes",
    "stale_owner_deleted_bytes",
];

/// The stale columns, one per reason.
const STALE_COLUMNS: [&str; 5] = [
    "stale_exited_bytes",
    "stale_zombie_bytes",
    "stale_uninterruptible_bytes",
    "stale_reparented_bytes",
    "stale_owner_deleted_bytes",
];

/// One GPU using `used`, with these (pid, bytes) on it.
fn scenario(used: u64, procs: &[(u32, u64)]) -> String {
    let mut y = format!(
        "devices:\n  - uuid: {UUID}\n    memory: {{total: {TOTAL}, reserved: {RESERVED}, used: {used}}}\n"
    );
    if procs.is_empty() {
        y.push_str("    processes: []\n");
    } else {
        y.push_str("    processes:\n");
        for (pid, b) in procs {
            y.push_str(&format!("      - {{pid: {pid}, used: {b}}}\n"));
        }
    }
    y
}

/// `gpumem-exporter record` on the fake NVML with `scenario`, logging
/// warnings and errors only, then `args`.
fn record(sc: &Scenario, args: &[&str]) -> Command {
    record_logging(sc, "warn", args)
}

fn record_logging(sc: &Scenario, level: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.arg("record")
        .arg("--nvml.library")
        .arg(fake_nvml())
        .args(["--log.level", level])
        .args(args)
        .env("FAKE_NVML_CONFIG", &sc.path)
        .stdin(Stdio::null());
    cmd
}

/// Run to the end, with a time limit.
fn run(mut cmd: Command) -> Output {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = cmd.spawn().expect("spawn gpumem-exporter record");
    wait_output(child, Duration::from_secs(60))
}

fn wait_output(mut child: Child, limit: Duration) -> Output {
    let t = Instant::now();
    while child.try_wait().expect("try_wait").is_none() {
        if t.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("wait");
            panic!("record did not end in {limit:?}: {}", output_text(&out));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("wait")
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// Real processes for the fake NVML to list: /proc has them, so the rows
/// carry their name and user. Killed on drop.
struct Sleepers(Vec<Child>);

impl Sleepers {
    fn new(n: usize) -> Sleepers {
        Sleepers(
            (0..n)
                .map(|_| {
                    Command::new("sleep")
                        .arg("120")
                        .spawn()
                        .expect("spawn sleep")
                })
                .collect(),
        )
    }

    fn pid(&self, i: usize) -> u32 {
        self.0[i].id()
    }
}

impl Drop for Sleepers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// One CSV row by column name.
struct Row(Vec<String>);

impl Row {
    fn get(&self, column: &str) -> &str {
        let i = COLUMNS
            .iter()
            .position(|c| *c == column)
            .expect("known column");
        &self.0[i]
    }

    fn u64(&self, column: &str) -> u64 {
        self.get(column)
            .parse()
            .unwrap_or_else(|_| panic!("{column} of {:?}", self.0))
    }

    /// Milliseconds since the epoch, from `unix_seconds`, checked against
    /// `time` (RFC 3339 with milliseconds).
    fn ms(&self) -> u64 {
        let unix = self.get("unix_seconds");
        let (s, frac) = unix.split_once('.').expect("unix_seconds has a fraction");
        assert_eq!(frac.len(), 3, "milliseconds: {unix}");
        let ms = s.parse::<u64>().unwrap() * 1000 + frac.parse::<u64>().unwrap();
        let time = self.get("time");
        assert!(
            time.len() == 24 && time.ends_with('Z'),
            "RFC 3339 UTC with ms: {time}"
        );
        let t = humantime::parse_rfc3339(time).expect("RFC 3339");
        assert_eq!(
            t.duration_since(UNIX_EPOCH).unwrap().as_millis() as u64,
            ms,
            "{time} is {unix}"
        );
        ms
    }
}

/// Every row of a CSV recording, the header checked.
fn read_csv(path: &Path) -> Vec<Row> {
    let mut r = csv::ReaderBuilder::new()
        .has_headers(true)
        .from_path(path)
        .expect("open csv");
    let header: Vec<String> = r
        .headers()
        .expect("header")
        .iter()
        .map(str::to_string)
        .collect();
    assert_eq!(header, COLUMNS, "header of {}", path.display());
    r.records()
        .map(|rec| {
            Row(rec
                .expect("a whole row")
                .iter()
                .map(str::to_string)
                .collect())
        })
        .collect()
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn assert_ok(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {}\n{}",
        out.status,
        output_text(out)
    );
}

/// Every figure of the scenario, to the byte, in its column; a row per GPU
/// per memory sample and a row per process per full sample.
#[test]
fn csv_rows_are_the_scenarios_bytes() {
    let procs = Sleepers::new(2);
    let (a, b) = (procs.pid(0), procs.pid(1));
    let (used, a_used, b_used) = (73_000_000_123, 40_000_000_007, 30_000_000_011);
    let sc = Scenario::new(&scenario(used, &[(a, a_used), (b, b_used)]));
    let out_path = sc.dir.path().join("run.csv");
    let t0 = now_ms();
    let out = run(record(
        &sc,
        &["-o", path_str(&out_path), "--duration", "2500ms"],
    ));
    let t1 = now_ms();
    assert_ok(&out, "record");
    let rows = read_csv(&out_path);

    let gpu: Vec<&Row> = rows.iter().filter(|r| r.get("kind") == "gpu").collect();
    // 2.5 s at the default 100 ms memory interval: about 25 rows.
    assert!(
        (15..=27).contains(&gpu.len()),
        "{} gpu rows in 2.5 s",
        gpu.len()
    );
    for r in &gpu {
        assert_eq!(r.get("gpu"), "0");
        assert_eq!(r.get("uuid"), UUID);
        assert_eq!(r.u64("used_bytes"), used);
        assert_eq!(r.u64("reserved_bytes"), RESERVED);
        assert_eq!(r.u64("free_bytes"), TOTAL - RESERVED - used);
        assert_eq!(r.u64("total_bytes"), TOTAL);
        let ledger = COLUMNS.iter().position(|c| *c == "used_byte_seconds");
        for c in &COLUMNS[9..ledger.unwrap()] {
            assert_eq!(r.get(c), "", "{c} is empty on a gpu row");
        }
        assert_eq!(r.get("busy_seconds"), "", "no utilisation in this scenario");
        // Used minus the two sleepers' bytes; neither is stale.
        assert_eq!(r.u64("unattributed_bytes"), used - a_used - b_used);
        for c in STALE_COLUMNS {
            assert_eq!(r.u64(c), 0, "{c}");
        }
    }
    // The memory-time counter: the GPU's bytes over the rows' own times.
    let byte_seconds = |r: &Row| -> f64 { r.get("used_byte_seconds").parse().unwrap() };
    let (first, last) = (gpu[0], gpu[gpu.len() - 1]);
    assert!(
        gpu.windows(2)
            .all(|w| byte_seconds(w[0]) <= byte_seconds(w[1])),
        "used_byte_seconds never goes back"
    );
    let span = (last.ms() - first.ms()) as f64 / 1000.0;
    let got = byte_seconds(last) - byte_seconds(first);
    let want = used as f64 * span;
    assert!(
        (got - want).abs() <= 0.005 * want,
        "used_byte_seconds grew {got} over {span} s, want {want}"
    );
    let process: Vec<&Row> = rows.iter().filter(|r| r.get("kind") == "process").collect();
    let mut full_samples: Vec<u64> = process.iter().map(|r| r.ms()).collect();
    full_samples.dedup();
    // Full samples at 0, 1 s and 2 s.
    assert_eq!(full_samples.len(), 3, "full samples at {full_samples:?}");
    assert_eq!(process.len(), 2 * full_samples.len());
    for r in &process {
        let pid: u32 = r.get("pid").parse().unwrap();
        let want = if pid == a {
            a_used
        } else {
            assert_eq!(pid, b);
            b_used
        };
        assert_eq!(r.u64("used_bytes"), want, "pid {pid}");
        assert_eq!(r.get("process"), "sleep");
        assert_eq!(r.get("user"), "root");
        assert_eq!(r.get("uuid"), UUID);
        for c in [
            "reserved_bytes",
            "free_bytes",
            "total_bytes",
            "namespace",
            "pod",
            "torch_allocated_bytes",
            "torch_reserved_bytes",
            "unattributed_bytes",
        ]
        .into_iter()
        .chain(STALE_COLUMNS)
        {
            assert_eq!(r.get(c), "", "{c} is empty on this process row");
        }
    }
    // Each process's memory-time over its rows: its bytes × the time.
    for (pid, bytes) in [(a, a_used), (b, b_used)] {
        let rs: Vec<&&Row> = process
            .iter()
            .filter(|r| r.get("pid") == pid.to_string())
            .collect();
        let (first, last) = (rs[0], rs[rs.len() - 1]);
        let span = (last.ms() - first.ms()) as f64 / 1000.0;
        let got = byte_seconds(last) - byte_seconds(first);
        let want = bytes as f64 * span;
        assert!(
            (got - want).abs() <= 0.005 * want,
            "pid {pid}: used_byte_seconds grew {got} over {span} s, want {want}"
        );
    }
    // A full sample writes its gpu row and its process rows at one time.
    for t in &full_samples {
        assert!(gpu.iter().any(|r| r.ms() == *t), "gpu row at {t}");
    }
    let times: Vec<u64> = rows.iter().map(Row::ms).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "rows in time order");
    assert!(
        t0 <= times[0] && *times.last().unwrap() <= t1,
        "rows within the run"
    );
}

/// The first row with a new figure is within one memory sample of the
/// scenario change, and no row before the change has it.
#[test]
fn a_scenario_change_shows_at_the_right_time() {
    let (before, after) = (10_000_000_000u64, 20_000_000_000u64);
    let sc = Scenario::new(&scenario(before, &[]));
    let out_path = sc.dir.path().join("run.csv");
    let child = record(&sc, &["-o", path_str(&out_path), "--duration", "3s"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn record");
    std::thread::sleep(Duration::from_millis(1300));
    let changing = now_ms();
    sc.write(&scenario(after, &[]));
    let changed = now_ms();
    let out = wait_output(child, Duration::from_secs(30));
    assert_ok(&out, "record");
    let gpu: Vec<(u64, u64)> = read_csv(&out_path)
        .iter()
        .filter(|r| r.get("kind") == "gpu")
        .map(|r| (r.ms(), r.u64("used_bytes")))
        .collect();
    let first_new = gpu
        .iter()
        .position(|(_, u)| *u == after)
        .expect("a row with the new figure");
    assert!(
        gpu[..first_new].iter().all(|(_, u)| *u == before),
        "only the old figure before the change"
    );
    assert!(
        gpu[first_new..].iter().all(|(_, u)| *u == after),
        "only the new figure after it"
    );
    let t_new = gpu[first_new].0;
    let t_old = gpu[first_new - 1].0;
    assert!(
        t_new >= changing,
        "new figure at {t_new}, change at {changing}"
    );
    // One sample (100 ms) late at most, plus 60 ms for a loaded machine.
    assert!(
        t_new <= changed + 160,
        "new figure at {t_new}, {} ms after the change",
        t_new - changed
    );
    assert!(
        t_old <= changed,
        "the last old figure is from before the change"
    );
}

/// A 300 ms spike between two full samples (5 s apart) is in the memory
/// rows, though no process row is written meanwhile.
#[test]
fn a_300ms_spike_between_full_samples_is_in_the_memory_rows() {
    let (base, spike) = (10u64 << 30, 90u64 << 30);
    let procs = Sleepers::new(1);
    let p = procs.pid(0);
    let sc = Scenario::new(&scenario(base, &[(p, 1 << 30)]));
    let out_path = sc.dir.path().join("run.csv");
    let child = record(
        &sc,
        &[
            "-o",
            path_str(&out_path),
            "--duration",
            "2500ms",
            "--sample-interval",
            "5s",
            "--memory-sample-interval",
            "100ms",
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("spawn record");
    std::thread::sleep(Duration::from_millis(1000));
    sc.write(&scenario(spike, &[(p, 1 << 30)]));
    let t = Instant::now();
    std::thread::sleep(Duration::from_millis(300));
    sc.write(&scenario(base, &[(p, 1 << 30)]));
    let lasted = t.elapsed();
    let out = wait_output(child, Duration::from_secs(30));
    assert_ok(&out, "record");
    let rows = read_csv(&out_path);
    let full: Vec<u64> = rows
        .iter()
        .filter(|r| r.get("kind") == "process")
        .map(Row::ms)
        .collect();
    assert_eq!(full.len(), 1, "one full sample (at the start) in 2.5 s");
    let spiked: Vec<u64> = rows
        .iter()
        .filter(|r| r.get("kind") == "gpu" && r.u64("used_bytes") == spike)
        .map(Row::ms)
        .collect();
    assert!(
        spiked.len() >= 2,
        "a {lasted:?} spike in {} memory rows",
        spiked.len()
    );
    assert!(spiked[0] > full[0], "after the full sample");
    assert!(
        spiked.last().unwrap() - spiked[0] <= lasted.as_millis() as u64 + 100,
        "the spike's rows are its {lasted:?}: {spiked:?}"
    );
    let last = rows.last().unwrap();
    assert_eq!(last.u64("used_bytes"), base, "back to the base after it");
}

/// The events of a trace, the document checked.
fn read_trace(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).expect("read trace");
    let doc: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{} is not JSON ({e}):\n{text}", path.display()));
    assert_eq!(doc["displayTimeUnit"], "ms");
    assert_eq!(doc["otherData"]["generator"], "gpumem-exporter record");
    doc["traceEvents"].as_array().expect("traceEvents").clone()
}

fn events<'a>(ev: &'a [Value], ph: &str, name: &str, pid: u64) -> Vec<&'a Value> {
    ev.iter()
        .filter(|e| e["ph"] == ph && e["name"] == name && e["pid"] == pid)
        .collect()
}

/// The documented tracks: a GPU track with `memory` (used, reserved,
/// free), a track per process with `gpu 0 used`, names as metadata, and a
/// process that left the GPU dropping to 0.
#[test]
fn trace_has_the_documented_tracks() {
    let procs = Sleepers::new(2);
    let (a, b) = (procs.pid(0), procs.pid(1));
    let used = 50_000_000_001u64;
    let (a_used, b_used) = (20_000_000_003u64, 10_000_000_005u64);
    let sc = Scenario::new(&scenario(used, &[(a, a_used), (b, b_used)]));
    let out_path = sc.dir.path().join("run.trace.json");
    let t0 = now_ms() * 1000;
    let child = record(
        &sc,
        &[
            "-o",
            path_str(&out_path),
            "--duration",
            "2200ms",
            "--sample-interval",
            "500ms",
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("spawn record");
    std::thread::sleep(Duration::from_millis(1100));
    sc.write(&scenario(used, &[(a, a_used)]));
    let out = wait_output(child, Duration::from_secs(30));
    let t1 = now_ms() * 1000;
    assert_ok(&out, "record");
    let ev = read_trace(&out_path);

    let gpu_name = events(&ev, "M", "process_name", GPU0_TRACK);
    assert_eq!(gpu_name.len(), 1, "GPU 0 named once");
    let name = gpu_name[0]["args"]["name"].as_str().unwrap();
    assert!(
        name.starts_with("GPU 0 ") && name.contains(UUID),
        "GPU track name {name:?}"
    );
    assert_eq!(events(&ev, "M", "process_sort_index", GPU0_TRACK).len(), 1);
    let memory = events(&ev, "C", "memory", GPU0_TRACK);
    assert!(memory.len() >= 15, "{} memory events", memory.len());
    for e in &memory {
        assert_eq!(e["args"]["used_bytes"], used);
        assert_eq!(e["args"]["reserved_bytes"], RESERVED);
        assert_eq!(e["args"]["free_bytes"], TOTAL - RESERVED - used);
    }
    // At each full sample: used minus the listed, before and after b left;
    // nothing stale (the sleepers are alive, their parent too).
    let held = events(&ev, "C", "unattributed and stale", GPU0_TRACK);
    assert!(held.len() >= 3, "{} unattributed events", held.len());
    let unattributed: Vec<u64> = held
        .iter()
        .map(|e| e["args"]["unattributed_bytes"].as_u64().unwrap())
        .collect();
    let (both, one) = (used - a_used - b_used, used - a_used);
    assert_eq!(unattributed[0], both, "{unattributed:?}");
    assert_eq!(*unattributed.last().unwrap(), one, "{unattributed:?}");
    assert!(
        unattributed.iter().all(|u| [both, one].contains(u)),
        "{unattributed:?}"
    );
    for e in &held {
        for c in STALE_COLUMNS {
            assert_eq!(e["args"][c], 0, "{c}: {e}");
        }
    }
    for (pid, want) in [(a, a_used), (b, b_used)] {
        let pid = u64::from(pid);
        let named = events(&ev, "M", "process_name", pid);
        assert_eq!(named.len(), 1, "pid {pid} named once");
        assert_eq!(named[0]["args"]["name"], "sleep (root)");
        let used = events(&ev, "C", "gpu 0 used", pid);
        assert!(used.len() >= 2, "pid {pid}: {} events", used.len());
        assert_eq!(used[0]["args"]["bytes"], want);
        assert_eq!(used[0]["tid"], pid);
    }
    // b left the GPU: its track drops to 0 once and stays there.
    let b_used_ev = events(&ev, "C", "gpu 0 used", u64::from(b));
    let last = b_used_ev.last().unwrap();
    assert_eq!(last["args"]["bytes"], 0, "b drops to 0 when it leaves");
    assert!(
        b_used_ev[..b_used_ev.len() - 1]
            .iter()
            .all(|e| e["args"]["bytes"] == b_used),
        "b's figure until then"
    );
    assert!(
        events(&ev, "C", "gpu 0 used", u64::from(a)).len() > b_used_ev.len(),
        "a goes on"
    );
    // Timestamps: microseconds since the epoch, in order, within the run.
    let ts: Vec<u64> = ev.iter().map(|e| e["ts"].as_u64().expect("ts")).collect();
    assert!(ts.windows(2).all(|w| w[0] <= w[1]), "events in time order");
    assert!(
        t0 <= ts[0] && *ts.last().unwrap() <= t1,
        "ts in µs since the epoch"
    );
}

/// After SIGINT or SIGTERM the trace is a complete document and the exit
/// code 0; a recording until stopped has no --duration.
#[test]
fn trace_is_complete_after_sigint_and_sigterm() {
    for sig in ["INT", "TERM"] {
        let sc = Scenario::new(&scenario(1 << 30, &[]));
        let out_path = sc.dir.path().join("run.json");
        let mut child = record(&sc, &["-o", path_str(&out_path)])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn record");
        wait_for(Duration::from_secs(20), "a few samples written", || {
            let t = std::fs::read_to_string(&out_path).ok()?;
            (t.matches("\"name\":\"memory\",\"ph\":\"C\"").count() >= 3).then_some(())
        });
        send_signal(&child, sig);
        let t = Instant::now();
        while child.try_wait().unwrap().is_none() {
            assert!(t.elapsed() < Duration::from_secs(10), "SIG{sig}: exits");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(child.wait().unwrap().code(), Some(0), "SIG{sig}");
        let ev = read_trace(&out_path);
        assert!(
            events(&ev, "C", "memory", GPU0_TRACK).len() >= 3,
            "SIG{sig}"
        );
    }
}

/// `record -- COMMAND` exits with the command's code (128 + signal when it
/// was killed), and the recording around it is complete.
#[test]
fn the_command_s_exit_code_is_the_recorder_s() {
    let sc = Scenario::new(&scenario(1 << 30, &[]));
    for (script, want) in [("sleep 0.3; exit 3", 3), ("exit 0", 0), ("kill -9 $$", 137)] {
        let out_path = sc.dir.path().join("cmd.json");
        let _ = std::fs::remove_file(&out_path);
        let out = run(record(
            &sc,
            &["-o", path_str(&out_path), "--", "sh", "-c", script],
        ));
        assert_eq!(
            out.status.code(),
            Some(want),
            "{script}: {}",
            output_text(&out)
        );
        let ev = read_trace(&out_path);
        assert!(
            !events(&ev, "C", "memory", GPU0_TRACK).is_empty(),
            "{script}: at least the sample before the command"
        );
    }
    // A command that outlives --duration is waited for.
    let out_path = sc.dir.path().join("outlived.csv");
    let t = Instant::now();
    let out = run(record(
        &sc,
        &[
            "-o",
            path_str(&out_path),
            "--duration",
            "300ms",
            "--",
            "sh",
            "-c",
            "sleep 1; exit 4",
        ],
    ));
    assert_eq!(out.status.code(), Some(4), "{}", output_text(&out));
    assert!(t.elapsed() >= Duration::from_secs(1));
    let rows = read_csv(&out_path);
    let span = rows.last().unwrap().ms() - rows[0].ms();
    assert!(span < 600, "recorded for --duration only: {span} ms");
}

/// `-o -` writes CSV to stdout; a command's own stdout then goes to
/// stderr, not into the recording.
#[test]
fn stdout_recording_keeps_the_command_s_output_apart() {
    let sc = Scenario::new(&scenario(1 << 30, &[]));
    let out = run(record(
        &sc,
        &[
            "-o",
            "-",
            "--",
            "sh",
            "-c",
            "echo from-the-command; sleep 0.3",
        ],
    ));
    assert_ok(&out, "record -o -");
    let stdout = String::from_utf8(out.stdout.clone()).unwrap();
    assert!(stdout.starts_with(&COLUMNS.join(",")), "{stdout}");
    assert!(!stdout.contains("from-the-command"), "{stdout}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("from-the-command"));
    let mut r = csv::Reader::from_reader(stdout.as_bytes());
    let mut n = 0;
    for rec in r.records() {
        assert_eq!(rec.expect("whole row").len(), COLUMNS.len());
        n += 1;
    }
    assert!(n >= 2, "{n} rows");
}

/// Each bad input: its line on stderr and its exit code; an existing file
/// is left as it was.
#[test]
fn bad_input_gets_its_line_and_exit_code() {
    let sc = Scenario::new(&scenario(1 << 30, &[]));
    let dir = sc.dir.path();
    let existing = sc.file("existing.csv", b"keep me\n");
    let quiet = |args: &[&str]| run(record_logging(&sc, "error", args));
    let one_line = |out: &Output, code: i32, want: &str, what: &str| {
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{what}: {err}");
        assert_eq!(err.lines().count(), 1, "{what}: one line: {err}");
        assert!(err.contains(want), "{what}: {err:?} wants {want:?}");
    };

    let out = quiet(&["-o", path_str(&existing), "--duration", "300ms"]);
    one_line(
        &out,
        1,
        "exists; pass --force to overwrite it",
        "existing file",
    );
    assert_eq!(std::fs::read(&existing).unwrap(), b"keep me\n");
    let out = quiet(&["-o", path_str(&existing), "--duration", "300ms", "--force"]);
    assert_ok(&out, "--force");
    assert!(!read_csv(&existing).is_empty());

    let out = quiet(&["-o", path_str(dir), "--duration", "300ms"]);
    one_line(&out, 1, "is a directory", "a directory");
    let out = quiet(&[
        "-o",
        path_str(dir),
        "--format",
        "csv",
        "--duration",
        "300ms",
    ]);
    one_line(&out, 1, "is a directory", "a directory with --format");

    let missing = dir.join("no/such/dir/run.csv");
    let out = quiet(&["-o", path_str(&missing), "--duration", "300ms"]);
    one_line(&out, 1, "cannot open", "a missing directory");
    assert!(String::from_utf8_lossy(&out.stderr).contains("No such file or directory"));

    let out = quiet(&["-o", "/dev/full", "--duration", "300ms"]);
    one_line(&out, 1, "No space left on device", "/dev/full");

    let out = quiet(&["-o", path_str(&dir.join("run.txt")), "--duration", "300ms"]);
    one_line(&out, 2, "cannot tell the format", "unknown extension");
    let out = quiet(&["-o", path_str(&dir.join("run.csv")), "--format", "xml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown format \"xml\""));
    for bad in ["10x", "0s", "-1s", "", "1.5s"] {
        let flag = format!("--duration={bad}");
        let out = quiet(&["-o", path_str(&dir.join("run.csv")), &flag]);
        assert_eq!(out.status.code(), Some(2), "{flag}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.lines().next().unwrap_or("").contains("--duration"),
            "{flag}: {err}"
        );
    }
    assert!(!dir.join("run.csv").exists(), "nothing made for bad flags");

    let out_path = dir.join("nocmd.csv");
    let out = quiet(&["-o", path_str(&out_path), "--", "/no/such/command", "x"]);
    one_line(
        &out,
        127,
        "cannot start the command \"/no/such/command\"",
        "no command",
    );
    assert!(!read_csv(&out_path).is_empty(), "the sample before is kept");
}
