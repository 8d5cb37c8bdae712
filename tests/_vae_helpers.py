"""Seeded random-weight diffusers `AutoencoderKLWan` models for CPU tests (the oracle the decoders are checked against).

The Wan2.2 layout (`is_residual=True`, `patch_size=2`, 12 in/out channels) at narrow widths: the real model has
`base_dim 160, decoder_base_dim 256, z_dim 48`; these default to 8 / 8 / 8, which decodes in well under a second.
The Wan2.1 layout (`is_residual=False`, no patchify, 3 channels; real `base_dim 96, z_dim 16`) likewise at 8 / 8.
Every parameter is overwritten with seeded noise so that no layer is an identity or a zero, by the seeded-weight
rule (`selfcheck.seeded_parameter`: convs randn / sqrt(fan_in), biases 0.1 randn, RMS-norm gammas 1 + 0.1 randn).

Import it from a test module, in whichever folder of `tests/`, as `from _vae_helpers import make_wan22_vae` (pytest's
`pythonpath` in pyproject.toml puts `tests/` on `sys.path`), or use the fixtures in `conftest.py`.
"""

from __future__ import annotations

import math

import torch

from fastvideo_pan2_ext.vae_kernel.compiled.selfcheck import random_weights, seeded_parameter


def randomize_parameters_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Overwrite every parameter of `module` in place with seeded noise by the seeded-weight rule
    (`selfcheck.seeded_parameter`)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(seeded_parameter(name, param.shape, generator).to(param.dtype))
    return module


def make_wan22_vae(seed: int = 0, base_dim: int = 8, decoder_base_dim: int | None = None, z_dim: int = 8,
                   dim_mult=(1, 2, 4, 4), num_res_blocks: int = 2):
    """A diffusers `AutoencoderKLWan` of the Wan2.2 layout with seeded random weights, fp32, in eval mode."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(
        base_dim=base_dim,
        decoder_base_dim=decoder_base_dim if decoder_base_dim is not None else base_dim,
        z_dim=z_dim,
        dim_mult=list(dim_mult),
        num_res_blocks=num_res_blocks,
        temperal_downsample=[False, True, True],
        is_residual=True,
        patch_size=2,
        in_channels=12,
        out_channels=12,
        latents_mean=[0.0] * z_dim,
        latents_std=[1.0] * z_dim,
    )
    return randomize_parameters_(vae, seed).eval()


def make_wan21_vae(seed: int = 0, base_dim: int = 8, z_dim: int = 8):
    """A diffusers `AutoencoderKLWan` of the Wan2.1 layout (`is_residual=False`, no patchify), seeded random weights."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(base_dim=base_dim, z_dim=z_dim, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                           temperal_downsample=[False, True, True], latents_mean=[0.0] * z_dim,
                           latents_std=[1.0] * z_dim)
    return randomize_parameters_(vae, seed).eval()


def random_wan22_decoder_weights(seed: int = 0, z_dim: int = 8, decoder_base_dim: int = 8) -> dict:
    """The decoder half of a narrow Wan2.2-layout VAE as a state dict, seeded random, without diffusers (for machines
    that have only torch): `selfcheck.random_weights`, not the same numbers as `make_wan22_vae`."""
    import dataclasses

    from fastvideo_pan2_ext.vae_kernel.definitions.architecture import WAN22_CONFIG

    return random_weights(dataclasses.replace(WAN22_CONFIG, z_dim=z_dim, decoder_base_dim=decoder_base_dim), seed)


def random_latents(shape, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Seeded standard-normal latents of `shape` ([B, z_dim, T, h, w])."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float32).to(dtype)


def diffusers_decode(vae, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The oracle: `vae.to(dtype).decode(z.to(dtype)).sample` (the VAE is cast in place)."""
    with torch.no_grad():
        return vae.to(dtype).decode(z.to(dtype)).sample


def winograd_problem(n, ti, hi, width, ci, co, kt, seed, residual=False):
    """One (kt, 3, 3) conv's operands like the decoder's: activation-like bf16 inputs (SiLU of RMS-normed noise),
    randn / sqrt(fan_in) bf16 weights, an fp32 bias, and optionally a bf16 residual. -> (x, w, b, residual)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16
    x = F.silu(F.normalize(torch.randn(n, ti, hi, width, ci, generator=g), dim=-1) * ci ** 0.5).to(bf16)
    w = (torch.randn(co, kt, 3, 3, ci, generator=g) / math.sqrt(9 * kt * ci)).to(bf16)
    b = 0.1 * torch.randn(co, generator=g)
    res = torch.randn(n, ti - kt + 1, hi - 2, width, co, generator=g).to(bf16) if residual else None
    return x, w, b, res


def winograd_out(n, ti, hi, width, ci, co, kt, strided=False):
    """An empty bf16 output for winograd_problem's conv; `strided`: frames of a bigger buffer, as the decoder's causal
    windows are."""
    shape = (n, ti - kt + 1, hi - 2, width, co)
    if strided:
        return torch.zeros(n, shape[1] + 2, *shape[2:], dtype=torch.bfloat16)[:, 2:]
    return torch.empty(shape, dtype=torch.bfloat16)


def fastvideo_wan_vae_of(vae, **config_fields):
    """FastVideo's own Wan VAE module with the weights of the diffusers `vae`, its config's `config_fields` set (e.g.
    decode_kernel=True); registers the plugin, whose route sends its decode to the fast decoder."""
    from fastvideo.configs.models.vaes import WanVAEConfig
    from fastvideo.models.vaes.wanvae import AutoencoderKLWan

    import fastvideo_pan2_ext

    fastvideo_pan2_ext.register()
    config = WanVAEConfig()
    config.update_model_arch({k: v for k, v in dict(vae.config).items() if not k.startswith("_")})
    for name, value in config_fields.items():
        setattr(config, name, value)
    fastvideo_vae = AutoencoderKLWan(config)
    fastvideo_vae.load_state_dict(vae.state_dict())
    return fastvideo_vae.eval()
