"""vLLM's parallel sizes: what unillm chooses on NVLink and PCIe boxes, what it refuses and what each
refusal says to do next. Pure data: hardware profiles and ModelInfo literals, no engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from unillm._errors import ConfigError
from unillm._hardware import GPU, Hardware, load_hardware
from unillm._inspect import ModelInfo
from unillm.engines.vllm._parallel import ParallelPlan, plan_parallel

GiB = 2**30
PROFILES = Path(__file__).parent / "profiles"
H100X8 = load_hardware(PROFILES / "h100-8x-nvlink.json")  # 80 GB, NVSwitch: every pair linked
RTX4090X4 = load_hardware(PROFILES / "rtx4090-4x-pcie.json")  # 24 GB, PCIe only
MI300X8 = load_hardware(PROFILES / "mi300x-8x.json")  # 192 GB, xGMI between all
LAPTOP = load_hardware(PROFILES / "laptop-8gb-cpu.json")  # no GPU


def box(n: int, gib: int = 24, nvlink: tuple[tuple[int, int], ...] = ()) -> Hardware:
    gpus = tuple(GPU(i, "nvidia", "NVIDIA RTX A5000", gib * GiB) for i in range(n))
    return Hardware("Linux", "x86_64", cpu_cores=32, gpus=gpus, nvlink=nvlink)


PAIRS = box(4, nvlink=((0, 1), (2, 3)))  # NVLink bridges on two pairs, PCIe between them
ALL8 = box(8, nvlink=tuple((a, b) for a in range(8) for b in range(a + 1, 8)))


def model(heads: int = 32, kv: int = 8, layers: int = 32, gib: float = 15.0) -> ModelInfo:
    return ModelInfo(
        "/models/m", "safetensors", heads=heads, kv_heads=kv, layers=layers, weights_bytes=int(gib * GiB)
    )


LLAMA_8B = model()  # 32 heads, 8 KV heads, 32 layers
LLAMA_70B = model(heads=64, kv=8, layers=80, gib=131.4)


def plan(**kw: Any) -> ParallelPlan:
    kw.setdefault("device", "cuda")
    kw.setdefault("hardware", H100X8)
    kw.setdefault("model", LLAMA_8B)
    return plan_parallel(**kw)


def sizes(p: ParallelPlan) -> tuple[int, int, int]:
    return p.tensor_parallel_size, p.pipeline_parallel_size, p.data_parallel_size


def noted(p: ParallelPlan, *words: str) -> bool:
    return any(all(w in note for w in words) for note in p.notes)


# -- the plan value -----------------------------------------------------------------------------


def test_engine_args_are_the_vllm_keywords_exactly() -> None:
    p = ParallelPlan(4, 2, 3)
    assert p.world_size == 8
    assert p.engine_args() == {
        "tensor_parallel_size": 4,
        "pipeline_parallel_size": 2,
        "data_parallel_size": 3,
    }
    assert ParallelPlan(8, 2, 1, "ray").engine_args() == {
        "tensor_parallel_size": 8,
        "pipeline_parallel_size": 2,
        "data_parallel_size": 1,
        "distributed_executor_backend": "ray",
    }
    assert ParallelPlan(2, 1, 1, "mp").engine_args()["distributed_executor_backend"] == "mp"


def test_nothing_given_and_it_fits_one_gpu_is_one_gpu_without_notes() -> None:
    assert plan() == ParallelPlan(1, 1, 1, None, ())
    assert plan(hardware=RTX4090X4) == ParallelPlan(1, 1, 1, None, ())


def test_module_imports_nothing_heavy() -> None:
    probe = "import sys, json, unillm.engines.vllm._parallel; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    loaded = {m.split(".")[0] for m in json.loads(out.stdout)}
    # the engine's package loads the kit (and with it pydantic), as every engine module does since
    # engines are packages; what planning the layout must never load is the engine or numpy
    assert not loaded & {"vllm", "torch", "ray", "numpy"}


# -- sizes the user gives -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "num_gpus"]
)
@pytest.mark.parametrize("value", [0, -2])
def test_sizes_below_one_are_refused(name: str, value: int) -> None:
    with pytest.raises(ConfigError, match=rf"{name} must be 1 or more, not {value}; 1 means no"):
        plan(**{name: value})


@pytest.mark.parametrize("other", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_num_gpus_with_an_explicit_size_says_pick_one(other: str) -> None:
    with pytest.raises(ConfigError, match=r"num_gpus cannot be combined with .*: pick one") as info:
        plan(num_gpus=4, **{other: 2})
    assert "num_gpus=N to let unillm choose" in str(info.value)
    assert "or the sizes themselves" in str(info.value)


def test_explicit_sizes_are_kept() -> None:
    p = plan(tensor_parallel_size=4, pipeline_parallel_size=2)
    assert sizes(p) == (4, 2, 1)
    assert p.world_size == 8
    assert p.distributed_executor is None
    assert noted(p, "8 GPUs on one machine", "'mp'")
    assert not noted(p, "without NVLink")  # NVSwitch: nothing to warn about


@pytest.mark.parametrize(
    ("hw", "gpus", "works"), [(H100X8, 8, "1, 2, 4, 8 (on the 8 GPUs here)"), (RTX4090X4, 4, "1, 2, 4 (on")]
)
def test_tp_must_divide_the_attention_heads(hw: Hardware, gpus: int, works: str) -> None:
    with pytest.raises(ConfigError) as info:
        plan(hardware=hw, tensor_parallel_size=3)
    msg = str(info.value)
    assert "tensor_parallel_size=3 does not divide the model's 32 attention heads" in msg
    assert f"use one of {works}" in msg
    assert "pipeline_parallel_size" in msg  # the way out that has no such rule


def test_tp_and_kv_heads_must_divide_one_another() -> None:
    odd = model(heads=12, kv=3, layers=24)
    with pytest.raises(ConfigError) as info:
        plan(model=odd, tensor_parallel_size=2)
    msg = str(info.value)
    assert "the model's 3 KV heads" in msg
    assert "use one of 1, 3, 6 (on the 8 GPUs here)" in msg  # 2 and 4 divide 12 but not 3
    assert sizes(plan(model=odd, tensor_parallel_size=6)) == (6, 1, 1)  # KV heads replicated
    assert sizes(plan(model=odd, tensor_parallel_size=3)) == (3, 1, 1)


def test_pp_cannot_exceed_the_layers() -> None:
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=33 is more than the model's 32 layers"):
        plan(pipeline_parallel_size=33, distributed_executor="ray")
    with pytest.raises(ConfigError, match=r"use at most 32"):
        plan(pipeline_parallel_size=40, distributed_executor="ray")
    assert sizes(plan(pipeline_parallel_size=8)) == (1, 8, 1)


def test_more_gpus_than_the_machine_has_names_the_count_and_ray() -> None:
    with pytest.raises(ConfigError) as info:
        plan(tensor_parallel_size=4, data_parallel_size=4)
    msg = str(info.value)
    assert "4 x 1 x 4 = 16 GPUs, but this machine has 8" in msg
    assert "at most 8" in msg
    assert "distributed_executor='ray'" in msg
    assert "vllm-scale-out.md" in msg
    with pytest.raises(ConfigError, match=r"this machine has 4"):
        plan(hardware=RTX4090X4, pipeline_parallel_size=8)


def test_num_gpus_above_the_machine_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"num_gpus=5, but this machine has 4 GPUs: ask for at most 4"):
        plan(hardware=RTX4090X4, num_gpus=5)


def test_a_machine_whose_gpus_were_not_detected_still_runs_one() -> None:
    blind = Hardware("Linux", "x86_64")  # nvidia-smi missing in the container, say
    assert sizes(plan(hardware=blind)) == (1, 1, 1)
    with pytest.raises(ConfigError, match=r"this machine has 0"):
        plan(hardware=blind, tensor_parallel_size=2)


def test_data_parallel_replicas_are_noted() -> None:
    p = plan(tensor_parallel_size=2, data_parallel_size=4)
    assert sizes(p) == (2, 1, 4)
    assert p.world_size == 2
    assert noted(p, "data_parallel_size=4", "4 replicas", "each on 2")


# -- tensor parallelism without NVLink ------------------------------------------------------------


def test_explicit_tp_over_pcie_is_honoured_with_a_note() -> None:
    p = plan(hardware=RTX4090X4, tensor_parallel_size=4)
    assert sizes(p) == (4, 1, 1)
    assert noted(p, "tensor_parallel_size=4 over GPUs without NVLink", "honoured", "pipeline_parallel_size=4")


def test_explicit_tp_within_nvlinked_pairs_is_not_flagged() -> None:
    assert not noted(plan(hardware=PAIRS, tensor_parallel_size=2, pipeline_parallel_size=2), "without NVLink")
    assert noted(plan(hardware=PAIRS, tensor_parallel_size=4), "without NVLink")


# -- unillm chooses: num_gpus -------------------------------------------------------------------


def test_num_gpus_on_nvlink_is_tensor_parallel() -> None:
    p = plan(num_gpus=4)
    assert sizes(p) == (4, 1, 1)
    assert noted(p, "NVLink joins the 4 GPUs", "tensor_parallel_size=4")


def test_num_gpus_over_pcie_is_pipeline_parallel() -> None:
    p = plan(hardware=RTX4090X4, num_gpus=4)
    assert sizes(p) == (1, 4, 1)
    assert noted(p, "no NVLink between the 4 GPUs: pipeline_parallel_size=4 instead of tensor parallelism")
    assert noted(p, "all-reduces every layer")


def test_num_gpus_on_amd_speaks_of_xgmi() -> None:
    p = plan(device="rocm", hardware=MI300X8, num_gpus=8)
    assert sizes(p) == (8, 1, 1)
    assert noted(p, "xGMI joins the 8 GPUs")


def test_num_gpus_that_the_heads_do_not_divide_adds_pipeline_stages() -> None:
    p = plan(num_gpus=6)  # 32 heads: 6 and 3 do not divide them, 2 does
    assert sizes(p) == (2, 3, 1)
    assert noted(p, "tensor_parallel_size=2", "32 attention heads", "pipeline_parallel_size=3")


def test_num_gpus_over_nvlinked_pairs_is_tp_within_pipeline_between() -> None:
    p = plan(hardware=PAIRS, num_gpus=4)
    assert sizes(p) == (2, 2, 1)
    assert noted(p, "NVLink joins the GPUs only in groups of 2")


def test_heads_that_allow_no_split_give_pipeline_stages() -> None:
    p = plan(model=model(heads=7, kv=7, layers=28), num_gpus=2)
    assert sizes(p) == (1, 2, 1)
    assert noted(p, "no tensor-parallel size above 1 divides both the 2 GPUs and the model's 7")


def test_num_gpus_without_hardware_or_model_skips_those_checks() -> None:
    p = plan(hardware=None, num_gpus=4)
    assert sizes(p) == (4, 1, 1)  # vLLM's advice within one machine, links unknown
    assert noted(p, "links between the GPUs are not known", "pipeline_parallel_size=4 instead")
    assert sizes(plan(hardware=RTX4090X4, model=None, num_gpus=4)) == (1, 4, 1)
    assert sizes(plan(hardware=None, model=None, num_gpus=16)) == (16, 1, 1)


def test_without_hardware_or_model_explicit_sizes_go_unchecked() -> None:
    p = plan(hardware=None, model=None, tensor_parallel_size=3, pipeline_parallel_size=200)
    assert sizes(p) == (3, 200, 1)
    assert sizes(plan(model=None, tensor_parallel_size=3)) == (3, 1, 1)  # heads unknown: not checked
    with pytest.raises(ConfigError, match=r"this machine has 8"):
        plan(model=None, tensor_parallel_size=16)


# -- unillm chooses: the weights do not fit one GPU ----------------------------------------------


def test_big_weights_on_nvlink_take_the_fewest_gpus_tensor_parallel() -> None:
    p = plan(model=LLAMA_70B)  # 131.4 GiB; an H100 holds 79.6 GiB, 71.7 of it for weights
    assert sizes(p) == (2, 1, 1)
    assert noted(p, "the weights (131.4 GiB) do not fit one GPU (79.6 GiB): spread over 2 GPUs")
    assert noted(p, "NVLink joins the 2 GPUs")


def test_big_weights_over_pcie_are_pipelined() -> None:
    p = plan(hardware=RTX4090X4, model=model(gib=40.0))  # 24 GiB GPUs, 21.6 for weights: 2 of them
    assert sizes(p) == (1, 2, 1)
    assert noted(p, "spread over 2 GPUs")
    assert noted(p, "no NVLink between the 2 GPUs: pipeline_parallel_size=2")


def test_gpu_count_rises_to_one_tensor_parallelism_can_use() -> None:
    p = plan(hardware=ALL8, model=LLAMA_70B)  # 7 x 21.6 GiB would hold it, but 7 does not divide 64
    assert sizes(p) == (8, 1, 1)
    assert noted(p, "spread over 7 GPUs")
    assert noted(p, "8 GPUs rather than 7", "64 attention heads")


def test_weights_too_big_for_every_gpu_say_how_big_in_gib() -> None:
    with pytest.raises(ConfigError) as info:
        plan(hardware=RTX4090X4, model=LLAMA_70B)
    msg = str(info.value)
    assert "the weights (131.4 GiB) do not fit even on all 4 GPUs (96.0 GiB, 86.4 GiB with ~10%" in msg
    assert "smaller quantization" in msg
    assert "distributed_executor='ray'" in msg


def test_explicit_sizes_turn_the_weights_check_off() -> None:
    assert sizes(plan(model=LLAMA_70B, tensor_parallel_size=8)) == (8, 1, 1)
    assert sizes(plan(hardware=RTX4090X4, model=LLAMA_70B, pipeline_parallel_size=4)) == (1, 4, 1)


# -- several machines: Ray -----------------------------------------------------------------------


def test_ray_spans_machines_without_counting_local_gpus() -> None:
    p = plan(model=LLAMA_70B, tensor_parallel_size=8, pipeline_parallel_size=2, distributed_executor="ray")
    assert sizes(p) == (8, 2, 1)
    assert p.engine_args() == {
        "tensor_parallel_size": 8,
        "pipeline_parallel_size": 2,
        "data_parallel_size": 1,
        "distributed_executor_backend": "ray",
    }
    assert noted(p, "the Ray cluster must provide 8 x 2 x 1 = 16 GPUs", "`ray status`")
    assert not noted(p, "'mp'")


def test_ray_without_hardware_is_fine() -> None:
    p = plan(hardware=None, tensor_parallel_size=4, pipeline_parallel_size=4, distributed_executor="ray")
    assert sizes(p) == (4, 4, 1)
    assert noted(p, "16 GPUs")


def test_ray_tensor_parallelism_across_machines_is_noted() -> None:
    p = plan(tensor_parallel_size=16, distributed_executor="ray", model=LLAMA_70B)
    assert noted(p, "tensor_parallel_size=16 is more than this machine's 8 GPUs", "pipeline_parallel_size")


def test_ray_num_gpus_over_several_machines_keeps_tp_within_one() -> None:
    p = plan(model=LLAMA_70B, num_gpus=16, distributed_executor="ray")
    assert sizes(p) == (8, 2, 1)  # tensor parallel within each 8-GPU machine, 2 stages between
    assert noted(p, "tensor_parallel_size=8 within each machine, pipeline_parallel_size=2 stages between")


def test_ray_tp_groups_never_straddle_two_machines() -> None:
    six = box(6, nvlink=tuple((a, b) for a in range(6) for b in range(a + 1, 6)))
    p = plan(hardware=six, num_gpus=12, distributed_executor="ray")  # 4 divides 32 and 12, not 6
    assert sizes(p) == (2, 6, 1)
    assert noted(p, "tensor_parallel_size=2 within each machine, pipeline_parallel_size=6")


def test_ray_still_checks_the_model() -> None:
    with pytest.raises(ConfigError, match=r"use one of 1, 2, 4, 8, 16, 32\b"):
        plan(tensor_parallel_size=12, distributed_executor="ray")  # no GPU limit: every size to 32


def test_explicit_mp_is_passed_on_without_the_default_note() -> None:
    p = plan(tensor_parallel_size=2, distributed_executor="mp")
    assert p.engine_args()["distributed_executor_backend"] == "mp"
    assert not noted(p, "left to vLLM")
    assert noted(plan(tensor_parallel_size=2), "left to vLLM", "'mp'")


# -- CPU ---------------------------------------------------------------------------------------


def test_cpu_tp_splits_the_cores_into_mp_ranks() -> None:
    p = plan(device="cpu", hardware=LAPTOP, tensor_parallel_size=2, cpu_ids=range(8))
    assert sizes(p) == (2, 1, 1)
    assert p.distributed_executor == "mp"  # vLLM could pick Ray, which its CPU platform refuses
    assert p.cpu_threads_bind == "0-3|4-7"
    assert p.engine_env() == {"VLLM_CPU_OMP_THREADS_BIND": "0-3|4-7"}
    assert p.engine_args()["distributed_executor_backend"] == "mp"
    assert noted(p, "on CPU tensor parallelism splits the cores", "2 worker process(es)", "cores 0-3 | 4-7")
    assert plan(device="cpu", hardware=LAPTOP, model=LLAMA_70B) == ParallelPlan()  # no GPU to fit


@pytest.mark.parametrize(
    ("ranks", "cores", "bind"),
    [
        (2, [0, 1], "0|1"),  # the measured layout of a 2-core machine
        (2, [0, 1, 2], "0|1"),  # the odd core stays free for the serving process
        (4, range(16), "0-3|4-7|8-11|12-15"),
        (2, [0, 2, 4, 6, 8, 9], "0,2,4|6,8-9"),  # an affinity mask with holes
    ],
)
def test_cpu_binding_gives_each_rank_its_own_cores(ranks: int, cores: Any, bind: str) -> None:
    p = plan(device="cpu", hardware=None, model=None, tensor_parallel_size=ranks, cpu_ids=cores)
    assert p.cpu_threads_bind == bind


def test_cpu_binding_is_left_alone_without_cores_or_ranks() -> None:
    assert plan(device="cpu", hardware=None, tensor_parallel_size=2).engine_env() == {}
    assert plan(device="cpu", hardware=None, cpu_ids=range(4)).engine_env() == {}  # tp=1: vLLM's own


def test_cpu_tp_above_the_cores_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"need a core per rank, and this process may use 1: use at most 1"):
        plan(device="cpu", hardware=None, model=None, tensor_parallel_size=2, cpu_ids=[0])


def test_cpu_runs_pipeline_stages_compiled_each_rank_on_its_cores() -> None:
    p = plan(device="cpu", hardware=LAPTOP, pipeline_parallel_size=2, cpu_ids=range(8))
    assert sizes(p) == (1, 2, 1) and p.distributed_executor == "mp"
    assert p.cpu_threads_bind == "0-3|4-7"
    assert noted(p, "on CPU pipeline parallelism splits the cores", "2 worker process(es)")
    both = plan(
        device="cpu", hardware=None, tensor_parallel_size=2, pipeline_parallel_size=2, cpu_ids=range(8)
    )
    assert both.cpu_threads_bind == "0-1|2-3|4-5|6-7"  # vLLM's ranks: tensor innermost
    assert noted(both, "tensor and pipeline parallelism splits the cores", "4 worker process(es)")
    compiled = plan(device="cpu", hardware=None, pipeline_parallel_size=2, enforce_eager=False)
    assert sizes(compiled) == (1, 2, 1)


def test_cpu_refuses_pipeline_stages_with_enforce_eager_and_ray_saying_what_works() -> None:
    with pytest.raises(ConfigError) as info:
        plan(device="cpu", hardware=LAPTOP, pipeline_parallel_size=2, enforce_eager=True)
    msg = str(info.value)
    assert "pipeline_parallel_size=2 with enforce_eager=True does not run on vLLM's CPU build" in msg
    assert "KeyError" in msg and "leave enforce_eager unset" in msg and "tensor_parallel_size" in msg
    with pytest.raises(ConfigError) as info:
        plan(device="cpu", hardware=LAPTOP, tensor_parallel_size=2, distributed_executor="ray")
    msg = str(info.value)
    assert "does not support ray" in msg and "tensor_parallel_size=N" in msg
    # the same layouts stay open on GPUs, eager included
    assert sizes(plan(pipeline_parallel_size=2, enforce_eager=True)) == (1, 2, 1)
    assert plan(tensor_parallel_size=2, distributed_executor="ray").distributed_executor == "ray"
    assert sizes(plan(device="cpu", hardware=None, tensor_parallel_size=2, enforce_eager=True)) == (2, 1, 1)


def test_cpu_still_checks_the_model() -> None:
    with pytest.raises(ConfigError, match=r"does not divide the model's 32 attention heads"):
        plan(device="cpu", hardware=LAPTOP, tensor_parallel_size=3)


def test_num_gpus_on_cpu_points_to_the_sizes() -> None:
    with pytest.raises(
        ConfigError, match=r"num_gpus counts GPUs, but the device is 'cpu': set tensor_parallel"
    ):
        plan(device="cpu", hardware=LAPTOP, num_gpus=2)


def test_cpu_binding_is_vllms_own_with_a_numa_node_per_rank() -> None:
    p = plan(device="cpu", hardware=None, tensor_parallel_size=2, cpu_ids=range(64), numa_nodes=2)
    assert p.cpu_threads_bind is None and p.engine_env() == {}
    assert noted(p, "a NUMA node each (vLLM's own binding)")
    one_node = plan(device="cpu", hardware=None, tensor_parallel_size=2, cpu_ids=range(64), numa_nodes=1)
    assert one_node.cpu_threads_bind == "0-31|32-63"  # vLLM's "auto" asserts a node per rank


# ---- several nodes: vLLM's own multi-node path (nnodes, the mp executor on every node) ----


def test_nodes_on_cpu_plan_a_pipeline_stage_per_node_on_mp() -> None:
    p = plan(device="cpu", hardware=None, nnodes=2, cpu_ids=[0, 1])
    assert sizes(p) == (1, 2, 1) and p.distributed_executor == "mp"
    assert p.cpu_threads_bind == "0-1"  # one local rank: all of this node's cores
    assert noted(p, "nnodes=2, on CPU one rank per node: pipeline_parallel_size=2, a stage on each node")
    assert noted(p, "each node runs 1 of the 2 ranks", "`unillm serve --headless`")


def test_nodes_on_gpus_keep_tensor_parallelism_inside_a_node() -> None:
    p = plan(nnodes=2)  # two 8-GPU NVSwitch boxes
    assert sizes(p) == (8, 2, 1) and p.distributed_executor == "mp"
    assert noted(p, "tensor_parallel_size=8 within each machine, pipeline_parallel_size=2 stages between")
    pcie = plan(hardware=RTX4090X4, nnodes=2)
    assert sizes(pcie) == (1, 8, 1)  # no NVLink even inside a node
    assert sizes(plan(hardware=PAIRS, nnodes=3)) == (2, 6, 1)  # tp within a bridged pair
    # num_gpus counts the GPUs of all the nodes; without hardware the groups stay inside a node
    assert sizes(plan(num_gpus=16, nnodes=2)) == (8, 2, 1)
    assert sizes(plan(hardware=None, num_gpus=8, nnodes=4)) == (2, 4, 1)
    assert sizes(plan(hardware=None, nnodes=2)) == (1, 2, 1)


@pytest.mark.parametrize(
    ("ranks", "cores", "bind"),
    [
        ({"tensor_parallel_size": 2}, [1], "1"),  # the loopback test: a rank per node, a core each
        ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, range(8), "0-3|4-7"),
        ({"tensor_parallel_size": 4, "pipeline_parallel_size": 2}, range(8), "0-1|2-3|4-5|6-7"),
    ],
)
def test_nodes_on_cpu_bind_only_this_nodes_ranks(ranks: dict[str, int], cores: Any, bind: str) -> None:
    p = plan(device="cpu", hardware=None, model=None, nnodes=2, cpu_ids=cores, **ranks)
    assert p.cpu_threads_bind == bind  # vLLM reads one group per local rank


def test_nodes_check_each_nodes_share() -> None:
    with pytest.raises(ConfigError, match=r"1 x 3 x 1 = 3 ranks cannot be shared out evenly over nnodes=2"):
        plan(device="cpu", hardware=None, pipeline_parallel_size=3, nnodes=2)
    with pytest.raises(ConfigError, match=r"16 GPUs \(8 on each of the 2 nodes\), but this machine has 4"):
        plan(hardware=RTX4090X4, tensor_parallel_size=8, pipeline_parallel_size=2, nnodes=2)
    fits = plan(hardware=RTX4090X4, tensor_parallel_size=4, pipeline_parallel_size=2, nnodes=2)
    assert sizes(fits) == (4, 2, 1)
    with pytest.raises(ConfigError, match=r"num_gpus=12, but each of the 2 nodes has 4 GPUs: ask for"):
        plan(hardware=RTX4090X4, num_gpus=12, nnodes=2)
    with pytest.raises(ConfigError, match=r"num_gpus=7 over nnodes=2: .* use a multiple of 2"):
        plan(num_gpus=7, nnodes=2)


def test_tensor_parallelism_across_nodes_is_honoured_with_a_note() -> None:
    p = plan(device="cpu", hardware=None, tensor_parallel_size=2, nnodes=2, cpu_ids=[0])
    assert sizes(p) == (2, 1, 1) and p.cpu_threads_bind == "0"
    assert noted(p, "tensor_parallel_size=2 with 1 rank(s) per node", "all-reduce over the network")


def test_nodes_refuse_ray_and_eager_pipelines_on_cpu() -> None:
    with pytest.raises(ConfigError, match=r"nnodes=2 is vLLM's own multi-node path.*leave nnodes at 1"):
        plan(tensor_parallel_size=8, nnodes=2, distributed_executor="ray")
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=2 with enforce_eager=True"):
        plan(device="cpu", hardware=None, nnodes=2, enforce_eager=True)  # the chosen layout, too
    with pytest.raises(ConfigError, match=r"nnodes must be 1 or more, not 0"):
        plan(nnodes=0)
