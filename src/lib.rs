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
//!
//! Visibility: the modules the binary, the e2e tests, the benchmarks and
//! the fuzz targets use are `pub`; everything else is `pub(crate)`, and
//! `unreachable_pub` keeps a `pub` from standing where nothing outside can
//! reach it (so unused code is reported as dead).

#![warn(unreachable_pub)]

pub mod attribute;
pub(crate) mod backoff;
pub mod config;
pub mod expose;
#[doc(hidden)]
pub mod fuzzing;
pub mod gpu;
pub(crate) mod history;
pub mod http;
pub(crate) mod jobmap;
pub mod kube;
pub mod logging;
pub mod model;
pub mod pipeline;
pub(crate) mod podres;
pub(crate) mod publish;
pub(crate) mod ratelimit;
pub mod record;
pub mod sample;
pub(crate) mod signals;
pub(crate) mod telemetry;
pub mod trend;
