//! Plain data that flows from the sampler to the encoder, by concern. No
//! NVML types, no behaviour beyond small helpers: a [`Snapshot`] is
//! immutable once published. Below `gpu/`, `collectors/` and `expose/`,
//! importing none of them (only the error labels of `crate::gpu_error`
//! and `crate::trend`'s slope).

mod accounting;
mod allocation;
mod device;
mod exporter;
mod forecast;
mod limits;
mod process;
mod readings;
mod snapshot;
mod stale;
mod torch;

pub use accounting::*;
pub use allocation::*;
pub use device::*;
pub use exporter::*;
pub use forecast::*;
pub use limits::*;
pub use process::*;
pub use readings::*;
pub use snapshot::*;
pub use stale::*;
pub use torch::*;

pub use crate::trend::Slope;
