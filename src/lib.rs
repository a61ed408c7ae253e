//! gpumem-exporter as a library: the binary (`src/main.rs`) wires these
//! modules together; benchmarks and tests use them directly.
//!
//! Data path: [`gpu`] (NVML) → [`sampler`] → [`model::Snapshot`] →
//! [`metrics`] (encode) → [`server`] (HTTP).

pub mod config;
pub mod gpu;
pub mod kube;
pub mod logging;
pub mod metrics;
pub mod model;
pub mod procfs;
pub mod sampler;
pub mod server;
pub mod torch_bridge;
pub mod web;
