"""PAN2 in FastVideo: FastVideo's compat package (`compat`: every FastVideo name used, one module per FastVideo area),
registration, the CLI's --pipeline, the pipeline and its stages, the fast decoder and the fast encoder inside
FastVideo, the streamed save, and PAN2's server (`serving`, `uploads`, `http_limits`; docs/design.md, "Rooms").

FastVideo is imported before any module of this room: its plugin loader then runs this package's `register()`, which
imports the modules it needs whole, whichever of them a caller imported first (no half-imported module, no cycle).
"""

import fastvideo  # noqa: F401  (first: see above)
