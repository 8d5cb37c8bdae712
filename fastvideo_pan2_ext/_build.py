"""Build step: install ``fastvideo_pan2_ext-plugins.pth`` at the top of site-packages.

setuptools has no declarative way to put a file at the root of site-packages, so `build_py` is extended (wired in
pyproject's ``[tool.setuptools.cmdclass]``). A regular build writes the file into ``build_lib`` (the wheel's root);
an editable build (PEP 660) writes it into the editable wheel's root, which is where setuptools sends every file that
is not part of the editable mapping. Either way pip installs it into site-packages, where ``site`` runs its one line
at start-up: it only installs `fastvideo_import_hook` (see there), nothing heavy.
"""

from __future__ import annotations

import os

from setuptools.command.build_py import build_py

PTH_NAME = "fastvideo_pan2_ext-plugins.pth"  # sorts after setuptools' "__editable__.*.pth", which must run first
PTH_LINE = (
    "import sys; exec('try:\\n import fastvideo_pan2_ext.fastvideo_import_hook as h; h.install()\\n"
    "except Exception as e:\\n print(\"fastvideo_pan2_ext: plugin hook not installed:\", e, file=sys.stderr)')\n"
)


class BuildPyWithPluginHook(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            target = self.get_finalized_command("install").install_lib  # the editable wheel's root
        else:
            target = self.build_lib
        os.makedirs(target, exist_ok=True)
        path = os.path.join(target, PTH_NAME)
        with open(path, "w", encoding="utf-8") as f:
            f.write(PTH_LINE)
        self._pth_output = path

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, PTH_NAME))
        return outputs
