//! `gpumem-exporter record`: the daemon's sampler, config and attribution
//! (torch bridge and pod watcher included), with a file instead of an HTTP
//! server. Every snapshot the sampler publishes also goes to a bounded
//! channel ([`Shared::set_sink`](crate::publish::Shared::set_sink)); a writer thread turns each into rows of
//! one format — [`csv`], [`trace`] (Chrome Trace Event JSON) or
//! [`openmetrics`] (timestamped exposition for promtool's backfill) — and
//! writes them, one write per sample, through [`output`], which keeps a
//! regular file a complete document after every sample. The sampler never
//! waits for the disk: a sample the channel has no room for is counted and
//! reported at the end.
//!
//! It stops at `--duration`, at SIGINT/SIGTERM, or when `-- COMMAND`
//! exits. With a command, a stop signal does not stop the recording: from
//! a terminal Ctrl-C reaches the command too (it runs in the recorder's
//! process group), and what it does then is worth recording; the recorder
//! never signals the command itself. docs/record.md has the formats, the
//! exit codes and what a recording costs.
//!
//! The rooms: `format.rs` (which format, a sample's time and kind, the
//! [`Encoder`] trait), the formats `csv.rs`, `trace.rs`, `openmetrics.rs`,
//! `output.rs` (the file), `regroup.rs` (an OpenMetrics file rewritten
//! family by family after a clean stop), `summary.rs` (the summary on stderr and
//! `<file>.summary.json` at the end), `session.rs` (one recording's steps over the
//! shared [`Pipeline`](crate::pipeline::Pipeline)) and `child.rs` (the
//! command).

mod child;
pub(crate) mod csv;
mod format;
pub(crate) mod openmetrics;
pub(crate) mod output;
mod regroup;
mod session;
mod summary;
pub(crate) mod trace;

pub use format::Format;
pub use output::{OutputError, Target};
pub use session::{Options, run};

#[cfg(test)]
mod tests;
