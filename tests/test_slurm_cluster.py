"""launch/slurm/*.sbatch and tape-submit against a real Slurm cluster running on this machine.

The cluster (tests/slurm_cluster.py) has 4 emulated nodes on loopback, runs every job with an
extern step (PrologFlags=Contain) and starts once for the module. Tests here use the real batch
scripts as tape-submit renders them:

- `tape-submit --dry-run` output for 1 and 4 nodes passes `sbatch --test-only` (5 nodes, more
  than the partition has, is refused: the negative control);
- a 2-node probe job (a small gloo program in place of the trainer, via --train-module)
  proves the rendezvous: MASTER_ADDR is the first node's NodeAddr, the port comes from the job
  id, node ranks differ, one all-reduce spans both nodes; a USR1 to the batch shell is
  forwarded to the training step alone (the extern step lives until the job ends; a USR1 to
  the whole job ends it at once: the negative control) and reaches both ranks, which stop
  together and exit 75 like the trainer; with --max-requeues 0 the script does not requeue
  and the job fails with 75;
- faults, with the same probe: with --max-restarts 0 a rank killed with SIGKILL ends the job
  within seconds, FAILED, not requeued, with the node that failed first named in the log; a run directory locked by
  another job fails in the start-up checks before torchrun; `sbatch train.sbatch` used as it
  is with a misspelt option reports tape-train's own error;
- `sbatch launch/slurm/prepare.sbatch` (tape-data prepare) told to stop mid-way with USR1 is
  requeued, resumes from its checkpoint and writes what a direct prepare writes; bad input
  fails once, not requeued; without the script's trap USR1 ends the job (negative control);
- the real trainer (tape-train, under torchrun, on a small real-text corpus): a 2-node job
  trains the shrunk `tiny` model with world size 2 and finishes; a second, identical job gets
  `scancel --signal=USR1 --batch` mid-run, checkpoints, requeues itself, resumes and finishes
  with per-step losses equal to the uninterrupted run's; an evaluation job submitted with
  `tape-submit --eval-after` (afterok on the interrupted job, so it waits across the requeue)
  writes eval.json, eval.md and the plot. The two training jobs run side by side (4 nodes);
- a 1-node training job whose trainer is SIGKILLed after its first checkpoint leaves RUN.lock;
  while it ran, real squeue kept its lock refused (RUNNING); the resubmission (a new job id)
  learns from squeue that the holder's job FAILED, takes the lock over and resumes.
- in-job restarts: rank 0's trainer SIGKILLed after the checkpoint at step 10 is restarted by
  torchrun in the same job, the new rank 0 takes over its lock, and the losses are the
  uninterrupted run's; a SIGSTOPped trainer: rank 0's collective times out after
  train.collective_timeout_s and says so in one line, then the job is restarted and completes
  with the uninterrupted losses, while with --max-restarts 0 (side by side) it ends FAILED once
  srun's --wait (grace + 60 s) has ended the stopped node; a trainer failing at step 2 of every
  attempt is restarted once, then refused for making no progress: FAILED;
- what admins and schedulers do, side by side: a job suspended (`scontrol suspend`) for longer
  than half the collective timeout and resumed runs on without a restart, with the
  uninterrupted losses; a job whose node is set DOWN is requeued by Slurm and resumes from the
  checkpoint its trainer wrote on TERM. A USR1 sent to the steps only (not the batch shell)
  stops the probe job for a requeue, like one to the batch shell.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import SlurmCluster, SlurmUnavailable  # noqa: E402

import tape_train  # noqa: E402
from tape_train.cluster import submit  # noqa: E402
from tape_train.checkpoint_layout import MARKER  # noqa: E402
from tape_train.train.run_lock import LOCK_NAME  # noqa: E402

REPO_ROOT = Path(tape_train.__file__).resolve().parents[1]

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.waits, pytest.mark.integration,
              pytest.mark.timeout(300)]

NUM_NODES = 4
CPUS_PER_NODE = 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        # PrologFlags=Contain: every job has an extern step, as where pam_slurm_adopt puts
        # ssh sessions into the job; the forwarded stop signal must leave it alone.
        c = SlurmCluster(tmp_path_factory.mktemp("slurm"), num_nodes=NUM_NODES,
                         cpus_per_node=CPUS_PER_NODE, cred_expire=10, prolog_flags="Contain")
        c.start()
    except SlurmUnavailable as exc:
        pytest.skip(f"local Slurm cluster cannot run here: {exc}")
    try:
        yield c
    finally:
        c.stop()


def write_run_config(path: Path, run_dir: Path) -> Path:
    path.write_text(f"model: tiny\ntrain:\n  run_dir: {run_dir}\n")
    return path


def tape_submit(args: list[str]) -> tuple[int, str, str]:
    """Run tape-submit in-process; returns (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = submit.main(args)
    return rc, out.getvalue(), err.getvalue()


def test_a_second_cluster_on_the_machine_is_refused_and_hosts_stays_whole(cluster, tmp_path):
    """Two test clusters at once (two pytest runs on one machine) once raced on /etc/hosts
    and left it empty (no localhost: every later rendezvous failed). The second now finds the
    machine-wide lock held and touches nothing; /etc/hosts is rewritten without truncating it
    first, so a concurrent reader sees the original prefix whatever the timing."""
    hosts = Path("/etc/hosts").read_bytes()
    second = SlurmCluster(tmp_path / "second", num_nodes=1)
    with pytest.raises(SlurmUnavailable, match=r"another local test cluster runs on this "
                                               rf"machine \(pid {os.getpid()} holds "):
        second.start()
    second.stop()
    assert Path("/etc/hosts").read_bytes() == hosts
    assert all(f"ttnode{k} " in hosts.decode() for k in range(1, NUM_NODES + 1))

    from slurm_cluster import _rewrite_in_place
    path = tmp_path / "hosts"
    path.write_bytes(b"127.0.0.1 localhost\n")
    _rewrite_in_place(path, b"127.0.0.1 localhost\n127.0.1.1 ttnode1 # marker\n")
    assert path.read_bytes() == b"127.0.0.1 localhost\n127.0.1.1 ttnode1 # marker\n"
    _rewrite_in_place(path, b"127.0.0.1 localhost\n")  # the restore: shorter, truncated
    assert path.read_bytes() == b"127.0.0.1 localhost\n"


def test_dry_run_scripts_pass_sbatch_test_only(cluster, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = write_run_config(tmp_path / "run.yaml", tmp_path / "run")
    common = ["--config", str(config), "train.max_steps=10", "--cpus-per-task",
              str(CPUS_PER_NODE), "--time", "00:30:00", "--partition", cluster.partition,
              "--dry-run", "--no-preflight"]  # the run has no data: the script only
    for nodes in (1, NUM_NODES, NUM_NODES + 1):
        rc, script, err = tape_submit([*common, "--nodes", str(nodes)])
        assert rc == 0, err
        assert f"#SBATCH --nodes={nodes}\n" in script
        assert "TRAIN_ARGS=(--config" in script and "train.max_steps=10" in script
        path = tmp_path / f"dry-{nodes}.sbatch"
        path.write_text(script)
        syntax = cluster.run(["bash", "-n", str(path)], check=False)
        assert syntax.returncode == 0, syntax.stderr
        test_only = cluster.run(["sbatch", "--test-only", str(path)], check=False)
        if nodes <= NUM_NODES:
            assert test_only.returncode == 0, test_only.stderr
            # e.g. "sbatch: Job 7 to start at ... using 8 processors on nodes ttnode[1-4] ..."
            assert "to start at" in test_only.stderr, test_only.stderr
            assert f"using {nodes * CPUS_PER_NODE} processors" in test_only.stderr
        else:   # negative control: more nodes than the partition has
            assert test_only.returncode != 0, test_only.stderr
    assert not (tmp_path / "logs").exists(), "--dry-run must not create files"


def test_a_job_no_node_can_hold_is_refused_not_queued(cluster, tmp_path, monkeypatch):
    """More CPUs per node than the partition has in all: sbatch 22.05 queued such a job (one
    asking for fewer, still more than a node has, it refused itself), which then pended for
    ever (PartitionConfig). tape-submit asks `sbatch --test-only` first and queues nothing.
    (Every job the tests below submit with tape-submit passed the same question.)"""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf_path))
    config = write_run_config(tmp_path / "run.yaml", tmp_path / "run")
    cpus = NUM_NODES * CPUS_PER_NODE + 1
    rc, out, err = tape_submit(["--config", str(config), "--cpus-per-task", str(cpus), "--time",
                                "00:30:00", "--job-name", "too-wide", "--no-preflight"])
    assert rc == 1 and out == "", err
    assert "Requested node configuration is not available: no node of the partition has " \
        f"what each node of this job asks for (--cpus-per-task {cpus}" in err, err
    assert "nothing was submitted" in err and not (tmp_path / "logs").exists()
    rc, out, err = tape_submit(["--config", str(config), "--cpus-per-task", str(cpus), "--time",
                                "00:30:00", "--job-name", "too-wide", "--no-preflight",
                                "--dry-run"])   # the script given to sbatch on stdin
    assert rc == 1 and "#SBATCH --job-name=too-wide" in out, err
    assert "Requested node configuration is not available" in err, err
    queued = cluster.run(["squeue", "--noheader", "--name=too-wide", "--states=all"]).stdout
    assert queued.strip() == "", queued


# Runs under torchrun in place of the trainer: records what each rank sees, and in a first run
# (SLURM_RESTART_COUNT=0) waits for USR1/TERM, agreeing on it across ranks at "step
# boundaries" like the trainer, then exits 75; a rerun would exit 0 at once.
PROBE_SOURCE = '''
import json, os, signal, sys, time
import torch
import torch.distributed as dist

stop = False
def on_signal(signum, frame):
    global stop
    stop = True
signal.signal(signal.SIGUSR1, on_signal)
signal.signal(signal.SIGTERM, on_signal)

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
out = os.environ.get("PROBE_OUT", "probe")   # a job submitted with --export=NONE: the cwd's
record = {k: os.environ.get(k) for k in (
    "MASTER_ADDR", "MASTER_PORT", "SLURMD_NODENAME", "SLURM_NODEID", "SLURM_JOB_ID",
    "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS", "LOCAL_RANK", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_MAX_RESTARTS")}
record.update(rank=rank, world=world, all_reduce_sum=total.item(), restart=restart)
steps = 0
if restart == 0:
    while True:
        flag = torch.tensor([1.0 if stop else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            break
        if steps == 0:  # written whole, then named: a reader never meets it empty
            with open(os.path.join(out, f".waiting-{rank}"), "w") as f:
                f.write(f"{os.getpid()} {os.environ['SLURM_NODEID']}")
            os.replace(os.path.join(out, f".waiting-{rank}"), os.path.join(out, f"waiting-{rank}"))
        steps += 1
        time.sleep(0.2)
record["steps_before_stop"] = steps
with open(os.path.join(out, f"probe-{restart}-{rank}.json"), "w") as f:
    json.dump(record, f)
dist.destroy_process_group()
sys.exit(75 if restart == 0 else 0)
'''


def submit_probe(cluster, tmp_path: Path, monkeypatch, extra: list[str] = (), sub: str = ""
                 ) -> tuple[int, Path, Path]:
    """tape-submit a 2-node job running PROBE_SOURCE in place of the trainer (from
    `tmp_path/sub`); returns (job id, the probe's output directory, the job's log). The nodes
    import this checkout's tape_train (PYTHONPATH), whatever the interpreter has installed."""
    tmp_path = tmp_path / sub
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "slurm_probe.py").write_text(PROBE_SOURCE)
    out = tmp_path / "probe"
    out.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(REPO_ROOT)]))
    monkeypatch.setenv("PROBE_OUT", str(out))
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf_path))
    config = write_run_config(tmp_path / "run.yaml", tmp_path / "run")
    rc, stdout, err = tape_submit(
        ["--config", str(config), "--nodes", "2", "--cpus-per-task", "1", "--time", "00:10:00",
         "--signal-grace", "120", "--socket-ifname", "lo", "--min-free-gb", "0.01",
         "--train-module", "slurm_probe", "--job-name", "probe", "--log-dir", "logs", *extra])
    assert rc == 0, err
    job_id = int(stdout.split()[0])
    return job_id, out, tmp_path / "logs" / f"probe-{job_id}.out"


def wait_for_probe_loop(cluster, job_id: int, out: Path, log: Path) -> list[int]:
    """Waits until both probe ranks are inside their loop; returns their pids (rank order)."""
    deadline = time.monotonic() + 120
    while not all((out / f"waiting-{r}").exists() for r in (0, 1)):
        info = cluster.job_info(job_id)
        assert info is not None and info.state in ("PENDING", "CONFIGURING", "RUNNING"), (
            f"{info}\n{log.read_text() if log.exists() else 'no log'}")
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        time.sleep(0.3)
    return [int((out / f"waiting-{r}").read_text().split()[0]) for r in (0, 1)]


def extern_step_lead(cluster, job_id: int, timeout: float = 20) -> float:
    """Seconds by which the job's extern step (PrologFlags=Contain) ended before its batch step,
    in its first run, from the slurmd logs. Left alone, the extern step is ended with the run
    (a few ms before or after the batch step, on another node); one that a signal killed ended
    long before. Waits for both ends to be logged (the extern one comes after the job's)."""
    from datetime import datetime

    deadline = time.monotonic() + timeout
    while True:
        ends = cluster.step_end_times(job_id)
        if "batch" in ends and "extern" in ends:
            batch, extern = (datetime.fromisoformat(ends[s][0]) for s in ("batch", "extern"))
            return (batch - extern).total_seconds()
        assert time.monotonic() < deadline, f"job {job_id}: step ends logged: {ends}"
        time.sleep(0.2)


def test_two_node_probe_rendezvous_and_signal_forwarding(cluster, tmp_path, monkeypatch):
    # --max-requeues 0: the stop must not requeue (the requeue itself is exercised with the
    # real trainer below), so this job ends after one run, FAILED with the trainer's 75.
    # Side by side, a second job gets USR1 on its steps only (`scancel --signal=USR1` without
    # --batch; `--signal=USR1@T` without B:): torchrun exits 1 for a forwarded signal, and the
    # script must still see a stop for a requeue (it used to fail the job: exit 1).
    job_id, out, log = submit_probe(cluster, tmp_path, monkeypatch, ["--max-requeues", "0"])
    # Submitted from a directory with a space and a '#' (quoted in the #SBATCH lines: unquoted,
    # sbatch ran the job in the path cut at the '#'), and with SBATCH_EXPORT=NONE, which Slurm
    # passes on to the job's sruns: the steps failed (`execve(): bash: No such file or
    # directory`) until the script gave them --export=ALL. The probe then imports from the cwd.
    monkeypatch.setenv("SBATCH_EXPORT", "NONE")
    steps_id, steps_out, steps_log = submit_probe(cluster, tmp_path, monkeypatch,
                                                  ["--max-requeues", "0"], sub="steps dir#2")
    monkeypatch.delenv("SBATCH_EXPORT")
    # Wait until both ranks are inside their loop, then "preempt" the batch shell only.
    wait_for_probe_loop(cluster, job_id, out, log)
    cluster.run(["scancel", "--signal=USR1", "--batch", str(job_id)])
    wait_for_probe_loop(cluster, steps_id, steps_out, steps_log)
    cluster.run(["scancel", "--signal=USR1", str(steps_id)])
    info = cluster.wait_for_job(job_id, timeout=120)
    text = log.read_text()
    assert info.state == "FAILED" and info.exit_code == "75:0", f"{info.raw}\n{text}"
    assert info.restart_count == 0, f"{info.raw}\n{text}"

    steps_info = cluster.wait_for_job(steps_id, timeout=120)
    steps_text = steps_log.read_text()
    assert (steps_info.state, steps_info.exit_code) == ("FAILED", "75:0"), (
        f"{steps_info.raw}\n{steps_text}")
    assert "caught SIGUSR1" not in steps_text           # the batch shell got nothing
    assert len(re.findall(r"node ttnode\d \(node rank \d\): SIGUSR1 reached this step",
                          steps_text)) == 2, steps_text
    assert all(json.loads((steps_out / f"probe-0-{r}.json").read_text())["steps_before_stop"] > 0
               for r in (0, 1))
    # The requeue's own decision (its limit is 0 here, as for the job above).
    assert "NOT requeueing: restart count 0 reached TAPE_MAX_REQUEUES=0" in steps_text
    assert "training failed" not in steps_text
    # The script forwarded USR1 to the training step alone: slurmstepd was never asked to
    # signal the extern step, which lived on until the job ended, with the batch step. The
    # negative control: the USR1 sent to all of the steps job's steps was asked of its extern
    # step too (slurmd's debug log, on both nodes), and on Slurm 22.05, whose extern step
    # holds a `sleep` that dies of it, ended that step at once, seconds before the batch step.
    # On 24.11 the extern step's `sleep` dies of it too, but the step lives on until the job
    # ends (measured), so only the request shows; an ssh session adopted there would get it.
    assert re.search(rf"caught SIGUSR1; forwarding it to the training step {job_id}\.\d+ ",
                     text), text
    usr1 = int(signal.SIGUSR1)
    assert "extern" not in cluster.step_signals(job_id, usr1), cluster.step_signals(job_id, usr1)
    assert len(cluster.step_signals(job_id, usr1).get("1", [])) == 2, (   # the training step
        cluster.step_signals(job_id, usr1))
    assert len(cluster.step_signals(steps_id, usr1).get("extern", [])) == 2, (
        cluster.step_signals(steps_id, usr1))
    assert extern_step_lead(cluster, job_id) < 1, cluster.step_end_times(job_id)
    if cluster.version() <= (22, 5):
        assert extern_step_lead(cluster, steps_id) > 1, cluster.step_end_times(steps_id)

    records = [json.loads((out / f"probe-0-{r}.json").read_text()) for r in (0, 1)]
    for rec in records:
        assert rec["world"] == 2 and rec["all_reduce_sum"] == 3.0   # 1 + 2 across both nodes
        # c10d rendezvous named after the job (its store on the first node, port from the job
        # id: the log line below); the workers' own store is a fresh one per attempt.
        assert rec["TORCHELASTIC_RUN_ID"] == str(job_id)
        assert rec["TORCHELASTIC_MAX_RESTARTS"] == "3"              # tape-submit's default
        assert rec["GLOO_SOCKET_IFNAME"] == "lo" and rec["OMP_NUM_THREADS"] == "1"
        assert rec["LOCAL_RANK"] == "0"                             # one process per node
        # The forwarded USR1 reached both ranks' processes after they had looped, and they
        # stopped together at a "step boundary".
        assert rec["restart"] == 0 and rec["steps_before_stop"] > 0
    # The two ranks ran on two different nodes, with node ranks 0 and 1.
    assert sorted(r["SLURM_NODEID"] for r in records) == ["0", "1"]
    assert len({r["SLURMD_NODENAME"] for r in records}) == 2

    assert len(re.findall(r"\[preflight ttnode\d\] all 6 start-up checks passed", text)) == 2
    assert "caught SIGUSR1" in text and "SLURM_RESTART_COUNT=0" in text
    # The endpoint is the first node's NodeAddr (127.0.0.1 in slurm.conf; its name resolves to
    # 127.0.1.1); the port comes from the job id, 15000-29999 without torchrun's 29400/29500.
    port = 15000 + job_id % 14998
    port += port >= 29400
    port += port >= 29500
    assert f"master=127.0.0.1:{port} (node ttnode1)" in text
    # Each node resolved the rendezvous host; the one hosting the store found its port free.
    assert f"[preflight ttnode1] ok     rendezvous: 127.0.0.1:{port} (127.0.0.1), hosted " \
        "here, port free" in text, text
    assert f"[preflight ttnode2] ok     rendezvous: 127.0.0.1:{port} (127.0.0.1)\n" in text, text
    assert "WARNING: this torchrun has no" not in text   # it takes every option
    assert "NOT requeueing: restart count 0 reached TAPE_MAX_REQUEUES=0" in text


def test_without_restarts_a_killed_rank_stops_the_job_promptly_naming_its_node(cluster, tmp_path,
                                                                                monkeypatch):
    # --max-restarts 0 (the negative control of the restart test with the trainer below):
    # node rank 1's worker dies of SIGKILL (OOM killer, a crash): its torchrun fails, the
    # other rank's collective fails when the connection closes, and the job ends FAILED,
    # not requeued, long before srun --wait (grace + 60 = 180 s) would cut it short.
    job_id, out, log = submit_probe(cluster, tmp_path, monkeypatch, ["--max-restarts", "0"])
    pids = wait_for_probe_loop(cluster, job_id, out, log)
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    info = cluster.wait_for_job(job_id, timeout=120)
    elapsed = time.monotonic() - killed_at
    text = log.read_text()
    assert info.state == "FAILED" and info.exit_code == "1:0", f"{info.raw}\n{text}"
    assert info.restart_count == 0 and elapsed < 60, (elapsed, text)
    assert "SIGKILL" in text   # torchrun's Root Cause block: rank 1, exitcode -9 (SIGKILL)
    node = dict(re.findall(r"node (ttnode\d) \(node rank (\d)\): torchrun exited", text))
    assert sorted(node.values()) == ["0", "1"], text
    first = re.search(r"node (ttnode\d) \(node rank (\d)\): torchrun exited with [1-9]", text)
    # The node that failed first comes first (c10d numbers the ranks by host and pid, so rank
    # 1 may run on either node).
    assert first and first.group(2) == (out / "waiting-1").read_text().split()[1], text
    assert "ERROR: training failed (exit 1); not requeueing" in text
    assert "requeueing job" not in text


def test_run_dir_locked_by_another_job_fails_in_preflight(cluster, tmp_path, monkeypatch):
    # Another job (on another host) holds the run directory: the first node's start-up check
    # names it, before torchrun starts, and the job is not requeued; the lock stays as it was.
    lock = tmp_path / "run" / LOCK_NAME
    lock.parent.mkdir()
    holder = ('{"host": "gpu-node-9", "pid": 4711, "slurm_job_id": "991", '
              '"slurm_restart_count": "0", "started": "2026-01-01T00:00:00Z"}\n')
    lock.write_text(holder)
    job_id, out, log = submit_probe(cluster, tmp_path, monkeypatch)
    info = cluster.wait_for_job(job_id, timeout=120)
    text = log.read_text()
    assert info.state == "FAILED" and info.restart_count == 0, f"{info.raw}\n{text}"
    assert re.search(r"\[preflight ttnode\d\] FAILED run dir writable: run directory "
                     + re.escape(str(lock.parent)) + r" is in use by another run \(host "
                     r"gpu-node-9, pid 4711, Slurm job 991", text), text
    assert "ERROR: start-up checks failed" in text
    assert not list(out.iterdir()), "the probe (the trainer) must not have started"
    assert lock.read_text() == holder


def test_plain_sbatch_with_bad_training_arguments_says_what_is_wrong(cluster, tmp_path):
    # launch/slurm/train.sbatch submitted as it is (no tape-submit), with a misspelt option.
    (tmp_path / "logs" / "slurm").mkdir(parents=True)
    script = REPO_ROOT / "launch" / "slurm" / "train.sbatch"
    # 30 minutes: with the script's own --signal=B:USR1@300 a 5-minute job is due its warning
    # at once, and Slurm's next signal check (every 30 s) could requeue it before it fails.
    # --ntasks-per-node=2, as one might ask for two processes per node: srun took the job's
    # SLURM_NTASKS over the script's --ntasks-per-node=1 and ran every step twice per node.
    job_id = cluster.sbatch(["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
                             "--time=30", str(script), "--confg", "run.yaml"], cwd=tmp_path,
                            env={"PYTHONPATH": str(REPO_ROOT), "TAPE_PYTHON": sys.executable})
    info = cluster.wait_for_job(job_id, timeout=120)
    text = (tmp_path / "logs" / "slurm" / f"tape-train-{job_id}.out").read_text()
    assert info.state == "FAILED" and info.restart_count == 0, f"{info.raw}\n{text}"
    # One start-up check ran, and its own exit code ended the job: a second task on the node
    # printed the same failure, or was killed by --kill-on-bad-exit (exit 143), before.
    assert text.count("tape-train would reject the arguments ['--confg', 'run.yaml']: the "
                      "following arguments are required: --config") == 1, text
    assert "ERROR: start-up checks failed on at least one node (exit 1)" in text, text
    assert "WARNING: the job asked for 2 tasks on 1 node(s)" in text, text


# ---------------------------------------------------------------------------------------------
# Corpus preparation: launch/slurm/prepare.sbatch
# ---------------------------------------------------------------------------------------------
# ~0.3 MB of training text in buffers of 10 kB: about 30 checkpoints, a few ms apart.
PREPARE_OPTIONS = ["--num-shards", "3", "--eval-fraction", "0.1", "--shuffle-bytes", "10000"]


def submit_prepare(cluster, workdir: Path, args: list[str], script: Path | None = None) -> int:
    """Plain `sbatch prepare.sbatch <args>` from `workdir` (1 CPU, 5 minutes)."""
    (workdir / "logs" / "slurm").mkdir(parents=True, exist_ok=True)
    script = script or REPO_ROOT / "launch" / "slurm" / "prepare.sbatch"
    return cluster.sbatch(["--cpus-per-task=1", "--time=5", str(script), *args], cwd=workdir,
                          env={"PYTHONPATH": str(REPO_ROOT), "TAPE_PYTHON": sys.executable})


def prepare_log(workdir: Path, job_id: int) -> str:
    path = workdir / "logs" / "slurm" / f"tape-prepare-{job_id}.out"
    return path.read_text() if path.exists() else f"<no log at {path}>"


def hold_prepare(cluster, job_id: int, workdir: Path, out: Path) -> int:
    """SIGSTOPs the job's prepare at its checkpoint 2 (so it cannot finish before a signal
    reaches the batch shell); returns its pid."""
    from test_slurm_prepare import hold_at_checkpoint

    def still_running() -> None:
        info = cluster.job_info(job_id)
        assert info is not None and info.state in ("PENDING", "CONFIGURING", "RUNNING"), (
            f"{info}\n{prepare_log(workdir, job_id)}")

    return hold_at_checkpoint(out, 2, still_running)


def test_prepare_job_requeued_on_usr1_resumes_to_a_direct_runs_bytes(cluster, corpus,
                                                                     tmp_path):
    """A prepare told to stop (USR1) mid-way is requeued, resumes from its checkpoint and
    writes what a direct `tape-data prepare` writes; a prepare of bad input fails once, not
    requeued; without the script's trap a USR1 ends the job and nothing requeues it (the
    negative control). The three jobs run side by side (~20 s, most of it the requeue's
    cred_expire wait)."""
    from test_slurm_prepare import files

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "in.jsonl").write_bytes(corpus["jsonl"].read_bytes() + b"{not json\n")
    bad_id = submit_prepare(cluster, bad, ["--input", str(bad / "in.jsonl"), "--out",
                                           str(bad / "out"), *PREPARE_OPTIONS])

    def args(out: Path) -> list[str]:
        return ["--input", str(corpus["jsonl"]), "--out", str(out), *PREPARE_OPTIONS,
                "--tokenize", "--tokenizer", str(corpus["tokenizer"])]

    work = tmp_path / "job"
    work.mkdir()
    job_id = submit_prepare(cluster, work, args(work / "out"))
    held = [hold_prepare(cluster, job_id, work, work / "out")]
    # The negative control: the same script without its USR1 trap, stopped the same way.
    control = tmp_path / "no-trap"
    control.mkdir()
    script = control / "prepare.sbatch"
    text = (REPO_ROOT / "launch" / "slurm" / "prepare.sbatch").read_text()
    script.write_text(text.replace("trap 'stop_prepare USR1' USR1\n", ""))
    assert script.read_text() != text
    control_id = submit_prepare(cluster, control, args(control / "out"), script=script)
    try:
        held.append(hold_prepare(cluster, control_id, control, control / "out"))
        # What a preemption tool does (and Slurm at the time limit minus the grace).
        for job in (job_id, control_id):
            cluster.run(["scancel", "--signal=USR1", "--batch", str(job)])
        deadline = time.monotonic() + 30
        while "caught SIGUSR1" not in prepare_log(work, job_id):
            assert time.monotonic() < deadline, prepare_log(work, job_id)
            time.sleep(0.1)
        control_info = cluster.wait_for_job(control_id, timeout=60)
    finally:
        for pid in held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    info = cluster.wait_for_job(job_id, timeout=120)
    log = prepare_log(work, job_id)
    assert info.state == "COMPLETED" and info.exit_code == "0:0", f"{info.raw}\n{log}"
    assert info.restart_count == 1, f"{info.raw}\n{log}"
    stopped = re.search(r"stopped; the same command resumes from checkpoint (\d+)", log)
    assert stopped and int(stopped.group(1)) >= 2, log
    assert f"requeueing job {job_id} (prepare exit code 130)" in log
    assert re.search(r"restart=1\] SLURM_RESTART_COUNT=1", log), log
    assert re.search(r"resuming prepare from \d+ documents \([\d.]+ MB\), checkpoint "
                     + stopped.group(1) + "\n", log), log
    assert "prepare finished (exit 0)" in log and "Traceback" not in log

    direct = tmp_path / "direct"
    run = subprocess.run([sys.executable, "-m", "tape_train.data.cli", "prepare",
                          *args(direct)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert files(work / "out") == files(direct)

    bad_info = cluster.wait_for_job(bad_id, timeout=60)
    bad_log = prepare_log(bad, bad_id)
    assert bad_info.state == "FAILED" and bad_info.exit_code == "1:0", f"{bad_info.raw}\n{bad_log}"
    assert bad_info.restart_count == 0
    assert "in.jsonl:161: malformed JSON" in bad_log
    assert "not requeueing: it would fail again" in bad_log

    control_log = prepare_log(control, control_id)
    assert control_info.restart_count == 0, f"{control_info.raw}\n{control_log}"
    # The batch shell died of signal 10 (USR1): FAILED, exit code 0:10.
    assert (control_info.state, control_info.exit_code) == ("FAILED", "0:10"), (
        f"{control_info.raw}\n{control_log}")
    assert "requeueing" not in control_log


# ---------------------------------------------------------------------------------------------
# The real trainer
# ---------------------------------------------------------------------------------------------
MAX_STEPS = 40
SIGNAL_AFTER_STEP = 5       # the interrupted job gets USR1 once metrics.jsonl shows this step
EVAL_LENGTHS = (64, 128)
# Resumed losses are usually bit-identical to the uninterrupted run's, but not always: in one
# of our runs (two jobs sharing the CPUs) the first resumed step's gradient norm differed by
# ~3e-10 relative and later losses in the 7th digit. So after the resume the comparison
# allows float32 round-off; a broken resume is off by orders of magnitude more.
LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """A small real-text JSONL corpus and a 512-piece tokenizer trained on it (~1 s)."""
    from tape_train.data.testing import real_text_documents, write_jsonl
    from tape_train.data.tokenizer import TokenizerTrainSpec, train_tokenizer

    root = tmp_path_factory.mktemp("corpus")
    docs = real_text_documents(160)
    jsonl = write_jsonl(root / "train.jsonl", docs)
    train_tokenizer(docs, root / "tok", TokenizerTrainSpec(vocab_size=512, num_threads=1))
    return {"jsonl": jsonl, "tokenizer": root / "tok.model"}


def write_training_config(path: Path, run_dir: Path, corpus: dict[str, Path]) -> Path:
    """The `tiny` model shrunk to 2 layers x 64 wide, fp32, checkpoints every 10 steps."""
    path.write_text(f"""\
model:
  base: tiny
  pe: tape
  vocab_size: 512
  num_layers: 2
  hidden_size: 64
  num_heads: 2
  intermediate_size: 128
data:
  sources: [{corpus['jsonl']}]
  tokenizer: {corpus['tokenizer']}
  eval_fraction: 0.1
train:
  run_dir: {run_dir}
  seq_len: 64
  micro_batch_size: 2
  max_steps: {MAX_STEPS}
  lr: 1.0e-3
  warmup_steps: 4
  dtype: fp32
  seed: 7
  device: cpu
checkpoint:
  interval: 10
  keep: 2
eval:
  interval: 0
  protocols: [nonoverlap]
  max_tokens: 1024
  batch_size: 2
logging:
  interval: 1
  console_interval: 5
  tensorboard: false
  peak_tflops: 1.0
""")
    return path


def submit_training(tmp_path: Path, name: str, corpus, monkeypatch, extra: list[str] = (),
                    nodes: int = 2) -> tuple[list[int], Path, Path]:
    """tape-submit a CPU training job (2 nodes unless told); returns (job ids, run dir, log
    dir). `resubmit_training` submits the same command again."""
    workdir = tmp_path / name
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    run_dir = workdir / "run"
    write_training_config(workdir / "run.yaml", run_dir, corpus)
    return resubmit_training(workdir, name, extra, nodes), run_dir, workdir / "logs"


def resubmit_training(workdir: Path, name: str, extra: list[str] = (), nodes: int = 2
                      ) -> list[int]:
    """Submits `workdir`'s run.yaml from `workdir` (the current directory) again."""
    assert Path.cwd() == workdir
    rc, stdout, err = tape_submit(
        ["--config", str(workdir / "run.yaml"), "--nodes", str(nodes), "--cpus-per-task", "1",
         "--time", "00:15:00", "--signal-grace", "120", "--socket-ifname", "lo",
         "--min-free-gb", "0.01", "--job-name", name, "--log-dir", "logs", *extra])
    assert rc == 0, err
    return [int(x) for x in stdout.split()]


def log_text(log_dir: Path, name: str, job_id: int) -> str:
    path = log_dir / f"{name}-{job_id}.out"
    return path.read_text() if path.exists() else f"<no log at {path}>"


def read_metrics(run_dir: Path, kind: str) -> list[dict]:
    """The trainer's metrics.jsonl records of `kind` (imported late: the tests above do not
    need the trainer)."""
    from tape_train.train.metrics import read_metrics as read

    return read(run_dir, kind)


def events(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir, "event")


@pytest.fixture(scope="module")
def training_jobs(cluster, corpus, tmp_path_factory):
    """Submits both training jobs (and the chained evaluation), side by side, and sends USR1 to
    the second one's batch shell once it has trained SIGNAL_AFTER_STEP steps."""
    tmp_path = tmp_path_factory.mktemp("training")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", str(cluster.conf_path))
        (plain_id,), plain_run, plain_logs = submit_training(tmp_path, "plain", corpus, mp)
        (stopped_id, eval_id), stopped_run, stopped_logs = submit_training(
            tmp_path, "stopped", corpus, mp,
            extra=["--eval-after", "--eval-time", "00:10:00",
                   "--eval-lengths", *map(str, EVAL_LENGTHS), "--eval-arg=--no-progress",
                   "--eval-arg=--protocols=nonoverlap", "--eval-arg=--max-tokens=1024"])
    deadline = time.monotonic() + 180
    while True:
        steps = [r["step"] for r in read_metrics(stopped_run, "train")]
        if steps and max(steps) >= SIGNAL_AFTER_STEP:
            break
        info = cluster.job_info(stopped_id)
        assert info is not None and info.state in ("PENDING", "CONFIGURING", "RUNNING"), (
            f"{info}\n{log_text(stopped_logs, 'stopped', stopped_id)}")
        assert time.monotonic() < deadline, log_text(stopped_logs, "stopped", stopped_id)
        time.sleep(0.2)
    cluster.run(["scancel", "--signal=USR1", "--batch", str(stopped_id)])
    return {
        "plain": (plain_id, plain_run, plain_logs),
        "stopped": (stopped_id, stopped_run, stopped_logs),
        "eval": (eval_id, stopped_run / "eval", stopped_logs),
    }


def test_two_node_training_finishes(cluster, training_jobs):
    job_id, run_dir, log_dir = training_jobs["plain"]
    info = cluster.wait_for_job(job_id, timeout=240)
    log = log_text(log_dir, "plain", job_id)
    assert info.state == "COMPLETED" and info.exit_code == "0:0", f"{info.raw}\n{log}"
    assert info.restart_count == 0
    steps = [r["step"] for r in read_metrics(run_dir, "train")]
    assert steps == list(range(1, MAX_STEPS + 1)), log
    kinds = [e["event"] for e in events(run_dir)]
    assert kinds[0] == "start" and kinds[-1] == "done", kinds
    start = events(run_dir)[0]
    assert start["world_size"] == 2 and start["slurm_restart_count"] == 0
    assert (run_dir / "checkpoints" / f"step_{MAX_STEPS:08d}").is_dir()
    assert len(re.findall(r"\[preflight ttnode\d\] all 7 start-up checks passed", log)) == 2
    assert "training finished (exit 0)" in log


def test_usr1_checkpoints_requeues_resumes_and_matches_uninterrupted_losses(cluster,
                                                                            training_jobs):
    job_id, run_dir, log_dir = training_jobs["stopped"]
    info = cluster.wait_for_job(job_id, timeout=240)
    log = log_text(log_dir, "stopped", job_id)
    assert info.state == "COMPLETED" and info.exit_code == "0:0", f"{info.raw}\n{log}"
    assert info.restart_count == 1, f"{info.raw}\n{log}"
    evs = events(run_dir)
    kinds = [e["event"] for e in evs]
    # First run: start ... stop (exit 75) at a step boundary mid-run; then the requeued run
    # resumes from the checkpoint written at that step and finishes.
    assert "stop" in kinds and "resume" in kinds and kinds[-1] == "done", kinds
    stop = evs[kinds.index("stop")]
    resume = evs[kinds.index("resume")]
    assert stop["exit_code"] == 75
    assert SIGNAL_AFTER_STEP <= stop["step"] < MAX_STEPS, (stop, log)
    assert resume["step"] == stop["step"] and resume["slurm_restart_count"] == 1
    assert f"step_{stop['step']:08d}" in str(resume["checkpoint"])
    assert "caught SIGUSR1" in log and "requeueing job" in log
    assert "SLURM_RESTART_COUNT=1" in log
    # The stop reached the training step only: the first run's extern step ended with that
    # run, with its batch step (a USR1 to every step would have ended it at once on 22.05),
    # and slurmstepd was never asked to signal it.
    assert re.search(rf"forwarding it to the training step {job_id}\.\d+ ", log), log
    assert extern_step_lead(cluster, job_id) < 1, cluster.step_end_times(job_id)
    assert "extern" not in cluster.step_signals(job_id, int(signal.SIGUSR1)), (
        cluster.step_signals(job_id, int(signal.SIGUSR1)))

    assert_uninterrupted_losses(cluster, training_jobs, run_dir, stop["step"])


def assert_uninterrupted_losses(cluster, training_jobs, run_dir: Path, resumed_at: int) -> None:
    """run_dir's per-step losses are the uninterrupted (plain) job's: bit-identical up to the
    checkpoint it resumed from, equal to float32 round-off after it."""
    plain_id, plain_run, _ = training_jobs["plain"]
    cluster.wait_for_job(plain_id, timeout=240)
    reference = {r["step"]: r["loss"] for r in read_metrics(plain_run, "train")}
    resumed = {r["step"]: r["loss"] for r in read_metrics(run_dir, "train")}
    assert sorted(resumed) == sorted(reference) == list(range(1, MAX_STEPS + 1))
    # Before the stop both jobs ran the same computation: bit-identical.
    before = range(1, resumed_at + 1)
    assert [resumed[s] for s in before] == [reference[s] for s in before]
    # After the resume: equal to float32 round-off (see LOSS_RTOL). A resume that lost the
    # optimizer state, the data position or the schedule is off by far more than that: the
    # loss moves by more than 100x the tolerance from one step to the next.
    after = range(resumed_at + 1, MAX_STEPS + 1)
    mismatches = [(s, reference[s], resumed[s]) for s in after
                  if not math.isclose(resumed[s], reference[s], rel_tol=LOSS_RTOL)]
    assert not mismatches, mismatches[:5]
    step_changes = [abs(reference[s] - reference[s - 1]) / reference[s] for s in after if s > 1]
    assert not step_changes or max(step_changes) > 100 * LOSS_RTOL  # none: it never resumed


def test_eval_job_chained_after_the_requeued_training(cluster, training_jobs):
    eval_id, out_dir, log_dir = training_jobs["eval"]
    stopped_id = training_jobs["stopped"][0]
    info = cluster.wait_for_job(eval_id, timeout=300)
    log = log_text(log_dir, "stopped-eval", eval_id)
    assert info.state == "COMPLETED" and info.exit_code == "0:0", f"{info.raw}\n{log}"
    # afterok held across the requeue: the evaluation started after the training job's
    # final (second) run had completed.
    train = cluster.job_info(stopped_id)
    assert train.state == "COMPLETED" and train.restart_count == 1
    fields = dict(t.split("=", 1) for t in info.raw.split() if "=" in t)
    train_fields = dict(t.split("=", 1) for t in train.raw.split() if "=" in t)
    assert fields["StartTime"] >= train_fields["EndTime"], (info.raw, train.raw)
    for name in ("eval.json", "eval.md", "ppl_vs_length.png"):
        assert (out_dir / name).is_file() and (out_dir / name).stat().st_size > 0, (name, log)
    # eval.json: {"format", "settings", "models": [{..., "results": [{"protocol", "length",
    # "perplexity", ...}]}]} (tape_train.eval.report).
    report = json.loads((out_dir / "eval.json").read_text())
    (model,) = report["models"]
    results = {(r["protocol"], r["length"]): r["perplexity"] for r in model["results"]}
    assert sorted({length for _, length in results}) == sorted(EVAL_LENGTHS), model["results"]
    # A trained 512-token model: better than uniform guessing, worse than perfect.
    assert all(1.0 < ppl < 512 for ppl in results.values()), results
    table = (out_dir / "eval.md").read_text()
    assert all(f"| nonoverlap | {length} |" in table for length in EVAL_LENGTHS), table
    assert (out_dir / "ppl_vs_length.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_job_killed_outright_leaves_its_lock_and_the_resubmission_resumes(cluster, corpus,
                                                                           tmp_path,
                                                                           monkeypatch):
    # The trainer of a 1-node job is killed by SIGKILL (OOM killer, kill -9, node failure)
    # after its first checkpoint: the job FAILS and RUN.lock stays. A resubmission (a new job
    # id) asks Slurm about the holder's job, takes the lock over and resumes.
    from tape_train.train.checkpoint import find_latest_intact

    monkeypatch.setenv("SLURM_CONF", str(cluster.conf_path))
    # The run takes about a second: a test process starved on a loaded machine may find it
    # ended before its kill. Then once more in a fresh directory (the assertions stay).
    for attempt in (1, 2):
        first, run_dir, log_dir, holder, info = _kill_a_job_after_its_first_checkpoint(
            cluster, corpus, tmp_path / f"attempt{attempt}", monkeypatch)
        if not (attempt == 1 and info.state == "COMPLETED"):
            break
    assert info.state == "FAILED", f"{info.raw}\n{log_text(log_dir, 'killed', first)}"
    lock = run_dir / LOCK_NAME
    killed_at = find_latest_intact(run_dir, warn=False)   # the last checkpoint before the kill
    assert lock.exists(), "a SIGKILLed trainer cannot release its lock"
    lock.write_text(json.dumps(holder))

    (second,) = resubmit_training(run_dir.parent, "killed", nodes=1)
    info = cluster.wait_for_job(second, timeout=240)
    log = log_text(log_dir, "killed", second)
    assert info.state == "COMPLETED", f"{info.raw}\n{log}"
    assert (f"took over the lock of run directory {run_dir} from host gpu-node-9, pid "
            f"{holder['pid']}, Slurm job {first} (restart 0), started {holder['started']}: its "
            f"Slurm job {first} has ended: Slurm says job {first} is FAILED") in log, log
    evs = events(run_dir)
    resume = [e for e in evs if e["event"] == "resume"]
    assert resume and killed_at.name in str(resume[-1]["checkpoint"]), (evs, log)
    assert evs[-1]["event"] == "done" and not lock.exists()
    steps = [r["step"] for r in read_metrics(run_dir, "train")]
    assert steps[-1] == MAX_STEPS, steps


def _kill_a_job_after_its_first_checkpoint(cluster, corpus, tmp_path: Path, monkeypatch):
    """Submits a 1-node job, SIGKILLs its trainer once a checkpoint is intact; returns (job id,
    run dir, log dir, its lock as read (host changed), its end's info); the lock None and the
    info COMPLETED when the job ended before the kill."""
    from tape_train.train.checkpoint import find_latest_intact
    from tape_train.train.run_lock import lock_refusal

    tmp_path.mkdir()
    # --max-restarts 0: with restarts the kill would be recovered inside the job (tested below).
    (first,), run_dir, log_dir = submit_training(tmp_path, "killed", corpus, monkeypatch, nodes=1,
                                                 extra=["--max-restarts", "0"])
    lock = run_dir / LOCK_NAME
    deadline = time.monotonic() + 180
    while find_latest_intact(run_dir, warn=False) is None:
        info = cluster.job_info(first)
        if info is not None and info.state == "COMPLETED":  # ended before the poll saw it
            return first, run_dir, log_dir, None, info
        assert info is not None and info.state in ("PENDING", "CONFIGURING", "RUNNING"), (
            f"{info}\n{log_text(log_dir, 'killed', first)}")
        assert time.monotonic() < deadline, log_text(log_dir, "killed", first)
        time.sleep(0.1)
    if not lock.exists():  # released: the run finished meanwhile
        return first, run_dir, log_dir, None, cluster.wait_for_job(first, timeout=120)
    holder = json.loads(lock.read_text())
    assert holder["slurm_job_id"] == str(first) and holder["slurm_cluster"] == "tapetest"
    # The emulated nodes share this machine's host name, where the dead pid alone would tell;
    # on a real cluster the resubmission's rank 0 runs on another host, which cannot check a
    # pid: the lock is made to say so (everything else as the killed job wrote it).
    holder["host"] = "gpu-node-9"
    # Negative control, while the job runs: Slurm says so, and its lock is not taken (asked
    # from this process, outside any job: the cluster name comes from scontrol). The lock is
    # put in another directory as if taken there (a lock copied with its directory is not
    # the holder's: run_lock takes it over).
    from tape_train.train.run_lock import directory_identity

    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / LOCK_NAME).write_text(json.dumps({**holder, "run_dir": directory_identity(copy)}))
    refusal = lock_refusal(copy)
    if not (refusal and refusal.endswith(f"Slurm says job {first} is RUNNING")):
        info = cluster.wait_for_job(first, timeout=120)
        if info.state == "COMPLETED":  # it ended meanwhile
            return first, run_dir, log_dir, None, info
    assert refusal and refusal.endswith(f"Slurm says job {first} is RUNNING"), refusal
    with contextlib.suppress(ProcessLookupError):  # (ended since: COMPLETED below)
        os.kill(holder["pid"], signal.SIGKILL)
    return first, run_dir, log_dir, holder, cluster.wait_for_job(first, timeout=120)


def _trainer_pids(run_dir: Path) -> list[int]:
    """The trainer processes (not srun, the node's bash or torchrun) of the job whose config is
    ``<run_dir>/../run.yaml`` (``submit_training``). A trainer's own child between its fork
    and exec (a helper command it runs) carries the same command line for a moment: processes
    whose parent is a trainer are left out."""
    found, parents = [], {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        module = argv[argv.index(b"-m") + 1] if b"-m" in argv[:-1] else None  # the first -m
        if (Path(argv[0].decode()).name.startswith("python") and module == b"tape_train.train.cli"
                and str(run_dir.parent / "run.yaml").encode() in argv):
            try:  # /proc/<pid>/stat: "pid (comm) state ppid ...", comm may hold spaces
                parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1]
                                              .split()[1])
            except (OSError, IndexError, ValueError):
                continue
            found.append(int(proc.name))
    return sorted(pid for pid in found if parents[pid] not in parents)


def wait_for_step(cluster, job_id: int, run_dir: Path, log_dir: Path, name: str,
                  step: int) -> None:
    deadline = time.monotonic() + 180
    while max([r["step"] for r in read_metrics(run_dir, "train")], default=0) < step:
        info = cluster.job_info(job_id)
        assert info is not None and info.state in ("PENDING", "CONFIGURING", "RUNNING"), (
            f"{info}\n{log_text(log_dir, name, job_id)}")
        assert time.monotonic() < deadline, log_text(log_dir, name, job_id)
        time.sleep(0.2)


def non_lock_holder(run_dir: Path) -> tuple[int, int]:
    """(rank 0's pid, the other trainer's pid) of a 2-rank job."""
    holder = json.loads((run_dir / LOCK_NAME).read_text())["pid"]  # rank 0
    pids = _trainer_pids(run_dir)
    assert len(pids) == 2 and holder in pids, (holder, pids)
    return holder, next(pid for pid in pids if pid != holder)


def ended_in_job(cluster, job_id: int, log_dir: Path, name: str, state: str, why: str) -> str:
    """Waits for the job to end in `state` without a requeue, its log saying `restart 1 of 3`
    and `why` the first attempt ended (a regex); returns the log."""
    info = cluster.wait_for_job(job_id, timeout=240)
    log = log_text(log_dir, name, job_id)
    assert info.state == state and info.restart_count == 0, f"{info.raw}\n{log}"
    assert re.search(rf"restart 1 of 3 \(job {job_id}:0\): attempt 0 ended: {why}", log), log
    return log


def test_a_killed_rank_is_restarted_in_the_job_and_the_losses_are_unchanged(
        cluster, corpus, training_jobs, tmp_path, monkeypatch):
    # Rank 0 is SIGKILLed (the OOM killer, a segfault, kill -9) after the checkpoint at step
    # 10: torchrun restarts both nodes' workers in the same job (no requeue), the new rank 0
    # takes over the dead one's RUN.lock, and they resume from step 10 and finish with the
    # uninterrupted run's losses. Without restarts the same kill fails the job
    # (test_without_restarts_a_killed_rank_stops_the_job_promptly_naming_its_node).
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf_path))
    (job_id,), run_dir, log_dir = submit_training(tmp_path, "restarted", corpus, monkeypatch)
    wait_for_step(cluster, job_id, run_dir, log_dir, "restarted", 12)
    holder, _ = non_lock_holder(run_dir)
    os.kill(holder, signal.SIGKILL)
    # Usually step 10's; a test process starved on a loaded machine may kill after step 20's.
    # Rank 0 writes the markers and is dead: no tag completes before the restart resumes.
    resumed_at = newest_complete_step(run_dir)
    assert resumed_at >= 10
    log = ended_in_job(cluster, job_id, log_dir, "restarted", "COMPLETED",
                       rf"rank 0 \(node ttnode\d, pid {holder}\) ended without a word: killed by "
                       rf"a signal")
    assert f"resuming from checkpoint step_{resumed_at:08d}" in log and "restart 2 of" not in log
    assert "TORCHELASTIC_RESTART_COUNT=" in log
    # The dead rank 0's lock (same job, same host) was taken over by the new rank 0.
    assert re.search(rf"took over the lock of run directory {re.escape(str(run_dir))} from "
                     rf"host \S+, pid {holder}, Slurm job {job_id} \(restart 0\).*its process "
                     rf"{holder} on this host no longer exists", log), log
    resume = [e for e in events(run_dir) if e["event"] == "resume"]
    assert len(resume) == 1 and f"step_{resumed_at:08d}" in str(resume[0]["checkpoint"]), resume
    assert_uninterrupted_losses(cluster, training_jobs, run_dir, resumed_at)


def newest_complete_step(run_dir: Path) -> int:
    """The step of the newest checkpoint with its completion marker (0: none)."""
    return max((int(tag.name.removeprefix("step_")) for tag in
                (run_dir / "checkpoints").glob("step_*") if (tag / MARKER).is_file()), default=0)


def test_a_stopped_trainer_is_restarted_and_without_restarts_fails_after_the_timeout(
        cluster, corpus, training_jobs, tmp_path, monkeypatch):
    # Node rank 1's trainer is SIGSTOPped (a frozen node): rank 0's collective times out after
    # train.collective_timeout_s. With restarts torchrun then ends the stopped worker (SIGKILL
    # after its 30 s stop timeout) and restarts both: the job completes with the uninterrupted
    # losses. Without (the negative control) the job ends FAILED once srun's --wait (grace +
    # 60 s; a short grace, warned about, keeps the wait short) has ended the stopped node. The
    # two jobs run side by side.
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf_path))
    extra = ["--signal-grace", "10", "train.collective_timeout_s=20",
             "train.startup_timeout_s=60"]
    jobs = {}
    for name, more in (("hang", ["--max-restarts", "0"]), ("hang-restarted", [])):
        (job_id,), run_dir, log_dir = submit_training(tmp_path, name, corpus, monkeypatch,
                                                      extra=extra + more)
        jobs[name] = job_id, run_dir, log_dir
    # Each is stopped as soon as it has trained 3 steps (well before its checkpoint at 10).
    stopped_at = {}
    deadline = time.monotonic() + 180
    while len(stopped_at) < len(jobs):
        for name, (job_id, run_dir, log_dir) in jobs.items():
            steps = [r["step"] for r in read_metrics(run_dir, "train")]
            if name not in stopped_at and max(steps, default=0) >= 3:
                os.kill(non_lock_holder(run_dir)[1], signal.SIGSTOP)
                stopped_at[name] = time.monotonic()
            info = cluster.job_info(job_id)
            assert info is not None and info.state in ("PENDING", "CONFIGURING", "RUNNING"), (
                f"{info}\n{log_text(log_dir, name, job_id)}")
        assert time.monotonic() < deadline, stopped_at
        time.sleep(0.1)
    timed_out = (r"\[rank0\] ERROR tape_train\.train: rank 0: a collective timed out in step "
                 r"\d+ \(train\.collective_timeout_s=20 s\)")

    job_id, run_dir, log_dir = jobs["hang"]
    info = cluster.wait_for_job(job_id, timeout=240)
    elapsed = time.monotonic() - stopped_at["hang"]
    text = log_text(log_dir, "hang", job_id)
    assert info.state == "FAILED" and info.restart_count == 0, f"{info.raw}\n{text}"
    assert re.search(timed_out, text), text
    assert "is stuck:" not in text          # the stopped rank could not report
    assert "restart 1 of" not in text
    # The collective timeout (20 s), then srun --wait (10 + 60 s) for the stopped node.
    assert 20 < elapsed < 20 + 70 + 60, (elapsed, text)
    print(f"stopped rank, no restarts: job ended {elapsed:.0f} s after the SIGSTOP")

    job_id, run_dir, log_dir = jobs["hang-restarted"]
    info = cluster.wait_for_job(job_id, timeout=240)
    elapsed = time.monotonic() - stopped_at["hang-restarted"]
    text = log_text(log_dir, "hang-restarted", job_id)
    print(f"stopped rank, restarts: job completed {elapsed:.0f} s after the SIGSTOP")
    assert info.state == "COMPLETED" and info.restart_count == 0, f"{info.raw}\n{text}"
    assert re.search(timed_out, text), text
    assert re.search(r"restart 1 of 3 \(job \d+:0\): attempt 0 ended: rank 1 \(node ttnode\d, "
                     r"pid \d+\) ended without a word.*; then rank 0 \(node ttnode\d, pid \d+\): "
                     r"rank 0: a collective timed out", text), text
    assert_uninterrupted_losses(cluster, training_jobs, run_dir, 0)


# Runs under torchrun in place of tape-train: the real trainer, but rank 1 fails at step 2 of
# every attempt (a deterministic bug).
CRASHING_TRAINER = '''
import os, sys
from tape_train.train import loop
real_step = loop.Trainer.train_step
def train_step(self):
    if self.state.step + 1 >= 2 and os.environ["RANK"] == "1":
        raise RuntimeError("injected failure at step 2")
    return real_step(self)
loop.Trainer.train_step = train_step
from tape_train.train.cli import main
sys.exit(main())
'''


def test_a_deterministic_failure_is_restarted_once_not_max_restarts_times(cluster, corpus,
                                                                          tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf_path))
    (tmp_path / "crashing_trainer.py").write_text(CRASHING_TRAINER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(REPO_ROOT)]))
    (job_id,), run_dir, log_dir = submit_training(
        tmp_path, "crashing", corpus, monkeypatch, extra=["--train-module", "crashing_trainer"])
    # The first restart is always taken; the second is refused: attempt 1 saved nothing.
    log = ended_in_job(cluster, job_id, log_dir, "crashing", "FAILED",
                       r"rank 1 \(node ttnode\d, pid \d+\) exited 1 first: RuntimeError: "
                       r"injected failure at step 2")
    assert ("ERROR: NOT restarting: attempt 1 made no progress (newest complete checkpoint "
            "none, as at its start), so the failure looks deterministic; it ended: rank 1") in log
    assert "restart 2 of" not in log and "requeueing job" not in log
    assert log.count("tape-train: world size 2") == 3, log   # attempts 0, 1 and the refused 2


# Runs under torchrun in place of tape-train: the real trainer, each step 0.25 s longer (the
# same computation), so that what an admin does lands mid-run.
SLOW_TRAINER = '''
import sys, time
from tape_train.train import loop
real_step = loop.Trainer.train_step
def train_step(self):
    time.sleep(0.25)
    return real_step(self)
loop.Trainer.train_step = train_step
from tape_train.train.cli import main
sys.exit(main())
'''


def _stopped(pids: list[int]) -> bool:
    """Whether every process in `pids` is stopped (state T in /proc/<pid>/stat)."""
    states = [Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] for pid in pids]
    return all(state == "T" for state in states)


@pytest.mark.timeout(600)  # two 2-node jobs, each waited for up to 240 s
def test_a_suspended_job_runs_on_and_a_downed_node_requeues_it(cluster, corpus, training_jobs,
                                                              tmp_path, monkeypatch):
    # Side by side, two 2-node jobs (train.collective_timeout_s=20, so 10 s per step phase):
    # - `scontrol suspend` for 13 s, then `scontrol resume`: every process is SIGSTOPped and
    #   SIGCONTed; the watchdog must not take the stopped time for a stuck rank (it ended both
    #   ranks, and torchrun restarted them, before the fix): the job completes with no restart
    #   and the uninterrupted losses, bit for bit;
    # - `scontrol update nodename=<its second node> state=down`: Slurm requeues the job
    #   (--requeue) after TERM to its processes; the trainer checkpoints, and the rerun (same job
    #   id, restart 1) resumes from there with the uninterrupted losses.
    # A node set DOWN requeues every job on it: the two jobs get two nodes each, and the
    # earlier training jobs have ended (they have, when the whole module runs).
    for job_id, *_ in training_jobs.values():
        cluster.wait_for_job(job_id, timeout=300)  # records are kept (MinJobAge=7200)
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf_path))
    (tmp_path / "slow_trainer.py").write_text(SLOW_TRAINER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(REPO_ROOT)]))
    extra = ["--train-module", "slow_trainer", "train.collective_timeout_s=20",
             "train.startup_timeout_s=60"]
    jobs = {}
    for name, nodes in (("suspended", cluster.node_names[:2]), ("downed", cluster.node_names[2:4])):
        (job_id,), run_dir, log_dir = submit_training(
            tmp_path, name, corpus, monkeypatch, [*extra, f"--sbatch-arg=--nodelist={','.join(nodes)}"])
        jobs[name] = job_id, run_dir, log_dir
    job_id, run_dir, log_dir = jobs["suspended"]
    wait_for_step(cluster, job_id, run_dir, log_dir, "suspended", 12)
    pids = _trainer_pids(run_dir)
    cluster.run(["scontrol", "suspend", str(job_id)])
    down_id, down_run, down_logs = jobs["downed"]
    wait_for_step(cluster, down_id, down_run, down_logs, "downed", 12)
    node = cluster.run(["scontrol", "show", "hostnames", cluster.job_info(down_id).node_list]
                       ).stdout.split()[-1]
    cluster.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=test"])
    try:
        deadline = time.monotonic() + 30
        while not _stopped(pids):   # Slurm stops the processes within a few seconds
            assert time.monotonic() < deadline, log_text(log_dir, "suspended", job_id)
            time.sleep(0.1)
        time.sleep(13)
        assert cluster.job_info(job_id).state == "SUSPENDED"
        cluster.run(["scontrol", "resume", str(job_id)])
        assert _trainer_pids(run_dir) == pids
    finally:
        cluster.run(["scontrol", "resume", str(job_id)], check=False)
        cluster.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)

    info = cluster.wait_for_job(job_id, timeout=240)
    log = log_text(log_dir, "suspended", job_id)
    assert info.state == "COMPLETED" and info.restart_count == 0, f"{info.raw}\n{log}"
    assert re.search(r"\[rank0\] INFO tape_train\.train: rank 0: this process did not run for "
                     r"1\d s \(a suspended job, SIGSTOP, or a machine too busy to run it\); "
                     r"step \d+ gets that time back", log), log
    assert "is stuck" not in log and "restart 1 of" not in log, log
    assert [e["event"] for e in events(run_dir)].count("resume") == 0
    assert_uninterrupted_losses(cluster, training_jobs, run_dir, MAX_STEPS)

    info = cluster.wait_for_job(down_id, timeout=240)
    log = log_text(down_logs, "downed", down_id)
    assert info.state == "COMPLETED" and info.restart_count == 1, f"{info.raw}\n{log}"
    ctld = (cluster.log_dir / "slurmctld.log").read_text()
    assert f"requeue job JobId={down_id} due to failure of node {node}" in ctld
    evs = events(down_run)
    stop = next(e for e in evs if e["event"] == "stop")
    resume = next(e for e in evs if e["event"] == "resume")
    assert stop["step"] >= 12 and resume["step"] == stop["step"], (evs, log)
    assert resume["slurm_restart_count"] == 1 and "caught SIGTERM" in log
    assert_uninterrupted_losses(cluster, training_jobs, down_run, stop["step"])
