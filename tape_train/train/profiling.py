"""Opt-in profiling of chosen training steps: torch.profiler traces and CUDA memory snapshots.

The ``profile`` config section (``tape_train.config.ProfileConfig``) names the steps (windows
of ``active_steps`` traced steps after ``warmup_steps`` discarded ones) and the ranks. The
trainer calls, on every rank: ``record_memory()`` at start-up, ``start(n)`` before the first
step ``n`` of the process, ``before_step(n)`` before every step, ``finish(n)`` when training
ends after step ``n``, ``close()`` at the very end, and ``after_out_of_memory`` when out of
memory ends the run; ``label(name)`` marks the phases of a step
(``tape_train/data``, ``sync``, ``forward``, ``backward``, ``optimizer_step``, ``evaluation``,
``checkpoint``). What a profiled rank writes::

    <run_dir>/profile/step_<first>/rank<r>.pt.trace.json     the window's steps, Chrome trace
    <run_dir>/profile/step_<first>/memory_rank<r>.pickle     CUDA allocator snapshot
    <run_dir>/profile/oom_after_step_<n>/memory_rank<r>.pickle  the snapshot when the run ran
                                                 out of CUDA memory after n completed steps

A window spans its steps and what follows each of them in the loop (metrics, evaluation,
checkpoint). Every file is written atomically (``tape_train.files.atomic_path``), and only
for a window whose steps all ran: a run that ends inside a window writes nothing for it.

Off (the default, or a rank not profiled, or between windows) ``label`` returns one shared
``nullcontext``: no ``record_function`` is created and nothing reaches the profiler.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
from pathlib import Path

import torch

from tape_train.files import atomic_path, human_bytes, write_atomic

log = logging.getLogger("tape_train.train")

LABEL_PREFIX = "tape_train/"  # of the phases' labels (docs/training.md, "Profiling a run")
_OFF = contextlib.nullcontext()


def no_label(name: str):
    """The label of a step's phase when nothing is profiled: one shared ``nullcontext``."""
    return _OFF


def profile_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "profile"


def window_dir(run_dir: str | os.PathLike, first: int) -> Path:
    return profile_dir(run_dir) / f"step_{first}"


def trace_name(rank: int) -> str:
    return f"rank{rank}.pt.trace.json"


def snapshot_name(rank: int) -> str:
    return f"memory_rank{rank}.pickle"


def memory_history_supported(device: torch.device) -> bool:
    """Whether the CUDA caching allocator's history can be recorded for ``device``."""
    return device.type == "cuda"


class RunProfiler:
    """The ``profile`` section at work on one rank (a no-op when it is off).

    Every rank keeps the same schedule, so the trainer can make a window's end a phase of every
    rank (``ends_window_before``); only the profiled ranks record and write.
    """

    def __init__(self, cfg=None, run_dir: str | os.PathLike = ".", rank: int = 0,
                 device: torch.device | None = None, max_steps: int = 0) -> None:
        self.cfg = cfg
        self.enabled = cfg is not None and cfg.enabled
        self.run_dir, self.rank, self.max_steps = Path(run_dir), rank, max_steps
        self.device = device or torch.device("cpu")
        self.records = self.enabled and cfg.profiles_rank(rank)
        self.snapshots = (self.records and cfg.memory_snapshot
                          and memory_history_supported(self.device))
        self._window: tuple[int, int] | None = None   # (first, last) traced step, while open
        self._torch: torch.profiler.profile | None = None
        self._complete = False                        # every step of the open window ran
        self._written = False                         # its trace was written
        self._memory_on = False

    def record_memory(self) -> None:
        """At start-up, once the device is set: start the CUDA allocator history (so that an
        out-of-memory error anywhere, model building included, has one), or warn once that
        this device has none."""
        if not self.records or not self.cfg.memory_snapshot:
            return
        if not self.snapshots:
            log.warning("profile.memory_snapshot: CUDA only, this run is on %s: no memory "
                        "snapshot is recorded", self.device.type)
        elif not self._memory_on:
            torch.cuda.memory._record_memory_history(
                max_entries=self.cfg.memory_snapshot_entries, stacks="python")
            self._memory_on = True

    def start(self, first_step: int) -> None:
        """Before the first step of this process: say which windows it traces, and a window
        it started inside of (a resume), which it does not."""
        if not self.records:
            return
        cfg = self.cfg
        span = cfg.warmup_steps + cfg.active_steps
        cut = cfg.window_from(first_step - span + 1)
        if (cut is not None and cut[0] - cfg.warmup_steps < first_step <= cut[1]
                and cut[1] <= self.max_steps):
            log.warning("profile: this process starts at step %d, inside the window of steps "
                        "%d-%d: not traced", first_step, cut[0], cut[1])
        window = cfg.window_from(first_step)
        if window is None or window[1] > self.max_steps:
            log.info("profile: no window left to trace after step %d", first_step - 1)
            return
        log.info("profile: tracing steps %d-%d%s on rank %d -> %s", window[0], window[1],
                 self._later_windows(), self.rank, window_dir(self.run_dir, window[0]))

    def _later_windows(self) -> str:
        cfg = self.cfg
        if cfg.repeat == 1:
            return ""
        every = f" and every {cfg.interval} steps after"
        return every + (" until the run ends" if cfg.repeat == 0 else
                        f" ({cfg.repeat} windows in all)")

    # ------------------------------------------------------------------------------------------

    def label(self, name: str):
        """A ``record_function`` context named ``tape_train/<name>`` inside a window; else one
        shared ``nullcontext`` (nothing created, nothing recorded)."""
        if self._torch is None:
            return _OFF
        return torch.profiler.record_function(LABEL_PREFIX + name)

    def ends_window_before(self, step: int) -> bool:
        """Whether a window's last step is ``step - 1`` (the same answer on every rank, profiled
        or not): its files are written before step ``step``."""
        if not self.enabled:
            return False
        cfg = self.cfg
        window = cfg.window_from(step - cfg.active_steps - cfg.warmup_steps)
        return window is not None and window[1] == step - 1

    def before_step(self, step: int) -> None:
        """Step ``step`` is about to run on this rank: end a window that ended with the step
        before, open one whose warm-up starts at ``step``, move an open one on."""
        if not self.records:
            return
        if self._window is not None and step > self._window[1]:
            self._complete = True
            self._end_window()
        if self._window is not None:
            if self._torch is not None:
                self._torch.step()
                self._tag_trace(step)
            return
        cfg = self.cfg
        window = cfg.window_from(step)
        if (window is None or window[0] - cfg.warmup_steps != step
                or window[1] > self.max_steps):
            return
        self._window, self._complete, self._written = window, False, False
        if cfg.trace:
            self._torch = self._new_torch_profiler(step, window)
            self._torch.step_num = step - 1  # ProfilerStep#<n> is training step n
            self._torch.start()
            self._torch.step()
            self._tag_trace(step)

    def _tag_trace(self, step: int) -> None:
        """Name the window and rank in the trace's metadata (once recording has begun)."""
        first, last = self._window
        if step == first:
            self._torch.add_metadata_json("tape_train", '{"first_step": %d, "last_step": %d, '
                                          '"rank": %d}' % (first, last, self.rank))

    def _new_torch_profiler(self, warmup_start: int, window: tuple[int, int]):
        from torch.profiler import ProfilerAction, ProfilerActivity

        first, last = window

        def schedule(step: int) -> ProfilerAction:
            if step < warmup_start or step > last:
                return ProfilerAction.NONE
            if step < first:
                return ProfilerAction.WARMUP
            return ProfilerAction.RECORD_AND_SAVE if step == last else ProfilerAction.RECORD

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        cfg = self.cfg
        prof = torch.profiler.profile(
            activities=activities, schedule=schedule, on_trace_ready=self._write_trace,
            record_shapes=cfg.record_shapes, profile_memory=cfg.profile_memory,
            with_stack=cfg.with_stack)
        return prof

    def _write_trace(self, prof) -> None:
        first, last = self._window
        if not self._complete:  # the run ended inside the window (see finish)
            return
        self._written = True
        path = window_dir(self.run_dir, first) / trace_name(self.rank)
        try:
            with atomic_path(path) as tmp:
                prof.export_chrome_trace(str(tmp))
        except OSError as exc:  # a diagnostic: training goes on without it
            log.error("profile: the trace of steps %d-%d was not written: %s", first, last,
                      exc.strerror or exc)
            return
        log.info("profile: wrote the trace of steps %d-%d on rank %d: %s (%s)", first, last,
                 self.rank, path, human_bytes(path.stat().st_size))

    def _end_window(self) -> None:
        first, last = self._window
        try:
            if self._torch is not None:
                try:
                    self._torch.stop()  # writes the trace (``_write_trace``) if complete
                except Exception as exc:  # noqa: BLE001 - a diagnostic: never the run's end
                    log.error("profile: stopping the profiler after steps %d-%d failed: %s",
                              first, last, f"{type(exc).__name__}: {exc}".splitlines()[0])
                else:
                    if self._complete and not self._written:
                        log.warning("profile: torch.profiler gave no trace of steps %d-%d (see "
                                    "its warnings above)", first, last)
            if self._complete and self._memory_on:
                self._write_snapshot(window_dir(self.run_dir, first) / snapshot_name(self.rank),
                                     f"after steps {first}-{last}")
        finally:
            self._torch, self._window = None, None

    def _write_snapshot(self, path: Path, when: str) -> Path | None:
        try:
            snapshot = torch.cuda.memory._snapshot()
            write_atomic(path, lambda f: pickle.dump(snapshot, f))
        except OSError as exc:  # a diagnostic: training goes on without it
            log.error("profile: the CUDA memory snapshot %s was not written: %s", when,
                      exc.strerror or exc)
            return None
        log.info("profile: wrote the CUDA memory snapshot %s on rank %d: %s (%s; open it at "
                 "pytorch.org/memory_viz)", when, self.rank, path,
                 human_bytes(path.stat().st_size))
        return path

    # ------------------------------------------------------------------------------------------

    def finish(self, step: int) -> None:
        """Training ended after ``step``: write a window whose steps all ran, discard one the
        run ended inside (saying so)."""
        if self._window is None:
            return
        first, last = self._window
        self._complete = step >= last
        if not self._complete:
            log.warning("profile: the run ended after step %d, before the window of steps "
                        "%d-%d was complete: nothing written for it", step, first, last)
        self._end_window()

    def close(self) -> None:
        """The run is over: stop the allocator history."""
        self._stop_memory_history()

    def after_out_of_memory(self, step: int, where: str) -> Path | None:
        """A CUDA out-of-memory error ends the run after ``step`` completed steps, in ``where``
        (the trainer's phase): the allocator snapshot, whose history holds the failed
        allocation, goes to ``oom_after_step_<step>/``. ``Trainer.run`` is the one caller."""
        if not self._memory_on:
            return None
        try:
            return self._write_snapshot(profile_dir(self.run_dir) / f"oom_after_step_{step}"
                                        / snapshot_name(self.rank),
                                        f"at the out-of-memory error in {where}")
        finally:
            self._stop_memory_history()

    def _stop_memory_history(self) -> None:
        if self._memory_on:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._memory_on = False


def describe_plan(cfg, world_size: int, device_type: str) -> tuple[list[str], list[str]]:
    """What ``cfg.profile`` will record, for ``--dry-run``: (plan lines, problems). A rank
    outside the world is a problem naming ``profile.ranks``."""
    profile = cfg.profile
    if not profile.enabled:
        return [], []
    ranks = list(range(world_size)) if profile.ranks == "all" else profile.ranks
    outside = [r for r in ranks if r >= world_size]
    if outside:
        return [], [f"profile.ranks={profile.ranks}: rank {outside[0]} is outside a world of "
                    f"{world_size} rank(s) (0-{world_size - 1})"]
    first, last = profile.start_step, profile.start_step + profile.active_steps - 1
    windows = f"steps {first}-{last} after {profile.warmup_steps} warm-up step(s)"
    if profile.repeat != 1:
        windows += (f", then every {profile.interval} steps"
                    + (" until the run ends" if profile.repeat == 0
                       else f" ({profile.repeat} windows)"))
    who = "every rank" if profile.ranks == "all" else "rank " + ", ".join(map(str, ranks))
    where = window_dir(cfg.train.run_dir, first)
    lines = [f"profiling: on (profile.enabled), {windows}, on {who}"]
    if profile.trace:
        activities = "CPU+CUDA" if device_type == "cuda" else "CPU"
        lines.append(f"profiling: torch.profiler traces ({activities} activities) -> "
                     f"{where}/{trace_name(ranks[0])} (Chrome trace JSON: ui.perfetto.dev, "
                     f"chrome://tracing)")
    if profile.memory_snapshot:
        lines.append(f"profiling: CUDA memory snapshots -> {where}/{snapshot_name(ranks[0])} "
                     f"and, on an out-of-memory error, {profile_dir(cfg.train.run_dir)}/"
                     f"oom_after_step_<n>/ (pytorch.org/memory_viz)" if device_type == "cuda"
                     else f"profiling: profile.memory_snapshot is CUDA only: not recorded on "
                          f"{device_type}")
    return lines, []
