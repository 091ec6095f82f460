"""Checkpoint layout on disk: tag names, the completion marker, checksums, discovery.

Torch-free (the Slurm requeue guard and other tools import it without loading torch);
``tape_train.train.checkpoint`` re-exports every name and adds saving and loading. The layout
itself is described there.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

import xxhash

from tape_train.files import describe_os_error, human_bytes

log = logging.getLogger("tape_train.train")

CHECKPOINT_DIR = "checkpoints"
MARKER = "COMPLETE.json"
UNIVERSAL = "universal"
LATEST = "latest"
_TAG_RE = re.compile(r"^step_(\d{8,})$")
CHECKSUM = "xxh3_64"
# What marks a tape-export directory (``tape_train.model.pretrained.PROVENANCE``; not imported:
# this module stays torch-free).
EXPORT_PROVENANCE = "export.json"
_CHUNK = 8 << 20  # bytes read per call while checksumming


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which and what survives."""


def tag_for_step(step: int) -> str:
    return f"step_{step:08d}"


def step_of_tag(tag: str) -> int | None:
    match = _TAG_RE.match(tag)
    return int(match.group(1)) if match else None


def rank_state_name(rank: int) -> str:
    return f"trainer_state_rank{rank:05d}.pt"


def checkpoint_root(path: str | Path) -> Path:
    """``<run_dir>/checkpoints`` for a run dir; the path itself if it already is a root."""
    path = Path(path)
    if path.name == CHECKPOINT_DIR or list_tags(path):
        return path
    return path / CHECKPOINT_DIR


# ----------------------------------------------------------------------------------------------
# Discovery and validation (no process group needed)
# ----------------------------------------------------------------------------------------------


def read_marker(tag_dir: Path) -> dict:
    return json.loads((Path(tag_dir) / MARKER).read_text())


def launch_dirs(tag_dir: Path, meta: dict) -> list[Path]:
    """Directories the relative paths of a run's config (its data and tokenizer) may be
    relative to, other than the working directory, most likely first: the directory the run
    was started from as the checkpoint's place tells it (a relative ``train.run_dir`` that ends
    the path the run lies at: found also when the whole project moved), then the one the run
    recorded when it saved (``launch_dir`` in the marker)."""
    found: list[Path] = []
    train = (meta.get("config") or {}).get("train")
    run_dir = train.get("run_dir") if isinstance(train, dict) else None
    if isinstance(run_dir, str) and run_dir and not os.path.isabs(os.path.expanduser(run_dir)):
        here = Path(os.path.abspath(tag_dir)).parent.parent  # <run_dir>/checkpoints/<tag>
        parts = [p for p in Path(run_dir).parts if p != "."]
        if parts and ".." not in parts and len(parts) < len(here.parts) \
                and list(here.parts[-len(parts):]) == parts:
            found.append(Path(*here.parts[:-len(parts)]))
    recorded = meta.get("launch_dir")
    if isinstance(recorded, str) and os.path.isabs(recorded) and Path(recorded) not in found:
        found.append(Path(recorded))
    return found


def _exists(path: str) -> bool:
    return bool(glob.glob(path, recursive=True)) if glob.has_magic(path) else os.path.exists(path)


def with_run_paths(meta: dict, tag_dir: Path) -> dict:
    """``meta`` (a marker) with the relative paths of its ``config.data`` section — the
    tokenizer, each training and held-out source's ``path`` — rewritten to where they exist
    when this process runs from another directory than the run did (``launch_dirs``). A path
    that exists as written, relative to the working directory or absolute, is kept, as is one
    found nowhere (its reader names it as missing). Returns a copy; the marker on disk is
    left as it is."""
    data = (meta.get("config") or {}).get("data")
    if not isinstance(data, dict):
        return meta
    bases = launch_dirs(tag_dir, meta)

    def moved(path, key: str):
        if not isinstance(path, str) or not path:
            return path
        expanded = os.path.expanduser(path)
        if os.path.isabs(expanded) or _exists(expanded):
            return path
        for base in bases:
            candidate = str(base / expanded)
            if _exists(candidate):
                log.info("%s %s is not under the working directory; using %s (relative to the "
                         "directory the run was started from)", key, path, candidate)
                return candidate
        return path

    def sources(entries, key: str):
        if not isinstance(entries, list):
            return entries
        out = []
        for i, entry in enumerate(entries):
            k = f"data.{key}[{i}].path"
            if isinstance(entry, str):
                out.append(moved(entry, k))
            elif isinstance(entry, dict) and isinstance(entry.get("path"), list):
                out.append({**entry, "path": [moved(p, k) for p in entry["path"]]})
            elif isinstance(entry, dict) and "path" in entry:
                out.append({**entry, "path": moved(entry["path"], k)})
            else:
                out.append(entry)
        return out

    data = dict(data)
    if "tokenizer" in data:
        data["tokenizer"] = moved(data["tokenizer"], "data.tokenizer")
    for key in ("sources", "eval_sources"):
        if key in data:
            data[key] = sources(data[key], key)
    return {**meta, "config": {**meta["config"], "data": data}}


def marker_problem(marker) -> str | None:
    """``None`` if a parsed marker has the shape every reader relies on, else what is wrong: a
    JSON object whose ``files`` maps names to sizes, whose ``checksums`` (when recorded) map
    names to digests and whose ``config`` (when recorded) is an object. A marker that parses
    but is garbled otherwise (edited by hand, damaged on disk) is then skipped like one that
    does not parse, instead of failing later in whichever reader meets the bad value."""
    if not isinstance(marker, dict):
        return f"a JSON {type(marker).__name__}, not an object"
    files = marker.get("files")
    if not isinstance(files, dict):
        return "no 'files' object" if files is None else (
            f"'files' is a {type(files).__name__}, not an object")
    for name, size in files.items():
        if type(size) is not int or size < 0:
            return f"'files' gives {name} the size {size!r}, not a byte count"
    sums = marker.get("checksums")
    if sums is not None and not (isinstance(sums, dict)
                                 and all(isinstance(v, str) for v in sums.values())):
        return "'checksums' is not an object of hex digests"
    if "config" in marker and not isinstance(marker["config"], dict):
        return f"'config' is a {type(marker['config']).__name__}, not an object"
    return None


def why_incomplete(tag_dir: Path) -> str | None:
    """``None`` if ``tag_dir`` is a complete checkpoint, else the reason it is not."""
    tag_dir = Path(tag_dir)
    marker_path = tag_dir / MARKER
    if not marker_path.is_file():
        return f"no {MARKER} (the save was interrupted or failed)"
    try:
        marker = read_marker(tag_dir)
    except (OSError, ValueError) as exc:
        return f"unreadable {MARKER} ({exc})"
    problem = marker_problem(marker)
    if problem is not None:
        return f"unreadable {MARKER} ({problem})"
    for name, size in marker["files"].items():
        path = tag_dir / name
        if not path.is_file():
            return f"missing file {name}"
        actual = path.stat().st_size
        if actual != size:
            return f"file {name} has {actual} bytes, {size} were written"
    return None


def file_checksum(path: Path) -> str:
    """xxh3-64 of a file's bytes as 16 hex digits, read once in 8 MiB chunks.

    xxh3 runs at memory speed (several GB/s per core), so hashing costs a fraction of the
    disk time of the write or read it guards (benchmarks/checkpoint_io.py measures both).
    """
    digest = xxhash.xxh3_64()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while True:
            n = fh.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
    return digest.hexdigest()


def checksum_bytes(data: bytes) -> str:
    return xxhash.xxh3_64(data).hexdigest()


def describe_size(tag_dir: Path) -> str:
    """``"12 files, 3.4 GiB"``: what reading a complete tag means (from its marker), for the
    line a long read starts with."""
    files = read_marker(tag_dir).get("files") or {}
    return f"{len(files)} files, {human_bytes(sum(files.values()))}"


def verify_files(tag_dir: Path, names: list[str] | None = None) -> str | None:
    """``None`` if every listed file (default: all of the marker) matches its recorded
    checksum, else one line naming the first file that does not. Markers written before
    checksums existed have nothing to compare: sizes only (``why_incomplete``)."""
    tag_dir = Path(tag_dir)
    try:
        marker = read_marker(tag_dir)
    except (OSError, ValueError) as exc:
        return f"unreadable {MARKER} ({exc})"
    sums = marker.get("checksums") or {}
    for name in (sorted(sums) if names is None else names):
        expected = sums.get(name)
        if expected is None:
            continue
        path = tag_dir / name
        try:
            actual = file_checksum(path)
        except OSError as exc:
            return f"cannot read {describe_os_error(exc, path)}"
        if actual != expected:
            return (f"file {path} is damaged: {marker.get('checksum', CHECKSUM)} {actual}, "
                    f"{expected} was written (same size: bytes changed on disk or in transit)")
    return None


def stray_tag_file(path: Path) -> str:
    """Why ``path``, a checkpoint tag's name taken by something that is not a directory (a
    file copied or written there by hand), stops a save: the end of the message."""
    kind = "a symbolic link" if path.is_symlink() else "a file"
    return (f"{kind} of that name is there, not a checkpoint directory, and the save of step "
            f"{step_of_tag(path.name)} writes a directory there: move it away (it is not "
            f"deleted)")


def list_tags(root: Path) -> list[Path]:
    """Tag directories under a checkpoint root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    tags = [p for p in root.iterdir() if p.is_dir() and step_of_tag(p.name) is not None]
    return sorted(tags, key=lambda p: step_of_tag(p.name))


def stray_tag_files(root: Path) -> list[Path]:
    """What holds a tag's name under a checkpoint root but is not a directory, oldest first
    (``list_tags`` skips them; a save of that step would fail on them)."""
    root = Path(root)
    if not root.is_dir():
        return []
    stray = [p for p in root.iterdir() if step_of_tag(p.name) is not None and not p.is_dir()]
    return sorted(stray, key=lambda p: step_of_tag(p.name))


def find_newest(path: str | Path, why_not: Callable[[Path], str | None],
                warn: bool = True) -> Path | None:
    """Newest tag directory under a run dir or checkpoint root for which ``why_not(tag)`` is
    None (``None``: no such tag). Newer tags are skipped with a warning naming the reason."""
    for tag_dir in reversed(list_tags(checkpoint_root(path))):
        reason = why_not(tag_dir)
        if reason is None:
            return tag_dir
        if warn:
            log.warning("skipping checkpoint %s: %s", tag_dir, reason)
    return None


def find_latest_complete(path: str | Path, warn: bool = True) -> Path | None:
    """Newest complete tag directory (its marker and every file's size check out)."""
    return find_newest(path, why_incomplete, warn)


def newest_complete_tag(run_dir: str | Path) -> str | None:
    """Name of the newest complete checkpoint (sizes checked, nothing read), or ``None``: what
    the Slurm requeue guard and the in-job restart guard compare to tell progress from a stall
    (a run that saved nothing since the last look made no progress)."""
    found = find_latest_complete(run_dir, warn=False)
    return found.name if found is not None else None


def resolve_checkpoint(path: str | Path, verify: bool = True) -> Path:
    """A complete tag directory from a run dir, a checkpoint root or a tag dir; raises else.

    With ``verify`` (tape-export, tape-eval) every file is read back and checked against its
    recorded checksum on this process: a damaged checkpoint is refused, naming the file, even
    when it is the latest of a run dir (an older step is never substituted silently).
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} is a file, not a directory: give a run "
                              f"directory (its latest complete checkpoint), its checkpoints "
                              f"directory or one checkpoint's step_* directory")
    if (path / EXPORT_PROVENANCE).is_file() and not list_tags(checkpoint_root(path)):
        raise CheckpointError(f"{path} is a model export (it holds {EXPORT_PROVENANCE}), not a "
                              f"training checkpoint: give the run directory or checkpoint it "
                              f"was exported from (its source is in {EXPORT_PROVENANCE})")
    if step_of_tag(path.name) is not None or (path / MARKER).exists():
        reason = why_incomplete(path)
        if reason is not None:
            raise CheckpointError(f"checkpoint {path} is not complete: {reason}; refusing to "
                                  f"use it (pick a complete one, or the run dir for the latest)")
        found = path
    elif verify:
        # A save that never finished (no marker, or one that does not parse) is skipped; a
        # finished one whose files changed since is damaged, like a checksum mismatch below.
        found = find_newest(path, lambda tag: None if _save_finished(tag)
                            else _unfinished_save(tag))
        if found is None:
            raise CheckpointError(f"no complete checkpoint under {checkpoint_root(path)}")
        reason = why_incomplete(found)
        if reason is not None:
            raise _damaged(found, f"{reason} (its save had finished: files changed or went "
                                  f"missing since)")
    else:
        found = find_latest_complete(path)
        if found is None:
            raise CheckpointError(f"no complete checkpoint under {checkpoint_root(path)}")
    if verify:
        try:
            log.info("checking %s against its checksums (%s)", found, describe_size(found))
        except (OSError, ValueError) as exc:
            raise deleted_while_read(found, exc) or _damaged(found, f"unreadable {MARKER} "
                                                                   f"({exc})") from None
        reason = verify_files(found)
        if reason is not None:
            raise deleted_while_read(found, reason) or _damaged(found, reason)
    return found


def deleted_while_read(tag_dir: Path, exc: BaseException,
                       when: str = "while it was being read") -> CheckpointError | None:
    """The error for a reader whose checkpoint went away under it (``exc``: what the read
    raised), or ``None`` while the tag is still there. A training run on the same run dir
    deletes its older tags (``checkpoint.keep``) as it saves newer ones, so a long
    ``tape-export`` or ``tape-eval`` of a live run can lose its tag half-way: say so, and what
    to do, instead of the bare ``No such file`` of whichever file came next. ``when`` says
    since when it was relied on (``tape-eval`` checks every checkpoint at the start and reads
    each one's weights only at its turn)."""
    tag_dir = Path(tag_dir)
    if (tag_dir / MARKER).is_file():
        return None
    return CheckpointError(
        f"checkpoint {tag_dir} was deleted {when} ({exc}): a training run on "
        f"this run directory deletes its older checkpoints as it saves newer ones "
        f"(checkpoint.keep); run this again (it reads the newest complete one), or copy the "
        f"tag directory elsewhere first and read the copy")


def _unfinished_save(tag_dir: Path) -> str | None:
    """``why_incomplete`` for a reader (not the run writing the tags): a tag without its marker
    in a run directory that a run holds may still be being written, not abandoned."""
    reason = why_incomplete(tag_dir)
    from tape_train.train.run_lock import LOCK_NAME

    if reason is not None and not (tag_dir / MARKER).exists() and \
            (tag_dir.parent.parent / LOCK_NAME).is_file():
        reason = (f"no {MARKER}: being written by the run that holds "
                  f"{tag_dir.parent.parent / LOCK_NAME}, or a save that was interrupted")
    return reason


def _save_finished(tag_dir: Path) -> bool:
    """Whether the save of ``tag_dir`` got as far as a marker of the right shape (whatever
    happened to its files afterwards)."""
    try:
        return marker_problem(read_marker(tag_dir)) is None
    except (OSError, ValueError):
        return False


def _damaged(tag_dir: Path, reason: str) -> CheckpointError:
    """The refusal of a damaged checkpoint for readers that never substitute an older step
    silently, naming the newest older complete one."""
    step = step_of_tag(tag_dir.name)
    older = [t for t in list_tags(tag_dir.parent)
             if step is not None and step_of_tag(t.name) < step and why_incomplete(t) is None]
    hint = f"; an older complete checkpoint: {older[-1]}" if older else ""
    return CheckpointError(f"checkpoint {tag_dir}: {reason}; refusing to use it{hint}")


# ----------------------------------------------------------------------------------------------
