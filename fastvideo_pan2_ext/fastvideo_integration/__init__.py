"""PAN2 in FastVideo: the one seam to FastVideo's internals (`adapter`), registration, the CLI's --pipeline, the
pipeline and its stages, the fast decoder inside FastVideo and the streamed save (docs/design.md, "Rooms").

FastVideo is imported before any module of this room: its plugin loader then runs this package's `register()`, which
imports the modules it needs whole, whichever of them a caller imported first (no half-imported module, no cycle).
"""

import fastvideo  # noqa: F401  (first: see above)
