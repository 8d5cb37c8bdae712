#!/usr/bin/env bash
# One-time set-up, safe to run again: a Python 3.12 virtual environment in .venv with this package (editable, with
# its test and serve extras) and the real FastVideo 0.2.1. A second run with unchanged inputs returns in about a
# second.
set -euo pipefail
cd "$(dirname "$0")"

find_python312() {
    local candidate
    for candidate in "${PYTHON312:-}" "$(command -v python3.12 || true)" \
                     "$(pyenv prefix 3.12 2>/dev/null | head -n1)/bin/python3.12" \
                     "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
        if [ -n "$candidate" ] && [ -x "$candidate" ] &&
           "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

venv=.venv
stamp="$venv/.setup-inputs"
# plugin_loader/pth_hook.py writes the plugin hook .pth, which an editable install copies rather than links: a change must reinstall.
inputs=$(cat pyproject.toml setup.sh fastvideo_pan2_ext/plugin_loader/pth_hook.py fastvideo_pan2_ext/version.py | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs" ] && "$venv/bin/python" -c 'import fastvideo_pan2_ext' 2>/dev/null; then
    exit 0
fi

python312=$(find_python312) || {
    echo "setup.sh: Python 3.12 not found (fastvideo-kernel ships cp312 wheels only)." >&2
    echo "          Put python3.12 on PATH, install it with pyenv, or set PYTHON312=/path/to/python3.12." >&2
    exit 1
}
echo "setup.sh: using $python312"
start=$(date +%s)
[ -x "$venv/bin/python" ] || "$python312" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
# setuptools tells every editable install with mapped folders to beware of same-named folders in the working
# directory; here that folder is the package itself (fastvideo_pan2_ext/ links the rooms), so the notice is noise.
PYTHONWARNINGS="ignore:Editable installation" "$venv/bin/python" -m pip install --quiet -e ".[test,serve]" \
    "fastvideo==0.2.1"

# `import fastvideo` has two upstream breakers (README, "Set-up notes"). Each package is removed only when importing
# it fails on this machine, so GPU machines and fixed upstream releases keep it.
remove_if_broken() {  # package-name import-name why
    local err
    if ! err=$("$venv/bin/python" -c "import $2" 2>&1); then
        echo "setup.sh: removing $1 ($3): $(echo "$err" | tail -n1)"
        "$venv/bin/python" -m pip uninstall --quiet --yes "$1"
    fi
}
# fastvideo wants torchaudio unpinned; the newest (2.11.1) is built for torch 2.11 and cannot load beside torch 2.12,
# which breaks every transformers and diffusers import. Nothing in PAN2 uses audio.
remove_if_broken torchaudio torchaudio "ABI mismatch with this torch"
# fastvideo-kernel's Triton kernels ask for a GPU driver when imported; FastVideo imports it under
# `except ImportError`, so without it FastVideo uses its other attention backends, as it must without a GPU anyway.
remove_if_broken fastvideo-kernel fastvideo_kernel "needs a GPU driver at import"
"$venv/bin/python" -c 'import fastvideo' || { echo "setup.sh: import fastvideo still fails" >&2; exit 1; }

echo "$inputs" > "$stamp"
echo "setup.sh: ready in $(( $(date +%s) - start )) s ($(du -sh "$venv" | cut -f1) in $venv)"
