"""FastVideo's compat package: every FastVideo name this package relies on, and the code that touches it
(docs/design/fastvideo-integration.md, "FastVideo facts relied on").

One module per FastVideo area; each lists its seams (`SEAMS`: the modules, classes, functions, attributes and
conventions it reads, calls or replaces, each with the reason; `seams.Seam`) and holds the code that uses them:

- `configs`: the configuration classes PAN2's configs are built on;
- `models`: the layers, attention and loaders PAN2's DiT and text encoder are built on, and the FA4 readers;
- `pipelines`: the pipeline base class and stages PAN2Pipeline is made of;
- `registry`: the config, preset, pipeline and model registries, and the hooks on FastVideoArgs;
- `cli`: `fastvideo generate` and `fastvideo serve` extended;
- `executor`: the parent and its workers (a batch's extra, the executor's forward, the world group, the device);
- `wan_vae`: the Wan VAE's config fields and its decode and encode routes;
- `logs`: colour codes only on terminals;
- `cpu_gaps`: FastVideo on a GPU-less machine;
- `http_server`: FastVideo's HTTP server (checked only when a PAN2 server starts: `check_serving`).

Nothing else in the package imports FastVideo beyond its top-level package (tests/repo/test_architecture.py checks the
import graph); other modules get FastVideo's classes from `symbol(name)` and its behaviour from an area's functions.
An upgrade of FastVideo is this folder to read. `check()` (run by `register()`) looks every seam up in the installed
FastVideo and fails with one line naming the FastVideo version and the first missing name, instead of a traceback
deep in a worker. Only the release in `seams.TESTED_RELEASE` is tested, so a seam names that release's spelling.
"""

from __future__ import annotations

from typing import Any

from . import cli, configs, cpu_gaps, executor, http_server, logs, models, pipelines, registry, wan_vae
from .seams import TESTED_RELEASE, IncompatibleFastVideo, Seam, fastvideo_version, lookup

__all__ = ["TESTED_RELEASE", "IncompatibleFastVideo", "Seam", "fastvideo_version", "lookup", "SEAMS", "SERVE_SEAMS",
           "check", "check_serving", "symbol"]

AREAS = (configs, registry, pipelines, cli, executor, wan_vae, cpu_gaps, logs, models)
SEAMS: tuple[Seam, ...] = tuple(seam for area in AREAS for seam in area.SEAMS)
SERVE_SEAMS: tuple[Seam, ...] = http_server.SEAMS


def check() -> None:
    """Raise IncompatibleFastVideo naming the first seam the installed FastVideo does not have."""
    for seam in SEAMS:
        lookup(seam)


def check_serving() -> None:
    """`check` for what a PAN2 server needs besides (`SERVE_SEAMS`)."""
    for seam in SERVE_SEAMS:
        lookup(seam)


_BY_NAME = {seam.name: seam for seam in SEAMS if seam.name}


def symbol(name: str) -> Any:
    """The FastVideo class or function the seam called `name` names (e.g. "PipelineConfig")."""
    return lookup(_BY_NAME[name])
