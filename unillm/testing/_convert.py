"""The tiny model converted by the engines' own converters, for the plugins that read other formats.

    from unillm.testing import convert_tiny, tiny_model

    onnx_dir = convert_tiny(tiny_model(), "onnxruntime-genai")   # genai_config.json + model.onnx
    ir_dir = convert_tiny(tiny_model(), "openvino")              # openvino_model.xml + tokenizers

The converters need torch and transformers, which the engines that run the result do not, so they
run as a subprocess of ``python`` (``$UNILLM_CONVERTER_PYTHON`` by default, else this interpreter):
in this project, the interpreter ``scripts/converters.sh`` prints. Conversions are offline and
cached beside the tiny model, keyed by its weights' digest; a failed one raises ``RuntimeError``
with the converter's output.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Literal

from unillm.testing._tiny import TinyModel, file_digest

__all__ = ["convert_tiny"]

Kind = Literal["onnxruntime-genai", "openvino"]
CONVERTER_VERSION = 1


def convert_tiny(model: TinyModel, kind: Kind, *, python: str | None = None, timeout: float = 600) -> Path:
    """The directory of ``model`` converted to ``kind``, converting it on first use."""
    interpreter = python or os.environ.get("UNILLM_CONVERTER_PYTHON") or sys.executable
    key = json.dumps(
        {"kind": kind, "weights": file_digest(model.hf_dir / "model.safetensors"), "v": CONVERTER_VERSION}
    )
    out = model.root / f"converted-{kind}"
    stamp = out / ".unillm-converted.json"
    if stamp.is_file() and stamp.read_text() == key:
        return out
    work = model.root / f".converting-{kind}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": ""}
    if kind == "onnxruntime-genai":
        args = ["-m", "onnxruntime_genai.models.builder", "-m", str(model.hf_dir), "-o", str(work / "out")]
        args += ["-p", "fp32", "-e", "cpu", "-c", str(work / "cache")]
    elif kind == "openvino":
        args = ["-m", "optimum.commands.optimum_cli", "export", "openvino", "--model", str(model.hf_dir)]
        args += ["--task", "text-generation-with-past", "--weight-format", "fp32", str(work / "out")]
    else:
        raise ValueError(f"kind is 'onnxruntime-genai' or 'openvino', got {kind!r}")
    proc = subprocess.run(
        [interpreter, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0 or not (work / "out").is_dir():
        shutil.rmtree(work, ignore_errors=True)
        raise RuntimeError(
            f"converting the tiny model to {kind} with {interpreter} failed ({proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    shutil.rmtree(out, ignore_errors=True)
    (work / "out").rename(out)
    shutil.rmtree(work, ignore_errors=True)
    stamp.write_text(key)
    return out
