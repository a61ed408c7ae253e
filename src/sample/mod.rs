//! The sampler: one dedicated thread owns the
//! [`GpuSource`](crate::gpu::GpuSource). Every
//! `memory_sample_interval` it reads each GPU's memory (cheap: ~7 µs per
//! GPU), and every `sample_interval` it also runs the collectors that are
//! on ([`crate::collectors`], one folder each, one table), reads the process lists
//! and asks [`attribute`](crate::attribute) who each pid is. Each tick
//! builds a fresh immutable [`Snapshot`](crate::model::Snapshot)
//! (`tick.rs`, over the per-GPU state of `device.rs` and the process step
//! of `processes.rs`); [`thread`] publishes it. Peaks over `peak_window`
//! (`peaks.rs`) are kept here, so they do not depend on who scrapes or how
//! often; `select.rs` picks the processes that get series.

mod control;
mod device;
mod errors;
mod host_memory;
mod limits;
mod peaks;
mod processes;
mod select;
pub(crate) mod thread;
mod tick;

pub(crate) use control::{Control, ControlSender, channel as control_channel};
pub use select::select;
pub use thread::OpenFailure;
pub(crate) use thread::StartError;
pub(crate) use thread::{Parts, spawn};
pub use tick::{SAMPLE_DURATION_BUCKETS, Sampler};
