"""Which of FastVideo's registered pipeline configs can take the fast decoder's switch
(`vae_config.decode_kernel`, docs/design/fastvideo-integration.md "The fast decoder in FastVideo"), measured on the
installed FastVideo.

    python bench/wan_vae_pipelines.py   # writes bench/results/wan-vae-pipelines-<date>.json (+ .md)

For every entry of FastVideo's config registry (`fastvideo.registry._CONFIG_REGISTRY`, what
`get_pipeline_config_cls_from_name` resolves a model to; its HF ids from `_MODEL_HF_PATH_TO_NAME`, its detectors from
`_MODEL_NAME_DETECTORS`) the config class is instantiated and the switch is set the way the CLI's
`--generator.pipeline.experimental.pipeline_config.vae_config.decode_kernel true` sets it
(`PipelineConfig.update_pipeline_config`, which checks the VAE config's dataclass fields), then `fast_decode.options`
must accept it. Measured beside it: the VAE config class, the VAE layout its defaults describe (Wan2.2-TI2V-class
configs take theirs from the checkpoint's vae/config.json at load: their defaults say Wan2.1), `use_light_vae`,
whether the family's pipeline package calls `streaming_decode` (a decode outside `AutoencoderKLWan.decode`), and,
for `use_light_vae`, how far the fast decoder lands from FastVideo's light-VAE decode of the same weights.
The VAE classes FastVideo's loader builds instead of `AutoencoderKLWan` for some configs (models/loader/
component_loader.py, `VAELoader.load`) are read from its source, listed in SPECIAL_VAE.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import inspect
import json
import logging
import os
import pkgutil
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python bench/wan_vae_pipelines.py`: make the repository's package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import fastvideo  # noqa: E402  (loads the plugin: WanVAEConfig gets its fields, AutoencoderKLWan.decode its route)
import fastvideo.registry as registry  # noqa: E402
from fastvideo.configs.models.vaes import WanVAEConfig  # noqa: E402

from fastvideo_pan2_ext.fastvideo_integration import fast_decode  # noqa: E402

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
COMMAND = "python bench/wan_vae_pipelines.py"

# Configs whose VAE FastVideo's loader builds from another class than AutoencoderKLWan (VAELoader.load in
# fastvideo/models/loader/component_loader.py, 0.2.1 line numbers), so AutoencoderKLWan.decode never runs.
# config class -> (the checkpoint's vae/config.json `_class_name`, or None where the loader keys on the config; note)
SPECIAL_VAE = {
    "LingBotWorld2CausalFastI2V480PConfig": ("LingBotWorld2WanVAE", "(component_loader.py:838-852): its own Wan2.1 VAE "
                                            "code from Wan2.1_VAE.pth, not AutoencoderKLWan"),
    "Cosmos25Config": (None, "Cosmos25WanVAE, component_loader.py:826-837: its own Wan2.1 VAE code from "
                             "tokenizer.safetensors"),
    "Gen3CConfig": (None, "AutoencoderKLGen3CTokenizer when its tokenizer is found (component_loader.py:778-824), else "
                          "AutoencoderKLWan built from a Gen3CVAEConfig"),
}
SWITCHES = ({"vae_config": {"decode_kernel": True}},  # the generic switch, then a config's own name for it (PAN2)
            {"vae_decode_kernel": True})


def family_calls_streaming_decode(config_cls) -> list[str]:
    """Modules of the config's family pipeline package (fastvideo.pipelines.basic.<config module>) that call
    `streaming_decode(` (the incremental decode, outside AutoencoderKLWan.decode)."""
    family = config_cls.__module__.rsplit(".", 1)[-1]
    try:
        package = importlib.import_module(f"fastvideo.pipelines.basic.{family}")
    except ImportError:
        return []
    found = []
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        source = Path(importlib.util.find_spec(info.name).origin).read_text()
        if ".streaming_decode(" in source:
            found.append(info.name)
    return found


def light_vae_gap() -> dict:
    """Why the switch refuses a light VAE: FastVideo's AutoencoderKLWan (tiny, seeded random weights) with
    use_light_vae=True; max|d| of the fast decoder's video against FastVideo's own (light) decode, and against
    FastVideo's plain decode of the same weights."""
    from fastvideo.models.vaes.wanvae import AutoencoderKLWan

    from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder

    torch.manual_seed(0)
    config = WanVAEConfig()
    config.update_model_arch({"base_dim": 8, "z_dim": 16})
    vae = AutoencoderKLWan(config).eval()
    z = torch.randn(1, 16, 3, 4, 6)
    original = AutoencoderKLWan.decode.__wrapped__
    with torch.no_grad():
        plain = original(vae, z)
        config.use_light_vae = True
        light = original(vae, z)
        fast = WanVAEDecoder(vae, device="cpu").decode(z).float()
    return {"layout": "Wan2.1, base_dim 8, latents (1, 16, 3, 4, 6)",
            "max_abs_fast_vs_fastvideo_light": (fast - light).abs().max().item(),
            "max_abs_fast_vs_fastvideo_plain": (fast - plain).abs().max().item(),
            "max_abs_fastvideo_light_vs_plain": (light - plain).abs().max().item()}


def detector_source(detector) -> str:
    try:
        return " ".join(inspect.getsource(detector).split())[:160]
    except (OSError, TypeError):
        return repr(detector)


def measure(entry_id: str, info) -> dict:
    cls = info.pipeline_config_cls
    row = {
        "registry_id": entry_id,
        "config": cls.__name__,
        "config_source": f"{inspect.getsourcefile(cls).split('site-packages/')[-1]}:{inspect.getsourcelines(cls)[1]}",
        "hf_ids": sorted(p for p, i in registry._MODEL_HF_PATH_TO_NAME.items() if i == entry_id),
        "detectors": [detector_source(d) for i, d in registry._MODEL_NAME_DETECTORS if i == entry_id],
        "workload_types": [w.value for w in info.workload_types],
        "pipeline_cls_name": info.pipeline_cls_name,
    }
    try:
        pc = cls()
    except Exception as exc:  # noqa: BLE001 - a config that cannot be built is a finding, not a crash
        return {**row, "group": "cannot", "why": f"config does not instantiate: {type(exc).__name__}: {exc}"}
    vc = pc.vae_config
    arch = getattr(vc, "arch_config", None)
    row.update({
        "vae_config": type(vc).__name__,
        "is_wan_vae_config": isinstance(vc, WanVAEConfig),
        "has_decode_kernel_field": dataclasses.is_dataclass(vc)
        and "decode_kernel" in {f.name for f in dataclasses.fields(vc)},
        "default_layout": {k: getattr(arch, k, None) for k in ("z_dim", "patch_size", "is_residual")}
        if isinstance(vc, WanVAEConfig) else None,
        "layout_from_checkpoint": bool(getattr(pc, "ti2v_task", False)) and getattr(arch, "z_dim", None) == 16,
        "use_light_vae": bool(getattr(vc, "use_light_vae", False)),
        "fastvideo_decode_precision": pc.vae_decode_precision or pc.vae_precision,
        "special_vae": " ".join(filter(None, SPECIAL_VAE.get(cls.__name__, (None, None)))) or None,
        "streaming_decode_in": family_calls_streaming_decode(cls),
        "switch_set": False,
    })
    if row["is_wan_vae_config"]:
        names = {f.name for f in dataclasses.fields(pc)}
        for switch in SWITCHES:
            if not set(switch) <= names:
                continue
            try:  # the CLI's dotted form lands here: update_pipeline_config -> ModelConfig.update_model_config
                pc.update_pipeline_config(switch)
                row["switch_set"] = fast_decode.options(pc.vae_config) is not None
            except Exception as exc:  # noqa: BLE001
                row["switch_error"] = f"{type(exc).__name__}: {exc}"
            row.setdefault("switch_tries", []).append({"set": switch, "options_on": row["switch_set"]})
            if row["switch_set"]:
                row["switch_via"] = "vae_config.decode_kernel" if "vae_config" in switch else next(iter(switch))
                break
        vae_class = SPECIAL_VAE.get(cls.__name__, (None, None))[0]
        if vae_class:  # what FastVideoArgs creation says about a local checkpoint with that VAE, switch on
            row["local_checkpoint_refused"] = fast_decode.unsupported_layout({"_class_name": vae_class})

    if not row["is_wan_vae_config"]:
        row.update(group="cannot", why=f"VAE config is {row['vae_config']}, not FastVideo's WanVAEConfig: no "
                                       "decode_kernel field" + (f"; VAE: {row['special_vae']}" if row["special_vae"]
                                                                else ""))
    elif not row["switch_set"]:
        row.update(group="cannot", why=f"setting the switch fails: {row.get('switch_error') or row['switch_tries']}")
    elif row["special_vae"]:
        refused = row.get("local_checkpoint_refused")
        row.update(group="cannot", why=f"its VAE is {row['special_vae']}: the switch is accepted but never used"
                                       + (f" (a local checkpoint is refused at FastVideoArgs: {refused}; a hub id "
                                          "is not checked)" if refused else ""))
    elif row["streaming_decode_in"]:
        row.update(group="partial", why="DecodingStage.decode -> AutoencoderKLWan.decode is routed; streaming_decode "
                                        f"(in {', '.join(row['streaming_decode_in'])}) is not")
    elif cls.__module__.startswith("fastvideo_pan2_ext"):
        row.update(group="takes", why="this plugin's PAN2DecodingStage -> the fast decoder (decode, or decode_iter "
                                      "for a streamed save)")
    else:
        row.update(group="takes", why="DecodingStage.decode -> AutoencoderKLWan.decode (routed)")
    if row.get("switch_via", "vae_config.decode_kernel") != "vae_config.decode_kernel":
        row["why"] += (f"; switch: {row['switch_via']} (vae_config.decode_kernel=True alone did not turn the fast "
                       "decoder on)")
    return row


GROUPS = (("takes", "Takes the switch"), ("partial", "Takes it, but part of its decode is not routed"),
          ("cannot", "Cannot take it (why)"))


def layout_text(row: dict) -> str:
    layout = row.get("default_layout")
    if not layout:
        return "-"
    text = "2.2" if layout["is_residual"] and layout["patch_size"] == 2 else "2.1" if layout["z_dim"] == 16 else str(
        layout)
    return text + (" (2.2 from the checkpoint)" if row["layout_from_checkpoint"] else "")


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# FastVideo pipeline configs and the fast decoder's switch ({meta['date']})", "",
             f"`{meta['command']}`", "",
             f"FastVideo {meta['fastvideo_version']}, {len(rows)} registry entries, "
             f"{len({r['config'] for r in rows})} config classes. Switch set as "
             "`--generator.pipeline.experimental.pipeline_config.vae_config.decode_kernel true` sets it "
             "(`update_pipeline_config`), then checked by `fast_decode.options`.", ""]
    for key, title in GROUPS:
        group = [r for r in rows if r["group"] == key]
        wan = [r for r in group if r.get("is_wan_vae_config")]
        lines += [f"## {title}: {len(group)} entries ({len({r['config'] for r in group})} classes; "
                  f"{len(wan)} with a WanVAEConfig)", "",
                  "| config | HF ids | workloads | VAE config | defaults layout | light VAE | FastVideo precision | "
                  "decode route / why |", "|---|---|---|---|---|---|---|---|"]
        for r in sorted(group, key=lambda r: (not r.get("is_wan_vae_config"), r["config"], r["registry_id"])):
            ids = ", ".join(r["hf_ids"]) or ("detector only" if r["detectors"] else "-")
            lines.append(f"| {r['config']} | {ids} | {', '.join(r['workload_types']) or '()'} | "
                         f"{r.get('vae_config', '-')} | {layout_text(r)} | {'yes' if r.get('use_light_vae') else ''}"
                         f" | {r.get('fastvideo_decode_precision', '-')} | {r['why']} |")
        lines.append("")
    gap = meta["light_vae_gap"]
    lines += ["Layouts are the config classes' defaults; every config's VAE layout is replaced at load by the "
              "checkpoint's vae/config.json (`update_model_arch`), which FastVideoArgs creation checks with the switch "
              "on (`fast_decode.unsupported_layout`). The fast decoder computes in bf16 (fp32 statistics) whatever "
              "the config's VAE precision (the fp32 rows decode in fp32 with FastVideo's own decoder).", "",
              "Why a light VAE is refused (" + gap["layout"] + "): max|d| of the fast decoder (the plain Wan VAE) vs "
              f"FastVideo's light decode {gap['max_abs_fast_vs_fastvideo_light']:.3g}, vs FastVideo's plain decode "
              f"{gap['max_abs_fast_vs_fastvideo_plain']:.3g} (bf16 vs fp32); FastVideo light vs plain "
              f"{gap['max_abs_fastvideo_light_vs_plain']:.3g}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / f"wan-vae-pipelines-{datetime.date.today()}.json",
                        help="JSON path (the .md table is written beside it)")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # FastVideo logs every config it builds
    torch.set_num_threads(min(2, os.cpu_count() or 1))

    rows = [measure(entry_id, info) for entry_id, info in registry._CONFIG_REGISTRY.items()]
    meta = {"date": datetime.date.today().isoformat(), "command": COMMAND, "fastvideo_version": fastvideo.__version__,
            "torch": torch.__version__, "light_vae_gap": light_vae_gap()}
    counts = {key: sum(r["group"] == key for r in rows) for key, _ in GROUPS}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**meta, "counts": counts, "configs": rows}, indent=1, default=str) + "\n")
    table = markdown(rows, meta)
    args.out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
