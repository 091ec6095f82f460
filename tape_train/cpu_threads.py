"""How many OpenMP threads each CPU training process gets, from the cores idle right now.

torch's default is one thread per core. On a machine where other work keeps cores busy that
is the slowest choice there is: OpenMP's barriers wait for the thread that shares its core,
and every parallel region runs at the busy core's pace. Measured on 2 cores (the demo's tiny
model, fp32, AVX2): 0.26 s per step with 2 threads and 0.46 s with 1 on a quiet machine, but
0.80 s with 2 and 0.46 s with 1 while another process kept one core busy.

So ``launch/local.sh`` (and the trainer when started by hand on CPU, and ``tape-eval`` and
``tape-generate`` on CPU) measures how many of the cores it may use are idle over a short
interval (``/proc/stat``) and gives each process ``round(idle / processes)`` threads, at least
1 and at most ``cores / processes``. A value of ``OMP_NUM_THREADS`` set by the user always
wins; one OpenMP cannot read (``abc``, ``0``: libgomp ignores it and takes a thread per core)
is named in a warning and chosen over. Once, at start: the load may change later. The same
holds for evaluation and sampling, measured on 2 cores (the demo's tiny model, fp32): the
demo's evaluation took 2.9 s with 2 threads and 5.3 s with 1 on a quiet machine, 30-36 s with
2 and 5.4-11 s with 1 while another process kept one core busy; 1000 sampled tokens 17-26 s
with 2 threads and 6-9 s with 1 then.

``python -m tape_train.cpu_threads N`` prints the ``OMP_NUM_THREADS`` for N processes (the
user's own when readable) and then the lines to log, if any (what ``launch/local.sh`` calls).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from tape_train.machine_cache import usable_cpu_ids

SAMPLE_S = 0.5


@dataclass(frozen=True)
class ThreadChoice:
    """``threads`` per process and the line that says why (for the log)."""

    threads: int
    reason: str


def _cpu_times(path: str, cpus: set[int]) -> tuple[float, float] | None:
    """(idle, total) jiffies summed over ``cpus`` from a /proc/stat-format file; ``None`` when
    it cannot be read or does not list every one of them (a container whose /proc/stat
    numbers its CPUs otherwise than its affinity mask: the listed ones would speak for
    CPUs they are not)."""
    idle = total = 0.0
    seen: set[int] = set()
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                name, _, rest = line.partition(" ")
                if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
                    continue
                fields = [float(v) for v in rest.split()]
                if len(fields) < 4:
                    continue
                # user nice system idle iowait irq softirq steal (guest is inside user)
                idle += fields[3] + (fields[4] if len(fields) > 4 else 0.0)
                total += sum(fields[:8])
                seen.add(int(name[3:]))
    except (OSError, ValueError):
        return None
    return (idle, total) if seen == cpus else None


def idle_cores(cpus: list[int], sample_s: float = SAMPLE_S,
               stat_path: str = "/proc/stat") -> float | None:
    """How many of ``cpus`` were idle, on average, over the next ``sample_s`` seconds
    (``None`` where /proc/stat cannot tell: not Linux, or no time elapsed on those CPUs)."""
    wanted = set(cpus)
    before = _cpu_times(stat_path, wanted)
    if before is None:
        return None
    time.sleep(sample_s)
    after = _cpu_times(stat_path, wanted)
    if after is None or after[1] <= before[1]:
        return None
    share = (after[0] - before[0]) / (after[1] - before[1])
    return max(0.0, min(1.0, share)) * len(wanted)


def choose_threads(processes: int, cores: int, idle: float | None) -> ThreadChoice:
    """Threads per process for ``processes`` processes on ``cores`` usable cores of which
    ``idle`` are idle (``None``: unknown, all are taken as idle)."""
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    most = max(1, cores // processes)
    if idle is None:
        threads = most
        reason = f"{cores} core(s) / {processes} process(es); the idle cores could not be measured"
    else:
        threads = max(1, min(most, int(idle / processes + 0.5)))
        reason = (f"{idle:.1f} of {cores} core(s) idle over {SAMPLE_S:g} s, {processes} "
                  f"process(es)")
    if threads < most:
        reason += (f": fewer than the {most} a quiet machine would get (threads that share a "
                   f"busy core slow every step)")
    if processes > cores:
        reason += (f"; more processes than cores: they share cores, which is slower than "
                   f"{cores} process(es)")
    return ThreadChoice(threads, reason)


def threads_for(processes: int) -> ThreadChoice:
    """``choose_threads`` on this machine, now."""
    cpus = usable_cpu_ids()
    return choose_threads(processes, len(cpus), idle_cores(cpus))


# What OpenMP (libgomp) reads from OMP_NUM_THREADS: a positive count, or a list of them for
# nested levels ("4,2"), spaces allowed around each.
_OPENMP_THREADS = re.compile(r"\s*0*[1-9][0-9]*\s*(,\s*[0-9]+\s*)*")


def user_threads() -> tuple[bool, str | None]:
    """(whether the user chose the threads with ``OMP_NUM_THREADS``, a warning or None). An
    empty value is no choice; one OpenMP cannot read is none either, and the warning says so
    (libgomp would ignore it and take a thread per core, the slowest choice on a busy
    machine)."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if not value:
        return False, None
    if _OPENMP_THREADS.fullmatch(value):
        return True, None
    return False, (f"OMP_NUM_THREADS={value!r} is not a number of threads (a positive "
                   f"integer), which OpenMP ignores: choosing from the idle cores instead")


def set_torch_threads(processes: int) -> str:
    """Set torch's threads in this process to ``threads_for(processes)`` and return the log
    line that says so (the trainer, ``tape-eval`` and ``tape-generate`` on CPU)."""
    import torch

    choice = threads_for(processes)
    torch.set_num_threads(choice.threads)
    return (f"CPU threads per process: {choice.threads} ({choice.reason}; set "
            f"OMP_NUM_THREADS to choose)")


def adopt_torch_threads(processes: int, say: Callable[[int, str], object]) -> None:
    """What every CPU command does at start (the trainer, ``tape-eval``, ``tape-generate``):
    unless ``OMP_NUM_THREADS`` chose, set torch's threads with ``set_torch_threads``; each line
    to log goes to ``say(level, text)`` (a warning for an unreadable ``OMP_NUM_THREADS``)."""
    chosen, warning = user_threads()
    if warning:
        say(logging.WARNING, warning)
    if not chosen:
        say(logging.INFO, set_torch_threads(processes))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit() or int(args[0]) < 1:
        print("usage: python -m tape_train.cpu_threads PROCESSES  (an integer >= 1)",
              file=sys.stderr)
        return 2
    chosen, warning = user_threads()
    if chosen:
        print(os.environ["OMP_NUM_THREADS"])
        return 0
    choice = threads_for(int(args[0]))
    print(choice.threads)
    if warning:
        print(warning)
    print(f"OMP_NUM_THREADS={choice.threads} per process ({choice.reason}; set "
          f"OMP_NUM_THREADS to choose)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
