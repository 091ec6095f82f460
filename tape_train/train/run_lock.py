"""One training run per run directory: ``<run_dir>/RUN.lock``. Torch-free.

The lock file is created by hard-linking a private, fully written file to the lock name (the
link is atomic and fails if the name exists, on local filesystems and on NFS, Lustre, GPFS;
a reader never sees a lock without content). It holds JSON naming its holder: host, pid, Slurm job id and restart count,
start time. Only rank 0 takes it; the trainer makes the verdict collective, so every rank of
a refused run stops before touching anything.

A lock is *stale*, and taken over with a log line, when its holder

* ran on this host and its pid no longer exists (a killed run, a crashed node that came back),
  or now belongs to another process: the lock records the holder's start (boot id and start
  time from ``/proc``), so a pid reused by an unrelated process (a container restarted under
  the same host name gets the same small pid) is not taken for the holder;
* is an earlier incarnation of this same Slurm job (same ``SLURM_JOB_ID``, another
  ``SLURM_RESTART_COUNT``): a requeued job restarts while its predecessor's lock remains.

Anything else (a live process here, any process on another host, another job) refuses the
start with one line naming the holder. A lock that cannot be parsed is refused too (it may be
being written): delete it by hand once sure nothing runs there.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from tape_train.files import fsync_dir, pid_alive

log = logging.getLogger("tape_train.train")

LOCK_NAME = "RUN.lock"


class RunLockError(RuntimeError):
    """The run directory is in use (or its lock is unreadable); the message names the holder."""


def _identity() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT", "0"),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "pid_start": process_start(os.getpid()),
            "token": f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"}


def describe_holder(holder: dict) -> str:
    job = holder.get("slurm_job_id")
    where = f"host {holder.get('host')}, pid {holder.get('pid')}"
    if job:
        where += f", Slurm job {job} (restart {holder.get('slurm_restart_count')})"
    return f"{where}, started {holder.get('started')}"


def process_start(pid: int) -> str | None:
    """``<boot id>:<start time in clock ticks>`` of process ``pid``: unique to one process on
    this host across pid reuse and reboots; ``None`` without ``/proc`` or without the process."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        ticks = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
    return f"{boot}:{ticks}"


def stale_reason(holder: dict, me: dict) -> str | None:
    """Why ``holder``'s lock may be taken over by ``me``; ``None``: it may not."""
    job = holder.get("slurm_job_id")
    if job and job == me.get("slurm_job_id") \
            and str(holder.get("slurm_restart_count")) != str(me.get("slurm_restart_count")):
        return (f"left by the previous incarnation of Slurm job {job} (restart "
                f"{holder.get('slurm_restart_count')}; this is restart "
                f"{me.get('slurm_restart_count')})")
    if holder.get("host") == me.get("host"):
        try:
            pid = int(holder.get("pid"))
        except (TypeError, ValueError):
            return None
        if pid != me.get("pid") and not pid_alive(pid):
            return f"its process {pid} on this host no longer exists"
        recorded, now = holder.get("pid_start"), process_start(pid)
        if recorded and now and recorded != now:
            return (f"its process {pid} on this host no longer exists (pid {pid} now belongs "
                    f"to another process, started after the lock was taken)")
    return None


def _refusal(path: Path, holder: dict | None, me: dict) -> str | None:
    """Why ``me`` may not take the lock at ``path`` held by ``holder`` (``{}``: released);
    ``None`` when it may (no holder, or a stale one)."""
    if holder is None:
        return (f"run directory {path.parent} has an unreadable lock {path}; if no run uses "
                f"the directory, delete it")
    if holder and stale_reason(holder, me) is None:
        ended = (f"; if Slurm job {holder['slurm_job_id']} has ended (`squeue -j "
                 f"{holder['slurm_job_id']}`) it was killed before releasing the lock: delete "
                 f"the lock" if holder.get("slurm_job_id") else "")
        return (f"run directory {path.parent} is in use by another run "
                f"({describe_holder(holder)}; lock {path}). Use another train.run_dir, or wait "
                f"for that run to end{ended}")
    return None


def lock_refusal(run_dir: str | os.PathLike) -> str | None:
    """What ``RunLock(run_dir).acquire()`` would refuse with now, without taking the lock
    (``None``: it would succeed). For start-up checks that run before the trainer."""
    lock = RunLock(run_dir)
    return _refusal(lock.path, lock._read(), lock.me)


class RunLock:
    """The lock of one run directory, held by this process until ``release()``."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.me = _identity()
        self.held = False

    def acquire(self) -> RunLock:
        """Take the lock (taking over a stale one); raise ``RunLockError`` naming the holder."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunLockError(f"cannot create run directory {self.path.parent}: "
                               f"{exc.strerror or exc}") from exc
        for _ in range(3):  # a takeover race with another starter is retried, then refused
            if self._create():
                self.held = True
                return self
            holder = self._read()
            refusal = _refusal(self.path, holder, self.me)
            if refusal is not None:
                raise RunLockError(refusal)
            if not holder:
                continue  # released meanwhile: create again
            reason = stale_reason(holder, self.me)
            if self._take_over(holder):
                log.warning("took over the lock of run directory %s from %s: %s",
                            self.path.parent, describe_holder(holder), reason)
        raise RunLockError(f"could not take the lock {self.path}: other processes are starting "
                           f"on the same run directory")

    def _create(self) -> bool:
        """Write our record to a private file, then hard-link it to the lock name: the link
        fails if the lock exists, and a reader never sees a lock without its content."""
        tmp = self.path.with_name(f".{LOCK_NAME}.{self.me['token'].replace(':', '-')}.tmp")
        try:
            with open(tmp, "w") as fh:
                fh.write(json.dumps(self.me) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.link(tmp, self.path)
        except FileExistsError:
            return False
        except OSError as exc:
            raise RunLockError(f"cannot create lock {self.path}: {exc.strerror or exc}") from exc
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(self.path.parent)
        return True

    def _read(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}  # released meanwhile: retry the create
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) else None

    def _take_over(self, holder: dict) -> bool:
        """Move the stale lock aside, then check it was the one judged stale (another starter
        may have replaced it meanwhile: then it is put back and the create is retried)."""
        if not holder:
            return True  # released meanwhile
        aside = self.path.with_name(f".{LOCK_NAME}.stale-{self.me['token'].replace(':', '-')}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        try:
            moved = json.loads(aside.read_text())
        except (OSError, ValueError):
            moved = None
        if moved != holder:  # not the lock we judged: restore it, never overwriting
            try:
                os.link(aside, self.path)
            except OSError:
                pass
        aside.unlink(missing_ok=True)
        return moved == holder

    def verify(self) -> None:
        """Raise ``RunLockError`` unless the lock file is still this process's."""
        if not self.held:
            raise RunLockError(f"this process does not hold {self.path}")
        holder = self._read()
        if not holder or holder.get("token") != self.me["token"]:
            raise RunLockError(f"the lock {self.path} is no longer held by this run (now: "
                               f"{describe_holder(holder) if holder else 'none'})")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = self._read()
        if holder and holder.get("token") == self.me["token"]:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
