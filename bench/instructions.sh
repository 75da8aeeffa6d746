#!/usr/bin/env bash
# The instructions the timed part of bench.placement's scenario (a) runs, counted by valgrind's callgrind: a figure
# that does not move with the machine's load (CPU seconds here vary by a third from run to run), for comparing two
# commits. Arguments go to bench.placement, e.g.
#   bench/instructions.sh --preemption --jobs 1000
# Prints the bench's result line and callgrind's count of the timed part ("Collected"). The untimed set-up runs
# under valgrind too, without instrumentation: ~5x slower than a plain run. Needs valgrind (Debian: valgrind).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "bench/instructions.sh: needs valgrind (apt-get install valgrind)" >&2; exit 2; }
out=$(mktemp)
trap 'rm -f "$out"' EXIT
GPUPOOL_CALLGRIND=1 PYTHONHASHSEED=0 valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$out" \
    .venv/bin/python -m bench.placement --mode a "$@" --json 2>&1 | grep -E '^\{|RESULT|Collected' | \
    sed -E 's/^==[0-9]+== //'
