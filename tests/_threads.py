"""One thread count for computations a test compares bit for bit: oneDNN and the BLAS may block (and so order) their
sums differently at another thread count, so a rank process and the decode it is compared with run at the same one.
"""

from __future__ import annotations

import contextlib

import torch

RANK_THREADS = 1  # what every spawned rank sets first, and what the comparison in the test process runs at


@contextlib.contextmanager
def torch_threads(n: int = RANK_THREADS):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
