#!/usr/bin/env bash
# gpumem-exporter beside nvitop-exporter 1.7.2 on a GPU host, in one run
# (< 4 minutes): scrape latency, RSS, idle CPU, start time, our tick vs NVML
# time, the cost of one nvidia-smi call, and a torch memory spike between two
# scrapes. Markdown to stdout and to $OUT/bench-h200.md when OUT is set.
#
#   scripts/bench-h200.sh [extra flags for scripts/bench_h200.py, e.g. --gpu 1]
#
# Needs, offline: python3 with torch (CUDA), prometheus-client, nvidia-ml-py,
# psutil; nvidia-smi; the exporter at .dev/gpumem-exporter (or $EXPORTER);
# the wheels nvitop-1.7.2 and nvitop_exporter-1.7.2 under .whl/, which are
# unpacked into /tmp/site (or $SITE) and put on PYTHONPATH of the
# nvitop-exporter process only.
set -euo pipefail
cd "$(dirname "$0")/.."
EXPORTER=${EXPORTER:-.dev/gpumem-exporter}
SITE=${SITE:-/tmp/site}
die() { echo "bench-h200: $*" >&2; exit 1; }

[[ -x $EXPORTER ]] || die "$EXPORTER is not an executable (build: cargo build --release; copy target/release/gpumem-exporter there)"
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this needs a GPU host with the NVIDIA driver"
command -v python3 >/dev/null || die "python3 not found"

shopt -s nullglob
wheels=(.whl/nvitop-1.7.2-*.whl .whl/nvitop_exporter-1.7.2-*.whl)
((${#wheels[@]} == 2)) || die "expected .whl/nvitop-1.7.2-*.whl and .whl/nvitop_exporter-1.7.2-*.whl, found: ${wheels[*]:-none}"
# Pure-Python wheels: unpacking is installing (no pip, no index needed).
mkdir -p "$SITE"
python3 - "$SITE" "${wheels[@]}" <<'EOF'
import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])
EOF

# nvitop 1.7.2 needs nvidia-ml-py >=11.450.51,<13.616 and psutil >=5.6.6;
# nvitop-exporter needs prometheus-client >=0.19. Say so now, not mid-run.
PYTHONPATH=$SITE python3 - <<'EOF' || die "a dependency of nvitop-exporter is missing or too old (see above)"
import importlib.metadata as md, sys
def v(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
def tup(s):
    return tuple(int(x) for x in s.split(".")[:3] if x.isdigit())
need = {"nvidia-ml-py": ("11.450.51", "13.616"), "psutil": ("5.6.6", None), "prometheus-client": ("0.19.0", None)}
ok = True
for name, (lo, hi) in need.items():
    have = v(name)
    good = have is not None and tup(have) >= tup(lo) and (hi is None or tup(have) < tup(hi))
    print(f"bench-h200: {name} {have or 'missing'} (needs >={lo}{', <' + hi if hi else ''}): {'ok' if good else 'NOT OK'}", file=sys.stderr)
    ok &= good
import nvitop_exporter.cli  # noqa: F401  (imports nvitop, pynvml, prometheus_client)
sys.exit(0 if ok else 1)
EOF
python3 -c 'import torch; assert torch.cuda.is_available(), "CUDA not available to torch"' \
    || die "torch with CUDA is needed for the spike test (or pass --skip-spike)"

exec timeout 235 python3 scripts/bench_h200.py --exporter "$EXPORTER" --nvitop-site "$SITE" "$@"
