"""Check unillm's ExLlamaV2 backend against the real exllamav2 on a GPU; print a table of results.

    python scripts/gpu_check_exllamav2.py HF_DIR [--context 512]

HF_DIR is an unquantized Hugging Face model directory (scripts/gpu_check.sh builds the tiny one and
writes an FP16 copy). The checks: greedy token parity with exllamav2's dynamic generator called
directly, streaming, 8 concurrent requests, KV-cache statistics, timings, prefix reuse, and
structured output (a JSON schema, a regex and a choice enforced by the llguidance filter at
temperature 1 over seeds, concurrent jobs under different formats, tok/s with and without a
schema). Exits 1 if
any check fails. tests/test_exllamav2.py runs this same script against the fake exllamav2, so its
logic is tested without a GPU; on the fake there is no torch and the device line says so.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPTS = ["The quick brown fox", "Once upon a time", "0 1 2 3 4 5 6 7 8 9"]
N = 24
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["pickup", "delivery"]},
        "n": {"type": "integer", "minimum": 3, "maximum": 9},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                    "qty": {"type": "integer"},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "gift": {"type": "boolean"},
    },
    "required": ["kind", "n", "items", "gift"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,4}"
CHOICES = ["yes", "no", "maybe so"]


def direct_greedy(model_dir: str, context: int, paged: bool) -> list[list[int]]:
    """exllamav2 alone, as its examples use it: config, autosplit model, cache, tokenizer, jobs."""
    from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
    from exllamav2.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler

    config = ExLlamaV2Config(model_dir)
    config.arch_compat_overrides()
    config.max_seq_len = context
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, max_seq_len=-(-context // 256) * 256, lazy=True)
    model.load_autosplit(cache, progress=False)
    tokenizer = ExLlamaV2Tokenizer(config)
    generator = ExLlamaV2DynamicGenerator(
        model=model, cache=cache, tokenizer=tokenizer, paged=paged, max_batch_size=1 if not paged else None
    )
    outs = []
    for prompt in PROMPTS:
        job = ExLlamaV2DynamicJob(
            input_ids=tokenizer.encode(prompt, encode_special_tokens=True),
            max_new_tokens=N,
            gen_settings=ExLlamaV2Sampler.Settings.greedy(),
            stop_conditions=[tokenizer.eos_token_id],
        )
        generator.enqueue(job)
        ids: list[int] = []
        while generator.num_remaining_jobs():
            for r in generator.iterate():
                if r["stage"] == "streaming" and "token_ids" in r:
                    ids.extend(r["token_ids"][0].tolist())
        outs.append(ids)
    model.unload()
    return outs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="an unquantized HF model directory")
    parser.add_argument("--context", type=int, default=512, help="max_seq_len to load with")
    args = parser.parse_args()

    import exllamav2

    from unillm import SamplingParams, StructuredOutputError, auto_engine

    torch = sys.modules.get("torch")
    device = torch.cuda.get_device_name(0) if torch is not None else "no torch (the fake exllamav2)"
    print(f"exllamav2 {exllamav2.__version__} from {Path(exllamav2.__file__).parent}")
    print(f"device: {device}\n")

    rows: list[tuple[str, bool, str]] = []

    def check(name: str, fn: Callable[[], tuple[bool, str]]) -> None:
        t0 = time.perf_counter()
        try:
            ok, detail = fn()
        except Exception as exc:
            traceback.print_exc()
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        rows.append((name, ok, f"{detail} ({time.perf_counter() - t0:.2f} s)"))

    greedy = SamplingParams(temperature=0.0, max_tokens=N)
    t0 = time.perf_counter()
    engine = auto_engine(args.model, backend="exllamav2", context_length=args.context)
    rows.append(("load through unillm", True, f"{time.perf_counter() - t0:.2f} s"))
    paged = bool(engine.capabilities.batching)

    def parity() -> tuple[bool, str]:
        ours = [list(engine.generate(p, greedy).token_ids) for p in PROMPTS]
        theirs = direct_greedy(args.model, args.context, paged)
        same = sum(a == b for a, b in zip(ours, theirs, strict=True))
        return same == len(PROMPTS) and all(len(o) > 0 for o in ours), f"{same}/{len(PROMPTS)} prompts"

    def streaming() -> tuple[bool, str]:
        chunks = list(engine.stream(PROMPTS[0], greedy))
        whole = engine.generate(PROMPTS[0], greedy)
        last = chunks[-1]
        ok = (
            "".join(c.text for c in chunks) == whole.text
            and len(chunks) > 1
            and last.finish_reason in ("stop", "length")
            and last.timings is not None
            and last.timings.ttft_s < last.timings.total_s
        )
        t = whole.timings
        tps = f"{t.decode_tokens_per_s:.0f} tok/s" if t.decode_tokens_per_s else "n/a"
        return ok, f"{len(chunks)} chunks, timings from {t.source}, decode {tps}"

    def concurrent() -> tuple[bool, str]:
        prompts = [f"Request {i} says" for i in range(8)]
        alone = [engine.generate(p, greedy, ignore_eos=True).token_ids for p in prompts]
        seen: list[int] = []

        async def one(prompt: str) -> tuple[int, ...]:
            ids: list[int] = []
            async for chunk in engine.astream(prompt, greedy, ignore_eos=True):
                seen.append(engine._runner.active)  # type: ignore[attr-defined]
                ids.extend(chunk.token_ids)
            return tuple(ids)

        async def run() -> list[tuple[int, ...]]:
            return list(await asyncio.gather(*(one(p) for p in prompts)))

        together = asyncio.run(run())
        ok = together == alone and (max(seen) > 1 or not paged)
        mode = "batched (paged)" if paged else "queued one at a time (unpaged: no flash-attn)"
        return (
            ok,
            f"8 jobs, {sum(a == b for a, b in zip(together, alone, strict=True))}/8 equal alone; {mode}",
        )

    def kv_stats() -> tuple[bool, str]:
        stats = engine.kv_stats()
        cache: Any = engine._cache  # type: ignore[attr-defined]
        allocated = sum(cache.footprint())
        ok = (
            stats.capacity_tokens == cache.max_seq_len
            and stats.capacity_bytes == allocated
            and stats.used_tokens == 0
            and (stats.block_size == 256 or not paged)
        )
        return ok, (
            f"capacity {stats.capacity_tokens} tokens, {stats.bytes_per_token} B/token, "
            f"allocated {allocated} B, {stats.total_blocks} pages"
        )

    def prefix_reuse() -> tuple[bool, str]:
        prompt = " the" * 300
        engine.generate(prompt, greedy, max_tokens=4)
        again = engine.generate(prompt, greedy, max_tokens=4)
        cached = again.usage.cached_prompt_tokens or 0
        return cached >= 256 or not paged, f"{cached} of {again.usage.prompt_tokens} prompt tokens cached"

    def structured() -> tuple[bool, str]:
        import re

        import jsonschema

        hot = SamplingParams(temperature=1.0, max_tokens=300)
        validator = jsonschema.Draft202012Validator(SCHEMA)
        finished = valid = 0
        for seed in range(8):
            done = engine.generate("Order:", hot, response_format=SCHEMA, seed=seed)
            if done.finish_reason == "stop":
                finished += 1
                valid += not list(validator.iter_errors(done.parsed()))
        regex = {"type": "regex", "pattern": REGEX}
        matched = sum(
            re.fullmatch(REGEX, engine.generate("x", hot, response_format=regex, seed=s).text) is not None
            for s in range(8)
        )
        choice = {"type": "choice", "choices": CHOICES}
        chosen = sum(
            engine.generate("x", hot, response_format=choice, seed=s).text in CHOICES for s in range(8)
        )
        formats: list[Any] = [SCHEMA, regex, choice, SCHEMA]

        async def run() -> list[Any]:
            return list(
                await asyncio.gather(
                    *(engine.agenerate("x", hot, response_format=f, seed=i) for i, f in enumerate(formats))
                )
            )

        def keeps(done: Any) -> bool:  # parse() raises on output that breaks the format
            try:
                return done.finish_reason != "stop" or done.parsed() is not None
            except StructuredOutputError:
                return False

        kept = sum(keeps(d) for d in asyncio.run(run()))

        def tps(**kw: Any) -> float:
            t = engine.generate("x", hot, seed=0, max_tokens=60, ignore_eos=not kw, **kw).timings
            return t.decode_tokens_per_s or 0.0

        plain, constrained = tps(), tps(response_format=SCHEMA)
        ok = finished >= 6 and valid == finished and matched == 8 and chosen == 8 and kept == len(formats)
        return ok, (
            f"schema {valid}/{finished} finished valid (of 8), regex {matched}/8, choice {chosen}/8, "
            f"{kept}/{len(formats)} concurrent kept their format; decode {constrained:.0f} tok/s under "
            f"the schema vs {plain:.0f} without"
        )

    def speculative() -> tuple[bool, str]:
        # the model drafting for itself: the same greedy tokens, (nearly) every draft kept
        opts = {"draft_model": args.model, "num_draft_tokens": 4}
        with auto_engine(args.model, backend="exllamav2", context_length=args.context, options=opts) as e:
            outs = [e.generate(p, greedy) for p in PROMPTS]
        plain = [engine.generate(p, greedy).token_ids for p in PROMPTS]
        same = sum(o.token_ids == want for o, want in zip(outs, plain, strict=True))
        drafted = sum(o.usage.draft_tokens or 0 for o in outs)
        kept = sum(o.usage.accepted_draft_tokens or 0 for o in outs)
        ok = same == len(PROMPTS) and 0 < kept <= drafted
        return ok, f"{same}/{len(PROMPTS)} prompts the same, {kept}/{drafted} drafts kept"

    for name, fn in [
        ("greedy parity", parity),
        ("streaming", streaming),
        ("concurrent jobs", concurrent),
        ("kv_stats", kv_stats),
        ("prefix reuse", prefix_reuse),
        ("structured output", structured),
        ("speculative decoding", speculative),
    ]:
        check(name, fn)
    engine.close()

    width = max(len(r[0]) for r in rows)
    print(f"{'check':<{width}}  result  detail")
    for name, ok, detail in rows:
        print(f"{name:<{width}}  {'ok' if ok else 'FAIL':<6}  {detail}")
    failed = [r[0] for r in rows if not r[1]]
    print("\nall checks passed" if not failed else f"\nFAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
