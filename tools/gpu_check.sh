#!/usr/bin/env bash
# The compiled decoder's GPU check on one GPU with no network (see tools/gpu_check.py for what it measures).
#
#   tools/make_gpu_bundle.sh              # here, once: CUTLASS headers + ninja into build/gpu_bundle (git-ignored)
#   tools/gpu_check.sh [--out DIR]        # on the GPU machine (carry build/gpu_bundle); writes DIR/gpu_check.json
#   tools/gpu_check.sh --dry-run          # anywhere: every step on CPU at tiny sizes
#
# Needs only torch, a C++ compiler and nvcc there: the package is used from this checkout (no install), CUTLASS and
# ninja come from the bundle when the machine has none.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bundle="$repo/build/gpu_bundle"

if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -x "$repo/.venv/bin/python" ]; then py="$repo/.venv/bin/python"
else py=$(command -v python3 || command -v python); fi

# The package from this checkout, whether or not it is installed: a shim directory mapping the import names
# (GPU_CHECK_FORCE_SHIM=1 uses it even where the package is installed: the dry-run test proves it that way).
if [ "${GPU_CHECK_FORCE_SHIM:-0}" = 1 ] || ! "$py" -c 'import fastvideo_pan2_ext.vae_kernel.decoder' 2>/dev/null; then
    shim=$(mktemp -d)
    mkdir -p "$shim/fastvideo_pan2_ext"
    ln -s "$repo/fastvideo_pan2_ext/__init__.py" "$shim/fastvideo_pan2_ext/__init__.py"
    ln -s "$repo/reference.py" "$shim/fastvideo_pan2_ext/reference.py"
    ln -s "$repo/vae_kernel" "$shim/fastvideo_pan2_ext/vae_kernel"
    if ! "$py" -c 'import tqdm' 2>/dev/null; then  # the decoder's progress bar; a silent one will do here
        mkdir -p "$shim/tqdm"
        : > "$shim/tqdm/__init__.py"
        printf '%s\n' 'class tqdm:' '    def __init__(self, *a, **k): pass' '    def update(self, n=1): pass' \
            '    def close(self): pass' > "$shim/tqdm/auto.py"
    fi
    export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -z "${WAN22_CUTLASS_DIR:-}" ] && [ -d "$bundle/cutlass/include" ]; then export WAN22_CUTLASS_DIR="$bundle/cutlass"; fi
if ! command -v ninja >/dev/null && [ -x "$bundle/bin/ninja" ]; then export PATH="$bundle/bin:$PATH"; fi
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
export MAX_JOBS=${MAX_JOBS:-$(( $(nproc) < 8 ? $(nproc) : 8 ))}

exec "$py" "$repo/tools/gpu_check.py" "$@"
