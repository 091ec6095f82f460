"""In-job restarts under torchrun: which attempt this is, whether to take it, why the last ended.

``launch/slurm/train.sbatch`` runs torchrun with ``--max_restarts N``: when a rank crashes or
hangs, torchrun (c10d rendezvous) stops every node's workers and starts them again, and the
trainer resumes from the newest complete checkpoint. torchrun restarts on any failure, so the
policy lives here, in rank 0's start-up, with the script's consent (``TAPE_RESTART_GUARD=1``):

- the first restart of a job's run is always taken (a transient failure: a flaky node, an
  NCCL timeout, a filesystem stall);
- a later one only if the attempt before it made progress: a newer complete checkpoint than at
  its start (the "stalled" notion of the requeue guard, ``checkpoint_layout.newest_complete_tag``);
  otherwise the failure looks deterministic and the run ends;
- an attempt that ended on a stop signal (exit 75, checkpoint written) is never continued by a
  restart: the job requeues, as without restarts;
- at most N restarts in all (torchrun counts per node: a node restarted because another one
  failed does not count, so the job's total could exceed N).

A refused restart ends every rank with exit 0, so that torchrun stops restarting (it restarts on
any non-zero exit); the refusal is recorded in ``<run_dir>/restarts/state.json`` and the script
reads it back (``python -m tape_train.cluster.requeue_guard --restart-verdict``) and fails or
requeues the job. Each rank also leaves ``<run_dir>/restarts/rank-<r>.json`` (host, node, pid;
exit code and reason when it ends through the trainer's own error handling), from which the
next attempt's rank 0 says which rank failed first and why: a rank that left no exit record was
killed (SIGKILL, the OOM killer, a segfault) or stopped and then ended by torchrun.

Torch-free.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from tape_train.checkpoint_layout import newest_complete_tag
from tape_train.files import write_atomic

GUARD_ENV = "TAPE_RESTART_GUARD"
STATE_DIR = "restarts"
EXIT_STOPPED = 75  # tape_train.train.signals.EXIT_REQUEUE (kept import-free here)
FAIL, REQUEUE = "fail", "requeue"


def guarded() -> bool:
    """Under torchrun with restarts, launched by a script that reads the verdict."""
    return (os.environ.get(GUARD_ENV) == "1"
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0)


def incarnation() -> str:
    """This run of the Slurm job: ``<job id>:<SLURM_RESTART_COUNT>`` (a requeue starts anew)."""
    return f"{os.environ.get('SLURM_JOB_ID', '')}:{os.environ.get('SLURM_RESTART_COUNT', '0')}"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def state_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / STATE_DIR / "state.json"


def _rank_path(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / STATE_DIR / f"rank-{rank:05d}.json"


REASON_CHARS = 300  # of a rank's one-line reason kept in its record


def record_rank(run_dir: str | os.PathLike, attempt: int, rank: int, *, code: int | None = None,
                reason: str | None = None) -> None:
    """This rank's record for ``attempt``: where it runs at start, how it ended at exit."""
    record = {"job": incarnation(), "attempt": attempt, "rank": rank,
              "host": socket.gethostname(), "node": os.environ.get("SLURMD_NODENAME"),
              "pid": os.getpid()}
    if code is not None:
        reason = reason or ""
        # Cut to a line's length, visibly: the restart message goes on after it.
        if len(reason) > REASON_CHARS:
            reason = reason[:REASON_CHARS - 1].rstrip() + "…"
        record.update(code=code, reason=reason, ended=time.time())
    try:
        write_atomic(_rank_path(run_dir, rank), json.dumps(record) + "\n")
    except OSError:
        pass  # a report, not a requirement: the run goes on without it


def describe_end(run_dir: str | os.PathLike, attempt: int, world_size: int) -> str:
    """Which rank of ``attempt`` failed first, and why, from the ranks' records."""
    records = {}
    for rank in range(world_size):
        rec = _read(_rank_path(run_dir, rank))
        if rec.get("job") == incarnation() and rec.get("attempt") == attempt:
            records[rank] = rec

    def where(rank: int) -> str:
        rec = records.get(rank, {})
        node = rec.get("node") or rec.get("host") or "?"
        return f"rank {rank} (node {node}, pid {rec.get('pid', '?')})"

    silent = [r for r in range(world_size) if "code" not in records.get(r, {})]
    told = sorted((rec["ended"], r) for r, rec in records.items() if "code" in rec)
    if silent:
        first = (f"{where(silent[0])} ended without a word: killed by a signal (SIGKILL, the "
                 f"OOM killer, a segfault; its torchrun's 'failed (exitcode: -N)' line names "
                 f"it) or stopped and then ended by torchrun")
        if len(silent) > 1:
            first += f" (so did {len(silent) - 1} other rank(s))"
    elif told:
        rank = told[0][1]
        rec = records[rank]
        first = f"{where(rank)} exited {rec['code']} first: {rec.get('reason') or 'no reason'}"
    else:
        return "no rank left a record"
    if told and silent:
        rank = told[0][1]
        first += f"; then {where(rank)}: {records[rank].get('reason') or 'no reason'}"
    return first


def begin_attempt(run_dir: str | os.PathLike, world_size: int, max_restarts: int
                  ) -> tuple[int, tuple[str, str] | None, str | None]:
    """Rank 0, at start-up: ``(attempt number, verdict or None, restart line or None)``.

    The attempt number counts this job run's worker-group starts (0: the first). A verdict
    ``(FAIL | REQUEUE, one line)`` refuses the restart; it is recorded in the state file."""
    path = state_path(run_dir)
    state = _read(path)
    if state.get("job") != incarnation():
        state = {"job": incarnation(), "attempts": [], "verdict": None}
    attempts = state["attempts"]
    attempt = len(attempts)
    newest = newest_complete_tag(run_dir)
    verdict, line = None, None
    if attempt > 0:
        prev = attempts[-1]
        end = describe_end(run_dir, attempt - 1, world_size)
        rank0 = _read(_rank_path(run_dir, 0))
        stopped = (rank0.get("job") == incarnation() and rank0.get("attempt") == attempt - 1
                   and rank0.get("code") == EXIT_STOPPED)
        saved = newest or "none"
        if stopped:
            verdict = (REQUEUE, f"NOT restarting: attempt {attempt - 1} stopped on a signal "
                                f"(exit {EXIT_STOPPED}, checkpoint {saved}) and torchrun "
                                f"restarted it; the job requeues instead")
        elif attempt > max_restarts:
            verdict = (FAIL, f"NOT restarting: restart {attempt} of {max_restarts} would "
                             f"exceed TAPE_MAX_RESTARTS={max_restarts}; attempt {attempt - 1} "
                             f"ended: {end}")
        elif attempt >= 2 and newest == prev.get("from_checkpoint"):
            verdict = (FAIL, f"NOT restarting: attempt {attempt - 1} made no progress (newest "
                             f"complete checkpoint {saved}, as at its start), so the failure "
                             f"looks deterministic; it ended: {end}")
        else:
            line = (f"restart {attempt} of {max_restarts} (job {incarnation()}): attempt "
                    f"{attempt - 1} ended: {end}; resuming from checkpoint {saved}")
    attempts.append({"started": _now(), "from_checkpoint": newest})
    if verdict is not None:
        state["verdict"] = {"kind": verdict[0], "line": verdict[1], "attempt": attempt}
    write_atomic(path, json.dumps(state) + "\n")
    return attempt, verdict, line


def read_verdict(run_dir: str | os.PathLike) -> tuple[str, str] | None:
    """The refusal recorded for this job run (``SLURM_JOB_ID``/``SLURM_RESTART_COUNT``)."""
    state = _read(state_path(run_dir))
    verdict = state.get("verdict")
    if state.get("job") != incarnation() or not isinstance(verdict, dict):
        return None
    return verdict.get("kind", FAIL), verdict.get("line", "restart refused")
