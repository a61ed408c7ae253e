//! What every family file needs: a gauge descriptor, the labels of a GPU,
//! an optional id as label text.

use std::fmt;

use prometheus_client::encoding::{DescriptorEncoder, MetricEncoder};
use prometheus_client::metrics::MetricType;

use crate::model::DeviceSample;

pub(super) fn gauge<'a>(
    enc: &'a mut DescriptorEncoder,
    name: &'a str,
    help: &str,
) -> Result<MetricEncoder<'a>, fmt::Error> {
    enc.encode_descriptor(name, help, None, MetricType::Gauge)
}

pub(super) fn gpu_labels(d: &DeviceSample) -> [(&'static str, &str); 2] {
    [("gpu", d.info.gpu.as_str()), ("uuid", d.info.uuid.as_str())]
}

/// An optional id as label text ("" when absent).
pub(super) fn id_label(v: Option<u32>) -> String {
    v.map(|v| v.to_string()).unwrap_or_default()
}
