"""The run-directory lock: one run per directory, stale locks taken over, holders named.

Concurrent starts are real processes racing for the lock; the stale cases write the lock file
a dead process, an earlier incarnation of a requeued Slurm job or a job killed on another node
would have left (for the last, stand-in `squeue` scripts say what Slurm knows of that job).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tape_train.train.run_lock import LOCK_NAME, RunLock, RunLockError, lock_refusal


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


def test_a_lock_copied_with_its_run_directory_is_taken_over(tmp_path, caplog):
    """``cp -r runs/a runs/b`` while a trains: b's copy of a's lock records directory a (other
    path, other inode), so b starts, with one log line saying so, and a keeps its lock.
    Negative controls, while a's holder lives: a itself under another path (a symlink), a lock
    naming a's inode under another path (a bind mount, another mount point, a moved
    directory), and a copied lock that records no directory (older tape-train) are refused."""
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    holder = RunLock(a).acquire()
    recorded = json.loads((a / LOCK_NAME).read_text())["run_dir"]
    assert recorded["path"] == str(a.resolve()) and recorded["ino"] == os.stat(a).st_ino
    shutil.copytree(a, b)
    assert lock_refusal(b) is None  # the start-up checks agree with the trainer
    with caplog.at_level("WARNING", logger="tape_train.train"):
        copy = RunLock(b).acquire()
    (line,) = [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]
    assert line.startswith(f"took over the lock of run directory {b} from host ")
    assert line.endswith(f"it was copied with the directory: the lock was taken in "
                         f"{a.resolve()} (inode {os.stat(a).st_ino}), this is {b.resolve()} "
                         f"(inode {os.stat(b).st_ino}), which that run does not use")
    holder.verify()  # a's run still holds a
    copy.verify()
    assert json.loads((b / LOCK_NAME).read_text())["run_dir"]["path"] == str(b.resolve())
    copy.release()

    link = tmp_path / "link"
    link.symlink_to(a, target_is_directory=True)
    with pytest.raises(RunLockError, match="in use by another run"):
        RunLock(link).acquire()
    lock = json.loads((a / LOCK_NAME).read_text())
    (b / LOCK_NAME).write_text(json.dumps(
        {**lock, "run_dir": {**lock["run_dir"], "ino": os.stat(b).st_ino}}))
    with pytest.raises(RunLockError, match="in use by another run"):
        RunLock(b).acquire()  # another path, the same inode: the same directory
    (b / LOCK_NAME).write_text(json.dumps({k: v for k, v in lock.items() if k != "run_dir"}))
    with pytest.raises(RunLockError, match="in use by another run"):
        RunLock(b).acquire()
    holder.release()


def test_lock_of_a_dead_pid_on_another_host_is_not_taken(tmp_path):
    _write_lock(tmp_path, host="some-other-node", pid=_dead_pid())
    with pytest.raises(RunLockError, match="host some-other-node"):
        RunLock(tmp_path).acquire()


def test_previous_incarnation_of_a_requeued_slurm_job_is_taken_over(tmp_path, monkeypatch,
                                                                   fake_slurm):
    fake_slurm.squeue_prints("778 RUNNING")
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


# ---------------------------------------------------------------------------------------------
# A holder on another host, in another Slurm job: Slurm is asked whether that job has ended
# (stand-in squeue scripts, first on PATH; what the real one prints is measured on the test
# cluster and recorded in docs/slurm.md, "Measured on the test cluster").
# ---------------------------------------------------------------------------------------------
def _write_killed_job_lock(run_dir, **extra):
    """The lock a job killed outright on node-a (SIGKILL, OOM killer, node failure) left."""
    _write_lock(run_dir, **{"host": "node-a", "pid": 4711, "slurm_job_id": "4242",
                            "slurm_restart_count": "0", "slurm_cluster": "tapetest",
                            "token": "killed-job", **extra})


@pytest.fixture
def resubmitted(monkeypatch, fake_slurm):
    """This process is the resubmission: another job of the same cluster."""
    monkeypatch.setenv("SLURM_JOB_ID", "5000")
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "tapetest")
    return fake_slurm


@pytest.mark.parametrize("state", ["CANCELLED", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                                   "TIMEOUT", "COMPLETED"])
def test_lock_of_an_ended_slurm_job_on_another_host_is_taken_over(tmp_path, caplog, resubmitted,
                                                                  state):
    resubmitted.squeue_prints(f"4242 {state}")
    _write_killed_job_lock(tmp_path)
    assert lock_refusal(tmp_path) is None   # the start-up checks agree with the trainer
    with caplog.at_level("WARNING", logger="tape_train.train"):
        lock = RunLock(tmp_path).acquire()
    lock.verify()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["slurm_job_id"] == "5000"
    assert ("from host node-a, pid 4711, Slurm job 4242 (restart 0), started "
            "2026-01-01T00:00:00Z: its Slurm job 4242 has ended: Slurm says job 4242 is "
            f"{state}") in caplog.text
    # Asked about that one job, in every state (squeue shows only live jobs by default), with
    # --jobs=<id> (squeue's -j takes an optional argument: "-j 4242" is not parsed as meant).
    assert resubmitted.calls[-1] == "squeue --noheader --jobs=4242 --states=all --format=%A %T"


def test_lock_of_a_purged_slurm_job_is_taken_over(tmp_path, caplog, resubmitted):
    # MinJobAge after it ended the controller forgets the job: squeue fails like this.
    resubmitted.command("squeue", "echo 'slurm_load_jobs error: Invalid job id specified' >&2\n"
                                  "exit 1")
    _write_killed_job_lock(tmp_path)
    with caplog.at_level("WARNING", logger="tape_train.train"):
        RunLock(tmp_path).acquire().release()
    assert ("its Slurm job 4242 has ended: Slurm no longer knows job 4242 (`squeue "
            "--jobs=4242 --states=all`: slurm_load_jobs error: Invalid job id specified)"
            ) in caplog.text


@pytest.mark.parametrize("state", ["RUNNING", "PENDING", "COMPLETING", "REQUEUED", "SUSPENDED",
                                   "REQUEUE_HOLD"])
def test_lock_of_a_slurm_job_that_has_not_ended_is_refused(tmp_path, resubmitted, state):
    resubmitted.squeue_prints(f"4242 {state}")
    _write_killed_job_lock(tmp_path)
    before = (tmp_path / LOCK_NAME).read_text()
    with pytest.raises(RunLockError) as err:
        RunLock(tmp_path).acquire()
    msg = str(err.value)
    assert msg.startswith(f"run directory {tmp_path} is in use by another run (host node-a, "
                          f"pid 4711, Slurm job 4242 (restart 0)"), msg
    assert msg.endswith(f"wait for that run to end; Slurm says job 4242 is {state}"), msg
    assert lock_refusal(tmp_path) == msg
    assert (tmp_path / LOCK_NAME).read_text() == before


def test_only_the_row_of_the_holders_own_job_id_counts(tmp_path, resubmitted):
    # An array task whose id is also the array's id (task 3_2 has SLURM_JOB_ID=3, measured):
    # squeue --jobs=3 lists every task of the array. A sibling's final state must not count.
    resubmitted.squeue_prints("4 CANCELLED\n3 RUNNING")
    _write_killed_job_lock(tmp_path, slurm_job_id="3")
    with pytest.raises(RunLockError, match="Slurm says job 3 is RUNNING$"):
        RunLock(tmp_path).acquire()
    resubmitted.squeue_prints("3 CANCELLED\n4 RUNNING")
    RunLock(tmp_path).acquire().release()


@pytest.mark.parametrize("case", ["absent", "failing", "hanging", "silent", "garbage"])
def test_when_slurm_cannot_tell_the_lock_is_refused_saying_what_happened(
        tmp_path, monkeypatch, resubmitted, case):
    import time

    from tape_train.train import run_lock

    monkeypatch.setattr(run_lock, "SLURM_QUERY_TIMEOUT_S", 0.5)
    expected = {
        "absent": "`squeue` is not installed here (not on PATH)",
        "failing": "`squeue --jobs=4242 --states=all` failed with exit status 1: squeue: "
                   "error: Unable to contact slurm controller (connect failure)",
        "hanging": "`squeue` did not answer within 0.5 s",
        "silent": "`squeue --jobs=4242 --states=all` gave no state for it (printed 'nothing')",
        "garbage": "`squeue --jobs=4242 --states=all` gave no state for it (printed "
                   "'4242 RUNNING extra')",
    }[case]
    if case == "absent":
        monkeypatch.setenv("PATH", str(resubmitted.bin_dir))   # no squeue at all
    elif case == "failing":
        resubmitted.command("squeue", "echo 'squeue: error: Unable to contact slurm controller "
                                      "(connect failure)' >&2\nexit 1")
    elif case == "hanging":   # a controller that does not answer (squeue retries for long)
        resubmitted.command("squeue", "sleep 30")
    elif case == "silent":
        resubmitted.command("squeue", "exit 0")
    else:
        resubmitted.squeue_prints("4242 RUNNING extra")
    _write_killed_job_lock(tmp_path)
    started = time.monotonic()
    with pytest.raises(RunLockError) as err:
        RunLock(tmp_path).acquire()
    assert time.monotonic() - started < 10
    msg = str(err.value)
    assert f"; Slurm could not tell whether job 4242 has ended: {expected}; if job 4242 has " \
           f"ended (`squeue --states=all --jobs=4242`) it was killed before releasing the " \
           f"lock: delete the lock" in msg, msg
    assert "host node-a, pid 4711, Slurm job 4242" in msg


def test_slurm_is_not_asked_when_its_answer_could_not_be_trusted(tmp_path, monkeypatch,
                                                                 resubmitted):
    resubmitted.squeue_prints("4242 CANCELLED")   # would say "ended" if asked
    cases = [
        # A live holder on this host is never taken over, whatever Slurm says about its job.
        ({"host": socket.gethostname(), "pid": os.getppid()},
         r"in use by another run .*for that run to end$"),
        # Another host outside Slurm: nothing to ask.
        ({"slurm_job_id": None}, "it ran outside Slurm on host node-a, whose processes cannot "
                                 "be checked from here"),
        # This very incarnation of our own job (rank 0 elsewhere): it runs.
        ({"slurm_job_id": "5000"}, "for that run to end$"),
        # Another cluster sharing the file system: our controller does not know its ids.
        ({"slurm_cluster": "othercluster"}, "its job ran on Slurm cluster othercluster and "
                                            "this is cluster tapetest"),
        # An older lock, without its cluster.
        ({"slurm_cluster": None}, "the lock does not say which Slurm cluster job 4242 ran on"),
        # A job id that is not one (a hand-edited lock) is never passed to squeue.
        ({"slurm_job_id": "--help"}, "job id '--help' is not one squeue can be asked"),
    ]
    for fields, refusal in cases:
        _write_killed_job_lock(tmp_path, **fields)
        with pytest.raises(RunLockError, match=refusal):
            RunLock(tmp_path).acquire()
    assert resubmitted.calls == []
    # Positive control: the same lock as written by the killed job is taken over.
    _write_killed_job_lock(tmp_path)
    RunLock(tmp_path).acquire().release()
    assert len(resubmitted.calls) == 1


def test_outside_a_job_the_cluster_name_comes_from_scontrol(tmp_path, fake_slurm):
    # A run started by hand (no SLURM_* variables) on another host than the killed job.
    fake_slurm.squeue_prints("4242 FAILED")
    fake_slurm.command("scontrol", "printf 'Configuration data as of ...\nClusterName "
                                   "            = tapetest\nMessageTimeout = 10 sec\n'")
    _write_killed_job_lock(tmp_path)
    RunLock(tmp_path).acquire().release()
    assert [c.split()[0] for c in fake_slurm.calls] == ["scontrol", "squeue"]
    # Negative control: scontrol names another cluster, or cannot tell: refused.
    fake_slurm.command("scontrol", "printf 'ClusterName = elsewhere\n'")
    _write_killed_job_lock(tmp_path)
    with pytest.raises(RunLockError, match="this is cluster elsewhere"):
        RunLock(tmp_path).acquire()
    fake_slurm.command("scontrol", "exit 1")
    with pytest.raises(RunLockError, match="this host's cluster is unknown"):
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


def test_a_late_takeover_of_the_same_stale_lock_never_removes_the_new_holders(tmp_path,
                                                                             monkeypatch):
    """Starters A and B both judge the same lock stale; A takes it over and holds the run; B,
    slower, then takes over what it judged. B must leave A's lock alone, even when a third
    starter C tries at any moment B touches the lock files (with the lock moved aside and put
    back, C could create its own in the gap: two runs on one directory)."""
    from tape_train.train import run_lock

    _write_lock(tmp_path, pid=_dead_pid())
    b = RunLock(tmp_path)
    stale = b._read()
    assert stale and run_lock._refusal(b.path, stale, b.me)[0] is None  # judged stale
    a = RunLock(tmp_path).acquire()
    c_outcomes = []

    def c_tries() -> None:
        try:
            RunLock(tmp_path).acquire()
            c_outcomes.append("won")
        except RunLockError as exc:
            c_outcomes.append(str(exc))

    real_rename, real_unlink = os.rename, Path.unlink

    def rename_then_c(src, dst):
        real_rename(src, dst)
        c_tries()

    def unlink_then_c(self, missing_ok=False):
        real_unlink(self, missing_ok=missing_ok)
        if self.name == "RUN.lock":
            c_tries()

    monkeypatch.setattr(run_lock.os, "rename", rename_then_c)
    monkeypatch.setattr(Path, "unlink", unlink_then_c)
    b._take_over(stale)  # B, late, with its judgement of the old lock
    monkeypatch.undo()
    a.verify()  # A still holds the run
    c_tries()
    assert "won" not in c_outcomes and c_outcomes, c_outcomes
    assert not list(tmp_path.glob(".RUN.lock.takeover*")), list(tmp_path.iterdir())
    # Control: the takeover itself still works when the lock is the stale one judged.
    a.release()
    _write_lock(tmp_path, pid=_dead_pid())
    d = RunLock(tmp_path)
    assert d._take_over(d._read()) and not d.path.exists()


def test_a_takeover_left_by_a_killed_start_is_cleared(tmp_path, caplog):
    """A start killed between taking the ``.takeover`` file and removing the stale lock leaves
    the file: the next start waits TAKEOVER_STALE_S at most, not forever."""
    from tape_train.train import run_lock

    _write_lock(tmp_path, pid=_dead_pid())
    mutex = tmp_path / ".RUN.lock.takeover"
    mutex.write_text(json.dumps({"token": "killed"}))
    with pytest.raises(RunLockError, match="other processes are starting"):
        RunLock(tmp_path).acquire()  # a fresh takeover file: someone may be taking over
    old = time.time() - run_lock.TAKEOVER_STALE_S - 5
    os.utime(mutex, (old, old))
    with caplog.at_level("WARNING", logger="tape_train.train"):
        RunLock(tmp_path).acquire()
    assert "left" in caplog.text and not mutex.exists()
