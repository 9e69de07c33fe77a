#!/usr/bin/env bash
# Run the test suite: bootstrap the environment if needed, then pytest (extra args pass through).
# Every run ends with the slowest test phases (--durations; fixtures show as "setup") and the
# seconds per module (tests/conftest.py), so each CI log says where the time went.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
VENV="${UNILLM_VENV:-.venv}"
exec "$VENV/bin/python" -m pytest --durations=25 "$@"
