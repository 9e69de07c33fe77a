#!/usr/bin/env bash
# Instruction counts (valgrind callgrind: deterministic, unlike wall time on a shared machine) of
# llama.cpp generating TOKENS greedy tokens through the raw llama-cpp-python loop and through
# unillm, each minus a run that only loads. The ratio is the floor comparison without the noise.
#
#   benchmarks/icount_llamacpp.sh [TOKENS]     (default 64; about 10 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${UNILLM_VENV:-.venv}/bin/python"
N="${1:-64}"
"$PY" -c "from unillm.testing import tiny_model; tiny_model('bench')"  # build outside valgrind
count() {
    valgrind --tool=callgrind --callgrind-out-file=/dev/null "$PY" benchmarks/icount_llamacpp.py "$1" "$N" 2>&1 \
        | sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
}
load=$(count load); raw=$(count raw); ours=$(count unillm)
echo "instructions: load-only $load, raw loop $raw, unillm $ours ($N tokens)"
awk -v l="$load" -v r="$raw" -v u="$ours" -v n="$N" 'BEGIN {
    printf "per token: raw loop %.0f, unillm %.0f instructions; speed vs raw loop %.4fx\n",
        (r - l) / n, (u - l) / n, (r - l) / (u - l) }'
