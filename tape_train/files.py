"""Durable file writes and filesystem errors that say what happened. Torch-free.

``write_atomic`` is the one way the project writes a file a reader may trust (a checkpoint
marker, a report, a manifest, a config copy, a tokenizer): the bytes go to a temporary file in
the same directory, the file is fsynced, renamed onto the target and the directory is fsynced.
A reader sees the old file or the new one, never a part; a crash leaves at most a hidden
``.<name>.*.tmp`` file, which the next write of the same name does not depend on.
``atomic_path`` does the same for a writer that needs a file name rather than bytes.

``describe_os_error`` turns an ``OSError`` into one line naming the path, and for a full disk
says "no space left on device" with the bytes needed and free.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO


class FileWriteError(OSError):
    """A file could not be written; ``str()`` is one line naming the path and the cause."""


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in directory ``path`` durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (and Windows) refuse fsync on a directory
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, data: bytes | str | Callable[[IO], object], *,
                 mode: int | None = None) -> Path:
    """Write ``data`` to ``path`` so a reader sees the old file or the complete new one.

    Args:
        path: target file; its directory is created if missing.
        data: bytes, text (UTF-8), or a callable ``write(binary_file)`` that writes the content
            (e.g. ``lambda f: fig.savefig(f, format="png")``).
        mode: permission bits of the new file (default: what ``open()`` gives under the umask).

    Raises ``FileWriteError`` (an ``OSError`` with the same errno) naming ``path``; the target is
    then unchanged and the temporary file removed.
    """
    size = len(data.encode() if isinstance(data, str) else data) if not callable(data) else 0
    with atomic_path(path, mode=mode, needed=size) as tmp:
        with open(tmp, "wb") as fh:
            if callable(data):
                data(fh)
            else:
                fh.write(data.encode() if isinstance(data, str) else data)
    return Path(path)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, mode: int | None = None,
                needed: int | None = None) -> Iterator[Path]:
    """``write_atomic`` for a writer that wants a file name (``torch.profiler``'s trace export):
    yields a temporary path beside ``path``; when the block ends the file written there is
    fsynced and renamed onto ``path``, and if it raises the temporary file is removed and
    ``path`` is unchanged. ``needed``: bytes to be written, for the message of a full disk.

    Raises ``FileWriteError`` as ``write_atomic`` does.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
    except OSError as exc:
        raise FileWriteError(exc.errno, describe_os_error(exc, path.parent)) from exc
    try:
        yield Path(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if mode is None:  # mkstemp creates 0600; a plain open() would honour the umask
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and not isinstance(exc, FileWriteError):
            raise FileWriteError(exc.errno, describe_os_error(exc, path, needed=needed)) from exc
        raise


def nearest_existing(path: str | os.PathLike) -> Path:
    """``path`` itself when it exists, else its nearest ancestor that does (where a
    ``mkdir -p path`` would start writing)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def unwritable_reason(directory: str | os.PathLike) -> str | None:
    """Why ``directory`` (existing or to be made) cannot hold new files of this user: its
    nearest existing part is a file, or a directory without write permission; ``None`` when
    permissions allow it (checked before a long job, not a guarantee)."""
    existing = nearest_existing(directory)
    if not existing.is_dir():
        return f"{existing} exists and is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user"
    return None


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes available to this user on the filesystem holding ``path`` (its nearest existing
    parent); ``None`` if that cannot be asked."""
    try:
        return shutil.disk_usage(nearest_existing(path)).free
    except OSError:
        return None


def is_disk_full(exc: BaseException) -> bool:
    """True for ENOSPC/EDQUOT anywhere in the exception's cause chain, or for the messages
    torch.save gives when its writer hits a full disk."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc).lower()
        if "no space left" in text or "disk quota exceeded" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def file_size_limit_hit(exc: BaseException) -> int | None:
    """This process's file-size limit (``RLIMIT_FSIZE``, ``ulimit -f``) in bytes when ``exc``
    is a write stopped by it: EFBIG in the cause chain, or torch.save's "unexpected pos" (its
    writer hides the errno) while such a limit is set. ``None`` otherwise."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        return None
    if limit == resource.RLIM_INFINITY:
        return None
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
            return limit
        if "unexpected pos" in str(exc):
            return limit
        exc = exc.__cause__ or exc.__context__
    return None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def describe_os_error(exc: BaseException, path: str | os.PathLike, *,
                      needed: int | None = None) -> str:
    """One line: what failed on which path. A full disk says so, with bytes needed and free.

    ``path`` is what the caller was writing; the file the OS names (``exc.filename``, e.g. a
    temporary file) is added when it differs.
    """
    free = free_bytes(path) if is_disk_full(exc) else None
    filename = getattr(exc, "filename", None)
    if filename and Path(filename) != Path(path):
        path = f"{path} ({filename})"
    if is_disk_full(exc):
        parts = [f"no space left on device writing {path}"]
        if needed:
            parts.append(f"needs {human_bytes(needed)} ({needed} bytes)")
        if free is not None:
            parts.append(f"{human_bytes(free)} ({free} bytes) free")
        return ", ".join(parts)
    reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    limit = file_size_limit_hit(exc)
    if limit is not None:
        reason += (f" (this process's file-size limit, `ulimit -f`, is {human_bytes(limit)}: "
                   f"raise or remove it)")
    return f"{path}: {reason}"


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory under ``root`` (before renaming a directory written
    file by file into place, e.g. an export)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host; a zombie (killed, not yet reaped) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True  # no /proc (macOS): the kill probe is all there is


def process_start(pid: int) -> str | None:
    """``<boot id>:<start time in clock ticks>`` of process ``pid``: unique to one process on
    this host across pid reuse and reboots; ``None`` without ``/proc`` or without the process."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        ticks = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
    return f"{boot}:{ticks}"


def remove_abandoned_scratch(parent: str | os.PathLike, prefix: str) -> list[Path]:
    """Delete the scratch directories ``<parent>/<prefix><pid>[-...]`` whose process is gone
    (a killed ``tape-data prepare`` or ``tape-export`` leaves one): their owner was on this
    host, as scratch names carry a local pid, and no live process writes into them. Returns
    what was removed."""
    import re

    pattern = re.compile(re.escape(prefix) + r"(\d+)(?:-|$)")
    removed = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = pattern.match(entry.name)
        if match and entry.is_dir() and not entry.is_symlink() and not pid_alive(int(match[1])):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def raise_open_file_limit(needed: int) -> int:
    """Raise this process's soft limit of open files towards ``needed`` (up to the hard limit,
    as ``ulimit -n`` may); returns the soft limit now in force (``needed`` where there is no
    such limit to read)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return needed
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return needed if soft == resource.RLIM_INFINITY else soft
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft
    return target
