//! Shared by the benches: the 8 GPU × 256 process shape, as a
//! [`Snapshot`] built directly and as a fake-NVML scenario, plus the fake
//! library itself and real processes for the scenario's pids.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use criterion::Criterion;
use gpumem_exporter::testing::gpu::{ErrorKind, Operation};
use gpumem_exporter::testing::model::{
    DeviceInfo, DeviceSample, DriverInfo, DurationHistogram, MemoryInfo, ProcIdentity,
    ProcessSample, Snapshot,
};
use gpumem_exporter::testing::sample::SAMPLE_DURATION_BUCKETS;

pub const GPUS: usize = 8;
pub const PROCESSES: usize = 256;

/// H200 figures, as the fake's defaults and the smoke test saw them.
pub const TOTAL: u64 = 150_754_820_096;
pub const RESERVED: u64 = 644_939_776;
/// CUDA context and driver overhead on top of the processes' bytes.
pub const OVERHEAD: u64 = 8 * 1024 * 1024;

/// Bytes of the `k`-th process: 256 MiB + k × 256 KiB, so the 256 of one
/// GPU add up to ~72 GiB and every figure has 9–11 digits, as on a busy GPU.
pub fn process_bytes(k: usize) -> u64 {
    (256 << 20) + (k as u64) * (256 << 10)
}

pub fn used_bytes() -> u64 {
    (0..PROCESSES).map(process_bytes).sum::<u64>() + OVERHEAD
}

pub fn uuid(gpu: usize) -> String {
    format!("GPU-6f1c2a9e-4b1d-8c3e-9a7f-{gpu:012x}")
}

/// Criterion with short runs: the whole `cargo bench` stays within a few
/// minutes on 2 cores. Flags on the command line still override.
pub fn criterion() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(50)
        .configure_from_args()
}

/// True under `cargo bench` (criterion gets `--bench`), false under
/// `cargo test --benches`, where each bench runs once as a smoke test.
pub fn benching() -> bool {
    std::env::args().any(|a| a == "--bench")
}

/// A snapshot of 8 GPUs × 256 processes, as the sampler would publish it
/// after a while: peaks, histograms with observations, one error counter.
/// With `pods`, as on a Kubernetes node: every process in a pod of its own,
/// so every label has a value (the largest body); without, as on a bare
/// host (namespace, pod and container empty).
pub fn snapshot(pods: bool) -> Snapshot {
    let names = [
        "python3",
        "pt_main_thread",
        "torchrun",
        "vllm",
        "tritonserver",
    ];
    // One pod per process, as in a cluster of single-process training pods.
    let ident = |g: usize, k: usize| {
        let n = g * PROCESSES + k;
        Arc::new(ProcIdentity {
            comm: Arc::from(names[k % names.len()]),
            user: Arc::from("1000"),
            container_id: Arc::from(if pods {
                format!("{n:064x}")
            } else {
                String::new()
            }),
            pod_uid: Arc::from(if pods {
                format!("6f1c2a9e-4b1d-8c3e-9a7f-{n:012x}")
            } else {
                String::new()
            }),
            slurm: None,
            cmdline: None,
            cgroup: None,
            namespace: Arc::from(if pods { "ml-training" } else { "" }),
            pod: Arc::from(if pods {
                format!("trainer-7d9f8c6b5-{n:05}")
            } else {
                String::new()
            }),
            container: Arc::from(if pods { "trainer" } else { "" }),
            engine: None,
            start_time: Some(1_000 + n as u64),
        })
    };
    let mut sample = DurationHistogram::new(SAMPLE_DURATION_BUCKETS);
    let mut nvml = DurationHistogram::new(SAMPLE_DURATION_BUCKETS);
    for i in 0..3600 {
        sample.observe(0.004 + (i % 7) as f64 * 0.001);
        nvml.observe(0.003 + (i % 5) as f64 * 0.001);
    }
    let mut errors = BTreeMap::new();
    errors.insert((Operation::MEMORY_INFO, ErrorKind::GpuLost), 3u64);
    let devices = (0..GPUS)
        .map(|g| {
            let used = used_bytes();
            let processes: Vec<ProcessSample> = (0..PROCESSES)
                .map(|k| ProcessSample {
                    pid: 1_200_000 + (g * PROCESSES + k) as u32 * 7,
                    used_bytes: Some(process_bytes(k)),
                    ident: ident(g, k),
                    gpu_instance_id: None,
                    compute_instance_id: None,
                    used_peak_bytes: Some(process_bytes(k) + (k as u64 % 3) * (64 << 20)),
                    torch: None,
                    readings: Default::default(),
                })
                .collect();
            DeviceSample {
                info: Arc::new(DeviceInfo {
                    gpu: g.to_string(),
                    uuid: uuid(g),
                    name: "NVIDIA H200".into(),
                    pci_bus_id: format!("00000000:{:02X}:00.0", 0x18 + g * 0x10),
                    memory: Default::default(),
                }),
                memory: Some(MemoryInfo {
                    total: TOTAL,
                    reserved: Some(RESERVED),
                    used,
                    free: TOTAL - RESERVED - used,
                }),
                used_peak_bytes: Some(used + (8 << 30)),
                processes: Arc::from(processes),
                other: None,
                mig: Arc::from(Vec::new()),
                readings: Default::default(),
            }
        })
        .collect();
    Snapshot {
        taken_at: SystemTime::now(),
        driver: Arc::new(DriverInfo {
            driver_version: "580.159.04".into(),
            nvml_version: "13.580.159.04".into(),
            cuda_driver_version: "13.0".into(),
        }),
        devices,
        nvml_errors: Arc::new(errors),
        sample_duration: Arc::new(sample),
        sample_nvml_duration: Arc::new(nvml),
        memory_samples: 32_400,
        process_lookup_failures: 0,
        attribution_rejected: Default::default(),
        nvml_reinit_attempts: 0,
        kubernetes: None,
        torch: None,
        containers: None,
        pod_resources: None,
        job_mapping: None,
        exporter: Default::default(),
        forecasts: Default::default(),
        accounting: Default::default(),
        limits: Default::default(),
        series: Default::default(),
    }
}

/// The same shape as a fake-NVML scenario; `pids` are the 256 pids listed
/// on every GPU (real processes, so the /proc lookups do real work).
pub fn scenario_yaml(pids: &[u32]) -> String {
    let mut y = String::from("devices:\n");
    for g in 0..GPUS {
        let _ = writeln!(y, "  - uuid: {}", uuid(g));
        let used = used_bytes();
        let _ = writeln!(
            y,
            "    memory: {{total: {TOTAL}, reserved: {RESERVED}, used: {used}}}"
        );
        y.push_str("    processes:\n");
        for (k, pid) in pids.iter().enumerate() {
            let _ = writeln!(
                y,
                "      - {{pid: {pid}, used: {}, type: compute}}",
                process_bytes(k)
            );
        }
    }
    y
}

/// Build the fake NVML in release (so its own cost stays small next to
/// the exporter's) and return the path of `libfake_nvml.so`.
pub fn fake_nvml() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let status = Command::new(env!("CARGO"))
        .args(["build", "-q", "--release", "-p", "fake-nvml", "--lib"])
        .current_dir(manifest)
        .status()
        .expect("run cargo build --release -p fake-nvml");
    assert!(
        status.success(),
        "cargo build --release -p fake-nvml failed"
    );
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest.join("target"));
    let lib = target.join("release").join("libfake_nvml.so");
    assert!(lib.exists(), "{} not built", lib.display());
    lib
}

/// `n` sleeping child processes, killed on drop (and by the kernel if the
/// bench dies first: PR_SET_PDEATHSIG).
pub struct Sleepers(Vec<Child>);

impl Sleepers {
    pub fn spawn(n: usize) -> Sleepers {
        let children = (0..n)
            .map(|_| {
                let mut cmd = Command::new("sleep");
                cmd.arg("3600")
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null());
                // SAFETY: prctl is async-signal-safe; nothing else runs
                // between fork and exec.
                unsafe {
                    cmd.pre_exec(|| {
                        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                        Ok(())
                    });
                }
                cmd.spawn().expect("spawn sleep")
            })
            .collect();
        Sleepers(children)
    }

    pub fn pids(&self) -> Vec<u32> {
        self.0.iter().map(Child::id).collect()
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

/// A scenario file in a temp dir, alive as long as the value.
pub struct ScenarioFile {
    _dir: tempfile::TempDir,
    pub path: PathBuf,
}

impl ScenarioFile {
    pub fn new(yaml: &str) -> ScenarioFile {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("scenario.yaml");
        std::fs::write(&path, yaml).expect("write scenario");
        ScenarioFile { _dir: dir, path }
    }
}
