#!/usr/bin/env bash
# Real-GPU attribution check: two torch processes, owned by different users
# and placed in cgroups shaped like Kubernetes pods (containerd, systemd
# driver), must each get their own series with the right pid, name, user,
# container id and pod UID. Needs root (to make cgroups and switch user), an
# NVIDIA GPU and python3 with torch.
#
#   scripts/gpu-attribution.sh [path/to/gpumem-exporter]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${1:-$here/../target/release/gpumem-exporter}
exec python3 "$here/gpu_attribution.py" "$bin"
