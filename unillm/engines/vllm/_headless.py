"""Headless workers for vLLM's own multi-node path (``nnodes`` > 1, the "mp" executor on every node,
no Ray): a node other than node 0 runs its share of the ranks and nothing else (no engine front end,
no HTTP server) until SIGINT or SIGTERM. ``unillm serve MODEL --backend vllm --option nnodes=N
--option node_rank=R --option master_addr=... --headless`` calls ``run_headless``; node 0 loads the
engine as usual (``load_engine``, or ``unillm serve`` without ``--headless``).

The workers take node 0's engine arguments, computed by the same code from the same config (model,
dtype, sizes, context, KV space), with only ``node_rank`` their own; each node binds its own ranks'
cores. This mirrors ``vllm serve --headless`` (vllm/entrypoints/cli/serve.py, ``run_headless``): the
ranks of a model split over nodes run in a ``MultiprocExecutor`` that meets node 0's at
``master_addr:master_port``; whole data-parallel replicas run as engine cores that reach node 0's
front end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from unillm import BackendUnavailable, ConfigError, ModelLoadError
from unillm.engines.vllm._args import model_dir
from unillm.engines.vllm._parallel import CPU_BIND_VAR
from unillm.engines.vllm._start import _environment

if TYPE_CHECKING:
    from unillm import EngineConfig

__all__ = ["run_headless"]

log = logging.getLogger("unillm.vllm")
_DOCS = "docs/backends/vllm-scale-out.md"


def run_headless(config: EngineConfig) -> None:
    """Run this node's vLLM workers for ``config`` (backend "vllm", ``nnodes`` > 1, ``node_rank``
    > 0) until SIGINT or SIGTERM, or until they end (node 0 gone); then stop them.

    :param config: the same engine config as node 0's, but for ``node_rank``.
    :raises ConfigError: for another backend, a config that is not a worker node's, or sizes vLLM
        would refuse.
    :raises BackendUnavailable: when vLLM is not installed or cannot run here.
    :raises ModelLoadError: when vLLM fails to start the workers.
    """
    from unillm.engines.vllm import VLLMEngine

    if re.sub(r"[^a-z0-9]", "", (config.backend or "").lower()) != "vllm":  # the registry's spelling rule
        raise ConfigError(
            f"--headless runs the worker ranks of vLLM's multi-node path, and the backend is "
            f"{config.backend or 'not given'}: add --backend vllm ({_DOCS})"
        )
    engine = VLLMEngine(config)  # the options validated: node_rank < nnodes
    opts = engine.options
    if opts.nnodes < 2 or opts.node_rank == 0:
        raise ConfigError(
            f"--headless is for the worker nodes (node_rank 1 to nnodes-1), and this is node_rank="
            f"{opts.node_rank} of nnodes={opts.nnodes}: node 0 serves, so run it without --headless, "
            f"and the others with --option nnodes=N --option node_rank=R ({_DOCS})"
        )
    avail = engine.available()
    if not avail.available:
        raise BackendUnavailable("vllm", avail.reason, avail.install_hint)
    path, facts = model_dir(config.model, engine.facts)
    # node 0's arguments (the same code, the same config), then this node's rank: ranks that
    # disagree on the model, dtype or sizes would wait for one another for ever
    engine.options = opts.model_copy(update={"node_rank": 0})
    args = {**engine._engine_args(path, facts), "node_rank": opts.node_rank}
    env = engine.parallel.engine_env() if engine.parallel is not None else {}
    if CPU_BIND_VAR in os.environ:
        env = {}  # the user's own binding wins
    for note in engine._notes:
        log.info("vllm: %s", note)
    with _environment(env), _stop_on_signals():
        _run(args, opts.node_rank, avail.install_hint or engine.install_hint)


def _run(args: dict[str, Any], rank: int, hint: str | None) -> None:
    """Start this node's share of vLLM's ranks and wait on them (vLLM's ``run_headless``)."""
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    except ImportError as exc:
        raise BackendUnavailable("vllm", f"vllm failed to import: {exc}", hint) from exc
    try:
        vllm_config = AsyncEngineArgs(**args).create_engine_config(
            usage_context=UsageContext.OPENAI_API_SERVER, headless=True
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"vLLM refuses the engine arguments: {exc}") from exc
    parallel = vllm_config.parallel_config
    where = f"{parallel.master_addr}:{parallel.master_port}"
    print(
        f"unillm serve --headless: node {rank} of {parallel.nnodes}, {parallel.local_world_size} vLLM "
        f"rank(s) here, meeting node 0 at {where}; stop with Ctrl-C or SIGTERM",
        file=sys.stderr,
        flush=True,
    )
    if parallel.node_rank_within_dp > 0:  # a share of one model's ranks
        try:
            executor = MultiprocExecutor(vllm_config, monitor_workers=False)
        except Exception as exc:
            raise ModelLoadError(f"vLLM's workers on node {rank} failed to start: {exc}") from exc
        try:
            executor.start_worker_monitor(inline=True)  # returns when a worker ends
        finally:
            executor.shutdown()
        return
    # whole data-parallel replicas: their engine cores, which reach node 0's front end
    from vllm.utils.network_utils import get_tcp_uri
    from vllm.v1.engine.utils import CoreEngineProcManager
    from vllm.v1.executor import Executor

    try:
        manager = CoreEngineProcManager(
            local_engine_count=parallel.data_parallel_size_local,
            start_index=parallel.data_parallel_rank,
            local_start_index=0,
            vllm_config=vllm_config,
            local_client=False,
            handshake_address=get_tcp_uri(parallel.data_parallel_master_ip, parallel.data_parallel_rpc_port),
            executor_class=Executor.get_class(vllm_config),
            log_stats=False,
        )
    except Exception as exc:
        raise ModelLoadError(f"vLLM's engine cores on node {rank} failed to start: {exc}") from exc
    try:
        manager.monitor_engine_liveness()
    finally:
        manager.shutdown(timeout=vllm_config.shutdown_timeout)


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM end the wait (SystemExit, once), so that the ``finally`` blocks stop the
    worker processes; the previous handlers come back afterwards."""
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise SystemExit(0)

    saved = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
