#!/bin/sh
# Slurm Epilog: remove this job from the job-mapping directory that
# deploy/slurm/prolog.sh writes (same environment; docs/deploying.md,
# "Slurm"). Every file is checked, not only SLURM_JOB_GPUS's, so a job
# is removed even where that variable is missing in the epilog. Never
# fails (a failing epilog drains the node).
set -u
dir=${GPUMEM_JOB_MAPPING_DIR:-/run/gpumem-exporter/slurm-jobs}
job=${SLURM_JOB_ID:-}

warn() { echo "gpumem-exporter epilog: $*" >&2; }

[ -n "$job" ] || { warn "SLURM_JOB_ID is not set"; exit 0; }
[ -d "$dir" ] || exit 0
exec 9>"$dir/.lock" || { warn "cannot open $dir/.lock"; exit 0; }
flock -w 10 9 || warn "no lock on $dir/.lock after 10 s; removing anyway"

for f in "$dir"/*; do
    [ -f "$f" ] || continue
    # dcgm: one job id per line; jobstats: "<jobid> <uid>". Keep the
    # lines of other jobs.
    tmp="$dir/.$(basename "$f").$job.tmp"
    awk -v job="$job" '$1 != job' "$f" >"$tmp" 2>/dev/null || { rm -f "$tmp"; continue; }
    if cmp -s "$f" "$tmp"; then
        rm -f "$tmp"
    elif [ -s "$tmp" ]; then
        mv -f "$tmp" "$f"
    else
        rm -f "$tmp" "$f"
    fi
done
exit 0
