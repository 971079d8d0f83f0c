#!/bin/bash
# The README's CPU-quota figures ("### Threads"): t1_calls.py in a cgroup (v1, cpu controller) with a
# quota of one CPU (100000 us a 100000 us period), 2 and 1 threads alternated.  Needs root.
#   bash bench/readme_figures/cgroup_quota.sh [t1_calls.py options]
set -e
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
CG=/sys/fs/cgroup/cpu/ktfp8-quota-$$
mkdir "$CG"
trap 'rmdir "$CG"' EXIT
echo 100000 > "$CG/cpu.cfs_period_us"
echo 100000 > "$CG/cpu.cfs_quota_us"
echo "cgroup $CG: period $(cat "$CG/cpu.cfs_period_us") quota $(cat "$CG/cpu.cfs_quota_us")"
bash -c "echo \$\$ > $CG/cgroup.procs; exec $PY -m ktfp8.cpu" | grep -i "threads without"
bash -c "echo \$\$ > $CG/cgroup.procs; exec $PY bench/readme_figures/t1_calls.py --threads 2,1 --passes 2 $*"
echo "cpu.stat:"; cat "$CG/cpu.stat"
