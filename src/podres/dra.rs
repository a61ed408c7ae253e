//! The Dynamic Resource Allocation part of the kubelet's `List` answer:
//! per container, `dynamic_resources` (claim namespace and name; per device
//! the driver, pool and device name) → [`DraAllocation`]s, read from the
//! same answer as the device plugin's devices (no call of its own).
//!
//! - **Which GPU.** The answer names a device only by (driver, pool,
//!   device). Its UUID comes from this node's ResourceSlices
//!   ([`SliceIndex`], kept by `kube::slices`' watcher); the MIG instance
//!   ids then come from the snapshot, like every other MIG row.
//! - **The fallback**, when the slices cannot be read (the pod watcher is
//!   off, or the API refuses them, e.g. 403 without the `resourceslices`
//!   rule) or do not have the device: NVIDIA's DRA driver names devices
//!   `gpu-<minor>` and `gpu-<minor>-mig-<profile>-<start>-<size>`, so the
//!   number after `gpu-` is taken as the GPU's index (the sampler's `gpu`
//!   label, which equals the minor number where NVML's order is the
//!   driver's, as on every node we have seen; docs/attribution.md). A MIG
//!   device so placed names its parent GPU only. A name without that
//!   number is exported without a GPU. Each device so placed is counted
//!   (`gpumem_exporter_dra_fallbacks_total`), and each reason is logged
//!   once. Until the slice watcher's first answer (or first error) the
//!   fallback is used without counting it: that is only the start.
//! - **Only GPUs.** A device is exported when its slice gives it a GPU or
//!   MIG UUID, or, for the fallback, when its driver is NVIDIA's GPU driver
//!   ([`NVIDIA_GPU_DRIVER`]); other drivers' devices (NICs,
//!   `compute-domain.nvidia.com` channels) are not GPUs.
//! - **Pod UIDs** come from the pod watcher's index by namespace and name
//!   (the kubelet's answer has none); absent while it is off.

use std::sync::Arc;

use super::proto;
use crate::kube::{PodIndex, SliceIndex};
use crate::model::{AllocatedDevice, DraAllocation};
use crate::ratelimit::LogLimiter;

/// NVIDIA's DRA driver for GPUs and MIG devices.
pub(crate) const NVIDIA_GPU_DRIVER: &str = "gpu.nvidia.com";

/// Why a device was placed by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Fallback {
    /// No slice watcher: the pod watcher (`kubernetes.enabled`) is off.
    NoWatcher,
    /// The slice watcher has failed and not listed the slices (yet).
    NotReadable,
    /// Listed, but no slice of this node has the device.
    NotInSlices,
}

impl Fallback {
    fn as_str(self) -> &'static str {
        match self {
            Fallback::NoWatcher => {
                "the Kubernetes API is not used (kubernetes.enabled is off): ResourceSlices are not read"
            }
            Fallback::NotReadable => {
                "this node's ResourceSlices cannot be read (is get/list/watch on resourceslices granted? deploy/kubernetes/base/rbac.yaml)"
            }
            Fallback::NotInSlices => "no ResourceSlice of this node has the device",
        }
    }
}

/// What resolves DRA devices: the slices, the pods, and the once-per-reason
/// log.
#[derive(Debug)]
pub(crate) struct Resolver {
    slices: Option<Arc<SliceIndex>>,
    pods: Option<Arc<PodIndex>>,
    logged: LogLimiter<Fallback>,
}

impl Resolver {
    pub(crate) fn new(slices: Option<Arc<SliceIndex>>, pods: Option<Arc<PodIndex>>) -> Resolver {
        Resolver {
            slices,
            pods,
            logged: LogLimiter::once(),
        }
    }

    /// The slice watcher's error count, when it runs.
    pub(crate) fn slice_errors_total(&self) -> Option<u64> {
        self.slices.as_ref().map(|s| s.errors_total())
    }

    /// One device: where it is, and whether that was a counted fallback.
    /// `None`: not a GPU.
    fn device(&mut self, r: &proto::ClaimResource) -> Option<(AllocatedDevice, bool)> {
        let reason = match &self.slices {
            None => Some(Fallback::NoWatcher),
            Some(s) => {
                if let Some(d) = s.resolve(&r.driver_name, &r.pool_name, &r.device_name) {
                    return Some((d, false));
                }
                if s.synced() {
                    Some(Fallback::NotInSlices)
                } else if s.errors_total() > 0 {
                    Some(Fallback::NotReadable)
                } else {
                    // The watcher has not answered yet: the start.
                    None
                }
            }
        };
        if r.driver_name != NVIDIA_GPU_DRIVER {
            return None;
        }
        if let Some(reason) = reason
            && self.logged.check(reason).is_some()
        {
            tracing::warn!(
                reason = reason.as_str(),
                driver = %r.driver_name,
                pool = %r.pool_name,
                device = %r.device_name,
                "DRA device placed by the index in its name, not by a ResourceSlice (said once per reason)"
            );
        }
        Some((by_name(&r.device_name), reason.is_some()))
    }
}

/// The fallback: `gpu-<n>` and `gpu-<n>-mig-…` → GPU `n`; anything else
/// → unknown.
pub(crate) fn by_name(device: &str) -> AllocatedDevice {
    let n = device
        .strip_prefix("gpu-")
        .map(|rest| rest.split_once('-').map_or(rest, |(n, _)| n))
        .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|n| n.parse::<u32>().ok());
    match n {
        Some(n) => AllocatedDevice::GpuIndex { gpu: n.to_string() },
        None => AllocatedDevice::Other { id: String::new() },
    }
}

/// The DRA allocations of one answer, sorted, duplicates removed, and the
/// number of counted fallbacks among them.
pub(crate) fn allocations(
    answer: &proto::ListPodResourcesResponse,
    resolver: &mut Resolver,
) -> (Vec<DraAllocation>, u64) {
    let mut out = Vec::new();
    let mut fallbacks = 0;
    for pod in &answer.pod_resources {
        let mut pod_uid: Option<Option<String>> = None;
        for c in &pod.containers {
            for claim in &c.dynamic_resources {
                for r in &claim.claim_resources {
                    let Some((device, fallback)) = resolver.device(r) else {
                        continue;
                    };
                    fallbacks += u64::from(fallback);
                    let uid = pod_uid
                        .get_or_insert_with(|| {
                            resolver
                                .pods
                                .as_ref()
                                .and_then(|p| p.uid_of(&pod.namespace, &pod.name))
                        })
                        .clone();
                    out.push(DraAllocation {
                        namespace: pod.namespace.clone(),
                        pod: pod.name.clone(),
                        container: c.name.clone(),
                        pod_uid: uid,
                        claim_namespace: claim.claim_namespace.clone(),
                        claim_name: claim.claim_name.clone(),
                        driver: r.driver_name.clone(),
                        pool: r.pool_name.clone(),
                        device_name: r.device_name.clone(),
                        device,
                    });
                }
            }
        }
    }
    out.sort();
    out.dedup();
    (out, fallbacks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fallback_by_name() {
        let gpu = |n: &str| AllocatedDevice::GpuIndex { gpu: n.into() };
        let unknown = AllocatedDevice::Other { id: String::new() };
        for (name, want) in [
            ("gpu-0", gpu("0")),
            ("gpu-13", gpu("13")),
            ("gpu-1-mig-9-4-1", gpu("1")),
            ("gpu-vfio-0", unknown.clone()),
            ("gpu-", unknown.clone()),
            ("gpu-+1", unknown.clone()),
            ("gpu-99999999999", unknown.clone()),
            ("nic-0", unknown.clone()),
            ("", unknown.clone()),
        ] {
            assert_eq!(by_name(name), want, "{name:?}");
        }
    }

    fn claim(ns: &str, name: &str, devices: &[(&str, &str)]) -> proto::DynamicResource {
        proto::DynamicResource {
            claim_name: name.into(),
            claim_namespace: ns.into(),
            claim_resources: devices
                .iter()
                .map(|(driver, device)| proto::ClaimResource {
                    cdi_devices: vec![],
                    driver_name: (*driver).into(),
                    pool_name: "node-1".into(),
                    device_name: (*device).into(),
                })
                .collect(),
        }
    }

    /// Without slices: NVIDIA's devices by name (counted), another
    /// driver's left out, the pod UID from the index.
    #[test]
    fn answer_without_slices() {
        let answer = proto::ListPodResourcesResponse {
            pod_resources: vec![proto::PodResources {
                name: "trainer-0".into(),
                namespace: "team-a".into(),
                containers: vec![proto::ContainerResources {
                    name: "trainer".into(),
                    dynamic_resources: vec![
                        claim(
                            "team-a",
                            "gpus",
                            &[(NVIDIA_GPU_DRIVER, "gpu-1"), ("nic.example.com", "nic-0")],
                        ),
                        claim("team-a", "gpus", &[(NVIDIA_GPU_DRIVER, "gpu-1")]),
                    ],
                    ..Default::default()
                }],
            }],
        };
        let pods = Arc::new(PodIndex::new());
        pods.insert("uid-1", &[], "team-a", "trainer-0");
        let mut r = Resolver::new(None, Some(pods));
        let (got, fallbacks) = allocations(&answer, &mut r);
        assert_eq!(
            got,
            vec![DraAllocation {
                namespace: "team-a".into(),
                pod: "trainer-0".into(),
                container: "trainer".into(),
                pod_uid: Some("uid-1".into()),
                claim_namespace: "team-a".into(),
                claim_name: "gpus".into(),
                driver: NVIDIA_GPU_DRIVER.into(),
                pool: "node-1".into(),
                device_name: "gpu-1".into(),
                device: AllocatedDevice::GpuIndex { gpu: "1".into() },
            }]
        );
        assert_eq!(fallbacks, 2);
        assert_eq!(r.slice_errors_total(), None);
    }
}
