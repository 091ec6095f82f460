"""The run-directory lock: one run per directory, stale locks taken over, holders named.

Concurrent starts are real processes racing for the lock; the stale cases write the lock file
a dead process or an earlier incarnation of a requeued Slurm job would have left.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys

import pytest

from tape_train.train.run_lock import LOCK_NAME, RunLock, RunLockError


def _write_lock(run_dir, **holder):
    base = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": None,
            "slurm_restart_count": "0", "started": "2026-01-01T00:00:00Z", "token": "x"}
    (run_dir / LOCK_NAME).write_text(json.dumps({**base, **holder}))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_second_run_refuses_naming_the_holder_and_release_frees_it(tmp_path):
    first = RunLock(tmp_path).acquire()
    with pytest.raises(RunLockError) as err:
        RunLock(tmp_path).acquire()
    msg = str(err.value)
    assert f"host {socket.gethostname()}, pid {os.getpid()}" in msg and "started" in msg
    assert str(tmp_path) in msg
    first.verify()
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    RunLock(tmp_path).acquire().release()  # free again


def test_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path, caplog):
    _write_lock(tmp_path, pid=_dead_pid())
    with caplog.at_level("WARNING", logger="tape_train.train"):
        lock = RunLock(tmp_path).acquire()
    assert "took over the lock" in caplog.text and "no longer exists" in caplog.text
    lock.verify()
    # Negative control: a live process (this one) on this host keeps its lock.
    lock.release()
    _write_lock(tmp_path, pid=os.getppid())
    with pytest.raises(RunLockError, match="in use by another run"):
        RunLock(tmp_path).acquire()


@pytest.mark.parametrize("pid", [os.getppid(), os.getpid()], ids=["other-live", "own-pid"])
def test_lock_whose_pid_now_belongs_to_another_process_is_taken_over(tmp_path, caplog, pid):
    from tape_train.train.run_lock import process_start

    # The holder died and its pid was reused: by an unrelated live process, or by this one
    # (a restarted container under the same host name gets the same small pid).
    _write_lock(tmp_path, pid=pid, pid_start="an-earlier-boot:12345")
    with caplog.at_level("WARNING", logger="tape_train.train"):
        RunLock(tmp_path).acquire().release()
    assert "now belongs to another process" in caplog.text
    # Negative control: the process that really holds it (same start) keeps its lock.
    _write_lock(tmp_path, pid=pid, pid_start=process_start(pid))
    with pytest.raises(RunLockError, match="in use by another run"):
        RunLock(tmp_path).acquire()


def test_lock_of_a_dead_pid_on_another_host_is_not_taken(tmp_path):
    _write_lock(tmp_path, host="some-other-node", pid=_dead_pid())
    with pytest.raises(RunLockError, match="host some-other-node"):
        RunLock(tmp_path).acquire()


def test_previous_incarnation_of_a_requeued_slurm_job_is_taken_over(tmp_path, monkeypatch):
    _write_lock(tmp_path, host="node-a", pid=1, slurm_job_id="777", slurm_restart_count="2")
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    RunLock(tmp_path).acquire().release()
    # Negative controls: the same incarnation, or another job, is a live holder.
    for job, restart in (("777", "3"), ("778", "2")):
        _write_lock(tmp_path, host="node-a", pid=1, slurm_job_id=job, slurm_restart_count=restart)
        with pytest.raises(RunLockError, match="in use by another run"):
            RunLock(tmp_path).acquire()


def test_unreadable_lock_is_refused(tmp_path):
    (tmp_path / LOCK_NAME).write_text("{half")
    with pytest.raises(RunLockError, match="unreadable lock"):
        RunLock(tmp_path).acquire()


def _race(run_dir, barrier, results):
    barrier.wait()
    try:
        lock = RunLock(run_dir).acquire()
        results.put("won")
        barrier.wait()  # hold it until every contender has tried
        lock.release()
    except RunLockError as exc:
        results.put(f"refused: {exc}")
        barrier.wait()


@pytest.mark.parametrize("stale", [False, True])
def test_concurrent_starts_exactly_one_wins(tmp_path, stale):
    if stale:  # everyone races to take over the same stale lock
        _write_lock(tmp_path, pid=_dead_pid())
    ctx = mp.get_context("fork")
    n = 4
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(tmp_path, barrier, results)) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    outcomes = sorted(results.get(timeout=5) for _ in range(n))
    assert outcomes.count("won") == 1, outcomes
    assert all("in use by another run" in o or "other processes are starting" in o
               for o in outcomes if o != "won"), outcomes
