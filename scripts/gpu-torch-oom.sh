#!/usr/bin/env bash
# Real-GPU check of the torch bridge's pools, memory limit, allocator
# settings and OOM snapshots (docs/torch-bridge.md), and a measurement of
# what torch's allocation history (GPUMEM_BRIDGE_OOM_HISTORY) costs:
#
#  1. a torch process runs gpumem_bridge with GPUMEM_BRIDGE_OOM_SNAPSHOT_DIR
#     and PYTORCH_CUDA_ALLOC_CONF set, makes both pools fragmented, and at a
#     quiet moment compares the exporter's pool series (and the settings
#     info series) with its own torch.cuda.memory_stats();
#  2. it allocates 200 GiB, past the card: the bridge must write one
#     snapshot that pickle.load reads, with segments and device_traces (an
#     "oom" event in them: history is on), print its path on stderr, and the
#     exporter's gpu_process_torch_oom_snapshots_total must read 1;
#  3. it sets a memory fraction of 0.25: the exported limit must equal the
#     limit torch's allocator hands its OOM observers when an allocation
#     past it fails; back to 1, the limit series must go;
#  4. separate processes time alloc+free pairs, an MLP training step and
#     torch.cuda.memory._snapshot() with history off, python and all.
#
# PASS/FAIL lines; exit 1 when a check fails. At most ~3 minutes (each
# phase has its own timeout). Needs an NVIDIA GPU with < 200 GiB, python3
# with torch >= 2.6. Results under $OUT (default ./gpu-torch-oom-out):
# report.txt (this output), results.json (every figure), snapshots/ (the
# pickles written, open them at https://pytorch.org/memory_viz).
#
#   scripts/gpu-torch-oom.sh [path/to/gpumem-exporter]   # default .dev/gpumem-exporter
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${1:-$here/../.dev/gpumem-exporter}
out=${OUT:-$PWD/gpu-torch-oom-out}
mkdir -p "$out"
set +e
timeout -k 5 180 python3 -u "$here/gpu_torch_oom.py" "$bin" "$out" 2>&1 | tee "$out/report.txt"
rc=${PIPESTATUS[0]}
set -e
[ "$rc" -eq 124 ] && echo "FAIL  the whole check timed out after 180 s" | tee -a "$out/report.txt"
exit "$rc"
