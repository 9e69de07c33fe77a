"""exllamav3's converter entry points (exllamav3/conversion/convert_model.py, v1.4.1: ``parser``,
``prepare(args) -> (in_args, job_state, ok, err)``, ``main(in_args, job_state)``), faked: the
output is the input directory with an EXL3 quantization_config, as the real one writes it (the
fake model reads only the weights' size, so they are copied as they are)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Any

from exllamav3.version import __version__

parser = argparse.ArgumentParser(description="Convert model to ExLlamaV3")
parser.add_argument("-i", "--in_dir", type=str, default=None, help="Input (model) directory")
parser.add_argument("-w", "--work_dir", type=str, default=None, help="Working directory")
parser.add_argument("-o", "--out_dir", type=str, default=None, help="Output directory")
parser.add_argument("-b", "--bits", type=float, help="Bits per weight")
parser.add_argument("-hb", "--head_bits", type=int, default=None, help="Bits per weight, output (head) layer")
parser.add_argument("-cr", "--cal_rows", type=int, help="Calibration data size, rows")
parser.add_argument("-cc", "--cal_cols", type=int, help="Calibration data size, columns")
parser.add_argument("-r", "--resume", action="store_true", help="Resume interrupted job")


def prepare(args: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None, bool, str | None]:
    if not args.work_dir:
        return None, None, False, "Must specify --work_dir"
    if not args.in_dir and not args.resume:
        return (
            None,
            None,
            False,
            "Specify either --in_dir to start a new job or --resume to resume an interrupted job",
        )
    if not args.out_dir and not args.resume:
        return None, None, False, "Must specify --out_dir or --resume"
    if args.bits is None:
        raise ValueError(" ## Missing required argument: bits")
    if args.bits > 8 or args.bits < 1:
        return None, None, False, "--bits must be between 1 and 8"
    os.makedirs(args.work_dir, exist_ok=True)
    in_args = {
        "in_dir": args.in_dir,
        "out_dir": args.out_dir,
        "work_dir": args.work_dir,
        "bits": args.bits,
        "head_bits": args.head_bits or 6,
    }
    return in_args, {"next_module_idx": 0, "q_strategy": None}, True, None


def main(args: dict[str, Any], job_state: dict[str, Any]) -> None:
    shutil.copytree(args["in_dir"], args["out_dir"], dirs_exist_ok=True)
    path = os.path.join(args["out_dir"], "config.json")
    with open(path, encoding="utf8") as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "exl3",
        "version": __version__,
        "bits": args["bits"],
        "head_bits": args["head_bits"],
        "calibration": {"rows": 16, "cols": 256},
        "out_scales": "always",
        "codebook": "mul1",
    }
    with open(path, "w", encoding="utf8") as f:
        json.dump(config, f, indent=2)
