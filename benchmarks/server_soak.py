"""A long soak of ``unillm serve``: many streaming clients for minutes, some hanging up early,
some reading nothing at all; what is lost, how memory moves, and whether /metrics agrees.

    python benchmarks/server_soak.py [--minutes 10] [--clients 64] [--model tiny.gguf]

The server runs the tiny bench model (built if missing) unless ``--model`` names another. Each of
``--clients`` clients sends streaming completions one after another: most read to ``[DONE]``,
``--cut`` of them hang up after a few events, and ``--stall`` of them stop reading after the first
event for longer than the server's ``write_timeout_s`` (5 s here): the server cuts off one whose
answer outgrew the connection's buffers (the system's: on loopback they hold a few MB, so most
answers fit), and one that fit is found whole when the client reads on.
A request is **lost** when it is none of: read whole (``[DONE]`` after a finish reason, read at
once or after the stall), hung up by its client, cut off by the server for stalling, or refused in
the protocol (429/503 JSON). The server's RSS is sampled
every 10 s. At the end the client's counts are set beside the server's /metrics. Results go to
``benchmarks/results-server-soak.json`` with the machine they were measured on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from _common import ROOT, checkout_unillm, machine

RESULTS = ROOT / "benchmarks" / "results-server-soak.json"
WRITE_TIMEOUT_S = 5
# how long a stalling client stops reading: past the write timeout, counted from when the buffers
# are full, which a large answer reaches only after some seconds of generation
STALL_S = 60
# silence (no byte) for this long ends a request as lost: past a stall, a queue wait and a prefill
SILENT_S = 180


def _metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _sum(samples: dict[str, float], name: str, **labels: str) -> float:
    return sum(
        v for k, v in samples.items()
        if k.partition("{")[0] == name and all(f'{a}="{b}"' in k for a, b in labels.items())
    )  # fmt: skip


def _rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return int(found[1]) if found else 0


async def _one(client: httpx.AsyncClient, url: str, kind: str, rng: random.Random) -> str:
    path, body = "/v1/completions", {
        "model": "soak", "prompt": f"Soak {rng.randrange(10**6)}", "temperature": 0.8,
        "max_tokens": rng.choice([16, 64, 256]), "stream": True, "ignore_eos": True,
    }  # fmt: skip
    if kind == "stall" and rng.random() < 0.5:
        # half of them an answer of several MB (20 alternatives a token), more than the loopback's
        # buffers hold: the server must cut it off
        path, body = "/v1/chat/completions", {
            "model": "soak", "messages": [{"role": "user", "content": body["prompt"]}], "temperature": 0.8,
            "max_tokens": 1900, "stream": True, "ignore_eos": True, "logprobs": True, "top_logprobs": 20,
        }  # fmt: skip
    events, stalled = 0, False
    try:
        async with client.stream("POST", url + path, json=body) as resp:
            if resp.status_code in (429, 503):
                return "refused"
            if resp.status_code != 200:
                return f"http {resp.status_code}"
            finished = False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                if kind == "cut" and events == 3:
                    return "cut by client"
                if kind == "stall" and events == 1:
                    # stop reading past the write timeout: an answer larger than the connection's
                    # buffers is cut off by the server; a smaller one is already all in them
                    await asyncio.sleep(STALL_S)
                    stalled = True
                if line == "data: [DONE]":
                    if not finished:
                        return "done without a finish"
                    return "delivered while unread" if stalled else "whole"
                event = json.loads(line[6:])
                if "error" in event:
                    return "error event"
                if any(c.get("finish_reason") for c in event.get("choices", ())):
                    finished = True
            return "cut by server" if kind == "stall" else "ended early"
    except httpx.ReadTimeout:  # nothing at all for SILENT_S: a hang, whatever the kind
        return f"silent for {SILENT_S} s"
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return "cut by server" if kind == "stall" else "connection lost"


async def _client(url: str, until: float, seed: int, cut: float, stall: float, out: Counter[str]) -> None:
    rng = random.Random(seed)
    # a request is bounded by silence, not by its length: a 1,900-token answer with 20 alternatives a
    # token takes minutes under 64 clients on two cores, and is not lost while its bytes come
    timeout = httpx.Timeout(120, read=SILENT_S)
    # A stalling client's socket has the system's buffers. With a 4 KiB receive buffer (as this
    # script once set, to keep the unread answer with the server) loopback's 64 KiB segments starve
    # the connection in the kernel: measured alone, a 2.6 MB answer sat whole in the server's socket
    # (the server done, its slot free) and reached the client at ~20 KB/s, under load with silences
    # past 180 s; that measured the client's socket, not the server.
    async with httpx.AsyncClient(timeout=timeout) as client:
        while time.monotonic() < until:
            roll = rng.random()
            kind = "stall" if roll < stall else "cut" if roll < stall + cut else "whole"
            got = await _one(client, url, kind, rng)
            out[(kind, got)] += 1  # type: ignore[index]


async def _soak(url: str, pid: int, minutes: float, clients: int, cut: float, stall: float) -> dict[str, Any]:
    out: Counter[Any] = Counter()
    until = time.monotonic() + minutes * 60
    rss: list[tuple[float, int]] = []
    t0 = time.monotonic()

    async def sample() -> None:
        while time.monotonic() < until:
            rss.append((round(time.monotonic() - t0, 1), _rss_kib(pid)))
            await asyncio.sleep(10)

    sampler = asyncio.ensure_future(sample())
    await asyncio.gather(*(_client(url, until, i, cut, stall, out) for i in range(clients)))
    sampler.cancel()
    rss.append((round(time.monotonic() - t0, 1), _rss_kib(pid)))
    return {"outcomes": {f"{k[0]}: {k[1]}": v for k, v in sorted(out.items())}, "rss_kib": rss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--cut", type=float, default=0.10, help="share of requests the client hangs up")
    ap.add_argument("--stall", type=float, default=0.01, help="share of requests that stop reading")
    ap.add_argument("--model", help="a .gguf to serve (default: the tiny bench model)")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from unillm.testing import tiny_model

        model = str(tiny_model("bench").gguf_path)
    cmd, env = checkout_unillm()
    log = Path(tempfile.mkdtemp(prefix="unillm-soak-")) / "server.log"
    argv = [*cmd, "serve", model, "--alias", "soak", "--port", "0", "--context", "2048",
            "--write-timeout", str(WRITE_TIMEOUT_S), "--max-queue", str(args.clients)]  # fmt: skip
    with log.open("wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True)  # fmt: skip
    try:
        url = None
        deadline = time.monotonic() + 300
        while url is None and time.monotonic() < deadline:
            found = re.search(r"listening on (http://\S+)/v1", log.read_text(errors="replace"))
            if found:
                try:
                    if httpx.get(found[1] + "/ready", timeout=5).status_code == 200:
                        url = found[1]
                except httpx.TransportError:
                    pass
            time.sleep(0.5)
        if url is None:
            sys.exit(f"the server did not start:\n{log.read_text(errors='replace')[-3000:]}")
        before = _metrics(url)
        result = asyncio.run(_soak(url, proc.pid, args.minutes, args.clients, args.cut, args.stall))
        after = _metrics(url)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    outcomes: dict[str, int] = result["outcomes"]
    expected = ("whole: whole", "cut: cut by client", "stall: cut by server", "stall: delivered while unread")
    lost = sum(n for k, n in outcomes.items() if k not in expected and not k.endswith(": refused"))
    server = {
        name: _sum(after, metric, **labels) - _sum(before, metric, **labels)
        for name, (metric, labels) in {
            "finished stop/length": ("unillm:request_success_total", {}),
            "aborted": ("unillm:request_success_total", {"finished_reason": "abort"}),
            "stalled clients cut off": ("unillm:stalled_clients_total", {}),
            "answered 429": ("unillm:requests_total", {"status": "429"}),
        }.items()
    }
    server["finished stop/length"] -= server["aborted"]
    rss = result["rss_kib"]
    report = {
        "machine": machine("llama-cpp-python"),
        "settings": vars(args) | {"model": model, "write_timeout_s": WRITE_TIMEOUT_S, "stall_s": STALL_S},
        "client": outcomes,
        "lost": lost,
        "server_metrics": server,
    }
    memory = {
        "first": round(rss[0][1] / 1024, 1),
        "last": round(rss[-1][1] / 1024, 1),
        "max": round(max(r for _, r in rss) / 1024, 1),
    }
    RESULTS.write_text(json.dumps(report | {"rss_mib": memory | {"samples": rss}}, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "machine"} | {"rss_mib": memory}, indent=1))
    print(f"lost: {lost}  (written to {RESULTS.relative_to(ROOT)})")


if __name__ == "__main__":
    main()
