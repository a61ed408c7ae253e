//! A fake kubelet: its pod-resources API, `v1.PodResourcesLister`, served
//! with tonic on a Unix socket from the same proto the exporter is built
//! with (build.rs generates this server beside the exporter's client). The
//! test sets the pods and their devices; `List` answers them.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

#[allow(clippy::all, clippy::pedantic)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/podres-server/v1.rs"));
}

use proto::pod_resources_lister_server::{PodResourcesLister, PodResourcesListerServer};

/// What the kubelet answers, and how often it was asked.
#[derive(Default)]
pub struct KubeletState {
    pub pods: Vec<proto::PodResources>,
    pub lists: u64,
}

struct Service(Arc<Mutex<KubeletState>>);

#[tonic::async_trait]
impl PodResourcesLister for Service {
    async fn list(
        &self,
        _: Request<proto::ListPodResourcesRequest>,
    ) -> Result<Response<proto::ListPodResourcesResponse>, Status> {
        let mut s = self.0.lock().unwrap();
        s.lists += 1;
        Ok(Response::new(proto::ListPodResourcesResponse {
            pod_resources: s.pods.clone(),
        }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<proto::AllocatableResourcesRequest>,
    ) -> Result<Response<proto::AllocatableResourcesResponse>, Status> {
        Err(Status::unimplemented("not used by gpumem-exporter"))
    }

    async fn get(
        &self,
        _: Request<proto::GetPodResourcesRequest>,
    ) -> Result<Response<proto::GetPodResourcesResponse>, Status> {
        Err(Status::unimplemented("not used by gpumem-exporter"))
    }
}

/// (resource name, device ids) of one container.
pub type Devices<'a> = &'a [(&'a str, &'a [&'a str])];

/// A pod with containers, each with its devices and CPU ids, as the
/// kubelet reports them.
pub fn pod(ns: &str, name: &str, containers: &[(&str, Devices)]) -> proto::PodResources {
    proto::PodResources {
        name: name.into(),
        namespace: ns.into(),
        containers: containers
            .iter()
            .map(|(c, devices)| proto::ContainerResources {
                name: (*c).into(),
                devices: devices
                    .iter()
                    .map(|(resource, ids)| proto::ContainerDevices {
                        resource_name: (*resource).into(),
                        device_ids: ids.iter().map(|s| s.to_string()).collect(),
                        topology: Some(proto::TopologyInfo {
                            nodes: vec![proto::NumaNode { id: 0 }],
                        }),
                    })
                    .collect(),
                cpu_ids: vec![2, 3],
                memory: vec![],
                dynamic_resources: vec![],
            })
            .collect(),
    }
}

/// One claim of a container: (claim namespace, claim name, its devices as
/// (driver, pool, device name)).
pub type Claim<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str, &'a str)]);

/// A pod whose containers hold ResourceClaims (Dynamic Resource
/// Allocation), as the kubelet reports them in `dynamic_resources`: each
/// device with the CDI device NVIDIA's DRA driver hands the runtime.
pub fn dra_pod(ns: &str, name: &str, containers: &[(&str, &[Claim])]) -> proto::PodResources {
    proto::PodResources {
        name: name.into(),
        namespace: ns.into(),
        containers: containers
            .iter()
            .map(|(c, claims)| proto::ContainerResources {
                name: (*c).into(),
                devices: vec![],
                cpu_ids: vec![],
                memory: vec![],
                dynamic_resources: claims
                    .iter()
                    .map(|(claim_ns, claim, devices)| proto::DynamicResource {
                        claim_name: (*claim).into(),
                        claim_namespace: (*claim_ns).into(),
                        claim_resources: devices
                            .iter()
                            .map(|(driver, pool, device)| proto::ClaimResource {
                                cdi_devices: vec![proto::CdiDevice {
                                    name: format!("k8s.{driver}/claim={claim}-{device}"),
                                }],
                                driver_name: (*driver).into(),
                                pool_name: (*pool).into(),
                                device_name: (*device).into(),
                            })
                            .collect(),
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// The kubelet's socket in a folder of its own, served on a runtime of
/// its own until [`FakeKubelet::stop`] or drop.
pub struct FakeKubelet {
    pub state: Arc<Mutex<KubeletState>>,
    pub socket: PathBuf,
    _dir: tempfile::TempDir,
    /// Serves the socket on its own threads.
    rt: tokio::runtime::Runtime,
    stop: Option<oneshot::Sender<()>>,
}

impl FakeKubelet {
    pub fn start(pods: Vec<proto::PodResources>) -> FakeKubelet {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("kubelet.sock");
        let state = Arc::new(Mutex::new(KubeletState { pods, lists: 0 }));
        let rt = tokio::runtime::Runtime::new().unwrap();
        let mut k = FakeKubelet {
            state,
            socket,
            _dir: dir,
            rt,
            stop: None,
        };
        k.serve();
        k
    }

    /// Bind the socket and serve it until [`FakeKubelet::stop`].
    fn serve(&mut self) {
        let (stop, stopped) = oneshot::channel::<()>();
        let listener = {
            let _guard = self.rt.enter();
            tokio::net::UnixListener::bind(&self.socket).unwrap()
        };
        let service = PodResourcesListerServer::new(Service(Arc::clone(&self.state)));
        self.rt.spawn(async move {
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::UnixListenerStream::new(listener),
                    async {
                        let _ = stopped.await;
                    },
                )
                .await
                .unwrap();
        });
        self.stop = Some(stop);
    }

    /// The kubelet restarts: it goes away as [`FakeKubelet::stop`] does,
    /// stays away for `down`, then serves the same pods on the same socket
    /// path again (a new socket file, as a restarted kubelet makes).
    #[cfg_attr(not(feature = "external-tools"), allow(dead_code))]
    pub fn restart(&mut self, down: std::time::Duration) {
        self.stop();
        std::thread::sleep(down);
        self.serve();
    }

    pub fn lists(&self) -> u64 {
        self.state.lock().unwrap().lists
    }

    /// The kubelet goes away: the server stops (open connections close)
    /// and its socket is removed.
    pub fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = std::fs::remove_file(&self.socket);
        // Let the server's connections close before the test goes on.
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

impl Drop for FakeKubelet {
    fn drop(&mut self) {
        self.stop();
    }
}
