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
    let mut w = SliceWatcher {
        cfg,
        index,
        local: HashMap::new(),
        fresh: None,
        backoff: Backoff::jittered(BACKOFF_MIN, BACKOFF_MAX),
        said_not_served: false,
        warnings: LogLimiter::every(WARN_INTERVAL),
    };
    loop {
        let built = match client::build(&w.cfg, Arc::new(|| {})).await {
            Ok(b) => b,
            Err(e) => {
                w.error("client", &e);
                tokio::time::sleep(w.backoff.next_delay()).await;
                continue;
            }
        };
        w.watch(built.client).await;
    }
}

/// The devices of each slice, by slice name.
type SliceDevices = HashMap<String, Vec<(DeviceKey, AllocatedDevice)>>;

/// The slice watcher's state across its streams, like the pod watcher's
/// (`watch.rs`).
struct SliceWatcher {
    cfg: KubeConfig,
    index: Arc<SliceIndex>,
    /// This stream's slices; published after each change.
    local: SliceDevices,
    /// Slices of a LIST in progress (between `Init` and `InitDone`).
    fresh: Option<SliceDevices>,
    backoff: Backoff,
    /// The API is not served (before Kubernetes 1.34): said once.
    said_not_served: bool,
    /// Per kind of error.
    warnings: LogLimiter<&'static str>,
}

impl SliceWatcher {
    /// One `watcher` stream, from an empty map, until it ends.
    async fn watch(&mut self, client: kube::Client) {
        let api: kube::Api<ResourceSlice> = kube::Api::all(client);
        let selector = format!("spec.nodeName={}", self.cfg.node_name);
        let mut config = watcher::Config::default().fields(&selector).any_semantic();
        config.page_size = None;
        let mut stream = watcher::watcher(api, config).boxed();
        self.local = HashMap::new();
        self.fresh = None;
        while let Some(item) = stream.next().await {
            match item {
                Ok(event) => self.apply(event),
                Err(e) => self.failed(e).await,
            }
        }
    }

    /// One event into the map: a LIST replaces it when done, a change of
    /// one slice changes its entry. Published whenever it changed.
    fn apply(&mut self, event: Event<ResourceSlice>) {
        match event {
            Event::Init => self.fresh = Some(HashMap::new()),
            Event::InitApply(s) => {
                let ours = self.ours(&s);
                if let (Some(f), Some(name)) = (&mut self.fresh, s.metadata.name.clone())
                    && ours
                {
                    f.insert(name, devices_of(&s));
                }
            }
            Event::InitDone => {
                self.local = self.fresh.take().unwrap_or_default();
                self.publish();
                if !self.index.synced.swap(true, Ordering::AcqRel) {
                    tracing::info!(
                        slices = self.local.len(),
                        node = %self.cfg.node_name,
                        "ResourceSlice list synced"
                    );
                }
                self.backoff.reset();
            }
            Event::Apply(s) => {
                if let Some(name) = s.metadata.name.clone() {
                    if self.ours(&s) {
                        self.local.insert(name, devices_of(&s));
                    } else {
                        self.local.remove(&name);
                    }
                    self.publish();
                }
            }
            Event::Delete(s) => {
                if let Some(name) = &s.metadata.name
                    && self.local.remove(name).is_some()
                {
                    self.publish();
                }
            }
        }
    }

    /// A failed request: counted, logged by kind, and waited out (a 410
    /// Gone watch is kube-rs relisting: waited out but not an error).
    async fn failed(&mut self, e: watcher::Error) {
        if is_not_served(&e) {
            return self.not_served(&e).await;
        }
        let kind = match &e {
            watcher::Error::InitialListFailed(_) => "list",
            watcher::Error::WatchStartFailed(_) => "watch start",
            watcher::Error::WatchError(s) if s.code == 410 => {
                tokio::time::sleep(self.backoff.next_delay()).await;
                return;
            }
            watcher::Error::WatchError(_) => "watch error event",
            watcher::Error::WatchFailed(_) => "watch",
            watcher::Error::NoResourceVersion => "resource version",
        };
        self.error(kind, &e);
        tokio::time::sleep(self.backoff.next_delay()).await;
    }

    /// A cluster before 1.34: said once, counted, asked again rarely (an
    /// upgrade may bring the API).
    async fn not_served(&mut self, e: &watcher::Error) {
        self.error("not served", e);
        if !self.said_not_served {
            self.said_not_served = true;
            tracing::info!(
                "resource.k8s.io/v1 ResourceSlices are not served (Kubernetes before 1.34?): DRA devices are placed by the index in their name"
            );
        }
        tokio::time::sleep(NOT_SERVED_RETRY).await;
    }

    /// Counted, and logged at most once per [`WARN_INTERVAL`] per kind.
    fn error(&mut self, kind: &'static str, e: &dyn Display) {
        self.index.errors_total.fetch_add(1, Ordering::Relaxed);
        if let Some(suppressed) = self.warnings.check(kind) {
            tracing::warn!(kind, error = %e, suppressed, "kubernetes ResourceSlice watcher");
        }
    }

    /// The field selector asks for this node's slices; a slice that moved
    /// to another node leaves the map.
    fn ours(&self, s: &ResourceSlice) -> bool {
        s.spec.node_name.as_deref() == Some(self.cfg.node_name.as_str())
    }

    /// The map readers see: every slice's devices, swapped in whole.
    fn publish(&self) {
        let map: HashMap<DeviceKey, AllocatedDevice> =
            self.local.values().flatten().cloned().collect();
        self.index.devices.store(Arc::new(map));
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
