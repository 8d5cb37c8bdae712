"""Build step: install ``fastvideo_pan2_ext-plugins.pth`` at the top of site-packages.

setuptools has no declarative way to put a file at the root of site-packages, so `build_py` is extended (wired in
pyproject's ``[tool.setuptools.cmdclass]``). A regular build writes the file into ``build_lib`` (the wheel's root);
an editable build (PEP 660) writes it into the editable wheel's root, which is where setuptools sends every file that
is not part of the editable mapping. Either way pip installs it into site-packages, where ``site`` runs its one line
at start-up. That line defines and installs `HOOK_STUB`, a ten-line finder that imports nothing (not even this
package) until ``fastvideo`` itself is imported; then it hands over to `import_hook.spec_for`. A failure
there (say, the package half-uninstalled) removes the stub and lets FastVideo import without plugins.
"""

from __future__ import annotations

import os

from setuptools.command.build_py import build_py

PTH_NAME = "fastvideo_pan2_ext-plugins.pth"  # sorts after setuptools' "__editable__.*.pth", which must run first
HOOK_STUB = """\
class FastVideoImportHook:
    def find_spec(self, name, path=None, target=None):
        if name != "fastvideo":
            return None
        try:
            from fastvideo_pan2_ext.plugin_loader.import_hook import spec_for
        except Exception:
            sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "FastVideoImportHook"]
            return None
        return spec_for(name)
if not any(type(f).__name__ == "FastVideoImportHook" for f in sys.meta_path):
    sys.meta_path.insert(0, FastVideoImportHook())
"""


def pth_line() -> str:
    """One line of Python for `site` to run at start-up: define and install `HOOK_STUB`."""
    return f"import sys; exec({HOOK_STUB!r}, {{'sys': sys, '__name__': 'fastvideo_pan2_ext_plugins_pth'}})\n"


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
            f.write(pth_line())
        self._pth_output = path

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, PTH_NAME))
        return outputs
