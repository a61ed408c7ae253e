#!/usr/bin/env bash
# Real-GPU check of the torch bridge ("Real or cache?" in README.md): a real
# torch process running gpumem_bridge allocates 4 GiB, frees half (kept in
# torch's cache), calls torch.cuda.empty_cache(), then frees everything. At
# each step it compares torch.cuda.memory_allocated()/memory_reserved(),
# read in the process, with gpu_process_torch_allocated_bytes /
# gpu_process_torch_reserved_bytes served by the exporter (must be equal),
# and with NVML's per-process bytes (must be >= reserved). Prints a markdown
# table; finishes within 2 minutes; exit 1 when a check fails. Needs an
# NVIDIA GPU and python3 with torch. The exporter runs as the same user as
# the torch process, so reading its /proc/<pid>/fd needs no capability.
#
#   scripts/gpu-torch-bridge.sh [path/to/gpumem-exporter]   # default .dev/gpumem-exporter
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${1:-$here/../.dev/gpumem-exporter}
exec timeout 120 python3 "$here/gpu_torch_bridge.py" "$bin"
