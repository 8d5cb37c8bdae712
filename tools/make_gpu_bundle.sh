#!/usr/bin/env bash
# What tools/gpu_check.sh needs beyond the GPU machine's own packages (torch, numpy, pillow, tqdm, huggingface-hub,
# safetensors, ...; see docs/design.md, "The GPU check"), into build/gpu_bundle (git-ignored; carry it):
#   cutlass/    CUTLASS headers (include/ and tools/util/include/) from the nvidia-cutlass wheel
#   bin/ninja   the build tool, for a machine without one
#   wheels/     diffusers and importlib_metadata (the one diffusers requirement that machine lacks), for the
#               diffusers baseline; the versions installed here
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$repo/.venv/bin/python}
src=$("$py" -c 'import cutlass_library, pathlib; print(pathlib.Path(cutlass_library.__file__).parent / "source")')
bundle="$repo/build/gpu_bundle"
rm -rf "$bundle"
mkdir -p "$bundle/cutlass/tools/util" "$bundle/bin" "$bundle/wheels"
cp -r "$src/include" "$bundle/cutlass/include"
cp -r "$src/tools/util/include" "$bundle/cutlass/tools/util/include"
cp "$(dirname "$py")/ninja" "$bundle/bin/ninja" 2>/dev/null || cp "$(command -v ninja)" "$bundle/bin/ninja"
pins=$("$py" -c 'import importlib.metadata as m; print(*(f"{d}=={m.version(d)}" for d in ("diffusers", "importlib_metadata")))')
# shellcheck disable=SC2086
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform any -d "$bundle/wheels" $pins
du -sh "$bundle"
