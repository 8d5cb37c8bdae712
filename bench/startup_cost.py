"""Measure what the plugin hook's .pth costs at interpreter start-up (python -c pass, python -c "import torch").

A/B on the same interpreter: `python -S` + `site.addsitedir(D)`, where D mirrors this venv's site-packages with
symlinks to every entry (A) or to every entry but fastvideo_pan2_ext-plugins.pth (B): the only difference between
the two runs is that file. Runs are interleaved; medians are reported. Also prints what the hook leaves in
sys.modules and `-X importtime` lines mentioning the package.

    .venv/bin/python bench/startup_cost.py [--runs 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

PTH = "fastvideo_pan2_ext-plugins.pth"


def _time(site_dir: str, payload: str) -> float:
    code = f"import site; site.addsitedir({site_dir!r}); {payload}"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-S", "-c", code], check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    real = sysconfig.get_paths()["purelib"]
    if not os.path.exists(os.path.join(real, PTH)):
        sys.exit(f"{PTH} is not installed in {real}")
    with tempfile.TemporaryDirectory() as with_dir, tempfile.TemporaryDirectory() as without_dir:
        for name in os.listdir(real):
            os.symlink(os.path.join(real, name), os.path.join(with_dir, name))
            if name != PTH:
                os.symlink(os.path.join(real, name), os.path.join(without_dir, name))
        for label, payload in (("python -c pass", "pass"), ("python -c 'import torch'", "import torch")):
            with_hook, without = [], []
            for _ in range(args.runs):
                with_hook.append(_time(with_dir, payload))
                without.append(_time(without_dir, payload))
            a, b = statistics.median(with_hook), statistics.median(without)
            print(f"{label:28s} with hook {a * 1000:8.1f} ms   without {b * 1000:8.1f} ms   "
                  f"difference {(a - b) * 1000:+7.1f} ms (median of {args.runs}, interleaved)")
    code = ("import sys; print(sorted(m for m in sys.modules if 'pan2' in m), "
            "[type(f).__name__ for f in sys.meta_path])")
    after = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
    print("after start-up (pan2 modules, sys.meta_path):", after)
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True, text=True).stderr
    print("-X importtime lines mentioning the package (self us | cumulative us | module):")
    for line in out.splitlines():
        if "fastvideo_pan2_ext" in line:
            print("  " + line.split(":", 1)[1].strip())


if __name__ == "__main__":
    main()
