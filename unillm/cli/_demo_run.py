"""``unillm demo``: the whole path on a tiny model built here, no download.

Builds (once) the tiny random-weight Llama, opens it with ``auto_engine``, prints the selection,
streams a completion and a chat reply with their usage, timings and KV-cache stats, then decodes
the same prompt on every other installed in-process engine that starts in seconds (llama.cpp and
MLX) and compares the tokens. The weights are random, so the text is noise: what the demo shows
is the machinery, and that the same weights mean the same tokens on every engine.
"""

from __future__ import annotations

import sys
from typing import Any

from unillm._choose._auto import auto_engine
from unillm._types import Completion, SamplingParams

_PROMPT = "The quick brown fox"


def run_demo(size: str = "small") -> None:
    """Run the demo on the tiny model of ``size`` (``small`` or ``bench``)."""
    from unillm.testing import tiny_model

    print(f"building (or reusing) the tiny '{size}' model...", file=sys.stderr)
    model = tiny_model(size)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    with auto_engine(model.gguf_path, context_length=512) as engine:
        print("== selection ==")
        print(engine.selection.explain() if engine.selection else engine.name)
        print(f"\n== stream: {_PROMPT!r} (greedy, 24 tokens) ==")
        last = None
        for chunk in engine.stream(_PROMPT, params):
            print(chunk.text, end="", flush=True)
            last = chunk
        print()
        if last is not None and last.usage is not None and last.timings is not None:
            print(_numbers(last.finish_reason, last.usage, last.timings))
        print("\n== chat: 'Why is the sky blue?' ==")
        reply: Completion = engine.chat([{"role": "user", "content": "Why is the sky blue?"}], params)
        print(reply.text)
        print(_numbers(reply.finish_reason, reply.usage, reply.timings))
        print("\n== kv_stats ==")
        kv = engine.kv_stats()
        print(
            f"holds {kv.used_tokens} of {kv.capacity_tokens} tokens, {kv.bytes_per_token} bytes/token "
            f"({kv.dtype}); prefix cache: {kv.prefix_cache_hits} of {kv.prefix_cache_queries} "
            "prompt tokens served from it"
        )
        reference = engine.generate(_PROMPT, params)
        name = engine.name
    _same_tokens_elsewhere(model, name, reference, params)
    print("\n(the tiny model has random weights: the text is noise, the numbers are real)")


def _numbers(finish: Any, usage: Any, t: Any) -> str:
    rate = f"{t.decode_tokens_per_s:.0f} tok/s" if t.decode_tokens_per_s else "n/a"
    return (
        f"finish: {finish}; tokens: {usage.prompt_tokens} in, {usage.completion_tokens} out "
        f"({usage.cached_prompt_tokens} cached); time to first token {t.ttft_s * 1000:.1f} ms, "
        f"decode {rate} ({t.source} timings)"
    )


def _same_tokens_elsewhere(model: Any, first: str, reference: Completion, params: SamplingParams) -> None:
    """Decode the prompt with the other quick-starting engines on the same weights."""
    from unillm._choose._registry import default_registry

    print(f"\n== the same weights on the other engines: {_PROMPT!r} ==")
    print(f"  {first}: {len(reference.token_ids)} tokens {list(reference.token_ids[:8])}...")
    for name in ("llama.cpp", "mlx"):
        if name == first:
            continue
        cls = default_registry().get(name)
        avail = cls.available()
        if not avail.available:
            print(f"  {name}: not installed ({avail.install_hint or avail.reason})")
            continue
        # the model directory holds the HF files and the GGUF: each engine reads its own
        with cls(model=str(model.root), context_length=512) as other:
            got = other.generate(_PROMPT, params)
        same = "the same tokens" if got.token_ids == reference.token_ids else "DIFFERENT tokens"
        print(f"  {name}: {len(got.token_ids)} tokens {list(got.token_ids[:8])}... ({same})")
    print("  (vLLM reads the same directory too; it is left out here because it takes a minute to start)")
