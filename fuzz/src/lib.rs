//! The checks each fuzz target runs on one input; a panic is a crash for
//! AFL++. The same checks (with the same invariants) are what the proptest
//! fuzzers in tests/e2e/fuzz.rs assert, so a crash found here can be
//! replayed there as a regression test.

use std::path::Path;
use std::time::Duration;

use gpumem_exporter::testing::attribute::{cgroup, containers, passwd, procfs, redact, slurm, torch};
use gpumem_exporter::testing::config;
use gpumem_exporter::testing::http::{negotiate, web_config};

/// Bytes as text the way the exporter reads files: invalid UTF-8 is an
/// error there before any parser runs, so it is skipped here.
fn text(data: &[u8]) -> Option<&str> {
    std::str::from_utf8(data).ok()
}

/// `--config.file`: accepted configs hold their invariants; errors are one
/// line naming the file.
pub fn config(data: &[u8]) {
    let Some(text) = text(data) else { return };
    match config::parse(text, "fuzz.yaml") {
        Ok(c) => {
            assert!(c.timing.sample_interval >= Duration::from_millis(10));
            assert!(c.timing.memory_sample_interval <= c.timing.sample_interval);
            assert!(c.timing.peak_window >= c.timing.sample_interval);
            assert!(c.http.telemetry_path.starts_with('/'));
        }
        Err(e) => {
            let e = e.to_string();
            assert!(!e.contains('\n'), "errors are one line: {e:?}");
            assert!(e.starts_with("config file fuzz.yaml"), "{e:?}");
        }
    }
}

/// `--web.config.file` (relative paths point into a folder that does not
/// exist, so certificate files are never read).
pub fn web_config(data: &[u8]) {
    let Some(text) = text(data) else { return };
    match web_config::parse(text, "web.yml", Path::new("/nonexistent-fuzz")) {
        Ok(c) => {
            assert!(c.limits.max_connections >= 1);
            assert!(c.limits.max_connections_per_ip >= 1);
            assert!(c.limits.max_connections_per_ip <= c.limits.max_connections);
        }
        Err(e) => {
            let e = e.to_string();
            assert!(!e.contains('\n'), "errors are one line: {e:?}");
        }
    }
}

/// `/proc/<pid>/stat`, `/proc/<pid>/status` and `/proc/<pid>/cmdline`
/// (with the redaction of command lines).
pub fn proc(data: &[u8]) {
    let args = procfs::parse_cmdline(data);
    let red = redact::redact_cmdline(&args, 64);
    assert!(red.chars().count() <= 64, "{red:?}");
    let Some(text) = text(data) else { return };
    let _ = procfs::parse_stat_start_time(text);
    let _ = procfs::parse_status_uid(text);
}

/// `/etc/passwd`: names kept are non-empty and never NIS `+`/`-` entries.
pub fn passwd(data: &[u8]) {
    let Some(text) = text(data) else { return };
    for name in passwd::parse_passwd(text).values() {
        assert!(
            !name.is_empty() && !name.starts_with(['+', '-']),
            "{name:?}"
        );
    }
}

/// `/proc/<pid>/cgroup`: whatever is found is well-formed.
pub fn cgroup(data: &[u8]) {
    let Some(text) = text(data) else { return };
    let id = cgroup::parse_cgroup(text);
    if let Some(c) = &id.container_id {
        assert!(cgroup::is_container_id(c), "{c:?}");
    }
    if let Some(u) = &id.pod_uid {
        assert!(cgroup::is_pod_uid(u), "{u:?}");
    }
}

/// The `Accept` and `Accept-Encoding` request headers.
pub fn accept(data: &[u8]) {
    let Some(text) = text(data) else { return };
    let _ = negotiate::format(Some(text));
    let _ = negotiate::accepts_gzip(Some(text));
}

/// The torch bridge document, read from another process's memfd.
pub fn torch(data: &[u8]) {
    if let Ok(doc) = torch::parse(data) {
        assert!(data.len() as u64 <= torch::MAX_DOCUMENT_BYTES);
        let _ = doc;
    }
}

/// The kubelet's pod-resources answer (protobuf): device-plugin and DRA
/// allocations, and each device id the device plugin could send (the
/// input's lines).
pub fn pod_resources(data: &[u8]) {
    gpumem_exporter::testing::fuzzing::pod_resources(data);
    if let Some(text) = text(data) {
        for id in text.lines() {
            gpumem_exporter::testing::fuzzing::device_id(id);
        }
    }
}

/// A ResourceSlice from the API server (JSON).
pub fn resource_slice(data: &[u8]) {
    gpumem_exporter::testing::fuzzing::resource_slice(data);
}

/// Slurm: a `/proc/<pid>/cgroup` (the job, step and uid of its paths) and
/// job-mapping file names (each line).
pub fn slurm(data: &[u8]) {
    let Some(text) = text(data) else { return };
    if let Some(job) = slurm::parse_slurm_cgroup(text) {
        assert!(!job.job.is_empty(), "{job:?}");
    }
    for line in text.lines() {
        let _ = slurm::parse_slurm_path(line);
        gpumem_exporter::testing::fuzzing::job_mapping_name(line);
    }
}

/// A container engine's inspect answer (Docker or Podman, JSON): values
/// are cut to their bound.
pub fn container(data: &[u8]) {
    if let Ok(info) = containers::client::parse(data) {
        for v in [
            &info.name,
            &info.image,
            &info.compose_project,
            &info.compose_service,
        ] {
            assert!(
                v.chars().count() <= containers::client::MAX_VALUE_CHARS,
                "{v:?}"
            );
        }
    }
}
