"""The GPU check of the compiled decoder (`bash gpu_check/gpu_check.sh --part 1|2`, from the root of a bare copy of
the tree; docs/gpu-check.md says how, gpu_check/gpu_check.py what it measures), the bundle it carries
(gpu_check/make_gpu_bundle.sh) and the compiled extension's CPU stand-in (gpu_check/emulated_extension.py), which the
tests hand to the loader too. Not part of the package."""
