"""FastVideo's CLI (fastvideo.entrypoints.cli): `fastvideo generate` and `fastvideo serve` extended (--pipeline), and
their config building (--config, the dotted overrides, the CLI's defaults and checks) reused as the CLI does it."""

from __future__ import annotations

from typing import Any, Callable

from .seams import Seam, replace_once

SEAMS = (
    Seam("fastvideo.api.parser", "parse_config", "--pipeline parses its run config, and a PAN2 serve config is parsed, "
         "as the CLI does"),
    Seam("fastvideo.api.schema", "RunConfig", "... into FastVideo's run config"),
    Seam("fastvideo.api.compat", "generator_config_to_fastvideo_args", "the CLI checks PAN2's memory plan on the "
         "FastVideoArgs its run will make, before anything loads", name="generator_config_to_fastvideo_args"),
    Seam("fastvideo.entrypoints.cli.generate", "GenerateSubcommand.subparser_init", "adds --pipeline", replaced=True),
    Seam("fastvideo.entrypoints.cli.generate", "GenerateSubcommand.validate", "--pipeline builds the run config",
         replaced=True),
    Seam("fastvideo.entrypoints.cli.generate", "GenerateSubcommand.cmd", "a --pipeline run ends cleanly on Ctrl-C, "
         "SIGTERM or a dying worker (FastVideo's run leaves a traceback and, mid-save, a partial file)",
         replaced=True),
    Seam("fastvideo.entrypoints.cli.main", "main", "the dotted overrides travel as args._unknown",
         mentions="args._unknown"),
    Seam("fastvideo.entrypoints.cli.generate", "_VALIDATED_RUN_CONFIG_ATTR", "--pipeline hands the run config it "
         "built to generate where FastVideo's validate() leaves its own"),
    Seam("fastvideo.entrypoints.cli.inference_config", "_load_nested_config", "--pipeline reads --config as the CLI "
         "does"),
    Seam("fastvideo.entrypoints.cli.inference_config", "_apply_dotted_overrides", "... and applies the dotted "
         "overrides as the CLI does"),
    Seam("fastvideo.entrypoints.cli.inference_config", "_GENERATE_OVERRIDE_PREFIXES", "... with the CLI's prefixes"),
    Seam("fastvideo.entrypoints.cli.inference_config", "_ensure_generate_cli_defaults", "... and its defaults"),
    Seam("fastvideo.entrypoints.cli.inference_config", "_validate_num_gpus", "... and its checks"),
    Seam("fastvideo.entrypoints.cli.inference_config", "_validate_generate_prompt_sources", "... and its checks"),
    Seam("fastvideo.entrypoints.cli.serve", "ServeSubcommand.subparser_init", "adds --pipeline to serve",
         replaced=True),
    Seam("fastvideo.entrypoints.cli.serve", "ServeSubcommand.validate", "a PAN2 serve config is built by this "
         "package (FastVideo's parser refuses its `pipeline` key)", replaced=True),
    Seam("fastvideo.entrypoints.cli.serve", "ServeSubcommand.cmd", "a PAN2 server runs with its serving rules",
         replaced=True),
    Seam("fastvideo.entrypoints.cli.serve", "_VALIDATED_SERVE_CONFIG_ATTR", "PAN2's validate hands its serve config "
         "to cmd where FastVideo's leaves its own"),
    Seam("fastvideo.entrypoints.cli.inference_config", "_SERVE_OVERRIDE_PREFIXES", "a PAN2 serve config takes the "
         "serve CLI's dotted overrides"),
    Seam("fastvideo.api.schema", "ServeConfig", "the serve config a PAN2 server is checked into"),
    Seam("fastvideo.api.compat", "generator_config_to_fastvideo_args", "the serve config's generator, as serve "
         "builds it"),
)


def extend_generate_cli(add_arguments: Callable, validate: Callable, run: Callable) -> None:
    """`fastvideo generate`: `add_arguments(parser)` after FastVideo's own; `validate(args, original)` and
    `run(args, original)` instead of FastVideo's validation and run (call `original(args)` to keep it).
    Idempotent."""
    from fastvideo.entrypoints.cli.generate import GenerateSubcommand

    _extend_subcommand(GenerateSubcommand, add_arguments, validate, run)


def extend_serve_cli(add_arguments: Callable, validate: Callable, run: Callable) -> None:
    """`fastvideo serve`, as `extend_generate_cli` does `generate`."""
    from fastvideo.entrypoints.cli.serve import ServeSubcommand

    _extend_subcommand(ServeSubcommand, add_arguments, validate, run)


def _extend_subcommand(cls, add_arguments: Callable, validate: Callable, run: Callable) -> None:
    def make_init(original):
        def subparser_init(self, subparsers):
            parser = original(self, subparsers)
            add_arguments(parser)
            return parser

        return subparser_init

    def make_validate(original):
        def validate_(self, args):
            return validate(args, lambda a: original(self, a))

        return validate_

    def make_run(original):
        def cmd(self, args):
            return run(args, lambda a: original(self, a))

        return cmd

    replace_once(cls, "subparser_init", make_init)
    replace_once(cls, "validate", make_validate)
    replace_once(cls, "cmd", make_run)


def generate_cli_overrides(args) -> list[str] | None:
    """The dotted overrides `fastvideo generate` collected (FastVideo keeps them on the namespace)."""
    return getattr(args, "_unknown", None)


def raw_generate_config(config_path: str | None, overrides: list[str] | None) -> dict:
    """The nested run config `fastvideo generate` builds from --config (optional here) and the dotted overrides,
    with the CLI's defaults, before validation."""
    from fastvideo.entrypoints.cli import inference_config as ic

    raw: dict[str, Any] = ic._load_nested_config(config_path) if config_path else {"generator": {}}
    raw.setdefault("request", {})
    raw = ic._apply_dotted_overrides(raw, overrides, allowed_prefixes=ic._GENERATE_OVERRIDE_PREFIXES)
    ic._ensure_generate_cli_defaults(raw)
    return raw


def validated_generate_config(raw: dict):
    """`raw` parsed into FastVideo's RunConfig and checked as `fastvideo generate` checks it."""
    from fastvideo.api.parser import parse_config
    from fastvideo.api.schema import RunConfig
    from fastvideo.entrypoints.cli import inference_config as ic

    config = parse_config(RunConfig, raw)
    ic._validate_num_gpus(config.generator.engine.num_gpus)
    ic._validate_generate_prompt_sources(config)
    return config


def hand_run_config_to_generate(args, config) -> None:
    """What FastVideo's own validate() leaves for its generate command: the validated run config."""
    from fastvideo.entrypoints.cli import generate

    setattr(args, generate._VALIDATED_RUN_CONFIG_ATTR, config)


def raw_serve_config(config_path: str, overrides: list[str] | None) -> dict:
    """The nested serve config `fastvideo serve` builds from --config and the dotted overrides, before validation."""
    from fastvideo.entrypoints.cli import inference_config as ic

    raw = ic._load_nested_config(config_path)
    raw.setdefault("server", {})
    raw.setdefault("default_request", {})
    return ic._apply_dotted_overrides(raw, overrides, allowed_prefixes=ic._SERVE_OVERRIDE_PREFIXES)


def validated_serve_config(raw: dict):
    """`raw` parsed into FastVideo's ServeConfig and checked as `fastvideo serve` checks it."""
    from fastvideo.api.parser import parse_config
    from fastvideo.api.schema import ServeConfig
    from fastvideo.entrypoints.cli import inference_config as ic

    config = parse_config(ServeConfig, raw)
    ic._validate_num_gpus(config.generator.engine.num_gpus)
    return config


def hand_serve_config_to_serve(args, config) -> None:
    """What FastVideo's own validate() leaves for its serve command: the validated serve config."""
    from fastvideo.entrypoints.cli import serve

    setattr(args, serve._VALIDATED_SERVE_CONFIG_ATTR, config)


def validated_serve_config_of(args):
    from fastvideo.entrypoints.cli import serve

    return getattr(args, serve._VALIDATED_SERVE_CONFIG_ATTR)
