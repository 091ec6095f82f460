"""``tape-data info DIR --verify``: every byte of a prepared directory against its manifest.

The readers check each listed shard's size when they open a directory but never hash it (that
would cost a full read of the corpus at every start). After copying a corpus to a cluster
(rsync, object storage, a tarball) ``verify_corpus`` reads every file the manifest lists —
training and held-out text shards, token shards — and compares size and sha256 with the
manifest; it also names listed files that are missing and files that look like shards but are
not listed (left from another prepare, or a corpus copied over another).

Files are hashed on a pool of threads, one file per thread at a time (``hashlib`` and file reads
release the GIL), in chunks of ``READ_BYTES``; progress goes through ``progress.ByteProgress``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tape_train.data.config import DataError
from tape_train.data.formats import MANIFEST_FORMAT, MANIFEST_NAME
from tape_train.data.tokens import TOKENS_SUFFIX
from tape_train.progress import ByteProgress

log = logging.getLogger("tape_train.data")

READ_BYTES = 16 << 20
# Names `tape-data prepare` gives its text and token shards.
SHARD_LIKE = re.compile(r"(train|eval)-\d{5}-of-\d{5}(\.jsonl\.zst|" + re.escape(TOKENS_SUFFIX)
                        + r")")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_buffers = threading.local()  # each hashing thread's read buffer


@dataclass
class Listed:
    """A file the manifest lists: its name in the directory, size and sha256."""

    name: str
    file_bytes: int
    sha256: str
    kind: str  # "text" or "tokens"


@dataclass(frozen=True)
class Problem:
    """What is wrong with one file: ``kind`` (missing, size mismatch, checksum mismatch,
    unreadable, not a file, unlisted, not checked) and the details."""

    name: str
    kind: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.name}: {self.kind}" + (f": {self.detail}" if self.detail else "")


@dataclass
class VerifyReport:
    """What ``verify_corpus`` found: ``problems`` in manifest order, then the unlisted files;
    empty when everything matches."""

    directory: Path
    listed: list[Listed]
    hashed_bytes: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def listed_files(directory: Path) -> list[Listed]:
    """The files ``directory``'s manifest lists (text shards, then token shards), read without
    looking at the files themselves. A manifest that is missing or cannot be read as one
    ``tape-data prepare`` writes is a ``DataError`` naming it and what is wrong."""
    from tape_train.data.prepare_scratch import unfinished_prepare_note
    from tape_train.data.tokens import _check_token_index

    path = Path(directory) / MANIFEST_NAME
    damaged = "the manifest is damaged or was edited: copy it again, or re-run `tape-data prepare`"
    if not Path(directory).is_dir():
        what = "is not a directory" if Path(directory).exists() else "does not exist"
        raise DataError(f"{directory} {what} (give the directory `tape-data prepare --out` "
                        f"wrote)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{path}: no such file: {directory} is not a directory written by "
                        f"`tape-data prepare`, or its copy lacks the manifest"
                        f"{unfinished_prepare_note(directory)}") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column "
                        f"{exc.colno}); {damaged}") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text (byte {exc.start}); {damaged}") from None
    if not isinstance(manifest, dict):
        raise DataError(f"{path}: a JSON {type(manifest).__name__}, not an object: not a "
                        f"manifest `tape-data prepare` writes; {damaged}")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise DataError(f"{path}: format {manifest.get('format')!r}, not {MANIFEST_FORMAT!r}: "
                        f"not a manifest `tape-data prepare` writes")
    tokens = manifest.get("tokens")
    sections = [("shards", manifest.get("shards"), "text")]
    if tokens is not None:
        if not isinstance(tokens, dict):
            raise DataError(f"{path}: tokens is a {type(tokens).__name__}, not an object; "
                            f"{damaged}")
        sections.append(("tokens.shards", tokens.get("shards"), "tokens"))
    listed = []
    for key, entries, kind in sections:
        if not isinstance(entries, list) or (kind == "text" and not entries):
            what = "missing" if entries is None else "empty" if entries == [] else "not a list"
            raise DataError(f"{path}: {key} is {what}; {damaged}")
        for i, entry in enumerate(entries):
            listed.append(_entry(entry, f"{path}: {key}[{i}]", damaged, kind))
    if tokens is not None:
        _check_token_index(tokens, path, "--verify")
    return listed


def _entry(entry, where: str, damaged: str, kind: str) -> Listed:
    if not isinstance(entry, dict):
        raise DataError(f"{where} is a {type(entry).__name__}, not an object; {damaged}")
    name, size, digest = entry.get("path"), entry.get("file_bytes"), entry.get("sha256")
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise DataError(f"{where}: path {name!r} is not a file name in the directory; {damaged}")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise DataError(f"{where} ({name}): file_bytes {size!r} is not a size in bytes; "
                        f"{damaged}")
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise DataError(f"{where} ({name}): sha256 {digest!r} is not a sha256 digest; {damaged}")
    return Listed(name, size, digest, kind)


def verify_corpus(directory: Path, *, workers: int = 1, progress: str | bool = "auto",
                  every_s: float = 5.0) -> VerifyReport:
    """Compare every file ``directory``'s manifest lists with its size and sha256 there.

    A file of another size is reported without being read; the others are hashed on up to
    ``workers`` threads. Progress: ``progress.ByteProgress`` (``progress`` its mode, a log
    line every ``every_s`` off a terminal). Raises ``DataError`` for a manifest it cannot
    read, ``KeyboardInterrupt`` on Ctrl-C (the threads stop within one chunk).
    """
    directory = Path(directory)
    report = VerifyReport(directory, listed_files(directory))
    wrong: dict[str, Problem] = {}
    to_hash: list[Listed] = []
    for item in report.listed:
        problem = _stat_problem(directory / item.name, item)
        if problem is not None:
            wrong[item.name] = problem
        else:
            to_hash.append(item)
    total = sum(item.file_bytes for item in to_hash)
    threads = max(1, min(workers, len(to_hash)))
    log.info("verify: hashing %d file(s) of %s (%s bytes) on %d thread(s)", len(to_hash),
             directory, f"{total:,}", threads)
    bar = ByteProgress(total, what="verify", logger=log, mode=progress, every_s=every_s)
    stop = threading.Event()
    started = time.monotonic()
    # Largest first: a long file started last would leave the other threads idle at the end.
    order = sorted(to_hash, key=lambda item: -item.file_bytes)
    tick_s = max(0.05, min(0.5, every_s))  # how often the bar is drawn or a line is due
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="verify")
    try:
        pending = {pool.submit(_hash_file, directory / item.name, bar, stop): item
                   for item in order}
        while pending:
            done, _ = concurrent.futures.wait(pending, timeout=tick_s,
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                item = pending.pop(future)
                problem = _content_problem(item, *future.result())
                if problem is not None:
                    wrong[item.name] = problem
            bar.tick()
    finally:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    report.seconds = time.monotonic() - started
    report.hashed_bytes = bar.done
    report.problems = [wrong[item.name] for item in report.listed if item.name in wrong]
    names = {item.name for item in report.listed}
    for path in sorted(directory.iterdir()):
        if SHARD_LIKE.fullmatch(path.name) and path.name not in names:
            report.problems.append(Problem(
                path.name, "unlisted", f"named like a shard, but {MANIFEST_NAME} does not list "
                f"it (left from another prepare, or a corpus copied over another?)"))
    return report


def _stat_problem(path: Path, item: Listed) -> Problem | None:
    """What is wrong with ``path`` that its metadata shows, or None."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return Problem(item.name, "missing", "a link to a file that does not exist"
                       if path.is_symlink() else "")
    except OSError as exc:
        return Problem(item.name, "unreadable", exc.strerror or str(exc))
    if not path.is_file():
        return Problem(item.name, "not a file", "the manifest lists a file; this is not a "
                       "regular file")
    if stat.st_size != item.file_bytes:
        return _size_problem(item, stat.st_size)
    return None


def _size_problem(item: Listed, found: int) -> Problem:
    cut = " (cut short)" if found < item.file_bytes else ""
    return Problem(item.name, "size mismatch",
                   f"{item.file_bytes:,} bytes expected, {found:,} found{cut}")


def _hash_file(path: Path, bar: ByteProgress,
               stop: threading.Event) -> tuple[int, str | None, str | None]:
    """(bytes read, sha256, read error) of ``path``: the sha256 is None after a read error
    (its reason) or when ``stop`` was set (no reason)."""
    digest, size = hashlib.sha256(), 0
    if not hasattr(_buffers, "buffer"):  # one per thread, not one per file
        _buffers.buffer = bytearray(READ_BYTES)
    buffer = _buffers.buffer
    view = memoryview(buffer)
    try:
        with open(path, "rb", buffering=0) as f:
            if hasattr(os, "posix_fadvise"):  # a longer read-ahead where the kernel offers it
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while n := f.readinto(buffer):
                if stop.is_set():
                    return size, None, None
                digest.update(view[:n])
                size += n
                bar.add(n)
    except OSError as exc:
        return size, None, exc.strerror or str(exc)
    return size, digest.hexdigest(), None


def _content_problem(item: Listed, size: int, digest: str | None,
                     error: str | None) -> Problem | None:
    if error is not None:
        return Problem(item.name, "unreadable", f"{error}, after {size:,} bytes")
    if digest is None:
        return Problem(item.name, "not checked", "stopped")
    if size != item.file_bytes:  # changed while it was read
        return _size_problem(item, size)
    if digest != item.sha256:
        return Problem(item.name, "checksum mismatch",
                       f"sha256 {digest[:16]}… found, {item.sha256[:16]}… expected "
                       f"(same size: bytes changed in the copy)")
    return None
