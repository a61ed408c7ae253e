//! gpumem-exporter as a library: the binary (`src/main.rs`) wires these
//! modules together.
//!
//! Data path, in folder names: [`gpu`] (NVML) → [`sample`] (running the
//! [`collectors`], with [`attribute`] saying who each pid is, from the pod
//! index [`kube`] keeps) → [`model::Snapshot`] → [`publish`] (with
//! [`podres`], the kubelet's device allocations, [`jobmap`], Slurm's, and
//! [`history`], the last 10 minutes) → [`expose`] (encode) → [`http`].
//! [`config`] turns YAML and flags into each component's own config;
//! [`signals`] owns the signals; [`telemetry`] holds the exporter's own
//! counters. [`record`] writes every snapshot to a file instead of
//! serving it (`gpumem-exporter record`). See ARCHITECTURE.md (its layer
//! list is what `scripts/ci/check-layers` holds the imports to).
//!
//! One door: every module is `pub(crate)`; what the binary needs is
//! re-exported below, and the tests, benchmarks and fuzz targets come in
//! through [`testing`] (hidden from the docs, not a public contract).
//! `unreachable_pub` keeps a `pub` from standing where nothing outside can
//! reach it, so unused code is reported as dead.

#![warn(unreachable_pub)]

pub(crate) mod accounting;
pub(crate) mod attribute;
pub(crate) mod backoff;
pub(crate) mod bridge;
pub(crate) mod collectors;
pub(crate) mod config;
pub(crate) mod containers;
pub(crate) mod encoding;
pub(crate) mod expose;
pub(crate) mod fuzzing;
pub(crate) mod gpu;
pub(crate) mod gpu_error;
pub(crate) mod history;
pub(crate) mod http;
pub(crate) mod jobmap;
pub(crate) mod kube;
pub(crate) mod limits;
pub(crate) mod logging;
pub(crate) mod model;
pub(crate) mod pipeline;
pub(crate) mod podres;
pub(crate) mod publish;
pub(crate) mod ratelimit;
pub(crate) mod record;
pub(crate) mod sample;
pub(crate) mod signals;
pub(crate) mod telemetry;
#[doc(hidden)]
pub mod testing;
pub(crate) mod trend;

// What the binary needs.
pub use collectors::{Def as CollectorDef, REGISTRY as COLLECTORS};
pub use config::{
    Config, HumanDuration, Overrides, describe as describe_config, load as load_config,
};
pub use expose::{REVISION, VERSION};
pub use gpu::nvml::{InitError as NvmlInitError, NvmlSource};
pub use http::serve;
pub use http::web_config::Web;
pub use logging::init as init_logging;
pub use pipeline::{Pipeline, Reload};
pub use record::{
    Format as RecordFormat, Options as RecordOptions, OutputError as RecordOutputError,
    Target as RecordTarget, run as record,
};
pub use sample::OpenFailure;
