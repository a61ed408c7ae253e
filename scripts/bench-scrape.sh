#!/usr/bin/env bash
# Scrape benchmark of the real binary on the fake NVML, loopback only:
# 8 GPUs x 256 processes (the pids are real sleeping processes, so /proc
# lookups do real work). Measures /metrics latency with wrk at 1 and 50
# connections (plain and gzip), response sizes, RSS, idle CPU at the default
# intervals and at --sample-interval 100ms, and time to the first good
# /metrics; then /healthz, the page (/) and /api/v1/snapshot side by side
# (their p99 against /healthz's). Prints a markdown table (also to
# $OUT/bench-scrape.md when OUT is set). Takes ~6 minutes after the build
# (4 idle periods of IDLE_SECONDS).
#
#   scripts/bench-scrape.sh
#   ENDPOINTS_ONLY=1 GPUS=2 PROCS=8 scripts/bench-scrape.sh   # only the endpoint table, ~2 min
#
# Knobs (environment): GPUS=8 PROCS=256 WRK_SECONDS=10 IDLE_SECONDS=60 STARTS=5
# BIN=path/to/gpumem-exporter (default: build and use target/release's)
# ENDPOINTS_ONLY=0
set -euo pipefail
cd "$(dirname "$0")/.."

GPUS=${GPUS:-8}
PROCS=${PROCS:-256}
WRK_SECONDS=${WRK_SECONDS:-10}
IDLE_SECONDS=${IDLE_SECONDS:-60}
STARTS=${STARTS:-5}
ENDPOINTS_ONLY=${ENDPOINTS_ONLY:-0}
TARGET=${CARGO_TARGET_DIR:-target}

die() { echo "bench-scrape: $*" >&2; exit 1; }

if ! command -v wrk >/dev/null; then
    echo "bench-scrape: wrk not found, installing it (apt-get install -y wrk)" >&2
    { apt-get install -y wrk >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y wrk >/dev/null; }; } \
        || die "could not install wrk: install it yourself (Debian: apt-get install -y wrk)"
    command -v wrk >/dev/null || die "wrk still not found after apt-get install"
fi
for tool in curl python3 getconf awk; do
    command -v "$tool" >/dev/null || die "$tool not found"
done

# The fake is built in release: it runs inside the exporter's process, so
# its own cost (a stat of the scenario file per NVML call) shows in the CPU
# figures; in release it is small next to the exporter's.
# BIN=path measures that binary instead (e.g. one built from an older
# commit, for a before/after comparison on the same fake).
if [[ -z ${BIN:-} ]]; then
    cargo build -q --release -p gpumem-exporter
    BIN=$TARGET/release/gpumem-exporter
fi
cargo build -q --release -p fake-nvml --lib
LIB=$TARGET/release/libfake_nvml.so
[[ -x $BIN && -f $LIB ]] || die "$BIN or $LIB missing after the build"

WORK=$(mktemp -d)
SLEEPERS=()
EXPORTER=
cleanup() {
    [[ -n $EXPORTER ]] && kill "$EXPORTER" 2>/dev/null && wait "$EXPORTER" 2>/dev/null
    ((${#SLEEPERS[@]})) && kill "${SLEEPERS[@]}" 2>/dev/null
    wait 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

for ((i = 0; i < PROCS; i++)); do
    sleep 1800 &
    SLEEPERS+=($!)
done

# scenario GPUS x PROCS, same figures as benches/common/mod.rs
scenario() { # $1: processes per GPU
    local n=$1 g k used
    used=$(( 8 * 1024 * 1024 ))
    for ((k = 0; k < n; k++)); do used=$(( used + (256 << 20) + k * (256 << 10) )); done
    echo "devices:"
    for ((g = 0; g < GPUS; g++)); do
        printf '  - uuid: GPU-6f1c2a9e-4b1d-8c3e-9a7f-%012x\n' "$g"
        echo "    memory: {total: 150754820096, reserved: 644939776, used: $used}"
        echo "    processes:"
        for ((k = 0; k < n; k++)); do
            echo "      - {pid: ${SLEEPERS[(g * n + k) % PROCS]}, used: $(( (256 << 20) + k * (256 << 10) )), type: compute}"
        done
    done
}
scenario "$PROCS" >"$WORK/full.yaml"
scenario 1 >"$WORK/one.yaml"
scenario 0 >"$WORK/empty.yaml"

# start_exporter SCENARIO [flags...]: sets EXPORTER (pid) and ADDR
start_exporter() {
    local yaml=$1; shift
    : >"$WORK/log"
    FAKE_NVML_CONFIG=$yaml "$BIN" --nvml.library "$LIB" --web.listen-address 127.0.0.1:0 "$@" \
        2>"$WORK/log" >/dev/null &
    EXPORTER=$!
    ADDR=
    for ((i = 0; i < 400; i++)); do
        ADDR=$(sed -n 's/.*msg=listening address=\([^ ]*\).*/\1/p' "$WORK/log")
        [[ -n $ADDR ]] && return 0
        kill -0 "$EXPORTER" 2>/dev/null || break
        sleep 0.05
    done
    cat "$WORK/log" >&2
    die "the exporter did not start listening"
}
stop_exporter() {
    kill "$EXPORTER" 2>/dev/null || true
    wait "$EXPORTER" 2>/dev/null || true
    EXPORTER=
}
status_kib() { awk -v k="$2:" '$1 == k {print $2}' "/proc/$1/status"; }
cpu_ticks() { # utime + stime of pid $1 (fields 14, 15; the comm field has no spaces here)
    awk '{print $14 + $15}' "/proc/$1/stat"
}
cpu_ns() { # run time of all threads of pid $1 in ns (schedstat: finer than ticks)
    cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{ s += $1 } END { printf "%.0f", s }'
}
HZ=$(getconf CLK_TCK)
# idle_cpu SECONDS: CPU seconds per minute of $EXPORTER while nobody scrapes,
# from utime+stime (1/CLK_TCK resolution) and from schedstat (ns); prints both
idle_cpu() {
    local t0 t1 c0 c1 n0 n1
    c0=$(cpu_ticks "$EXPORTER"); n0=$(cpu_ns "$EXPORTER"); t0=$(date +%s%N)
    sleep "$1"
    c1=$(cpu_ticks "$EXPORTER"); n1=$(cpu_ns "$EXPORTER"); t1=$(date +%s%N)
    awk -v c=$((c1 - c0)) -v hz="$HZ" -v n=$((n1 - n0)) -v ns=$((t1 - t0)) \
        'BEGIN { printf "%.4f %.2f", n / ns * 60, c / hz / (ns / 1e9) * 60 }'
}
# wrk_run CONNS [header]: prints "p50_ms p99_ms req_per_s" for /metrics
wrk_run() { wrk_path /metrics "$@"; }
# wrk_path PATH CONNS [header]: the same for PATH
wrk_path() {
    local path=$1 conns=$2 threads=2; shift 2
    ((conns < threads)) && threads=$conns
    local args=(-t"$threads" -c"$conns" -d"${WRK_SECONDS}s" --latency)
    (($#)) && args+=(-H "$1")
    wrk "${args[@]}" "http://$ADDR$path" >"$WORK/wrk.txt" 2>&1 || { cat "$WORK/wrk.txt" >&2; die "wrk failed"; }
    grep -q "Non-2xx" "$WORK/wrk.txt" && { cat "$WORK/wrk.txt" >&2; die "non-2xx answers"; }
    awk '
        function ms(v) {
            if (v ~ /us$/) return substr(v, 1, length(v) - 2) / 1000
            if (v ~ /ms$/) return substr(v, 1, length(v) - 2) + 0
            if (v ~ /s$/) return substr(v, 1, length(v) - 1) * 1000
            return v
        }
        $1 == "50%" { p50 = ms($2) }
        $1 == "99%" { p99 = ms($2) }
        $1 == "Requests/sec:" { rps = $2 }
        END { printf "%.3f %.3f %.0f\n", p50, p99, rps }' "$WORK/wrk.txt"
}

echo "bench-scrape: $GPUS GPUs x $PROCS processes, $(nproc) cores" >&2

# --- /healthz, the page and the JSON snapshot side by side: p99 against
# /healthz's (which encodes nothing), at 1 and 50 connections
endpoints() {
    local spec path hdr conns r p50 p99 rps h1= h50= size_plain size_gzip
    start_exporter "$WORK/full.yaml"
    sleep 2
    echo "| endpoint | body (plain / gzip) | 1 connection: p50 / p99 | 50 connections: p50 / p99 | p99 ÷ /healthz p99 (1; 50) |"
    echo "|---|---|---|---|---|"
    for spec in "/healthz|" "/|" "/api/v1/snapshot|" "/api/v1/snapshot|Accept-Encoding: gzip" "/metrics|" "/metrics|Accept-Encoding: gzip"; do
        path=${spec%%|*}; hdr=${spec#*|}
        size_plain=$(curl -sf -o /dev/null -w '%{size_download}' "http://$ADDR$path")
        size_gzip=$(curl -sf -o /dev/null -w '%{size_download}' -H 'Accept-Encoding: gzip' "http://$ADDR$path")
        local row=() ratios=() base
        wrk_path "$path" 1 ${hdr:+"$hdr"} >/dev/null # warm-up
        for conns in 1 50; do
            r=$(wrk_path "$path" "$conns" ${hdr:+"$hdr"}); read -r p50 p99 rps <<<"$r"
            row+=("$p50 / $p99 ms ($rps req/s)")
            if [[ $path == /healthz ]]; then
                if ((conns == 1)); then h1=$p99; else h50=$p99; fi
            fi
            if ((conns == 1)); then base=$h1; else base=$h50; fi
            ratios+=("$(awk -v a="$p99" -v b="$base" 'BEGIN { printf "%.2f", a / b }')")
        done
        echo "| \`$path\`${hdr:+ ($hdr)} | $size_plain / $size_gzip bytes | ${row[0]} | ${row[1]} | ${ratios[0]}; ${ratios[1]} |"
    done
    stop_exporter
}
ENDPOINTS=$(endpoints)
if ((ENDPOINTS_ONLY)); then
    REPORT=$(printf '### bench-scrape endpoints: %s GPUs × %s processes, fake NVML, %s cores, loopback\n\n%s\n' \
        "$GPUS" "$PROCS" "$(nproc)" "$ENDPOINTS")
    echo "$REPORT"
    if [[ -n ${OUT:-} ]]; then mkdir -p "$OUT"; echo "$REPORT" >"$OUT/bench-scrape.md"; fi
    exit 0
fi

# --- time from process start to the first good /metrics (fresh process each)
cat >"$WORK/startup.py" <<'EOF'
import http.client, os, re, socket, statistics, subprocess, sys, time
binary, lib, yaml, runs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
env = dict(os.environ, FAKE_NVML_CONFIG=yaml)
firsts, inits = [], []
for _ in range(runs):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    t0 = time.monotonic()
    p = subprocess.Popen([binary, "--nvml.library", lib, "--web.listen-address", f"127.0.0.1:{port}"],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    while True:
        if time.monotonic() - t0 > 20:
            p.kill(); sys.exit("no good /metrics within 20 s")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/metrics")
            r = c.getresponse(); body = r.read(); c.close()
            if r.status == 200 and b"gpu_memory_used_bytes{" in body:
                break
        except OSError:
            pass
        time.sleep(0.0005)
    firsts.append((time.monotonic() - t0) * 1000)
    p.terminate(); err = p.communicate(timeout=10)[1].decode(errors="replace")
    m = re.search(r'msg="NVML initialised" init_ms=(\d+)', err)
    inits.append(int(m.group(1)) if m else float("nan"))
print(f"{statistics.median(firsts):.1f} {min(firsts):.1f} {statistics.median(inits):.0f}")
EOF
# startup SCENARIO: "median min init_ms" over $STARTS fresh processes
startup() { python3 "$WORK/startup.py" "$BIN" "$LIB" "$1" "$STARTS"; }
STARTUP=$(startup "$WORK/full.yaml")
STARTUP_ONE=$(startup "$WORK/one.yaml")
read -r START_MED START_MIN INIT_MS <<<"$STARTUP"
read -r START1_MED START1_MIN INIT1_MS <<<"$STARTUP_ONE"

# --- latency, sizes, RSS at the default intervals
start_exporter "$WORK/full.yaml"
PID=$EXPORTER
sleep 2
SIZE_PLAIN=$(curl -sf -o /dev/null -w '%{size_download}' "http://$ADDR/metrics")
SIZE_GZIP=$(curl -sf -o /dev/null -w '%{size_download}' -H 'Accept-Encoding: gzip' "http://$ADDR/metrics")
SIZE_OM=$(curl -sf -o /dev/null -w '%{size_download}' -H 'Accept: application/openmetrics-text' "http://$ADDR/metrics")
wrk_run 1 >/dev/null # warm-up: every format cached once, buffers grown
HWM_WARM=$(status_kib "$PID" VmHWM); RSS_WARM=$(status_kib "$PID" VmRSS)
R=$(wrk_run 1); read -r P50_1 P99_1 RPS_1 <<<"$R"
R=$(wrk_run 50); read -r P50_50 P99_50 RPS_50 <<<"$R"
R=$(wrk_run 1 'Accept-Encoding: gzip'); read -r GP50_1 GP99_1 GRPS_1 <<<"$R"
R=$(wrk_run 50 'Accept-Encoding: gzip'); read -r GP50_50 GP99_50 GRPS_50 <<<"$R"
HWM_LOAD=$(status_kib "$PID" VmHWM); RSS_LOAD=$(status_kib "$PID" VmRSS)
sleep 5 # let the last scrapes' buffers go
read -r CPU_DEFAULT CPU_DEFAULT_TICKS <<<"$(idle_cpu "$IDLE_SECONDS")"
RSS_IDLE=$(status_kib "$PID" VmRSS)
HIST=$(curl -sf "http://$ADDR/metrics" | awk '
    /^gpumem_exporter_sample_duration_seconds_sum/ { s = $2 }
    /^gpumem_exporter_sample_duration_seconds_count/ { n = $2 }
    /^gpumem_exporter_sample_nvml_duration_seconds_sum/ { ns = $2 }
    /^gpumem_exporter_sample_nvml_duration_seconds_count/ { nn = $2 }
    END { printf "%.2f %.3f %d", s / n * 1000, ns / nn * 1000, n }')
read -r TICK_MS NVML_MS TICKS <<<"$HIST"
stop_exporter

# --- idle CPU with --sample-interval 100ms, and at defaults with no processes
start_exporter "$WORK/full.yaml" --sample-interval 100ms
sleep 2
read -r CPU_FAST CPU_FAST_TICKS <<<"$(idle_cpu "$IDLE_SECONDS")"
stop_exporter
start_exporter "$WORK/one.yaml"
sleep 2
read -r CPU_ONE CPU_ONE_TICKS <<<"$(idle_cpu "$IDLE_SECONDS")"
stop_exporter
start_exporter "$WORK/empty.yaml"
sleep 2
read -r CPU_EMPTY CPU_EMPTY_TICKS <<<"$(idle_cpu "$IDLE_SECONDS")"
stop_exporter

pct() { awk -v s="$1" 'BEGIN { printf "%.3f", s / 60 * 100 }'; }
mib() { awk -v k="$1" 'BEGIN { printf "%.1f", k / 1024 }'; }
REPORT=$(cat <<EOF
### bench-scrape: $GPUS GPUs × $PROCS processes, fake NVML, $(nproc) cores, loopback

| measure | value |
|---|---|
| /metrics body, text / OpenMetrics / gzip | $SIZE_PLAIN / $SIZE_OM / $SIZE_GZIP bytes |
| latency, 1 connection, plain: p50 / p99 | $P50_1 / $P99_1 ms ($RPS_1 req/s) |
| latency, 50 connections, plain: p50 / p99 | $P50_50 / $P99_50 ms ($RPS_50 req/s) |
| latency, 1 connection, gzip: p50 / p99 | $GP50_1 / $GP99_1 ms ($GRPS_1 req/s) |
| latency, 50 connections, gzip: p50 / p99 | $GP50_50 / $GP99_50 ms ($GRPS_50 req/s) |
| RSS after warm-up: VmHWM / VmRSS | $(mib "$HWM_WARM") / $(mib "$RSS_WARM") MiB |
| RSS after the load: VmHWM / VmRSS | $(mib "$HWM_LOAD") / $(mib "$RSS_LOAD") MiB |
| RSS idle ${IDLE_SECONDS} s after the load: VmRSS | $(mib "$RSS_IDLE") MiB |
| CPU idle, defaults (sample 1s, memory 100ms) | $CPU_DEFAULT CPU s/min = $(pct "$CPU_DEFAULT") % of a core (utime+stime: $CPU_DEFAULT_TICKS s/min) |
| CPU idle, --sample-interval 100ms | $CPU_FAST CPU s/min = $(pct "$CPU_FAST") % of a core (utime+stime: $CPU_FAST_TICKS s/min) |
| CPU idle, defaults, $GPUS GPUs × 1 process | $CPU_ONE CPU s/min = $(pct "$CPU_ONE") % of a core (utime+stime: $CPU_ONE_TICKS s/min) |
| CPU idle, defaults, $GPUS GPUs × 0 processes | $CPU_EMPTY CPU s/min = $(pct "$CPU_EMPTY") % of a core (utime+stime: $CPU_EMPTY_TICKS s/min) |
| full sample (tick), mean of its histogram | $TICK_MS ms, of which NVML $NVML_MS ms ($TICKS ticks) |
| process start → first good /metrics, median / min of $STARTS | $START_MED / $START_MIN ms (log's init_ms, NVML open + first full sample: ${INIT_MS} ms) |
| the same, $GPUS GPUs × 1 process | $START1_MED / $START1_MIN ms (init_ms ${INIT1_MS} ms) |


$ENDPOINTS
EOF
)
echo "$REPORT"
if [[ -n ${OUT:-} ]]; then
    mkdir -p "$OUT"
    echo "$REPORT" >"$OUT/bench-scrape.md"
fi
