"""One fallback policy for every route of a Wan VAE's `decode` / `encode` to a fast worker, in both integrations
(docs/design/worker.md, "One fallback policy").

Where the fast worker cannot serve a call (a VAE outside its architecture, weights it cannot take, diffusers'
layerwise casting or hooks, a compiled module, weights offloaded layer by layer, autograd recording, an input it does
not take, ...), the stock method runs (diffusers' or FastVideo's own), after one warning per VAE and reason saying
why and what runs instead; the worker's prepared weights leave the device while the stock method runs (the worker
stays, and prepares them again at its next call). The reasons are read at every call, so the fast worker serves again
once the cause is gone. Options are not a fallback: a bad one is an error at the switch. Each route says what it
cannot serve and how its warning is given (`emit`: diffusers' routes `warnings.warn`, FastVideo's its log).
"""

from __future__ import annotations

import weakref
from typing import Callable


class Fallback:
    """The fallback of one routed method: `name` prefixes its warnings ("enable_fast_decode", "fast VAE encoder"),
    `verb` and `stock` say what runs instead ("encoding", "FastVideo's own encode"), `emit(message)` gives a
    warning."""

    def __init__(self, name: str, verb: str, stock: str, emit: Callable[[str], None]) -> None:
        self.name, self.verb, self.stock, self.emit = name, verb, stock, emit
        self._given: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owner -> the kinds warned of

    def warn_once(self, owner, kind: str, message: str) -> None:
        """`message` as a warning, once per `owner` (the VAE, or the route on it) and `kind`."""
        given = self._given.setdefault(owner, set())
        if kind not in given:
            given.add(kind)
            self.emit(f"{self.name}: {message}")

    def __call__(self, owner, kind: str, why: str, worker=None) -> None:
        """The stock method is about to run instead of the fast one because of `why` (of kind `kind`): one warning per
        `owner` and kind, and `worker`'s prepared weights (if any) leave the device."""
        self.warn_once(owner, kind, f"{why}; {self.verb} with {self.stock}")
        if worker is not None and worker.weights:
            worker.release_weights()
