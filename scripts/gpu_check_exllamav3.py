"""Check the exllamav3 plugin (plugins/unillm-exllamav3) against the real exllamav3 on a GPU; print
a table of results.

    python scripts/gpu_check_exllamav3.py HF_DIR --work DIR [--context 512] [--bits 4.0]

HF_DIR is an unquantized Hugging Face model directory (scripts/gpu_check.sh builds the tiny one);
there is no network on the GPU machine, so the EXL3 weights are made here with exllamav3's own
converter (``exllamav3.conversion.convert_model``, what its convert.py runs). If the conversion
fails (a model too small for EXL3's tiles, say) the checks run on the FP16 directory instead,
which exllamav3 loads unquantized, and the table says so.

The checks: what a Job asked for n tokens streams (exllamav3 1.6.5's ``Job`` streams exactly n;
1.4.1's kept ``max_new_tokens - 1``, and the plugin reads which from a Job at load and asks for
one more there), greedy token parity with exllamav3's
generator called directly, streaming, the overhead of going through unillm (decode time over the
direct loop's, median of interleaved runs), structured output through exllamav3's llguidance
filter, 8 concurrent requests batched, a closed stream
cancelling its job, KV-cache statistics against the cache exllamav3 built, prefix reuse. Exits 1
if any check fails. The plugin must be importable (PYTHONPATH=plugins/unillm-exllamav3); it need
not be installed. tests/test_plugin_exllamav3.py runs this script against the plugin's fake
exllamav3, so its logic is tested without a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPTS = ["The quick brown fox", "Once upon a time", "0 1 2 3 4 5 6 7 8 9"]
N = 24
OVERHEAD_TOKENS = 128
OVERHEAD_LIMIT = (
    1.25  # unillm's decode time over the direct loop's, on a tiny model (per-token cost dominates)
)


def convert(hf_dir: str, work: Path, bits: float) -> tuple[str, str]:
    """EXL3 weights of ``hf_dir`` through exllamav3's converter; (directory, what it is)."""
    from exllamav3.conversion.convert_model import main, parser, prepare

    out = work / "exl3"
    args = parser.parse_args(
        [
            "-i",
            hf_dir,
            "-o",
            str(out),
            "-w",
            str(work / "exl3-work"),
            "-b",
            str(bits),
            "-cr",
            "16",
            "-cc",
            "256",
        ]
    )
    try:
        in_args, job_state, ok, err = prepare(args)
        if not ok:
            raise RuntimeError(err)
        main(in_args, job_state)
    except Exception as exc:  # the tiny model may be below what EXL3's quantizer takes
        traceback.print_exc()
        return hf_dir, f"FP16 (conversion failed: {type(exc).__name__}: {exc})"
    return str(out), f"EXL3 {bits} bpw, converted here"


class Direct:
    """exllamav3 alone, as its examples use it: config, model, cache, tokenizer, generator, jobs."""

    def __init__(self, model_dir: str, context: int) -> None:
        from exllamav3 import ArgmaxSampler, Cache, Config, Generator, Job, Model, Tokenizer

        self.config = Config.from_directory(model_dir)
        self.model = Model.from_config(self.config)
        self.cache = Cache(self.model, max_num_tokens=-(-context // 256) * 256)
        self.model.load(progressbar=False)
        self.tokenizer = Tokenizer.from_config(self.config)
        self.generator = Generator(model=self.model, cache=self.cache, tokenizer=self.tokenizer)
        self.Job, self.Argmax = Job, ArgmaxSampler

    def run(self, prompt: str, max_new_tokens: int, stop: bool = True) -> list[int]:
        job = self.Job(
            input_ids=self.tokenizer.encode(prompt, encode_special_tokens=True),
            max_new_tokens=max_new_tokens,
            sampler=self.Argmax(),
            stop_conditions=self.config.eos_token_id_list if stop else None,
        )
        self.generator.enqueue(job)
        ids: list[int] = []
        while self.generator.num_remaining_jobs():
            for r in self.generator.iterate():
                if r["stage"] == "streaming" and "token_ids" in r:
                    ids.extend(r["token_ids"][0].tolist())
        return ids

    def close(self) -> None:
        self.model.unload()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="an unquantized HF model directory")
    parser.add_argument("--work", required=True, help="a folder for the converted model")
    parser.add_argument("--context", type=int, default=512, help="max_seq_len to load with")
    parser.add_argument("--bits", type=float, default=4.0, help="EXL3 bits per weight")
    args = parser.parse_args()

    import exllamav3
    import unillm_exllamav3

    from unillm import Registry, SamplingParams, auto_engine

    registry = Registry()  # the built-ins and installed plugins; this one even if not pip-installed
    if "exllamav3" not in registry.backends():
        registry.register_plugin(unillm_exllamav3, name="exllamav3")

    torch = sys.modules.get("torch")
    device = torch.cuda.get_device_name(0) if torch is not None else "no torch (a fake exllamav3)"
    print(f"exllamav3 {exllamav3.__version__} from {Path(exllamav3.__file__).parent}")
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

    t0 = time.perf_counter()
    model_dir, what = convert(args.model, Path(args.work), args.bits)
    # a conversion the tiny model is too small for is a finding about the test model, not the
    # plugin: the other checks then run on the FP16 weights, and this row says so
    rows.append(("weights", True, f"{what}: {model_dir} ({time.perf_counter() - t0:.1f} s)"))

    greedy = SamplingParams(temperature=0.0, max_tokens=N)
    t0 = time.perf_counter()
    engine = auto_engine(model_dir, backend="exllamav3", context_length=args.context, registry=registry)
    rows.append(
        ("load through unillm", True, f"{time.perf_counter() - t0:.2f} s, {engine.kv_stats().dtype} cache")
    )
    # the engine called directly shares the GPU with unillm's: both are small
    direct = Direct(model_dir, args.context)

    def max_new_tokens_count() -> tuple[bool, str]:
        got = {n: len(direct.run(PROMPTS[0], n, stop=False)) for n in (1, 2, 8)}
        ours = {
            n: len(engine.generate(PROMPTS[0], greedy, max_tokens=n, ignore_eos=True).token_ids) for n in got
        }
        # 1.6.5 streams n; the plugin asks for what gives n either way (see its _load)
        return ours == {
            n: n for n in got
        }, f"Job(max_new_tokens=n) streams {got}; unillm max_tokens=n gives {ours}"

    def parity() -> tuple[bool, str]:
        ours = [list(engine.generate(p, greedy).token_ids) for p in PROMPTS]
        theirs = [direct.run(p, N) for p in PROMPTS]
        same = sum(a == b for a, b in zip(ours, theirs, strict=True))
        lp = engine.generate(PROMPTS[0], greedy, logprobs=1)
        lp_ok = lp.logprobs is not None and len(lp.logprobs) == len(lp.token_ids) and max(lp.logprobs) <= 1e-3
        lp_ok = lp_ok and list(lp.token_ids) == ours[0]  # asking for logprobs changes no token
        detail = f"{same}/{len(PROMPTS)} prompts; logprobs {'ok' if lp_ok else 'WRONG'}"
        return same == len(PROMPTS) and all(ours) and lp_ok, detail

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

    def overhead() -> tuple[bool, str]:
        long = SamplingParams(temperature=0.0, max_tokens=OVERHEAD_TOKENS, ignore_eos=True)
        ours: list[float] = []
        theirs: list[float] = []
        for _ in range(5):  # interleaved, after the warm-up the checks above gave both
            t = time.perf_counter()
            engine.generate(PROMPTS[1], long)
            ours.append(time.perf_counter() - t)
            t = time.perf_counter()
            direct.run(PROMPTS[1], OVERHEAD_TOKENS, stop=False)
            theirs.append(time.perf_counter() - t)
        ratio = statistics.median(ours) / statistics.median(theirs)
        return ratio <= OVERHEAD_LIMIT, (
            f"{OVERHEAD_TOKENS} tokens: unillm {statistics.median(ours) * 1e3:.1f} ms, direct "
            f"{statistics.median(theirs) * 1e3:.1f} ms, ratio {ratio:.3f} (limit {OVERHEAD_LIMIT})"
        )

    def structured() -> tuple[bool, str]:
        schema = {
            "type": "object",
            "properties": {"color": {"enum": ["red", "blue"]}, "n": {"type": "integer"}},
            "required": ["color", "n"],
            "additionalProperties": False,
        }
        values = [
            engine.generate(
                PROMPTS[0], temperature=1.0, seed=s, max_tokens=64, response_format=schema
            ).parsed()
            for s in range(4)
        ]
        ok = all(v["color"] in ("red", "blue") and isinstance(v["n"], int) for v in values)
        return ok, f"4 sampled answers parse under the schema through LLGuidanceFilter: {values[0]}"

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
        same = sum(a == b for a, b in zip(together, alone, strict=True))
        # batched fp16 kernels may flip a near-tie: report, but require most to match
        return same >= 6 and max(seen) > 1, f"8 jobs, {same}/8 equal alone, up to {max(seen)} in flight"

    def cancel() -> tuple[bool, str]:
        stream = engine.stream(PROMPTS[0], greedy, max_tokens=400, ignore_eos=True)
        next(stream)
        next(stream)
        stream.close()  # type: ignore[attr-defined]
        gen: Any = engine._generator  # type: ignore[attr-defined]
        for _ in range(500):
            if engine._runner.call(gen.num_remaining_jobs) == 0:  # type: ignore[attr-defined]
                break
            time.sleep(0.01)
        left = engine._runner.call(gen.num_remaining_jobs)  # type: ignore[attr-defined]
        used = engine.kv_stats().used_tokens
        return left == 0 and used == 0, f"{left} jobs left, {used} cache tokens in use after close()"

    def kv_stats() -> tuple[bool, str]:
        stats = engine.kv_stats()
        cache: Any = engine._cache  # type: ignore[attr-defined]
        stored = sum(int(layer.storage_size()) for layer in cache.layers.values())
        ok = (
            stats.capacity_tokens == cache.max_num_tokens
            and stats.capacity_bytes is not None
            and abs(stats.capacity_bytes - stored) < cache.max_num_tokens
            and stats.used_tokens == 0
            and stats.block_size == 256
        )
        return ok, (
            f"capacity {stats.capacity_tokens} tokens, {stats.bytes_per_token} B/token, "
            f"cache layers {stored} B, {stats.total_blocks} pages"
        )

    def prefix_reuse() -> tuple[bool, str]:
        prompt = " the" * 300
        engine.generate(prompt, greedy, max_tokens=4)
        again = engine.generate(prompt, greedy, max_tokens=4)
        cached = again.usage.cached_prompt_tokens or 0
        return cached >= 256, f"{cached} of {again.usage.prompt_tokens} prompt tokens cached"

    for name, fn in [
        ("max_new_tokens count", max_new_tokens_count),
        ("greedy parity", parity),
        ("streaming", streaming),
        ("overhead", overhead),
        ("structured output", structured),
        ("concurrent jobs", concurrent),
        ("cancel on close", cancel),
        ("kv_stats", kv_stats),
        ("prefix reuse", prefix_reuse),
    ]:
        check(name, fn)
    direct.close()
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
