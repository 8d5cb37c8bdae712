"""The fast decoder's switch (`vae_config.decode_kernel`, docs/design/fastvideo-integration.md "The fast decoder in
FastVideo") on FastVideo's own Wan pipelines, with tiny stock checkpoints (`demo.tiny_checkpoints --layout wan2.2-ti2v |
wan2.1-t2v`, in folders named like the hub models: FastVideo matches a local folder to its config by name):

- stock Wan2.2-TI2V-5B through `fastvideo generate --config run.yaml`, switch on (dotted override), off, and off
  explicitly (the two off videos byte-identical);
- stock Wan2.1 T2V through the Python API (`VideoGenerator.from_config`), switch on;
- in process, FastVideo's `AutoencoderKLWan` of each layout: switch off = FastVideo's own decode bit for bit, switch
  on = `WanVAEDecoder` bit for bit;
- a VAE layout the fast decoder cannot decode is refused when FastVideo's args are made, before any worker starts.

Each FastVideo run is ~30 s on 2 cores (two FastVideo imports: parent and worker).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from _pan2_helpers import (E2E_FRAMES, E2E_HEIGHT, E2E_WIDTH, FASTVIDEO_CLI, OFFLINE, WAN22, last_json_line, run,
                           video_frames_and_size)

pytestmark = pytest.mark.slow

FAST_DECODER_LINE = "fast VAE decoder:"
SWITCH = "--generator.pipeline.experimental.pipeline_config.vae_config.decode_kernel"
REQUEST = {"height": E2E_HEIGHT, "width": E2E_WIDTH, "num_frames": E2E_FRAMES, "num_inference_steps": 2, "seed": 0}


def cli_generate(checkpoint: Path, video: Path, *overrides: str):
    import yaml

    config = video.with_suffix(".yaml")
    config.write_text(yaml.safe_dump({
        "generator": {"model_path": str(checkpoint), "engine": {"num_gpus": 1}},
        "request": {"prompt": "a cat on a sofa", "sampling": REQUEST, "output": {"output_path": str(video)}},
    }))
    proc = run([FASTVIDEO_CLI, "generate", "--config", str(config), *overrides], env_extra=OFFLINE,
               cwd=video.parent)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert video_frames_and_size(video) == (E2E_FRAMES, (E2E_WIDTH, E2E_HEIGHT))
    return log


def test_stock_wan22_ti2v_cli_switch_on_decodes_with_the_fast_decoder(wan22_stock, tmp_path):
    log = cli_generate(wan22_stock, tmp_path / "on.mp4", SWITCH, "true")
    assert ("fast VAE decoder: backend torch, frames_per_pass auto, tile_rows None, max_memory None, one rank on cpu"
            in log)
    # 9 frames: three latent frames, so "auto" can use at most 2 per pass (the first frame goes alone)
    assert "fast VAE decoder: latents [1, 48, 3, 4, 6]: 2 latent frame(s) per pass, untiled" in log


def test_stock_wan22_ti2v_cli_switch_off_is_fastvideos_decode(wan22_stock, tmp_path):
    """No override and `decode_kernel false`: FastVideo's own decode both times, the same bytes."""
    logs = [cli_generate(wan22_stock, tmp_path / "default.mp4"),
            cli_generate(wan22_stock, tmp_path / "off.mp4", SWITCH, "false")]
    assert not [log for log in logs if FAST_DECODER_LINE in log]
    assert (tmp_path / "default.mp4").read_bytes() == (tmp_path / "off.mp4").read_bytes()


# --------------------------------------------------------------------------------------------------- the Python API


API_SCRIPT = textwrap.dedent("""
    import json, sys
    from fastvideo import VideoGenerator

    if __name__ == "__main__":
        checkpoint, video, request = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
        generator = VideoGenerator.from_config({
            "model_path": checkpoint, "engine": {"num_gpus": 1},
            "pipeline": {"experimental": {"pipeline_config": {"vae_config": {"decode_kernel": True}}}}})
        try:
            result = generator.generate({"prompt": "a cat on a sofa", "sampling": request,
                                         "output": {"output_path": video, "save_video": True, "return_frames": False}})
        finally:
            generator.shutdown()
        print(json.dumps({"video_path": result.video_path, "size": list(result.size)}))
""")


def test_stock_wan21_t2v_python_api_switch_on_decodes_with_the_fast_decoder(wan21_stock, tmp_path):
    script = tmp_path / "api.py"
    script.write_text(API_SCRIPT)
    video = tmp_path / "api.mp4"
    proc = run([sys.executable, str(script), str(wan21_stock), str(video), json.dumps(REQUEST)], env_extra=OFFLINE,
               cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert last_json_line(proc.stdout) == {"video_path": str(video), "size": [E2E_HEIGHT, E2E_WIDTH, E2E_FRAMES]}
    assert video_frames_and_size(video) == (E2E_FRAMES, (E2E_WIDTH, E2E_HEIGHT))
    assert ("fast VAE decoder: backend torch, frames_per_pass auto, tile_rows None, max_memory None, one rank on cpu"
            in log)


# --------------------------------------------------------------------------------------------------- in process


def fastvideo_wan_vae(checkpoint: Path):
    """FastVideo's own `AutoencoderKLWan` for a checkpoint's vae folder, as its VAE loader builds it (a fresh
    `WanVAEConfig`: the switch off), and the vae/config.json it was built from."""
    import torch
    from fastvideo.configs.models.vaes import WanVAEConfig
    from fastvideo.models.vaes.wanvae import AutoencoderKLWan
    from safetensors.torch import load_file

    vae_json = json.loads((checkpoint / "vae" / "config.json").read_text())
    config = WanVAEConfig()
    config.update_model_arch({k: v for k, v in vae_json.items() if k != "_class_name"})
    vae = AutoencoderKLWan(config)
    vae.load_state_dict(load_file(checkpoint / "vae" / "diffusion_pytorch_model.safetensors"))
    assert next(vae.parameters()).dtype == torch.float32
    return vae.eval(), vae_json


@pytest.mark.parametrize("layout", ["wan2.2", "wan2.1"])
def test_fastvideo_wan_vae_decode_off_is_fastvideos_on_is_the_fast_decoder(layout, wan22_stock, wan21_stock):
    import torch
    from fastvideo.models.vaes.wanvae import AutoencoderKLWan

    from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder

    vae, vae_json = fastvideo_wan_vae(wan22_stock if layout == "wan2.2" else wan21_stock)
    original = AutoencoderKLWan.decode.__wrapped__  # FastVideo's decode, under compat.wan_vae's route
    assert original is not AutoencoderKLWan.decode
    s = vae_json["scale_factor_spatial"]
    z = torch.randn(1, vae_json["z_dim"], 3, E2E_HEIGHT // s, E2E_WIDTH // s,
                    generator=torch.Generator().manual_seed(0))
    z = z * torch.tensor(vae_json["latents_std"]).view(1, -1, 1, 1, 1) + torch.tensor(
        vae_json["latents_mean"]).view(1, -1, 1, 1, 1)  # de-normalized, as FastVideo's decoding stage hands it over

    with torch.no_grad():
        fastvideo = original(vae, z)
        assert vae.config.decode_kernel is False
        off = vae.decode(z)
        vae.config.decode_kernel = True
        on = vae.decode(z)
        fast = WanVAEDecoder(vae, device="cpu", local=True).decode(z).float()

    assert off.shape == on.shape == (1, 3, E2E_FRAMES, E2E_HEIGHT, E2E_WIDTH)
    assert torch.equal(off, fastvideo)
    assert torch.equal(on, fast)
    assert not torch.equal(on, fastvideo)  # a different decoder (bf16 inside) ran


@pytest.mark.parametrize("layout", [{"is_residual": True, "patch_size": 4}, {"is_residual": False, "patch_size": 2}])
def test_unsupported_vae_layout_is_refused_before_any_worker_starts(layout, wan22_stock, tmp_path, monkeypatch):
    from fastvideo import VideoGenerator
    from fastvideo.fastvideo_args import FastVideoArgs

    checkpoint = tmp_path / WAN22[0]  # the stock name: FastVideo picks Wan2.2-TI2V's config for it
    shutil.copytree(wan22_stock, checkpoint)
    vae_json = checkpoint / "vae" / "config.json"
    vae_json.write_text(json.dumps({**json.loads(vae_json.read_text()), **layout}))
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)

    def no_workers(*args, **kwargs):
        raise AssertionError("FastVideo started its workers")

    monkeypatch.setattr(VideoGenerator, "from_fastvideo_args", classmethod(no_workers))
    expected = (f"vae_config.decode_kernel=True cannot decode {str(checkpoint)!r}: its Wan VAE layout "
                f"(is_residual {layout['is_residual']!r}, patch_size {layout['patch_size']!r}) is neither Wan2.2's "
                "nor Wan2.1's")
    with pytest.raises(ValueError) as raised:
        VideoGenerator.from_config({"model_path": str(checkpoint), "engine": {"num_gpus": 1}, "pipeline": {
            "experimental": {"pipeline_config": {"vae_config": {"decode_kernel": True}}}}})
    assert str(raised.value) == expected
    with pytest.raises(ValueError) as raised:
        FastVideoArgs.from_kwargs(model_path=str(checkpoint), num_gpus=1, **{"vae_config.decode_kernel": True})
    assert str(raised.value) == expected
    # Switch off: FastVideo's own decode, none of the fast decoder's business.
    args = FastVideoArgs.from_kwargs(model_path=str(checkpoint), num_gpus=1)
    assert args.pipeline_config.vae_config.decode_kernel is False
