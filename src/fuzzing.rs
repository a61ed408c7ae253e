//! Entry points for the fuzz targets (`fuzz/`) into parsers that are
//! private to the crate: the kubelet's pod-resources answer (device-plugin
//! and DRA allocations), ResourceSlice objects from the API server, and
//! the Slurm job-mapping directory's file names. Each takes the raw bytes
//! the exporter would read and asserts what the exporter relies on; a
//! panic is a finding. Not part of the public contract (hidden from the
//! docs); the public parsers (config, /proc, cgroup, torch, container
//! engine answers) are fuzzed directly.

use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceSlice;
use prost::Message as _;

use crate::config::{JobMappingFormat, PodResourcesConfig};
use crate::model::AllocatedDevice;
use crate::podres::{self, dra, proto};

/// A `ListPodResourcesResponse` (protobuf) as the kubelet's socket answers
/// it: the device-plugin allocations are sorted, unique and only of
/// exported resources; the DRA ones (no ResourceSlice watcher: the name
/// fallback) are sorted and unique, each from a claim of the answer.
pub fn pod_resources(data: &[u8]) {
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
pub fn device_id(id: &str) {
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

/// A file name in the Slurm job-mapping directory, in both formats: a GPU
/// index is 1–4 digits and nothing else.
pub fn job_mapping_name(name: &str) {
    for format in [JobMappingFormat::Dcgm, JobMappingFormat::Jobstats] {
        if let Some(AllocatedDevice::GpuIndex { gpu }) = crate::jobmap::device_of(name, format) {
            assert!(
                !gpu.is_empty() && gpu.len() <= 4 && gpu.bytes().all(|b| b.is_ascii_digit()),
                "{name:?} -> {gpu:?}"
            );
        }
    }
}
