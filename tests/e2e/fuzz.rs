//! Fuzzing the parsers with generated and mutated inputs (proptest
//! strategies, run for a time budget). Each target must never panic, and
//! where a parser accepts, what it returns must hold its invariants.
//!
//! CI runs each target for FUZZ_SECONDS (default 3). The long run
//! documented in RELIABILITY.md:
//!
//!     FUZZ_SECONDS=600 cargo test --release --test e2e fuzz:: -- --nocapture --test-threads=6
//!
//! The checks are the fuzz targets' own, from one place
//! (`testing::fuzzing`, src/fuzzing.rs): these run them on generated
//! inputs, blind to coverage; the coverage-guided targets (cargo-afl,
//! AFL++) in fuzz/, run by scripts/ci/fuzz, call the same functions.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use gpumem_exporter::testing::fuzzing;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, TestRunner};

fn budget() -> Duration {
    let secs = std::env::var("FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .unwrap_or(3.0);
    Duration::from_secs_f64(secs)
}

/// Run `check` until the budget is spent on texts that are either `seeds`
/// with random edits or anything at all; on a panic, fail with the input
/// that caused it.
fn fuzz(name: &str, seeds: &'static [&'static str], check: impl Fn(&str)) {
    let strategy = prop_oneof![mutated(seeds), any_text()];
    let mut runner = TestRunner::new(Config::default());
    let start = Instant::now();
    let budget = budget();
    let mut runs: u64 = 0;
    while start.elapsed() < budget {
        let Ok(tree) = strategy.new_tree(&mut runner) else {
            continue;
        };
        let input = tree.current();
        if catch_unwind(AssertUnwindSafe(|| check(&input))).is_err() {
            panic!("{name}: panicked on input {input:?}");
        }
        runs += 1;
    }
    assert!(runs > 0, "{name}: no input ran within {budget:?}");
    eprintln!(
        "fuzz {name}: {runs} executions in {:.1} s, no crash",
        start.elapsed().as_secs_f64()
    );
}

/// Valid-looking inputs with random edits: most of the input is right, so
/// the parser gets deep before it meets the damage.
fn mutated(seeds: &'static [&'static str]) -> impl Strategy<Value = String> {
    let edit = (
        any::<usize>(),
        any::<usize>(),
        prop_oneof![
            Just(String::new()),
            "[:\\-\\[\\]{}#&*!|>'\"%@`, \\t\\n]{1,3}",
            "\\PC{1,4}",
            "[0-9]{1,25}",
            Just("\u{0}".to_string()),
            Just("\u{feff}".to_string()),
        ],
    );
    (
        prop::sample::select(seeds),
        prop::collection::vec(edit, 0..6),
    )
        .prop_map(|(seed, edits)| {
            let mut s: Vec<char> = seed.chars().collect();
            for (at, len, with) in edits {
                let at = if s.is_empty() { 0 } else { at % (s.len() + 1) };
                let end = (at + len % 4).min(s.len());
                s.splice(at..end, with.chars());
            }
            s.into_iter().collect()
        })
}

fn any_text() -> impl Strategy<Value = String> {
    prop_oneof![
        ".{0,200}",
        "\\PC{0,200}",
        prop::collection::vec(any::<u8>(), 0..200)
            .prop_map(|b| String::from_utf8_lossy(&b).to_string()),
    ]
}

const CONFIGS: &[&str] = &[
    "web:\n  listen_address: \":9877\"\n  telemetry_path: /metrics\nsample_interval: 1s\nmemory_sample_interval: 100ms\npeak_window: 30s\nnvml:\n  library: \"\"\nlog:\n  level: info\n  format: logfmt\n",
    "processes:\n  enabled: true\n  min_bytes: 1048576\n  top_n: 10\n  cmdline: true\n  cmdline_max_length: 64\n  passwd_file: /host/etc/passwd\npath:\n  procfs: /host/proc\n",
    "kubernetes:\n  enabled: true\n  node_name: gpu-1\n  api_url: https://10.0.0.1:443\n  token_file: /t\n  ca_file: /c\n",
    "sample_interval: 1m30s\npeak_window: 1h\n",
    "{web: {listen_address: '[::1]:9877'}, log: {level: debug}}\n",
];

#[test]
fn fuzz_config_parser() {
    fuzz("config", CONFIGS, |text| fuzzing::config(text.as_bytes()));
}

const CGROUPS: &[&str] = &[
    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b2c3d4e_0000_1111_2222_333344445555.slice/cri-containerd-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef.scope\n",
    "12:memory:/kubepods/besteffort/pod1b2c3d4e-0000-1111-2222-333344445555/0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef\n11:cpu,cpuacct:/kubepods\n1:name=systemd:/\n",
    "0::/system.slice/docker-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef.scope\n",
    "0::/machine.slice/libpod-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef.scope\n",
    "0::/kubepods.slice/kubepods-pod1b2c3d4e_0000_1111_2222_333344445555.slice/crio-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef.scope\n",
    "0::/system.slice/nvidia-persistenced.service\n",
];

#[test]
fn fuzz_cgroup_parser() {
    fuzz("cgroup", CGROUPS, |text| fuzzing::cgroup(text.as_bytes()));
}

const PROC_FILES: &[&str] = &[
    "436 (python3) S 1 436 436 0 -1 4194560 1 0 0 0 5 3 0 0 20 0 12 0 98765 123456 789 18446744073709551615\n",
    "437 (a) b) (c) R 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 4242\n",
    "Name:\tpython3\nUmask:\t0022\nState:\tS (sleeping)\nUid:\t1000\t1000\t1000\t1000\nGid:\t1000\t1000\t1000\t1000\n",
    "root:x:0:0:root:/root:/bin/bash\nalice:x:1000:1000::/home/alice:/bin/sh\n# comment\n",
];

/// /proc files and /etc/passwd (the AFL++ targets `proc` and `passwd`).
#[test]
fn fuzz_proc_parsers() {
    fuzz("proc", PROC_FILES, |text| {
        fuzzing::proc(text.as_bytes());
        fuzzing::passwd(text.as_bytes());
    });
}

const ACCEPTS: &[&str] = &[
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "text/plain;version=0.0.4",
    "gzip, deflate, br",
    "identity;q=1, *;q=0",
];

#[test]
fn fuzz_accept_headers() {
    fuzz("accept", ACCEPTS, |text| fuzzing::accept(text.as_bytes()));
}

const WEB_CONFIGS: &[&str] = &[
    "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.crt\n  min_version: TLS13\n",
    "basic_auth_users:\n  prometheus: $2y$10$X0h1gDsPszWURQaxFh.zoubFi6DXncSjhoQNJgRrnGs7EsimhC7zG\n",
    "http_server_config:\n  max_connections: 100\n  header_read_timeout: 5s\n",
];

#[test]
fn fuzz_web_config_parser() {
    fuzz("web-config", WEB_CONFIGS, |text| {
        fuzzing::web_config(text.as_bytes())
    });
}

const TORCH_DOCUMENTS: &[&str] = &[
    r#"{"v":1,"seq":7,"allocator":{"backend":"native","expandable_segments":false,"max_split_size":null},"devices":[{"uuid":"GPU-aaaaaaaa-1717-0000-0000-000000000000","allocated":1024,"reserved":2048,"allocated_peak":4096,"reserved_peak":8192,"active":512,"inactive_split":0,"alloc_retries":1,"ooms":0,"pools":{"large":{"allocated":1,"reserved":2,"inactive_split":3,"segments":4},"small":{"allocated":1,"reserved":2,"inactive_split":3,"segments":4}},"limit":75377410048,"oom_snapshots":0}]}"#,
    r#"{"v":1,"devices":[]}"#,
    r#"{"v":1,"allocator":{"backend":"cudaMallocAsync","expandable_segments":true,"max_split_size":1048576},"devices":[{"uuid":"x","allocated":0,"reserved":0,"allocated_peak":0,"reserved_peak":0,"active":0,"inactive_split":0,"alloc_retries":0,"ooms":0}]}"#,
];

/// The torch bridge document (read from another process's memfd).
#[test]
fn fuzz_torch_bridge_document() {
    fuzz("torch", TORCH_DOCUMENTS, |text| {
        fuzzing::torch(text.as_bytes())
    });
}

const TORCH_MESSAGES: &[&str] = &[
    "gpumem-bridge 1\n{\"v\":1,\"seq\":7,\"devices\":[{\"uuid\":\"GPU-aaaaaaaa-1717-0000-0000-000000000000\",\"allocated\":1024,\"reserved\":2048,\"allocated_peak\":4096,\"reserved_peak\":8192,\"active\":512,\"inactive_split\":0,\"alloc_retries\":1,\"ooms\":0,\"steps\":{\"total\":3,\"ring\":[[1,1764633600.1,1],[2,1764633600.2,2],[3,1764633600.3,3]]}}]}",
    "gpumem-bridge 1\n{\"v\":1,\"devices\":[]}",
    "gpumem-bridge 2\n{\"v\":1,\"devices\":[]}",
    "gpumem-bridge 01\n{\"v\":1,\"devices\":[]}",
    // Control data as recvmsg fills it in: SCM_CREDENTIALS, then
    // SCM_RIGHTS with three fds (little-endian, 64-bit).
    "\u{1c}\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}\u{1}\u{0}\u{0}\u{0}\u{2}\u{0}\u{0}\u{0}AAAABBBBCCCC\u{0}\u{0}\u{0}\u{0}\u{1c}\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}\u{1}\u{0}\u{0}\u{0}\u{1}\u{0}\u{0}\u{0}\u{5}\u{0}\u{0}\u{0}\u{6}\u{0}\u{0}\u{0}\u{7}\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}",
];

/// One packet on the torch bridge socket (header line, then the document).
#[test]
fn fuzz_torch_bridge_message() {
    fuzz("torch_message", TORCH_MESSAGES, |text| {
        fuzzing::torch_message(text.as_bytes())
    });
}

const SLURM_INPUTS: &[&str] = &[
    "11:memory:/slurm/uid_1000/job_4242/step_0/task_0\n4:freezer:/slurm/uid_1000/job_4242/step_0\n1:name=systemd:/system.slice/slurmd.service\n",
    "0::/system.slice/node1_slurmstepd.scope/job_77/step_batch/user/task_0\n",
    "0\n3\n1.2\nGPU-8f6b4c1e-0000-1111-2222-333344445555\nMIG-4f2c0000-1111-2222-3333-444455556666\n12345\n",
];

/// Slurm: `/proc/<pid>/cgroup` paths and job-mapping file names (the
/// AFL++ target `slurm`), and the same bytes as the `pod_resources` target
/// takes them (a protobuf answer; each line a device-plugin id).
#[test]
fn fuzz_slurm_parsers() {
    fuzz("slurm", SLURM_INPUTS, |text| {
        fuzzing::slurm(text.as_bytes());
        fuzzing::pod_resources(text.as_bytes());
    });
}

const JSON_ANSWERS: &[&str] = &[
    r#"{"Id":"f07636cd","Name":"/shop-web-1","State":{"Pid":4242},"Config":{"Hostname":"f07636cd","Image":"nginx:1.25","Labels":{"com.docker.compose.project":"shop","com.docker.compose.service":"web"}}}"#,
    r#"{"Id":"aa","Name":"/trainer-a","Config":{"Image":"localhost/busybox:e2e","Labels":null}}"#,
    r#"{"apiVersion":"resource.k8s.io/v1","kind":"ResourceSlice","metadata":{"name":"n"},"spec":{"driver":"gpu.nvidia.com","nodeName":"node-a","pool":{"name":"node-a","generation":1,"resourceSliceCount":1},"devices":[{"name":"gpu-0","attributes":{"uuid":{"string":"GPU-8f6b"}}},{"name":"gpu-1-mig-9-4-1","attributes":{"uuid":{"string":"MIG-4f2c"},"parentUUID":{"string":"GPU-8f6b"}}}]}}"#,
];

/// JSON from outside: a container engine's inspect answer and a
/// ResourceSlice (the AFL++ targets `container` and `resource_slice`).
#[test]
fn fuzz_container_and_resource_slice_answers() {
    fuzz("container+resource_slice", JSON_ANSWERS, |text| {
        fuzzing::container(text.as_bytes());
        fuzzing::resource_slice(text.as_bytes());
        // And the same bytes as a pod-resources answer (protobuf; the
        // AFL++ target `pod_resources`).
        fuzzing::pod_resources(text.as_bytes());
    });
}
