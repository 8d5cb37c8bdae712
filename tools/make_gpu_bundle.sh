#!/usr/bin/env bash
# Copy what tools/gpu_check.sh needs beyond torch into build/gpu_bundle (git-ignored, ~30 MB), so a GPU machine
# without network gets it with the checkout: CUTLASS headers (include/ and tools/util/include/) and a ninja binary.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$repo/.venv/bin/python}
src=$("$py" -c 'import cutlass_library, pathlib; print(pathlib.Path(cutlass_library.__file__).parent / "source")')
bundle="$repo/build/gpu_bundle"
rm -rf "$bundle"
mkdir -p "$bundle/cutlass/tools/util" "$bundle/bin"
cp -r "$src/include" "$bundle/cutlass/include"
cp -r "$src/tools/util/include" "$bundle/cutlass/tools/util/include"
cp "$(dirname "$py")/ninja" "$bundle/bin/ninja" 2>/dev/null || cp "$(command -v ninja)" "$bundle/bin/ninja"
du -sh "$bundle"
