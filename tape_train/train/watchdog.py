"""A rank that hangs ends the run, and the log says where: collective timeouts and a watchdog.

A rank that *dies* ends a multi-rank run in seconds (its peers' next collective fails). A rank
that *hangs* (a SIGSTOPped process, a read stuck on a dead filesystem, a deadlock) would leave
every other rank blocked in its next collective, silently, until the process group's timeout or
the job's time limit. Two bounds, both set by the config:

- **Collective timeout.** Every process group of this rank (the world, and the dp/sp/tp and
  DeepSpeed sub-groups, which torch creates with its own default of 30 min for gloo, 10 min
  for NCCL) waits at most ``train.collective_timeout_s`` in one collective during training
  steps, and ``train.startup_timeout_s`` during start-up, the first step of the process,
  evaluations and checkpoint saves: phases that grow with the model and the data, in which one
  rank may work alone while the others wait (rank 0 writing the marker, a first-step compile).
  A timed-out collective raises; ``describe_collective_error`` turns that into one line naming
  the key to raise, and the trainer exits 1.
- **Watchdog.** ``Watchdog.arm`` gives each phase (one step, one evaluation, one save, one
  start-up phase) half of its collective timeout. When a phase overruns, the watchdog thread
  looks at where the trainer's thread is. Waiting in a collective (for a peer that is behind):
  one warning line; the collective's timeout ends it. Anywhere else, this rank is the stuck
  one: one error line, every thread's stack on stderr (this rank's log), exit 1 — at half the
  timeout, so before the peers' collectives time out and their launcher (torchrun, srun) ends
  the job and this rank with it. If a waiting rank is still in the same phase a minute after
  its collective should have timed out, it is ended the same way. A stopped process runs no
  watchdog: its peers' collective timeout ends the run.
- **Time stopped is not time stuck.** ``time.monotonic`` runs on while the process is stopped
  (``scontrol suspend``, gang scheduling, SIGSTOP/SIGCONT), so right after a resume every
  phase would look overrun. The watchdog thread wakes at least every ``TICK_S`` (less for
  short allowances); a wake that comes more than ``STOPPED_GAP_S`` later than it asked for is
  time this process did not run: the phase's start moves by as much (one INFO line) and the
  faulthandler backstop is re-armed. A wake can also come late because the trainer's thread
  holds the GIL (a long C call that does not release it, e.g. in a stuck retry loop): that
  thread's CPU time tells the two apart, since a stopped thread uses none, so only the part of
  the delay in which the trainer's thread did not run is given back (else such a rank would
  be found stuck several times later than its allowance, after its peers' collectives had
  already timed out). What it cannot cover: the collective timeouts of torch's
  process groups count wall time too, so a suspension approaching the collective timeout fails
  the collective that was waiting (gloo: measured), and faulthandler's own timer fires at the
  resume when the stop outlasted it (the collective timeout + 2 minutes).

Checkpoints stay intact whatever the watchdog ends: a checkpoint is marked complete only after
every rank finished writing it (``tape_train.train.checkpoint.save_checkpoint``), so a save cut
short leaves a tag without ``COMPLETE.json``, which resume skips.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Imported now, not when exiting: a trainer stuck in an import holds the import lock.
from tape_train.progress import exit_flushed

log = logging.getLogger("tape_train.train")

EXIT_HUNG = 1
STEP_KEY, STARTUP_KEY = "train.collective_timeout_s", "train.startup_timeout_s"
BACKSTOP_S = 60.0  # after a collective's timeout, before a rank still waiting is ended
TICK_S = 1.0        # the watchdog thread wakes at least this often while a phase runs ...
STOPPED_GAP_S = 2.0  # ... and a wake this much later than asked means the process was stopped

_PACKAGE = Path(__file__).resolve().parents[1]


def _comm_dirs() -> tuple[str, ...]:
    """Where communication code lives: a trainer thread whose innermost frame is in one of
    these directories is waiting for its peers (collectives release the GIL while waiting, so
    the watchdog thread can look)."""
    import importlib.util

    dirs = []
    for module in ("torch.distributed", "deepspeed.comm", "deepspeed.runtime.zero"):
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.submodule_search_locations:
            dirs += [str(Path(p)) + os.sep for p in spec.submodule_search_locations]
    return tuple(dirs)


@dataclass
class _Phase:
    name: str
    timeout_s: float      # the collective timeout in force during this phase
    key: str              # the config key that sets it
    started: float
    warned: bool = False
    cpu_started: float = 0.0  # the trainer thread's CPU seconds when it was armed

    @property
    def budget_s(self) -> float:
        return self.timeout_s / 2

    def deadline(self) -> float:
        if not self.warned:
            return self.started + self.budget_s
        return self.started + self.timeout_s + BACKSTOP_S

    def backstop_s(self, now: float) -> float:
        """Seconds from ``now`` until faulthandler's backstop (set again whenever ``started``
        moves): after even the waiting allowance."""
        return max(self.started + self.timeout_s + 2 * BACKSTOP_S - now, 1.0)


class Watchdog:
    """Ends this process, with every thread's stack on stderr, when a phase makes no progress.

    Args:
        rank: named in every line.
        before_exit: called (bounded to a few seconds) just before the process ends, e.g. to
            release the run-directory lock.
    """

    def __init__(self, rank: int, before_exit: Callable[[], None] | None = None) -> None:
        self.rank = rank
        self.before_exit = before_exit
        self._target = threading.get_ident()  # the trainer's thread
        self._target_cpu = _thread_cpu_clock()  # its CPU-time clock (None where unavailable)
        self._comm_dirs = _comm_dirs()
        self._phase: _Phase | None = None
        self._last: _Phase | None = None  # the phase in progress, or the last one disarmed
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._watch, name="tape-train-watchdog",
                                        daemon=True)
        self._thread.start()

    def arm(self, name: str, timeout_s: float, key: str) -> None:
        """Start phase ``name``: it may take ``timeout_s / 2`` on this rank."""
        now = time.monotonic()
        with self._cond:
            self._phase = self._last = phase = _Phase(name, timeout_s, key, now,
                                                      cpu_started=self._trainer_cpu_s())
            self._cond.notify()
        # Backstop for a hang that holds the GIL (the thread above cannot run then): a C
        # thread dumps the stacks and exits once even the waiting allowance is over.
        _backstop(phase.backstop_s(now))

    def progress(self) -> None:
        """The current phase made progress (a long loop's iteration, e.g. an evaluation
        batch): its allowance starts again, so a long but moving phase is never taken for a
        stuck one. Cheap enough to call per iteration (re-arms at most once a second)."""
        now = time.monotonic()
        with self._cond:
            phase = self._phase
            if phase is None or now - phase.started < 1.0:
                return
            phase.started, phase.warned = now, False
            self._cond.notify()
        _backstop(phase.backstop_s(now))

    def disarm(self) -> None:
        with self._cond:
            self._phase = None
            self._cond.notify()
        faulthandler.cancel_dump_traceback_later()

    def close(self) -> None:
        with self._cond:
            self._closed = True
        self.disarm()
        self._thread.join(timeout=5)

    @property
    def phase(self) -> tuple[str, float, str] | None:
        """(name, collective timeout, its key) of the phase in progress, else of the last one:
        a call that failed has ended its phase before its error is described, and the timeout
        in force is still that phase's."""
        phase = self._last
        return (phase.name, phase.timeout_s, phase.key) if phase else None

    # ------------------------------------------------------------------------------------------

    def _watch(self) -> None:
        with self._cond:
            due = None  # when the last timed wait was to end at the latest
            while not self._closed:
                now = time.monotonic()
                if due is not None and now - due > STOPPED_GAP_S:
                    # The trainer's thread ran (held the GIL) in part of the delay: not stopped.
                    ran = self._trainer_cpu_s() - cpu_before
                    stopped_s = (now - due) - max(0.0, ran - wait)
                    if stopped_s > STOPPED_GAP_S:
                        self._resumed(stopped_s, now)
                due = None
                phase = self._phase
                if phase is None:
                    self._cond.wait()
                    if self._phase is not None:
                        # Woken by arm(): this wake was due when the phase started. A process
                        # stopped between the two (SIGSTOP right after the arm, before this
                        # thread ran) is a late wake like any other, not a stuck phase.
                        due, cpu_before, wait = self._phase.started, self._phase.cpu_started, 0.0
                    continue
                remaining = phase.deadline() - now
                if remaining > 0:
                    # Short waits, so that a stop shows as a late wake (see the module doc).
                    wait = min(remaining, TICK_S, phase.budget_s / 4)
                    due, cpu_before = now + wait, self._trainer_cpu_s()
                    self._cond.wait(wait)
                    continue
                self._overrun(phase)

    def _trainer_cpu_s(self) -> float:
        """CPU seconds the trainer's thread has used (0 where that cannot be read)."""
        if self._target_cpu is None:
            return 0.0
        try:
            return time.clock_gettime(self._target_cpu)
        except OSError:  # the thread has ended
            return 0.0

    def _resumed(self, stopped_s: float, now: float) -> None:
        """The process did not run for ``stopped_s`` (stopped, suspended): not the phase's
        fault, so its allowance (and the backstop) starts that much later."""
        phase = self._phase
        if phase is None:
            return
        phase.started += stopped_s
        # Also seen without any stop, on a machine whose cores are all busy: say both.
        log.info("rank %d: this process did not run for %.0f s (a suspended job, SIGSTOP, or "
                 "a machine too busy to run it); %s gets that time back", self.rank, stopped_s,
                 phase.name)
        _backstop(phase.backstop_s(now))

    def _overrun(self, phase: _Phase) -> None:
        frame = sys._current_frames().get(self._target)
        if frame is None:  # the trainer's thread is gone: nothing to watch
            self._phase = None
            return
        waiting = self._collective(frame)
        elapsed = time.monotonic() - phase.started
        if waiting is not None and not phase.warned:
            phase.warned = True
            log.warning("rank %d: %s has waited %.0f s, in a collective (%s), for a rank that "
                        "is behind or stuck; it fails after %s=%g s", self.rank, phase.name,
                        elapsed, waiting, phase.key, phase.timeout_s)
            return
        where = _where(frame)
        if waiting is not None:
            what = (f"has waited {elapsed:.0f} s in a collective ({waiting}), past its "
                    f"{phase.key}={phase.timeout_s:g} s timeout")
        else:
            what = f"made no progress for {elapsed:.0f} s, at {where}, not in a collective"
        log.error("rank %d is stuck: %s %s; the stacks of its threads follow; ending this "
                  "process (exit %d) so that the job ends instead of idling to its time limit. "
                  "If it was only slow, raise %s (each phase may take half of it)", self.rank,
                  phase.name, what, EXIT_HUNG, phase.key)
        _write_stacks(self.rank)
        self._release_and_exit()

    def _collective(self, frame) -> str | None:
        """``"all_reduce, called from loop.py:391 in train_step"`` when the innermost frame is
        communication code, else None."""
        if not frame.f_code.co_filename.startswith(self._comm_dirs):
            return None
        return f"{frame.f_code.co_name}, called from {_where(frame)}"

    def _release_and_exit(self) -> None:
        if self.before_exit is not None:
            # On a hung filesystem this may block too: give it a few seconds, then exit anyway.
            helper = threading.Thread(target=self._before_exit, daemon=True)
            helper.start()
            helper.join(timeout=5)
        exit_flushed(EXIT_HUNG)

    def _before_exit(self) -> None:
        try:
            self.before_exit()
        except Exception as exc:  # noqa: BLE001 - exiting anyway
            log.warning("rank %d: before exiting: %s", self.rank, exc)


def _thread_cpu_clock() -> int | None:
    """The CPU-time clock of the calling thread, readable from other threads (None where the
    platform has none)."""
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):
        return None


def _backstop(seconds: float) -> None:
    try:
        faulthandler.dump_traceback_later(seconds, exit=True)
    except (AttributeError, ValueError, OSError):  # stderr without a file descriptor
        pass


def _where(frame) -> str:
    """The innermost frame in tape_train code (else the innermost frame), as ``file:line in
    function``, the file relative to the package."""
    first = None
    for f, line in traceback.walk_stack(frame):
        path = Path(f.f_code.co_filename)
        first = first or (f, line)
        if path.is_relative_to(_PACKAGE):
            return f"{path.relative_to(_PACKAGE.parent)}:{line} in {f.f_code.co_name}"
    f, line = first
    return f"{f.f_code.co_filename}:{line} in {f.f_code.co_name}"


def _write_stacks(rank: int) -> None:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue  # the watchdog itself
        parts.append(f"[rank{rank}] thread {names.get(ident, ident)} (most recent call last):\n"
                     + "".join(traceback.format_stack(frame)))
    try:
        sys.stderr.write("\n".join(parts))
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "Connection refused")


def _raised_in_communication(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside communication code (torch.distributed, DeepSpeed's
    comm or ZeRO's gathers): gloo's messages do not always name gloo (a timed-out wait on a
    coalesced all-gather raises "Application timeout caused pair closure")."""
    dirs = _comm_dirs()
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next  # the innermost frame: where it was raised
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(dirs) if dirs else False


def describe_collective_error(exc: BaseException, watchdog: Watchdog | None,
                              rank: int) -> str | None:
    """One line for a collective that failed (timed out, or a peer went away), naming the
    phase and the config key to raise; ``None`` when ``exc`` is not a communication error."""
    import re

    import torch.distributed as dist

    text = str(exc).strip()
    if not (isinstance(exc, dist.DistError)
            or re.search(r"\bgloo\b|\bNCCL\b|c10d|ProcessGroup|pair closure", text)
            or _raised_in_communication(exc)):
        return None
    # gloo's first line: "[<its source file>:<line>] <what>. <advice>": keep <what>.
    first = (re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0]).split(". ")[0] if text
             else type(exc).__name__)
    name, timeout, key = (watchdog.phase if watchdog is not None and watchdog.phase
                          else ("start-up", None, STARTUP_KEY))
    if any(marker in text for marker in _PEER_GONE):
        return (f"rank {rank}: a collective failed in {name}: another rank exited (crashed, "
                f"was killed, or was ended by its watchdog: its log says which) ({first})")
    if re.search(r"timed out|timeout", text, re.IGNORECASE):
        limit = f"{key}={timeout:g} s" if timeout is not None else key
        return (f"rank {rank}: a collective timed out in {name} ({limit}): another rank is "
                f"stuck (its log says 'is stuck', with its stacks) or stopped (SIGSTOP, a "
                f"frozen node); if the ranks were only slow, raise {key} ({first})")
    return f"rank {rank}: a collective failed in {name}: {first}"
