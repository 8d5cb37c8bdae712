"""Injects a fault into PAN2's decoding stage in every process of a test server (tests/_serve_helpers.py puts this
folder first on PYTHONPATH and names the prompt in PAN2_TEST_FAULT_PROMPT): a request whose prompt contains it runs
out of memory in the worker's decode, as a GPU would. Nothing in the package knows of it."""

import importlib.abc
import importlib.util
import os
import sys

FAULT_PROMPT = os.environ.get("PAN2_TEST_FAULT_PROMPT")
TARGET = "fastvideo_pan2_ext.integration.stages"


def _inject(module) -> None:
    import torch

    stage = module.PAN2DecodingStage
    forward = stage.forward

    def failing_forward(self, batch, fastvideo_args):
        if FAULT_PROMPT in str(batch.prompt):
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return forward(self, batch, fastvideo_args)

    stage.forward = failing_forward


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _inject(module)

        spec.loader.exec_module = exec_module
        return spec


if FAULT_PROMPT:
    sys.meta_path.insert(0, _AfterImport())
