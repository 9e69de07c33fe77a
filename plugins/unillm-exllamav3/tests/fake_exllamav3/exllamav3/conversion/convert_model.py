"""exllamav3's converter entry points (exllamav3/conversion/convert_model.py, v1.6.5: ``parser``,
``prepare(args) -> (in_args, job_state, ok, err)``, ``main(in_args, job_state)``), faked: the
output is the input directory with an EXL3 quantization_config, as the real one's compile step
(conversion/compile.py) writes it (the fake model reads only the weights' size, so they are
copied as they are). The options the fake takes are a subset of the real parser's; 1.6.5's
output scales default to ``auto``."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Any

from exllamav3.version import __version__

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("-i", "--in_dir", type=str, default=None, help="Input (model) directory")
parser.add_argument("-w", "--work_dir", type=str, default=None, help="Working directory")
parser.add_argument("-o", "--out_dir", type=str, default=None, help="Output directory")
parser.add_argument("-b", "--bits", type=float, help="Bits per weight")
parser.add_argument(
    "-hb", "--head_bits", type=float, default=None, help="Bits per weight, output (head) layer"
)
parser.add_argument("-r", "--resume", action="store_true", help="Resume interrupted job")
parser.add_argument("-cr", "--cal_rows", type=int, help="Calibration data size, rows, default: 250")
parser.add_argument("-cc", "--cal_cols", type=int, help="Calibration data size, columns, default: 2048")
parser.add_argument(
    "-cb", "--codebook", type=str, default="mul1", help="Codebook: mul1 (default), mcg or 3inst"
)
parser.add_argument(
    "--out_scales",
    type=str,
    default="auto",
    choices=["auto", "always", "never", "yaqa"],
    help="Output channel scales",
)


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
    if args.codebook not in ["mcg", "mul1", "3inst"]:
        return None, None, False, "Codebook must be 'mcg', 'mul1' or '3inst'"
    if args.bits is not None and (args.bits > 8 or args.bits < 1):
        return None, None, False, "--bits must be between 1 and 8"
    if args.head_bits is not None and (args.head_bits > 8 or args.head_bits < 1) and args.head_bits != 16:
        return None, None, False, "--head_bits must be between 1 and 8, or 16"
    if not args.resume and args.bits is None:
        return None, None, False, "Specify either --bits or --recipe"
    assert not args.resume, "the fake does not resume jobs"
    os.makedirs(args.work_dir, exist_ok=True)
    head_bits = args.head_bits or 6
    in_args = {
        "in_dir": args.in_dir,
        "out_dir": args.out_dir,
        "work_dir": args.work_dir,
        "bits": args.bits,
        "head_bits": int(head_bits) if float(head_bits).is_integer() else head_bits,
        "cal_rows": args.cal_rows or 250,
        "cal_cols": args.cal_cols or 2048,
        "codebook": args.codebook,
        "apply_out_scales": {"always": True, "never": False, "auto": None, "yaqa": None}[args.out_scales],
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
        "calibration": {"rows": args["cal_rows"], "cols": args["cal_cols"]},
        "out_scales": {True: "always", False: "never", None: "auto"}[args["apply_out_scales"]],
        "codebook": args["codebook"],
    }
    with open(path, "w", encoding="utf8") as f:
        json.dump(config, f, indent=2)
