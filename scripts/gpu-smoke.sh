#!/usr/bin/env bash
# Real-GPU smoke test: start gpumem-exporter, hold a known amount of GPU
# memory with torch, compare the scrape with nvidia-smi, and check that the
# process's series disappear after it exits. Needs: an NVIDIA GPU, the
# driver (nvidia-smi), python3 with torch.
#
#   scripts/gpu-smoke.sh [path/to/gpumem-exporter]    (default: target/release/gpumem-exporter)
#
# Exit 0 when every check passes; prints a table of what it compared.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${1:-$here/../target/release/gpumem-exporter}
exec python3 "$here/gpu_smoke.py" "$bin"
