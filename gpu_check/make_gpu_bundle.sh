#!/usr/bin/env bash
# What gpu_check/gpu_check.sh needs beyond the GPU machine's own packages (torch, numpy, pillow, transformers, imageio,
# safetensors, ...; see docs/gpu-check.md), into build/gpu_bundle (git-ignored; carry it):
#   cutlass.tar.xz  CUTLASS headers (include/ and tools/util/include/) from the nvidia-cutlass wheel, compressed
#                   (28 MB of headers in about 1 MB; gpu_check.sh unpacks them into a temporary folder)
#   bin/ninja       the build tool, for a machine without one
#   wheels/         part 2 only: diffusers (the baseline), FastVideo 0.2.1 and the modules its import of the PAN2
#                   pipeline, the CLI entry point (the plugin's hook) and the mp4 writer need that the machine lacks;
#                   the versions installed here (imageio-ffmpeg: the newest the index has)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$repo/.venv/bin/python}
src=$("$py" -c 'import cutlass_library, pathlib; print(pathlib.Path(cutlass_library.__file__).parent / "source")')
bundle="$repo/build/gpu_bundle"
rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/wheels"
tar -C "$src" -cf - include tools/util/include | xz -T0 -6 >"$bundle/cutlass.tar.xz"
cp "$(dirname "$py")/ninja" "$bundle/bin/ninja" 2>/dev/null || cp "$(command -v ninja)" "$bundle/bin/ninja"
pinned="diffusers importlib_metadata fastvideo remote-pdb ftfy wcwidth fastapi starlette pydantic pydantic-core
        typing-inspection annotated-types opentelemetry-api"
pins=$("$py" -c 'import sys, importlib.metadata as m; print(*(f"{d}=={m.version(d)}" for d in sys.argv[1:]))' $pinned)
# shellcheck disable=SC2086
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "$bundle/wheels" \
    $pins imageio-ffmpeg
du -sh "$bundle"
