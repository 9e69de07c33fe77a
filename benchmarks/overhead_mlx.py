"""What unillm costs over calling mlx-lm directly.

Same model (the ~50 MB tiny Llama, f32, HF directory), same greedy settings, one process, runs
interleaved with rotating order, 256 tokens. Contenders:

- ``mlx_lm.stream_generate``: mlx-lm's own streaming call, consumed response by response: the floor.
- ``unillm stream`` / ``unillm generate`` with ``batch_size=1``: the backend wrapping
  ``stream_generate``, one request at a time.
- ``unillm stream (batched)``: the default engine (``batch_size=8``), whose requests go through
  mlx-lm's ``BatchGenerator`` on a worker thread, here with one request in flight.

Both sides start every request from an empty KV cache (unillm's prompt-cache reuse is switched off
here, so neither side skips the prompt). Goal (issue 4): unillm >= 0.99 x mlx-lm's speed.

    python benchmarks/overhead_mlx.py [--rounds 25] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import base_class_cost_us, interleaved, machine, medians, paired, print_floor, tiny_bench_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=25, help="interleaved rounds (>= 5)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.rounds < 5:
        ap.error("--rounds must be at least 5")

    import mlx_lm

    from unillm import SamplingParams, auto_engine
    from unillm.testing import tiny_model

    model = tiny_model("bench")
    path = str(model.hf_dir)
    prompt = "Once upon a time, there was a small model that wanted to tell stories."
    raw_model, raw_tok = mlx_lm.load(path)
    eos = set(raw_tok.eos_token_ids)
    raw_tok.eos_token_ids = set()  # generate the full length on both sides
    engine = auto_engine(
        path, backend="mlx", context_length=1024, options={"prompt_cache": False, "batch_size": 1}
    )
    batched = auto_engine(path, backend="mlx", context_length=1024, options={"prompt_cache": False})

    def raw(n: int) -> tuple[int, str]:
        parts, count = [], 0
        for resp in mlx_lm.stream_generate(raw_model, raw_tok, prompt, max_tokens=n):
            parts.append(resp.text)
            count += 1
        return count, "".join(parts)

    params = SamplingParams(temperature=0.0, ignore_eos=True)

    def unillm_stream(n: int) -> tuple[int, str]:
        parts, count = [], 0
        for chunk in engine.stream(prompt, params, max_tokens=n):
            parts.append(chunk.text)
            count += len(chunk.token_ids)
        return count, "".join(parts)

    def unillm_generate(n: int) -> tuple[int, str]:
        done = engine.generate(prompt, params, max_tokens=n)
        return len(done.token_ids), done.text

    def unillm_batched(n: int) -> tuple[int, str]:
        parts, count = [], 0
        for chunk in batched.stream(prompt, params, max_tokens=n):
            parts.append(chunk.text)
            count += len(chunk.token_ids)
        return count, "".join(parts)

    contenders = {
        "mlx_lm.stream_generate": raw,
        "unillm stream": unillm_stream,
        "unillm generate": unillm_generate,
        "unillm stream (batched)": unillm_batched,
    }
    outputs = {name: fn(args.tokens) for name, fn in contenders.items()}  # warm-up + agreement
    if len({text for _, text in outputs.values()}) != 1:
        sys.exit(f"contenders disagree: {outputs}")
    raw_tok.eos_token_ids = eos

    samples = interleaved({k: (fn, args.tokens) for k, fn in contenders.items()}, args.rounds)
    floor = medians(samples)
    ratios = paired(samples, "mlx_lm.stream_generate")
    base_us = base_class_cost_us()
    per_tok = floor["mlx_lm.stream_generate"] / args.tokens * 1e6

    results = {
        "machine": machine("mlx", "mlx-lm"),
        "model": tiny_bench_model(model),
        "workload": {"prompt": prompt, "greedy": True, "concurrency": 1, "rounds": args.rounds},
        "tokens": args.tokens,
        "seconds": floor,
        "speed_vs_mlx_lm": {k: v[0] for k, v in ratios.items()},
        "speed_vs_mlx_lm_iqr": {k: v[1:] for k, v in ratios.items()},
        "base_class_us_per_token": base_us,
        "mlx_lm_us_per_token": per_tok,
    }
    print(f"machine: {results['machine']}")
    print(f"model:   {results['model']}")
    print_floor(f"{args.tokens} tokens, greedy, {args.rounds} interleaved rounds", args.tokens, floor, ratios)
    print(
        f"  unillm's base class costs {base_us:.2f} us/token = {base_us / per_tok:.2%} of this model's "
        f"{per_tok:.0f} us/token"
    )
    met = ratios["unillm stream"][0] >= 0.99
    results["goal_met"] = met
    print(f"  [{'met' if met else 'MISSED'}] unillm >= 0.99 x mlx_lm.stream_generate")
    engine.close()
    batched.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
