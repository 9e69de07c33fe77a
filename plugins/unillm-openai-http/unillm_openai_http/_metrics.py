"""``KVStats`` read from a server's Prometheus ``/metrics``, for the servers that publish them.

Which gauges each server names (a scrape may hold several servers' families; the first family
found wins, in this order):

- vLLM: ``vllm:kv_cache_usage_perc`` (older: ``vllm:gpu_cache_usage_perc``; a fraction of the
  blocks), the counters ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (in prompt
  tokens; hits are whole blocks), and the labels of ``vllm:cache_config_info`` (``block_size``,
  ``num_gpu_blocks``, and where it has them (0.32 does) ``kv_cache_size_tokens``, the capacity
  vLLM itself states, else blocks times the block size, and ``kv_cache_memory_bytes``: the bytes,
  and the bytes per token where they divide exactly; ``cache_dtype`` unless it is ``auto``).
- SGLang: ``sglang:num_used_tokens``, ``sglang:max_total_num_tokens``, ``sglang:page_size``.
- llama.cpp's ``llama-server --metrics``: ``llamacpp:kv_cache_tokens``,
  ``llamacpp:kv_cache_usage_ratio`` (capacity = tokens / ratio, when the ratio is above zero).
- ``unillm serve``: ``unillm:kv_cache_usage_perc`` and ``unillm:prefix_cache_queries`` /
  ``unillm:prefix_cache_hits``.

A usage fraction alone gives no token counts (``KVStats`` holds counts, not fractions), so it
fills ``used_tokens`` only where the capacity is known too. What no gauge says stays None.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from unillm import KVStats

__all__ = ["Sample", "kv_from_metrics", "parse_metrics"]

Sample = tuple[str, dict[str, str], float]
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition: (name, labels, value); comments skipped."""
    out: list[Sample] = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), value))
    return out


class _Scrape:
    """The samples of one scrape, narrowed to one served model where they carry its name."""

    def __init__(self, samples: list[Sample], model: str) -> None:
        names = {lb.get("model_name") for _, lb, _ in samples} - {None}
        keep = model in names
        self.samples = [s for s in samples if not keep or s[1].get("model_name") in (None, model)]

    def value(self, *names: str) -> float | None:
        """The sum over label sets of the first of ``names`` the scrape holds (counters are
        exposed with a ``_total`` suffix by newer clients: both spellings are looked up)."""
        for name in names:
            found = [v for n, _, v in self.samples if n in (name, name + "_total")]
            if found:
                return sum(found)
        return None

    def labels(self, name: str) -> Mapping[str, str] | None:
        for n, lb, _ in self.samples:
            if n == name:
                return lb
        return None


def kv_from_metrics(text: str, model: str) -> KVStats:
    """``KVStats`` from a ``/metrics`` body; every field the scrape does not tell is None."""
    s = _Scrape(parse_metrics(text), model)
    if s.value("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc") is not None:
        return _vllm(s)
    if s.value("sglang:max_total_num_tokens", "sglang:num_used_tokens") is not None:
        used, cap = s.value("sglang:num_used_tokens"), s.value("sglang:max_total_num_tokens")
        page = s.value("sglang:page_size")
        return KVStats(capacity_tokens=_int(cap), used_tokens=_int(used), block_size=_int(page))
    if s.value("llamacpp:kv_cache_tokens", "llamacpp:kv_cache_usage_ratio") is not None:
        used, ratio = s.value("llamacpp:kv_cache_tokens"), s.value("llamacpp:kv_cache_usage_ratio")
        cap = used / ratio if used is not None and ratio else None
        return KVStats(capacity_tokens=_int(cap), used_tokens=_int(used))
    if s.value("unillm:kv_cache_usage_perc", "unillm:prefix_cache_queries") is not None:
        return KVStats(
            prefix_cache_queries=_int(s.value("unillm:prefix_cache_queries")),
            prefix_cache_hits=_int(s.value("unillm:prefix_cache_hits")),
        )
    return KVStats()


def _vllm(s: _Scrape) -> KVStats:
    perc = s.value("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    info = s.labels("vllm:cache_config_info") or {}
    block, blocks = _int_label(info, "block_size"), _int_label(info, "num_gpu_blocks")
    cap = _int_label(info, "kv_cache_size_tokens") or (block * blocks if block and blocks else None)
    # vLLM's usage is over its blocks less the null block (BlockPool.get_usage: used / (n - 1)),
    # so the blocks in use are perc x (n - 1), and the tokens they hold those blocks' tokens
    used_blocks = round(perc * (blocks - 1)) if perc is not None and blocks and blocks > 1 else None
    used: int | None
    if used_blocks is not None and block:
        used = used_blocks * block
    else:
        used = round(perc * cap) if perc is not None and cap else None
    # the bytes only where they are the cache's exactly (a size asked for and rounded down to
    # whole blocks leaves a remainder: then no byte figure at all rather than a wrong one)
    size = _int_label(info, "kv_cache_memory_bytes")
    bpt = size // cap if size and cap and size % cap == 0 else None
    dtype = info.get("cache_dtype")
    return KVStats(
        capacity_tokens=cap,
        used_tokens=used,
        bytes_per_token=bpt,
        capacity_bytes=size if bpt else None,
        used_bytes=used * bpt if bpt and used is not None else None,
        dtype=dtype if dtype and dtype not in ("auto", "None") else None,
        block_size=block,
        total_blocks=blocks,
        used_blocks=used_blocks,
        prefix_cache_queries=_int(s.value("vllm:prefix_cache_queries")),
        prefix_cache_hits=_int(s.value("vllm:prefix_cache_hits")),
    )


def _int(value: float | None) -> int | None:
    return None if value is None else round(value)


def _int_label(labels: Mapping[str, str], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return None
