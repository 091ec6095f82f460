"""Keep freed host memory in the process: glibc's malloc set up for training loops on CPU.

A CPU training step allocates and frees the same large buffers every step (the (b, N, V)
logits, activations, gradients). glibc serves every allocation above its mmap threshold (at
most 32 MiB) with a fresh ``mmap`` and unmaps it on ``free``, so each step page-faults and
zero-fills those buffers again; measured here that was 12–16 % of a ``125m`` step
(docs/training.md). Turning off mmap-backed allocations and heap trimming makes freed memory
reusable by the next step: what preloading jemalloc or tcmalloc does for PyTorch on CPUs,
without a dependency. The process's RSS then stays at its peak (which a training step
reaches every step anyway).
"""

from __future__ import annotations

import ctypes
import logging
import platform

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_applied = False


def keep_freed_memory() -> bool:
    """Tune glibc malloc once per process; False (and no change) where libc is not glibc."""
    global _applied
    if _applied:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    if ok:
        _applied = True
        log.info("host memory: glibc malloc keeps freed memory (mmap and trimming off; "
                 "train.keep_freed_memory=false restores the defaults)")
    return ok
