"""The GPU check's `pan2_options` step, the parts a CPU can judge without running it (its dry run, with FastVideo in
worker processes, is rehearsed in tests/gpu_check/test_gpu_check.py): every run sets all of FastVideo's options the plan decides
(FastVideo 0.2.1's defaults turn every offload on), each run is held to the right reference, and the verdict "in
effect" read from a worker's state is the one a GPU run's state must give (states as `_worker_state` reports them)."""

from __future__ import annotations

import ast
import copy

import pytest
from _source_tree import REPO

from gpu_check import gpu_check

OPTIONS = ("dit_layerwise_offload", "text_encoder_cpu_offload", "vae_cpu_offload", "use_fsdp_inference")


def _state(**flags) -> dict:
    """A GPU worker's state after a plain run of the tiny checkpoint (2 joint blocks, 1 refiner block), `flags` on."""
    args = dict.fromkeys((*gpu_check.OPTION_FLAGS, "pin_cpu_memory"), False) | flags
    return {"args": args, "device": "cuda:0",
            "transformer": {"devices": ["cuda:0"], "device_bytes": 4096, "dtypes": ["float32"], "parameters": 68,
                            "dtensor_parameters": 0, "fsdp_meshes": [],
                            "module_lists": {"transformer_blocks": {"blocks": 2, "offload_hooked": 0,
                                                                    "device_bytes": 2048},
                                             "context_refiner": {"blocks": 1, "offload_hooked": 0,
                                                                 "device_bytes": 512}}},
            "text_encoder": {"devices": ["cuda:0"], "device_bytes": 1024, "dtypes": ["float32"]},
            "vae": {"devices": ["cuda:0"], "device_bytes": 1024, "dtypes": ["float32"]}}


def test_every_run_sets_each_option_and_only_its_own_is_on():
    names = [name for name, _, _ in gpu_check.OPTION_RUNS]
    assert names == ["plain", "dit_layerwise_offload", "text_encoder_cpu_offload", "vae_cpu_offload", "plain_bf16",
                     "use_fsdp_inference"]
    for name in names:
        engine = gpu_check.option_engine(name)
        assert engine["num_gpus"] == 1 and set(engine["offload"]) == {"dit", "dit_layerwise", "text_encoder", "vae"}
        on = [key for key, value in engine["offload"].items() if value] + ["fsdp"] * engine["use_fsdp_inference"]
        assert on == ({"dit_layerwise_offload": ["dit_layerwise"], "text_encoder_cpu_offload": ["text_encoder"],
                       "vae_cpu_offload": ["vae"], "use_fsdp_inference": ["fsdp"]}.get(name, [])), name


def test_fsdp_is_held_to_a_plain_bf16_run_and_the_offloads_to_the_plain_fp32_one():
    """FastVideo 0.2.1's FSDP inference gathers the DiT in bf16 whatever dit_precision says."""
    runs = {name: (precision, reference) for name, precision, reference in gpu_check.OPTION_RUNS}
    assert runs["use_fsdp_inference"] == ("bf16", "plain_bf16") and runs["plain_bf16"] == ("bf16", None)
    assert runs["plain"] == ("fp32", None)
    assert all(runs[name] == ("fp32", "plain") for name in OPTIONS[:3])


def _cpu_offload_flags() -> tuple[str, ...]:
    """`fastvideo_integration.compat.cpu_gaps.CPU_OFFLOAD_FLAGS`, read from its source (importing it imports
    FastVideo)."""
    tree = ast.parse((REPO / "fastvideo_pan2_ext" / "fastvideo_integration" / "compat" / "cpu_gaps.py").read_text())
    [value] = [node.value for node in tree.body if isinstance(node, ast.Assign)
               and [getattr(t, "id", None) for t in node.targets] == ["CPU_OFFLOAD_FLAGS"]]
    return ast.literal_eval(value)


def test_the_options_a_dry_run_records_off_are_those_turned_off_without_a_gpu():
    CPU_OFFLOAD_FLAGS = _cpu_offload_flags()
    assert set(gpu_check.OFF_WITHOUT_GPU) == set(OPTIONS[:3]) <= set(CPU_OFFLOAD_FLAGS)
    assert "use_fsdp_inference" not in CPU_OFFLOAD_FLAGS  # FSDP2 runs on a CPU over gloo: the dry run runs it


def test_plain_is_plain_only_with_no_option_on_and_every_component_on_the_gpu():
    assert gpu_check.option_in_effect("plain", _state(), dry_run=False)[0]
    assert not gpu_check.option_in_effect("plain", _state(dit_cpu_offload=True), dry_run=False)[0]
    parked = _state()
    parked["text_encoder"] |= {"devices": ["cpu"], "device_bytes": 0}
    in_effect, words = gpu_check.option_in_effect("plain_bf16", parked, dry_run=False)
    assert not in_effect and "text_encoder" in words


def test_layerwise_offload_is_in_effect_when_every_joint_block_and_no_refiner_block_is_hooked_and_emptied():
    state = _state(dit_layerwise_offload=True)
    joint = state["transformer"]["module_lists"]["transformer_blocks"]
    joint |= {"offload_hooked": 2, "device_bytes": 0}
    in_effect, words = gpu_check.option_in_effect("dit_layerwise_offload", state, dry_run=False)
    assert in_effect and "2 of 2 transformer_blocks hooked" in words, words
    for broken in ({"offload_hooked": 1}, {"device_bytes": 2048}):
        assert not gpu_check.option_in_effect("dit_layerwise_offload", _with(state, joint=broken), False)[0]
    refiner = _with(state, refiner={"offload_hooked": 1})  # the 4 text-refiner blocks are not PAN2's to stream
    assert not gpu_check.option_in_effect("dit_layerwise_offload", refiner, dry_run=False)[0]


def _with(state: dict, joint: dict | None = None, refiner: dict | None = None) -> dict:
    changed = copy.deepcopy(state)
    lists = changed["transformer"]["module_lists"]
    lists["transformer_blocks"] |= joint or {}
    lists["context_refiner"] |= refiner or {}
    return changed


@pytest.mark.parametrize("name, part", [("text_encoder_cpu_offload", "text_encoder"), ("vae_cpu_offload", "vae")])
def test_a_component_offload_is_in_effect_when_its_weights_are_back_on_the_cpu_after_the_run(name, part):
    state = _state(**{name: True})
    assert not gpu_check.option_in_effect(name, state, dry_run=False)[0]  # asked for, weights still on the GPU
    state[part] |= {"devices": ["cpu"], "device_bytes": 0}
    assert gpu_check.option_in_effect(name, state, dry_run=False) == (True, "its weights after the run on ['cpu']")


def test_fsdp_is_in_effect_when_the_dit_holds_dtensors():
    state = _state(use_fsdp_inference=True)
    assert not gpu_check.option_in_effect("use_fsdp_inference", state, dry_run=False)[0]
    state["transformer"] |= {"dtensor_parameters": 68, "fsdp_meshes": [[1, 1]]}
    in_effect, words = gpu_check.option_in_effect("use_fsdp_inference", state, dry_run=False)
    assert in_effect and words == "68 of 68 DiT parameters FSDP DTensors on meshes [[1, 1]]"


@pytest.mark.parametrize("name", OPTIONS)
def test_an_option_the_worker_turned_off_is_not_in_effect_and_a_dry_run_says_why(name):
    """FastVideo resolves conflicts in the worker (layer-wise offload turns FSDP off); on a GPU-less machine the
    compat package turns the offloads off: either way the worker's args say so and nothing else counts."""
    state = _state()  # the option asked for, off in the worker: every sign of it present all the same
    state["transformer"] |= {"dtensor_parameters": 68}
    state["text_encoder"]["devices"] = state["vae"]["devices"] = ["cpu"]
    in_effect, words = gpu_check.option_in_effect(name, state, dry_run=False)
    assert not in_effect and words == f"the worker's FastVideoArgs have {name}=False"
    in_effect, words = gpu_check.option_in_effect(name, state, dry_run=True)
    assert not in_effect and ("CPU_OFFLOAD_FLAGS" in words) == (name != "use_fsdp_inference")


def test_the_step_comes_before_the_pipeline_in_part_2_with_a_small_cap():
    for sizes in (gpu_check.FULL, gpu_check.DRY):
        steps = gpu_check.part_steps(2, sizes, with_diffusers=True)
        assert [step.name for step in steps[-2:]] == [gpu_check.PAN2_OPTIONS, gpu_check.PIPELINE]
        assert steps[-2].cap <= 120 and steps[-2].needs[0] <= steps[-2].cap
        assert gpu_check.PAN2_OPTIONS not in [step.name for step in gpu_check.part_steps(1, sizes, True)]
    assert gpu_check.FULL["pan2_options"] == (256, 384, 17, 2) and gpu_check.DRY["pan2_options"] == (64, 96, 9, 2)
