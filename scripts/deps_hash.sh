#!/usr/bin/env bash
# Print the hash that keys the test environment: the dependency specification in pyproject.toml
# (build system, Python range, dependencies and extras) and the script that installs it. Other
# edits to pyproject.toml (pytest, ruff or mypy settings) keep the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
spec=$("$PY" - <<'PY' 2>/dev/null || cat pyproject.toml
import json
import tomllib  # Python 3.11+; on 3.10 the whole file is hashed instead

with open("pyproject.toml", "rb") as f:
    data = tomllib.load(f)
project = data["project"]
keys = ("requires-python", "dependencies", "optional-dependencies")
print(json.dumps([data["build-system"], *(project.get(k) for k in keys)], sort_keys=True))
PY
)
{ printf '%s\n' "$spec"; cat scripts/bootstrap.sh; } | sha256sum | cut -c1-16
