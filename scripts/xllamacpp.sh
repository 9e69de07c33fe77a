#!/usr/bin/env bash
# Build (or reuse) the environment of xllamacpp, llama.cpp's own llama-server in process, the peer
# `unillm serve` on llama.cpp is measured against (benchmarks/server_vs_native.py --engines
# xllamacpp), and print its interpreter's path on stdout. It bundles its own llama.cpp build,
# which must not meet llama-cpp-python's in the project's environment, so it lives apart.
#
#   UNILLM_CI_ROOT   where environments are kept (default: ~/.cache/unillm-ci)
#
# Keyed by a hash of this script: changing the pin below rebuilds it; otherwise it is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
spec_hash=$(sha256sum scripts/xllamacpp.sh | cut -c1-16)
VENV="${UNILLM_CI_ROOT:-$HOME/.cache/unillm-ci}/xllamacpp-$spec_hash"
stamp="$VENV/.unillm-xllamacpp"
if ! [ -x "$VENV/bin/python" ] || ! [ -f "$stamp" ]; then
    echo "xllamacpp: building $VENV" >&2
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q "xllamacpp==2026.10.11549" >&2
    "$VENV/bin/python" -c "import xllamacpp; xllamacpp.CommonParams()"  # the wheel loads here
    touch "$stamp"
fi
echo "$VENV/bin/python"
