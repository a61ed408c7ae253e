#!/usr/bin/env bash
# What a `gpumem-exporter record` file costs, in bytes per hour at the
# default intervals (memory samples every 100 ms, full samples every 1 s),
# measured on the fake NVML for 1 GPU x 2 processes and 8 GPUs x 256
# processes, in each format.
#
# Each case is recorded twice (SHORT and LONG seconds); the rate is the
# slope between the two, so the fixed part (CSV header, the first block's
# OpenMetrics HELP lines, trace names) does not inflate it. The processes
# are real (copies of sleep named python3, so /proc gives a name and a
# user, as on a GPU host); the 8 x 256 case lists the same 256 pids on
# every GPU, with 11-digit byte figures.
#
#     cargo build && cargo build -p fake-nvml --lib && scripts/record-cost.sh
#
# BIN, LIB, SHORT (default 20), LONG (default 60) and FORMATS (default
# "csv trace openmetrics") override the defaults.
# docs/record.md has the results.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/debug/gpumem-exporter}
LIB=${LIB:-target/debug/libfake_nvml.so}
SHORT=${SHORT:-20}
LONG=${LONG:-60}
FORMATS=${FORMATS:-csv trace openmetrics}
[ -x "$BIN" ] || { echo "no $BIN: run cargo build" >&2; exit 1; }
[ -f "$LIB" ] || { echo "no $LIB: run cargo build -p fake-nvml --lib" >&2; exit 1; }

work=$(mktemp -d)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

cp "$(command -v sleep)" "$work/python3"
start_procs() { # n
    local i
    for ((i = 0; i < $1; i++)); do
        "$work/python3" 3600 &
        pids+=("$!")
    done
}

scenario() { # gpus, then the pids on each
    local gpus=$1; shift
    local g p
    echo "devices:"
    for ((g = 0; g < gpus; g++)); do
        printf '  - uuid: GPU-%08d-1111-2222-3333-444444444444\n' "$g"
        echo "    memory: {total: 150754820096, reserved: 644939776, used: 80000000000}"
        echo "    processes:"
        for p in "$@"; do
            echo "      - {pid: $p, used: 12354322432}"
        done
    done
}

measure() { # label gpus nprocs
    local label=$1 gpus=$2 n=$3
    local before=${#pids[@]}
    start_procs "$n"
    scenario "$gpus" "${pids[@]:$before:$n}" >"$work/$label.yaml"
    local f ext s
    for f in $FORMATS; do
        case $f in csv) ext=csv ;; trace) ext=json ;; openmetrics) ext=om ;; esac
        declare -A size=()
        for s in "$SHORT" "$LONG"; do
            FAKE_NVML_CONFIG="$work/$label.yaml" "$BIN" record --nvml.library "$LIB" \
                --log.level warn -o "$work/$label-$s.$ext" --duration "${s}s" 2>"$work/err" \
                || { cat "$work/err" >&2; exit 1; }
            if grep -q "left out of the recording" "$work/err"; then
                echo "$label $f: samples were dropped:" >&2
                cat "$work/err" >&2
            fi
            size[$s]=$(stat -c %s "$work/$label-$s.$ext")
        done
        awk -v l="$label" -v f="$f" -v a="${size[$SHORT]}" -v b="${size[$LONG]}" \
            -v s="$SHORT" -v t="$LONG" 'BEGIN {
                rate = (b - a) / (t - s)
                printf "%-8s %-12s %8.0f bytes/s  %10.1f MB/hour  (%d s: %d bytes, %d s: %d bytes)\n",
                    l, f, rate, rate * 3600 / 1e6, s, a, t, b
            }'
        rm -f "$work/$label-"*."$ext"
    done
}

echo "record cost at the defaults (memory 100 ms, full 1 s); $(date -u +%FT%TZ)"
measure 1x2 1 2
measure 8x256 8 256
