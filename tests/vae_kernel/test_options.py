"""The decoder's options are defined once (`vae_kernel.options`): the decoder's keyword arguments, the command-line
flags and the Wan VAE config's fields are that table, checked the same way everywhere."""

from __future__ import annotations

import argparse

import pytest

from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel import options


def test_the_decoder_takes_exactly_the_options_and_names_an_unknown_one(wan22_state_dict):
    decoder = WanVAEDecoder(wan22_state_dict, device="cpu", **{**options.DEFAULTS, "backend": "torch"})
    assert options.as_kwargs(decoder.options) == {**options.DEFAULTS, "backend": "torch"}
    with pytest.raises(ValueError, match=r"unknown decoder option\(s\) frame_per_pass; the options are "
                                         r"frames_per_pass, tile_rows, max_memory, backend, conv_algorithm"):
        WanVAEDecoder(wan22_state_dict, device="cpu", frame_per_pass=2)


@pytest.mark.parametrize("values, message", [
    ({"frames_per_pass": 0}, r"--frames-per-pass must be 'auto' or an int >= 1; got 0"),
    ({"tile_rows": 2, "max_memory": "1GiB"}, r"set --tile-rows or --max-memory, not both"),
    ({"backend": "cuDNN"}, r"--backend must be one of \['auto', 'cuda', 'torch'\]; got 'cuDNN'"),
    ({"conv_algorithm": "fft"}, r"--conv-algorithm must be one of \['auto', 'direct', 'winograd'\]; got 'fft'"),
    ({"max_memory": "lots"}, r"--max-memory must be bytes \(int\) or a string like '2GiB'; got 'lots'"),
])
def test_each_rule_names_the_option_as_the_caller_spells_it(values, message):
    with pytest.raises(ValueError, match=message):
        options.check(values, lambda name: "--" + name.replace("_", "-"))


def test_command_line_flags_come_from_the_table():
    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    parsed = options.from_arguments(parser.parse_args(["--frames-per-pass", "2", "--max-memory", "3GiB",
                                                       "--conv-algorithm", "winograd"]))
    assert options.as_kwargs(parsed) == {**options.DEFAULTS, "frames_per_pass": 2, "max_memory": "3GiB",
                                         "conv_algorithm": "winograd"}
    assert options.from_arguments(parser.parse_args([])) == options.DecoderOptions()
    with pytest.raises(SystemExit):
        parser.parse_args(["--tile-rows", "0"])


def test_the_wan_vae_config_fields_are_the_switch_and_one_per_option():
    from fastvideo_pan2_ext.fastvideo_integration import fast_decode

    assert list(fast_decode.CONFIG_FIELDS) == ["decode_kernel", *(f"decode_{name}" for name in options.NAMES)]
    assert {name: default for name, (_, default) in fast_decode.CONFIG_FIELDS.items()} == {
        "decode_kernel": False, **{f"decode_{name}": default for name, default in options.DEFAULTS.items()}}


def test_the_wan_vae_config_fields_of_the_encoder_are_its_switch_and_one_per_encode_option():
    from fastvideo_pan2_ext.fastvideo_integration import fast_encode

    assert list(fast_encode.CONFIG_FIELDS) == ["encode_kernel", *(f"encode_{name}" for name in options.ENCODE_NAMES)]
    assert {name: default for name, (_, default) in fast_encode.CONFIG_FIELDS.items()} == {
        "encode_kernel": False, **{f"encode_{o.name}": o.default for o in options.ENCODE_OPTIONS}}
    checked = options.check({"precision": "bf16", "tile_rows": 2}, part="encode")
    assert options.as_kwargs(checked) == {**{o.name: o.default for o in options.ENCODE_OPTIONS}, "precision": "bf16",
                                          "tile_rows": 2}
