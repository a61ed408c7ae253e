#!/usr/bin/env bash
# Real-GPU check of `gpumem-exporter record` (issue 13): a torch process
# grows by 2 GiB every 100 ms until it OOMs, recorded to $OUT/run.csv with
# `record -o $OUT/run.csv -- python3 scripts/gpu_record_oom.py`; prints the
# last rows (the climb), the file size and the checks; then measures the
# recorder's CPU at 10 Hz memory samples for 30 s (<= 1 % of a core).
# Under a minute; exit 1 when a check fails. Needs an NVIDIA GPU and
# python3 with torch. The report is also written to $OUT/gpu-record.md.
#
#   OUT=/some/dir scripts/gpu-record.sh [path/to/gpumem-exporter]   # default .dev/gpumem-exporter
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${1:-$here/../.dev/gpumem-exporter}
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
timeout 170 python3 "$here/gpu_record.py" "$bin" "$out" | tee "$out/gpu-record.md"
exit "${PIPESTATUS[0]}"
