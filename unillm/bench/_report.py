"""Results for people: a markdown table (the terminal prints the same) and PNG plots.

``table(results)`` has one row per engine and level; ``plot(results, directory)`` writes latency
CDFs (TTFT, TPOT, E2E) and output tok/s and p99 TTFT against concurrency, one line per engine.
An embedding benchmark's results (``"task": "embed"``) get a table and a plot of their own: texts/s,
tokens/s and call latency by batch size.
matplotlib is imported only here, only when plotting (the ``bench`` extra).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["label", "plot", "table"]


def label(result: dict[str, Any]) -> str:
    """``engine version`` (or the URL's), the line a result is drawn and listed under."""
    engine = result["metadata"]["engine"]
    name = str(engine.get("name") or result["target"].get("url"))
    version = str(engine.get("version") or "?")
    return version if version.startswith(name + " ") else f"{name} {version}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


_HEAD = (
    "| engine | level | req/s | out tok/s | prefill tok/s | decode tok/s | TTFT p50 / p99 ms "
    "| TPOT p50 / p99 ms | ITL p99 ms | E2E p99 ms | goodput | errors | peak RSS MiB | plan/RSS |"
)


def table(results: Sequence[dict[str, Any]]) -> str:
    """A markdown table of every level of every result (embedding results in a table of their own)."""
    embeds = [r for r in results if r.get("task") == "embed"]
    results = [r for r in results if r.get("task") != "embed"]
    if embeds:
        return "\n\n".join(t for t in (table(results) if results else "", _embed_table(embeds)) if t)
    lines = [_HEAD, "|" + "---|" * _HEAD.count(" | ") + "---|"]
    for result in results:
        name = label(result) + (" (partial)" if result.get("partial") else "")
        for level in result["levels"]:
            s = level["summary"]
            kind = "c" if level["kind"] == "concurrency" else "rate"
            value = f"{kind}={level['value']:g}"
            mem = level["memory"]
            rss = mem.get("peak_rss_bytes")
            good = s["goodput"]["share"]
            errors = ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "0"
            lines.append(
                f"| {name} | {value} | {_num(s['requests_per_s'], '{:.2f}')} "
                f"| {_num(s['output_tokens_per_s'])} "
                f"| {_num(s['prefill_tokens_per_s'])} | {_num(s['decode_tokens_per_s'])} "
                f"| {_ms(s['ttft']['p50'])} / {_ms(s['ttft']['p99'])} "
                f"| {_ms(s['tpot']['p50'])} / {_ms(s['tpot']['p99'])} | {_ms(s['itl']['p99'])} "
                f"| {_ms(s['e2e']['p99'])} | {_num(good * 100 if good is not None else None, '{:.0f}%')} "
                f"| {errors} | {_num(rss / 2**20 if rss else None, '{:.0f}')} "
                f"| {_num(mem.get('plan_over_peak_rss'), '{:.2f}')} |"
            )
    return "\n".join(lines)


_EMBED_HEAD = (
    "| engine | batch | texts/s | tokens/s | calls/s | latency p50 / p90 / p99 ms | ms per text p50 "
    "| errors | peak RSS MiB |"
)


def _embed_table(results: Sequence[dict[str, Any]]) -> str:
    lines = [_EMBED_HEAD, "|" + "---|" * _EMBED_HEAD.count(" | ") + "---|"]
    for result in results:
        name = label(result) + (" (partial)" if result.get("partial") else "")
        for level in result["levels"]:
            s = level["summary"]
            lat = s["latency"]
            rss = level["memory"].get("peak_rss_bytes")
            errors = ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "0"
            lines.append(
                f"| {name} | {level['value']:g} | {_num(s['texts_per_s'])} | {_num(s['tokens_per_s'])} "
                f"| {_num(s['calls_per_s'], '{:.2f}')} "
                f"| {_ms(lat['p50'])} / {_ms(lat['p90'])} / {_ms(lat['p99'])} "
                f"| {_ms(s['latency_per_text']['p50'])} | {errors} "
                f"| {_num(rss / 2**20 if rss else None, '{:.0f}')} |"
            )
    return "\n".join(lines)


def _records(level: dict[str, Any]) -> list[Any]:
    from unillm.bench._metrics import RequestRecord

    return [RequestRecord.from_dict(r) for r in level["records"]]


def plot_title(results: Sequence[dict[str, Any]]) -> str:
    """What a figure shows, on two lines: the model and the engines; the machine and the date."""
    meta = results[0]["metadata"] if results else {}
    model = (meta.get("model") or {}).get("name") or "model unknown"
    engines = ", ".join(dict.fromkeys(label(r) for r in results)) or "no engine"
    hw = meta.get("hardware") or {}
    gpus = hw.get("gpus") or ()
    device = (
        f"{len(gpus)} x {gpus[0].get('name', 'GPU')}" if gpus
        else f"{hw.get('cpu_model') or 'CPU unknown'}, {hw.get('cpu_cores', '?')} CPUs"
    )  # fmt: skip
    date = str(meta.get("date") or "")[:10] or "date unknown"
    return f"{model} on {engines}\n{device} ({hw.get('os', '?')} {hw.get('arch', '?')}), {date}"


def plot(results: Sequence[dict[str, Any]], directory: str | Path, *, stem: str = "bench") -> list[Path]:
    """Write ``STEM-cdf.png`` (latency CDFs, one line per engine and level) and, when the results
    sweep more than one level, ``STEM-sweep.png`` (output tok/s and p99 TTFT against the level,
    one line per engine); the paths written. Each figure is titled with the model, the engines,
    the machine and the date (``plot_title``), each axis with its unit. Embedding results are
    drawn apart (``STEM-embed.png``: texts/s and latency against the batch size)."""
    embeds = [r for r in results if r.get("task") == "embed"]
    if embeds:
        rest = [r for r in results if r.get("task") != "embed"]
        return _plot_embed(embeds, directory, stem=stem) + (plot(rest, directory, stem=stem) if rest else [])
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for result in results:
        for level in result["levels"]:
            records = _records(level)
            kind = "c" if level["kind"] == "concurrency" else "rate"
            name = f"{label(result)} {kind}={level['value']:g}"
            for ax, metric in zip(axes, ("ttft", "tpot", "e2e"), strict=True):
                xs = sorted(v * 1000 for r in records if (v := getattr(r, metric)) is not None)
                if xs:
                    ys = [(i + 1) / len(xs) for i in range(len(xs))]
                    ax.step(xs, ys, where="post", label=name)
    for ax, metric in zip(axes, ("TTFT", "TPOT", "E2E"), strict=True):
        ax.set_xlabel(f"{metric} (ms)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"{metric} CDF")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(plot_title(results), fontsize=10)
    fig.tight_layout()
    path = out_dir / f"{stem}-cdf.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)

    if any(len(r["levels"]) > 1 for r in results):
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
        for result in results:
            xs = [lv["value"] for lv in result["levels"]]
            left.plot(
                xs,
                [lv["summary"]["output_tokens_per_s"] or 0 for lv in result["levels"]],
                "o-",
                label=label(result),
            )
            right.plot(
                xs,
                [(lv["summary"]["ttft"]["p99"] or 0) * 1000 for lv in result["levels"]],
                "o-",
                label=label(result),
            )
        kind = results[0]["levels"][0]["kind"]
        for ax, title, unit in ((left, "output tok/s", "tokens/s"), (right, "p99 TTFT (ms)", "ms")):
            ax.set_xlabel(
                "concurrency (requests at once)" if kind == "concurrency" else "request rate (req/s)"
            )
            ax.set_ylabel(unit)
            ax.set_title(title)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(plot_title(results), fontsize=10)
        fig.tight_layout()
        path = out_dir / f"{stem}-sweep.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def _plot_embed(results: Sequence[dict[str, Any]], directory: str | Path, *, stem: str) -> list[Path]:
    """``STEM-embed.png``: texts/s and call latency (p50, p99) against the batch size, a line per
    engine; the paths written (none without results)."""
    if not results:
        return []
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for result in results:
        xs = [lv["value"] for lv in result["levels"]]
        sums = [lv["summary"] for lv in result["levels"]]
        left.plot(xs, [s["texts_per_s"] or 0 for s in sums], "o-", label=label(result))
        for p, style in (("p50", "o-"), ("p99", "x--")):
            ys = [(s["latency"][p] or 0) * 1000 for s in sums]
            right.plot(xs, ys, style, label=f"{label(result)} {p}")
    sizes = sorted({lv["value"] for r in results for lv in r["levels"]})
    for ax, title, unit in ((left, "texts/s", "texts/s"), (right, "call latency (ms)", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [f"{x:g}" for x in sizes])
        ax.set_xlabel("batch size (texts per call)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(plot_title(results), fontsize=10)
    fig.tight_layout()
    path = out_dir / f"{stem}-embed.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]
