"""FastVideo plugin loader: runs the entry points of group ``fastvideo.plugins`` once per process.

FastVideo 0.2.1 has no plugin hook of its own, so this package supplies one (modelled on vLLM's
``vllm.plugins.load_general_plugins``). `import_hook` calls `load_plugins()` right after ``import
fastvideo`` finishes, in every process that imports FastVideo, including its spawned workers.

What a plugin author must know: plugins run in every process (the CLI parent and each worker), possibly more than
once across processes, so ``register()`` functions must be idempotent and cheap.

``FASTVIDEO_PLUGINS`` filters them: unset loads every installed plugin; a comma-separated list of entry-point names
loads only those (``FASTVIDEO_PLUGINS=`` loads none).
"""

from __future__ import annotations

import logging
import os

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
