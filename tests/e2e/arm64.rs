//! The aarch64 build under emulation: the exporter and the fake NVML
//! cross-built for aarch64-unknown-linux-gnu (scripts/ci/build-arm64, a
//! no-op when scripts/ci/test has built them), the exporter run by
//! qemu-user (`qemu-aarch64-static -L /usr/aarch64-linux-gnu`: the cross
//! libc as its sysroot) on the arm64 fake NVML, beside the host's build
//! on the host's fake with the same scenario: processes, a GPU in MIG mode
//! and a lost GPU. The GPU families must be the same bytes; `/readyz`,
//! and SIGTERM → exit 0.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::harness::tools::require_tool;
use crate::harness::*;

const QEMU: &str = "qemu-aarch64-static";
const SYSROOT: &str = "/usr/aarch64-linux-gnu";
/// ELF e_machine of AArch64.
const EM_AARCH64: u16 = 183;

const SCENARIO: &str = r#"driver_version: "580.95.05"
nvml_version: "13.580.95.05"
cuda_driver_version: 13000
devices:
  - uuid: GPU-a64a64a6-0000-0000-0000-000000000000
    name: NVIDIA GH200 480GB
    pci_bus_id: "00000009:01:00.0"
    memory: {total: 102005473280, reserved: 536870912, used: 40802189312}
    processes:
      - {pid: 7001, used: 40265318400, type: compute}
      - {pid: 7002, used: null, type: compute}
    utilization: {gpu: 87, memory: 41, encoder: 0, decoder: 0}
    temperature_c: 55
    power_mw: 512300
    power_limit_mw: 900000
  - uuid: GPU-a64a64a6-1111-0000-0000-000000000000
    name: NVIDIA GH200 480GB
    pci_bus_id: "00000019:01:00.0"
    memory: {total: 102005473280, reserved: 536870912, used: 3221225472}
    mig_devices:
      - uuid: MIG-a64a64a6-1111-0000-0000-000000000001
        gpu_instance_id: 1
        compute_instance_id: 0
        memory: {total: 24696061952, reserved: 0, used: 2147483648}
        processes: [{pid: 7101, used: 2097152000}]
      - uuid: MIG-a64a64a6-1111-0000-0000-000000000002
        gpu_instance_id: 2
        compute_instance_id: 0
        memory: {total: 24696061952, reserved: 0, used: 1073741824}
        processes: [{pid: 7102, used: 1000, type: mps}]
  - uuid: GPU-a64a64a6-2222-0000-0000-000000000000
    name: NVIDIA GH200 480GB
    pci_bus_id: "00000029:01:00.0"
    memory: {total: 102005473280, reserved: 536870912, used: 0}
    error: gpu_lost
"#;

/// The folder with the arm64 `gpumem-exporter` and `libfake_nvml.so`.
pub(crate) fn arm64_build() -> PathBuf {
    let t = Instant::now();
    let out = Command::new(repo_file("scripts/ci/build-arm64"))
        .current_dir(repo())
        .stdin(Stdio::null())
        .output()
        .expect("run scripts/ci/build-arm64");
    assert!(
        out.status.success(),
        "scripts/ci/build-arm64: {}",
        output_text(&out)
    );
    let dir = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .expect("build-arm64 prints the folder")
        .to_string();
    eprintln!(
        "arm64 e2e: scripts/ci/build-arm64 {:.1} s",
        t.elapsed().as_secs_f64()
    );
    PathBuf::from(dir)
}

fn elf_machine(path: &Path) -> u16 {
    let b = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        b.starts_with(b"\x7fELF\x02\x01"),
        "{}: not a 64-bit little-endian ELF",
        path.display()
    );
    u16::from_le_bytes([b[18], b[19]])
}

/// The lines of the GPU families (`gpu_*`, with their HELP and TYPE): the
/// exporter's own `gpumem_exporter_*` figures (timings, scrape counts)
/// differ between any two runs. The accounting counters (`*_seconds_total`:
/// byte-seconds, busy and allocation seconds) integrate the time since each
/// exporter started, so two exporters started apart differ in them by
/// design: their series (names and labels) are kept, their values are not.
pub(crate) fn gpu_families(body: &str) -> String {
    body.lines()
        .filter(|l| {
            let name = l
                .strip_prefix("# HELP ")
                .or_else(|| l.strip_prefix("# TYPE "))
                .unwrap_or(l);
            name.starts_with("gpu_")
        })
        .map(|l| match l.rsplit_once(' ') {
            Some((series, _)) if !l.starts_with('#') && integrates_time(series) => {
                format!("{series} <time-integrated>\n")
            }
            _ => format!("{l}\n"),
        })
        .collect()
}

/// Whether a sample line's series is an accounting counter of seconds.
fn integrates_time(series: &str) -> bool {
    let name = series.split('{').next().unwrap_or(series);
    name.ends_with("_seconds_total")
}

#[test]
fn the_arm64_build_serves_the_same_bytes_under_qemu() {
    // qemu-user keeps a core busy while the emulated exporter runs: beside
    // a flood, a flood's scrape deadline would measure the emulator.
    let _one = heavy();
    require_tool(QEMU);
    assert!(
        Path::new(SYSROOT)
            .join("lib/ld-linux-aarch64.so.1")
            .exists(),
        "{SYSROOT} has no arm64 loader: apt-get install libc6-dev-arm64-cross (scripts/ci/test does)"
    );
    let dir = arm64_build();
    let (bin, lib) = (dir.join("gpumem-exporter"), dir.join("libfake_nvml.so"));
    assert_eq!(elf_machine(&bin), EM_AARCH64, "{}", bin.display());
    assert_eq!(elf_machine(&lib), EM_AARCH64, "{}", lib.display());

    let scenario = Scenario::new(SCENARIO);
    let host = Exporter::start(&scenario, &[]);
    let started = Instant::now();
    let mut qemu = Command::new(QEMU);
    qemu.arg("-L").arg(SYSROOT).arg(&bin);
    let mut arm = Exporter::spawn(Exporter::command_with_library(qemu, &lib, &scenario, &[]));
    let listening = started.elapsed();
    wait_for(Duration::from_secs(30), "arm64 /readyz 200", || {
        (arm.get("/readyz").status == 200).then_some(())
    });
    let ready = started.elapsed();
    wait_for(Duration::from_secs(10), "host /readyz 200", || {
        (host.get("/readyz").status == 200).then_some(())
    });

    // Both have sampled the static scenario: the GPU families, byte for byte.
    let (want, got) = wait_for(Duration::from_secs(20), "the same GPU families", || {
        let want = gpu_families(&host.get("/metrics").body);
        let got = gpu_families(&arm.get("/metrics").body);
        (want == got).then_some((want, got))
    });
    assert_eq!(want, got);
    let m = arm.metrics();
    let g0 = [
        ("gpu", "0"),
        ("uuid", "GPU-a64a64a6-0000-0000-0000-000000000000"),
    ];
    assert_eq!(m.get("gpu_memory_used_bytes", &g0), Some(40802189312.0));
    assert_eq!(m.get("gpu_up", &g0), Some(1.0));
    // Lost from the start: no identity, so no uuid label.
    let lost = m.find("gpu_up", &[("gpu", "2")]);
    assert_eq!(lost.len(), 1, "{}", m.text);
    assert_eq!(lost[0].1, 0.0);
    let mig = m.find("gpu_mig_memory_used_bytes", &[("gpu_instance_id", "1")]);
    assert_eq!(mig.len(), 1, "{}", m.text);
    assert_eq!(mig[0].1, 2147483648.0);
    let p = m.find("gpu_process_memory_used_bytes", &[("pid", "7001")]);
    assert_eq!(p.len(), 1, "{}", m.text);
    assert_eq!(p[0].1, 40265318400.0);
    assert_eq!(
        m.find("gpumem_exporter_build_info", &[]).len(),
        1,
        "build_info"
    );

    let (status, took) = arm.signal("TERM");
    assert_eq!(status.code(), Some(0), "arm64 exit status after SIGTERM");
    eprintln!(
        "arm64 e2e: listening {:.0} ms and ready {:.0} ms after start under qemu; {} GPU-family lines equal to the host build's; SIGTERM → exit 0 in {:.0} ms",
        listening.as_secs_f64() * 1e3,
        ready.as_secs_f64() * 1e3,
        got.lines().count(),
        took.as_secs_f64() * 1e3
    );
}
