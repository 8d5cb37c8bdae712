"""The FA4 decision and its application. Only the device capability and the presence of `flash_attn.cute` are
faked (a stand-in package on sys.path); the in-process tests in test_pipeline_inprocess.py and the e2e test check it
against real FastVideo modules and workers."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
from _pan2_helpers import fake_flash_attn

from fastvideo_pan2_ext.attention import apply_fa4_policy, fa4_decision
from fastvideo_pan2_ext.attention import fa4


@pytest.fixture
def no_flash_attn(monkeypatch):
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    assert importlib.util.find_spec("flash_attn") is None, "this test needs a venv without flash_attn"


@pytest.fixture
def fa4_installed(monkeypatch, tmp_path, no_flash_attn):
    monkeypatch.syspath_prepend(str(fake_flash_attn(tmp_path)))
    yield
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[name]


@pytest.mark.parametrize("capability", [(10, 0), (10, 3)])
def test_fa4_on_for_datacenter_blackwell_with_fa4_installed(fa4_installed, capability):
    assert fa4_decision(capability, environ={}) is True


@pytest.mark.parametrize("capability", [(12, 0), (12, 1), (11, 0), (9, 0), (8, 9), (8, 0), (7, 5)])
def test_fa4_off_on_gpus_fa4_does_not_target(fa4_installed, capability):
    assert fa4_decision(capability, environ={}) is False


def test_fa4_off_without_flash_attn_cute(no_flash_attn):
    assert fa4_decision((10, 0), environ={}) is False


@pytest.mark.parametrize("value", ["0", "1"])
def test_explicit_fastvideo_fa4_is_always_respected(fa4_installed, value):
    assert fa4_decision((10, 0), environ={"FASTVIDEO_FA4": value}) is False


@pytest.mark.parametrize("value", ["", "false", "banana", " 1"])
def test_an_fastvideo_fa4_value_other_than_0_or_1_is_refused(fa4_installed, value):
    """FastVideo reads any value but "0" as on: a typo would silently turn FA4 on."""
    with pytest.raises(ValueError, match=r"FASTVIDEO_FA4 must be unset, 0 or 1; got"):
        fa4_decision((10, 0), environ={"FASTVIDEO_FA4": value})


def test_no_gpu_means_no_fa4(fa4_installed):
    import torch

    assert not torch.cuda.is_available()
    assert fa4_decision(None, environ={}) is False


@pytest.mark.parametrize("capability", [(10,), "sm_100", (10.0, 0), (True, 0)])
def test_bad_capability_is_a_clear_error(capability):
    with pytest.raises(ValueError, match=r"capability must be a \(major, minor\) pair of ints; got"):
        fa4_decision(capability, environ={})


def test_decision_reads_os_environ_by_default_and_changes_nothing(fa4_installed, monkeypatch):
    monkeypatch.delenv("FASTVIDEO_FA4", raising=False)
    assert fa4_decision((10, 0)) is True
    assert "FASTVIDEO_FA4" not in os.environ
    monkeypatch.setenv("FASTVIDEO_FA4", "0")
    assert fa4_decision((10, 0)) is False


def test_apply_sets_fastvideo_fa4_when_decided(fa4_installed, monkeypatch):
    monkeypatch.delenv("FASTVIDEO_FA4", raising=False)
    monkeypatch.setattr(fa4, "_current_capability", lambda: (10, 0))
    assert apply_fa4_policy() is True
    assert os.environ["FASTVIDEO_FA4"] == "1"


def test_apply_keeps_fastvideo_fa4_0(fa4_installed, monkeypatch):
    monkeypatch.setenv("FASTVIDEO_FA4", "0")
    monkeypatch.setattr(fa4, "_current_capability", lambda: (10, 0))
    assert apply_fa4_policy() is False
    assert os.environ["FASTVIDEO_FA4"] == "0"


def test_apply_does_nothing_on_hopper(fa4_installed, monkeypatch):
    monkeypatch.delenv("FASTVIDEO_FA4", raising=False)
    monkeypatch.setattr(fa4, "_current_capability", lambda: (9, 0))
    assert apply_fa4_policy() is False
    assert "FASTVIDEO_FA4" not in os.environ
