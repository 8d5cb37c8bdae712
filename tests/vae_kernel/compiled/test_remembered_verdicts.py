"""Self-check verdicts across processes (vae_kernel/compiled/verification.py): a failure is remembered, so later processes
refuse the compiled backend without running the failing check again; a verdict another user could have written is
not believed. The emulated extensions stand in for builds ("emulated-wrong" is outside the allowance,
"emulated-abort" kills its process at the first kernel call); every process and self-check child here is real, and
the children are counted by the audit hook of the process that starts them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from fastvideo_pan2_ext.vae_kernel.compiled import build, verification
from gpu_check.emulated_extension import open_variant, stand_in
from fastvideo_pan2_ext.vae_kernel.compiled.extension import CompiledUnavailable

pytestmark = pytest.mark.slow  # each self-check child takes 10-20 s here

CPU = torch.device("cpu")

# Loads the compiled table for argv[1] twice (as two decoders of one process would), counting self-check children.
LOADER = """
import json, logging, sys
children = []
sys.addaudithook(lambda event, args: children.append(1)
                 if event == "subprocess.Popen" and any("child_main" in str(a) for a in args[1]) else None)
logging.basicConfig(level=logging.WARNING, format="LOG %(levelname)s %(message)s")
from fastvideo_pan2_ext.vae_kernel.compiled import loader
from fastvideo_pan2_ext.vae_kernel.compiled.extension import CompiledUnavailable
from gpu_check.emulated_extension import stand_in
errors = []
for _ in range(2):
    try:
        loader.load_ops("cpu", source=stand_in(sys.argv[1]))
        errors.append(None)
    except CompiledUnavailable as exc:
        errors.append(str(exc))
print("RESULT " + json.dumps({"children": len(children), "errors": errors}))
"""


def _load_twice(root, arch: str) -> tuple[dict, str]:
    env = {**os.environ, build.BUILD_DIR_ENV: str(root)}
    done = subprocess.run([sys.executable, "-c", LOADER, arch], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):]), done.stderr


@pytest.mark.parametrize("arch,failure", [("emulated-wrong", "OUTSIDE THE ALLOWANCE"),
                                          ("emulated-abort", "crashed (exit -6)")])
def test_a_failed_self_check_is_remembered_and_not_rerun_by_later_processes(tmp_path, monkeypatch, arch, failure):
    first, _ = _load_twice(tmp_path, arch)
    assert first["children"] == 1, "the first process checks once (its second load is the process's memory)"
    assert all(failure in e for e in first["errors"]), first["errors"]

    second, stderr = _load_twice(tmp_path, arch)
    assert second["children"] == 0, "a later process ran the failing self-check again"

    monkeypatch.setenv(build.BUILD_DIR_ENV, str(tmp_path))
    verdict = verification.remembered_verdict(open_variant(arch), CPU)
    assert verdict is not None and not verdict.ok and failure in verdict.failure
    assert verdict.path.parent == tmp_path / "verdicts"
    assert verification.remembered_verdict(open_variant("emulated"), CPU) is None  # another build: nothing remembered
    for error in second["errors"]:
        assert error.startswith("remembered self-check verdict") and str(verdict.path) in error and failure in error
        assert "delete that file to check again" in error
    disabled = [l for l in stderr.splitlines() if l.startswith("LOG WARNING") and "disabled for this process" in l]
    assert len(disabled) == 1 and str(verdict.path) in disabled[0], "one warning naming the remembered failure"

    verdict.path.unlink()  # what the refusal tells a user to do
    third, _ = _load_twice(tmp_path, arch)
    assert third["children"] == 1 and all(failure in e for e in third["errors"])


@pytest.fixture(scope="module")
def genuine_pass(tmp_path_factory):
    """A build cache holding a real passing verdict: the correct emulated build's, checked once in this process."""
    root = tmp_path_factory.mktemp("genuine")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(build.BUILD_DIR_ENV, str(root))
        # Every case of the full self-check: over a minute here, longer on a loaded machine.
        assert all(r.ok for r in verification.verify_build_isolated(stand_in("emulated"), CPU, timeout_s=1200))
    (verdict,) = (root / "verdicts").iterdir()
    return root, verdict


def test_a_pass_is_remembered_and_answers_later_processes_without_a_child(genuine_pass):
    root, _ = genuine_pass
    assert _load_twice(root, "emulated")[0] == {"children": 0, "errors": [None, None]}


@pytest.fixture
def planted_pass(tmp_path, monkeypatch, genuine_pass):
    """The correct build's real passing verdict copied to where the wrong build's verdict is kept: a verdict file
    that marks a broken build as verified."""
    monkeypatch.setenv(build.BUILD_DIR_ENV, str(tmp_path))
    planted = verification.verdict_path(open_variant("emulated-wrong"), CPU)
    planted.parent.mkdir(mode=0o700)
    shutil.copyfile(genuine_pass[1], planted)
    os.chmod(planted, 0o600)
    return planted


def test_a_planted_pass_of_this_user_is_believed(planted_pass):
    """The control of the test below: the plant is a verdict the cache would believe, but for its owner or mode."""
    assert all(r.ok for r in verification.verify_build_isolated(stand_in("emulated-wrong"), CPU))


@pytest.mark.parametrize("plant", ["owned-by-another-user", "world-writable", "group-writable-verdicts-folder",
                                   "verdicts-folder-of-another-user"])
def test_a_planted_pass_others_could_have_written_is_not_believed(planted_pass, plant, caplog):
    if plant in ("owned-by-another-user", "verdicts-folder-of-another-user") and os.geteuid() != 0:
        pytest.skip("handing files to another uid needs root (as in CI)")
    if plant == "owned-by-another-user":
        os.chown(planted_pass, 65534, 65534)
    elif plant == "world-writable":
        os.chmod(planted_pass, 0o602)
    elif plant == "group-writable-verdicts-folder":
        os.chmod(planted_pass.parent, 0o770)
    else:
        os.chown(planted_pass.parent, 65534, 65534)
    with pytest.raises(CompiledUnavailable, match="OUTSIDE THE ALLOWANCE"):
        verification.verify_build_isolated(stand_in("emulated-wrong"), CPU)
    assert any("not believing the self-check verdict" in r.getMessage() for r in caplog.records)
