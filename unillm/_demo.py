"""``unillm demo``: the whole path on a tiny model built here, no download.

Builds (once) the tiny random-weight Llama, opens its GGUF with ``auto_engine``, prints the
selection, streams a completion and a chat reply, and prints usage, timings and KV-cache stats.
The model's weights are random, so its text is gibberish: the demo shows the machinery.
"""

from __future__ import annotations

import sys

from unillm._auto import auto_engine
from unillm._types import Completion, SamplingParams


def run_demo(size: str = "small") -> None:
    """Run the demo on the tiny model of ``size`` (``small`` or ``bench``)."""
    from unillm.testing import tiny_model

    print(f"building (or reusing) the tiny '{size}' model...", file=sys.stderr)
    model = tiny_model(size)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    with auto_engine(model.gguf_path, context_length=512) as engine:
        print("== selection ==")
        print(engine.selection.explain() if engine.selection else engine.name)
        print("\n== stream: 'The quick brown fox' ==")
        last = None
        for chunk in engine.stream("The quick brown fox", params):
            print(chunk.text, end="", flush=True)
            last = chunk
        print()
        if last is not None:
            print(f"usage:   {last.usage}\ntimings: {last.timings}")
        print("\n== chat: 'Why is the sky blue?' ==")
        reply: Completion = engine.chat([{"role": "user", "content": "Why is the sky blue?"}], params)
        print(reply.text)
        print(f"finish:  {reply.finish_reason}\nusage:   {reply.usage}\ntimings: {reply.timings}")
        print("\n== kv_stats ==")
        print(engine.kv_stats())
    print("\n(the tiny model has random weights: the text is noise, the numbers are real)")
