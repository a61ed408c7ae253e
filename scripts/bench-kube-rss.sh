#!/usr/bin/env bash
# Memory of the exporter with the pod watcher on: the release binary on the
# fake NVML at 8 GPUs x 256 processes (the same pids on every GPU), a fake
# /proc root where each of the 256 pids is a container of one of 200 pods,
# and a local Kubernetes API (scripts/fake_kube_api.py, loopback only)
# serving those 200 pods. Waits until every pod name is resolved, scrapes
# once a second for MEASURE_SECONDS, then prints VmRSS and VmHWM.
#
#   scripts/bench-kube-rss.sh                      # this checkout's release build
#   BIN=/path/to/gpumem-exporter LIB=/path/to/libfake_nvml.so scripts/bench-kube-rss.sh
#
# Knobs (environment): GPUS=8 PROCS=256 PODS=200 MEASURE_SECONDS=30, and
# KUBE=false for the same run with the pod watcher off (the baseline).
set -euo pipefail
cd "$(dirname "$0")/.."

GPUS=${GPUS:-8}
PROCS=${PROCS:-256}
PODS=${PODS:-200}
MEASURE_SECONDS=${MEASURE_SECONDS:-30}
TARGET=${CARGO_TARGET_DIR:-target}
NODE=gpu-node-1

die() { echo "bench-kube-rss: $*" >&2; exit 1; }
for tool in curl python3; do
    command -v "$tool" >/dev/null || die "$tool not found"
done
if [[ -z ${BIN:-} ]]; then
    cargo build -q --release -p gpumem-exporter
    BIN=$TARGET/release/gpumem-exporter
fi
if [[ -z ${LIB:-} ]]; then
    cargo build -q --release -p fake-nvml --lib
    LIB=$TARGET/release/libfake_nvml.so
fi
[[ -x $BIN && -f $LIB ]] || die "$BIN or $LIB missing"

WORK=$(mktemp -d)
API=
EXPORTER=
cleanup() {
    [[ -n $EXPORTER ]] && kill "$EXPORTER" 2>/dev/null && wait "$EXPORTER" 2>/dev/null
    [[ -n $API ]] && kill "$API" 2>/dev/null && wait "$API" 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT

# The fake /proc root: pid 20000+k is the container of pod k % PODS, with
# the UID and container id scripts/fake_kube_api.py gives that pod.
mkdir -p "$WORK/proc"
for ((k = 0; k < PROCS; k++)); do
    pid=$((20000 + k))
    i=$((k % PODS))
    uid=$(printf '%032x' "$i")
    uid_=$(printf '%s_%s_%s_%s_%s' "${uid:0:8}" "${uid:8:4}" "${uid:12:4}" "${uid:16:4}" "${uid:20}")
    cid=$(printf '%064x' "$i")
    d=$WORK/proc/$pid
    mkdir -p "$d"
    echo python3 >"$d/comm"
    echo "$pid (python3) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 $((1000 + pid))" >"$d/stat"
    printf 'Name:\tpython3\nUid:\t1000\t1000\t1000\t1000\n' >"$d/status"
    echo "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod$uid_.slice/cri-containerd-$cid.scope" >"$d/cgroup"
    printf 'python3\0train.py\0' >"$d/cmdline"
done
echo 'root:x:0:0:root:/root:/bin/bash' >"$WORK/passwd"

{
    echo "devices:"
    for ((g = 0; g < GPUS; g++)); do
        used=$((8 * 1024 * 1024 + PROCS * (256 << 20)))
        printf '  - uuid: GPU-6f1c2a9e-4b1d-8c3e-9a7f-%012x\n' "$g"
        echo "    memory: {total: 150754820096, reserved: 644939776, used: $used}"
        echo "    processes:"
        for ((k = 0; k < PROCS; k++)); do
            echo "      - {pid: $((20000 + k)), used: $(((256 << 20) + k * (256 << 10))), type: compute}"
        done
    done
} >"$WORK/scenario.yaml"

python3 scripts/fake_kube_api.py 0 "$NODE" "$PODS" >"$WORK/api.out" 2>&1 &
API=$!
for _ in $(seq 100); do
    grep -q '^ready ' "$WORK/api.out" 2>/dev/null && break
    sleep 0.1
done
API_PORT=$(awk '/^ready /{print $2}' "$WORK/api.out")
[[ -n $API_PORT ]] || die "the fake API did not start: $(cat "$WORK/api.out")"

cat >"$WORK/config.yaml" <<EOF
path:
  procfs: $WORK/proc
processes:
  passwd_file: $WORK/passwd
kubernetes:
  enabled: ${KUBE:-true}
  api_url: http://127.0.0.1:$API_PORT
  node_name: $NODE
EOF

FAKE_NVML_CONFIG=$WORK/scenario.yaml "$BIN" --nvml.library "$LIB" \
    --config.file "$WORK/config.yaml" --web.listen-address 127.0.0.1:0 \
    2>"$WORK/exporter.log" &
EXPORTER=$!
ADDR=
for _ in $(seq 200); do
    ADDR=$(grep -o 'msg=listening address=[^ ]*' "$WORK/exporter.log" 2>/dev/null | head -1 | cut -d= -f3 || true)
    [[ -n $ADDR ]] && break
    sleep 0.1
done
[[ -n $ADDR ]] || die "the exporter did not start: $(cat "$WORK/exporter.log")"

resolved=0
for _ in $(seq "$([[ ${KUBE:-true} == true ]] && echo 300 || echo 20)"); do
    resolved=$(curl -fsS "http://$ADDR/metrics" | grep -c '^gpu_process_memory_used_bytes{.*pod="trainer-' || true)
    ((resolved == GPUS * PROCS)) && break
    sleep 0.1
done
if [[ ${KUBE:-true} == true ]]; then
    ((resolved == GPUS * PROCS)) || die "only $resolved of $((GPUS * PROCS)) process series have a pod"
fi
pods=$(curl -fsS "http://$ADDR/metrics" | awk '/^gpumem_exporter_kubernetes_pods /{print $2}')

for ((s = 0; s < MEASURE_SECONDS; s++)); do
    curl -fsS -o /dev/null "http://$ADDR/metrics"
    sleep 1
done
series=$(curl -fsS "http://$ADDR/metrics" | grep -vc '^#')
own=$(curl -fsS "http://$ADDR/metrics" | grep -c '^gpumem_exporter_\|^gpu_driver_info')
rss=$(awk '/^VmRSS/{print $2}' "/proc/$EXPORTER/status")
hwm=$(awk '/^VmHWM/{print $2}' "/proc/$EXPORTER/status")
size=$(stat -c %s "$BIN")
echo "binary $BIN: $size bytes"
echo "GPUs $GPUS, processes per GPU $PROCS, pods $pods ($resolved process series attributed); $series series, $own of them the exporter's own"
echo "after ${MEASURE_SECONDS}s of scrapes: VmRSS $((rss / 1024)).$(((rss % 1024) * 10 / 1024)) MiB, VmHWM $((hwm / 1024)).$(((hwm % 1024) * 10 / 1024)) MiB"
