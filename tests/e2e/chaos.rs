//! Chaos soak: one exporter on the fake NVML with 8 GPUs while a seeded
//! random schedule throws every fault the fakes can make at it, together
//! and over time, as a node fails:
//!
//! - a GPU lost (`error: gpu_lost`) and healed; a driver reload (every
//!   call answering `runtime_error`, init failing) and back;
//! - MIG created (two instances, the GPU's processes moved into them) and
//!   destroyed;
//! - process churn, 100 starts and exits a minute (each with its /proc
//!   entry; half of them in one of 16 pods);
//! - the kubelet restarted (its pod-resources socket gone, then back);
//!   the Kubernetes API restarted (every connection dropped, the port
//!   refusing, then the first watch answered 410 Gone);
//! - SIGHUP every few seconds, with a valid config (which switches the
//!   utilisation collector on or off) or an invalid one (kept out);
//! - 50 concurrent scrapers, and a slowloris flood (300 connections
//!   trickling header bytes) from the scrapers' own address.
//!
//! After every step an oracle waits (within a bound) until what is served
//! equals the model of the scenario, then checks: every GPU's memory to
//! the byte (the used bytes change every step, so a stale snapshot shows),
//! the process series exactly the live pids with their bytes, pod and MIG
//! instance, no series of a lost GPU, the MIG instances, the utilisation
//! series present exactly when the running config says so, the
//! allocations exactly the kubelet's, the config reload counters exactly
//! the valid and invalid SIGHUPs sent, `/readyz` 200 exactly when NVML is
//! up and a GPU answers, `/healthz` 200, and no panic, no warn or error
//! line that a fault of the last 30 s does not explain. At the end: no
//! scrape failed (a 503 only while not ready), RSS flat, and the counters
//! add up (lists, watch restarts, NVML re-opens, kubelet errors,
//! evictions).
//!
//! `CHAOS_SECONDS` (default 150: the CI length) and `CHAOS_SEED` (default:
//! from the clock, printed first) replay a run: a failure prints the seed
//! and the step. The documented long run (RELIABILITY.md):
//!
//!     CHAOS_SECONDS=3600 cargo test --features external-tools --test e2e chaos:: -- --nocapture
//!
//! The schedule comes from SplitMix64, written here in six lines rather
//! than taken from a crate: a printed seed must replay the same schedule
//! with any future version of the dependencies.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::harness::cluster::{FakeNode, NODE, containerd_cgroup, pod, write_proc};
use crate::harness::kubelet::{self, FakeKubelet, proto};
use crate::harness::*;

const GPUS: usize = 8;
const PODS: usize = 16;
const TOTAL: u64 = 150_754_820_096;
const RESERVED: u64 = 644_939_776;
/// Live GPU processes the churn keeps, about.
const LIVE: usize = 40;
const CHURN_PER_MINUTE: f64 = 100.0;
const SCRAPERS: usize = 50;
const SLOWLORIS: usize = 300;
/// Config SIGHUPs, one every this long.
const HUP_EVERY: Duration = Duration::from_secs(3);
/// How long a fault explains a warn or error line after it was made.
const EXPLAINS_FOR: Duration = Duration::from_secs(30);

/// SplitMix64 (Steele, Lea, Flood 2014).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.next() % (hi - lo + 1))
    }
}

fn uuid(g: usize) -> String {
    format!("GPU-c4a05000-0000-4000-8000-{g:012x}")
}

fn mig_uuid(g: usize, gi: usize) -> String {
    format!("MIG-c4a05000-0000-4000-8000-{g:08x}{gi:04x}")
}

fn pod_name(p: usize) -> String {
    format!("job-{p:02}")
}

fn pod_uid(p: usize) -> String {
    format!("c4a05000-0000-4000-8000-{p:012x}")
}

fn container_id(p: usize) -> String {
    format!("{p:064x}")
}

/// The GPU a pod's kubelet allocation names.
fn pod_gpu(p: usize) -> usize {
    p % GPUS
}

#[derive(Clone, Debug)]
struct Proc {
    pid: u32,
    gpu: usize,
    pod: Option<usize>,
}

impl Proc {
    fn used(&self) -> u64 {
        u64::from(self.pid) * 4096
    }
}

/// The kinds of fault, for the log oracle and the figures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Churn,
    GpuLost,
    GpuHealed,
    DriverReload,
    MigCreated,
    MigDestroyed,
    KubeletRestart,
    ApiRestart,
    HupValid,
    HupInvalid,
}

/// What the scenario says: the model the oracle holds the exporter to.
struct World {
    step: u64,
    lost: [bool; GPUS],
    mig: [bool; GPUS],
    /// The MIG layout the exporter last read while the GPU answered: a
    /// down GPU keeps its identity series (gpu_info, gpu_mig_info) from
    /// then, without memory.
    mig_seen: [bool; GPUS],
    driver_down: bool,
    procs: Vec<Proc>,
    next_pid: u32,
    utilization: bool,
    hups_valid: u64,
    hups_invalid: u64,
}

impl World {
    fn used(&self, g: usize) -> u64 {
        (g as u64 + 1) * (1 << 30) + self.step * 4096
    }

    fn mig_used(&self, g: usize, gi: usize) -> u64 {
        (gi as u64) * (1 << 28) + g as u64 * 4096 + self.step
    }

    /// The MIG instance (1 or 2) a process runs in, on a MIG GPU.
    fn instance(p: &Proc) -> usize {
        1 + (p.pid as usize % 2)
    }

    fn yaml(&self) -> String {
        let mut y = String::new();
        if self.driver_down {
            y.push_str(
                "init_error: lib_rm_version_mismatch\nruntime_error: lib_rm_version_mismatch\n",
            );
        }
        y.push_str("devices:\n");
        for g in 0..GPUS {
            y.push_str(&format!(
                "  - uuid: {}\n    pci_bus_id: \"00000000:{:02x}:00.0\"\n    memory: {{total: {TOTAL}, reserved: {RESERVED}, used: {}}}\n    utilization: {{gpu: {}, memory: {}}}\n",
                uuid(g),
                0x10 + g,
                self.used(g),
                40 + g,
                10 + g
            ));
            if self.lost[g] {
                y.push_str("    error: gpu_lost\n");
            }
            let procs: Vec<&Proc> = self.procs.iter().filter(|p| p.gpu == g).collect();
            let list = |ps: &[&Proc]| {
                let items: Vec<String> = ps
                    .iter()
                    .map(|p| format!("{{pid: {}, used: {}}}", p.pid, p.used()))
                    .collect();
                format!("[{}]", items.join(", "))
            };
            if self.mig[g] {
                y.push_str("    mig_devices:\n");
                for gi in 1..=2 {
                    let inside: Vec<&Proc> = procs
                        .iter()
                        .copied()
                        .filter(|p| Self::instance(p) == gi)
                        .collect();
                    y.push_str(&format!(
                        "      - uuid: {}\n        gpu_instance_id: {gi}\n        compute_instance_id: 0\n        memory: {{total: 70000000000, reserved: 0, used: {}}}\n        processes: {}\n",
                        mig_uuid(g, gi),
                        self.mig_used(g, gi),
                        list(&inside)
                    ));
                }
            } else {
                y.push_str(&format!("    processes: {}\n", list(&procs)));
            }
        }
        y
    }

    /// After a settled step: the layout of every answering GPU was read.
    fn see_mig(&mut self) {
        for g in 0..GPUS {
            if !self.driver_down && !self.lost[g] {
                self.mig_seen[g] = self.mig[g];
            }
        }
    }

    fn ready(&self) -> bool {
        !self.driver_down && self.lost.iter().any(|l| !l)
    }
}

/// One process in the fake /proc: in a pod's container, or a plain job of
/// alice's.
fn add_proc(root: &std::path::Path, p: &Proc) {
    let cgroup = match p.pod {
        Some(n) => containerd_cgroup(&pod_uid(n), &container_id(n)),
        None => format!("0::/system.slice/job-{}.service\n", p.pid),
    };
    write_proc(root, p.pid, "python3", 1000, &cgroup, &[]);
}

fn api_pods() -> Vec<Value> {
    (0..PODS)
        .map(|n| {
            pod(
                "chaos",
                &pod_name(n),
                &pod_uid(n),
                NODE,
                "10",
                &[("main", Some(format!("containerd://{}", container_id(n))))],
            )
        })
        .collect()
}

fn kubelet_pods() -> Vec<proto::PodResources> {
    (0..PODS)
        .map(|n| {
            let u = uuid(pod_gpu(n));
            let ids = [u.as_str()];
            kubelet::pod(
                "chaos",
                &pod_name(n),
                &[("main", &[("nvidia.com/gpu", &ids[..])])],
            )
        })
        .collect()
}

/// The config file: the node's (procfs, passwd, the API, the kubelet),
/// and the utilisation collector on or off; `broken` adds a key with a
/// value of the wrong type, which a reload must refuse.
fn config(
    node: &FakeNode,
    sc: &Scenario,
    socket: &std::path::Path,
    utilization: bool,
    broken: bool,
) -> String {
    let processes = if broken { "  top_n: lots\n" } else { "" };
    format!(
        "{}collectors:\n  utilization: {utilization}\n",
        node.config_with(
            sc,
            processes,
            &format!(
                "  pod_resources_socket: {}\n  pod_resources_interval: 200ms\n",
                socket.display()
            ),
        )
    )
}

/// Every way what is served differs from `w` (empty: it matches).
fn diff(w: &World, m: &Metrics) -> Vec<String> {
    let mut out = Vec::new();
    let mut want_procs: BTreeMap<String, (usize, u64, Option<String>, Option<String>)> =
        BTreeMap::new();
    for g in 0..GPUS {
        let gs = g.to_string();
        let u = uuid(g);
        let up = !w.driver_down && !w.lost[g];
        let got_up = m.find("gpu_up", &[("gpu", &gs)]);
        if got_up.len() != 1 || got_up[0].1 != if up { 1.0 } else { 0.0 } {
            out.push(format!("gpu {g}: gpu_up {got_up:?}, want {}", u8::from(up)));
        }
        let ls = [("gpu", gs.as_str()), ("uuid", u.as_str())];
        let mem = |name: &str| m.get_u64(name, &ls);
        let mig_info = m.find("gpu_mig_info", &[("uuid", &u)]).len();
        let util = m.get("gpu_utilization_ratio", &ls);
        if up {
            let used = w.used(g);
            for (name, want) in [
                ("gpu_memory_used_bytes", used),
                ("gpu_memory_total_bytes", TOTAL),
                ("gpu_memory_reserved_bytes", RESERVED),
                ("gpu_memory_free_bytes", TOTAL - RESERVED - used),
            ] {
                if mem(name) != Some(want) {
                    out.push(format!("gpu {g}: {name} {:?}, want {want}", mem(name)));
                }
            }
            let want_mig = if w.mig[g] { 2 } else { 0 };
            if mig_info != want_mig {
                out.push(format!(
                    "gpu {g}: {mig_info} MIG instances, want {want_mig}"
                ));
            }
            if w.mig[g] {
                for gi in 1..=2 {
                    let gis = gi.to_string();
                    let got = m.get_u64(
                        "gpu_mig_memory_used_bytes",
                        &[
                            ("gpu", &gs),
                            ("uuid", &u),
                            ("gpu_instance_id", &gis),
                            ("compute_instance_id", "0"),
                        ],
                    );
                    if got != Some(w.mig_used(g, gi)) {
                        out.push(format!(
                            "gpu {g} instance {gi}: used {got:?}, want {}",
                            w.mig_used(g, gi)
                        ));
                    }
                }
            }
            let want_util = w.utilization.then(|| (40 + g) as f64 / 100.0);
            if util != want_util {
                out.push(format!("gpu {g}: utilization {util:?}, want {want_util:?}"));
            }
            for p in w.procs.iter().filter(|p| p.gpu == g) {
                let gi = w.mig[g].then(|| World::instance(p).to_string());
                want_procs.insert(p.pid.to_string(), (g, p.used(), p.pod.map(pod_name), gi));
            }
        } else {
            let mig_memory = m.find("gpu_mig_memory_used_bytes", &[("uuid", &u)]).len();
            let want_mig = if w.mig_seen[g] { 2 } else { 0 };
            if mem("gpu_memory_used_bytes").is_some()
                || mig_memory != 0
                || util.is_some()
                || mig_info != want_mig
            {
                out.push(format!(
                    "gpu {g}: down; served used {:?}, {mig_info} MIG instances (want {want_mig}, the last layout read), {mig_memory} with memory, utilisation {util:?}",
                    mem("gpu_memory_used_bytes")
                ));
            }
        }
    }
    let mut got_procs = BTreeMap::new();
    for (l, v) in m.find("gpu_process_memory_used_bytes", &[]) {
        let pid = l.get("pid").cloned().unwrap_or_default();
        let g: usize = l
            .get("gpu")
            .and_then(|g| g.parse().ok())
            .unwrap_or(usize::MAX);
        got_procs.insert(
            pid,
            (
                g,
                v as u64,
                l.get("pod").cloned(),
                l.get("gpu_instance_id").cloned(),
            ),
        );
    }
    if got_procs != want_procs {
        let got: BTreeSet<_> = got_procs.iter().collect();
        let want: BTreeSet<_> = want_procs.iter().collect();
        out.push(format!(
            "process series: served but not in the scenario {:?}; in the scenario but not served {:?}",
            got.difference(&want).take(8).collect::<Vec<_>>(),
            want.difference(&got).take(8).collect::<Vec<_>>()
        ));
    }
    let infos = m.find("gpu_process_info", &[]).len();
    if infos != want_procs.len() {
        out.push(format!(
            "{infos} gpu_process_info series, want {}",
            want_procs.len()
        ));
    }
    // The kubelet is always back when the oracle looks: every pod's row.
    let allocated: BTreeSet<String> = m
        .find("gpu_allocation_info", &[("namespace", "chaos")])
        .into_iter()
        .filter_map(|(l, _)| l.get("pod").cloned())
        .collect();
    let want_alloc: BTreeSet<String> = (0..PODS).map(pod_name).collect();
    if allocated != want_alloc {
        out.push(format!(
            "allocations of {} pods, want {PODS}",
            allocated.len()
        ));
    }
    for (result, want) in [("success", w.hups_valid), ("failure", w.hups_invalid)] {
        let got = m.get(
            "gpumem_exporter_config_reloads_total",
            &[("result", result)],
        );
        if got != Some(want as f64) {
            out.push(format!("config reloads {result} {got:?}, want {want}"));
        }
    }
    if !w.driver_down {
        let ts = m
            .get("gpumem_exporter_last_sample_timestamp_seconds", &[])
            .unwrap_or(0.0);
        if unix_now() - ts > 2.0 {
            out.push(format!("last sample {:.1} s old", unix_now() - ts));
        }
    }
    out
}

// ------------------------------------------------------------------ load

/// What the 50 scrapers saw.
#[derive(Default)]
struct Scrapes {
    ok: u64,
    not_ready: u64,
    failures: Vec<String>,
    slowest: Duration,
}

fn scrape(addr: SocketAddr) -> Result<(u16, Duration), String> {
    let deadline = Deadline::Steps {
        connect: Duration::from_secs(5),
        read: Duration::from_secs(10),
    };
    let scrape = scrape_within(addr, "/metrics", &[], deadline).map_err(|e| e.to_string())?;
    let r = scrape.response();
    let complete = r
        .header("content-length")
        .and_then(|l| l.parse::<usize>().ok())
        .is_some_and(|l| l == r.body.len());
    match r.status {
        200 if complete && r.body.contains("gpumem_exporter_build_info") => Ok((200, scrape.took)),
        503 if r.body.contains("NVML") => Ok((503, scrape.took)),
        s => Err(format!(
            "status {s} ({} bytes, complete {complete})",
            r.body.len()
        )),
    }
}

fn scrapers(
    addr: SocketAddr,
    stop: &Arc<AtomicBool>,
    seen: &Arc<Mutex<Scrapes>>,
) -> Vec<std::thread::JoinHandle<()>> {
    (0..SCRAPERS)
        .map(|i| {
            let (stop, seen) = (Arc::clone(stop), Arc::clone(seen));
            std::thread::spawn(move || {
                // Spread over the second, as scrape offsets are.
                std::thread::sleep(Duration::from_millis(20 * i as u64));
                while !stop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    let r = scrape(addr);
                    let mut s = seen.lock().unwrap();
                    match r {
                        Ok((200, took)) => {
                            s.ok += 1;
                            s.slowest = s.slowest.max(took);
                        }
                        Ok(_) => s.not_ready += 1,
                        Err(e) => s.failures.push(e),
                    }
                    drop(s);
                    std::thread::sleep(Duration::from_secs(1).saturating_sub(t.elapsed()));
                }
            })
        })
        .collect()
}

/// Slowloris: [`SLOWLORIS`] connections, each sending a request line and
/// then a header line a second, never finishing; a closed one is opened
/// again. Returns the connections opened.
fn slowloris(addr: SocketAddr, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let open = |opened: &mut u64| {
            let s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
            s.set_write_timeout(Some(Duration::from_millis(50))).ok();
            let mut s = s;
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: slow\r\n")
                .ok()?;
            *opened += 1;
            Some(s)
        };
        let mut opened = 0;
        let mut conns: Vec<Option<TcpStream>> = (0..SLOWLORIS).map(|_| None).collect();
        while !stop.load(Ordering::Relaxed) {
            for c in conns.iter_mut() {
                let alive = c
                    .as_mut()
                    .is_some_and(|s| s.write_all(b"X-Slow: 1\r\n").is_ok());
                if !alive {
                    *c = open(&mut opened);
                }
            }
            std::thread::sleep(Duration::from_secs(1));
        }
        opened
    })
}

/// The fault kinds a warn or error line of the exporter may come from
/// (its `msg`); `None`: no fault explains it.
fn explained_by(line: &str) -> Option<&'static [Kind]> {
    let msg = line.split(" msg=").nth(1).unwrap_or(line);
    const RULES: &[(&str, &[Kind])] = &[
        ("kubelet pod-resources", &[Kind::KubeletRestart]),
        ("kubernetes pod watcher", &[Kind::ApiRestart]),
        ("kubernetes ResourceSlice watcher", &[Kind::ApiRestart]),
        // kube-client's own line when a watch stream's connection drops.
        ("eof in poll", &[Kind::ApiRestart]),
        ("config reload failed", &[Kind::HupInvalid]),
        // A process exited between NVML's list and the /proc read.
        ("not visible in /proc", &[Kind::Churn]),
        ("NVML", &[Kind::DriverReload, Kind::GpuLost]),
        (
            "GPU",
            &[
                Kind::GpuLost,
                Kind::DriverReload,
                Kind::MigCreated,
                Kind::MigDestroyed,
            ],
        ),
        (
            "MIG",
            &[Kind::MigCreated, Kind::MigDestroyed, Kind::DriverReload],
        ),
    ];
    RULES
        .iter()
        .find(|(needle, _)| msg.contains(needle))
        .map(|(_, kinds)| *kinds)
}

#[test]
fn faults_together_over_time_keep_the_served_bytes_true() {
    let secs = env_u64("CHAOS_SECONDS", 150);
    let seed: u64 = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!("chaos: CHAOS_SEED={seed} CHAOS_SECONDS={secs}");
    let _one = heavy();
    let mut rng = Rng(seed);

    let mut node = FakeNode::start(api_pods());
    let mut kubelet = FakeKubelet::start(kubelet_pods());
    let mut w = World {
        step: 0,
        lost: [false; GPUS],
        mig: [false; GPUS],
        mig_seen: [false; GPUS],
        driver_down: false,
        procs: Vec::new(),
        next_pid: 300_000,
        utilization: true,
        hups_valid: 0,
        hups_invalid: 0,
    };
    let proc_root = node.proc_root.path().to_path_buf();
    let new_proc = |w: &mut World, rng: &mut Rng| {
        let p = Proc {
            pid: w.next_pid,
            gpu: rng.below(GPUS),
            pod: (rng.below(2) == 0).then(|| rng.below(PODS)),
        };
        w.next_pid += 1;
        add_proc(&proc_root, &p);
        w.procs.push(p);
    };
    for _ in 0..LIVE {
        new_proc(&mut w, &mut rng);
    }
    let sc = Scenario::new(&w.yaml());
    let cfg_text = config(&node, &sc, &kubelet.socket, true, false);
    let ex = Exporter::with_config(&sc, &cfg_text, &["--mig-rescan-interval", "1s"]);
    let pid = ex.child.id();

    let settle = |w: &World, what: &str, bound: Duration, ex: &Exporter| -> Metrics {
        let t = Instant::now();
        loop {
            let r = ex.get("/metrics");
            let last = if r.status == 200 {
                let m = Metrics::parse(&r.body);
                let d = diff(w, &m);
                if d.is_empty() {
                    return m;
                }
                d
            } else {
                vec![format!("/metrics {}: {}", r.status, r.body.trim())]
            };
            assert!(
                t.elapsed() < bound,
                "CHAOS_SEED={seed} step {} ({what}): after {bound:?} the exporter still serves something else:\n{}",
                w.step,
                last.join("\n")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    settle(&w, "start", Duration::from_secs(30), &ex);

    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Scrapes::default()));
    let scraping = scrapers(ex.addr, &stop, &seen);
    let flood = slowloris(ex.addr, Arc::clone(&stop));

    let start = Instant::now();
    let mut faults: BTreeMap<Kind, u64> = BTreeMap::new();
    let mut last_made: BTreeMap<Kind, Instant> = BTreeMap::new();
    let mut churned = 0u64;
    let mut next_hup = start + HUP_EVERY;
    let mut next_rss = start;
    let mut rss: Vec<(u64, u64)> = Vec::new();
    let mut log_seen = 0usize;
    let mut kubelet_down_long = false;
    let mut api_restarts = 0u64;
    let mut driver_reloads = 0u64;
    let mut steps_settled = Duration::ZERO;
    while start.elapsed() < Duration::from_secs(secs) {
        w.step += 1;
        let mut made: Vec<Kind> = Vec::new();
        // Process churn at its rate: one exits, one starts.
        let due = (start.elapsed().as_secs_f64() / 60.0 * CHURN_PER_MINUTE) as u64;
        while churned < due {
            churned += 1;
            if !w.procs.is_empty() {
                let gone = w.procs.remove(rng.below(w.procs.len()));
                let _ = std::fs::remove_dir_all(node.proc_root.path().join(gone.pid.to_string()));
            }
            new_proc(&mut w, &mut rng);
            made.push(Kind::Churn);
        }
        let mut bound = Duration::from_secs(20);
        let mut what = String::from("churn");
        match rng.below(100) {
            0..=29 => {}
            30..=41 => {
                let g = rng.below(GPUS);
                if w.lost.iter().filter(|l| **l).count() < 3 && !w.lost[g] {
                    w.lost[g] = true;
                    made.push(Kind::GpuLost);
                    what = format!("GPU {g} lost");
                }
            }
            42..=53 => {
                if let Some(g) = (0..GPUS).find(|g| w.lost[*g]) {
                    w.lost[g] = false;
                    made.push(Kind::GpuHealed);
                    what = format!("GPU {g} healed");
                }
            }
            54..=65 => {
                let g = rng.below(GPUS);
                w.mig[g] = !w.mig[g];
                made.push(if w.mig[g] {
                    Kind::MigCreated
                } else {
                    Kind::MigDestroyed
                });
                what = format!(
                    "GPU {g} MIG {}",
                    if w.mig[g] { "created" } else { "destroyed" }
                );
            }
            66..=71 => {
                // The driver goes away for a while, then comes back.
                w.driver_down = true;
                sc.write(&w.yaml());
                settle(&w, "driver unloaded", bound, &ex);
                assert_eq!(
                    ex.get("/readyz").status,
                    503,
                    "CHAOS_SEED={seed} step {}: not ready while the driver is away",
                    w.step
                );
                std::thread::sleep(rng.millis(300, 2000));
                w.driver_down = false;
                // NVML re-opened: a GPU that does not answer then has no
                // layout read in this NVML session.
                for g in 0..GPUS {
                    if w.lost[g] {
                        w.mig_seen[g] = false;
                    }
                }
                driver_reloads += 1;
                made.push(Kind::DriverReload);
                what = "driver reloaded".into();
                // NVML is re-opened with backoff.
                bound = Duration::from_secs(60);
            }
            72..=85 => {
                let down = rng.millis(100, 1500);
                kubelet_down_long |= down >= Duration::from_millis(600);
                kubelet.restart(down);
                made.push(Kind::KubeletRestart);
                what = format!("kubelet restarted ({down:?} away)");
            }
            _ => {
                let down = rng.millis(100, 1500);
                node.rt.block_on(node.api.restart(down));
                api_restarts += 1;
                made.push(Kind::ApiRestart);
                what = format!("API restarted ({down:?} away, then 410)");
            }
        }
        if Instant::now() >= next_hup {
            next_hup += HUP_EVERY;
            if rng.below(3) == 0 {
                sc.file(
                    "config.yaml",
                    config(&node, &sc, &kubelet.socket, w.utilization, true).as_bytes(),
                );
                w.hups_invalid += 1;
                made.push(Kind::HupInvalid);
            } else {
                w.utilization = !w.utilization;
                sc.file(
                    "config.yaml",
                    config(&node, &sc, &kubelet.socket, w.utilization, false).as_bytes(),
                );
                w.hups_valid += 1;
                made.push(Kind::HupValid);
            }
            ex.signal_only("HUP");
        }
        let now = Instant::now();
        for k in &made {
            *faults.entry(*k).or_default() += 1;
            last_made.insert(*k, now);
        }
        for g in 0..GPUS {
            if w.lost[g] {
                last_made.insert(Kind::GpuLost, now);
            }
        }
        sc.write(&w.yaml());
        let t = Instant::now();
        settle(&w, &what, bound, &ex);
        steps_settled += t.elapsed();
        w.see_mig();
        let ready = ex.get("/readyz").status;
        assert_eq!(
            ready == 200,
            w.ready(),
            "CHAOS_SEED={seed} step {} ({what}): /readyz {ready}",
            w.step
        );
        let health = ex.get("/healthz");
        assert_eq!(
            health.status, 200,
            "CHAOS_SEED={seed} step {} ({what}): /healthz {}",
            w.step, health.body
        );
        // Every new warn or error line is explained by a recent fault.
        let lines: Vec<String> = ex.stderr.lock().unwrap()[log_seen..].to_vec();
        log_seen += lines.len();
        for line in &lines {
            assert!(
                !line.contains("panicked"),
                "CHAOS_SEED={seed} step {}: {line}",
                w.step
            );
            if !(line.contains("level=warn") || line.contains("level=error")) {
                continue;
            }
            let explained = explained_by(line).is_some_and(|kinds| {
                kinds.iter().any(|k| {
                    last_made
                        .get(k)
                        .is_some_and(|at| at.elapsed() <= EXPLAINS_FOR)
                })
            });
            assert!(
                explained,
                "CHAOS_SEED={seed} step {} ({what}): a line no recent fault explains: {line}",
                w.step
            );
        }
        if Instant::now() >= next_rss {
            next_rss += Duration::from_secs(5);
            rss.push((
                start.elapsed().as_secs(),
                status_kib(pid, "VmRSS:").unwrap_or(0),
            ));
        }
    }
    stop.store(true, Ordering::Relaxed);
    for s in scraping {
        s.join().unwrap();
    }
    let slow_opened = flood.join().unwrap();
    let seen = std::mem::take(&mut *seen.lock().unwrap());

    // The counters add up. Every 410 the API answered makes a re-list
    // (two restarts close together may share one), once the watcher's
    // backoff has let it ask again.
    let refused = node.api.state.lock().unwrap().watches_refused;
    let t = Instant::now();
    let m = loop {
        let m = ex.metrics();
        let lists = m
            .get("gpumem_exporter_kubernetes_lists_total", &[])
            .unwrap_or(0.0);
        if lists >= (1 + refused) as f64 || t.elapsed() > Duration::from_secs(30) {
            break m;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let c = |name: &str| m.find(name, &[]).iter().map(|(_, v)| v).sum::<f64>();
    let figures = format!(
        "chaos: seed {seed}, {:.0} s, {} steps (settled in {:.2} s on average); faults {faults:?}; \
         scrapes {} ok, {} not ready (503), {} failed, slowest {:?}; slowloris opened {slow_opened} connections, \
         exporter evicted {}; API restarts {api_restarts}, 410 answers {refused}; counters: lists {}, watch restarts {}, NVML re-opens {}, kubelet errors {}, reloads ok {} failed {}; \
         RSS KiB (t_s, VmRSS) {rss:?}; VmHWM {} KiB",
        start.elapsed().as_secs_f64(),
        w.step,
        steps_settled.as_secs_f64() / w.step.max(1) as f64,
        seen.ok,
        seen.not_ready,
        seen.failures.len(),
        seen.slowest,
        c("gpumem_exporter_http_connections_evicted_total"),
        c("gpumem_exporter_kubernetes_lists_total"),
        c("gpumem_exporter_kubernetes_watch_restarts_total"),
        c("gpumem_exporter_nvml_reinit_attempts_total"),
        c("gpumem_exporter_pod_resources_errors_total"),
        w.hups_valid,
        w.hups_invalid,
        status_kib(pid, "VmHWM:").unwrap_or(0),
    );
    eprintln!("{figures}");
    assert!(
        seen.failures.is_empty(),
        "CHAOS_SEED={seed}: {} scrapes failed: {:?}",
        seen.failures.len(),
        &seen.failures[..seen.failures.len().min(10)]
    );
    assert!(seen.ok > 0);
    // /metrics answers 503 only while NVML is not open.
    if driver_reloads == 0 {
        assert_eq!(seen.not_ready, 0, "{figures}");
    }
    assert!(
        c("gpumem_exporter_kubernetes_lists_total") >= (1 + refused) as f64,
        "a re-list per 410: {figures}"
    );
    assert!(refused >= 1 || api_restarts == 0, "{figures}");
    assert!(
        c("gpumem_exporter_kubernetes_watch_restarts_total") >= refused as f64,
        "a watch restart per 410: {figures}"
    );
    assert!(
        c("gpumem_exporter_nvml_reinit_attempts_total") >= driver_reloads as f64,
        "an NVML re-open per driver reload: {figures}"
    );
    if kubelet_down_long {
        assert!(
            c("gpumem_exporter_pod_resources_errors_total") >= 1.0,
            "{figures}"
        );
    }
    assert!(slow_opened >= SLOWLORIS as u64, "{figures}");
    // RSS flat: the last quarter's highest within 2 MiB of the second
    // quarter's (the first is warm-up).
    let quarter = |q: usize| {
        let n = rss.len();
        rss[n * q / 4..n * (q + 1) / 4]
            .iter()
            .map(|(_, r)| *r)
            .max()
            .unwrap_or(0)
    };
    assert!(
        rss.len() >= 8,
        "RSS needs 8 samples, one every 5 s: CHAOS_SECONDS of at least 40; {figures}"
    );
    assert!(quarter(3) <= quarter(1) + 2048, "RSS grew: {figures}");
    drop(kubelet);
}
