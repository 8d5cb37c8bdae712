"""The working tree as the GPU machine and a fresh clone get it: the files git tracks or would track (untracked and
not ignored), with symbolic links kept as links."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def source_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                         check=True, capture_output=True).stdout.decode()
    return sorted(f for f in out.split("\0") if f and os.path.lexists(REPO / f))


def copy_source_tree(dest: Path) -> Path:
    """Copy the tree into `dest` (created); returns `dest`."""
    for source in source_files():
        destination = dest / source
        destination.parent.mkdir(parents=True, exist_ok=True)
        if (REPO / source).is_symlink():
            destination.symlink_to(os.readlink(REPO / source))
        else:
            shutil.copy2(REPO / source, destination)
    return dest
