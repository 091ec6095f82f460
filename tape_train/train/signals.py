"""Stop requests from the outside world (Slurm pre-emption, Ctrl-C) → a clean checkpointed stop.

The handlers only set a flag (a signal can land inside a collective or a checkpoint write; the
only safe thing there is to remember it). At each step boundary the trainer calls
``StopRequest.agreed(all_reduce_max)`` so every rank sees the same decision at the same step,
then checkpoints and exits with ``exit_code``:

- SIGUSR1 / SIGTERM → 75 (EX_TEMPFAIL): the Slurm batch script requeues the job on 75.
- SIGINT (Ctrl-C)   → 130 (128 + SIGINT), the shell convention; a second Ctrl-C while the
  checkpoint is being written is ignored with a message (use SIGKILL to abandon it).

The first signal is acknowledged on stderr at once, saying what will happen and the exit code.

A launcher killed outright (SIGKILL of ``launch/local.sh`` or of its torchrun, the OOM killer)
sends nothing: torchrun starts each worker in a session of its own, so a process-group kill
misses them too, and the orphans would train on, holding the run-directory lock.
``stop_with_launcher`` asks the kernel for a SIGTERM when this process's parent dies
(``PR_SET_PDEATHSIG``), which the handler above turns into the same stop: a checkpoint at the
next step boundary, exit 75 (the watchdog ends a rank that cannot get there).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

EXIT_REQUEUE = 75
EXIT_INTERRUPTED = 130

# Encoded for the all-reduce: larger wins, so a requeue request (which asks the scheduler to
# continue the job) dominates an interrupt (which asks it to stop) when both arrive.
_NONE, _INTERRUPT, _REQUEUE = 0, 1, 2
_CODES = {_NONE: 0, _INTERRUPT: EXIT_INTERRUPTED, _REQUEUE: EXIT_REQUEUE}


class StopRequest:
    """Installs handlers for SIGUSR1, SIGTERM and SIGINT; restores the old ones on ``close``."""

    def __init__(self) -> None:
        self.local = _NONE
        self.signal_name: str | None = None
        self.launcher: int | None = None  # the parent watched by ``stop_with_launcher``
        self._previous: dict[int, object] = {}

    def install(self) -> "StopRequest":
        if self._previous:  # installed already: keep the original handlers to restore
            return self
        for sig, kind in ((signal.SIGUSR1, _REQUEUE), (signal.SIGTERM, _REQUEUE),
                          (signal.SIGINT, _INTERRUPT)):
            self._previous[sig] = signal.signal(sig, self._make_handler(kind))
        return self

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _make_handler(self, kind: int):
        def handler(signum, frame) -> None:
            name = signal.Signals(signum).name
            if self.local != _NONE and kind == _INTERRUPT:
                _say("tape-train: stop already requested; finishing the checkpoint "
                     "(SIGKILL abandons it)")
            elif self.local == _NONE:  # acknowledged at once: the stop may be a step, an
                # evaluation or a save away, and a silent Ctrl-C invites a second one
                if self.launcher is not None and os.getppid() != self.launcher:
                    name_said = (f"{name} received (the launcher that started this process, "
                                 f"pid {self.launcher}, is gone)")
                else:
                    name_said = f"{name} received"
                _say(f"tape-train: {name_said}: stopping at the next step boundary after "
                     f"writing a checkpoint (before the first step: at the next start-up "
                     f"phase, nothing to save); exit {_CODES[max(self.local, kind)]}")
            if self.signal_name is None or kind > self.local:  # the signal that decides:
                self.signal_name = name  # torchrun's own SIGTERM after a forwarded SIGUSR1
            self.local = max(self.local, kind)  # does not rename the stop
        return handler

    def agreed(self, all_reduce_max: Callable[[int], int]) -> int:
        """The exit code every rank agrees on (0: keep training). Collective: call on all ranks.

        ``all_reduce_max`` maps this rank's integer to the maximum over all ranks.
        """
        return _CODES[all_reduce_max(self.local)]


# ``launch/local.sh`` sets it to 1 for what it starts (the trainer, or its torchrun); 0 turns
# the watch off. Unset: on for a torchrun worker outside a Slurm step.
WITH_LAUNCHER_ENV = "TAPE_TRAIN_STOP_WITH_LAUNCHER"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def launcher_watch_wanted(env=os.environ) -> bool:
    """Whether this process should stop when its parent dies: asked by ``launch/local.sh``
    (``TAPE_TRAIN_STOP_WITH_LAUNCHER=1``), or a worker of torchrun (``TORCHELASTIC_RUN_ID``)
    outside a Slurm step, where slurmstepd ends the step's processes itself and the batch
    script's requeue path is left exactly as it was."""
    asked = env.get(WITH_LAUNCHER_ENV, "").strip()
    if asked in ("0", "1"):
        return asked == "1"
    return "TORCHELASTIC_RUN_ID" in env and "SLURM_STEP_ID" not in env


def stop_with_launcher(parent: int, sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send ``sig`` to this process when its parent (the launcher that started
    it: torchrun, or the launch script) dies; ``parent`` is the parent pid read at start-up.
    False where that cannot be asked (not Linux, no prctl).

    The kernel sends it when the *thread* that created this process ends: torchrun's agent
    starts (and restarts) its workers from its main thread, which ends only with torchrun;
    a shell has one thread. Should the parent have died before the request (between the fork
    and here), the kernel never sends it: the parent pid is read again right after, and a
    changed one (or 1: adopted by init) sends ``sig`` to this process now."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    now = os.getppid()
    if now != parent or now == 1:
        os.kill(os.getpid(), sig)
    return True


def _say(line: str) -> None:
    """One line on stderr from a signal handler: ``os.write``, unbuffered, because the handler
    may interrupt the main thread inside a write to ``sys.stderr`` (a log line), where
    ``print`` would raise "reentrant call" into whatever the trainer was doing."""
    rank = os.environ.get("RANK")  # torchrun's: each rank says it, tagged like its log lines
    try:
        os.write(2, (f"[rank{rank}] " if rank else "").encode() + (line + "\n").encode())
    except OSError:
        pass
