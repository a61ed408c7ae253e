#!/bin/sh
# Slurm Epilog: remove this job from the job-mapping directory that
# deploy/slurm/prolog.sh writes (same environment; docs/deploying.md,
# "Slurm"). Every file is checked, not only SLURM_JOB_GPUS's, so a job
# is removed even where that variable is missing in the epilog. Never
# fails (a failing epilog drains the node).
set -u
umask 022
dir=${GPUMEM_JOB_MAPPING_DIR:-/run/gpumem-exporter/slurm-jobs}
job=${SLURM_JOB_ID:-}

warn() { echo "gpumem-exporter epilog: $*" >&2; }

# As in the prolog: the directory must be root's alone.
safe_dir() {
    [ ! -L "$1" ] && [ -d "$1" ] || { warn "$1 is not a directory (or is a symlink): not changed"; return 1; }
    set -- "$1" $(stat -c '%u %a' "$1") || return 1
    [ "$2" = 0 ] || { warn "$1 is owned by uid $2, not root: not changed"; return 1; }
    case $3 in
        *[2367][0-7] | *[2367]) warn "$1 has mode $3, writable by group or others: not changed"; return 1 ;;
    esac
}

[ -n "$job" ] || { warn "SLURM_JOB_ID is not set"; exit 0; }
[ -e "$dir" ] || exit 0
safe_dir "$dir" || exit 0
exec 9<"$dir" || { warn "cannot open $dir"; exit 0; }
flock -w 10 9 || warn "no lock on $dir after 10 s; removing anyway"

for f in "$dir"/*; do
    [ -f "$f" ] && [ ! -L "$f" ] || continue
    # dcgm: one job id per line; jobstats: "<jobid> <uid>". Keep the
    # lines of other jobs.
    tmp=$(mktemp "$dir/.$(basename "$f").XXXXXXXX") || { warn "cannot create a temporary file in $dir"; continue; }
    awk -v job="$job" '$1 != job' "$f" >"$tmp" 2>/dev/null || { rm -f "$tmp"; continue; }
    if cmp -s "$f" "$tmp"; then
        rm -f "$tmp"
    elif [ -s "$tmp" ]; then
        chmod 0644 "$tmp" && mv -f -T "$tmp" "$f" || { warn "cannot write $f"; rm -f "$tmp"; }
    else
        rm -f "$tmp" "$f"
    fi
done
exit 0
