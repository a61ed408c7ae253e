//! End-to-end: the real binary on the fake NVML.

use std::path::Path;
use std::time::Duration;

use crate::harness::*;

#[cfg(feature = "external-tools")]
mod external;

const GIB: u64 = 1 << 30;

/// Two GPUs; pid `me` is this test process (so its comm is readable),
/// 3999999 does not exist (comm ""), 3999998 is listed without a memory figure.
fn scenario(me: u32, with_second_proc: bool, gpu1_error: &str) -> String {
    let extra = if with_second_proc {
        format!(
            "      - {{pid: 3999999, used: {}, type: graphics}}\n",
            2 * GIB
        )
    } else {
        String::new()
    };
    format!(
        r#"driver_version: "580.159.04"
nvml_version: "13.580.159.04"
cuda_driver_version: 13000
devices:
  - uuid: GPU-aaaaaaaa-0000-0000-0000-000000000000
    name: NVIDIA H200
    pci_bus_id: "00000000:00:06.0"
    memory: {{total: 150754820096, reserved: 644939776, used: 12363563008}}
    processes:
      - {{pid: {me}, used: 12354322432, type: compute}}
{extra}      - {{pid: 3999998, used: null, type: compute}}
  - uuid: GPU-bbbbbbbb-0000-0000-0000-000000000000
    name: NVIDIA H200
    pci_bus_id: "00000000:00:07.0"
    memory: {{total: 150754820096, reserved: 644939776, used: 1048576}}
    processes: []
    error: {gpu1_error}
"#
    )
}

fn comm_of_self() -> String {
    std::fs::read_to_string("/proc/self/comm")
        .unwrap()
        .trim_end()
        .to_string()
}

const G0: [(&str, &str); 2] = [
    ("gpu", "0"),
    ("uuid", "GPU-aaaaaaaa-0000-0000-0000-000000000000"),
];
const G1: [(&str, &str); 2] = [
    ("gpu", "1"),
    ("uuid", "GPU-bbbbbbbb-0000-0000-0000-000000000000"),
];

#[test]
fn values_equal_the_scenario_to_the_byte() {
    let me = std::process::id();
    let sc = Scenario::new(&scenario(me, true, "null"));
    let ex = Exporter::start(&sc, &["--sample-interval", "100ms"]);
    let m = ex.metrics();

    assert_eq!(m.get_u64("gpu_memory_total_bytes", &G0), Some(150754820096));
    assert_eq!(m.get_u64("gpu_memory_reserved_bytes", &G0), Some(644939776));
    assert_eq!(m.get_u64("gpu_memory_used_bytes", &G0), Some(12363563008));
    assert_eq!(
        m.get_u64("gpu_memory_free_bytes", &G0),
        Some(150754820096 - 644939776 - 12363563008)
    );
    assert_eq!(m.get_u64("gpu_memory_used_bytes", &G1), Some(1048576));
    assert_eq!(m.get("gpu_up", &G0), Some(1.0));
    assert_eq!(m.get("gpu_up", &G1), Some(1.0));
    assert_eq!(
        m.get(
            "gpu_info",
            &[
                ("gpu", "0"),
                ("uuid", "GPU-aaaaaaaa-0000-0000-0000-000000000000"),
                ("name", "NVIDIA H200"),
                ("pci_bus_id", "00000000:00:06.0")
            ]
        ),
        Some(1.0)
    );
    assert_eq!(
        m.get(
            "gpu_driver_info",
            &[
                ("driver_version", "580.159.04"),
                ("nvml_version", "13.580.159.04"),
                ("cuda_driver_version", "13.0")
            ]
        ),
        Some(1.0)
    );
    let me_s = me.to_string();
    let comm = comm_of_self();
    // Outside Kubernetes and MIG those labels are empty.
    let labels = |pid, process| {
        [
            G0[0],
            G0[1],
            ("pid", pid),
            ("process", process),
            ("namespace", ""),
            ("pod", ""),
            ("container", ""),
            ("gpu_instance_id", ""),
            ("compute_instance_id", ""),
        ]
    };
    let p = |pid: &'static str, process: &'static str| labels(pid, process);
    let mine = labels(me_s.as_str(), comm.as_str());
    assert_eq!(
        m.get_u64("gpu_process_memory_used_bytes", &mine),
        Some(12354322432)
    );
    // A graphics process; its pid does not exist here, so process is "".
    assert_eq!(
        m.get_u64("gpu_process_memory_used_bytes", &p("3999999", "")),
        Some(2 * GIB)
    );
    // "Unavailable" is its own signal, never a fake 0.
    assert_eq!(
        m.find("gpu_process_memory_used_bytes", &[("pid", "3999998")])
            .len(),
        0
    );
    assert_eq!(
        m.get("gpu_process_memory_unavailable", &p("3999998", "")),
        Some(1.0)
    );
    assert_eq!(m.find("gpu_process_memory_used_bytes", &G1).len(), 0);

    let build = m.find(
        "gpumem_exporter_build_info",
        &[("version", env!("CARGO_PKG_VERSION"))],
    );
    assert_eq!(build.len(), 1, "{}", m.text);
    assert!(
        m.get("gpumem_exporter_sample_duration_seconds_count", &[])
            .unwrap()
            >= 1.0
    );
    let ts = m
        .get("gpumem_exporter_last_sample_timestamp_seconds", &[])
        .unwrap();
    let now = unix_now();
    assert!((now - ts).abs() < 5.0, "timestamp {ts} vs now {now}");
    assert_eq!(
        ex.get("/metrics").header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
}

#[test]
fn exited_process_is_gone_after_the_next_sample() {
    let me = std::process::id();
    let sc = Scenario::new(&scenario(me, true, "null"));
    let ex = Exporter::start(&sc, &["--sample-interval", "100ms"]);
    assert_eq!(
        ex.metrics()
            .find("gpu_process_memory_used_bytes", &[("pid", "3999999")])
            .len(),
        1
    );
    sc.write(&scenario(me, false, "null"));
    wait_for(
        Duration::from_secs(3),
        "pid 3999999 to leave /metrics",
        || {
            ex.metrics()
                .find("gpu_process_memory_used_bytes", &[("pid", "3999999")])
                .is_empty()
                .then_some(())
        },
    );
    // The other process is still there.
    assert_eq!(
        ex.metrics()
            .find(
                "gpu_process_memory_used_bytes",
                &[("pid", me.to_string().as_str())]
            )
            .len(),
        1
    );
}

#[test]
fn lost_gpu_goes_down_alone_and_comes_back() {
    let me = std::process::id();
    let sc = Scenario::new(&scenario(me, false, "null"));
    let ex = Exporter::start(&sc, &["--sample-interval", "100ms"]);
    assert_eq!(ex.metrics().get("gpu_up", &G1), Some(1.0));
    sc.write(&scenario(me, false, "gpu_lost"));
    let m = wait_for(Duration::from_secs(3), "gpu_up{gpu=1} 0", || {
        let m = ex.metrics();
        (m.get("gpu_up", &G1) == Some(0.0)).then_some(m)
    });
    // The lost GPU has no memory figures; the other keeps reporting.
    assert_eq!(m.get("gpu_memory_used_bytes", &G1), None);
    assert_eq!(m.get("gpu_up", &G0), Some(1.0));
    assert_eq!(m.get_u64("gpu_memory_used_bytes", &G0), Some(12363563008));
    let errors = |m: &Metrics| {
        m.get(
            "gpumem_exporter_nvml_errors_total",
            &[("operation", "memory_info"), ("error", "gpu_lost")],
        )
        .unwrap_or(0.0)
    };
    let first = errors(&m);
    assert!(first >= 1.0, "{}", m.text);
    wait_for(Duration::from_secs(3), "the error counter to rise", || {
        (errors(&ex.metrics()) > first).then_some(())
    });
    sc.write(&scenario(me, false, "null"));
    let m = wait_for(Duration::from_secs(3), "gpu_up{gpu=1} back to 1", || {
        let m = ex.metrics();
        (m.get("gpu_up", &G1) == Some(1.0)).then_some(m)
    });
    assert_eq!(m.get_u64("gpu_memory_used_bytes", &G1), Some(1048576));
}

#[test]
fn openmetrics_when_asked() {
    let sc = Scenario::new(&scenario(std::process::id(), false, "null"));
    let ex = Exporter::start(&sc, &[]);
    let r = http_get(
        ex.addr,
        "/metrics",
        &[(
            "Accept",
            "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
        )],
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("content-type"),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
    );
    assert!(r.body.ends_with("# EOF\n"), "{}", r.body);
    assert!(r.body.contains("gpu_memory_used_bytes{gpu=\"0\""));
}

#[test]
fn endpoints() {
    let sc = Scenario::new(&scenario(std::process::id(), false, "null"));
    let ex = Exporter::start(&sc, &["--web.telemetry-path", "/gpu/metrics"]);
    assert_eq!(ex.get("/healthz").status, 200);
    assert_eq!(ex.get("/readyz").status, 200);
    let landing = ex.get("/");
    assert_eq!(landing.status, 200);
    for link in [
        "href=\"/gpu/metrics\"",
        "href=\"/healthz\"",
        "href=\"/readyz\"",
    ] {
        assert!(landing.body.contains(link), "{link} in {}", landing.body);
    }
    assert_eq!(ex.get("/gpu/metrics").status, 200);
    assert_eq!(ex.get("/metrics").status, 404);
    assert_eq!(ex.get("/nope").status, 404);
}

/// Outside Kubernetes and MIG, with a pid that has no name: the served
/// bodies (text and OpenMetrics) carry no empty label, only the labels
/// that are known (the strict parsers read them in `external`).
#[test]
fn no_empty_labels_in_the_served_bodies() {
    let me = std::process::id();
    let sc = Scenario::new(&scenario(me, true, "null"));
    let ex = Exporter::start(&sc, &[]);
    let text = ex.metrics().text;
    let om = http_get(
        ex.addr,
        "/metrics",
        &[("Accept", "application/openmetrics-text;version=1.0.0")],
    )
    .body;
    for (format, body) in [("text", &text), ("OpenMetrics", &om)] {
        assert_eq!(empty_label_lines(body), Vec::<&str>::new(), "{format}");
        let unnamed = "gpu_process_memory_used_bytes{gpu=\"0\",uuid=\"GPU-aaaaaaaa-0000-0000-0000-000000000000\",pid=\"3999999\"} ";
        assert!(
            body.contains(unnamed),
            "{format}: no {unnamed:?} in\n{body}"
        );
    }
}

#[test]
fn sigterm_exits_zero_within_a_second() {
    let sc = Scenario::new(&scenario(std::process::id(), false, "null"));
    let mut ex = Exporter::start(&sc, &[]);
    assert_eq!(ex.get("/metrics").status, 200);
    let (status, took) = ex.signal("TERM");
    assert_eq!(status.code(), Some(0), "{}", ex.stderr());
    assert!(took < Duration::from_secs(1), "took {took:?}");
    let mut ex = Exporter::start(&sc, &[]);
    let (status, took) = ex.signal("INT");
    assert_eq!(status.code(), Some(0));
    assert!(took < Duration::from_secs(1), "took {took:?}");
}

#[test]
fn missing_library_is_a_clear_error_with_exit_1() {
    let (code, err) = run_to_exit(&[
        "--nvml.library",
        "/nonexistent/libnvidia-ml.so.1",
        "--web.listen-address",
        "127.0.0.1:0",
    ]);
    assert_eq!(code, Some(1), "{err}");
    let line = err
        .lines()
        .find(|l| l.contains("level=error"))
        .unwrap_or_default();
    assert!(line.contains("NVML could not be loaded from"), "{err}");
    assert!(line.contains("/nonexistent/libnvidia-ml.so.1"), "{err}");
    assert!(line.contains("--nvml.library"), "{err}");
    assert_eq!(
        err.lines().filter(|l| l.contains("level=error")).count(),
        1,
        "{err}"
    );
}

#[test]
fn bad_config_files_are_rejected_with_key_and_line() {
    let sc = Scenario::new("devices: []\n");
    let cases: [(&str, &[u8], &str); 6] = [
        (
            "typo.yaml",
            b"web:\n  listen_adress: :9877\n",
            "line 2 column 3: key web.listen_adress: unknown field `listen_adress`",
        ),
        (
            "duration.yaml",
            b"sample_interval: soon\n",
            "line 1 column 18: key sample_interval: invalid duration \"soon\"",
        ),
        (
            "level.yaml",
            b"log:\n  level: chatty\n",
            "line 2 column 10: key log.level: invalid log level \"chatty\"",
        ),
        ("type.yaml", b"web: [1, 2]\n", "line 1 column 6: key web:"),
        (
            "addr.yaml",
            b"web:\n  listen_address: 1.2.3.4:99999\n",
            "key web.listen_address: invalid listen address",
        ),
        ("binary.yaml", b"\x00\x01\xff\xfe", "config file"),
    ];
    for (name, content, want) in cases {
        assert_file_refused("--config.file", &sc.file(name, content), &[], want);
    }
    assert_file_refused(
        "--config.file",
        Path::new("/nonexistent/c.yaml"),
        &[],
        "cannot read",
    );
    let (code, err) = run_to_exit(&["--sample-interval=-1s"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--sample-interval"), "{err}");
}

#[test]
fn config_file_values_apply_and_flags_override() {
    let sc = Scenario::new(&scenario(std::process::id(), false, "null"));
    let ex = Exporter::with_config(
        &sc,
        "web:\n  telemetry_path: /m\nsample_interval: 2s\nlog:\n  format: logfmt\n",
        &["--web.telemetry-path", "/override"],
    );
    assert_eq!(ex.get("/override").status, 200);
    assert_eq!(ex.get("/m").status, 404);
}

/// SIGTERM while a scrape is being sent: the scrape completes, then the
/// process exits 0 within a second.
#[test]
fn sigterm_mid_scrape_finishes_the_scrape() {
    use std::io::{Read, Write};
    // A body of over 5 MiB, larger than the socket buffers, so the server is
    // still writing it when the signal arrives.
    let mut y = String::from("devices:\n");
    for g in 0..8 {
        y.push_str(&format!(
            "  - uuid: GPU-{g:08x}-0000-0000-0000-000000000000\n    memory: {{total: 150754820096, reserved: 0, used: 1000000000}}\n    processes:\n"
        ));
        for p in 0..3072 {
            y.push_str(&format!(
                "      - {{pid: {}, used: {}}}\n",
                3_000_000 + g * 10_000 + p,
                1_000_000 + p
            ));
        }
    }
    let sc = Scenario::new(&y);
    let mut ex = Exporter::start(&sc, &[]);
    let mut s = small_window_connect(ex.addr);
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut first = [0u8; 1024];
    s.read_exact(&mut first).unwrap();
    let t = std::time::Instant::now();
    ex.signal_only("TERM");
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    let status = ex.child.wait().unwrap();
    let took = t.elapsed();
    let mut raw = first.to_vec();
    raw.extend_from_slice(&rest);
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let len: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse().unwrap())
        })
        .expect("content-length");
    // More than the server's send buffer (tcp_wmem max, 4 MiB) plus our
    // pinned 4 KiB receive buffer: the server was still writing.
    assert!(len > 5 << 20, "body of {len} bytes");
    assert_eq!(body.len(), len, "the whole scrape arrived");
    assert!(
        body.trim_end().ends_with(|c: char| c.is_ascii_digit()),
        "ends with a sample"
    );
    assert_eq!(status.code(), Some(0));
    assert!(took < Duration::from_secs(1), "exit took {took:?}");
}

/// A TCP connection whose receive buffer is pinned small (no autotuning), so
/// a large response cannot sit entirely in the kernel's buffers.
fn small_window_connect(addr: std::net::SocketAddr) -> std::net::TcpStream {
    use std::os::fd::FromRawFd;
    let std::net::SocketAddr::V4(v4) = addr else {
        panic!("IPv4 expected");
    };
    // SAFETY: plain socket syscalls on a fresh fd that is handed to
    // TcpStream (which then owns and closes it).
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(fd >= 0);
        let size: libc::c_int = 4096;
        let rc = libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            &size as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
        assert_eq!(rc, 0);
        let sa = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: v4.port().to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(*v4.ip()).to_be(),
            },
            sin_zero: [0; 8],
        };
        let rc = libc::connect(
            fd,
            &sa as *const libc::sockaddr_in as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        );
        assert_eq!(rc, 0, "connect");
        std::net::TcpStream::from_raw_fd(fd)
    }
}
