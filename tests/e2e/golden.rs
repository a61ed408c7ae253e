//! The metrics contract, byte for byte: one fixed snapshot that touches
//! every metric family the exporter serves, encoded in both formats and
//! compared with `tests/fixtures/exposition.prom` (Prometheus text 0.0.4)
//! and `tests/fixtures/exposition.om` (OpenMetrics 1.0).
//!
//! A change to a metric name, label, HELP text, value formatting or order
//! shows up as a diff of those files. Regenerate them on purpose with
//! `GOLDEN_UPDATE=1 cargo test --test e2e golden::` and commit the diff in
//! its own commit, explained.
//!
//! The build's version and git revision (labels of
//! `gpumem_exporter_build_info`) are written as `VERSION` and `REVISION` in
//! the fixtures, so a new commit does not change the contract.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, UNIX_EPOCH};

use gpumem_exporter::testing::accounting::Ledger;
use gpumem_exporter::testing::expose::{self, Format};
use gpumem_exporter::testing::gpu::{ErrorKind, Operation};
use gpumem_exporter::testing::model::{
    AllocatedDevice, AllocatorBackend, AllocatorSettings, AttributionRejections,
    BridgeSocketCounters, Busy, ContainerInfo, ContainerLookups, DeviceInfo, DeviceSample,
    DriverInfo, DurationHistogram, ExporterCounters, Idle, JobAllocation, JobMappingErrors,
    JobMappingState, KubeState, MemoryInfo, MigInfo, MigSample, OtherProcesses, ProcIdentity,
    ProcessSample, Readings, SlurmJob, Snapshot, Stale, StaleReason, TorchCounters, TorchPool,
    TorchPools, TorchStats, TorchSteps, TorchThreshold, Unattributed,
};
use gpumem_exporter::testing::readings::{
    Health, PowerThermal, ProcessUtilization, RemappedRows, RetiredPages, Utilization,
};
use gpumem_exporter::testing::sample::SAMPLE_DURATION_BUCKETS;
use gpumem_exporter::testing::trend;

use crate::harness::empty_label_lines;

#[cfg(feature = "external-tools")]
mod external;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn ident(
    comm: &str,
    user: &str,
    container_id: &str,
    pod_uid: &str,
    k8s: Option<(&str, &str, &str)>,
    cmdline: Option<&str>,
) -> Arc<ProcIdentity> {
    let (namespace, pod, container) = k8s.unwrap_or(("", "", ""));
    Arc::new(ProcIdentity {
        comm: Arc::from(comm),
        user: Arc::from(user),
        container_id: Arc::from(container_id),
        pod_uid: Arc::from(pod_uid),
        slurm: None,
        cmdline: cmdline.map(Arc::from),
        namespace: Arc::from(namespace),
        pod: Arc::from(pod),
        container: Arc::from(container),
        engine: None,
        start_time: None,
        cgroup: None,
    })
}

fn histogram(observations: &[f64]) -> Arc<DurationHistogram> {
    let mut h = DurationHistogram::new(SAMPLE_DURATION_BUCKETS);
    for &s in observations {
        h.observe(s);
    }
    Arc::new(h)
}

/// Three GPUs: 0 on a Kubernetes node with a torch-bridged process, a
/// process without a memory figure and a `pid="other"` rollup; 1 in MIG
/// mode with two instances (one whose memory query failed); 2 not
/// answering.
fn fixed_snapshot() -> Snapshot {
    let h200 = |gpu: &str, uuid: &str, bus: &str| {
        Arc::new(DeviceInfo {
            gpu: gpu.into(),
            uuid: uuid.into(),
            name: "NVIDIA H200".into(),
            pci_bus_id: bus.into(),
            memory: Default::default(),
        })
    };
    let total = 150_754_820_096;
    let reserved = 644_939_776;
    let memory = |used: u64| MemoryInfo {
        total,
        reserved: Some(reserved),
        used,
        free: total - reserved - used,
    };
    let cid = "4f3c2b1a0e9d8c7b6a5f4e3d2c1b0a9f8e7d6c5b4a3f2e1d0c9b8a7f6e5d4c3b";
    let pod_uid = "0b6e2f51-3c1d-4a8e-9f7b-2d4c6e8a0b1c";
    let trainer = ProcessSample {
        pid: 4242,
        used_bytes: Some(11_782 * MIB),
        ident: ident(
            "python3",
            "alice",
            cid,
            pod_uid,
            Some(("ml-team", "trainer-0", "trainer")),
            Some(r#"python3 train.py --token <redacted> --name "run \1""#),
        ),
        gpu_instance_id: None,
        compute_instance_id: None,
        used_peak_bytes: Some(12_000 * MIB),
        torch: Some(Arc::new(TorchStats {
            allocated: 10 * GIB,
            reserved: 11 * GIB,
            allocated_peak: 10 * GIB + 512 * MIB,
            reserved_peak: 11 * GIB + 256 * MIB,
            active: 10 * GIB + 2 * MIB,
            inactive_split: 3 * MIB,
            alloc_retries: 2,
            ooms: 1,
            pools: Some(TorchPools {
                large: TorchPool {
                    allocated: 10 * GIB - 40 * MIB,
                    reserved: 11 * GIB - 64 * MIB,
                    inactive_split: 2 * MIB,
                    segments: 37,
                },
                small: TorchPool {
                    allocated: 40 * MIB,
                    reserved: 64 * MIB,
                    inactive_split: MIB,
                    segments: 32,
                },
            }),
            limit: Some(75_377_410_048),
            allocator: Some(AllocatorSettings {
                backend: AllocatorBackend::Native,
                expandable_segments: false,
                max_split_size: Some(256 * MIB),
            }),
            oom_snapshots: Some(1),
            // 64 steps keeping 3 MiB each, 8 steps a second.
            steps: Some(TorchSteps {
                total: 812,
                allocated: Some(10 * GIB),
                growth: trend::slope(&[(749, 10 * GIB - 3 * MIB), (750, 10 * GIB)]),
                pace: Some((63, 7875)),
                window: 64,
            }),
            threshold: Some(TorchThreshold {
                bytes: 60 * GIB,
                crossings: 1,
                above: false,
            }),
        })),
        readings: Readings::default().with(ProcessUtilization {
            sm: 87,
            memory: 41,
            encoder: 0,
            decoder: 2,
        }),
    };
    // A Slurm job's step beside the pod (the job from its cgroup path).
    let slurm_step = ProcessSample {
        pid: 4343,
        used_bytes: Some(GIB),
        ident: Arc::new(ProcIdentity {
            slurm: Some(SlurmJob {
                job: Arc::from("81234"),
                step: Arc::from("0"),
                uid: Arc::from("1001"),
            }),
            ..ProcIdentity::clone(&ident("python3", "bob", "", "", None, None))
        }),
        gpu_instance_id: None,
        compute_instance_id: None,
        used_peak_bytes: Some(GIB),
        torch: None,
        // Its parent died: an orphan still holding its memory.
        readings: Readings::default().with(Stale {
            reason: StaleReason::Reparented,
            since: UNIX_EPOCH + Duration::from_secs(1_764_000_000),
        }),
    };
    let unavailable = ProcessSample {
        pid: 5151,
        used_bytes: None,
        ident: ident("Xorg", "root", "", "", None, None),
        gpu_instance_id: None,
        compute_instance_id: None,
        used_peak_bytes: None,
        torch: None,
        readings: Readings::default(),
    };
    let gpu0 = DeviceSample {
        info: h200(
            "0",
            "GPU-6f1c2a9e-4b1d-8c3e-9a7f-000000000000",
            "00000000:19:00.0",
        ),
        memory: Some(memory(11_790 * MIB + 3 * GIB)),
        used_peak_bytes: Some(16 * GIB),
        processes: Arc::from(vec![trainer, slurm_step, unavailable]),
        other: Some(OtherProcesses {
            count: 3,
            used_bytes: 3 * GIB,
        }),
        mig: Arc::from(Vec::new()),
        readings: Arc::new(
            Readings::default()
                // A process without a figure: no unattributed bytes.
                .with(Unattributed {
                    bytes: None,
                    mig: Vec::new(),
                })
                .with(Utilization {
                    gpu: Some(93),
                    memory: Some(41),
                    encoder: Some(0),
                    decoder: None,
                    samples: None,
                })
                // What the utilisation collector leaves for the ledger beside
                // its own reading.
                .with(Busy {
                    percent: Some(93),
                    samples: None,
                })
                .with(PowerThermal {
                    temperature_c: Some(62),
                    power_mw: Some(612_345),
                    power_limit_mw: Some(700_000),
                    energy_mj: Some(81_234_567_890),
                    clocks_mhz: [Some(1755), Some(1980), Some(3201), None],
                    performance_state: Some(0),
                    clock_event_reasons: Some(0x4),
                })
                .with(Health {
                    ecc_enabled: Some(true),
                    ecc_errors: [Some(12), Some(40), Some(1), Some(1)],
                    remapped_rows: Some(RemappedRows {
                        correctable: 2,
                        uncorrectable: 1,
                        pending: true,
                        failed: false,
                    }),
                    retired_pages: None,
                    xid_errors: Some(Arc::new(BTreeMap::from([(48, 1), (79, 2)]))),
                }),
        ),
    };
    let mig = |gi: u32, ci: u32, uuid: &str, used: Option<u64>| MigSample {
        info: Arc::new(MigInfo {
            mig_uuid: uuid.into(),
            name: "NVIDIA H200 MIG 3g.71gb".into(),
            gpu_instance_id: gi,
            compute_instance_id: ci,
        }),
        memory: used.map(|u| MemoryInfo {
            total: 71 * GIB,
            reserved: Some(0),
            used: u,
            free: 71 * GIB - u,
        }),
    };
    let on_mig = ProcessSample {
        pid: 777,
        used_bytes: Some(2 * GIB),
        // A plain Docker container, named through the engine's API.
        ident: Arc::new(ProcIdentity {
            engine: Some(Arc::new(ContainerInfo {
                name: Arc::from("shop-vllm-1"),
                image: Arc::from("vllm/vllm-openai:v0.6.3"),
                compose_project: Arc::from("shop"),
                compose_service: Arc::from("vllm"),
            })),
            ..ProcIdentity::clone(&ident(
                "vllm",
                "1001",
                "4c5e0a1f9b2d7e3c6a8b0d1f2e4c6a8b0d1f2e4c6a8b0d1f2e4c6a8b0d1f2e4c",
                "",
                None,
                None,
            ))
        }),
        gpu_instance_id: Some(1),
        compute_instance_id: Some(0),
        used_peak_bytes: Some(2 * GIB + MIB),
        torch: None,
        // A server that ran no kernel for two hours.
        readings: Readings::default().with(Idle {
            since: UNIX_EPOCH + Duration::from_millis(1_796_112_000_250 - 7_200_000),
        }),
    };
    let gpu1 = DeviceSample {
        info: h200(
            "1",
            "GPU-6f1c2a9e-4b1d-8c3e-9a7f-000000000001",
            "00000000:2A:00.0",
        ),
        memory: Some(memory(2 * GIB + 64 * MIB)),
        used_peak_bytes: Some(2 * GIB + 64 * MIB),
        processes: Arc::from(vec![on_mig]),
        other: None,
        mig: Arc::from(vec![
            mig(
                1,
                0,
                "MIG-1d2c3b4a-0000-4000-8000-000000000001",
                Some(2 * GIB),
            ),
            mig(2, 0, "MIG-1d2c3b4a-0000-4000-8000-000000000002", None),
        ]),
        readings: Arc::new(
            Readings::default()
                .with(Unattributed {
                    bytes: Some(64 * MIB),
                    mig: vec![
                        (
                            Arc::from("MIG-1d2c3b4a-0000-4000-8000-000000000001"),
                            Some(0),
                        ),
                        (Arc::from("MIG-1d2c3b4a-0000-4000-8000-000000000002"), None),
                    ],
                })
                .with(PowerThermal {
                    temperature_c: Some(38),
                    ..PowerThermal::default()
                })
                .with(Health {
                    ecc_enabled: Some(false),
                    retired_pages: Some(RetiredPages {
                        single_bit_ecc: Some(2),
                        double_bit_ecc: Some(0),
                        pending: Some(true),
                    }),
                    ..Health::default()
                }),
        ),
    };
    let gpu2 = DeviceSample {
        info: h200(
            "2",
            "GPU-6f1c2a9e-4b1d-8c3e-9a7f-000000000002",
            "00000000:3B:00.0",
        ),
        memory: None,
        used_peak_bytes: None,
        processes: Arc::from(Vec::new()),
        other: None,
        mig: Arc::from(Vec::new()),
        readings: Default::default(),
    };
    // GPU 3 fell off the bus before the exporter started: no identity.
    let gpu3 = DeviceSample {
        info: Arc::new(DeviceInfo::unknown(3)),
        memory: None,
        used_peak_bytes: None,
        processes: Arc::from(Vec::new()),
        other: None,
        mig: Arc::from(Vec::new()),
        readings: Default::default(),
    };
    let mut errors = BTreeMap::new();
    errors.insert((Operation::DEVICE_UUID, ErrorKind::GpuLost), 4);
    errors.insert((Operation::MEMORY_INFO, ErrorKind::GpuLost), 7);
    errors.insert(
        (Operation::RUNNING_COMPUTE_PROCESSES, ErrorKind::Unknown),
        1,
    );
    let mut s = Snapshot {
        taken_at: UNIX_EPOCH + Duration::from_millis(1_796_112_000_250),
        driver: Arc::new(DriverInfo {
            driver_version: "580.159.04".into(),
            nvml_version: "13.580.159.04".into(),
            cuda_driver_version: "13.0".into(),
        }),
        devices: vec![gpu0, gpu1, gpu2, gpu3],
        nvml_errors: Arc::new(errors),
        sample_duration: histogram(&[0.0004, 0.0009, 0.003, 0.02]),
        sample_nvml_duration: histogram(&[0.0002, 0.0003, 0.0011, 0.015]),
        memory_samples: 36,
        process_lookup_failures: 2,
        attribution_rejected: AttributionRejections {
            cgroup_owner: 3,
            cgroup_misplaced: 1,
            ..AttributionRejections::default()
        },
        nvml_reinit_attempts: 1,
        kubernetes: Some(KubeState {
            pods: 12,
            synced: true,
            lists_total: 2,
            watch_restarts_total: 5,
            errors_total: 1,
            ..KubeState::default()
        }),
        torch: Some(TorchCounters {
            reports: 40,
            malformed: 1,
            oversized: 0,
            permission: 2,
            identity: 1,
            socket: Some(BridgeSocketCounters {
                connections: 3,
                limited_connections: 4,
                limited_rate: 5,
                ..BridgeSocketCounters::default()
            }),
        }),
        containers: Some(ContainerLookups {
            found: 3,
            not_found: 1,
            error: 2,
        }),
        pod_resources: None,
        // Slurm jobs' GPUs: GPU 0 (by index, dcgm layout), GPU 1 by UUID
        // with the owner (jobstats layout).
        job_mapping: Some(JobMappingState {
            allocations: Arc::from(vec![
                JobAllocation {
                    device: AllocatedDevice::Gpu {
                        uuid: "GPU-6f1c2a9e-4b1d-8c3e-9a7f-000000000001".into(),
                    },
                    job: "81235".into(),
                    uid: Some("1002".into()),
                },
                JobAllocation {
                    device: AllocatedDevice::GpuIndex { gpu: "0".into() },
                    job: "81234".into(),
                    uid: None,
                },
            ]),
            reads_total: 7,
            errors: JobMappingErrors {
                content: 1,
                not_regular: 2,
                ..JobMappingErrors::default()
            },
        }),
        exporter: ExporterCounters::default(),
        forecasts: Default::default(),
        accounting: Default::default(),
        limits: Default::default(),
        series: Default::default(),
    };
    // The ledger's counters: this snapshot held for 10 s, exact in binary
    // (a fixed start, a fixed span), so the fixture stays deterministic.
    let mut ledger = Ledger::new();
    let t0 = Instant::now();
    ledger.record(&s, t0);
    s.accounting = ledger.record(&s, t0 + Duration::from_secs(10));
    s
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The encoded body with the build's version and revision made constant.
fn encoded(format: Format) -> String {
    encoded_of(fixed_snapshot(), format)
}

fn encoded_of(s: Snapshot, format: Format) -> String {
    let body = expose::encode(&Arc::new(s), format).expect("encode");
    let build = format!(
        "version=\"{}\",revision=\"{}\"",
        expose::VERSION,
        expose::REVISION
    );
    assert!(body.contains(&build), "build_info labels not found");
    body.replace(&build, "version=\"VERSION\",revision=\"REVISION\"")
}

fn check(format: Format, name: &str) {
    check_text(&encoded(format), name);
}

/// `got` against the fixture `name` (`GOLDEN_UPDATE=1` writes it).
fn check_text(got: &str, name: &str) {
    let got = got.to_string();
    let path = fixture(name);
    if std::env::var_os("GOLDEN_UPDATE").is_some() {
        std::fs::write(&path, &got).expect("write fixture");
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (GOLDEN_UPDATE=1 writes it)", path.display()));
    if got != want {
        let first = got
            .lines()
            .zip(want.lines())
            .position(|(g, w)| g != w)
            .unwrap_or_else(|| got.lines().count().min(want.lines().count()));
        panic!(
            "{} differs from the encoder's output at line {}:\n  fixture: {:?}\n  encoded: {:?}\n(a change to the metrics contract: GOLDEN_UPDATE=1 rewrites the fixture; commit it on its own)",
            path.display(),
            first + 1,
            want.lines().nth(first),
            got.lines().nth(first),
        );
    }
}

#[test]
fn text_exposition_matches_the_fixture() {
    check(Format::Text, "exposition.prom");
}

#[test]
fn openmetrics_exposition_matches_the_fixture() {
    check(Format::OpenMetrics, "exposition.om");
}

/// The families off by default, asked for: `processes.byte_seconds` adds
/// `gpu_process_memory_used_byte_seconds_total` and its line of
/// `gpumem_exporter_series`, and changes no other line. The lines it adds,
/// in body order, are the fixtures `process-byte-seconds.prom` and `.om`.
#[test]
fn the_per_process_counter_when_asked_for_adds_only_its_own_lines() {
    for (format, name, whole) in [
        (Format::Text, "process-byte-seconds.prom", "exposition.prom"),
        (
            Format::OpenMetrics,
            "process-byte-seconds.om",
            "exposition.om",
        ),
    ] {
        let mut s = fixed_snapshot();
        s.series.process_byte_seconds = true;
        let on = encoded_of(s, format);
        let default = encoded(format);
        let mut left: Vec<&str> = default.lines().collect();
        let mut added = String::new();
        for line in on.lines() {
            match left.first() {
                Some(l) if *l == line => {
                    left.remove(0);
                }
                _ => {
                    added.push_str(line);
                    added.push('\n');
                }
            }
        }
        assert!(left.is_empty(), "{whole}: lines the opt-in lost: {left:#?}");
        check_text(&added, name);
    }
}

/// A body that reuses the last full sample's segments (the scrape after a
/// memory-only sample) is the fixture too: the snapshot before it shares
/// every `Arc` and differs in memory and counters, as a memory-only sample
/// does.
#[test]
fn a_body_after_a_memory_only_sample_reuses_the_full_sample_and_matches_the_fixture() {
    for (format, name) in [
        (Format::Text, "exposition.prom"),
        (Format::OpenMetrics, "exposition.om"),
    ] {
        let reuse = expose::Reuse::new();
        let fixed = Arc::new(fixed_snapshot());
        let mut before = (*fixed).clone();
        for d in &mut before.devices {
            if let Some(m) = d.memory.as_mut() {
                m.used /= 2;
                m.free += m.used;
            }
        }
        before.memory_samples = before.memory_samples.saturating_sub(1);
        let before = expose::encode_reusing(&Arc::new(before), format, &reuse).expect("encode");
        assert_eq!(reuse.reused(), 0);
        let body = expose::encode_reusing(&fixed, format, &reuse).expect("encode");
        assert_eq!(
            reuse.reused(),
            1,
            "{name}: the full-sample segments were reused"
        );
        assert_ne!(before, body);
        assert_eq!(
            body,
            expose::encode(&fixed, format).expect("encode"),
            "{name}"
        );
        let build = format!(
            "version=\"{}\",revision=\"{}\"",
            expose::VERSION,
            expose::REVISION
        );
        let body = body.replace(&build, "version=\"VERSION\",revision=\"REVISION\"");
        let want = std::fs::read_to_string(fixture(name)).expect("fixture");
        assert!(
            body == want,
            "{name}: the reused body differs from the fixture"
        );
    }
}

/// Every family the exporter can serve has at least one sample in the
/// fixture, so the contract leaves nothing out.
#[test]
fn the_fixture_covers_every_family() {
    let text = encoded(Format::Text);
    let mut families = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let name = rest.split(' ').next().unwrap_or("");
            families.push(name.to_string());
        }
    }
    assert!(families.len() >= 40, "only {} families", families.len());
    for name in &families {
        let has_sample = text.lines().any(|l| {
            !l.starts_with('#')
                && (l.starts_with(&format!("{name}{{"))
                    || l.starts_with(&format!("{name} "))
                    || l.starts_with(&format!("{name}_total"))
                    || l.starts_with(&format!("{name}_bucket")))
        });
        assert!(has_sample, "{name} has no sample in the fixture");
    }
}

/// No label with an empty value in either format: for
/// Prometheus an empty label is no label, so the pair would be bytes that
/// buy nothing. The fixed snapshot has every case that used to write one:
/// processes outside Kubernetes, outside MIG, without a name (the
/// `pid="other"` rollup), without a container id or a command line.
#[test]
fn no_label_has_an_empty_value() {
    for format in [Format::Text, Format::OpenMetrics] {
        let body = encoded(format);
        let empty = empty_label_lines(&body);
        assert!(empty.is_empty(), "{format:?}: {empty:#?}");
        // The snapshot does have those unknowns: the labels are left out,
        // the series are not.
        for series in [
            "gpu_process_memory_used_bytes{gpu=\"0\",uuid=\"GPU-6f1c2a9e-4b1d-8c3e-9a7f-000000000000\",pid=\"other\"} ",
            "gpu_process_memory_unavailable{gpu=\"0\",uuid=\"GPU-6f1c2a9e-4b1d-8c3e-9a7f-000000000000\",pid=\"5151\",process=\"Xorg\"} ",
            "gpu_process_info{gpu=\"0\",uuid=\"GPU-6f1c2a9e-4b1d-8c3e-9a7f-000000000000\",pid=\"5151\",process=\"Xorg\",user=\"root\"} ",
            // A Docker container: names from the engine, no pod labels.
            "container_name=\"shop-vllm-1\",container_image=\"vllm/vllm-openai:v0.6.3\",compose_project=\"shop\",compose_service=\"vllm\"} ",
        ] {
            assert!(
                body.contains(series),
                "{format:?}: no {series:?} in\n{body}"
            );
        }
    }
}
