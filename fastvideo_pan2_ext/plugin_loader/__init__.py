"""FastVideo plugin loader: runs the entry points of group ``fastvideo.plugins`` once per process.

FastVideo 0.2.1 has no plugin hook of its own, so this package supplies one (modelled on vLLM's
``vllm.plugins.load_general_plugins``). `import_hook` calls `load_plugins()` right after ``import
fastvideo`` finishes, in every process that imports FastVideo, including its spawned workers.

What a plugin author must know: plugins run in every process (the CLI parent and each worker), possibly more than
once across processes, so ``register()`` functions must be idempotent and cheap.

``FASTVIDEO_PLUGINS`` filters them: unset loads every installed plugin; a comma-separated list of entry-point names
loads only those (``FASTVIDEO_PLUGINS=`` loads none). A plugin's pipeline is named like its entry point, so
``fastvideo generate --pipeline NAME`` for an installed plugin the filter left out ends with one line saying so (without
the plugin nothing adds ``--pipeline``, and FastVideo would only ask for ``--config``).
"""

from __future__ import annotations

import logging
import os
import sys

PLUGINS_GROUP = "fastvideo.plugins"
PLUGINS_ENV = "FASTVIDEO_PLUGINS"

logger = logging.getLogger(__name__)

_plugins_loaded = False


def _selected(environ) -> set[str] | None:
    """The plugin names FASTVIDEO_PLUGINS allows, or None for all."""
    raw = environ.get(PLUGINS_ENV)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _refuse_cli_pipeline_of(filtered_out: set[str], environ) -> None:
    """`fastvideo generate --pipeline NAME` with NAME's plugin filtered out: one error line, exit code 2."""
    argv = sys.argv
    if len(argv) < 2 or os.path.basename(argv[0]) != "fastvideo" or argv[1] != "generate":
        return
    names = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--pipeline"]
    names += [arg.partition("=")[2] for arg in argv if arg.startswith("--pipeline=")]
    for name in names:
        if name in filtered_out:
            print(f"fastvideo generate: error: --pipeline {name}: the {name!r} plugin is installed but "
                  f"{PLUGINS_ENV}={environ.get(PLUGINS_ENV)!r} leaves it out (unset {PLUGINS_ENV} or list "
                  f"{name} in it)", file=sys.stderr)
            raise SystemExit(2)


def load_plugins(environ=None) -> dict[str, object]:
    """Load and call every allowed ``fastvideo.plugins`` entry point, once per process.

    Returns {name: result} for the plugins that ran now (empty on later calls). A plugin that raises is logged
    with its traceback and skipped: one broken plugin never takes FastVideo down.
    """
    global _plugins_loaded
    if _plugins_loaded:
        return {}
    _plugins_loaded = True

    from importlib.metadata import entry_points

    environ = os.environ if environ is None else environ
    discovered = list(entry_points(group=PLUGINS_GROUP))
    allowed = _selected(environ)
    logger.debug("FastVideo plugins found: %s", [ep.name for ep in discovered])
    if allowed is not None:
        logger.debug("%s=%s: loading only %s", PLUGINS_ENV, environ.get(PLUGINS_ENV), sorted(allowed))

    if allowed is not None:
        _refuse_cli_pipeline_of({ep.name for ep in discovered} - allowed, environ)
    results: dict[str, object] = {}
    seen: set[str] = set()
    for ep in discovered:
        if ep.name in seen or (allowed is not None and ep.name not in allowed):
            continue
        seen.add(ep.name)
        try:
            results[ep.name] = ep.load()()
            logger.debug("FastVideo plugin %r (%s) loaded", ep.name, ep.value)
        except Exception as exc:  # one line; the traceback at DEBUG level
            logger.error("FastVideo plugin %r (%s) failed to load; continuing without it: %s: %s", ep.name, ep.value,
                         type(exc).__name__, exc)
            logger.debug("traceback of plugin %r", ep.name, exc_info=True)
    return results
