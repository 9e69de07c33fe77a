#!/usr/bin/env bash
# Build (or reuse) the environment of the model converters the plugin tests use, and print its
# interpreter's path on stdout. The converters pull torch and transformers < 5.6 (optimum-intel
# 2.2's bound), which must not meet vLLM's in the test environment; so they live apart:
#
#   onnxruntime_genai.models.builder   HF dir -> ONNX Runtime GenAI model dir (genai_config.json)
#   optimum-cli export openvino        HF dir -> OpenVINO IR dir
#
#   UNILLM_CI_ROOT   where environments are kept (default: ~/.cache/unillm-ci)
#
# Keyed by a hash of this script: changing a pin below rebuilds it; otherwise it is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
spec_hash=$(sha256sum scripts/converters.sh | cut -c1-16)
VENV="${UNILLM_CI_ROOT:-$HOME/.cache/unillm-ci}/converters-$spec_hash"
stamp="$VENV/.unillm-converters"
if ! [ -x "$VENV/bin/python" ] || ! [ -f "$stamp" ]; then
    echo "converters: building $VENV" >&2
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q -U pip >&2
    # torch pinned on the same line: without it pip takes the newest CUDA build (several GB).
    "$VENV/bin/python" -m pip install -q torch==2.13.0 "transformers<5.6" onnx onnx-ir \
        "onnxruntime-genai>=0.18,<0.19" "optimum-intel[openvino]>=2.2,<2.3" >&2
    # optimum-intel pulls PyPI's torchvision, which breaks against the CPU torch
    # ("torchvision::nms does not exist"); the export does not need it.
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio 2>/dev/null >&2 || true
    touch "$stamp"
fi
echo "$VENV/bin/python"
