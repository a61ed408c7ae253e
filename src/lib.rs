//! gpumem-exporter as a library: the binary (`src/main.rs`) wires these
//! modules together; benchmarks and tests use them directly.
//!
//! Data path, in folder names: [`gpu`] (NVML) → [`sample`] (with
//! [`attribute`] saying who each pid is, from the pod index [`kube`]
//! keeps) → [`model::Snapshot`] →
//! [`publish`] (with [`podres`], the kubelet's device allocations, and [`history`], the last 10 minutes) →
//! [`expose`] (encode) → [`http`]. [`config`] turns YAML and
//! flags into each component's own config; [`signals`] owns the signals;
//! [`telemetry`] holds the exporter's own counters. [`record`] writes every
//! snapshot to a file instead of serving it (`gpumem-exporter record`).
//! See ARCHITECTURE.md.

pub mod attribute;
pub mod backoff;
pub mod config;
pub mod expose;
pub mod gpu;
pub mod history;
pub mod http;
pub mod kube;
pub mod logging;
pub mod model;
pub mod pipeline;
pub mod podres;
pub mod publish;
pub mod ratelimit;
pub mod record;
pub mod sample;
pub mod signals;
pub mod telemetry;
