//! `gpu_allocation_info`: which container the kubelet allocated each device
//! to (pod-resources API), and which Slurm job holds it (the job-mapping
//! directory a prolog writes, `jobmap`). One family for both schedulers:
//! Kubernetes rows carry `namespace`, `pod`, `container` and `resource`,
//! Slurm rows `slurm_job` (and `slurm_uid` where the file has it), DRA rows
//! (ResourceClaims, from the same pod-resources answer) `namespace`, `pod`,
//! `container`, `pod_uid` and the claim's `dra_claim_namespace`,
//! `dra_claim_name`, `dra_driver_name`, `dra_pool_name`, `dra_device_name`
//! (dcgm-exporter's names, so dashboards carry over); the device labels are
//! the same. The device ids are matched to this
//! snapshot's GPUs and MIG instances here, at encode time, so the `gpu`
//! index and the MIG ids are those of the same snapshot as the memory
//! series they are joined with.

use std::collections::HashMap;
use std::fmt;

use prometheus_client::encoding::DescriptorEncoder;

use crate::accounting::allocation_seconds;
use crate::encoding::gauge;
use crate::model::{AllocatedDevice, Allocation, AllocationRow, DeviceInfo, MigInfo, Snapshot};

/// `gpu_allocation_info`, when the pod-resources client or the Slurm
/// job-mapping reader is on.
pub(super) fn families(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    if s.pod_resources.is_none() && s.job_mapping.is_none() {
        return Ok(());
    }
    let mut m = gauge(
        enc,
        "gpu_allocation_info",
        "A device the kubelet allocated to a container (pod-resources API), or that a Slurm job holds (slurm_job, from the job-mapping directory); value is always 1. gpu and uuid name the GPU (the parent GPU of a MIG device; absent when this exporter does not see it), resource the extended resource; MIG devices add mig_uuid, gpu_instance_id and compute_instance_id, time-sliced ones replica.",
    )?;
    let k8s = s
        .pod_resources
        .as_ref()
        .map_or(&[][..], |p| &p.allocations[..]);
    let slurm = s
        .job_mapping
        .as_ref()
        .map_or(&[][..], |j| &j.allocations[..]);
    let dra = s.pod_resources.as_ref().map_or(&[][..], |p| &p.dra[..]);
    if k8s.is_empty() && slurm.is_empty() && dra.is_empty() {
        return Ok(());
    }
    let devices = Devices::of(s);
    for a in k8s {
        let place = devices.place(&a.device);
        let replica = a.replica.map(|r| r.to_string());
        let owner = [
            ("namespace", a.namespace.as_str()),
            ("pod", a.pod.as_str()),
            ("container", a.container.as_str()),
            ("resource", a.resource.as_str()),
        ];
        row(&mut m, &place, replica.as_deref(), &owner)?;
    }
    for a in dra {
        let place = devices.place(&a.device);
        let owner = [
            ("namespace", a.namespace.as_str()),
            ("pod", a.pod.as_str()),
            ("container", a.container.as_str()),
            ("pod_uid", a.pod_uid.as_deref().unwrap_or("")),
            ("dra_claim_namespace", a.claim_namespace.as_str()),
            ("dra_claim_name", a.claim_name.as_str()),
            ("dra_driver_name", a.driver.as_str()),
            ("dra_pool_name", a.pool.as_str()),
            ("dra_device_name", a.device_name.as_str()),
        ];
        row(&mut m, &place, None, &owner)?;
    }
    for a in slurm {
        let place = devices.place(&a.device);
        let owner = [
            ("slurm_job", a.job.as_str()),
            ("slurm_uid", a.uid.as_deref().unwrap_or("")),
        ];
        row(&mut m, &place, None, &owner)?;
    }
    Ok(())
}

/// One series: the device's labels, then its owner's.
fn row(
    m: &mut prometheus_client::encoding::MetricEncoder<'_>,
    place: &Place<'_>,
    replica: Option<&str>,
    owner: &[(&'static str, &str)],
) -> Result<(), fmt::Error> {
    let instance = place
        .instance
        .map(|(gi, ci)| (gi.to_string(), ci.to_string()));
    let labels = row_labels(place, instance.as_ref(), replica, owner);
    m.encode_family(&labels)?.encode_gauge(&1u32)?;
    Ok(())
}

/// A row's labels: the device's, then its owner's, none empty (see
/// encoder::Labels).
fn row_labels<'a>(
    place: &Place<'a>,
    instance: Option<&'a (String, String)>,
    replica: Option<&'a str>,
    owner: &[(&'static str, &'a str)],
) -> Vec<(&'static str, &'a str)> {
    let mut labels: Vec<(&'static str, &'a str)> = vec![("gpu", place.gpu), ("uuid", place.uuid)];
    if let Some(mig_uuid) = place.mig_uuid {
        labels.push(("mig_uuid", mig_uuid));
    }
    if let Some((gi, ci)) = instance {
        labels.push(("gpu_instance_id", gi));
        labels.push(("compute_instance_id", ci));
    }
    if let Some(r) = replica {
        labels.push(("replica", r));
    }
    labels.extend_from_slice(owner);
    labels.retain(|(_, v)| !v.is_empty());
    labels
}

/// `gpu_allocation_seconds_total` and `gpu_allocation_idle_seconds_total`:
/// the ledger's totals of each row of `gpu_allocation_info` (`accounting`),
/// with the same labels; absent while no row has been seen.
pub(super) fn counters(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    if s.accounting.allocations.is_empty() {
        return Ok(());
    }
    let devices = Devices::of(s);
    for (name, help, idle) in [
        (
            "gpu_allocation_seconds",
            "Seconds the device of one gpu_allocation_info row was allocated (integrated at every memory sample; same labels as gpu_allocation_info).",
            false,
        ),
        (
            "gpu_allocation_idle_seconds",
            "Of gpu_allocation_seconds_total, the seconds in which the allocated GPU held no process of the row's pod (device plugin: by namespace and pod; DRA: by pod UID) or Slurm job.",
            true,
        ),
    ] {
        let mut m = enc.encode_descriptor(
            name,
            help,
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        let mut each = |row: &AllocationRow,
                        device: &AllocatedDevice,
                        replica: Option<&str>,
                        owner: &[(&'static str, &str)]|
         -> fmt::Result {
            let Some((all, idle_s)) = allocation_seconds(&s.accounting, row) else {
                return Ok(());
            };
            let place = devices.place(device);
            let instance = place
                .instance
                .map(|(gi, ci)| (gi.to_string(), ci.to_string()));
            let labels = row_labels(&place, instance.as_ref(), replica, owner);
            super::accounting::value(m.encode_family(&labels)?, if idle { idle_s } else { all })
        };
        for row in s.accounting.allocations.keys() {
            match row {
                AllocationRow::Kube(a) => {
                    if s.pod_resources
                        .as_ref()
                        .is_none_or(|p| p.allocations.binary_search(a).is_err())
                    {
                        continue;
                    }
                    let replica = a.replica.map(|r| r.to_string());
                    let owner = [
                        ("namespace", a.namespace.as_str()),
                        ("pod", a.pod.as_str()),
                        ("container", a.container.as_str()),
                        ("resource", a.resource.as_str()),
                    ];
                    each(row, &a.device, replica.as_deref(), &owner)?;
                }
                AllocationRow::Dra(a) => {
                    if s.pod_resources
                        .as_ref()
                        .is_none_or(|p| p.dra.binary_search(a).is_err())
                    {
                        continue;
                    }
                    let owner = [
                        ("namespace", a.namespace.as_str()),
                        ("pod", a.pod.as_str()),
                        ("container", a.container.as_str()),
                        ("pod_uid", a.pod_uid.as_deref().unwrap_or("")),
                        ("dra_claim_namespace", a.claim_namespace.as_str()),
                        ("dra_claim_name", a.claim_name.as_str()),
                        ("dra_driver_name", a.driver.as_str()),
                        ("dra_pool_name", a.pool.as_str()),
                        ("dra_device_name", a.device_name.as_str()),
                    ];
                    each(row, &a.device, None, &owner)?;
                }
                AllocationRow::Slurm(a) => {
                    if s.job_mapping
                        .as_ref()
                        .is_none_or(|j| j.allocations.binary_search(a).is_err())
                    {
                        continue;
                    }
                    let owner = [
                        ("slurm_job", a.job.as_str()),
                        ("slurm_uid", a.uid.as_deref().unwrap_or("")),
                    ];
                    each(row, &a.device, None, &owner)?;
                }
            }
        }
    }
    Ok(())
}

/// One allocation and where its device is in the snapshot it came with
/// (the recorder's CSV rows and trace events).
#[derive(Debug)]
pub(crate) struct Placed<'a> {
    pub allocation: &'a Allocation,
    /// The GPU's index; empty when this snapshot does not have it.
    pub gpu: &'a str,
    /// The GPU's UUID (a MIG device's parent), or the id as reported.
    pub uuid: &'a str,
    /// A MIG device's UUID, when known.
    pub mig_uuid: Option<&'a str>,
}

/// The snapshot's allocations, each placed on its devices; empty while the
/// pod-resources client is off.
pub(crate) fn placed(s: &Snapshot) -> Vec<Placed<'_>> {
    let Some(p) = &s.pod_resources else {
        return Vec::new();
    };
    let devices = Devices::of(s);
    p.allocations
        .iter()
        .map(|a| {
            let place = devices.place(&a.device);
            Placed {
                allocation: a,
                gpu: place.gpu,
                uuid: place.uuid,
                mig_uuid: place.mig_uuid,
            }
        })
        .collect()
}

/// Where an allocated device is in this snapshot.
#[derive(Debug, PartialEq, Eq)]
struct Place<'a> {
    /// The GPU's index; empty when this snapshot does not have it.
    gpu: &'a str,
    /// The GPU's UUID (a MIG device's parent), or the id as reported.
    uuid: &'a str,
    /// A MIG device's UUID, when known.
    mig_uuid: Option<&'a str>,
    /// A MIG device's GPU and compute instance ids, when known.
    instance: Option<(u32, u32)>,
}

/// This snapshot's GPUs by UUID and MIG instances by UUID and by ids.
struct Devices<'a> {
    gpus: HashMap<&'a str, &'a DeviceInfo>,
    by_index: HashMap<&'a str, &'a DeviceInfo>,
    mig_of_index: HashMap<(&'a str, u32), (&'a DeviceInfo, &'a MigInfo)>,
    migs: HashMap<&'a str, (&'a DeviceInfo, &'a MigInfo)>,
    mig_ids: HashMap<(&'a str, u32, u32), &'a MigInfo>,
}

impl<'a> Devices<'a> {
    fn of(s: &'a Snapshot) -> Devices<'a> {
        let mut d = Devices {
            gpus: HashMap::new(),
            by_index: HashMap::new(),
            mig_of_index: HashMap::new(),
            migs: HashMap::new(),
            mig_ids: HashMap::new(),
        };
        for dev in s.devices.iter().filter(|dev| dev.info.is_known()) {
            d.gpus.insert(dev.info.uuid.as_str(), &dev.info);
            d.by_index.insert(dev.info.gpu.as_str(), &dev.info);
            for m in dev.mig.iter() {
                // The first compute instance of a GPU instance stands for it.
                d.mig_of_index
                    .entry((dev.info.gpu.as_str(), m.info.gpu_instance_id))
                    .or_insert((&dev.info, &m.info));
                d.migs
                    .insert(m.info.mig_uuid.as_str(), (&dev.info, &m.info));
                d.mig_ids.insert(
                    (
                        dev.info.uuid.as_str(),
                        m.info.gpu_instance_id,
                        m.info.compute_instance_id,
                    ),
                    &m.info,
                );
            }
        }
        d
    }

    fn place(&self, device: &'a AllocatedDevice) -> Place<'a> {
        let gpu_of = |uuid: &str| self.gpus.get(uuid).map_or("", |g| &*g.gpu);
        match device {
            AllocatedDevice::Gpu { uuid } => Place {
                gpu: gpu_of(uuid),
                uuid,
                mig_uuid: None,
                instance: None,
            },
            AllocatedDevice::Mig { mig_uuid } => match self.migs.get(mig_uuid.as_str()) {
                Some((gpu, m)) => Place {
                    gpu: &gpu.gpu,
                    uuid: &gpu.uuid,
                    mig_uuid: Some(mig_uuid),
                    instance: Some((m.gpu_instance_id, m.compute_instance_id)),
                },
                // Not (yet) seen by a MIG rescan: its UUID alone.
                None => Place {
                    gpu: "",
                    uuid: "",
                    mig_uuid: Some(mig_uuid),
                    instance: None,
                },
            },
            AllocatedDevice::MigOfParent { mig_uuid, gpu_uuid } => {
                match self.migs.get(mig_uuid.as_str()) {
                    Some((gpu, m)) => Place {
                        gpu: &gpu.gpu,
                        uuid: &gpu.uuid,
                        mig_uuid: Some(mig_uuid),
                        instance: Some((m.gpu_instance_id, m.compute_instance_id)),
                    },
                    // Not (yet) seen by a MIG rescan: its parent GPU.
                    None => Place {
                        gpu: gpu_of(gpu_uuid),
                        uuid: gpu_uuid,
                        mig_uuid: Some(mig_uuid),
                        instance: None,
                    },
                }
            }
            AllocatedDevice::MigOfGpu {
                gpu_uuid,
                gpu_instance_id,
                compute_instance_id,
            } => Place {
                gpu: gpu_of(gpu_uuid),
                uuid: gpu_uuid,
                mig_uuid: self
                    .mig_ids
                    .get(&(gpu_uuid.as_str(), *gpu_instance_id, *compute_instance_id))
                    .map(|m| m.mig_uuid.as_str()),
                instance: Some((*gpu_instance_id, *compute_instance_id)),
            },
            AllocatedDevice::GpuIndex { gpu } => match self.by_index.get(gpu.as_str()) {
                Some(g) => Place {
                    gpu: &g.gpu,
                    uuid: &g.uuid,
                    mig_uuid: None,
                    instance: None,
                },
                // A GPU this exporter does not see: no gpu label to join.
                None => Place {
                    gpu: "",
                    uuid: "",
                    mig_uuid: None,
                    instance: None,
                },
            },
            AllocatedDevice::MigOfGpuIndex {
                gpu,
                gpu_instance_id,
            } => match self.mig_of_index.get(&(gpu.as_str(), *gpu_instance_id)) {
                Some((g, m)) => Place {
                    gpu: &g.gpu,
                    uuid: &g.uuid,
                    mig_uuid: Some(&m.mig_uuid),
                    instance: Some((m.gpu_instance_id, m.compute_instance_id)),
                },
                None => Place {
                    gpu: "",
                    uuid: "",
                    mig_uuid: None,
                    instance: None,
                },
            },
            AllocatedDevice::Other { id } => Place {
                gpu: "",
                uuid: id,
                mig_uuid: None,
                instance: None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::UNIX_EPOCH;

    use crate::expose::{Format, encode};
    use crate::model::*;

    const GPU0: &str = "GPU-00000000-0000-0000-0000-000000000000";
    const GPU1: &str = "GPU-11111111-0000-0000-0000-000000000000";
    const MIG_A: &str = "MIG-aaaaaaaa-0000-0000-0000-000000000000";
    const MIG_B: &str = "MIG-bbbbbbbb-0000-0000-0000-000000000000";

    fn device(gpu: &str, uuid: &str, mig: &[(&str, u32, u32)]) -> DeviceSample {
        DeviceSample {
            info: Arc::new(DeviceInfo {
                gpu: gpu.into(),
                uuid: uuid.into(),
                name: "NVIDIA H200".into(),
                pci_bus_id: String::new(),
                memory: Default::default(),
            }),
            memory: None,
            used_peak_bytes: None,
            processes: Arc::from(Vec::new()),
            other: None,
            mig: mig
                .iter()
                .map(|(u, gi, ci)| MigSample {
                    info: Arc::new(MigInfo {
                        mig_uuid: (*u).into(),
                        name: "MIG 1g.18gb".into(),
                        gpu_instance_id: *gi,
                        compute_instance_id: *ci,
                    }),
                    memory: None,
                })
                .collect(),
            readings: Default::default(),
        }
    }

    fn alloc(
        pod: &str,
        resource: &str,
        device: AllocatedDevice,
        replica: Option<u32>,
    ) -> Allocation {
        Allocation {
            namespace: "team-a".into(),
            pod: pod.into(),
            container: "main".into(),
            resource: resource.into(),
            device,
            replica,
        }
    }

    fn lines(s: Snapshot) -> Vec<String> {
        encode(&Arc::new(s), Format::Text)
            .unwrap()
            .lines()
            .filter(|l| l.contains("gpu_allocation_info") && !l.starts_with("gpumem_exporter_"))
            .map(str::to_owned)
            .collect()
    }

    /// Whole GPUs, MIG devices (both id forms, known and not), time-sliced
    /// replicas and another plugin's device, joined with the snapshot's
    /// GPUs and MIG instances.
    #[test]
    fn allocations_are_joined_with_the_snapshot() {
        let mut s = Snapshot::empty(UNIX_EPOCH);
        s.devices = vec![
            device("0", GPU0, &[]),
            device("1", GPU1, &[(MIG_A, 3, 0), (MIG_B, 5, 0)]),
        ];
        use AllocatedDevice::*;
        let allocations = vec![
            alloc("a", "nvidia.com/gpu", Gpu { uuid: GPU0.into() }, None),
            alloc(
                "b",
                "nvidia.com/mig-1g.18gb",
                Mig {
                    mig_uuid: MIG_A.into(),
                },
                None,
            ),
            alloc(
                "c",
                "nvidia.com/gpu",
                MigOfGpu {
                    gpu_uuid: GPU1.into(),
                    gpu_instance_id: 5,
                    compute_instance_id: 0,
                },
                None,
            ),
            alloc("d", "nvidia.com/gpu", Gpu { uuid: GPU0.into() }, Some(2)),
            alloc(
                "e",
                "nvidia.com/gpu",
                Mig {
                    mig_uuid: "MIG-unknown".into(),
                },
                None,
            ),
            alloc(
                "f",
                "nvidia.com/gpu",
                Gpu {
                    uuid: "GPU-elsewhere".into(),
                },
                None,
            ),
            alloc(
                "g",
                "example.com/fpga",
                Other {
                    id: "fpga-0".into(),
                },
                None,
            ),
        ];
        s.pod_resources = Some(PodResourcesState {
            allocations: allocations.into(),
            lists_total: 4,
            errors_total: 1,
            ..Default::default()
        });
        let want = [
            "# HELP gpu_allocation_info A device the kubelet allocated to a container (pod-resources API), or that a Slurm job holds (slurm_job, from the job-mapping directory); value is always 1. gpu and uuid name the GPU (the parent GPU of a MIG device; absent when this exporter does not see it), resource the extended resource; MIG devices add mig_uuid, gpu_instance_id and compute_instance_id, time-sliced ones replica.".to_string(),
            "# TYPE gpu_allocation_info gauge".to_string(),
            format!(r#"gpu_allocation_info{{gpu="0",uuid="{GPU0}",namespace="team-a",pod="a",container="main",resource="nvidia.com/gpu"}} 1"#),
            format!(r#"gpu_allocation_info{{gpu="1",uuid="{GPU1}",mig_uuid="{MIG_A}",gpu_instance_id="3",compute_instance_id="0",namespace="team-a",pod="b",container="main",resource="nvidia.com/mig-1g.18gb"}} 1"#),
            format!(r#"gpu_allocation_info{{gpu="1",uuid="{GPU1}",mig_uuid="{MIG_B}",gpu_instance_id="5",compute_instance_id="0",namespace="team-a",pod="c",container="main",resource="nvidia.com/gpu"}} 1"#),
            format!(r#"gpu_allocation_info{{gpu="0",uuid="{GPU0}",replica="2",namespace="team-a",pod="d",container="main",resource="nvidia.com/gpu"}} 1"#),
            r#"gpu_allocation_info{mig_uuid="MIG-unknown",namespace="team-a",pod="e",container="main",resource="nvidia.com/gpu"} 1"#.to_string(),
            r#"gpu_allocation_info{uuid="GPU-elsewhere",namespace="team-a",pod="f",container="main",resource="nvidia.com/gpu"} 1"#.to_string(),
            r#"gpu_allocation_info{uuid="fpga-0",namespace="team-a",pod="g",container="main",resource="example.com/fpga"} 1"#.to_string(),
        ];
        assert_eq!(lines(s.clone()), want);
        let text = encode(&Arc::new(s), Format::Text).unwrap();
        assert!(
            text.contains("\ngpumem_exporter_pod_resources_lists_total 4\n"),
            "{text}"
        );
        assert!(
            text.contains("\ngpumem_exporter_pod_resources_errors_total 1\n"),
            "{text}"
        );
    }

    /// Slurm rows beside Kubernetes rows: by index, `<gpu>.<gi>` and
    /// UUIDs, with and without a uid; a GPU this exporter does not see
    /// keeps only the job.
    #[test]
    fn slurm_rows_are_joined_with_the_snapshot() {
        let mut s = Snapshot::empty(UNIX_EPOCH);
        s.devices = vec![
            device("0", GPU0, &[]),
            device("1", GPU1, &[(MIG_A, 3, 0), (MIG_B, 5, 0)]),
        ];
        use AllocatedDevice::*;
        let job = |device, job: &str, uid: Option<&str>| JobAllocation {
            device,
            job: job.into(),
            uid: uid.map(Into::into),
        };
        s.job_mapping = Some(JobMappingState {
            allocations: vec![
                job(Gpu { uuid: GPU0.into() }, "1002", Some("1000")),
                job(GpuIndex { gpu: "0".into() }, "1001", None),
                job(
                    MigOfGpuIndex {
                        gpu: "1".into(),
                        gpu_instance_id: 5,
                    },
                    "1003",
                    None,
                ),
                job(GpuIndex { gpu: "7".into() }, "1004", None),
            ]
            .into(),
            reads_total: 3,
            errors: JobMappingErrors {
                content: 2,
                ..Default::default()
            },
        });
        let want = [
            format!(
                r#"gpu_allocation_info{{gpu="0",uuid="{GPU0}",slurm_job="1002",slurm_uid="1000"}} 1"#
            ),
            format!(r#"gpu_allocation_info{{gpu="0",uuid="{GPU0}",slurm_job="1001"}} 1"#),
            format!(
                r#"gpu_allocation_info{{gpu="1",uuid="{GPU1}",mig_uuid="{MIG_B}",gpu_instance_id="5",compute_instance_id="0",slurm_job="1003"}} 1"#
            ),
            r#"gpu_allocation_info{slurm_job="1004"} 1"#.to_string(),
        ];
        let got: Vec<String> = lines(s.clone())
            .into_iter()
            .filter(|l| !l.starts_with('#'))
            .collect();
        assert_eq!(got, want);
        let text = encode(&Arc::new(s), Format::Text).unwrap();
        assert!(
            text.contains("\ngpumem_exporter_slurm_job_mapping_reads_total 3\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "\ngpumem_exporter_slurm_job_mapping_errors_total{reason=\"content\"} 2\n"
            ),
            "{text}"
        );
    }

    /// A DRA allocation of container `main` in `team-a`, from node-1's
    /// pool; pod `c` has no pod UID.
    fn dra(pod: &str, claim: &str, name: &str, device: AllocatedDevice) -> DraAllocation {
        DraAllocation {
            namespace: "team-a".into(),
            pod: pod.into(),
            container: "main".into(),
            pod_uid: (pod != "c").then(|| format!("uid-{pod}")),
            claim_namespace: "team-a".into(),
            claim_name: claim.into(),
            driver: "gpu.nvidia.com".into(),
            pool: "node-1".into(),
            device_name: name.into(),
            device,
        }
    }

    /// The owner labels of a row made from `dra(pod, claim, name, _)`.
    fn owner(pod: &str, claim: &str, name: &str) -> String {
        let uid = if pod == "c" {
            String::new()
        } else {
            format!(r#"pod_uid="uid-{pod}","#)
        };
        format!(
            r#"namespace="team-a",pod="{pod}",container="main",{uid}dra_claim_namespace="team-a",dra_claim_name="{claim}",dra_driver_name="gpu.nvidia.com",dra_pool_name="node-1",dra_device_name="{name}""#
        )
    }

    /// DRA rows: a whole GPU and a MIG device from the slices, a device
    /// shared by two claims (two rows), the fallback by index, an unknown
    /// device (the owner only), a MIG device no rescan has seen yet (its
    /// parent from the slice), and the two counters.
    #[test]
    fn dra_rows_are_joined_with_the_snapshot() {
        let mut s = Snapshot::empty(UNIX_EPOCH);
        s.devices = vec![
            device("0", GPU0, &[]),
            device("1", GPU1, &[(MIG_A, 3, 0), (MIG_B, 5, 0)]),
        ];
        use AllocatedDevice::*;
        s.pod_resources = Some(PodResourcesState {
            dra: vec![
                dra("a", "one", "gpu-0", Gpu { uuid: GPU0.into() }),
                dra(
                    "b",
                    "mig",
                    "gpu-1-mig-9-3-1",
                    Mig {
                        mig_uuid: MIG_A.into(),
                    },
                ),
                dra("c", "shared-1", "gpu-0", Gpu { uuid: GPU0.into() }),
                dra("c", "shared-2", "gpu-0", Gpu { uuid: GPU0.into() }),
                dra("d", "by-name", "gpu-1", GpuIndex { gpu: "1".into() }),
                dra("e", "odd", "gpu-vfio-0", Other { id: String::new() }),
                dra(
                    "f",
                    "new-mig",
                    "gpu-1-mig-9-6-1",
                    MigOfParent {
                        mig_uuid: "MIG-new".into(),
                        gpu_uuid: GPU1.into(),
                    },
                ),
            ]
            .into(),
            dra_fallbacks_total: 2,
            resource_slice_errors_total: Some(3),
            ..Default::default()
        });
        let want = [
            format!(
                r#"gpu_allocation_info{{gpu="0",uuid="{GPU0}",{}}} 1"#,
                owner("a", "one", "gpu-0")
            ),
            format!(
                r#"gpu_allocation_info{{gpu="1",uuid="{GPU1}",mig_uuid="{MIG_A}",gpu_instance_id="3",compute_instance_id="0",{}}} 1"#,
                owner("b", "mig", "gpu-1-mig-9-3-1")
            ),
            format!(
                r#"gpu_allocation_info{{gpu="0",uuid="{GPU0}",{}}} 1"#,
                owner("c", "shared-1", "gpu-0")
            ),
            format!(
                r#"gpu_allocation_info{{gpu="0",uuid="{GPU0}",{}}} 1"#,
                owner("c", "shared-2", "gpu-0")
            ),
            format!(
                r#"gpu_allocation_info{{gpu="1",uuid="{GPU1}",{}}} 1"#,
                owner("d", "by-name", "gpu-1")
            ),
            format!(
                r#"gpu_allocation_info{{{}}} 1"#,
                owner("e", "odd", "gpu-vfio-0")
            ),
            format!(
                r#"gpu_allocation_info{{gpu="1",uuid="{GPU1}",mig_uuid="MIG-new",{}}} 1"#,
                owner("f", "new-mig", "gpu-1-mig-9-6-1")
            ),
        ];
        let got: Vec<String> = lines(s.clone())
            .into_iter()
            .filter(|l| !l.starts_with('#'))
            .collect();
        assert_eq!(got, want);
        let text = encode(&Arc::new(s), Format::Text).unwrap();
        for line in [
            "\ngpumem_exporter_dra_fallbacks_total 2\n",
            "\ngpumem_exporter_resource_slice_errors_total 3\n",
        ] {
            assert!(text.contains(line), "{line} not in {text}");
        }
    }

    /// Off: no family at all; on with nothing allocated: the family
    /// without series (and the counters).
    #[test]
    fn off_and_empty() {
        assert!(lines(Snapshot::empty(UNIX_EPOCH)).is_empty());
        let mut s = Snapshot::empty(UNIX_EPOCH);
        s.pod_resources = Some(PodResourcesState::default());
        assert_eq!(lines(s).iter().filter(|l| !l.starts_with('#')).count(), 0);
    }
}
