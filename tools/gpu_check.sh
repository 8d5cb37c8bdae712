#!/usr/bin/env bash
# The compiled decoder's GPU check (tools/gpu_check.py says what it measures; docs/design.md, "The GPU check").
#
#   tools/make_gpu_bundle.sh          # here, once: CUTLASS headers, ninja and the diffusers wheels -> build/gpu_bundle
#   tools/gpu_check.sh [--out DIR]    # on the GPU machine, from a bare copy of the tree (carry build/gpu_bundle)
#   tools/gpu_check.sh --dry-run      # anywhere: every step on CPU at tiny sizes
#
# Needs only python3 with torch, a C++ compiler and nvcc on the machine: the package is used from this checkout (no
# install; tools/gpu_check.py puts the checkout first on its path), everything else comes from the bundle where the
# machine lacks it.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bundle="$repo/build/gpu_bundle"

if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -x "$repo/.venv/bin/python" ]; then py="$repo/.venv/bin/python"
else py=$(command -v python3 || command -v python); fi

if [ -z "${WAN22_CUTLASS_DIR:-}" ] && [ -d "$bundle/cutlass/include" ]; then export WAN22_CUTLASS_DIR="$bundle/cutlass"; fi
if ! command -v ninja >/dev/null && [ -x "$bundle/bin/ninja" ]; then export PATH="$bundle/bin:$PATH"; fi
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
# The diffusers baseline: its wheels, installed into a throwaway folder behind the machine's own packages.
if [ -d "$bundle/wheels" ] && ! "$py" -c 'import diffusers' 2>/dev/null; then
    site=$(mktemp -d)
    "$py" -m pip install --quiet --no-index --no-deps --no-compile --target "$site" "$bundle"/wheels/*.whl
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$site"
fi
export MAX_JOBS=${MAX_JOBS:-$(( $(nproc) < 8 ? $(nproc) : 8 ))}
export PYTHONUNBUFFERED=1

exec "$py" "$repo/tools/gpu_check.py" "$@"
