#!/usr/bin/env bash
# Real-GPU check of discovery and re-open (issue: per-device discovery, MIG
# rescan, driver reload): NVML opened, every GPU identified, closed with the
# library unloaded and opened again, 20 times in one process, as the
# sampler does after a driver upgrade or reload. Needs an NVIDIA GPU and the
# driver. MIG settings are only read, never changed.
#
#   cargo build --release --example nvml_reopen
#   scripts/gpu-discovery.sh [path/to/nvml_reopen]   (default: target/release/examples/nvml_reopen)
#
# Exit 0 when every round saw the same GPUs.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${1:-$here/../target/release/examples/nvml_reopen}
nvidia-smi --query-gpu=index,uuid,mig.mode.current --format=csv,noheader
exec "$bin" 20
