"""The decision logic of launch/slurm/train.sbatch, run by bash with stand-in Slurm commands.

`srun`, `scontrol` and `scancel` are small shell scripts on PATH that record their arguments:
the training "step" waits until it is signalled (or exits with a chosen code), `scancel
--signal` signals it, `scontrol requeue` is recorded. This checks, in about a second per case
and without a cluster, what the script does for every outcome: finished, preempted (USR1),
terminated (TERM), failed, failed preflight, requeue refused, restart limit reached. The same
paths run for real against Slurm in test_slurm_cluster.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tape_train.cluster.render import ClusterOptions, default_template_dir, render_train_script

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

JOB_ID = 4321

FAKE_SRUN = r"""#!/bin/bash
echo "srun $*" >> "$FAKE_DIR/calls"
if [[ "$*" == *tape_train.cluster.preflight* ]]; then
    if [[ -n ${FAKE_PREFLIGHT_BLOCK:-} ]]; then
        touch "$FAKE_DIR/step.running"
        until [[ -e "$FAKE_DIR/release" ]]; do sleep 0.05; done
    fi
    exit "${FAKE_PREFLIGHT_RC:-0}"
fi
echo $$ > "$FAKE_DIR/step.pid"
trap 'echo "step got USR1" >> "$FAKE_DIR/calls"; exit 1' USR1
trap 'echo "step got TERM" >> "$FAKE_DIR/calls"; exit 1' TERM
if [[ -n ${FAKE_TRAIN_RC:-} ]]; then exit "$FAKE_TRAIN_RC"; fi
touch "$FAKE_DIR/step.running"
while :; do sleep 0.05; done
"""
FAKE_SCANCEL = r"""#!/bin/bash
echo "scancel $*" >> "$FAKE_DIR/calls"
for arg in "$@"; do
    case $arg in --signal=*) kill -s "${arg#--signal=}" "$(cat "$FAKE_DIR/step.pid")";; esac
done
"""
FAKE_SCONTROL = r"""#!/bin/bash
echo "scontrol $*" >> "$FAKE_DIR/calls"
case $1 in
    show) printf 'nodeA\nnodeB\n';;
    requeue) exit "${FAKE_REQUEUE_RC:-0}";;
esac
"""


def _fake_slurm_bin(tmp_path: Path) -> Path:
    """A bin/ with stand-ins for srun, scancel and scontrol (put it first on PATH)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL),
                       ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = _fake_slurm_bin(tmp_path)
    opts = ClusterOptions(nodes=2, procs_per_node=2, cpus_per_task=8, signal_grace=120,
                          socket_ifname="lo", max_requeues=3, python="python3",
                          log_dir=str(tmp_path), workdir=str(tmp_path),
                          max_stalled_requeues=0)  # the progress guard is tested on its own below
    script = tmp_path / "train.sbatch"
    script.write_text(render_train_script((default_template_dir() / "train.sbatch").read_text(),
                                          opts, ["--config", "run.yaml", "train.max_steps=5"]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FAKE_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", FAKE_DIR=str(tmp_path),
               SLURM_JOB_ID=str(JOB_ID), SLURM_NNODES="2", SLURM_JOB_NODELIST="node[A-B]",
               SLURM_CPUS_PER_TASK="8")
    return tmp_path, script, env


def run_script(fake_slurm, send: signal.Signals | None = None, **env_extra):
    """Run the batch script; with `send`, deliver it to the shell once the step is running.
    Returns (exit code, recorded calls, output)."""
    tmp_path, script, env = fake_slurm
    env = {**env, **{k: str(v) for k, v in env_extra.items()}}
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        if send is not None:
            deadline = time.monotonic() + 20
            while not (tmp_path / "step.running").exists():
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "the training step never started"
                time.sleep(0.02)
            proc.send_signal(send)
            time.sleep(0.2)                         # let the trap run before the step ends
            (tmp_path / "release").touch()          # lets a blocked preflight step finish
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() \
        else []
    return proc.returncode, calls, output


def test_finished_training_exits_0_without_requeue(fake_slurm):
    rc, calls, out = run_script(fake_slurm, FAKE_TRAIN_RC=0)
    assert rc == 0, out
    assert not any(c.startswith("scontrol requeue") for c in calls)
    preflight, train = [c for c in calls if c.startswith("srun")]
    assert ("--gpus-per-node 0 --min-free-gb 10.0 --procs-per-node 2 --train-module "
            "tape_train.train.cli -- --config run.yaml train.max_steps=5" in preflight)
    for part in ("--ntasks-per-node=1", "--cpus-per-task=8", "--nnodes=2", "--nproc_per_node=2",
                 "--master_addr=nodeA", f"--master_port={15000 + JOB_ID % 15000}",
                 "--signals_to_handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
                 "--shutdown_timeout=120", "--wait=180",
                 "-m tape_train.train.cli --config run.yaml train.max_steps=5"):
        assert part in train, part
    assert "OMP_NUM_THREADS=4" in out        # 8 CPUs shared by 2 processes
    assert "training finished (exit 0)" in out


def test_usr1_is_forwarded_then_the_job_requeues(fake_slurm):
    rc, calls, out = run_script(fake_slurm, send=signal.SIGUSR1)
    assert rc == 0, out
    assert f"scancel --signal=USR1 {JOB_ID}" in calls
    assert "step got USR1" in calls
    # The requeue comes after the step has ended, never while it may be writing a checkpoint.
    assert calls.index(f"scontrol requeue {JOB_ID}") > calls.index("step got USR1")
    assert "requeueing job" in out


def test_usr1_when_requeue_is_refused_exits_75(fake_slurm):
    rc, calls, out = run_script(fake_slurm, send=signal.SIGUSR1, FAKE_REQUEUE_RC=1)
    assert rc == 75, out
    assert "scontrol requeue failed" in out


def test_usr1_at_the_restart_limit_does_not_requeue(fake_slurm):
    rc, calls, out = run_script(fake_slurm, send=signal.SIGUSR1, SLURM_RESTART_COUNT=3)
    assert rc == 75, out
    assert not any(c.startswith("scontrol requeue") for c in calls)
    assert "NOT requeueing: restart count 3 reached TAPE_MAX_REQUEUES=3" in out


def test_term_is_forwarded_but_not_requeued(fake_slurm):
    rc, calls, out = run_script(fake_slurm, send=signal.SIGTERM)
    assert rc == 1, out
    assert f"scancel --signal=TERM {JOB_ID}" in calls and "step got TERM" in calls
    assert not any(c.startswith("scontrol requeue") for c in calls)


def test_failed_training_without_a_signal_is_not_requeued(fake_slurm):
    rc, calls, out = run_script(fake_slurm, FAKE_TRAIN_RC=1)
    assert rc == 1, out
    assert not any(c.startswith("scontrol requeue") for c in calls)
    assert "training failed (exit 1); not requeueing" in out


def test_trainer_exit_75_without_our_signal_requeues(fake_slurm):
    # The steps were signalled directly (e.g. `scancel --signal=USR1 <job>`): the trainer's own
    # 75 is enough to requeue.
    rc, calls, out = run_script(fake_slurm, FAKE_TRAIN_RC=75)
    assert rc == 0, out
    assert f"scontrol requeue {JOB_ID}" in calls


def test_failed_preflight_stops_before_training(fake_slurm):
    rc, calls, out = run_script(fake_slurm, FAKE_PREFLIGHT_RC=1)
    assert rc == 1, out
    assert len([c for c in calls if c.startswith("srun")]) == 1
    assert "start-up checks failed" in out


def test_usr1_during_the_start_up_checks_requeues_without_training(fake_slurm):
    rc, calls, out = run_script(fake_slurm, send=signal.SIGUSR1, FAKE_PREFLIGHT_BLOCK=1)
    assert rc == 0, out
    # Not forwarded (the checks would die of it), no training step, requeued afterwards.
    assert not any(c.startswith("scancel") for c in calls)
    assert len([c for c in calls if c.startswith("srun")]) == 1
    assert f"scontrol requeue {JOB_ID}" in calls
    assert "before training started" in out


def test_outside_slurm_the_script_refuses_to_run(fake_slurm):
    tmp_path, script, env = fake_slurm
    env = {k: v for k, v in env.items() if k != "SLURM_JOB_ID"}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "not inside a Slurm job" in proc.stderr


# ----------------------------------------------------------------------------------------------
# Requeue without progress (tape_train.cluster.requeue_guard, run for real by the script)
# ----------------------------------------------------------------------------------------------


def _complete_checkpoint(run_dir, step):
    import json

    tag = run_dir / "checkpoints" / f"step_{step:08d}"
    tag.mkdir(parents=True)
    (tag / "shard.pt").write_bytes(b"x" * 8)
    (tag / "COMPLETE.json").write_text(json.dumps({"step": step, "files": {"shard.pt": 8}}))


def test_requeue_guard_counts_restarts_without_a_new_checkpoint(tmp_path):
    from tape_train.cluster.requeue_guard import decide

    run = tmp_path / "run"
    assert decide(run, "9", "0", 2)[0]                   # nothing saved yet: 1 of 2
    requeue, why = decide(run, "9", "1", 2)
    assert not requeue and "2 consecutive restarts added no checkpoint" in why
    # Negative control: a restart that saved a checkpoint resets the count.
    _complete_checkpoint(run, 5)
    assert decide(run, "9", "2", 2) == (True, f"progress: newest checkpoint step_00000005 in {run}")
    assert decide(run, "9", "3", 2)[0]                   # 1 of 2 again
    _complete_checkpoint(run, 10)
    assert decide(run, "9", "4", 2)[0] and decide(run, "9", "5", 2)[0]
    assert not decide(run, "9", "6", 2)[0]
    # A new job on the same run directory starts its own count.
    assert decide(run, "10", "0", 2)[0]


@pytest.mark.slow
@pytest.mark.parametrize("progress", [False, True])
def test_job_stops_requeueing_after_restarts_without_progress(tmp_path, progress):
    bin_dir = _fake_slurm_bin(tmp_path)
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text("model: {base: tiny}\ntrain: {synthetic_data: true}\n")
    import sys

    opts = ClusterOptions(nodes=1, procs_per_node=1, cpus_per_task=2, max_requeues=100,
                          max_stalled_requeues=2, python=sys.executable, log_dir=str(tmp_path),
                          workdir=str(tmp_path))
    script = tmp_path / "train.sbatch"
    script.write_text(render_train_script((default_template_dir() / "train.sbatch").read_text(),
                                          opts, ["--config", str(config),
                                                 f"train.run_dir={run_dir}"]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FAKE_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", FAKE_DIR=str(tmp_path),
               SLURM_JOB_ID=str(JOB_ID), SLURM_NNODES="1", SLURM_JOB_NODELIST="nodeA",
               SLURM_CPUS_PER_TASK="2", FAKE_TRAIN_RC="75")   # every incarnation: stop, requeue
    outputs = []
    for restart in range(3):
        if progress:
            _complete_checkpoint(run_dir, 10 * (restart + 1))
        result = subprocess.run(["bash", str(script)], env={**env, "SLURM_RESTART_COUNT":
                                str(restart)}, capture_output=True, text=True, timeout=120)
        outputs.append((result.returncode, result.stdout + result.stderr))
    requeues = (tmp_path / "calls").read_text().count(f"scontrol requeue {JOB_ID}")
    if progress:  # negative control: every incarnation added a checkpoint, so it requeues
        assert [rc for rc, _ in outputs] == [0, 0, 0] and requeues == 3, outputs
        return
    assert [rc for rc, _ in outputs] == [0, 75, 75] and requeues == 1, outputs
    assert "NOT requeueing: 2 consecutive restarts added no checkpoint" in outputs[1][1]
