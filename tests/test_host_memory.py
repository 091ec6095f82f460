"""glibc malloc keeps freed memory after ``keep_freed_memory()``: once the heap has grown to
the loop's working set (a few rounds: alignment padding fragments it at first), a large
buffer allocated and freed every round costs no new page faults; without the tuning every
round maps and faults it anew (the negative control)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")

PROBE = """
import json, resource, sys, torch
from tape_train.host_memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "tuned" else False
faults = []
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf = torch.ones(64 * 2**20 // 4)   # 64 MiB, above glibc's largest mmap threshold
    del buf
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_freed_buffers_are_reused_without_new_page_faults():
    pages = 64 * 2**20 // 4096
    tuned, default = _probe("tuned"), _probe("default")
    assert tuned["applied"]
    # The last 8 rounds, most of them: the kernel may fault resident pages again on its own
    # (swap, page migration, NUMA hinting: seen once under the full suite's load, a whole
    # round of the reused buffer faulted), so one stray round must not decide either way.
    assert sum(f < pages // 20 for f in tuned["faults"][-8:]) >= 6, tuned   # reused
    assert sum(f > pages // 2 for f in default["faults"][-8:]) >= 6, default  # mmap'd anew
