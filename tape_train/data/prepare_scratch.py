"""Where ``tape-data prepare`` writes before its output is complete, and how it resumes.

A prepare writes into ``<out>/.tmp-prepare-resume-<key>/``, ``key`` a digest of every option
that shapes the output (the manifest's ``config``, shard count, held-out fraction, seed,
shuffle buffer, zstd frame size, tokenizer). At deterministic points of the pass (after each
flush of the shuffle buffer, whether or not the run is later interrupted) it takes a
*checkpoint*: every data file is flushed and fsynced, then ``state.json`` is written atomically,
naming each file's size and everything else the rest of the pass depends on. A kill at any
moment leaves files at least as long as the last state says; a re-run with the same key and the
same inputs truncates them back and goes on from there, so its output is byte-identical to an
uninterrupted run. Other keys' scratch (other options) is removed, as is this key's when the
inputs changed or ``--fresh`` asks.

``seen.bin`` holds the dedup digests (16 bytes each) in the order they were added; a checkpoint
appends only the new ones.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
from pathlib import Path
from typing import IO

from tape_train.data.config import DataError
from tape_train.data.state import digest
from tape_train.files import pid_alive, process_start, remove_abandoned_scratch, write_atomic

log = logging.getLogger("tape_train.data")

# Scratch of prepares before resume existed (``.tmp-prepare-<pid>``): removed once the pid is gone.
SCRATCH_PREFIX = ".tmp-prepare-"
RESUME_PREFIX = ".tmp-prepare-resume-"
STATE_NAME = "state.json"
OWNER_NAME = "owner.json"
SEEN_NAME = "seen.bin"
DIGEST_BYTES = 16
# Bumped whenever what a state means changes: an older state is then started over, not misread.
RESUME_FORMAT = 1
# Test hook: the process SIGKILLs itself at the named point ("checkpoint-K" after the state of
# checkpoint K is written, "data-K" after its data but before its state, "moved" after the
# first finished shard is moved into place, "manifest" after the manifest is written). Tests
# use it to interrupt at exact points.
KILL_ENV = "TAPE_DATA_TEST_KILL_AT"


def kill_point(name: str) -> None:
    if os.environ.get(KILL_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def resume_key(options: dict) -> str:
    """The digest naming the scratch directory of a prepare with these ``options``."""
    return digest({"resume_format": RESUME_FORMAT, **options})


def describe_option_change(old: dict | None, new: dict) -> str:
    """The options (``--seed 0 -> 1``, ``inputs [...] -> [...]``) that differ between an
    interrupted prepare and this one, in a few words."""
    if not isinstance(old, dict):
        return "its options are not recorded"
    flat_old = {**(old.get("config") or {}), **{k: v for k, v in old.items() if k != "config"}}
    flat_new = {**(new.get("config") or {}), **{k: v for k, v in new.items() if k != "config"}}
    changes = [f"{name} {flat_old.get(name)!r} -> {flat_new.get(name)!r}"
               for name in sorted(set(flat_old) | set(flat_new))
               if flat_old.get(name) != flat_new.get(name)]
    return "; ".join(changes) or "its options differ"


def describe_input_change(old, new) -> str:
    """What differs between two input identities (``{"files": [[path, size, mtime_ns], ...]}``
    for local files, Hub facts for a Hub dataset), in a few words."""
    if isinstance(old, dict) and isinstance(new, dict):
        if isinstance(old.get("files"), list) and isinstance(new.get("files"), list):
            before = {f[0]: f[1:] for f in old["files"]}
            after = {f[0]: f[1:] for f in new["files"]}
            for path, stat in after.items():
                if path not in before:
                    return f"{path} is new"
                if stat != before[path]:
                    return (f"{path} changed (size {before[path][0]} -> {stat[0]} bytes)"
                            if stat[0] != before[path][0] else f"{path} was modified")
            for path in before:
                if path not in after:
                    return f"{path} is gone"
        for name in sorted(set(old) | set(new)):
            if old.get(name) != new.get(name):
                return f"{name} {old.get(name)!r} -> {new.get(name)!r}"
    return "the inputs differ"


class DigestLog:
    """The dedup set of a prepare and its append-only file (``seen.bin``)."""

    def __init__(self, path: Path, keep: int | None = None):
        if keep is None:
            self.file = open(path, "wb")
            self.seen: set[bytes] = set()
        else:  # the file was truncated to ``keep`` digests by PrepareScratch.open
            self.file = open(path, "r+b")
            data = self.file.read()
            self.seen = {data[i:i + DIGEST_BYTES] for i in range(0, len(data), DIGEST_BYTES)}
            if len(self.seen) != keep:
                raise DataError(f"{path}: holds {len(self.seen)} distinct digests, its state "
                                f"says {keep}; re-run with --fresh")
        self.new: list[bytes] = []

    def __len__(self) -> int:
        return len(self.seen)

    def add(self, key: bytes) -> bool:
        """False if ``key`` was seen before; else remember it."""
        if key in self.seen:
            return False
        self.seen.add(key)
        self.new.append(key)
        return True

    def checkpoint(self) -> int:
        """Append the digests added since the last checkpoint; returns how many there are."""
        self.file.write(b"".join(self.new))
        self.new.clear()
        return len(self.seen)


class PrepareScratch:
    """The scratch directory of one prepare, and its last checkpoint (``state``: None to start
    from the first document)."""

    def __init__(self, out: Path, options: dict):
        self.out = out
        self.options = options
        self.key = resume_key(options)
        self.dir = out / f"{RESUME_PREFIX}{self.key}"
        self.state: dict | None = None

    @classmethod
    def open(cls, out: Path, options: dict, inputs, fresh: bool = False) -> PrepareScratch:
        """Sweep away what other prepares left in ``out``, then resume the scratch of
        ``options`` if its inputs are ``inputs`` (and not ``fresh``), else start it empty.

        An interrupted prepare with other options that reached a checkpoint is not thrown
        away on a mere re-run (a changed flag or a path written differently would lose hours
        of work): that is refused, naming what differs, until ``fresh`` discards it."""
        with _claiming(out):
            return cls._open(out, options, inputs, fresh)

    @classmethod
    def _open(cls, out: Path, options: dict, inputs, fresh: bool) -> PrepareScratch:
        for left in remove_abandoned_scratch(out, SCRATCH_PREFIX):
            log.info("prepare: removed %s, left by an interrupted prepare", left)
        self = cls(out, options)
        for other in sorted(out.glob(f"{RESUME_PREFIX}*")):
            if other.name == self.dir.name or not other.is_dir() or other.is_symlink():
                continue
            if _live_owner(other) is not None:
                continue
            done = _checkpointed(other)
            if done is not None and not fresh:
                raise DataError(
                    f"prepare: {out} holds an interrupted prepare with other options "
                    f"({describe_option_change(done.get('options'), options)}) that got to "
                    f"checkpoint {done.get('checkpoint')} ({other.name}); re-run it with its "
                    f"own options to resume it, or add --fresh to discard it and start this one")
            shutil.rmtree(other, ignore_errors=True)
            log.info("prepare: removed %s, left by an interrupted prepare with other options%s",
                     other, " (--fresh)" if done is not None else " before its first checkpoint")
        owner = _live_owner(self.dir)
        if owner is not None:
            raise DataError(f"prepare: {out} is being written by another tape-data prepare with "
                            f"the same options (pid {owner}, scratch {self.dir}); wait for it "
                            f"to finish or stop it")
        state = self._read_state() if self.dir.is_dir() else None
        reason = None
        if self.dir.is_dir():
            if fresh:
                reason = "--fresh"
            elif state is None:
                reason = "it was stopped before its first checkpoint"
            elif state.get("inputs") != inputs:
                reason = (f"its input changed since: "
                          f"{describe_input_change(state.get('inputs'), inputs)}")
            else:
                reason = self._truncate(state)
        if reason is not None:
            log.info("prepare: starting over, not resuming the interrupted prepare in %s: %s",
                     self.dir, reason)
            state = None
        if state is None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir.mkdir()
        self.state = state
        write_atomic(self.dir / OWNER_NAME, json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(),
             "pid_start": process_start(os.getpid())}) + "\n")
        return self

    def _read_state(self) -> dict | None:
        try:
            state = json.loads((self.dir / STATE_NAME).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(state, dict) or state.get("format") != RESUME_FORMAT \
                or state.get("key") != self.key:
            return None
        return state

    def saved_checkpoint(self) -> int:
        """The checkpoint a resume would start from: the state on disk, which a stop signal
        arriving between its write and ``self.state``'s update would otherwise contradict."""
        state = self._read_state()
        return int(state.get("checkpoint", 0)) if state is not None else 0

    def _truncate(self, state: dict) -> str | None:
        """Cut every data file back to the size its checkpoint recorded (a kill after the
        checkpoint leaves more); the reason not to resume if one is shorter or missing."""
        sizes = state.get("files", {})
        for name, size in sizes.items():
            path = self.dir / name
            if not path.is_file() or path.stat().st_size < size:
                return f"{name} is missing or shorter than its checkpoint recorded"
        for name, size in sizes.items():
            os.truncate(self.dir / name, size)
        return None

    def save(self, checkpoint: int, inputs, progress: dict, files: list[IO]) -> None:
        """Checkpoint ``checkpoint``: ``files`` flushed and fsynced, then the state naming
        their sizes written atomically, so no state ever describes data not yet on disk."""
        sizes = {}
        for f in files:
            f.flush()
            os.fsync(f.fileno())
            sizes[Path(f.name).name] = f.tell()
        kill_point(f"data-{checkpoint}")
        state = {"format": RESUME_FORMAT, "key": self.key, "options": self.options,
                 "inputs": inputs,
                 "checkpoint": checkpoint, "files": sizes, "progress": progress}
        write_atomic(self.dir / STATE_NAME, json.dumps(state) + "\n")
        self.state = state  # only once written: a save that failed is not the one to resume
        kill_point(f"checkpoint-{checkpoint}")

    def save_final(self, inputs, manifest: dict) -> None:
        """The pass is complete and its files fsynced: what is left is moving them into place
        and writing ``manifest``."""
        self.state = {"format": RESUME_FORMAT, "key": self.key, "options": self.options,
                      "inputs": inputs,
                      "checkpoint": (self.state or {}).get("checkpoint", 0), "files": {},
                      "manifest": manifest}
        write_atomic(self.dir / STATE_NAME, json.dumps(self.state, ensure_ascii=False) + "\n")

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def remove_finished_scratch(out: Path) -> None:
    """Remove what a prepare killed between writing its manifest and removing its scratch left
    (a complete directory needs none of it)."""
    for directory in sorted(Path(out).glob(f"{RESUME_PREFIX}*")):
        try:
            finished = "manifest" in json.loads((directory / STATE_NAME).read_text())
        except (OSError, ValueError, TypeError):
            continue
        if finished and _live_owner(directory) is None:
            shutil.rmtree(directory, ignore_errors=True)
            log.info("prepare: removed %s, left by a prepare that completed", directory)


def interrupted_scratch(out: Path) -> list[tuple[Path, dict]]:
    """The scratch directories in ``out`` of prepares that were interrupted after a checkpoint
    and are not running (e.g. a ``--force`` rebuild of a complete directory), with their
    states: work a re-run with the same options resumes, and disk it holds meanwhile."""
    found = []
    for directory in sorted(Path(out).glob(f"{RESUME_PREFIX}*")):
        state = _checkpointed(directory) if directory.is_dir() else None
        if state is not None and _live_owner(directory) is None:
            found.append((directory, state))
    return found


@contextlib.contextmanager
def _claiming(out: Path):
    """Held while a prepare looks for live owners and writes its own ``owner.json``: two
    prepares started at once on this host would otherwise both find no owner, then both
    resume (or one delete the other's scratch) and write the same files. A filesystem without
    ``flock`` on directories leaves only the owner check."""
    fd = os.open(out, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _checkpointed(directory: Path) -> dict | None:
    """The state of the interrupted prepare in ``directory`` if it reached a checkpoint (work a
    re-run with its options would resume), else None."""
    try:
        state = json.loads((directory / STATE_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or state.get("format") != RESUME_FORMAT:
        return None
    return state if state.get("checkpoint") or "manifest" in state else None


def _live_owner(directory: Path) -> int | None:
    """The pid of a live process on this host that owns ``directory`` (None: none, or the
    owner is this process, or its pid now names another process, or it ran on another host:
    a prepare moved to another node after its job was preempted resumes there)."""
    try:
        owner = json.loads((directory / OWNER_NAME).read_text())
        host, pid = owner["host"], int(owner["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host != socket.gethostname() or pid == os.getpid() or not pid_alive(pid):
        return None
    recorded = owner.get("pid_start")
    if recorded is not None and process_start(pid) not in (None, recorded):
        return None  # the pid was reused (the owner died, perhaps before a reboot)
    return pid


def unfinished_prepare_note(out: Path) -> str:
    """For a directory read as a corpus that has no manifest: what an unfinished prepare left
    in it (its scratch), or "" if none — the error then says to finish that prepare rather
    than that the directory holds no data."""
    scratch = sorted(p for p in Path(out).glob(f"{SCRATCH_PREFIX}*") if p.is_dir())
    if not scratch:
        return ""
    owner = _live_owner(scratch[0])
    state = _checkpointed(scratch[0])
    if owner is not None:
        status = f"still running (pid {owner})"
    elif state is not None:
        status = (f"interrupted at checkpoint {state.get('checkpoint')}: re-running it with its "
                  f"options resumes it")
    else:
        status = "interrupted before its first checkpoint: re-running it starts it over"
    return (f"; it holds the scratch of an unfinished `tape-data prepare` ({scratch[0].name}, "
            f"{status}); use the directory once that prepare has finished")
