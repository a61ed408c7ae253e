#!/bin/sh
# Slurm Prolog: record which GPUs this job holds in the job-mapping
# directory gpumem-exporter reads (slurm.job_mapping_dir), so a GPU that a
# job holds without running anything on it shows as gpu_allocation_info
# {slurm_job=...} (and GpuAllocatedButIdle). docs/deploying.md, "Slurm".
#
#   slurm.conf:  Prolog=/usr/local/lib/gpumem-exporter/prolog.sh
#                Epilog=/usr/local/lib/gpumem-exporter/epilog.sh
#                PrologFlags=Alloc   (run at allocation, salloc included)
#
# Environment (all optional except what slurmd sets):
#   GPUMEM_JOB_MAPPING_DIR     default /run/gpumem-exporter/slurm-jobs
#   GPUMEM_JOB_MAPPING_FORMAT  dcgm (default: a file per GPU index, one job
#                              id per line) or jobstats ("<jobid> <uid>")
#   SLURM_JOB_ID, SLURM_JOB_UID, SLURM_JOB_GPUS (set by slurmd)
#
# SLURM_JOB_GPUS holds GPU indexes (e.g. "0,2"); CUDA_VISIBLE_DEVICES is
# not used: since Slurm 25.11 it may hold UUIDs, and it is renumbered
# inside the job's cgroup. A prolog that fails drains the node, so this
# one never fails: problems go to stderr (slurmd's log) and it exits 0.
set -u
umask 022
dir=${GPUMEM_JOB_MAPPING_DIR:-/run/gpumem-exporter/slurm-jobs}
format=${GPUMEM_JOB_MAPPING_FORMAT:-dcgm}
job=${SLURM_JOB_ID:-}
gpus=${SLURM_JOB_GPUS:-}

warn() { echo "gpumem-exporter prolog: $*" >&2; }

# The directory must be root's alone: whoever else can write it can put
# any job id into slurm_job labels, or plant a symlink for root to write
# through. The exporter refuses such a directory too.
safe_dir() {
    [ ! -L "$1" ] && [ -d "$1" ] || { warn "$1 is not a directory (or is a symlink): not written"; return 1; }
    set -- "$1" $(stat -c '%u %a' "$1") || return 1
    [ "$2" = 0 ] || { warn "$1 is owned by uid $2, not root: not written"; return 1; }
    case $3 in
        *[2367][0-7] | *[2367]) warn "$1 has mode $3, writable by group or others: not written"; return 1 ;;
    esac
}

[ -n "$job" ] || { warn "SLURM_JOB_ID is not set"; exit 0; }
[ -n "$gpus" ] || exit 0
mkdir -p "$dir" 2>/dev/null || { warn "cannot create $dir"; exit 0; }
safe_dir "$dir" || exit 0
# One writer at a time: two jobs may share a GPU. The lock is the
# directory itself (no lock file to be swapped for a symlink).
exec 9<"$dir" || { warn "cannot open $dir"; exit 0; }
flock -w 10 9 || warn "no lock on $dir after 10 s; writing anyway"

for g in $(echo "$gpus" | tr ',' ' '); do
    case $g in
        '' | *[!0-9]*) warn "SLURM_JOB_GPUS entry '$g' is not a GPU index"; continue ;;
    esac
    f="$dir/$g"
    # A fresh file of our own (O_EXCL), dot-named so the exporter skips it
    # until it is renamed into place.
    tmp=$(mktemp "$dir/.$g.XXXXXXXX") || { warn "cannot create a temporary file in $dir"; continue; }
    case $format in
        jobstats) printf '%s %s\n' "$job" "${SLURM_JOB_UID:-}" >"$tmp" ;;
        *)
            {
                [ -f "$f" ] && [ ! -L "$f" ] && grep -v -x -F "$job" "$f"
                echo "$job"
            } >"$tmp"
            ;;
    esac
    # Readable by the exporter's non-root uid; renamed into place (never
    # into a directory of that name, never through a symlink): the
    # exporter never reads half a file.
    chmod 0644 "$tmp" && mv -f -T "$tmp" "$f" || { warn "cannot write $f"; rm -f "$tmp"; }
done
exit 0
