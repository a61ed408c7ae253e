#!/usr/bin/env bash
# Real-GPU check of the collectors: NVML cost per call and per collector,
# the exporter's steady tick and CPU with each collector on and off, and the
# figures against nvidia-smi (utilization idle and during a bf16 matmul
# loop, pmon per-process SM %, temperature, power, clocks, ECC and row
# remapping). Needs an NVIDIA GPU, nvidia-smi, python3 with torch and
# nvidia-ml-py. Changes no GPU setting. About 2.5 minutes.
#
#   scripts/gpu-collectors.sh [path/to/gpumem-exporter]   (default: target/release/gpumem-exporter)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${1:-$here/../target/release/gpumem-exporter}
exec python3 "$here/gpu_collectors.py" "$bin"
