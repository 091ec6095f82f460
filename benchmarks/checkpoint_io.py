"""Checkpoint save/load bandwidth of a real Trainer next to raw sequential I/O of as many bytes.

In one child process: ``Trainer.save()`` (+ fsync of its files) and a raw write (+ fsync) of
as many random bytes in the same directory; then, after dropping all those files from the
page cache (``posix_fadvise(DONTNEED)``; a VM's host may still cache them),
checksum verification plus ``checkpoint.load_training_state`` (what a resume does) and a raw
sequential read. Repetitions alternate which of
the two goes first.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from trainer_process import Child, build_trainer, trainer_overrides


class CheckpointWorker:
    """In a child: a Trainer whose checkpoints are saved and loaded, and raw I/O beside them."""

    def __init__(self, recipe: Path, overrides: list[str]) -> None:
        self.trainer = build_trainer(recipe, overrides)
        self.trainer.train_step()  # AdamW's moments exist only after a step

    def step(self) -> None:
        self.trainer.train_step()  # the next save gets a new tag

    def measure(self, raw_first: bool) -> dict:
        """Save (+ fsync) and raw write (+ fsync), drop the files from the page cache, then
        load and raw read; the raw operations first if ``raw_first`` (the caller alternates,
        so order effects hit both alike). The raw file has the latest save's size: this
        one's, or the previous one's when the raw operations go first."""
        from tape_train.train.checkpoint import (checkpoint_root, load_training_state,
                                                 verify_checkpoint)

        clock = time.perf_counter
        r: dict = {"raw_first": raw_first}
        raw = checkpoint_root(self.trainer.run_dir) / "raw_io.bin"

        def save() -> None:
            start = clock()
            self.tag_dir = self.trainer.save()
            r["save_s"] = clock() - start
            self.files = sorted(p for p in self.tag_dir.rglob("*") if p.is_file())
            start = clock()
            for path in self.files:
                _fsync(path)
            r["fsync_s"] = clock() - start
            self.bytes = sum(p.stat().st_size for p in self.files)
            r.update(tag=self.tag_dir.name, files=len(self.files), bytes=self.bytes)

        def write_raw() -> None:
            r["raw_bytes"] = self.bytes
            r["raw_write_s"], r["raw_fsync_s"] = _write_raw(raw, self.bytes)

        def load() -> None:
            # What a resume does: verify the checksums (each file read once), then load.
            start = clock()
            reason = verify_checkpoint(self.tag_dir)
            r["verify_s"] = clock() - start
            if reason is not None:
                raise RuntimeError(f"{self.tag_dir}: {reason}")
            load_training_state(self.trainer.engine, self.tag_dir, self.trainer.rank)
            r["load_s"] = clock() - start

        def read_raw() -> None:
            start = clock()
            _read_raw(raw)
            r["raw_read_s"] = clock() - start

        order = -1 if raw_first else 1
        for op in (save, write_raw)[::order]:
            op()
        for path in [*self.files, raw]:
            _drop_from_page_cache(path)
        for op in (load, read_raw)[::order]:
            op()
        raw.unlink()
        return r

    def close(self) -> None:
        self.trainer.close()


_CHUNK = 64 * 2**20


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _write_raw(path: Path, n_bytes: int) -> tuple[float, float]:
    """Sequentially write ``n_bytes`` random bytes; (write seconds, fsync seconds)."""
    chunk = os.urandom(min(_CHUNK, n_bytes))
    with open(path, "wb", buffering=0) as fh:
        start = time.perf_counter()
        left = n_bytes
        while left:
            left -= fh.write(memoryview(chunk)[:min(left, len(chunk))])
        written = time.perf_counter()
        os.fsync(fh.fileno())
        return written - start, time.perf_counter() - written


def _read_raw(path: Path) -> int:
    buffer = bytearray(_CHUNK)
    total = 0
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buffer):
            total += n
    return total


def measure_checkpoint(args, work: Path) -> dict:
    """The checkpoint part of ``benchmarks/run.py``: per-repetition seconds and bytes, and the
    median GB/s of each operation."""
    run_dir = work / f"checkpoint-{args.checkpoint_model}"
    # Keep every tag: deleting an old one inside save() would be timed as writing.
    overrides = (trainer_overrides(args.checkpoint_model, "tape", 128, 1, run_dir)
                 + [f"checkpoint.keep={args.checkpoint_reps + 1}", *args.set])
    from tape_train.config import load_run_config

    cfg = load_run_config(args.recipe, overrides)
    print(f"[checkpoint] setting up a {args.checkpoint_model} trainer in {run_dir}", flush=True)
    worker = Child(f"checkpoint worker ({args.checkpoint_model})", work / "checkpoint.log",
                   CheckpointWorker, args.recipe, overrides)
    reps = []
    try:
        worker.result()
        for rep in range(args.checkpoint_reps):
            if rep:
                worker.call("step")
            r = worker.call("measure", rep % 2 == 1)  # the first save sizes the raw file
            reps.append(r)
            gb = r["bytes"] / 1e9
            print(f"[checkpoint] {rep + 1}/{args.checkpoint_reps}: {gb:.3f} GB in {r['files']} "
                  f"files | save {r['save_s']:.2f}s + fsync {r['fsync_s']:.2f}s, raw write "
                  f"{r['raw_write_s']:.2f}s + fsync {r['raw_fsync_s']:.2f}s | load "
                  f"{r['load_s']:.2f}s (checksums {r['verify_s']:.2f}s), raw read "
                  f"{r['raw_read_s']:.2f}s", flush=True)
    finally:
        worker.close()

    def rate(size: str, *seconds: str) -> float:  # median GB/s over the repetitions
        return statistics.median(r[size] / 1e9 / sum(r[k] for k in seconds) for r in reps)

    summary = {"save_gbps": rate("bytes", "save_s"),
               "save_durable_gbps": rate("bytes", "save_s", "fsync_s"),
               "raw_write_gbps": rate("raw_bytes", "raw_write_s"),
               "raw_write_durable_gbps": rate("raw_bytes", "raw_write_s", "raw_fsync_s"),
               "load_gbps": rate("bytes", "load_s"),
               "verify_gbps": rate("bytes", "verify_s"),
               "raw_read_gbps": rate("raw_bytes", "raw_read_s")}
    summary.update(save_vs_raw=summary["save_durable_gbps"] / summary["raw_write_durable_gbps"],
                   load_vs_raw=summary["load_gbps"] / summary["raw_read_gbps"])
    return {"model": args.checkpoint_model, "overrides": args.set,
            # Where, without this machine's paths: the filesystem is what the I/O measures.
            "directory": "scratch directory on the filesystem of "
                         + ("the system temp dir" if args.work_dir is None else "--work-dir"),
            "zero_stage": cfg.parallel.zero_stage, "dtype": cfg.train.dtype,
            "bytes": reps[-1]["bytes"],
            "reads": "cold in this VM's page cache (posix_fadvise DONTNEED after fsync); the "
                     "host may still cache the virtual disk",
            "reps": reps, **summary}
