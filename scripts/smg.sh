#!/usr/bin/env bash
# Build (or reuse) the environment of SMG (the `smg` router, successor of sglang-router; Rust,
# shipped as a wheel) that tests/test_smg.py and benchmarks/scale_out.py put in front of
# `unillm serve` workers, and print the path of its `smg` executable on stdout. Not written here,
# and not in the test environment: it pins its own dependencies.
#
#   UNILLM_CI_ROOT   where environments are kept (default: ~/.cache/unillm-ci)
#
# Keyed by a hash of this script: changing the pin below rebuilds it; otherwise it is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
spec_hash=$(sha256sum scripts/smg.sh | cut -c1-16)
VENV="${UNILLM_CI_ROOT:-$HOME/.cache/unillm-ci}/smg-$spec_hash"
stamp="$VENV/.unillm-smg"
if ! [ -x "$VENV/bin/smg" ] || ! [ -f "$stamp" ]; then
    echo "smg: building $VENV" >&2
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q -U pip >&2
    "$VENV/bin/python" -m pip install -q "smg==1.13.0" >&2
    # offline smoke check: the executable runs and says its version
    "$VENV/bin/smg" --version >&2
    touch "$stamp"
fi
echo "$VENV/bin/smg"
