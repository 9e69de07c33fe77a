"""llama.cpp's own llama-server, in process through xllamacpp: the peer of ``unillm serve`` on
llama.cpp with continuous batching. Run with the Python of xllamacpp's own environment
(``scripts/xllamacpp.sh`` builds it); it serves until killed.

    python _xllamacpp_server.py MODEL.gguf --port N [--parallel 8] [--context 1024] [--threads 2]
"""

from __future__ import annotations

import argparse
import signal
import threading

import xllamacpp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--alias", default="tiny")
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024, help="tokens per slot")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    p = xllamacpp.CommonParams()
    p.model.path = args.model
    p.model_alias = args.alias
    p.n_parallel = args.parallel
    p.n_ctx = args.context * args.parallel  # llama-server splits n_ctx among its slots
    p.cont_batching = True
    p.n_batch = 512
    p.n_ubatch = 512
    p.cpuparams.n_threads = args.threads
    p.cpuparams_batch.n_threads = args.threads
    p.port = args.port
    p.hostnames = ["127.0.0.1"]
    p.warmup = False
    server = xllamacpp.Server(p)
    print(f"listening on {server.listening_address}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()


if __name__ == "__main__":
    main()
