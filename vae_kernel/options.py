"""The fast decoder's and the fast encoder's options, defined once (README, "The options"; docs/design/decoder.md, "The
decoder").

Each option is a name, a type, a default, what it means, its check and whether it applies to the decode, the encode
or both. From this table come `WanVAEDecoder`'s keyword arguments (`OPTIONS`: the decode's), `WanVAEEncoder`'s
(`ENCODE_OPTIONS`), the fields FastVideo's Wan VAE config gets (`decode_<name>`, beside the `decode_kernel` switch),
PAN2's switches (`vae_decode_<name>`, views of its Wan VAE config), the decode command's flags (`--frames-per-pass`,
...) and the options `enable_fast_decode` and `enable_fast_encode` take. A new option is a new row here (and the code
that honours it).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from .planning.memory import AUTO, parse_bytes
from .portable.ops import Ops

BACKENDS = ("auto", "cuda", "torch")
CONV_ALGORITHMS = ("auto", "direct", "winograd")
PRECISIONS = ("auto", "fp32", "bf16")


def _check_frames_per_pass(label: str, value) -> None:
    if not (value == AUTO or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)):
        raise ValueError(f"{label} must be 'auto' or an int >= 1; got {value!r}")


def _check_tile_rows(label: str, value) -> None:
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"{label} must be an int >= 1 (latent rows per tile) or None; got {value!r}")


def _check_max_memory(label: str, value) -> None:
    if value is not None:
        parse_bytes(value, label)


def _check_backend(label: str, value) -> None:
    if not isinstance(value, Ops) and value not in BACKENDS:
        raise ValueError(f"{label} must be one of {list(BACKENDS)}; got {value!r}")


def _check_conv_algorithm(label: str, value) -> None:
    if value not in CONV_ALGORITHMS:
        raise ValueError(f"{label} must be one of {list(CONV_ALGORITHMS)}; got {value!r}")


def _check_precision(label: str, value) -> None:
    if value not in PRECISIONS:
        raise ValueError(f"{label} must be one of {list(PRECISIONS)}; got {value!r}")


def _check_bool(label: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{label} must be True or False; got {value!r}")


def _count_or_auto(text: str) -> int | str:
    return int(text) if text.strip().lstrip("-").isdigit() else text


def _count_or_none(text: str) -> int | None:
    return None if text.lower() == "none" else int(text) if text.strip().lstrip("-").isdigit() else text


def _bytes_or_none(text: str) -> int | str | None:
    return None if text.lower() == "none" else int(text) if text.isdigit() else text


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    annotation: Any
    default: Any
    meaning: str
    check: Callable[[str, Any], None]  # ValueError naming `label` when the value is wrong
    from_text: Callable[[str], Any] = str  # a command line's spelling -> the value (then checked)
    applies: tuple[str, ...] = ("decode", "encode")


ALL_OPTIONS = (
    Option("frames_per_pass", int | str, AUTO, "latent frames per pass (memory vs speed; the same result), or "
           "'auto': the most that fit the free memory", _check_frames_per_pass, _count_or_auto),
    Option("tile_rows", int | None, None, "work in exact tiles of this many latent rows, one after another (the "
           "same result, less memory; one rank)", _check_tile_rows, _count_or_none),
    Option("max_memory", int | str | None, None, "or pick, per shape, the largest tile whose working memory fits "
           "this budget (bytes, or a string such as '8GiB'; one rank)", _check_max_memory, _bytes_or_none),
    Option("backend", str, "auto", "'auto' (compiled kernels where built and self-checked, else portable), 'cuda' "
           "(compiled or an error), 'torch' (portable, CPU too)", _check_backend),
    Option("conv_algorithm", str, "auto", "the 3x3 spatial convs 'direct', by 'winograd' F(2x2, 3x3), or 'auto' (per "
           "layer, as measured for the GPU; direct elsewhere)", _check_conv_algorithm, applies=("decode",)),
    Option("precision", str, "auto", "what the encode computes in: 'auto' (as diffusers' and FastVideo's own encode "
           "for an fp32 VAE: fp32, TF32 where torch's settings allow it; bf16 for a bf16 VAE; fp32 for an fp16 one, "
           "whose moments come back in fp16; a caller's autocast changes nothing), 'fp32' (no TF32), 'bf16'",
           _check_precision, applies=("encode",)),
    Option("reuse_steady", bool, True, "reuse a stage's last output when its input and causal history repeat (exact: "
           "image-to-video inputs)", _check_bool, applies=("encode",)),
)
OPTIONS = tuple(o for o in ALL_OPTIONS if "decode" in o.applies)  # the decoder's
ENCODE_OPTIONS = tuple(o for o in ALL_OPTIONS if "encode" in o.applies)
NAMES = tuple(option.name for option in OPTIONS)
DEFAULTS = {option.name: option.default for option in OPTIONS}
ENCODE_NAMES = tuple(option.name for option in ENCODE_OPTIONS)


def _options_class(name: str, table: tuple[Option, ...], doc: str):
    return dataclasses.make_dataclass(
        name, [(o.name, o.annotation, dataclasses.field(default=o.default)) for o in table], frozen=True,
        namespace={"__doc__": doc,
                   "tiled": property(lambda self: self.tile_rows is not None or self.max_memory is not None)})


DecoderOptions = _options_class("DecoderOptions", OPTIONS, "The fast decoder's options (see `OPTIONS`), checked.")
EncoderOptions = _options_class("EncoderOptions", ENCODE_OPTIONS,
                                "The fast encoder's options (see `ENCODE_OPTIONS`), checked.")


def config_field(part: str, option: str) -> str:
    """The field of a Wan VAE config (FastVideo's) that holds `option` of `part` ("decode" or "encode"):
    `decode_<option>`, `encode_<option>`; `<part>_kernel` is the switch."""
    return f"{part}_{option}"


def config_fields(part: str) -> dict[str, tuple[Any, Any]]:
    """The fields a Wan VAE config gets for `part`: name -> (type, default), the switch first."""
    table = OPTIONS if part == "decode" else ENCODE_OPTIONS
    return {config_field(part, "kernel"): (bool, False),
            **{config_field(part, o.name): (o.annotation, o.default) for o in table}}


def from_config(config, part: str, prefix: str = "vae_config."):
    """(whether `part`'s switch is on, its options checked) as the fields of `config` hold them (a ValueError names a
    bad field as `prefix` + its name)."""
    table = OPTIONS if part == "decode" else ENCODE_OPTIONS
    switch = config_field(part, "kernel")
    enabled = getattr(config, switch, False)
    values = {o.name: getattr(config, config_field(part, o.name), o.default) for o in table}
    return enabled, check(values, lambda name: prefix + config_field(part, name), prefix + switch, enabled, part)


def switched_on(config, part: str, prefix: str = "vae_config."):
    """The options of a Wan VAE config whose fast decoder (encoder: `part`) is on, else None (a ValueError names a bad
    field as `prefix` + its name)."""
    enabled, options = from_config(config, part, prefix)
    return options if enabled else None


def as_kwargs(options) -> dict[str, Any]:
    """`options` (DecoderOptions or EncoderOptions) as the keyword arguments of `WanVAEDecoder` (`WanVAEEncoder`)."""
    return {field.name: getattr(options, field.name) for field in dataclasses.fields(options)}


def check(values: Mapping[str, Any], label: Callable[[str], str] = str, switch: str | None = None,
          enabled: bool = True, part: str = "decode"):
    """`values` (a subset of the options of `part`, "decode" or "encode"; the rest default) as DecoderOptions
    (EncoderOptions), or a ValueError naming the first bad one as the caller calls it (`label(name)`).
    `switch`/`enabled`: the caller's switch that turns the fast decoder (encoder) on (tiling options without it are
    an error: nothing else tiles exactly)."""
    table, names, make = (OPTIONS, NAMES, DecoderOptions) if part == "decode" else \
        (ENCODE_OPTIONS, ENCODE_NAMES, EncoderOptions)
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"unknown {part}r option(s) {', '.join(label(n) for n in unknown)}; the options are "
                         f"{', '.join(label(n) for n in names)}")
    if switch is not None and not isinstance(enabled, bool):
        raise ValueError(f"{switch} must be a bool; got {enabled!r}")
    for option in table:
        if option.name in values:
            option.check(label(option.name), values[option.name])
    options = make(**values)
    if options.tile_rows is not None and options.max_memory is not None:
        raise ValueError(f"set {label('tile_rows')} or {label('max_memory')}, not both: the budget picks the tile")
    if options.tiled and not enabled:
        raise ValueError(f"{label('tile_rows')} / {label('max_memory')} tile the fast {part}r: set {switch}=True "
                         f"(FastVideo's own Wan VAE {part} has no exact tiling)")
    return options


def add_arguments(parser: argparse.ArgumentParser, unset: Any = None) -> None:
    """Every option as a command-line flag (`--frames-per-pass`, ...), default: the option's; with
    `unset=argparse.SUPPRESS`, a flag not given leaves no attribute (for a caller with defaults of its own)."""
    for option in OPTIONS:
        flag = "--" + option.name.replace("_", "-")
        default = option.default if unset is None else unset
        parser.add_argument(flag, dest=option.name, default=default, type=argparse_type(option.name),
                            help=f"{option.meaning} (default: {option.default})")


def from_arguments(namespace: argparse.Namespace) -> DecoderOptions:
    return check({name: getattr(namespace, name) for name in NAMES}, lambda n: "--" + n.replace("_", "-"))


def argparse_type(name: str) -> Callable[[str], Any]:
    """The argparse type of option `name`: a command line's spelling, checked."""
    option = OPTIONS[NAMES.index(name)]

    def parse(text: str):
        value = option.from_text(text)
        try:
            option.check(option.name, value)  # argparse names the flag before the message
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    parse.__name__ = option.name  # argparse names the type in its error
    return parse
