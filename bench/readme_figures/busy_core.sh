#!/bin/bash
# The README's busy-core figures ("### Threads"): t1_calls.py while another process spins on CPU 1.
#   bash bench/readme_figures/busy_core.sh same-session|own-session [t1_calls.py options]
# same-session: the spinner in this script's session (one autogroup: CFS weighs the kernel's threads
# against the spinner thread by thread); own-session: the spinner in a session of its own (its own
# autogroup, as another user's job would be: the core is shared between the two sessions).
set -e
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
case "$1" in
    same-session) taskset -c 1 bash -c 'while :; do :; done' & ;;
    own-session) taskset -c 1 setsid bash -c 'while :; do :; done' & ;;
    *) echo "usage: $0 same-session|own-session [t1_calls.py options]" >&2; exit 2 ;;
esac
SPINNER=$!
trap 'kill $SPINNER 2>/dev/null' EXIT
shift
sleep 1
echo "spinner pid $SPINNER on CPU $(ps -o psr= -p $SPINNER), autogroup $(cat /proc/$SPINNER/autogroup)"
"$PY" bench/readme_figures/t1_calls.py --threads 2,1 --passes 2 "$@"
echo "spinner CPU time: $(ps -o time= -p $SPINNER)"
