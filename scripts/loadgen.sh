#!/usr/bin/env bash
# Build (or reuse) the environment of the outside load generator that cross-checks `unillm bench`
# (benchmarks/crosscheck_guidellm.py, tests/test_bench_crosscheck.py), and print its interpreter's
# path on stdout. guidellm is a tool no one here wrote; it pulls torch, transformers and datasets,
# which must not meet the test environment's pins, so it lives apart:
#
#   guidellm run --backend kind=openai_http,... --data kind=synthetic_text,...   (its CLI is bin/guidellm
#   beside the interpreter printed)
#
#   UNILLM_CI_ROOT   where environments are kept (default: ~/.cache/unillm-ci)
#
# Keyed by a hash of this script: changing a pin below rebuilds it; otherwise it is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
spec_hash=$(sha256sum scripts/loadgen.sh | cut -c1-16)
VENV="${UNILLM_CI_ROOT:-$HOME/.cache/unillm-ci}/loadgen-$spec_hash"
stamp="$VENV/.unillm-loadgen"
if ! [ -x "$VENV/bin/python" ] || ! [ -f "$stamp" ]; then
    echo "loadgen: building $VENV" >&2
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q -U pip >&2
    # torch pinned on the same line: without it pip takes the newest CUDA build (several GB).
    "$VENV/bin/python" -m pip install -q torch==2.13.0 "guidellm==0.8.1" >&2
    # offline smoke check: the CLI imports and knows `run`
    "$VENV/bin/guidellm" run --help >/dev/null
    touch "$stamp"
fi
echo "$VENV/bin/python"
