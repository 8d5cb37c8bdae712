"""Run FastVideo's plugins right after ``import fastvideo`` finishes (never at interpreter start-up).

``fastvideo_pan2_ext-plugins.pth`` (installed into site-packages by both ``pip install .`` and ``pip install -e .``)
puts a ten-line copy of `FastVideoImportHook` on ``sys.meta_path`` at start-up (`pth_hook.HOOK_STUB`). It imports
nothing and answers for one module name, ``fastvideo``: when that import happens it imports this module and calls
`spec_for`, which removes the hook, lets the real finders locate FastVideo, and wraps the loader so that once
``fastvideo/__init__.py`` has run, `fastvideo_pan2_ext.plugin_loader.load_plugins` is called. Spawned workers are fresh
interpreters, so they get the hook (and the plugins) too.

Only the standard library is used here.
"""

import sys

TARGET = "fastvideo"


class _RunPluginsAfterExec:
    """Loader wrapper: executes the real ``fastvideo`` module, then loads the plugins."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            from fastvideo_pan2_ext.plugin_loader import load_plugins

            load_plugins()
        except Exception:  # the loader itself must never break `import fastvideo`
            import logging

            logging.getLogger(__name__).exception("running FastVideo plugins failed")

    def __getattr__(self, name):  # get_resource_reader, is_package, ... come from the real loader
        return getattr(self._loader, name)


def spec_for(fullname: str):
    """The real spec of ``fastvideo``, its loader wrapped to load the plugins after it; removes the hook."""
    uninstall()
    from importlib.util import find_spec

    spec = find_spec(fullname)  # the real finders, now that the hook is out of the way
    if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
        return spec
    spec.loader = _RunPluginsAfterExec(spec.loader)
    return spec


class FastVideoImportHook:
    """A ``sys.meta_path`` finder that answers only for ``fastvideo`` and only once."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        return spec_for(fullname)


def _is_hook(finder) -> bool:
    # By name: the .pth file's stub and this class are different class objects.
    return type(finder).__name__ == FastVideoImportHook.__name__


def install() -> None:
    """Put the hook in front of ``sys.meta_path`` (no-op if FastVideo is already imported or the hook is there)."""
    if TARGET in sys.modules or any(_is_hook(f) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, FastVideoImportHook())


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not _is_hook(f)]
