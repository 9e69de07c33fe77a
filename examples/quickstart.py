"""Quickstart: open a model with the best installed backend, stream, chat, read the numbers.

    python examples/quickstart.py [MODEL]

MODEL is a .gguf file or a model directory. Without one, the script builds (once, into
``$UNILLM_CACHE`` or ~/.cache/unillm) unillm's tiny random-weight Llama and runs that: its text
is noise, but the selection, usage, timings and KV-cache numbers are real.
"""

from __future__ import annotations

import sys

from unillm import Completion, SamplingParams, Usage, auto_engine


def usage_line(usage: Usage) -> str:
    return (
        f"usage: prompt={usage.prompt_tokens} completion={usage.completion_tokens} "
        f"cached={usage.cached_prompt_tokens}"  # None where the engine cannot tell
    )


def main(model: str) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0)
    with auto_engine(model, context_length=512) as engine:
        assert engine.selection is not None  # auto_engine always records why
        print(engine.selection.explain())

        print("\n-- stream --")
        last = None
        for last in engine.stream("The quick brown fox", params):
            print(last.text, end="", flush=True)
        print()
        # The last chunk carries the finish reason, usage and timings.
        if last is not None and last.usage is not None and last.timings is not None:
            t = last.timings
            rate = f"{t.decode_tokens_per_s:.0f} tok/s" if t.decode_tokens_per_s else "n/a"
            print(f"finish: {last.finish_reason}")
            print(usage_line(last.usage))
            print(f"timings: ttft={t.ttft_s * 1000:.2f} ms decode={rate} (source: {t.source})")

        print("\n-- chat --")
        history = [{"role": "user", "content": "What is the capital of France?"}]
        reply: Completion = engine.chat(history, params)
        print(f"reply: {reply.text!r}")
        print(f"finish: {reply.finish_reason}")
        print(usage_line(reply.usage))

        # A follow-up turn starts with the whole first turn: the engine reuses that prefix.
        history += [
            {"role": "assistant", "content": reply.text},
            {"role": "user", "content": "And of Italy?"},
        ]
        follow_up = engine.chat(history, params)
        print(f"follow-up {usage_line(follow_up.usage)}")

        print("\n-- kv_stats --")
        kv = engine.kv_stats()  # None in a field means this engine cannot tell
        print(f"kv: capacity={kv.capacity_tokens} used={kv.used_tokens} bytes_per_token={kv.bytes_per_token}")
        hits, queries = kv.prefix_cache_hits, kv.prefix_cache_queries  # prompt tokens
        print(f"prefix cache: {hits} of {queries} prompt tokens served from it")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        model_path = sys.argv[1]
    else:
        from unillm.testing import tiny_model

        model_path = str(tiny_model().gguf_path)
    main(model_path)
