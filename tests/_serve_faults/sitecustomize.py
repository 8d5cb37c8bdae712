"""Injects faults into every process of a test server (tests/_serve_helpers.py puts this folder first on PYTHONPATH
and names the prompts): a request whose prompt contains PAN2_TEST_FAULT_PROMPT runs out of memory in the worker's
decode, as a GPU would; one whose prompt contains PAN2_TEST_PAUSE_PROMPT waits in the server, once its video is in
place and before its job ends, printing PAN2_TEST_PAUSED and the video's path (a server stopped then has a job that
wrote its video but never ended). Nothing in the package knows of them."""

import importlib.abc
import importlib.util
import os
import sys
import time

FAULT_PROMPT = os.environ.get("PAN2_TEST_FAULT_PROMPT")
PAUSE_PROMPT = os.environ.get("PAN2_TEST_PAUSE_PROMPT")
PAUSED = os.environ.get("PAN2_TEST_PAUSED")
PAUSE_S = 20


def _inject_decode_oom(module) -> None:
    import torch

    stage = module.PAN2DecodingStage
    forward = stage.forward

    def failing_forward(self, batch, fastvideo_args):
        if FAULT_PROMPT in str(batch.prompt):
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return forward(self, batch, fastvideo_args)

    stage.forward = failing_forward


def _inject_pause(module) -> None:
    generate = module._generate_pan2  # the parent's save step, looked up by name when a request is made

    def pausing(original, generator, prompt, *args, **kwargs):
        result = generate(original, generator, prompt, *args, **kwargs)
        if PAUSE_PROMPT in str(prompt):
            print(f"{PAUSED} {result.get('video_path')}", flush=True)
            time.sleep(PAUSE_S)
        return result

    module._generate_pan2 = pausing


TARGETS = {}
if FAULT_PROMPT:
    TARGETS["fastvideo_pan2_ext.fastvideo_integration.stages"] = _inject_decode_oom
if PAUSE_PROMPT:
    TARGETS["fastvideo_pan2_ext.fastvideo_integration.streamed_save"] = _inject_pause


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        inject = TARGETS.pop(name, None)
        if inject is None:
            return None
        sys.meta_path.remove(self)  # the module as the other finders find it
        try:
            spec = importlib.util.find_spec(name)
        finally:
            if TARGETS:
                sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            inject(module)

        spec.loader.exec_module = exec_module
        return spec


if TARGETS:
    sys.meta_path.insert(0, _AfterImport())
