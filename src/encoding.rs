//! What every family group writes with — `expose/`'s and each
//! collector's (`collectors/<name>/families.rs`): a gauge descriptor, the
//! label set every series is written with, the labels of a GPU and of a
//! process, a process's ids as label text. It sits below both, so that a
//! collector's families need nothing from `expose/`.

use std::fmt;

use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabel, EncodeLabelSet, LabelSetEncoder, MetricEncoder,
};
use prometheus_client::metrics::MetricType;

use crate::model::{DeviceSample, ProcessSample};

pub(crate) fn gauge<'a>(
    enc: &'a mut DescriptorEncoder,
    name: &'a str,
    help: &str,
) -> Result<MetricEncoder<'a>, fmt::Error> {
    enc.encode_descriptor(name, help, None, MetricType::Gauge)
}

/// The labels of one series, written without those whose value is empty.
/// For Prometheus a label with an empty value is no label at all (same
/// series, same answer to every PromQL query), so `pod=""` would be bytes
/// that buy nothing: outside Kubernetes and MIG they were 40 % of the body.
/// An absent label means unknown or not applicable (docs/metrics.md).
/// Every series of every family is written through this type.
pub(crate) struct Labels<'a, const N: usize>(pub [(&'static str, &'a str); N]);

impl<const N: usize> EncodeLabelSet for Labels<'_, N> {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), fmt::Error> {
        encode_present(&self.0, encoder)
    }
}

/// One loop for every label count: monomorphised per `N`, the same loop
/// measured 40 % slower (criterion, k8s shape), so the arrays share it.
#[inline(never)]
fn encode_present(
    labels: &[(&'static str, &str)],
    encoder: &mut LabelSetEncoder,
) -> Result<(), fmt::Error> {
    for label in labels.iter().filter(|(_, value)| !value.is_empty()) {
        label.encode(encoder.encode_label())?;
    }
    Ok(())
}

pub(crate) fn gpu_labels(d: &DeviceSample) -> Labels<'_, 2> {
    Labels([("gpu", d.info.gpu.as_str()), ("uuid", d.info.uuid.as_str())])
}

/// A process's pid and MIG instance ids as label text, formatted on the
/// stack: a `to_string()` of each per series was an allocation each, three
/// per process series. One `Ids` serves a whole family, series after
/// series.
#[derive(Default)]
pub(crate) struct Ids {
    pid: itoa::Buffer,
    gi: itoa::Buffer,
    ci: itoa::Buffer,
}

impl Ids {
    /// The pid.
    pub(crate) fn pid(&mut self, p: &ProcessSample) -> &str {
        self.pid.format(p.pid)
    }

    /// The pid, the GPU instance id and the compute instance id ("", so no
    /// label, outside MIG).
    pub(crate) fn all(&mut self, p: &ProcessSample) -> (&str, &str, &str) {
        (
            self.pid.format(p.pid),
            match p.gpu_instance_id {
                Some(v) => self.gi.format(v),
                None => "",
            },
            match p.compute_instance_id {
                Some(v) => self.ci.format(v),
                None => "",
            },
        )
    }
}

/// Labels of every per-process value series: the GPU (and MIG instance),
/// the pid, its name, its pod and its Slurm job; those not known (no pod,
/// no job, no MIG, no name) are left out.
pub(crate) fn process_labels<'a>(
    d: &'a DeviceSample,
    p: &'a ProcessSample,
    pid: &'a str,
    gi: &'a str,
    ci: &'a str,
) -> Labels<'a, 10> {
    Labels([
        ("gpu", d.info.gpu.as_str()),
        ("uuid", d.info.uuid.as_str()),
        ("pid", pid),
        ("process", &*p.ident.comm),
        ("namespace", &*p.ident.namespace),
        ("pod", &*p.ident.pod),
        ("container", &*p.ident.container),
        ("slurm_job", p.ident.slurm.as_ref().map_or("", |j| &*j.job)),
        ("gpu_instance_id", gi),
        ("compute_instance_id", ci),
    ])
}

/// The processes of one workload on one GPU (and MIG instance): one
/// series of each per-process family in `processes.series: workload`.
/// `workload` is `None` for the processes whose workload is unknown (not
/// visible in /proc); their group also takes the `pid="other"` rollup
/// and is written `workload="other"`.
pub(crate) struct WorkloadGroup<'a> {
    pub(crate) members: Vec<&'a ProcessSample>,
    /// The series' labels, those without a value left out.
    pub(crate) labels: Vec<(&'static str, String)>,
    /// The unknown workload's group (`workload="other"`).
    pub(crate) other: bool,
}

/// The workload groups of GPU `d`, in a stable order (by workload, then
/// MIG instance; the unknown workload last), every process in one. With
/// `rollup`, a group for the `pid="other"` processes is made even when no
/// listed process lacks a workload.
pub(crate) fn workload_groups(d: &DeviceSample, rollup: bool) -> Vec<WorkloadGroup<'_>> {
    use std::collections::BTreeMap;
    type Key = (
        bool,
        Option<crate::model::Workload>,
        Option<u32>,
        Option<u32>,
    );
    let mut by: BTreeMap<Key, Vec<&ProcessSample>> = BTreeMap::new();
    for p in d.processes.iter() {
        let w = crate::model::Workload::of(&p.ident);
        by.entry((w.is_none(), w, p.gpu_instance_id, p.compute_instance_id))
            .or_default()
            .push(p);
    }
    if rollup && d.other.is_some() && !by.keys().any(|k| k.0 && k.2.is_none() && k.3.is_none()) {
        by.insert((true, None, None, None), Vec::new());
    }
    by.into_iter()
        .map(|((other, w, gi, ci), members)| {
            let mut labels: Vec<(&'static str, String)> =
                vec![("gpu", d.info.gpu.clone()), ("uuid", d.info.uuid.clone())];
            match &w {
                Some(w) => labels.extend(w.labels().into_iter().map(|(k, v)| (k, v.to_string()))),
                None => labels.push(("workload", "other".to_string())),
            }
            labels.push((
                "gpu_instance_id",
                gi.map(|v| v.to_string()).unwrap_or_default(),
            ));
            labels.push((
                "compute_instance_id",
                ci.map(|v| v.to_string()).unwrap_or_default(),
            ));
            labels.retain(|(_, v)| !v.is_empty());
            WorkloadGroup {
                members,
                labels,
                other,
            }
        })
        .collect()
}
