//! The end-to-end tests: one test binary, one harness, a module per area.
//!
//! - `harness`: build the fake NVML (tests/fake-nvml), write its scenarios,
//!   run the real `gpumem-exporter` and scrape it; a fake node (/proc root,
//!   Kubernetes list/watch API), Python children running the torch bridge,
//!   a real Prometheus server, the external tools (promtool, kubectl, …).
//! - `core`: values to the byte, endpoints, formats, signals, bad configs.
//! - `peaks`: windowed peaks from fast memory samples; gzip.
//! - `accounting`: the ledger: memory-time and busy-time counters per
//!   GPU, process and workload, allocated and idle time, the rankings in
//!   the API and on the page.
//! - `idle`: idle holders: a process whose utilisation samples stop, the
//!   GPU's utilisation where the driver has none; idle byte-seconds.
//! - `limits`: each workload's own limits: the driver's per-cgroup limits
//!   and dmem for root-owned cgroups only, a driver without the call, the
//!   limit forecast under faketime.
//! - `forecast`: the table of histories (steady, ramps, steps, sawtooth)
//!   under faketime at 10x real speed: when the GPU is forecast full.
//! - `tenant`: hostile tenants on a shared node: forged cgroups, fds,
//!   FIFOs and names, as real uids in real cgroups.
//! - `faults`: NVML not ready, every GPU lost, a hung call, SIGHUP reload.
//! - `collectors`: utilisation, per-process utilisation, power/thermal and
//!   memory health: exact values, absent when unsupported, switched off.
//! - `discovery`: a GPU dead from the start, MIG layouts changing at run
//!   time, a driver upgraded or unloaded under the running exporter.
//! - `attribution`: pods, users, command lines, MIG and MPS on a fake node;
//!   the Kubernetes client from a kubeconfig, in-cluster, broken.
//! - `stale`: memory held by the dead: a pid exited (after two full
//!   samples, not one; never one that had no /proc entry), zombie, in D,
//!   reparented, its pod or Slurm job gone, in the metrics, the API and
//!   the page; `gpu_memory_unattributed_bytes` against the scenario.
//! - `cardinality`: the series budget (8 GPUs × 1,024 processes within
//!   2,000 series) and `processes.series` (pid, workload, off) by SIGHUP.
//! - `allocation`: gpu_allocation_info from a fake kubelet's pod-resources
//!   API (whole GPUs, MIG devices, time-slicing replicas).
//! - `pod_limits`: the limits the Kubernetes API states for a pod (HAMi's
//!   and KAI's annotations, a DRA claim's consumed capacity), each on its
//!   own pod only.
//! - `torch`: the torch bridge with real Python processes and a stub torch.
//! - `slurm`: Slurm jobs and steps per process, and GPU → job allocations
//!   from the shipped prolog/epilog, against a real slurmctld/slurmd.
//! - `web`: connection limits, TLS, mTLS, basic auth, web config reload.
//! - `page`: the live page in a real headless Chromium, and its JSON API.
//! - `attack`: slowhttptest floods (slow headers, slow body, slow read,
//!   range header; 3,000 connections) while a scraper loses no scrape;
//!   sslscan on the TLS listener.
//! - `prometheus`: every dashboard query and rule in a real Prometheus.
//! - `fleet`: the fleet path from the shipped deploy/fleet files: vmagent →
//!   VictoriaMetrics → vmalert → Alertmanager → a webhook, GpuMemoryHigh
//!   fired and resolved; Prometheus in agent mode remote-writing.
//! - `demo`: `scripts/demo` as a newcomer runs it: names, users and pods,
//!   nothing refused, nothing left behind on SIGTERM.
//! - `empty_labels`: the same queries answer the same series whether the
//!   exposition leaves empty labels out (it does) or writes them.
//! - `kube_watch`: the pod watcher against the list/watch wire format.
//! - `in_cluster`: kube-rs's own in-cluster path, in a private mount
//!   namespace with the service account's files bind-mounted at their
//!   fixed path; token rotation.
//! - `config_corpus`: every malformed config in tests/config-corpus.
//! - `fuzz`: the parsers under generated input, for a time budget.
//! - `soak`: process churn; RSS, fds and series stay flat.
//! - `ceiling`: the release binary at 8 GPUs × 1,024 processes, 500 pods,
//!   64 torch bridges and 50 scrapers inside a cgroup v1 memory limit.
//! - `chaos`: every fault of the fakes at once, on a seeded schedule, under
//!   50 scrapers and a slowloris flood; an oracle after every step.
//! - `podman`: container names from a real Podman's Docker-compatible
//!   API: two containers named, the service stopped and back, no API
//!   call in 1,000 scrapes.
//! - `arm64`: the aarch64 cross build of the exporter and the fake NVML
//!   under qemu-user: the same GPU bytes as the host build, SIGTERM.
//! - `image`: the container image built from the Dockerfile (nothing
//!   pulled) and run with Podman as the DaemonSet runs it: uid 60877,
//!   read-only root, no capabilities, the toolkit's NVML mount, in-cluster
//!   API; SIGTERM, and no library mounted.
//! - `ops_artifacts`: rules, manifests, systemd unit, Dockerfile, dashboard,
//!   checked with the tools that consume them.
//! - `golden`: golden exposition files (tests/fixtures).
//! - `record`: `gpumem-exporter record` — CSV, Chrome trace, OpenMetrics
//!   backfilled into a real Prometheus and read by the strict OpenMetrics
//!   parser, signals, commands, bad output.
//!
//! `cargo test --test e2e` runs the fast areas (no program from outside
//! the Rust toolchain); `cargo test --test e2e --features external-tools`
//! runs every area (what scripts/ci/test does). One area with its module
//! path as the filter:
//!
//!     cargo test --test e2e web::
//!     cargo test --test e2e --features external-tools prometheus::
//!
//! The long runs:
//!
//!     SOAK_SECONDS=3600 cargo test --release --features external-tools --test e2e soak:: -- --nocapture
//!     CHAOS_SECONDS=3600 cargo test --features external-tools --test e2e chaos:: -- --nocapture
//!     FUZZ_SECONDS=600 cargo test --release --test e2e fuzz:: -- --nocapture --test-threads=5
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod harness;

// The fast loop, `cargo test`: these need only the fake NVML and the binary
// (and, as root, cgroups). Where an area also has tests that need a tool,
// they are in its `external` module, built with the feature below.
mod accounting;
mod allocation;
mod attribution;
mod cardinality;
mod collectors;
mod config_corpus;
mod core;
mod discovery;
mod faults;
mod fuzz;
mod golden;
mod idle;
mod kube_watch;
mod limits; // faketime (external-tools) for the limit forecast
mod ops_artifacts;
mod page;
mod peaks;
mod pod_limits;
mod record;
mod stale;
mod web;

// Areas that need a program from outside the Rust toolchain, or run long:
// `cargo test --features external-tools` (scripts/ci/test installs the
// programs and runs them).
#[cfg(feature = "external-tools")]
mod arm64; // the aarch64 cross build under qemu-user
#[cfg(feature = "external-tools")]
mod attack; // slowhttptest, sslscan, openssl; 3,000 connections
#[cfg(feature = "external-tools")]
mod ceiling; // root, cgroup v1, python3 children: the release exporter under its documented memory limit
#[cfg(feature = "external-tools")]
mod chaos; // the long run: every fault at once for CHAOS_SECONDS
#[cfg(feature = "external-tools")]
mod demo; // python3: scripts/demo (its fake Kubernetes API) on this build
#[cfg(feature = "external-tools")]
mod empty_labels; // a real Prometheus
#[cfg(feature = "external-tools")]
mod fleet; // victoria-metrics, vmagent, vmalert, prometheus-alertmanager, prometheus (agent mode)
#[cfg(feature = "external-tools")]
mod forecast; // faketime: the table of histories at 10x real speed
#[cfg(feature = "external-tools")]
mod image; // buildah, podman, runc, kubectl: the image built and run as the DaemonSet runs it
#[cfg(feature = "external-tools")]
mod in_cluster; // unshare and mount (util-linux), as root: a private mount namespace
#[cfg(feature = "external-tools")]
mod podman; // a real Podman (runc, vfs) and its Docker-compatible API
#[cfg(feature = "external-tools")]
mod prometheus; // a real Prometheus, python3 children (the stub torch)
#[cfg(feature = "external-tools")]
mod slurm; // slurmctld, slurmd, munge (root: mknod, cgroups)
#[cfg(feature = "external-tools")]
mod soak; // the long run: process churn for SOAK_SECONDS
#[cfg(feature = "external-tools")]
mod tenant; // root: real cgroups, chown, setpriv to uid 65534, mkfifo
#[cfg(feature = "external-tools")]
mod torch; // python3 children (the bridge, the stub torch), promtool
