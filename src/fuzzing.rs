//! The fuzz targets' checks, the one place they are written: one function
//! per target, each taking the raw bytes the exporter would read, parsing
//! them and asserting what the exporter relies on; a panic is a finding.
//! The AFL++ binaries in `fuzz/src/bin/` call them (one each), and so do
//! their proptest twins in `tests/e2e/fuzz.rs`, so a crash AFL++ finds
//! replays there as a regression test. Reached through the hidden
//! `testing` module; the parsers themselves stay private to the crate.

use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceSlice;
use prost::Message as _;

use crate::attribute::{cgroup, passwd, procfs, redact, slurm};
use crate::bridge as torch;
use crate::config::{JobMappingFormat, PodResourcesConfig};
use crate::containers;
use crate::http::{negotiate, web_config};
use crate::model::AllocatedDevice;
use crate::podres::{self, dra, proto};

/// Bytes as text the way the exporter reads files: invalid UTF-8 is an
/// error there before any parser runs, so it is skipped here.
fn text(data: &[u8]) -> Option<&str> {
    std::str::from_utf8(data).ok()
}

/// `--config.file`: accepted configs hold their invariants; errors are one
/// line naming the file.
pub fn config(data: &[u8]) {
    let Some(text) = text(data) else { return };
    match crate::config::parse(text, "fuzz.yaml") {
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
/// exist, so certificate files are never read): accepted limits are
/// usable; errors are one line.
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
/// (with the redaction of command lines, cut to its bound).
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

/// The `Accept` and `Accept-Encoding` request headers: never a panic.
pub fn accept(data: &[u8]) {
    let Some(text) = text(data) else { return };
    let _ = negotiate::format(Some(text));
    let _ = negotiate::accepts_gzip(Some(text));
}

/// The torch bridge document, read from another process's memfd: one is
/// accepted only within its size bound.
pub fn torch(data: &[u8]) {
    if let Ok(doc) = torch::parse(data) {
        assert!(data.len() as u64 <= torch::MAX_DOCUMENT_BYTES);
        let _ = doc;
    }
}

/// One packet on the torch bridge socket (any process may send one): a
/// message is accepted only within its size bound, with the header of the
/// one framing version, and its document is what the document parser
/// makes of the rest; a refusal names a closed reason. The same bytes as
/// the message's control data (what `recvmsg` fills in beside it): the
/// walk never reads past them, and a fd or a sender comes only from
/// whole fields inside them.
pub fn torch_message(data: &[u8]) {
    use torch::frame;
    let control = torch::control::parse(data);
    assert!(control.fds.len() * 4 <= data.len());
    if control.sender.is_some() {
        assert!(data.len() >= std::mem::size_of::<libc::cmsghdr>() + 8);
    }
    match frame::parse_message(data) {
        Ok(doc) => {
            assert!(data.len() <= frame::MAX_MESSAGE_BYTES);
            let body = data
                .iter()
                .position(|b| *b == b'\n')
                .map(|i| &data[i + 1..])
                .unwrap_or_default();
            assert!(data.starts_with(frame::MAGIC));
            assert_eq!(torch::parse(body).ok(), Some(doc));
        }
        Err(e) => {
            let reason = e.reason().as_str();
            assert!(matches!(reason, "malformed" | "oversized"), "{reason}");
            if let frame::FrameError::Version(v) = e {
                assert_ne!(v, frame::FRAME_VERSION);
            }
        }
    }
}

/// The kubelet's pod-resources answer (protobuf): device-plugin and DRA
/// allocations, and each device id the device plugin could send (the
/// input's lines).
pub fn pod_resources(data: &[u8]) {
    pod_resources_answer(data);
    if let Some(text) = text(data) {
        for id in text.lines() {
            device_id(id);
        }
    }
}

/// A `ListPodResourcesResponse` as the kubelet's socket answers it: the
/// device-plugin allocations are sorted, unique and only of exported
/// resources; the DRA ones (no ResourceSlice watcher: the name fallback)
/// are sorted and unique, each from a claim of the answer.
fn pod_resources_answer(data: &[u8]) {
    let Ok(answer) = proto::ListPodResourcesResponse::decode(data) else {
        return;
    };
    let cfg = PodResourcesConfig {
        socket: Default::default(),
        interval: Duration::from_secs(1),
        extra_resources: vec!["example.com/gpu".into()],
    };
    let claimed: usize = answer
        .pod_resources
        .iter()
        .flat_map(|p| &p.containers)
        .flat_map(|c| &c.dynamic_resources)
        .map(|d| d.claim_resources.len())
        .sum();
    let mut resolver = dra::Resolver::new(None, None);
    let (dras, fallbacks) = dra::allocations(&answer, &mut resolver);
    assert!(
        dras.windows(2).all(|w| w[0] < w[1]),
        "DRA rows sorted, unique"
    );
    assert!(dras.len() <= claimed, "a row per claimed device at most");
    assert!(
        fallbacks <= claimed as u64,
        "a fallback per claimed device at most"
    );
    let plugin = podres::allocations(answer, &cfg);
    assert!(plugin.windows(2).all(|w| w[0] < w[1]), "sorted, unique");
    for a in &plugin {
        assert!(cfg.exports(&a.resource), "{a:?}");
    }
}

/// A device id of the device plugin (`GPU-…`, `MIG-…`, `…::<replica>`).
fn device_id(id: &str) {
    let (device, replica) = podres::parse_device_id(id);
    if replica.is_some() {
        assert!(id.contains("::"), "{id:?}");
    }
    if let AllocatedDevice::Gpu { uuid } = &device {
        assert!(
            uuid.starts_with("GPU-") && id.contains(uuid.as_str()),
            "{id:?}"
        );
    }
}

/// A ResourceSlice as the API server sends it (JSON): whatever devices it
/// yields are GPU or MIG UUIDs of the slice's own driver and pool.
pub fn resource_slice(data: &[u8]) {
    let Ok(slice) = serde_json::from_slice::<ResourceSlice>(data) else {
        return;
    };
    for ((driver, pool, _), device) in crate::kube::slices::devices_of(&slice) {
        assert_eq!(driver, slice.spec.driver);
        assert_eq!(pool, slice.spec.pool.name);
        let ok = match &device {
            AllocatedDevice::Gpu { uuid } => uuid.starts_with("GPU-"),
            AllocatedDevice::Mig { mig_uuid } => mig_uuid.starts_with("MIG-"),
            AllocatedDevice::MigOfParent { mig_uuid, gpu_uuid } => {
                mig_uuid.starts_with("MIG-") && gpu_uuid.starts_with("GPU-")
            }
            _ => false,
        };
        assert!(ok, "{device:?}");
    }
}

/// Slurm: a `/proc/<pid>/cgroup` (a job found has a name) and, each line,
/// a cgroup path (the job, step and uid in it) and a job-mapping file name.
pub fn slurm(data: &[u8]) {
    let Some(text) = text(data) else { return };
    if let Some(job) = slurm::parse_slurm_cgroup(text) {
        assert!(!job.job.is_empty(), "{job:?}");
    }
    for line in text.lines() {
        let _ = slurm::parse_slurm_path(line);
        job_mapping_name(line);
    }
}

/// A file name in the Slurm job-mapping directory, in both formats: a GPU
/// index is 1–4 digits and nothing else.
fn job_mapping_name(name: &str) {
    for format in [JobMappingFormat::Dcgm, JobMappingFormat::Jobstats] {
        if let Some(AllocatedDevice::GpuIndex { gpu }) = crate::jobmap::device_of(name, format) {
            assert!(
                !gpu.is_empty() && gpu.len() <= 4 && gpu.bytes().all(|b| b.is_ascii_digit()),
                "{name:?} -> {gpu:?}"
            );
        }
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
