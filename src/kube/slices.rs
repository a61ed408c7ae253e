//! Which GPU a Dynamic Resource Allocation device is: this node's
//! ResourceSlices (`resource.k8s.io/v1`, Kubernetes 1.34 and later), kept
//! by a LIST/WATCH of kube-rs's `watcher`, as `(driver, pool, device)` →
//! GPU or MIG UUID.
//!
//! - **Why the slices.** The kubelet's pod-resources answer names a DRA
//!   device only by driver, pool and device name (`gpu-0`,
//!   `gpu-1-mig-9-4-1`); the UUID the GPU memory series carry is an
//!   attribute of that device in the driver's ResourceSlice. NVIDIA's DRA
//!   driver (`gpu.nvidia.com`) publishes `uuid` on every device (the MIG
//!   UUID for a MIG device, which also carries `parentUUID`, `profile` and
//!   `type: mig`); attributes may also be written qualified with the
//!   driver's domain (`gpu.nvidia.com/uuid`), which the API treats as the
//!   same name, so both are read. `parentUUID` places a MIG device on its
//!   GPU before a MIG rescan has seen it (one the driver just created).
//! - **Node-scoped, off the scrape and sample paths.** Like the pod
//!   watcher: `fieldSelector=spec.nodeName=<node>`, its own task, an
//!   immutable map published by swapping an `Arc`. The pod-resources client
//!   reads it when the kubelet answers, never a scrape.
//! - **Minimal RBAC.** `get`, `list`, `watch` on `resourceslices`
//!   (deploy/kubernetes/base/rbac.yaml). Without it (403) the watcher keeps
//!   retrying with backoff, counts the error, and the pod-resources client
//!   falls back to the index in the device's name (`podres::dra`).
//! - **Only GPUs.** A device whose `uuid` is not a GPU's (`GPU-…`) or a MIG
//!   device's (`MIG-…`) is not kept: other drivers' devices (NICs, FPGAs)
//!   stay out of `gpu_allocation_info`.

use std::collections::HashMap;
use std::fmt::Display;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use futures_util::StreamExt;
use k8s_openapi::api::resource::v1::{DeviceAttribute, ResourceSlice};
use kube::runtime::watcher::{self, Event};

use super::client;
use super::config::KubeConfig;
use crate::backoff::Backoff;
use crate::model::AllocatedDevice;
use crate::ratelimit::LogLimiter;

const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A repeated warning of the same kind is logged at most this often.
const WARN_INTERVAL: Duration = Duration::from_secs(60);
/// How long to wait before asking again an API server that does not serve
/// `resource.k8s.io/v1` (404).
const NOT_SERVED_RETRY: Duration = Duration::from_secs(600);

/// A device's key in the slices: its driver, pool and name, as the
/// kubelet's pod-resources answer names it.
pub(crate) type DeviceKey = (String, String, String);

/// This node's ResourceSlice devices that are GPUs or MIG devices. Cheap to
/// share; readers never block.
#[derive(Debug, Default)]
pub(crate) struct SliceIndex {
    devices: ArcSwap<HashMap<DeviceKey, AllocatedDevice>>,
    /// A LIST has completed (and the map reflects the API server).
    synced: AtomicBool,
    errors_total: AtomicU64,
}

impl SliceIndex {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// The GPU or MIG device `(driver, pool, device)` is, when a slice of
    /// this node said so.
    pub(crate) fn resolve(
        &self,
        driver: &str,
        pool: &str,
        device: &str,
    ) -> Option<AllocatedDevice> {
        let key = (driver.to_owned(), pool.to_owned(), device.to_owned());
        self.devices.load().get(&key).cloned()
    }

    /// Whether a LIST of the slices has completed.
    pub(crate) fn synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// Failed requests (a 403 included) and unusable objects so far.
    pub(crate) fn errors_total(&self) -> u64 {
        self.errors_total.load(Ordering::Relaxed)
    }
}

/// The GPU or MIG devices of one slice, by key.
pub(crate) fn devices_of(slice: &ResourceSlice) -> Vec<(DeviceKey, AllocatedDevice)> {
    let spec = &slice.spec;
    let driver = spec.driver.as_str();
    let qualified = format!("{driver}/uuid");
    let qualified_parent = format!("{driver}/parentUUID");
    spec.devices
        .iter()
        .flatten()
        .filter_map(|d| {
            let attrs = d.attributes.as_ref()?;
            let uuid = attrs
                .get("uuid")
                .or_else(|| attrs.get(&qualified))
                .and_then(|a: &DeviceAttribute| a.string.as_deref())?;
            let parent = attrs
                .get("parentUUID")
                .or_else(|| attrs.get(&qualified_parent))
                .and_then(|a: &DeviceAttribute| a.string.as_deref())
                .filter(|p| p.starts_with("GPU-"));
            let device = if uuid.starts_with("MIG-") {
                match parent {
                    Some(p) => AllocatedDevice::MigOfParent {
                        mig_uuid: uuid.to_owned(),
                        gpu_uuid: p.to_owned(),
                    },
                    None => AllocatedDevice::Mig {
                        mig_uuid: uuid.to_owned(),
                    },
                }
            } else if uuid.starts_with("GPU-") {
                AllocatedDevice::Gpu {
                    uuid: uuid.to_owned(),
                }
            } else {
                return None;
            };
            Some((
                (driver.to_owned(), spec.pool.name.clone(), d.name.clone()),
                device,
            ))
        })
        .collect()
}

/// Runs forever on the current tokio runtime: LIST and WATCH this node's
/// ResourceSlices into `index`, retrying with a jittered backoff.
pub(crate) async fn run_slice_watcher(cfg: KubeConfig, index: Arc<SliceIndex>) {
    if cfg.node_name.is_empty() {
        return;
    }
    let mut backoff = Backoff::jittered(BACKOFF_MIN, BACKOFF_MAX);
    let mut said_not_served = false;
    let mut warnings: LogLimiter<&'static str> = LogLimiter::every(WARN_INTERVAL);
    let mut error = |kind: &'static str, e: &dyn Display| {
        index.errors_total.fetch_add(1, Ordering::Relaxed);
        if let Some(suppressed) = warnings.check(kind) {
            tracing::warn!(kind, error = %e, suppressed, "kubernetes ResourceSlice watcher");
        }
    };
    loop {
        let built = match client::build(&cfg, Arc::new(|| {})).await {
            Ok(b) => b,
            Err(e) => {
                error("client", &e);
                tokio::time::sleep(backoff.next_delay()).await;
                continue;
            }
        };
        let api: kube::Api<ResourceSlice> = kube::Api::all(built.client);
        let selector = format!("spec.nodeName={}", cfg.node_name);
        let mut config = watcher::Config::default().fields(&selector).any_semantic();
        config.page_size = None;
        let mut stream = watcher::watcher(api, config).boxed();
        // Slice name → its devices.
        let mut local: HashMap<String, Vec<(DeviceKey, AllocatedDevice)>> = HashMap::new();
        let mut fresh: Option<HashMap<String, Vec<(DeviceKey, AllocatedDevice)>>> = None;
        let publish = |slices: &HashMap<String, Vec<(DeviceKey, AllocatedDevice)>>| {
            let map: HashMap<DeviceKey, AllocatedDevice> =
                slices.values().flatten().cloned().collect();
            index.devices.store(Arc::new(map));
        };
        let ours = |s: &ResourceSlice| s.spec.node_name.as_deref() == Some(cfg.node_name.as_str());
        while let Some(item) = stream.next().await {
            match item {
                Ok(Event::Init) => fresh = Some(HashMap::new()),
                Ok(Event::InitApply(s)) => {
                    if let (Some(f), Some(name)) = (&mut fresh, s.metadata.name.clone())
                        && ours(&s)
                    {
                        f.insert(name, devices_of(&s));
                    }
                }
                Ok(Event::InitDone) => {
                    local = fresh.take().unwrap_or_default();
                    publish(&local);
                    if !index.synced.swap(true, Ordering::AcqRel) {
                        tracing::info!(
                            slices = local.len(),
                            node = %cfg.node_name,
                            "ResourceSlice list synced"
                        );
                    }
                    backoff.reset();
                }
                Ok(Event::Apply(s)) => {
                    if let Some(name) = s.metadata.name.clone() {
                        if ours(&s) {
                            local.insert(name, devices_of(&s));
                        } else {
                            local.remove(&name);
                        }
                        publish(&local);
                    }
                }
                Ok(Event::Delete(s)) => {
                    if let Some(name) = &s.metadata.name
                        && local.remove(name).is_some()
                    {
                        publish(&local);
                    }
                }
                Err(e) if is_not_served(&e) => {
                    // A cluster before 1.34: said once, counted, asked
                    // again rarely (an upgrade may bring the API).
                    error("not served", &e);
                    if !said_not_served {
                        said_not_served = true;
                        tracing::info!(
                            "resource.k8s.io/v1 ResourceSlices are not served (Kubernetes before 1.34?): DRA devices are placed by the index in their name"
                        );
                    }
                    tokio::time::sleep(NOT_SERVED_RETRY).await;
                }
                Err(e) => {
                    let kind = match &e {
                        watcher::Error::InitialListFailed(_) => "list",
                        watcher::Error::WatchStartFailed(_) => "watch start",
                        watcher::Error::WatchError(s) if s.code == 410 => {
                            tokio::time::sleep(backoff.next_delay()).await;
                            continue;
                        }
                        watcher::Error::WatchError(_) => "watch error event",
                        watcher::Error::WatchFailed(_) => "watch",
                        watcher::Error::NoResourceVersion => "resource version",
                    };
                    error(kind, &e);
                    tokio::time::sleep(backoff.next_delay()).await;
                }
            }
        }
    }
}

/// The API server does not know the resource (404): no `resource.k8s.io/v1`.
fn is_not_served(e: &watcher::Error) -> bool {
    matches!(
        e,
        watcher::Error::InitialListFailed(kube::Error::Api(s)) if s.code == 404
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A slice as NVIDIA's DRA driver publishes it (trimmed): a whole GPU,
    /// a MIG device with its parent, a device with a qualified attribute
    /// name, and a device that is no GPU.
    #[test]
    fn devices_of_a_slice() {
        let slice: ResourceSlice = serde_json::from_value(serde_json::json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": "node-1-gpu.nvidia.com-x7k2p"},
            "spec": {
                "driver": "gpu.nvidia.com",
                "nodeName": "node-1",
                "pool": {"name": "node-1", "generation": 1, "resourceSliceCount": 1},
                "devices": [
                    {"name": "gpu-0", "attributes": {
                        "type": {"string": "gpu"},
                        "uuid": {"string": "GPU-0000"},
                        "productName": {"string": "NVIDIA H200"},
                        "driverVersion": {"version": "580.159.4"}}},
                    {"name": "gpu-1-mig-9-4-1", "attributes": {
                        "type": {"string": "mig"},
                        "uuid": {"string": "MIG-1111"},
                        "parentUUID": {"string": "GPU-1000"},
                        "profile": {"string": "1g.18gb"}}},
                    {"name": "gpu-1-mig-9-5-1", "attributes": {"uuid": {"string": "MIG-1112"}}},
                    {"name": "gpu-2", "attributes": {"gpu.nvidia.com/uuid": {"string": "GPU-2000"}}},
                    {"name": "nic-0", "attributes": {"uuid": {"string": "0000:3b:00.0"}}},
                    {"name": "bare"}
                ]
            }
        }))
        .unwrap();
        let key = |d: &str| ("gpu.nvidia.com".into(), "node-1".into(), d.into());
        assert_eq!(
            devices_of(&slice),
            vec![
                (
                    key("gpu-0"),
                    AllocatedDevice::Gpu {
                        uuid: "GPU-0000".into()
                    }
                ),
                (
                    key("gpu-1-mig-9-4-1"),
                    AllocatedDevice::MigOfParent {
                        mig_uuid: "MIG-1111".into(),
                        gpu_uuid: "GPU-1000".into()
                    }
                ),
                (
                    key("gpu-1-mig-9-5-1"),
                    AllocatedDevice::Mig {
                        mig_uuid: "MIG-1112".into()
                    }
                ),
                (
                    key("gpu-2"),
                    AllocatedDevice::Gpu {
                        uuid: "GPU-2000".into()
                    }
                ),
            ]
        );
    }
}
