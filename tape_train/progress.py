"""One progress convention for every command: a tqdm bar only on a terminal, never in logs.

``mode`` is ``"auto"`` (a bar when the stream is a terminal), ``True``/``"on"`` (always) or
``False``/``"off"`` (never). Without a bar, commands report progress as ordinary greppable log
lines, so a redirected log never holds carriage returns. ``setup_cli_logging`` makes those lines
one per record, whatever library logged them. ``run_with_progress`` runs a child process that
takes minutes (DeepSpeed's universal conversion) with the same kind of lines, and a heartbeat.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from tape_train.files import human_bytes

MODES = ("auto", "on", "off")
CLI_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _not_printed_by_its_library(record: logging.LogRecord) -> bool:
    """False for a record that a handler below the root prints: libraries such as
    huggingface_hub and datasets attach a stderr handler to their loggers (at import, i.e.
    possibly after ours was set up) and also propagate, so the root would print it twice. A
    ``NullHandler`` (urllib3's and requests', e.g. for connection retries) or a handler whose
    level is above the record's prints nothing: such a record is still the root's to print."""
    logger = logging.getLogger(record.name)
    while logger is not None and logger is not logging.root:
        if any(not isinstance(handler, logging.NullHandler) and record.levelno >= handler.level
               for handler in logger.handlers):
            return False
        logger = logger.parent if logger.propagate else None
    return True


def setup_cli_logging(level: int = logging.INFO, tag: str = "") -> None:
    """A command's log on stderr: one ``time LEVEL logger: message`` line per record, and no
    second copy of what a library prints through its own handler. Keeps an existing root
    setup (a command called from another one, or from tests) apart from adding the filter.
    ``tag`` (e.g. ``rank1``) goes in brackets after the time: which process of several said it."""
    root = logging.getLogger()
    if not root.handlers:
        fmt = CLI_LOG_FORMAT.replace(" ", f" [{tag}] ", 1) if tag else CLI_LOG_FORMAT
        logging.basicConfig(level=level, stream=sys.stderr, format=fmt)
    for handler in root.handlers:
        if _not_printed_by_its_library not in handler.filters:
            handler.addFilter(_not_printed_by_its_library)


def exit_flushed(code: int) -> None:
    """Ends this process with ``code`` at once (``os._exit``: no interpreter teardown, no
    atexit handlers), after flushing whatever stdout and stderr still hold."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed, or None
            pass
    os._exit(code)


def exit_without_finalizing(code: int) -> None:
    """Ends a rank of a process group with ``code`` once its atexit handlers ran (logging's
    flush, a data loader's prefetch stop), skipping the interpreter's finalization: a gloo
    worker thread that still releases its last collective's tensors then needs the GIL, and
    Python ends such a thread in a way that aborts the process ("terminate called without an
    active exception", exit -6), after which torchrun ends the other ranks — or, for a
    training run, counts a failed attempt and restarts a finished run (measured: 2 of 16
    two-rank CPU runs; ``destroy_process_group`` does not stop those threads)."""
    import atexit

    atexit._run_exitfuncs()
    exit_flushed(code)


def show_progress(mode: bool | str = "auto", stream: IO | None = None) -> bool:
    """Whether a bar should be drawn on ``stream`` (default stderr) for ``mode``."""
    if mode is True or mode == "on":
        return True
    if mode is False or mode == "off":
        return False
    if mode != "auto":
        raise ValueError(f"progress mode {mode!r} is not one of {', '.join(MODES)}")
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def progress_bar(total: int | None, *, desc: str | None = None, unit: str = "it",
                 mode: bool | str = "auto", initial: int = 0, leave: bool = True,
                 stream: IO | None = None, binary: bool = False):
    """A tqdm bar on ``stream`` (default stderr), or None when ``mode`` says no bar.
    ``binary``: counts are bytes, shown as KiB, MiB, GiB like ``files.human_bytes``."""
    stream = sys.stderr if stream is None else stream
    if not show_progress(mode, stream):
        return None
    from tqdm import tqdm

    scale = {"unit_scale": True, "unit_divisor": 1024} if binary else {}
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True,
                leave=leave, file=stream, **scale)


class ByteProgress:
    """Progress of work counted in bytes, done by several threads (hashing a corpus): a bar on
    a terminal (``mode`` as for ``progress_bar``), else a log line at most every ``every_s``
    seconds with the bytes done of ``total``, the rate and the time left — never a carriage
    return. Workers call ``add(n)`` from any thread; the thread that owns this object calls
    ``tick()`` now and then (it draws or logs) and ``close()`` at the end. ``clock`` is for
    tests."""

    def __init__(self, total: int, *, what: str, logger: logging.Logger,
                 mode: bool | str = "auto", every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, stream: IO | None = None):
        self.total, self.what, self.every_s = total, what, every_s
        self._logger, self._clock = logger, clock
        self._lock = threading.Lock()
        self._done = self._drawn = 0
        self.started = self._logged = clock()
        self._bar = progress_bar(total, desc=what, unit="B", mode=mode, stream=stream,
                                 binary=True)

    @property
    def done(self) -> int:
        with self._lock:
            return self._done

    def add(self, n: int) -> None:
        with self._lock:
            self._done += n

    def line(self) -> str:
        """``1.2 GiB of 4.0 GiB (30 %), 410.3 MiB/s, 7 s left``."""
        done, seconds = self.done, self._clock() - self.started
        rate = done / seconds if seconds > 0 else 0.0
        share = f"{100 * done / self.total:.0f} %" if self.total else "100 %"
        left = (_elapsed((self.total - done) / rate) + " left" if rate > 0
                else "time left not known yet")
        return (f"{human_bytes(done)} of {human_bytes(self.total)} ({share}), "
                f"{human_bytes(rate)}/s, {left}")

    def tick(self) -> None:
        if self._bar is not None:
            done = self.done
            self._bar.update(done - self._drawn)
            self._drawn = done
            return
        now = self._clock()
        if now - self._logged >= self.every_s:
            self._logged = now
            self._logger.info("%s: %s", self.what, self.line())

    def close(self) -> None:
        if self._bar is not None:
            self.tick()
            self._bar.close()


@contextlib.contextmanager
def library_bars(module, mode: bool | str = "auto", stream: IO | None = None):
    """Within the block, the bars a library draws with its module-level ``tqdm`` (DeepSpeed's
    ``zero_to_fp32`` "Loading checkpoint shards") follow this convention too."""
    if show_progress(mode, stream):
        yield
        return
    original = module.tqdm
    module.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        module.tqdm = original


# ----------------------------------------------------------------------------------------------
# A long child process (DeepSpeed's universal conversion): progress as log lines
# ----------------------------------------------------------------------------------------------

LOG_EVERY_S = 30.0  # a progress line at least this often while a child process runs
TAIL_LINES = 15     # the child's last output lines kept for the error when it fails
# Output without a line end is kept only up to this many characters (its latest part), and a
# line is kept for the error only up to LINE_CHARS: a child printing megabytes without a
# newline (binary output, a huge repr) costs neither memory nor time per read.
PENDING_CHARS = 1 << 16
LINE_CHARS = 1000
_BAR_COUNT = re.compile(r"\b(\d+)/(\d+)\b")


class ChildOutput:
    """Reads a child's merged stdout/stderr on a thread: whole lines only (a tqdm bar's ``\\r``
    updates collapse to their last state), the last ``TAIL_LINES`` of them, a count of reads
    (any output is progress), and the child's latest stage line and bar position."""

    def __init__(self, stream, stage_prefix: str | None, on_stage: Callable[[str], None]) -> None:
        self._stream = stream
        self._stage_prefix = stage_prefix
        self._on_stage = on_stage
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.reads = 0
        self.stage: str | None = None
        self.position: str | None = None  # "120/300" of the bar being drawn
        self._thread = threading.Thread(target=self._read, name="child-output", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        pending = ""
        while chunk := self._stream.read1(65536):
            self.reads += 1
            pending += chunk.decode("utf-8", "replace")
            *lines, pending = pending.split("\n")
            for line in lines:
                self._line(line)
            pending = self._bar(pending)[-PENDING_CHARS:]
        if pending.strip():
            self._line(pending)

    def _bar(self, text: str) -> str:
        """The last ``\\r``-separated state of a line being redrawn; notes its n/total."""
        states = [state for state in text.split("\r") if state.strip()]
        text = states[-1] if states else ""
        counts = _BAR_COUNT.findall(text)
        if counts:
            self.position = "/".join(counts[-1])
        return text

    def _line(self, line: str) -> None:
        line = self._bar(line).rstrip()
        if not line:
            return
        self.tail.append(line if len(line) <= LINE_CHARS else line[:LINE_CHARS] + " …")
        if self._stage_prefix is not None and line.startswith(self._stage_prefix):
            self.stage = line[len(self._stage_prefix):].strip().rstrip(". ")
            self.position = None
            self._on_stage(self.stage)

    def join(self, timeout: float = 5.0) -> None:
        self._thread.join(timeout)


def _tree_size(root: Path) -> tuple[int, int]:
    """(files, bytes) under ``root`` so far (files may vanish while it is walked)."""
    files = size = 0
    for parent, _, names in os.walk(root):
        for name in names:
            try:
                size += os.stat(os.path.join(parent, name)).st_size
                files += 1
            except OSError:
                pass
    return files, size


# A child that used at least this share of a core since the last tick moved, whatever it
# wrote or printed: a converter that imports torch and DeepSpeed, or reads a large shard,
# prints nothing for seconds (over 10 s on a busy 2-core machine, which ended a resume's
# conversion under train.startup_timeout_s=20). One that waits on something that never comes
# uses none; the watcher thread of loading._WITH_PARENT, waking once a second, about 1e-5.
CPU_MOVING_SHARE = 0.05
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _group_cpu_s(pgid: int) -> float | None:
    """CPU seconds used so far by the processes of process group ``pgid`` (with their reaped
    children), from /proc; None where there is no /proc."""
    total, found = 0, False
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        # fields[0] is the state (stat's 3rd field): pgrp is the 5th, utime..cstime 14th-17th.
        if int(fields[2]) == pgid:
            found = True
            total += sum(int(f) for f in fields[11:15])
    return total / _CLOCK_TICKS if found else None


def run_with_progress(cmd: list[str], *, what: str, output_dir: Path, logger: logging.Logger,
                      tick: Callable[[bool], None] | None = None, tick_s: float = 5.0,
                      stage_prefix: str | None = None) -> tuple[int, list[str]]:
    """Run ``cmd`` (a child that may take minutes) and report its progress as log lines.

    A line per stage line the child prints (a line starting with
    ``stage_prefix``), and one at least every ``LOG_EVERY_S``: the time so far, the files and
    bytes it wrote under ``output_dir``, its stage and bar position, and how long it has not
    moved if it stopped. Never a carriage return. ``tick(moved)`` is called every ``tick_s``
    while it runs, ``moved`` saying whether it wrote or printed anything since the previous
    call (a trainer tells its watchdog and the ranks waiting for it), or used at least
    ``CPU_MOVING_SHARE`` of a core (Linux: its process group's CPU time). If ``tick`` raises, or
    the caller is interrupted, the child is killed with everything it started (it runs as
    the leader of a new session, so its worker processes are in its process group, and a
    terminal's Ctrl-C reaches only the caller, which decides).

    Returns ``(exit status, its last output lines)``.
    """
    start = time.monotonic()
    child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output = ChildOutput(child.stdout, stage_prefix,
                             lambda stage: logger.info("%s: %s (%s so far)", what, stage,
                                                       _elapsed(time.monotonic() - start)))
        seen, moved_at, logged_at = (0, 0, 0), start, start
        cpu_seen, ticked_at = 0.0, start
        while True:
            try:
                child.wait(timeout=tick_s)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            files, size = _tree_size(output_dir)
            cpu = _group_cpu_s(child.pid)
            computed = cpu is not None and cpu - cpu_seen >= CPU_MOVING_SHARE * (now - ticked_at)
            cpu_seen, ticked_at = (cpu if cpu is not None else cpu_seen), now
            moved = (files, size, output.reads) != seen or computed
            seen = (files, size, output.reads)
            moved_at = now if moved else moved_at
            if tick is not None:
                tick(moved)
            if now - logged_at >= LOG_EVERY_S:
                logged_at = now
                logger.info("%s: %s so far, %d files (%s) written%s%s%s", what,
                            _elapsed(now - start), files, human_bytes(size),
                            f"; {output.stage}" if output.stage else "",
                            f", {output.position}" if output.position else "",
                            "" if now - moved_at < tick_s * 2 else
                            f"; no progress for {_elapsed(now - moved_at)}")
    finally:
        if child.poll() is None:  # not reaped yet: its process group is still its own
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except OSError:
                child.kill()
            child.wait()
    output.join()
    return child.returncode, list(output.tail)


def _elapsed(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"
