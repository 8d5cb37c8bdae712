"""PAN2's memory plan (`model.memory`, `fastvideo_integration.memory_check`): its weight bytes are the real model's parameters,
its sizes come from a checkpoint's own files, and a run that cannot fit is one line before any weight loads."""

from __future__ import annotations

import sys

import pytest
import torch

from fastvideo_pan2_ext.model import memory
from fastvideo_pan2_ext.model.architecture import PAN2TransformerConfig

GB = 10 ** 9
# The real model's sizes: the transformer's config, Qwen3.5-9B's text model and the Wan2.2 VAE as built on the meta
# device from their public configurations (tests/model/test_pan2_memory.py::test_the_real_text_encoder_and_vae_sizes).
REAL = memory.Sizes(PAN2TransformerConfig(), text_params=7_936_684_544, text_hidden=4096, text_layers=32,
                    vae_params=704_688_668)
R241, R481 = memory.Request(704, 1248, 241), memory.Request(704, 1248, 481)


def test_the_plans_transformer_weights_are_the_real_models_parameters():
    from fastvideo.models.registry import ModelRegistry

    from fastvideo_pan2_ext.model.dit_config import PAN2DiTConfig

    cls, _ = ModelRegistry.resolve_model_cls(["PAN2Transformer3DModel"])
    with torch.device("meta"):
        model = cls(config=PAN2DiTConfig(), hf_config={})
    count = sum(p.numel() for p in model.parameters())
    assert memory.plan(REAL, R241).components["transformer weights"] == 2 * count
    assert memory.plan(REAL, R241, memory.Layout(dit_precision="fp32")).components["transformer weights"] == 4 * count
    block = sum(p.numel() for p in model.transformer_blocks[0].parameters())
    offloaded = memory.plan(REAL, R241, memory.Layout(dit_layerwise_offload=True)).components["transformer weights"]
    assert offloaded == 2 * (count - 44 * block + 2 * block)  # two joint blocks resident, the rest streamed


@pytest.mark.slow
def test_the_real_text_encoder_and_vae_sizes():
    """The constants above: Qwen3.5-9B's text model (its public configuration) and the Wan2.2 VAE, on meta."""
    from diffusers import AutoencoderKLWan
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    text = Qwen3_5TextConfig(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                             num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                             linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128)
    with torch.device("meta"):
        qwen = Qwen3_5TextModel(text)
        vae = AutoencoderKLWan(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                               temperal_downsample=[False, True, True], is_residual=True, patch_size=2,
                               in_channels=12, out_channels=12, scale_factor_spatial=16, scale_factor_temporal=4)
    assert sum(p.numel() for p in qwen.parameters()) == REAL.text_params
    assert sum(p.numel() for p in vae.parameters()) == REAL.vae_params


def test_sizes_come_from_the_checkpoints_files(tiny_ckpt):
    from diffusers import AutoencoderKLWan
    from transformers import Qwen3_5TextModel

    sizes = memory.Sizes.from_checkpoint(tiny_ckpt)
    text = Qwen3_5TextModel.from_pretrained(tiny_ckpt / "text_encoder")
    vae = AutoencoderKLWan.from_pretrained(tiny_ckpt / "vae")
    assert sizes.text_params == sum(p.numel() for p in text.parameters())
    assert (sizes.text_hidden, sizes.text_layers) == (text.config.hidden_size, text.config.num_hidden_layers)
    assert sizes.vae_params == sum(p.numel() for p in vae.parameters())
    assert sizes.transformer.text_embed_dim == text.config.hidden_size


def test_the_real_size_table():
    """docs/design/pan2.md, "PAN2's memory plan" (the table: docs/benchmarks.md, "PAN2 at its real size, by
    arithmetic"): what fits one H100 (80 GB), one H200 (141 GB), one B200 (180 GB)."""
    h100, h200, b200 = 80 * GB, 141 * GB, 180 * GB
    assert memory.video_tokens(REAL, R241) == 52_338 and memory.video_tokens(REAL, R481) == 103_818
    bare = memory.plan(REAL, R241)
    assert not bare.fits(h100) and bare.fits(h200) and memory.plan(REAL, R481).fits(b200)
    fitting = memory.first_fitting(REAL, R241, h100, num_gpus=1)
    assert fitting.layout.text_encoder_cpu_offload and not fitting.layout.dit_layerwise_offload
    assert memory.first_fitting(REAL, R481, h100, num_gpus=1).layout.text_encoder_cpu_offload
    assert memory.first_fitting(REAL, R481, 48 * GB, num_gpus=1).layout.dit_layerwise_offload
    eight = memory.plan(REAL, R481, memory.Layout(num_gpus=8, sp_size=8, use_fsdp_inference=True))
    assert eight.components["one joint block's activations"] < memory.plan(REAL, R481).components[
        "one joint block's activations"] / 7  # the video tokens split 8 ways, the text replicated


def test_a_plan_that_cannot_fit_names_the_options_that_would():
    with pytest.raises(ValueError) as info:
        memory.check(REAL, R241, memory.Layout(), 80 * GB)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("PAN2 (1248x704, 241 frames) with no offload needs 81.5 GiB per GPU (transformer "
                              "weights 54.4 GiB, text encoder weights 14.8 GiB")
    assert message.endswith(": set text_encoder_cpu_offload=True, vae_cpu_offload=True (69.6 GiB)")
    with pytest.raises(ValueError, match="no offload option makes it fit: use more GPUs"):
        memory.check(REAL, R481, memory.Layout(), 16 * GB)


@pytest.mark.slow
def test_the_cli_refuses_a_run_that_cannot_fit_before_any_weight_loads(pan2, tiny_ckpt, monkeypatch, capsys):
    """One 84 GB GPU (the weights fit, 241 frames do not) and the real model's sizes (neither exists here: both
    injected), no offload asked for, PAN2's default 241 frames: one line, exit 2,
    from the CLI's checks, before a worker starts. On 80 GB the weights alone are refused the same way."""
    from fastvideo.entrypoints.cli.main import main

    from fastvideo_pan2_ext.fastvideo_integration import memory_check

    monkeypatch.setattr(memory_check, "gpu_bytes", lambda num_gpus: 84 * GB)
    monkeypatch.setattr(memory.Sizes, "from_checkpoint", classmethod(lambda cls, folder: REAL))
    started = []
    monkeypatch.setattr("multiprocessing.context.SpawnProcess.start", lambda self: started.append(self))
    no_offload = [arg for flag in ("dit", "dit_layerwise", "text_encoder", "vae")
                  for arg in (f"--generator.engine.offload.{flag}", "false")]
    monkeypatch.setattr(sys, "argv", ["fastvideo", "generate", "--pipeline", "pan2", "--generator.model_path",
                                      str(tiny_ckpt), "--request.prompt", "a fox", *no_offload])
    with pytest.raises(SystemExit) as info:
        main()
    lines = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(lines) == 1 and not started
    assert lines[0].startswith("fastvideo generate: error: PAN2 (1248x704, 241 frames) with no offload needs")
    assert "set text_encoder_cpu_offload=True, vae_cpu_offload=True" in lines[0]


def test_the_cost_models_flops_are_what_torch_counts_on_the_reference_transformer():
    """Linear layers: FlopCounterMode over the reference's forward (tiny config, an odd patch grid, 7 text tokens).
    Attention (which torch's CPU attention does not report to it): the same shapes as explicit matmuls."""
    from torch.utils.flop_counter import FlopCounterMode

    from fastvideo_pan2_ext import reference
    from fastvideo_pan2_ext.model.architecture import weight_shapes
    from fastvideo_pan2_ext.model.cost import forward_flops

    c = PAN2TransformerConfig(num_attention_heads=2, attention_head_dim=16, rope_axes_dim=(4, 6, 6), num_layers=2,
                              num_refiner_layers=1, text_embed_dim=40)
    g = torch.Generator().manual_seed(0)
    state = {name: torch.randn(shape, generator=g) * 0.05 for name, shape in weight_shapes(c).items()}
    video, text = 3 * 2 * 3, 7
    with FlopCounterMode(display=False) as counter:
        reference.pan2_transformer(torch.randn(1, 97, 3, 4, 6), torch.tensor([500.0]), torch.randn(1, text, 40),
                                   state, c)
    counted = counter.get_flop_counts()["Global"]
    assert set(map(str, counted)) == {"aten.convolution", "aten.addmm", "aten.mm"}
    flops = forward_flops(c, video, text)
    assert flops.linear == sum(counted.values())
    with FlopCounterMode(display=False) as counter:
        for tokens, blocks in ((video + text, c.num_layers), (text, c.num_refiner_layers)):
            for _ in range(blocks):
                q = k = v = torch.randn(c.num_attention_heads, tokens, c.attention_head_dim)
                torch.softmax(q @ k.transpose(1, 2), -1) @ v
    assert flops.attention == counter.get_total_flops()


def test_one_joint_blocks_flops_are_what_torch_counts_on_the_reference_block():
    """`joint_block_flops` (what the GPU check divides a block's time by): FlopCounterMode over the reference's one
    joint block, its attention through explicit matmuls (torch's CPU attention does not report to the counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    from fastvideo_pan2_ext import reference
    from fastvideo_pan2_ext.model.architecture import weight_shapes
    from fastvideo_pan2_ext.model.cost import joint_block_flops

    c = PAN2TransformerConfig(num_attention_heads=2, attention_head_dim=16, rope_axes_dim=(4, 6, 6), num_layers=2,
                              num_refiner_layers=1, text_embed_dim=40)
    g = torch.Generator().manual_seed(0)
    state = {name: torch.randn(shape, generator=g) * 0.05 for name, shape in weight_shapes(c).items()
             if name.startswith("transformer_blocks.0.")}
    grid, text = (3, 2, 3), 7

    def attention(q, k, v):
        return (torch.softmax(q.transpose(1, 2) @ k.permute(0, 2, 3, 1), -1) @ v.transpose(1, 2)).transpose(1, 2)\
            .flatten(2)

    with FlopCounterMode(display=False) as counter:
        reference._pan2_joint_block(state, "transformer_blocks.0", torch.randn(1, 18, 32), torch.randn(1, text, 32),
                                    torch.randn(1, 32), reference.pan2_rope(c, grid), 2, attention)
    assert joint_block_flops(c, 18, text).total == counter.get_total_flops()


@pytest.mark.parametrize("gpu_gb,chosen", [
    (141, {"dit": False, "dit_layerwise": False, "text_encoder": False, "vae": False}),
    (80, {"dit": False, "dit_layerwise": False, "text_encoder": True, "vae": True}),
    (40, {"dit": False, "dit_layerwise": True, "text_encoder": True, "vae": True}),
])
def test_the_pan2_preset_picks_the_fastest_layout_that_fits_the_gpus_it_finds(tiny_ckpt, monkeypatch, gpu_gb,
                                                                              chosen):
    from fastvideo_pan2_ext.fastvideo_integration import memory_check

    monkeypatch.setattr(memory_check, "gpu_bytes", lambda num_gpus: gpu_gb * GB)
    monkeypatch.setattr(memory.Sizes, "from_checkpoint", classmethod(lambda cls, folder: REAL))
    generator = {"model_path": str(tiny_ckpt)}
    layout = memory_check.choose_layout(generator, R241)
    assert generator["engine"]["offload"] == chosen and generator["engine"]["use_fsdp_inference"] is False
    assert memory.plan(REAL, R241, layout).fits(gpu_gb * GB)
    given = {"model_path": str(tiny_ckpt), "engine": {"offload": {"vae": True}}}
    assert memory_check.choose_layout(given, R241) is None and given["engine"]["offload"] == {"vae": True}
