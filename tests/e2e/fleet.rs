//! The fleet path end to end, with the shipped files of deploy/fleet: an
//! exporter on the fake NVML is scraped by vmagent (vmagent.yml, its hosts
//! job) into VictoriaMetrics (victoria-metrics.flags); vmalert
//! (vmalert.flags) evaluates the shipped deploy/prometheus/rules.yml
//! against it and sends to Alertmanager (alertmanager.yml), which posts to
//! a webhook receiver in the test. GPU 0 goes over the memory threshold:
//! GpuMemoryHigh reaches the webhook with its labels and runbook URL, then
//! resolves when the memory drops. Prometheus in agent mode
//! (prometheus-agent.yml) remote-writes the same job into VictoriaMetrics.
//!
//! What the test changes in the shipped files, and why: the example hosts
//! and ports (loopback, free ports), paths (temporary directories), the
//! Kubernetes job (needs a cluster; the static hosts job is the one run),
//! the scrape and evaluation intervals (1 s), vmalert's remote-write flush
//! (500 ms, not 5 s), VictoriaMetrics'
//! `-search.latencyOffset` (1 s: samples are queryable a second after they
//! arrive, not 30 s), and Alertmanager's `group_wait` / `group_interval`
//! (1 s, not 30 s / 5 min). The rules file is the shipped one, unchanged.
//!
//! `for: 5m`: the alert is not waited for for five minutes. The test uses
//! vmalert's own restart path instead: vmalert keeps each pending alert's
//! start in the ALERTS_FOR_STATE series (written to VictoriaMetrics) and,
//! started with `-remoteRead.url` (as the shipped flags do), reads it back
//! so a restart does not reset `for:`. The test lets the alert go pending,
//! stops vmalert, writes that series again — the same labels vmalert wrote
//! — with a start 5 minutes and 10 seconds ago, and starts vmalert again:
//! the restored alert has been pending for longer than its `for:` and
//! fires at the next evaluation, if the expression is still true.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::harness::cluster::{FakeNode, cgroup_crio, pods_resolved, team_pods, write_proc};
use crate::harness::fleet::{
    self, Proc, Webhook, alertmanager, http_post, victoria_metrics, vmagent, vmalert,
};
use crate::harness::*;

const GPU0: &str = "GPU-f1f1f1f1-0000-0000-0000-000000000000";
const GPU1: &str = "GPU-f2f2f2f2-0000-0000-0000-000000000000";
const TOTAL: u64 = 85_899_345_920;

/// GPU 0 at `used0` bytes (over 90% of TOTAL: GpuMemoryHigh), GPU 1 idle.
fn scenario(used0: u64) -> String {
    format!(
        "devices:
  - uuid: {GPU0}
    memory: {{total: {TOTAL}, reserved: 536870912, used: {used0}}}
    processes:
      - {{pid: 4102, used: {used0}}}
  - uuid: {GPU1}
    memory: {{total: {TOTAL}, reserved: 536870912, used: 1000000000}}
"
    )
}

/// Whether `a` is the GpuMemoryHigh alert of GPU 0.
fn gpu0_high(a: &Value) -> bool {
    a["labels"]["alertname"] == "GpuMemoryHigh" && a["labels"]["uuid"] == GPU0
}

/// The alerts of GpuMemoryHigh on GPU 0 the webhook got with `status`.
fn delivered(hook: &Webhook, status: &str) -> Vec<Value> {
    hook.received()
        .iter()
        .flat_map(|m| m["alerts"].as_array().cloned().unwrap_or_default())
        .filter(|a| gpu0_high(a) && a["status"] == status)
        .collect()
}

/// vmalert's state of GpuMemoryHigh on GPU 0, if it has one.
fn vmalert_state(vmalert: &Proc) -> Option<String> {
    vmalert.api("/api/v1/alerts")["data"]["alerts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|a| a["name"] == "GpuMemoryHigh" && a["labels"]["uuid"] == GPU0)
        .and_then(|a| a["state"].as_str().map(str::to_string))
}

fn logs(procs: &[&Proc]) -> String {
    procs
        .iter()
        .map(|p| format!("--- {} log:\n{}", p.name, p.log()))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn gpu_memory_high_reaches_the_webhook_through_vmagent_victoria_metrics_vmalert_and_alertmanager() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let sc = Scenario::new(&scenario(80_000_000_000));
    // GPU 0's one process is team-b's infer-7f9c pod (a CRI-O container in
    // the fake /proc, its pod on the fake API): the alert names it.
    let node = FakeNode::start(team_pods());
    write_proc(
        node.proc_root.path(),
        4102,
        "tritonserver",
        1001,
        &cgroup_crio('b'),
        &[],
    );
    let ex = Exporter::with_config(&sc, &node.config(&sc, ""), &["--sample-interval", "500ms"]);
    wait_for(
        Duration::from_secs(20),
        "pid 4102 named as pod infer-7f9c",
        || pods_resolved(&ex.metrics(), &["infer-7f9c"]).then_some(()),
    );

    let vm = victoria_metrics(dir.path());
    let hook = Webhook::start();
    let am = alertmanager(dir.path(), &hook);
    let _agent = vmagent(dir.path(), &vm, &[ex.addr.to_string()], "1s");
    // The shipped file as it is (GpuMemoryHigh's group has no interval of
    // its own: it runs at -evaluationInterval).
    let rules = repo_file("deploy/prometheus/rules.yml");
    let alerts_dir = dir.path().join("vmalert");
    std::fs::create_dir_all(&alerts_dir).unwrap();
    let mut alerter = vmalert(&alerts_dir, &rules, &vm, &am.url(), "1s");

    // The exporter's series in VictoriaMetrics, with the job the rules select.
    wait_for(
        Duration::from_secs(20),
        "GPU 0's used memory in VictoriaMetrics, job gpumem-exporter",
        || {
            let q = vm.query(
                &format!("gpu_memory_used_bytes{{job=\"gpumem-exporter\",uuid=\"{GPU0}\"}}"),
                None,
            );
            (q.values() == vec![80e9]).then_some(())
        },
    );
    // Pending in vmalert, and its start stored in VictoriaMetrics.
    let for_state = format!("ALERTS_FOR_STATE{{alertname=\"GpuMemoryHigh\",uuid=\"{GPU0}\"}}");
    let stored = wait_for(
        Duration::from_secs(20),
        "GpuMemoryHigh pending in vmalert and its ALERTS_FOR_STATE in VictoriaMetrics",
        || {
            let pending = vmalert_state(&alerter).as_deref() == Some("pending");
            let q = vm.query(&for_state, None);
            (pending && q.result.len() == 1).then(|| q.labels()[0].clone())
        },
    );
    assert!(
        delivered(&hook, "firing").is_empty(),
        "GpuMemoryHigh delivered before its `for:` passed"
    );

    // vmalert restarts, and finds the alert pending for 5m10s.
    drop(alerter);
    let five_minutes_ago = unix_now().floor() - 310.0;
    let labels: Vec<String> = stored
        .iter()
        .map(|(k, v)| format!("{k}={}", Value::String(v.as_str().unwrap_or("").into())))
        .filter(|l| !l.starts_with("__name__="))
        .collect();
    let line = format!(
        "ALERTS_FOR_STATE{{{}}} {five_minutes_ago} {}\n",
        labels.join(","),
        (unix_now() * 1000.0) as u64
    );
    assert_eq!(
        http_post(vm.addr, "/api/v1/import/prometheus", &line),
        204,
        "import {line}"
    );
    wait_for(
        Duration::from_secs(10),
        "the rewritten ALERTS_FOR_STATE in VictoriaMetrics",
        || (vm.query(&for_state, None).values() == vec![five_minutes_ago]).then_some(()),
    );
    alerter = vmalert(&alerts_dir, &rules, &vm, &am.url(), "1s");

    let firing = wait_for(
        Duration::from_secs(20),
        "GpuMemoryHigh of GPU 0 firing at the webhook",
        || delivered(&hook, "firing").into_iter().next(),
    );
    let l = &firing["labels"];
    let want = [
        ("alertname", "GpuMemoryHigh"),
        ("gpu", "0"),
        ("uuid", GPU0),
        ("job", "gpumem-exporter"),
        ("severity", "warning"),
    ];
    for (k, v) in want {
        assert_eq!(
            l[k],
            v,
            "label {k} of {firing}\n{}",
            logs(&[&vm, &alerter, &am])
        );
    }
    assert_eq!(l["instance"], ex.addr.to_string(), "{firing}");
    let a = &firing["annotations"];
    assert_eq!(
        a["runbook_url"],
        "https://github.com/gpumem-exporter/gpumem-exporter/blob/main/docs/runbooks.md#alert-gpumemoryhigh",
        "{firing}"
    );
    let description = a["description"].as_str().unwrap_or("");
    assert!(
        description.contains(GPU0) && description.contains("93.13%"),
        "the description templated with the GPU and its share: {description}"
    );
    // vmalert's `query` template: the largest holder, from the process
    // series, by its pod (a per-GPU alert's labels stay the GPU's, so a new
    // largest holder does not restart `for:`).
    assert!(
        description.ends_with("Largest holder: pod team-b/infer-7f9c (74.51GiB)."),
        "the description names GPU 0's largest holder: {description}"
    );
    // The message went to the warning receiver's path, and not as critical.
    let to_team = hook.received().iter().any(|m| {
        m["receiver"] == "gpu-team"
            && m["alerts"]
                .as_array()
                .is_some_and(|v| v.iter().any(gpu0_high))
    });
    assert!(
        to_team,
        "delivered to receiver gpu-team: {:?}",
        hook.received()
    );
    assert_eq!(vmalert_state(&alerter).as_deref(), Some("firing"));

    // The memory drops: resolved at the webhook.
    sc.write(&scenario(10_000_000_000));
    let resolved = wait_for(
        Duration::from_secs(20),
        "GpuMemoryHigh of GPU 0 resolved at the webhook",
        || delivered(&hook, "resolved").into_iter().next(),
    );
    assert_eq!(resolved["labels"]["gpu"], "0", "{resolved}");
    assert_eq!(
        resolved["annotations"]["runbook_url"], a["runbook_url"],
        "{resolved}"
    );
    eprintln!(
        "fleet: fired and resolved through vmagent, VictoriaMetrics, vmalert, Alertmanager in {:.1?}",
        started.elapsed()
    );
}

#[test]
fn prometheus_in_agent_mode_remote_writes_the_shipped_job_into_victoria_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let sc = Scenario::new(&scenario(30_000_000_000));
    let ex = Exporter::start(&sc, &["--sample-interval", "500ms"]);
    let vm = victoria_metrics(dir.path());
    let vm_url = vm.url();
    let config = fleet::scrape_config(
        "prometheus-agent.yml",
        &[ex.addr.to_string()],
        "1s",
        Some(&vm_url),
        dir.path(),
    );
    let agent = Proc::start("prometheus", dir.path(), "/-/ready", |addr| {
        vec![
            "--enable-feature=agent".to_string(),
            format!("--config.file={}", config.display()),
            format!(
                "--storage.agent.path={}",
                dir.path().join("agent").display()
            ),
            format!("--web.listen-address={addr}"),
            "--log.level=warn".into(),
        ]
    });
    let q = format!(
        "gpu_memory_used_bytes{{job=\"gpumem-exporter\",cluster=\"gpu-cluster-1\",uuid=\"{GPU0}\"}}"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if vm.query(&q, None).values() == vec![30e9] {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no {q} in VictoriaMetrics after 30 s\n{}",
            logs(&[&agent, &vm])
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The shipped files pass the checks of the programs that read them:
/// `amtool check-config`, `vmagent -dryRun` (Kubernetes job included) and
/// `vmalert -dryRun` on the shipped rules.
#[test]
fn the_shipped_fleet_files_pass_their_programs_checks() {
    let check = |program: &'static str, args: &[String]| {
        let out = std::process::Command::new(fleet::require(program))
            .args(args)
            .current_dir(repo())
            .output()
            .unwrap_or_else(|e| panic!("run {program}: {e}"));
        assert!(
            out.status.success(),
            "{program} {args:?}: {}\n{}",
            out.status,
            output_text(&out)
        );
    };
    check(
        "amtool",
        &[
            "check-config".into(),
            "deploy/fleet/alertmanager.yml".into(),
        ],
    );
    check(
        "vmagent",
        &[
            "-dryRun".into(),
            "-promscrape.config=deploy/fleet/vmagent.yml".into(),
            "-promscrape.config.strictParse".into(),
        ],
    );
    check(
        "vmalert",
        &["-dryRun".into(), "-rule=deploy/prometheus/rules.yml".into()],
    );
    // Every shipped flag is one the program knows: it would refuse to
    // start otherwise (`-dryRun` checks the flags too).
    for (program, file) in [("vmagent", "vmagent"), ("vmalert", "vmalert")] {
        let mut flags = fleet::shipped_flags(
            file,
            &[],
            &[
                "-dryRun".into(),
                "-promscrape.config=deploy/fleet/vmagent.yml".into(),
                "-rule=deploy/prometheus/rules.yml".into(),
            ],
        );
        if program == "vmalert" {
            flags.retain(|f| !f.starts_with("-promscrape."));
        } else {
            flags.retain(|f| !f.starts_with("-rule="));
        }
        check(program, &flags);
    }
}
