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
