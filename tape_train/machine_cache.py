"""Per-machine cache of small measurements (bf16 speed, GEMM peaks), so they are taken once.

A measurement is keyed by what decides its value: the CPU model and ISA flags, the torch
version, the ISA limits set in the environment (``ATEN_CPU_CAPABILITY``,
``ONEDNN_MAX_CPU_ISA``) and the caller's own key (dtype, threads). The cache is one JSON file,
``$TAPE_TRAIN_CACHE_DIR`` or ``$XDG_CACHE_HOME/tape-train`` (default ``~/.cache/tape-train``)
``/measurements.json``; an unreadable or unwritable cache, or none at all (no ``HOME``), only
means measuring again. The same
directory (``cache_dir``) holds the demo corpus's downloads (``tape-data prepare --demo``).
``usable_cpus`` says how many CPUs this process may run on.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from collections.abc import Callable
from pathlib import Path

from tape_train.files import write_atomic

CACHE_ENV = "TAPE_TRAIN_CACHE_DIR"
# /proc/cpuinfo flags that decide how fast bf16 and fp32 GEMMs can be.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (what Slurm's ``--cpus-per-task``, a
    cgroup cpuset or ``taskset`` leave it), not the machine's count, which oversubscribes a
    job that shares its node."""
    return len(usable_cpu_ids())


def usable_cpu_ids() -> list[int]:
    """The ids of ``usable_cpus`` (all of the machine's where the mask is unknown)."""
    try:
        return sorted(os.sched_getaffinity(0)) or [0]
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


class NoCacheDir(OSError):
    """No cache directory can be named: no ``$TAPE_TRAIN_CACHE_DIR``/``$XDG_CACHE_HOME`` and no
    home directory (``HOME`` unset and a user id the password database lacks: a container
    started with ``--user``)."""


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except (RuntimeError, KeyError) as exc:  # Path.home() without HOME or a passwd entry
            raise NoCacheDir(f"no cache directory: HOME is unset and user id {os.getuid()} has "
                             f"no home directory in the password database ({exc}); set "
                             f"{CACHE_ENV} or HOME") from None
    return Path(base) / "tape-train"


def cpu_info() -> tuple[str, frozenset[str]]:
    """(model name, flags) from /proc/cpuinfo; ('', {}) where it cannot be read."""
    model, flags = platform.processor() or "", frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and value.strip():
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return model, flags


# The ATEN_CPU_CAPABILITY values torch takes at their word, without asking the CPU, and the
# /proc/cpuinfo flags the kernels they select need (those torch requires when it chooses),
# the highest first.
ATEN_CAPABILITY_NEEDS = {"avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"),
                         "avx2": ("avx2", "fma")}


def isa_limit_error() -> str | None:
    """Why ``ATEN_CPU_CAPABILITY`` would kill this process, or None: a value asking for more
    than this CPU has (an environment copied from another node) makes torch run instructions
    the CPU lacks, and the first vectorised operation dies with SIGILL ("Illegal instruction")."""
    value = os.environ.get("ATEN_CPU_CAPABILITY", "")
    _, flags = cpu_info()
    if value not in ATEN_CAPABILITY_NEEDS or not flags:  # flags unknown: torch decides
        return None
    missing = [f for f in ATEN_CAPABILITY_NEEDS[value] if f not in flags]
    if not missing:
        return None
    fits = next((name for name, needs in ATEN_CAPABILITY_NEEDS.items()
                 if all(f in flags for f in needs)), "default")
    return (f"ATEN_CPU_CAPABILITY={value} makes torch use instructions this CPU lacks (no "
            f"{', '.join(missing)} in /proc/cpuinfo): it would die with 'Illegal instruction'; "
            f"unset it (torch then picks what the CPU has) or set it to {fits}")


def machine_key() -> str:
    """What a CPU measurement depends on, as a short stable string."""
    import torch

    model, flags = cpu_info()
    parts = [model, ",".join(f for f in ISA_FLAGS if f in flags), torch.__version__,
             torch.backends.cpu.get_cpu_capability(),
             os.environ.get("ATEN_CPU_CAPABILITY", ""), os.environ.get("ONEDNN_MAX_CPU_ISA", "")]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def busy_cpu() -> str | None:
    """A description of the load when the machine is busier than it has cores, else None (a
    measurement taken then is low and must not be kept)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None
    cores = os.cpu_count() or 1
    return f"load {load:.1f} on {cores} cores" if load > cores else None


def cached(name: str, key: str, measure: Callable[[], float], keep: bool = True
           ) -> tuple[float, bool]:
    """``measure()`` once per (machine, ``name``, ``key``); returns (value, was_cached).

    With ``keep=False`` a missing value is measured but not stored (a busy machine)."""
    full_key = f"{name}/{machine_key()}/{key}"
    try:
        path = cache_dir() / "measurements.json"
    except NoCacheDir:  # nowhere to keep it: measured every time
        return float(measure()), False
    try:
        table = json.loads(path.read_text())
        if not isinstance(table, dict):
            table = {}
    except (OSError, ValueError):
        table = {}
    value = table.get(full_key)
    # A damaged entry (0, negative, Infinity: json reads it) is measured again, never used:
    # an infinite GEMM peak would make every MFU 0.
    if isinstance(value, (int, float)) and 0 < value < math.inf:
        return float(value), True
    value = float(measure())
    if not keep:
        return value, False
    table[full_key] = value
    try:  # a failed write (a full disk) leaves the old table and no temporary file
        write_atomic(path, json.dumps(table, indent=1, sort_keys=True))
    except OSError:
        pass
    return value, False
