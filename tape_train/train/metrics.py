"""Training metrics: TensorBoard + ``metrics.jsonl`` on rank 0, console summary, MFU, memory.

``metrics.jsonl`` holds one JSON object per line: ``{"kind": "train", "step": ..., ...}`` per
logged step, ``{"kind": "eval", ...}`` per evaluation result and ``{"kind": "event", ...}``
for starts/resumes/stops. Floats are written with ``repr`` precision, so a loss read back is
bit-identical to the one computed (the exact-resume test relies on it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import sys
import threading
import time
from pathlib import Path

import torch

from tape_train.files import FileWriteError, describe_os_error

log = logging.getLogger("tape_train.train")


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Resident set size (GiB; peak too) and, on CUDA, the caching allocator's figures for
    this rank's device: allocated and reserved memory and their peaks (GiB), and the
    cumulative counts of allocation retries (a failed ``cudaMalloc`` after which the allocator
    freed its cache, a device-wide sync, and tried again) and of out-of-memory errors
    (``tape_train.train.cuda_allocator``)."""
    out = {}
    try:
        with open("/proc/self/statm") as fh:
            out["mem/rss_gib"] = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:
        pass
    out["mem/peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)  # one read: the figures are of one moment
        out["mem/cuda_allocated_gib"] = stats.get("allocated_bytes.all.current", 0) / 2**30
        out["mem/cuda_reserved_gib"] = stats.get("reserved_bytes.all.current", 0) / 2**30
        out["mem/cuda_peak_allocated_gib"] = stats.get("allocated_bytes.all.peak", 0) / 2**30
        out["mem/cuda_peak_reserved_gib"] = stats.get("reserved_bytes.all.peak", 0) / 2**30
        out["mem/cuda_alloc_retries"] = stats.get("num_alloc_retries", 0)
        out["mem/cuda_ooms"] = stats.get("num_ooms", 0)
    return out


def format_summary(step: int, max_steps: int, m: dict, mfu_at_most: bool = False) -> str:
    """The greppable one-line summary: ``step 120/1000 | loss 4.1230 | lr 3.00e-04 | ...``.

    ``mfu_at_most``: the peak may be low (measured on a busy machine), so the MFU shown is an
    upper bound: ``mfu <=41.2%``."""
    parts = [f"step {step}/{max_steps}", f"loss {m['loss']:.4f}", f"lr {m['lr']:.2e}"]
    if m.get("grad_norm") is not None:
        parts.append(f"gnorm {m['grad_norm']:.3f}")
    parts.append(f"tok/s {m['tokens_per_s']:.0f}")
    if m.get("mfu") is not None:
        parts.append(f"mfu {'<=' if mfu_at_most else ''}{100 * m['mfu']:.1f}%")
    parts.append(f"step {m['step_time_s']:.3f}s")
    parts.append(f"data {100 * m['data_wait_frac']:.1f}%")
    parts.append(f"tokens {m['tokens_seen']:.3g}")
    if m.get("skipped_steps"):
        parts.append(f"skipped {m['skipped_steps']}")
    return " | ".join(parts)


class MetricsWriter:
    """Rank-0 sink for scalars: TensorBoard (optional) and ``metrics.jsonl`` (always).

    On other ranks every method is a no-op, so call sites need no rank checks.

    ``resume_step``: the step the run (re)starts from. Rows a previous run logged for later
    steps are replayed now, so they are superseded: ``metrics.jsonl`` is rewritten atomically
    without them (they move to ``metrics.replayed.jsonl``, nothing is lost) and TensorBoard
    purges its events after that step (``purge_step``). Readers see one curve.
    """

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool,
                 resume_step: int | None = None, wandb: dict | None = None,
                 run_config: dict | None = None) -> None:
        self.enabled = enabled
        self.run_dir = run_dir
        self._failed = False
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        if wandb is not None:  # imported only when configured
            from tape_train.train.wandb_sink import WandbSink

            self._wandb = WandbSink(run_dir, wandb, run_config or {})
        with self._naming_write_errors("metrics.jsonl"):
            run_dir.mkdir(parents=True, exist_ok=True)
            if resume_step is not None:
                supersede_replayed_rows(run_dir, resume_step)
            self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = {"purge_step": resume_step + 1} if resume_step is not None else {}
            _quiet_tensorboard_writer_thread()
            with self._naming_write_errors("tensorboard"):
                self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), **purge)

    def write(self, kind: str, step: int, values: dict) -> None:
        if not self.enabled or self._failed:
            return
        record = {"kind": kind, "step": step, "time": time.time(), **values}
        items = scalar_items(kind, values)
        with self._naming_write_errors("metrics.jsonl"):
            self._jsonl.write(json.dumps(record, default=_json_default) + "\n")
        if self._tb is not None:
            with self._naming_write_errors("tensorboard"):
                for tag, value in items.items():
                    self._tb.add_scalar(tag, value, step)
        if self._wandb is not None:
            self._wandb.write(items, step)

    def flush(self) -> None:
        if self._failed:
            return
        if self._tb is not None:
            with self._naming_write_errors("tensorboard"):
                self._tb.flush()
        if self._jsonl is not None:
            with self._naming_write_errors("metrics.jsonl"):
                self._jsonl.flush()

    def close(self) -> None:
        # After a failed write (said once, by write or flush) closing fails the same way: the
        # run is ending on that error already, so the rest is let go quietly.
        if self._tb is not None:
            tb, self._tb = self._tb, None
            with self._naming_write_errors("tensorboard", quiet=self._failed):
                tb.close()
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None
        if self._jsonl is not None:
            jsonl, self._jsonl = self._jsonl, None
            with self._naming_write_errors("metrics.jsonl", quiet=self._failed):
                jsonl.close()

    @contextlib.contextmanager
    def _naming_write_errors(self, name: str, quiet: bool = False):
        """A full disk, a read-only run dir, or a directory or file in the place of
        metrics.jsonl or tensorboard/ (also from TensorBoard's writer thread, which hands its
        error to the next call): one FileWriteError naming the path, which ends the run in one
        line like a failed save; later writes are skipped, not failed again."""
        try:
            yield
        except OSError as exc:
            self._failed = True
            if quiet:
                return
            raise FileWriteError(f"metrics: {describe_os_error(exc, self.run_dir / name)}") \
                from exc


def _quiet_tensorboard_writer_thread() -> None:
    """TensorBoard writes its events in a thread that, when a write fails (a full disk), keeps
    the error for the writer's next call, which raises it here to be named in one line
    (``_naming_write_errors``), and also lets it end the thread, which Python's
    ``threading.excepthook`` printed as an "Exception in thread" traceback. Only that error of
    that thread is kept quiet; every other thread's error is printed as before."""
    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    previous = threading.excepthook
    if getattr(previous, "handed_to_the_writer", False):
        return

    def hook(args) -> None:
        if not (isinstance(args.thread, _AsyncWriterThread) and isinstance(args.exc_value, OSError)
                and args.thread.exception is args.exc_value):
            previous(args)

    hook.handed_to_the_writer = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def supersede_replayed_rows(run_dir: Path, resume_step: int) -> int:
    """Drop the rows of steps after ``resume_step`` from ``metrics.jsonl`` (and lines cut by a
    kill), appending them to ``metrics.replayed.jsonl``; atomic. Returns how many moved."""
    from tape_train.files import write_atomic

    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return 0
    keep, moved = [], []
    for line in path.read_bytes().splitlines():  # bytes: a damaged line is moved as it is
        if not line.strip():
            continue
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):  # not JSON, not UTF-8, not an object
            step = None  # a line cut by SIGKILL, or damaged: not a record
        (keep if isinstance(step, int) and step <= resume_step else moved).append(line)
    if not moved:
        return 0
    replayed = path.with_name("metrics.replayed.jsonl")
    old = replayed.read_bytes() if replayed.exists() else b""
    write_atomic(replayed, old + b"".join(line + b"\n" for line in moved))
    write_atomic(path, b"".join(line + b"\n" for line in keep))
    log.info("metrics.jsonl: %d rows after step %d (replayed from there) superseded; kept in %s",
             len(moved), resume_step, replayed)
    return len(moved)


def scalar_items(kind: str, values: dict) -> dict[str, float]:
    """The scalars every dashboard sink logs for a record: finite numbers of ``train`` and
    ``eval`` records, tagged ``<kind>/<key>`` unless the key already has a ``/``."""
    if kind not in ("train", "eval"):
        return {}
    return {(key if "/" in key else f"{kind}/{key}"): value for key, value in values.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


def _json_default(obj):
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    return repr(obj)


# DeepSpeed 0.19.8's ZeRO gathers and reduce-scatters through the collectives torch 2.13
# deprecates, and the warning registry is reset during every step (a filter change anywhere
# does that), so each rank printed the same two-line FutureWarning at every step: a log of
# 100k steps on 64 ranks drowned in them. Nothing in this run can act on it.
LIBRARY_DEPRECATIONS = (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                        r"is deprecated")


def quiet_library_deprecations() -> None:
    """Ignore the deprecation warnings of ``LIBRARY_DEPRECATIONS``, and only those."""
    import warnings

    warnings.filterwarnings("ignore", message=LIBRARY_DEPRECATIONS, category=FutureWarning)


def setup_logging(rank: int, all_ranks: bool) -> None:
    """Rank 0 logs at INFO; other ranks only warnings unless ``all_ranks``."""
    level = logging.INFO if rank == 0 or all_ranks else logging.WARNING
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger("tape_train")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def read_metrics(run_dir: Path, kind: str = "train") -> list[dict]:
    """Records of ``kind`` from ``metrics.jsonl``; for a step logged several times (a run that
    was killed after logging it, then resumed), the last record wins. Sorted by step."""
    path = Path(run_dir) / "metrics.jsonl"
    by_step: dict[int, dict] = {}
    extra: list[dict] = []
    if not path.exists():
        return []
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # a line cut by SIGKILL, or damaged (not JSON, not UTF-8)
            continue
        if not isinstance(record, dict) or record.get("kind") != kind:
            continue
        if kind == "train":
            if not isinstance(record.get("step"), int):
                continue
            by_step[record["step"]] = record
        else:
            extra.append(record)
    return [by_step[s] for s in sorted(by_step)] if kind == "train" else extra
