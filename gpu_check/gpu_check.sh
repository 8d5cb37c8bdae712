#!/usr/bin/env bash
# The compiled decoder's GPU check in two commands (docs/gpu-check.md says how to run them; gpu_check/gpu_check.py what
# each measures):
#
#   gpu_check/make_gpu_bundle.sh                # here, once: CUTLASS headers, ninja, wheels -> build/gpu_bundle
#   gpu_check/gpu_check.sh --part 1 [--out DIR] # on the GPU machine, from a bare copy of the tree
#   gpu_check/gpu_check.sh --part 2 [--out DIR]
#   gpu_check/gpu_check.sh --part 1 --dry-run   # anywhere: every step on CPU at tiny sizes
#
# Needs only python3 with torch, a C++ compiler and nvcc on the machine: the package is used from this checkout (no
# install; gpu_check/gpu_check.py puts the checkout first on its path), everything else comes from the bundle where the
# machine lacks it. Part 2 installs the bundle's wheels (diffusers, FastVideo and what FastVideo needs that the machine
# lacks) and this checkout, without dependencies, into a throwaway environment layered over the machine's own
# packages, so that FastVideo's spawned workers find the PAN2 plugin as they would after `pip install`.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bundle="$repo/build/gpu_bundle"

if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -x "$repo/.venv/bin/python" ]; then py="$repo/.venv/bin/python"
else py=$(command -v python3 || command -v python); fi

part=1
prev=
for arg in "$@"; do
    if [ "$prev" = --part ]; then part=$arg; fi
    case $arg in --part=*) part=${arg#--part=} ;; esac
    prev=$arg
done

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
if [ -z "${WAN22_CUTLASS_DIR:-}" ] && [ -f "$bundle/cutlass.tar.xz" ]; then
    mkdir "$scratch/cutlass"
    tar -C "$scratch/cutlass" -xJf "$bundle/cutlass.tar.xz"
    export WAN22_CUTLASS_DIR="$scratch/cutlass"
fi
if ! command -v ninja >/dev/null && [ -x "$bundle/bin/ninja" ]; then export PATH="$bundle/bin:$PATH"; fi
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi

if [ "$part" = 2 ] && [ -d "$bundle/wheels" ]; then
    # A venv whose site-packages first takes in the machine's own (a .pth line runs site.addsitedir on each, so their
    # own .pth files run too), then the wheels and this checkout, all without dependencies and without the network.
    env="$scratch/env"
    "$py" -m venv --without-pip "$env"
    parent_sites=$("$py" -c 'import site; print("\n".join(site.getsitepackages()))')
    site_dir=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    while IFS= read -r dir; do echo "import site; site.addsitedir('$dir')"; done <<<"$parent_sites" \
        >"$site_dir/00-gpu-machine.pth"
    "$py" -m pip --python "$env/bin/python" install --quiet --no-index --no-deps --no-compile --no-build-isolation \
        "$bundle"/wheels/*.whl "$repo" || echo "gpu_check.sh: installing the bundle's wheels failed" >&2
    py="$env/bin/python"
fi
export MAX_JOBS=${MAX_JOBS:-$(( $(nproc) < 8 ? $(nproc) : 8 ))}
export PYTHONUNBUFFERED=1

"$py" "$repo/gpu_check/gpu_check.py" "$@"
