"""One training run per run directory: ``<run_dir>/RUN.lock``. Torch-free.

The lock file is created by hard-linking a private, fully written file to the lock name (the
link is atomic and fails if the name exists, on local filesystems and on NFS, Lustre, GPFS;
a reader never sees a lock without content). It holds JSON naming its holder: host, pid and
its start, Slurm job id, restart count and cluster name, start time, and the run directory it
was taken in (resolved path, device and inode). Only rank 0 takes it;
the trainer makes the verdict collective, so every rank of a refused run stops before
touching anything.

A lock is *stale*, and taken over with a log line, when it was copied with its directory
(``cp -r runs/a runs/b`` while ``a`` trains): the directory it records differs from the one it
is found in both in resolved path and in inode number. The same directory under another path
(a symlink, a bind mount, another mount point on another node) keeps its inode number, a
moved one (``mv``) too: those are not copies. (The device number is recorded but not
compared: another client of the same network file system may number its mount otherwise.)
A lock that records no directory (older tape-train) is judged by its holder alone. Or when its
holder

* ran on this host and its pid no longer exists (a killed run, a crashed node that came back),
  or now belongs to another process: the lock records the holder's start (boot id and start
  time from ``/proc``), so a pid reused by an unrelated process (a container restarted under
  the same host name gets the same small pid) is not taken for the holder;
* is an earlier incarnation of this same Slurm job (same ``SLURM_JOB_ID``, another
  ``SLURM_RESTART_COUNT``): a requeued job restarts while its predecessor's lock remains;
* ran on another host in another Slurm job of this cluster, and Slurm says that job has ended:
  ``squeue --jobs=<id> --states=all`` reports a final state (COMPLETED, FAILED, CANCELLED,
  TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, ...) or no longer knows the id (``Invalid job id
  specified``: purged ``MinJobAge`` after it ended). This is the job killed without releasing
  its lock (SIGKILL, OOM killer, node failure) and resubmitted onto other nodes.

Anything else refuses the start with one line naming the holder: a live process here, a
process on another host outside Slurm (nothing can tell whether it runs), or another job that
Slurm does not positively report as ended (pending, running, completing, requeued, suspended;
or squeue missing, failing, silent or slower than ``SLURM_QUERY_TIMEOUT_S``; or the holder's
job ran on another cluster, whose ids ours does not know, or its lock does not name its
cluster) -- the refusal then says what Slurm answered. A lock that cannot be parsed is
refused too (it may be being written): delete it by hand once sure nothing runs there.

A takeover is serialised by ``.RUN.lock.takeover`` (taken the same way, held for
milliseconds): its holder checks that the lock is still the stale one it judged and only then
removes it, so a slower starter that judged the same lock never removes the lock a faster one
has created meanwhile. One older than ``TAKEOVER_STALE_S`` (a start killed in between) is
removed with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tape_train.files import fsync_dir, pid_alive, process_start  # noqa: F401 - re-exported

log = logging.getLogger("tape_train.train")

LOCK_NAME = "RUN.lock"
# How long squeue (and scontrol, for the cluster name outside a job) may take to answer. A
# controller that is down makes squeue retry for MessageTimeout (often 10 s) and longer; an
# unanswered question keeps the refusal, so this only bounds how long a start can take.
SLURM_QUERY_TIMEOUT_S = 5.0
# Job states (squeue's %T) after which a job's processes are gone and it does not run again by
# itself. squeue shows COMPLETING while any process is still being killed, and REQUEUED,
# REQUEUE_HOLD, SPECIAL_EXIT, PENDING for a job that will run again: those keep the lock.
ENDED_JOB_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                              "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED", "REVOKED"})
# A job id as SLURM_JOB_ID holds it (array tasks and heterogeneous job components have their
# own plain numeric id there); anything else in a lock is never passed to squeue.
_JOB_ID = re.compile(r"[0-9]{1,12}")
# A takeover (check the stale lock is still there, remove it) holds its ``.takeover`` file for
# milliseconds; one this old was left by a start killed in between.
TAKEOVER_STALE_S = 30.0


class RunLockError(RuntimeError):
    """The run directory is in use (or its lock is unreadable); the message names the holder."""


def _identity() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT", "0"),
            "slurm_cluster": os.environ.get("SLURM_CLUSTER_NAME") or None,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "pid_start": process_start(os.getpid()),
            "token": f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"}


def directory_identity(directory: str | os.PathLike) -> dict | None:
    """What a lock records of the run directory it is taken in: ``{"path": resolved path,
    "dev": st_dev, "ino": st_ino}``; ``None`` when it cannot be seen (not created yet)."""
    try:
        path = Path(directory).resolve()
        st = os.stat(path)
    except (OSError, RuntimeError):
        return None
    return {"path": str(path), "dev": st.st_dev, "ino": st.st_ino}


def copied_from(holder: dict, here: dict | None) -> str | None:
    """Why ``holder``'s lock is a copy made with its directory, found now in the directory
    ``here`` (``directory_identity``): the directory it was taken in differs from ``here`` in
    resolved path AND in inode number; ``None`` otherwise, or when either is not known."""
    then = holder.get("run_dir")
    if not isinstance(then, dict) or not isinstance(here, dict):
        return None
    path, ino = then.get("path"), then.get("ino")
    if not isinstance(path, str) or not isinstance(ino, int) or isinstance(ino, bool):
        return None
    if path == here["path"] or ino == here["ino"]:
        return None  # this very directory (perhaps under another path, or moved)
    return (f"it was copied with the directory: the lock was taken in {path} (inode {ino}), "
            f"this is {here['path']} (inode {here['ino']}), which that run does not use")


def describe_holder(holder: dict) -> str:
    job = holder.get("slurm_job_id")
    where = f"host {holder.get('host')}, pid {holder.get('pid')}"
    if job:
        where += f", Slurm job {job} (restart {holder.get('slurm_restart_count')})"
    return f"{where}, started {holder.get('started')}"


def _run_bounded(argv: list[str]) -> tuple[int, str, str] | str:
    """Run a Slurm client command for at most SLURM_QUERY_TIMEOUT_S: ``(exit status, stdout,
    stderr)``, or a sentence saying why there is no answer. Its environment drops squeue's own
    filters and cluster choice (``SQUEUE_*``, ``SLURM_CLUSTERS``), which would hide the job;
    the whole process group is killed on timeout (a site's squeue may be a wrapper script)."""
    exe = shutil.which(argv[0])
    if exe is None:
        return f"`{argv[0]}` is not installed here (not on PATH)"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SQUEUE_") and k != "SLURM_CLUSTERS"}
    try:
        proc = subprocess.Popen([exe, *argv[1:]], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                env=env, start_new_session=True)
    except OSError as exc:
        return f"`{argv[0]}` could not be run: {exc.strerror or exc}"
    try:
        out, err = proc.communicate(timeout=SLURM_QUERY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.communicate()
        return f"`{argv[0]}` did not answer within {SLURM_QUERY_TIMEOUT_S:g} s"
    return proc.returncode, out, err


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "nothing"


def slurm_cluster_name() -> str | None:
    """The name of the Slurm cluster this process's squeue asks: ``SLURM_CLUSTER_NAME`` inside a
    job, else ``ClusterName`` from ``scontrol show config``; ``None`` when neither tells."""
    if os.environ.get("SLURM_CLUSTER_NAME"):
        return os.environ["SLURM_CLUSTER_NAME"]
    answer = _run_bounded(["scontrol", "show", "config"])
    if isinstance(answer, str) or answer[0] != 0:
        return None
    found = re.search(r"^ClusterName\s*=\s*(\S+)\s*$", answer[1], re.MULTILINE)
    return found.group(1) if found else None


def slurm_job_ended(job_id: str) -> tuple[bool | None, str]:
    """Ask Slurm whether job ``job_id`` has ended: ``(True, what Slurm said)`` only when squeue
    positively says so (a final state, or the id is no longer known); ``(False, its state)``
    when it says the job has not; ``(None, what went wrong)`` when it cannot tell."""
    asked = f"`squeue --jobs={job_id} --states=all`"
    answer = _run_bounded(["squeue", "--noheader", f"--jobs={job_id}", "--states=all",
                           "--format=%A %T"])
    if isinstance(answer, str):
        return None, answer
    rc, out, err = answer
    if rc != 0:
        # One unknown id: exit 1, "slurm_load_jobs error: Invalid job id specified" (measured,
        # Slurm 22.05); a controller that is down or a bad configuration fail otherwise.
        if "Invalid job id specified" in err:
            return True, f"Slurm no longer knows job {job_id} ({asked}: {_last_line(err)})"
        return None, f"{asked} failed with exit status {rc}: {_last_line(err)}"
    # One line per job: "<job id> <state>". An array's id lists its other tasks too, a
    # heterogeneous job's its other components: only the row of this very id counts.
    states = [fields[1] for fields in (ln.split() for ln in out.splitlines())
              if len(fields) == 2 and fields[0] == job_id]
    if len(states) != 1:
        return None, f"{asked} gave no state for it (printed {_last_line(out)!r})"
    state = states[0]
    return state in ENDED_JOB_STATES, f"Slurm says job {job_id} is {state}"


def stale_reason(holder: dict, me: dict) -> tuple[str | None, str | None]:
    """``(why holder's lock may be taken over by me, None)``, or ``(None, what keeps it)``:
    the note the refusal adds (``None``: nothing to add to naming the holder)."""
    copied = copied_from(holder, me.get("run_dir"))
    if copied:
        return copied, None
    job = holder.get("slurm_job_id")
    job = None if job in (None, "") else str(job)
    if job and job == me.get("slurm_job_id") \
            and str(holder.get("slurm_restart_count")) != str(me.get("slurm_restart_count")):
        return (f"left by the previous incarnation of Slurm job {job} (restart "
                f"{holder.get('slurm_restart_count')}; this is restart "
                f"{me.get('slurm_restart_count')})"), None
    if holder.get("host") == me.get("host"):
        try:
            pid = int(holder.get("pid"))
        except (TypeError, ValueError):
            return None, None
        if pid != me.get("pid") and not pid_alive(pid):
            return f"its process {pid} on this host no longer exists", None
        recorded, now = holder.get("pid_start"), process_start(pid)
        if recorded and now and recorded != now:
            return (f"its process {pid} on this host no longer exists (pid {pid} now belongs "
                    f"to another process, started after the lock was taken)"), None
        return None, None
    if job and job == me.get("slurm_job_id"):
        return None, None  # this incarnation of our own job, on another node: it runs
    if not job:
        return None, (f"it ran outside Slurm on host {holder.get('host')}, whose processes "
                      f"cannot be checked from here: if nothing runs there any more, delete "
                      f"the lock")
    by_hand = (f"if job {job} has ended (`squeue --states=all --jobs={job}`) it was killed "
               f"before releasing the lock: delete the lock")
    if not _JOB_ID.fullmatch(str(job)):
        return None, (f"its Slurm job id {job!r} is not one squeue can be asked about: "
                      f"if no run uses the directory, delete the lock")
    # Job ids are per cluster: only the holder's own cluster can say that job N has ended.
    theirs = holder.get("slurm_cluster")
    if not theirs:
        return None, (f"the lock does not say which Slurm cluster job {job} ran on (written by "
                      f"an older tape-train), so Slurm is not asked: {by_hand}")
    ours = slurm_cluster_name()
    if ours != theirs:
        here = f"this is cluster {ours}" if ours else "this host's cluster is unknown"
        return None, (f"its job ran on Slurm cluster {theirs} and {here}, whose job ids are "
                      f"not the same: {by_hand}")
    ended, said = slurm_job_ended(job)
    if ended:
        return f"its Slurm job {job} has ended: {said}", None
    if ended is False:
        return None, said
    return None, f"Slurm could not tell whether job {job} has ended: {said}; {by_hand}"


def _refusal(path: Path, holder: dict | None, me: dict) -> tuple[str | None, str | None]:
    """``(why me may not take the lock at path held by holder, None)``, or ``(None, why the
    holder's lock is stale)`` when it may (``(None, None)``: no holder; ``{}``: released)."""
    if holder is None:
        return (f"run directory {path.parent} has an unreadable lock {path}; if no run uses "
                f"the directory, delete it"), None
    if not holder:
        return None, None
    reason, note = stale_reason(holder, me)
    if reason is not None:
        return None, reason
    return (f"run directory {path.parent} is in use by another run "
            f"({describe_holder(holder)}; lock {path}). Use another train.run_dir, or wait "
            f"for that run to end" + (f"; {note}" if note else "")), None


def lock_refusal(run_dir: str | os.PathLike) -> str | None:
    """What ``RunLock(run_dir).acquire()`` would refuse with now, without taking the lock
    (``None``: it would succeed). For start-up checks that run before the trainer."""
    lock = RunLock(run_dir)
    if not lock.path.parent.is_dir():  # none yet, or a file in the way (the run dir check's)
        return None
    return _refusal(lock.path, lock._read(), lock.me)[0]


class RunLock:
    """The lock of one run directory, held by this process until ``release()``."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.me = {**_identity(), "run_dir": directory_identity(run_dir)}
        self.held = False

    def acquire(self) -> RunLock:
        """Take the lock (taking over a stale one); raise ``RunLockError`` naming the holder."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunLockError(f"cannot create run directory {self.path.parent}: "
                               f"{exc.strerror or exc}") from exc
        self.me["run_dir"] = directory_identity(self.path.parent)  # now that it exists
        for _ in range(3):  # a takeover race with another starter is retried, then refused
            if self._create():
                self.held = True
                return self
            holder = self._read()
            refusal, reason = _refusal(self.path, holder, self.me)
            if refusal is not None:
                raise RunLockError(refusal)
            if not holder:
                continue  # released meanwhile: create again
            if self._take_over(holder):
                log.warning("took over the lock of run directory %s from %s: %s",
                            self.path.parent, describe_holder(holder), reason)
        raise RunLockError(f"could not take the lock {self.path}: other processes are starting "
                           f"on the same run directory")

    def _create(self) -> bool:
        """Take the free lock name (``_link_record``)."""
        if not self._link_record(self.path):
            return False
        fsync_dir(self.path.parent)
        return True

    def _link_record(self, target: Path) -> bool:
        """Write our record to a private file, then hard-link it to ``target``: the link fails
        if ``target`` exists, and a reader never sees it without its content."""
        tmp = target.with_name(f".{target.name}.{self.me['token'].replace(':', '-')}.tmp")
        try:
            with open(tmp, "w") as fh:
                fh.write(json.dumps(self.me) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.link(tmp, target)
        except FileExistsError:
            return False
        except OSError as exc:
            raise RunLockError(f"cannot create lock {target}: {exc.strerror or exc}") from exc
        finally:
            tmp.unlink(missing_ok=True)
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
        """Remove the stale lock ``holder`` judged, if it is still the lock; False when it is
        not (then the start judges again). Takeovers are serialised by a second lock, its
        ``.takeover`` file: a starter that judged the same stale lock later must not remove
        the lock the first one has created meanwhile (nothing but a takeover ever removes
        another process's lock, and one at a time checks, then removes)."""
        if not holder:
            return True  # released meanwhile
        mutex = self.path.with_name(f".{LOCK_NAME}.takeover")
        if not self._link_record(mutex):
            self._clear_stale_takeover(mutex)
            time.sleep(0.05)  # another starter is taking over: judge again after it
            return False
        try:
            if self._read() != holder:
                return False  # replaced or released since it was judged
            self.path.unlink(missing_ok=True)
            fsync_dir(self.path.parent)
            return True
        finally:
            try:
                mine = json.loads(mutex.read_text()).get("token") == self.me["token"]
            except (OSError, ValueError, AttributeError):
                mine = False
            if mine:
                mutex.unlink(missing_ok=True)

    @staticmethod
    def _clear_stale_takeover(mutex: Path) -> None:
        """A takeover holds its file for milliseconds: one older than TAKEOVER_STALE_S was left
        by a starter killed during its takeover, and is removed (else no start could take a
        stale lock again)."""
        try:
            age = time.time() - mutex.stat().st_mtime
        except OSError:
            return
        if age > TAKEOVER_STALE_S:
            log.warning("removing %s, left %.0f s ago by a start killed while taking over the "
                        "lock", mutex, age)
            mutex.unlink(missing_ok=True)

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
