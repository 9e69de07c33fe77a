#!/usr/bin/env bash
# Run the test suite: bootstrap the environment if needed, then pytest (extra args pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
VENV="${UNILLM_VENV:-.venv}"
exec "$VENV/bin/python" -m pytest "$@"
