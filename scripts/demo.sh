#!/usr/bin/env bash
# Run the demo: bootstrap the environment if needed, then `unillm demo` on the built-in tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
VENV="${UNILLM_VENV:-.venv}"
exec "$VENV/bin/unillm" demo "$@"
