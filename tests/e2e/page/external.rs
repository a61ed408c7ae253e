//! The live page in a real headless Chromium (`--features external-tools`).

use std::time::{Duration, Instant};

use serde_json::Value;

use super::*;
use crate::harness::browser::Browser;

/// What the page shows, read from its DOM.
const READ_DOM: &str = r#"(() => ({
  started: Number(document.body.dataset.started || 0),
  rendered: Number(document.body.dataset.rendered || 0),
  problems: [...document.querySelectorAll('#problems .problem')].map((p) => p.textContent),
  summary: document.getElementById('summary').textContent,
  health: document.getElementById('health').textContent,
  gpus: [...document.querySelectorAll('section.gpu')].map((s) => ({
    gpu: s.dataset.gpu,
    title: s.querySelector('h2').textContent,
    legend: s.querySelector('.legend') ? s.querySelector('.legend').textContent : null,
    util: s.querySelector('.util') ? s.querySelector('.util').textContent : null,
    problem: s.querySelector('.problem') ? s.querySelector('.problem').textContent : null,
    sparkline: s.querySelectorAll('svg.sparkline path').length,
    peak: s.querySelectorAll('svg.bar line.peak').length,
    rows: [...s.querySelectorAll('tbody tr[data-pid]')].map((r) =>
      [r.dataset.pid, ...[...r.querySelectorAll('td')].map((td) => td.textContent)]),
  })),
}))()"#;

fn rows(dom: &Value, gpu: usize) -> Vec<Vec<String>> {
    dom["gpus"][gpu]["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|c| c.as_str().unwrap().to_string())
                .collect()
        })
        .collect()
}

fn row(pid: &str, cells: &[&str]) -> Vec<String> {
    std::iter::once(pid)
        .chain(std::iter::once(pid))
        .chain(cells.iter().copied())
        .map(String::from)
        .collect()
}

#[test]
fn the_page_shows_the_scenario_follows_it_and_logs_no_error() {
    let node = node();
    let sc = Scenario::new(&scenario(false));
    let ex = start(&node, &sc, "500ms", &[]);
    let mut b = Browser::start(1280, 900);
    b.navigate(&format!("http://{}/", ex.addr));

    let dom = b.wait_until(
        Duration::from_secs(20),
        "two GPUs with their processes",
        READ_DOM,
        |d| {
            d["gpus"].as_array().is_some_and(|g| g.len() == 2)
                && d["gpus"][1]["rows"]
                    .as_array()
                    .is_some_and(|r| r.len() == 2)
                && d["gpus"][0]["sparkline"] == 1
        },
    );
    assert_eq!(dom["problems"], serde_json::json!([]), "{dom:#}");
    assert_eq!(
        dom["summary"],
        "2 GPUs · driver 580.159.04 · CUDA 13.0 · sampled every 0.5 s"
    );
    let g0 = &dom["gpus"][0];
    assert_eq!(g0["title"], "GPU 0 NVIDIA H200 up");
    assert_eq!(
        g0["legend"],
        "used 12,288 MiB reserved 615 MiB free 130,868 MiB of 143,771 MiB peak 12,288 MiB"
    );
    assert_eq!(g0["util"], "utilisation: GPU 93 % · memory 41 %");
    assert_eq!(g0["peak"], 1);
    // Sorted by memory, largest first; a process without a figure last.
    // Columns: pid, process, user, namespace / pod, memory, share.
    assert_eq!(
        rows(&dom, 0),
        vec![
            row(
                "4101",
                &[
                    "python3",
                    "alice",
                    "team-a/trainer-0 (trainer)",
                    "10,240 MiB",
                    "7.1 %"
                ]
            ),
            row(
                "4103",
                &[
                    "jupyter",
                    "4242",
                    "team-a/notebook (jupyter)",
                    "2,048 MiB",
                    "1.4 %"
                ]
            ),
            row("4104", &["Xorg", "root", "—", "n/a", "—"]),
        ],
        "{dom:#}"
    );
    let g1 = &dom["gpus"][1];
    assert_eq!(g1["title"], "GPU 1 NVIDIA A100-SXM4-80GB up");
    assert_eq!(
        g1["legend"],
        "used 4,096 MiB reserved 512 MiB free 77,312 MiB of 81,920 MiB peak 4,096 MiB"
    );
    assert_eq!(g1["util"], Value::Null, "no utilisation figures for GPU 1");
    assert_eq!(
        rows(&dom, 1),
        vec![
            row(
                "4102",
                &[
                    "tritonserver",
                    "bob",
                    "team-b/infer-7f9c (server)",
                    "3,072 MiB",
                    "3.8 %"
                ]
            ),
            row("4105", &["python3", "bob", "—", "1,000 MiB", "1.2 %"]),
        ]
    );
    let health = dom["health"].as_str().unwrap();
    assert!(health.contains("gpu_up: 2 of 2 answering"), "{health}");
    assert!(health.contains("NVML errors: 0"), "{health}");
    assert!(health.contains("last sample: "), "{health}");

    // Sortable: by pid (ascending), then by memory again (largest first).
    let by = |b: &mut Browser, key: &str| {
        b.eval(&format!(
            "document.querySelector('section.gpu button.sort[data-key=\"{key}\"]').click()"
        ));
        let d = b.eval(READ_DOM);
        rows(&d, 0).iter().map(|r| r[0].clone()).collect::<Vec<_>>()
    };
    assert_eq!(by(&mut b, "pid"), ["4101", "4103", "4104"]);
    assert_eq!(by(&mut b, "pid"), ["4104", "4103", "4101"]);
    assert_eq!(by(&mut b, "mem"), ["4101", "4103", "4104"]);

    // The scenario changes: the DOM shows it by the second refresh begun
    // after the change (one sample interval for the sampler to see it, one
    // for the page to ask).
    let before = b.eval(READ_DOM)["started"].as_u64().unwrap();
    let t = Instant::now();
    sc.write(&scenario(true));
    let dom = b.wait_until(
        Duration::from_secs(10),
        "the change on the page",
        READ_DOM,
        |d| {
            let notebook = d["gpus"][0]["rows"]
                .as_array()
                .and_then(|r| r.iter().find(|r| r[0] == "4103"))
                .map(|r| r[5].clone());
            notebook.as_ref().and_then(Value::as_str) == Some("6,144 MiB")
                && d["gpus"][0]["rows"]
                    .as_array()
                    .is_some_and(|r| r.len() == 4)
                && d["gpus"][1]["legend"].is_null()
        },
    );
    let shown_by = dom["rendered"].as_u64().unwrap();
    eprintln!(
        "change shown by refresh {} ({} after the write, {:?})",
        shown_by,
        shown_by - before,
        t.elapsed()
    );
    assert!(
        shown_by - before <= 2,
        "shown by refresh {shown_by}, more than two after {before}"
    );
    assert_eq!(
        dom["problems"],
        serde_json::json!(["GPU 1 (NVIDIA A100-SXM4-80GB) is not answering (gpu_up 0)."])
    );
    assert_eq!(
        dom["gpus"][0]["legend"],
        "used 17,408 MiB reserved 615 MiB free 125,748 MiB of 143,771 MiB peak 17,408 MiB"
    );
    assert_eq!(
        rows(&dom, 0)[2],
        row("4106", &["eval", "alice", "—", "1,024 MiB", "0.7 %"])
    );
    let g1 = &dom["gpus"][1];
    assert_eq!(g1["title"], "GPU 1 NVIDIA A100-SXM4-80GB not answering");
    assert_eq!(
        g1["problem"],
        "No memory figures: the last sample of this GPU failed."
    );
    let health = dom["health"].as_str().unwrap();
    assert!(health.contains("gpu_up: 1 of 2 answering"), "{health}");
    assert!(!health.contains("NVML errors: 0"), "{health}");

    // No console error, uncaught exception or browser log error (a CSP
    // violation or a failed load would be one) in all that time.
    b.pump(Duration::from_millis(300));
    assert_eq!(b.errors, Vec::<String>::new());
    // ...and the collector does see one.
    b.eval("console.error('canary')");
    b.pump(Duration::from_millis(300));
    assert_eq!(b.errors, ["console.\"error\": canary"]);

    // docs/page.png: PAGE_SCREENSHOT=$PWD/docs/page.png cargo test --features external-tools --test
    // e2e page::the_page -- after a minute of memory going up and down,
    // so the sparklines have a shape.
    if let Some(path) = std::env::var_os("PAGE_SCREENSHOT") {
        for i in 0..120u64 {
            let wave = |period: u64, amp: u64| {
                let phase = (i % period) as f64 / period as f64 * std::f64::consts::TAU;
                (amp as f64 * (1.0 + phase.sin()) / 2.0) as u64
            };
            sc.write(&scenario_at(
                2048 + wave(40, 4096),
                3072 + wave(25, 2048),
                false,
                false,
            ));
            std::thread::sleep(Duration::from_millis(500));
        }
        b.wait_until(Duration::from_secs(10), "both GPUs up", READ_DOM, |d| {
            d["problems"] == serde_json::json!([])
        });
        b.screenshot(std::path::Path::new(&path));
    }
}

#[test]
fn before_the_first_sample_the_page_and_the_api_say_why() {
    let sc = Scenario::new("init_error: driver_not_loaded\ndevices: []\n");
    let ex = Exporter::start(&sc, &[]);
    for path in [
        "/api/v1/snapshot",
        "/api/v1/history",
        "/api/v1/history?seconds=60",
    ] {
        let (status, v) = json(&ex, path);
        assert_eq!(status, 503, "{path}");
        assert_eq!(
            v,
            serde_json::json!({"schema_version": 1, "error": "no sample yet: NVML is not initialised yet"}),
            "{path}"
        );
    }
    let mut b = Browser::start(1024, 600);
    b.navigate(&format!("http://{}/", ex.addr));
    let dom = b.wait_until(
        Duration::from_secs(20),
        "the reason on the page",
        READ_DOM,
        |d| {
            d["problems"][0]
                .as_str()
                .is_some_and(|p| p.starts_with("No sample"))
        },
    );
    assert_eq!(
        dom["problems"],
        serde_json::json!(["No sample yet: NVML is not initialised yet."])
    );
    assert_eq!(dom["gpus"], serde_json::json!([]));
    // The only errors are the browser's notes of the 503 answers.
    b.pump(Duration::from_millis(200));
    assert!(!b.errors.is_empty());
    for e in &b.errors {
        assert!(e.contains("503"), "{e}");
    }
}

/// "Will it OOM?" on the page: a GPU whose used memory grows steadily and a
/// torch process whose allocated grows 3 MiB per step get the forecast and
/// the leak sentence; a flat GPU with a steady process gets neither. The
/// forecast needs a minute of history, so both run side by side for one.
#[test]
fn the_page_forecasts_a_growing_gpu_and_names_a_leak_but_not_for_a_flat_one() {
    use crate::harness::python::Py;
    const GPU: &str = "GPU-cccccccc-2222-2222-2222-222222222222";
    const GIB: u64 = 1 << 30;
    let total = 150_754_820_096u64;
    // A bridge document with 64 steps, allocated growing by `per_step`.
    let torch = |per_step: u64| {
        let ring: Vec<Value> = (1..=64u64)
            .map(|i| serde_json::json!([i, 1_000.0 + i as f64 * 0.1, 8 * GIB + i * per_step]))
            .collect();
        let doc = serde_json::json!({"v": 1, "devices": [{
            "uuid": GPU, "allocated": 8 * GIB + 64 * per_step, "reserved": 9 * GIB,
            "allocated_peak": 9 * GIB, "reserved_peak": 9 * GIB, "active": 8 * GIB,
            "inactive_split": 0, "alloc_retries": 0, "ooms": 0,
            "steps": {"total": 64, "ring": ring}}]});
        Py::raw(doc.to_string().as_bytes(), true)
    };
    let ((leaky, _d1), (steady, _d2)) = (torch(3 * MIB), torch(0));
    let yaml = |pid: u32, used: u64| {
        format!(
            "devices:\n  - uuid: {GPU}\n    memory: {{total: {total}, reserved: 644939776, used: {used}}}\n    processes: [{{pid: {pid}, used: {used}}}]\n"
        )
    };
    let growing = Scenario::new(&yaml(leaky.pid, 20 * GIB));
    let flat = Scenario::new(&yaml(steady.pid, 20 * GIB));
    let cfg = "sample_interval: 500ms\n";
    let (ex_growing, ex_flat) = (
        Exporter::with_config(&growing, cfg, &[]),
        Exporter::with_config(&flat, cfg, &[]),
    );
    // 256 MiB a second, for 66 seconds.
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(66) {
        let used = 20 * GIB + (start.elapsed().as_millis() as u64 * 256 * MIB) / 1000;
        growing.write(&yaml(leaky.pid, used));
        std::thread::sleep(Duration::from_millis(250));
    }
    const READ: &str = r#"(() => ({
      forecast: [...document.querySelectorAll('section.gpu p.forecast')].map((p) => p.textContent),
      leak: [...document.querySelectorAll('section.gpu p.leak')].map((p) => p.textContent),
      steps: [...document.querySelectorAll('section.gpu td.steps')].map((td) => td.textContent),
    }))()"#;
    let mut b = Browser::start(1280, 900);
    b.navigate(&format!("http://{}/", ex_growing.addr));
    let dom = b.wait_until(Duration::from_secs(20), "the forecast", READ, |d| {
        d["forecast"].as_array().is_some_and(|f| f.len() == 1)
    });
    let forecast = dom["forecast"][0].as_str().unwrap_or_default();
    // "Full in about 7 min at the last 1 min's rate (used grows 15,356 MiB
    // a minute)." — 256 MiB a second is 15,360 a minute, give or take the
    // timing of the scenario writes.
    let per_minute: f64 = forecast
        .split("used grows ")
        .nth(1)
        .and_then(|r| r.split(" MiB").next())
        .map(|n| n.replace(',', ""))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0.0);
    assert!(
        forecast.starts_with("Full in about ")
            && forecast.contains(" at the last 1 min's rate (used grows ")
            && (per_minute / 15_360.0 - 1.0).abs() < 0.02,
        "{forecast}"
    );
    assert_eq!(
        dom["leak"],
        serde_json::json!([format!(
            "pid {} ({}): allocated grows 3.0 MiB per step over the last 64 steps: a leak? At 10.0 steps/s that is 1,800 MiB a minute.",
            leaky.pid,
            std::fs::read_to_string(format!("/proc/{}/comm", leaky.pid))
                .unwrap_or_default()
                .trim()
        )]),
        "{dom:#}"
    );
    assert_eq!(
        dom["steps"],
        serde_json::json!(["+3.0 MiB · 10.0/s · 64 steps"])
    );
    // The API says the same: 256 MiB a second, free ÷ that.
    let (_, v) = json(&ex_growing, "/api/v1/snapshot");
    let f = &v["gpus"][0]["forecast"];
    let rate = f["growth_bytes_per_second"].as_f64().unwrap_or(0.0);
    assert!((rate / (256.0 * MIB as f64) - 1.0).abs() < 0.05, "{f}");
    let free = v["gpus"][0]["memory"]["free_bytes"].as_f64().unwrap_or(0.0);
    let full_in = f["full_in_seconds"].as_f64().unwrap_or(0.0);
    // The forecast is worked out once per new second and cached between
    // the 10 Hz publishes, so the free bytes it was made from may be up to
    // a second (one second of growth) older than the snapshot's.
    assert!((full_in - free / rate).abs() < 2.0, "{f} free {free}");
    assert!(f["window_seconds"].as_u64().unwrap_or(0) >= 60, "{f}");

    b.navigate(&format!("http://{}/", ex_flat.addr));
    let dom = b.wait_until(Duration::from_secs(20), "the flat GPU", READ, |d| {
        d["steps"].as_array().is_some_and(|s| s.len() == 1)
    });
    assert_eq!(dom["forecast"], serde_json::json!([]), "{dom:#}");
    assert_eq!(dom["leak"], serde_json::json!([]), "{dom:#}");
    assert_eq!(
        dom["steps"],
        serde_json::json!(["+0.0 MiB · 10.0/s · 64 steps"])
    );
    let (_, v) = json(&ex_flat, "/api/v1/snapshot");
    assert_eq!(v["gpus"][0]["forecast"], Value::Null);

    b.pump(Duration::from_millis(300));
    assert_eq!(b.errors, Vec::<String>::new());
}

/// One GPU whose every NVML call takes `delay_ms` (0: none; 20 s: the
/// sampler stalls in the call).
fn one_gpu(delay_ms: u64) -> String {
    format!(
        "devices:\n  - uuid: {GPU0}\n    name: NVIDIA H200\n    memory: {{total: 150754820096, reserved: 644939776, used: {}}}\n    delay_ms: {delay_ms}\n    processes: []\n",
        1024 * MIB
    )
}

/// Run before the page's own script: the browser's wall clock (`Date`)
/// moved by `seconds`, as on a laptop whose clock is off.
fn skewed_clock(seconds: f64) -> String {
    format!(
        "(() => {{
  const off = {seconds} * 1000;
  const D = Date;
  class Skewed extends D {{
    constructor(...a) {{ if (a.length === 0) super(D.now() + off); else super(...a); }}
    static now() {{ return D.now() + off; }}
  }}
  globalThis.Date = Skewed;
}})();"
    )
}

/// "Last sample N s old" is the server's clock against the server's
/// clock: with the browser's clock 10 minutes ahead or behind, a live
/// exporter shows a sample well under a second or two old and no "may be
/// stuck" banner (the page used to subtract `taken_at` from the
/// browser's clock and cried wolf); an NVML call that really hangs still
/// raises the banner within a few seconds.
#[test]
fn the_sample_age_is_read_from_the_servers_clock_not_the_browsers() {
    let sc = Scenario::new(&one_gpu(0));
    let ex = Exporter::start(
        &sc,
        &[
            "--sample-interval",
            "200ms",
            "--memory-sample-interval",
            "100ms",
        ],
    );
    let url = format!("http://{}/", ex.addr);
    let last_sample = |d: &Value| -> Option<f64> {
        let h = d["health"].as_str()?;
        let rest = h.split("last sample: ").nth(1)?;
        rest.split(" s ago").next()?.parse().ok()
    };
    let mut browsers = Vec::new();
    for skew in [600.0, -600.0] {
        let mut b = Browser::start(1024, 600);
        b.call(
            "Page.addScriptToEvaluateOnNewDocument",
            serde_json::json!({ "source": skewed_clock(skew) }),
        );
        b.navigate(&url);
        let dom = b.wait_until(Duration::from_secs(20), "a few renders", READ_DOM, |d| {
            d["rendered"].as_u64().is_some_and(|n| n >= 5)
        });
        let browser_now = b.eval("Date.now() / 1000").as_f64().unwrap_or(0.0);
        let host_now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        assert!(
            (browser_now - host_now - skew).abs() < 5.0,
            "the browser's clock is {:.0} s off, not {skew}",
            browser_now - host_now
        );
        assert_eq!(dom["problems"], serde_json::json!([]), "skew {skew}: {dom}");
        let age = last_sample(&dom);
        assert!(
            age.is_some_and(|a| a < 2.5),
            "skew {skew}: the page says the last sample is {age:?} s old: {}",
            dom["health"]
        );
        browsers.push((skew, b));
    }
    // A real stall: the sampler hangs in an NVML call; both pages say so.
    sc.write(&one_gpu(20_000));
    for (skew, b) in &mut browsers {
        let dom = b.wait_until(Duration::from_secs(15), "the stuck banner", READ_DOM, |d| {
            d["problems"].as_array().is_some_and(|p| {
                p.iter().any(|l| {
                    l.as_str()
                        .is_some_and(|l| l.contains("the sampler may be stuck"))
                })
            })
        });
        let age = last_sample(&dom);
        assert!(
            age.is_some_and(|a| (4.0..60.0).contains(&a)),
            "skew {skew}: stalled, the page says {age:?} s: {}",
            dom["health"]
        );
        assert!(b.errors.is_empty(), "skew {skew}: {:?}", b.errors);
    }
}

/// The ranking tables as the page shows them: per window, its title and
/// each row's cells.
const READ_RANKING: &str = r#"(() => [...document.querySelectorAll('#workloads .ranking')].map((r) => ({
  window: r.dataset.window,
  title: r.querySelector('h2').textContent,
  rows: [...r.querySelectorAll('tbody tr')].map((tr) => [...tr.querySelectorAll('td')].map((td) => td.textContent)),
})))()"#;

/// The page's figure for `h` hours (as app.js writes it).
fn hours(h: f64) -> String {
    if h >= 100.0 {
        let n = h.round() as u64;
        let s = n.to_string();
        let mut out = String::new();
        for (i, c) in s.chars().enumerate() {
            if i > 0 && (s.len() - i).is_multiple_of(3) {
                out.push(',');
            }
            out.push(c);
        }
        out
    } else if h >= 1.0 {
        format!("{h:.2}")
    } else {
        format!("{h:.4}")
    }
}

/// After the processes left, the totals stand still: the page's ranking
/// tables are the API's, row for row (kind, workload, GiB-hours, busy
/// GPU-hours), in the same order, for both windows.
#[test]
fn the_page_ranks_the_workloads_as_the_api_does() {
    let node = node();
    let sc = Scenario::new(&scenario(false));
    let ex = start(&node, &sc, "200ms", &[]);
    std::thread::sleep(Duration::from_secs(2));
    // Every process gone: the workloads keep their totals (the grace).
    sc.write(&format!(
        "devices:\n  - uuid: {GPU0}\n    memory: {{total: 150754820096, reserved: 644939776, used: 0}}\n    utilization: {{gpu: 93, memory: 41}}\n  - uuid: {GPU1}\n    memory: {{total: 85899345920, reserved: 536870912, used: 0}}\n"
    ));
    let api = wait_for(Duration::from_secs(10), "totals standing still", || {
        let (_, a) = json(&ex, "/api/v1/snapshot");
        std::thread::sleep(Duration::from_millis(500));
        let (_, b) = json(&ex, "/api/v1/snapshot");
        let still = a["workloads"]["since_start"]["workloads"]
            == b["workloads"]["since_start"]["workloads"]
            && a["workloads"]["last_hour"]["workloads"] == b["workloads"]["last_hour"]["workloads"];
        let none = b["gpus"][0]["processes"]
            .as_array()
            .is_some_and(|p| p.is_empty());
        (still && none).then_some(b)
    });
    let mut want: Vec<Value> = Vec::new();
    for window in ["last_hour", "since_start"] {
        let list = api["workloads"][window]["workloads"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert!(list.len() >= 4, "{window}: {list:?}");
        let rows: Vec<Vec<String>> = list
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let s = |k: &str| w[k].as_str().unwrap_or("").to_string();
                let (kind, name) = match w["kind"].as_str() {
                    // A pod whose names the watcher did not know yet: its UID.
                    Some("pod") => {
                        let ns = s("namespace");
                        let pod = if s("pod").is_empty() {
                            s("pod_uid")
                        } else {
                            s("pod")
                        };
                        (
                            "pod",
                            if ns.is_empty() {
                                pod
                            } else {
                                format!("{ns}/{pod}")
                            },
                        )
                    }
                    Some("slurm_job") => ("Slurm job", s("slurm_job")),
                    Some("container") => {
                        ("container", s("container_id").chars().take(12).collect())
                    }
                    _ => ("user", s("user")),
                };
                vec![
                    (i + 1).to_string(),
                    kind.to_string(),
                    name,
                    hours(w["memory_gib_hours"].as_f64().unwrap_or(-1.0)),
                    hours(w["busy_gpu_hours"].as_f64().unwrap_or(-1.0)),
                ]
            })
            .collect();
        want.push(serde_json::json!(rows));
    }
    // The trainer's 10 GiB is the largest.
    assert_eq!(want[1][0][2], "team-a/trainer-0", "{want:?}");
    let mut b = Browser::start(1280, 900);
    b.navigate(&format!("http://{}/", ex.addr));
    let dom = b.wait_until(
        Duration::from_secs(20),
        "both ranking tables as the API's",
        READ_RANKING,
        |d| {
            d.as_array().is_some_and(|r| r.len() == 2)
                && d[0]["rows"] == want[0]
                && d[1]["rows"] == want[1]
        },
    );
    assert_eq!(dom[0]["window"], "last-hour");
    assert!(
        dom[1]["title"]
            .as_str()
            .is_some_and(|t| t.starts_with("Workloads by memory-hours since start (")),
        "{dom:#}"
    );
}
