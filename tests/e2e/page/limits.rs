//! Each workload's own limit on the page and in the API: a pod limited by
//! the driver (the fake NVML's `nvmlDeviceGetMemoryLimits_v1`, keyed by its
//! cgroup directory under `path.cgroupfs`) gets a tick at each limit on its
//! bar and "N GiB to its limit"; a GPU shared by two pods without limits
//! says that neighbours can take it all; a GPU of one workload says
//! nothing (`--features external-tools`: Chromium).

use std::time::Duration;

use serde_json::json;

use super::*;
use crate::harness::browser::Browser;
use crate::harness::cluster::cgroupfs_of;

const GIB: u64 = 1 << 30;
const TOTAL: u64 = 150_754_820_096;
const GPU2: &str = "GPU-cccccccc-2222-2222-2222-222222222222";

/// Each GPU's limit rows as the page shows them, and its sentence.
const READ_LIMITS: &str = r#"(() => [...document.querySelectorAll('section.gpu')].map((s) => ({
  gpu: s.dataset.gpu,
  nolimit: [...s.querySelectorAll('p.nolimit')].map((p) => p.textContent),
  workloads: [...s.querySelectorAll('.workload-limit')].map((w) => ({
    workload: w.dataset.workload,
    head: w.querySelector('.limit-head').textContent,
    to_limit: [...w.querySelectorAll('.to-limit')].map((t) => t.textContent),
    keys: w.querySelector('.limit-keys').textContent,
    ticks: [...w.querySelectorAll('svg.wbar g.tick')].map((t) => {
      const line = t.querySelector('line');
      const dash = getComputedStyle(line).strokeDasharray;
      return {
        source: t.dataset.source, kind: t.dataset.kind, class: t.getAttribute('class'),
        title: t.querySelector('title').textContent,
        x: Number(line.getAttribute('x1')),
        dashed: dash !== 'none' && dash !== '',
        dash,
        stroke: getComputedStyle(line).stroke,
        marks: t.querySelectorAll('polygon').length,
      };
    }),
  })),
})))()"#;

/// Run before the page's script: the snapshot's first limit row gains a
/// granted share and a torch limit, so the two other marks are drawn
/// from the API's data (the sources themselves have their own tests).
const MORE_MARKS: &str = r#"(() => {
  const real = window.fetch.bind(window);
  window.fetch = async (url, opts) => {
    const r = await real(url, opts);
    if (!String(url).startsWith('api/v1/snapshot')) return r;
    const body = await r.json();
    for (const g of body.gpus || []) {
      for (const w of g.limits || []) {
        w.limits.push({source: 'kai', kind: 'granted', bytes: 30 * 1073741824},
                      {source: 'torch', kind: 'hard', bytes: 18 * 1073741824});
      }
    }
    return new Response(JSON.stringify(body), {status: r.status, headers: r.headers});
  };
})();"#;

/// The cgroup v2 path of a `/proc/<pid>/cgroup` line `0::<path>`.
fn v2_path(cgroup: &str) -> String {
    cgroup.trim().trim_start_matches("0::").to_string()
}

fn proc_line(pid: u32, used: u64) -> String {
    format!("      - {{pid: {pid}, used: {used}, type: compute}}\n")
}

#[test]
fn a_limited_workload_gets_its_ticks_and_headroom_and_a_shared_gpu_without_limits_a_warning() {
    let node = FakeNode::start(team_pods());
    let root = node.proc_root.path();
    // trainer-0 on GPU 0, limited; infer-7f9c and notebook share GPU 1;
    // Xorg (a user, no workload of its own) alone on GPU 2.
    for (pid, comm, uid, cgroup) in [
        (4101, "python3", 1000, cgroup_containerd('a')),
        (4102, "tritonserver", 1001, cgroup_crio('b')),
        (4103, "jupyter", 4242, cgroup_containerd('c')),
        (
            4104,
            "Xorg",
            0,
            "0::/system.slice/display-manager.service\n".to_string(),
        ),
    ] {
        cluster::write_proc(root, pid, comm, uid, &cgroup, &[]);
    }
    // The fake cgroup filesystem is a hybrid layout: cgroup v2 at
    // `unified/`, where the exporter asks the driver about a v2 path.
    let trainer_dir = format!(
        "{}{}",
        cgroupfs_of(root).join("unified").display(),
        v2_path(&cgroup_containerd('a'))
    );
    let yaml = format!(
        "devices:
  - uuid: {GPU0}
    name: NVIDIA H200
    memory: {{total: {TOTAL}, reserved: 644939776, used: {u0}}}
    memory_limits:
      \"{trainer_dir}\": {{soft: {soft}, hard: {hard}, used: {u0}}}
    processes:
{p0}  - uuid: {GPU1}
    name: NVIDIA H200
    memory: {{total: {TOTAL}, reserved: 644939776, used: {u1}}}
    processes:
{p1}{p2}  - uuid: {GPU2}
    name: NVIDIA H200
    memory: {{total: {TOTAL}, reserved: 644939776, used: {u3}}}
    processes:
{p3}",
        u0 = 12 * GIB,
        soft = 16 * GIB,
        hard = 20 * GIB,
        p0 = proc_line(4101, 12 * GIB),
        u1 = 7 * GIB,
        p1 = proc_line(4102, 3 * GIB),
        p2 = proc_line(4103, 4 * GIB),
        u3 = GIB,
        p3 = proc_line(4104, GIB),
    );
    let sc = Scenario::new(&yaml);
    let ex = start(&node, &sc, "500ms", &["--limits.interval", "500ms"]);

    // The API: the trainer's row on GPU 0, none on the others; the driver
    // looked for and found.
    let v = wait_for(Duration::from_secs(20), "the trainer's limits", || {
        let (_, v) = json(&ex, "/api/v1/snapshot");
        (v["gpus"][0]["limits"]
            .as_array()
            .is_some_and(|l| l.len() == 1))
        .then_some(v)
    });
    assert_eq!(
        v["gpus"][0]["limits"],
        json!([{
            "kind": "pod", "namespace": "team-a", "pod": "trainer-0",
            "pod_uid": cluster::pod_uid('a'), "slurm_job": null, "container_id": null,
            "used_bytes": 12 * GIB,
            "limits": [
                {"source": "driver", "kind": "hard", "bytes": 20 * GIB},
                {"source": "driver", "kind": "soft", "bytes": 16 * GIB},
            ],
            "hard_limit_bytes": 20 * GIB, "to_limit_bytes": 8 * GIB,
            "limit_in_seconds": null,
        }]),
        "{v:#}"
    );
    assert_eq!(v["gpus"][1]["limits"], json!([]));
    assert_eq!(v["gpus"][2]["limits"], json!([]));
    assert_eq!(v["limit_sources"]["driver"], true, "{}", v["limit_sources"]);
    assert_eq!(v["limit_sources"]["dmem"], false, "{}", v["limit_sources"]);
    for (source, found) in v["limit_sources"].as_object().unwrap() {
        assert!(found.is_boolean(), "{source}: {found}");
        assert!(
            ["driver", "dmem", "hami", "dra", "kai", "torch"].contains(&source.as_str()),
            "{source}"
        );
    }
    // The same as /metrics.
    let m = ex.metrics();
    let hard = m.find(
        "gpu_workload_memory_limit_bytes",
        &[
            ("gpu", "0"),
            ("pod", "trainer-0"),
            ("source", "driver"),
            ("kind", "hard"),
        ],
    );
    assert_eq!(hard.len(), 1, "{hard:?}");
    assert_eq!(hard[0].1, (20 * GIB) as f64);

    // The page: the ticks (hard solid, soft dashed) where the limits are
    // on a bar scaled to the GPU's total, their titles, the headroom.
    let mut b = Browser::start(1280, 900);
    b.navigate(&format!("http://{}/", ex.addr));
    let dom = b.wait_until(
        Duration::from_secs(20),
        "the trainer's ticks and the shared GPU's warning",
        READ_LIMITS,
        |d| {
            d.as_array().is_some_and(|g| g.len() == 3)
                && d[0]["workloads"].as_array().is_some_and(|w| w.len() == 1)
                && d[1]["nolimit"].as_array().is_some_and(|n| n.len() == 1)
        },
    );
    let w = &dom[0]["workloads"][0];
    assert_eq!(w["workload"], "pod team-a/trainer-0", "{dom:#}");
    assert_eq!(
        w["head"],
        "pod team-a/trainer-0 12.0 GiB used · 8.0 GiB to its limit"
    );
    assert_eq!(w["to_limit"], json!(["8.0 GiB to its limit"]));
    assert_eq!(
        w["keys"],
        "driver hard limit 20.0 GiB driver soft limit 16.0 GiB "
    );
    let ticks = w["ticks"].as_array().unwrap();
    assert_eq!(ticks.len(), 2, "{dom:#}");
    let at = |bytes: u64| bytes as f64 / TOTAL as f64 * 1000.0;
    for (t, kind, bytes, dashed) in [
        (&ticks[0], "hard", 20 * GIB, false),
        (&ticks[1], "soft", 16 * GIB, true),
    ] {
        assert_eq!(t["source"], "driver", "{t}");
        assert_eq!(t["kind"], kind, "{t}");
        assert_eq!(t["class"], format!("tick {kind}"), "{t}");
        assert_eq!(
            t["title"],
            format!("driver {kind} limit {}.0 GiB", bytes / GIB),
            "{t}"
        );
        assert!((t["x"].as_f64().unwrap() - at(bytes)).abs() < 0.01, "{t}");
        assert_eq!(t["dashed"], dashed, "{t}");
        assert_eq!(t["marks"], 0, "{t}");
    }
    assert_eq!(dom[0]["nolimit"], json!([]), "limited: no warning");
    assert_eq!(dom[1]["workloads"], json!([]));
    assert_eq!(
        dom[1]["nolimit"],
        json!([
            "Shared by 2 workloads, each with no limit of its own: neighbours can take it all."
        ])
    );
    assert_eq!(dom[2]["nolimit"], json!([]), "one workload: nothing to say");
    assert_eq!(dom[2]["workloads"], json!([]));
    b.pump(Duration::from_millis(300));
    assert_eq!(b.errors, Vec::<String>::new());

    // A granted share is dotted; torch's limit has its own colour and
    // mark (both added to the API's answer in the browser).
    let mut b = Browser::start(1280, 900);
    b.call(
        "Page.addScriptToEvaluateOnNewDocument",
        json!({ "source": MORE_MARKS }),
    );
    b.navigate(&format!("http://{}/", ex.addr));
    let dom = b.wait_until(Duration::from_secs(20), "four ticks", READ_LIMITS, |d| {
        d[0]["workloads"][0]["ticks"]
            .as_array()
            .is_some_and(|t| t.len() == 4)
    });
    let ticks = &dom[0]["workloads"][0]["ticks"];
    let (hard, granted, torch) = (&ticks[0], &ticks[2], &ticks[3]);
    assert_eq!(
        (&granted["kind"], &granted["class"], &granted["title"]),
        (
            &json!("granted"),
            &json!("tick granted"),
            &json!("kai granted share 30.0 GiB")
        ),
        "{dom:#}"
    );
    assert_eq!(granted["dashed"], true, "dotted: {granted}");
    assert_ne!(granted["dash"], ticks[1]["dash"], "dotted, not dashed");
    assert_eq!(
        (
            &torch["source"],
            &torch["kind"],
            &torch["class"],
            &torch["title"]
        ),
        (
            &json!("torch"),
            &json!("hard"),
            &json!("tick torch"),
            &json!("torch hard limit 18.0 GiB")
        ),
        "{dom:#}"
    );
    assert_eq!(torch["marks"], 1, "torch's own mark: {torch}");
    assert_eq!(hard["marks"], 0);
    assert_ne!(torch["stroke"], hard["stroke"], "torch's own colour");
    assert_eq!(torch["dashed"], false);
    b.pump(Duration::from_millis(300));
    assert_eq!(b.errors, Vec::<String>::new());
}
