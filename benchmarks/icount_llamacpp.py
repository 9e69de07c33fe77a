"""One contender of the instruction-count comparison (run under valgrind by icount_llamacpp.sh).

    python benchmarks/icount_llamacpp.py {load|raw|unillm} TOKENS

Loads the ~50 MB tiny GGUF with one thread (no spinning worker threads, so the count is
repeatable), then generates TOKENS greedy tokens with the raw loop or with unillm, or nothing.
"""

from __future__ import annotations

import codecs
import sys


def main() -> None:
    mode, n = sys.argv[1], int(sys.argv[2])
    from llama_cpp import Llama

    from unillm import SamplingParams, auto_engine
    from unillm.testing import tiny_model

    path = str(tiny_model("bench").gguf_path)
    prompt = "Once upon a time, there was a small model that wanted to tell stories."
    raw = Llama(path, n_ctx=512, n_threads=1, n_threads_batch=1, verbose=False)
    engine = auto_engine(path, context_length=512, options={"n_threads": 1, "n_threads_batch": 1})
    ids = raw.tokenize(prompt.encode(), add_bos=True, special=True)
    count = 0
    if mode == "raw":
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for tok in raw.generate(ids, temp=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            decoder.decode(raw.detokenize([tok]))
            count += 1
            if count == n:
                break
    elif mode == "unillm":
        for chunk in engine.stream(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)):
            count += len(chunk.token_ids)
    print(mode, count)


if __name__ == "__main__":
    main()
