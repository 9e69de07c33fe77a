#!/usr/bin/env bash
# Check the ExLlamaV2 backend against the real exllamav2 on an NVIDIA GPU, in one run: install
# exllamav2 from carried wheels, build the tiny HF model, write an FP16 copy, load it unquantized
# through unillm and run scripts/gpu_check_exllamav2.py (greedy parity with exllamav2 called
# directly, streaming, 8 concurrent jobs, kv_stats, prefix reuse), which prints a table. Exits non-zero
# on any failure. Budget a few minutes: exllamav2 compiles its CUDA extension on first import.
#
#   scripts/gpu_check.sh [WHEEL_DIR]        WHEEL_DIR defaults to .whl in the repository root
#
# The GPU machine has no internet, so the packages its image lacks travel as wheels. Its image has
# Python 3.12 (x86-64) with torch, numpy, safetensors, tokenizers, ninja, nvcc, jinja2, pluggy,
# typer, rich, pandas, pygments, regex and pillow. Prepare the rest, once, on a machine with pip
# access (keep .whl out of git: echo /.whl/ >> .git/info/exclude):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl \
#       exllamav2==0.3.2 fastparquet cramjam websockets \
#       pydantic pydantic-core annotated-types typing-inspection gguf
#
# (exllamav2 0.3.2 on PyPI is a pure-Python wheel; fastparquet needs cramjam; pydantic is for
# unillm, gguf for the tiny-model builder.) Copy the checkout with .whl to the GPU machine and run
# `bash scripts/gpu_check.sh .whl` there. The table is also written to $OUT/gpu_check.txt when OUT
# names a folder.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS="${1:-.whl}"
PY="${PYTHON:-python3}"
WORK="${GPU_CHECK_DIR:-/tmp/unillm-gpu-check}"
OUT_DIR="${OUT:-$WORK}"

if ! nvidia-smi -L; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi -L failed)" >&2
    exit 2
fi
ls "$WHEELS"/*.whl >/dev/null || { echo "gpu_check: no wheels in $WHEELS (see the header)" >&2; exit 2; }

# A venv that sees the packages of $PY (torch above all: a .pth file names its site-packages, which
# --system-site-packages alone misses when $PY is itself a venv); the carried wheels go on top,
# with no index to fall back to.
rm -rf "$WORK"
mkdir -p "$WORK"
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$PY" -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' \
    >"$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_unillm_parent.pth"
"$VPY" -m pip install -q --no-index --no-deps --no-compile "$WHEELS"/*.whl
"$VPY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'

# unillm from this checkout, without building it (no hatchling there).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

"$VPY" -m unillm testing build-tiny "$WORK/tiny"
"$VPY" - "$WORK/tiny/hf" "$WORK/tiny-fp16" <<'EOF'
# An FP16 copy of the tiny model: the unquantized precision exllamav2 runs.
import json, shutil, sys
from pathlib import Path

from safetensors.numpy import load_file, save_file

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
shutil.copytree(src, dst, dirs_exist_ok=True)
tensors = {k: v.astype("float16") for k, v in load_file(src / "model.safetensors").items()}
save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
cfg = json.loads((dst / "config.json").read_text())
cfg["torch_dtype"] = "float16"
(dst / "config.json").write_text(json.dumps(cfg, indent=2))
print(f"fp16 copy: {dst}")
EOF

# First import compiles exllamav2's extension (minutes, with nvcc and ninja); time it on its own.
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
start=$(date +%s)
"$VPY" -c "import exllamav2, exllamav2.ext; print('exllamav2', exllamav2.__version__, 'imported')"
echo "gpu_check: exllamav2 import (extension build) took $(( $(date +%s) - start )) s"

"$VPY" scripts/gpu_check_exllamav2.py "$WORK/tiny-fp16" --context 512 2>&1 | tee "$OUT_DIR/gpu_check.txt"

# ---- ExLlamaV3 (plugins/unillm-exllamav3) ----
# Runs when the wheel directory holds an exllamav3 wheel. Carry, beside the ones above (same pip
# download line; exllamav3 1.6.5's own requirements, from its wheel's METADATA, that the image
# lacks: pyyaml, marisa-trie, llguidance>=1.7):
#
#       exllamav3==1.6.5 marisa-trie pyyaml llguidance
#
# (1.6.5 is what `pip install exllamav3` gives and what the plugin's fake follows; it vendors the
# flash-linear-attention kernels 1.4.1 needed as a package, and wants numpy>=2.1 and torch>=2.6:
# carry numpy too if the image's is older. Its attention and cache kernels are Triton's; a CUDA
# torch on Linux normally brings triton, checked below.) exllamav3 compiles its CUDA extension at first import (nvcc and ninja, minutes), like
# exllamav2. scripts/gpu_check_exllamav3.py converts the tiny model to EXL3 with exllamav3's own
# converter (there is no network for prequantized weights), then checks the plugin against
# exllamav3 called directly: the Job's max_new_tokens count, greedy parity, streaming, overhead
# ratio, structured output (llguidance), 8 concurrent requests batched, cancel on close, kv_stats,
# prefix reuse. Its table goes to $OUT/gpu_check_exllamav3.txt.
if ls "$WHEELS"/exllamav3-*.whl >/dev/null 2>&1; then
    "$VPY" -c "import triton; print('triton', triton.__version__)" \
        || echo "gpu_check: no triton beside torch: exllamav3 1.6 does not import without it (carry the triton wheel torch pins)"
    start=$(date +%s)
    "$VPY" -c "import exllamav3; print('exllamav3', exllamav3.__version__, 'imported')"
    echo "gpu_check: exllamav3 import (extension build) took $(( $(date +%s) - start )) s"
    PYTHONPATH="$PWD/plugins/unillm-exllamav3:$PYTHONPATH" \
        "$VPY" scripts/gpu_check_exllamav3.py "$WORK/tiny-fp16" --work "$WORK/exllamav3" --context 512 \
        2>&1 | tee "$OUT_DIR/gpu_check_exllamav3.txt"
else
    echo "gpu_check: no exllamav3 wheel in $WHEELS: the ExLlamaV3 plugin's check is skipped"
fi
