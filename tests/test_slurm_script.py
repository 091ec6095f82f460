"""The decision logic of launch/slurm/train.sbatch, run by bash with stand-in Slurm commands.

`srun`, `scontrol` and `scancel` are small shell scripts on PATH that record their arguments:
the training "step" waits until it is signalled (or exits with a chosen code), `scancel
--signal` signals it, `scontrol requeue` is recorded. This checks, in about a second per case
and without a cluster, what the script does for every outcome: finished, preempted (USR1),
terminated (TERM), failed, failed preflight, requeue refused, restart limit reached. The same
paths run for real against Slurm in test_slurm_cluster.py.
"""

from __future__ import annotations

import json
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
# How many tasks Slurm starts: srun's --ntasks, else SLURM_NTASKS of the job (srun's input
# variable; an option on the command line wins over it), else one per node.
tasks=${SLURM_NTASKS:-$SLURM_NNODES}
for arg in "$@"; do [[ $arg == --ntasks=* ]] && tasks=${arg#--ntasks=}; done
echo "$tasks" >> "$FAKE_DIR/step.tasks"
if [[ "$*" == *tape_train.cluster.preflight* ]]; then
    if [[ -n ${FAKE_PREFLIGHT_BLOCK:-} ]]; then
        touch "$FAKE_DIR/step.running"
        until [[ -e "$FAKE_DIR/release" ]]; do sleep 0.05; done
    fi
    exit "${FAKE_PREFLIGHT_RC:-0}"
fi
for arg in "$@"; do [[ $arg == --job-name=* ]] && echo "${arg#--job-name=}" > "$FAKE_DIR/step.name"; done
echo $$ > "$FAKE_DIR/step.pid"
echo "${PYTORCH_CUDA_ALLOC_CONF-<unset>} ${PYTORCH_ALLOC_CONF-<unset>}" > "$FAKE_DIR/step.alloc_conf"
# FAKE_STOP_HOLD: a stop takes until $FAKE_DIR/release exists (the trainer's checkpoint).
hold() { [[ -z ${FAKE_STOP_HOLD:-} ]] || until [[ -e "$FAKE_DIR/release" ]]; do sleep 0.05; done; }
trap 'echo "step got USR1" >> "$FAKE_DIR/calls"; hold; exit 1' USR1
trap 'echo "step got TERM" >> "$FAKE_DIR/calls"; hold; exit 1' TERM
if [[ -n ${FAKE_TRAIN_RC:-} ]]; then exit "$FAKE_TRAIN_RC"; fi
touch "$FAKE_DIR/step.running"
while :; do sleep 0.05; done
"""
# FAKE_SCANCEL_RC: scancel refuses (as while Slurm ends the job), the step signalled all the same
# (by Slurm itself, then).
FAKE_SCANCEL = r"""#!/bin/bash
echo "scancel $*" >> "$FAKE_DIR/calls"
for arg in "$@"; do
    case $arg in --signal=*) kill -s "${arg#--signal=}" "$(cat "$FAKE_DIR/step.pid")";; esac
done
exit "${FAKE_SCANCEL_RC:-0}"
"""
# squeue --steps: the job's batch and extern steps, and once the training "step" runs (after
# FAKE_SQUEUE_LATE more calls, as while srun registers it) step 1 under its srun --job-name.
# FAKE_SQUEUE_RC: squeue fails with an error instead. A SQUEUE_PARTITION in the environment
# hides everything, as another partition's filter would.
FAKE_SQUEUE = r"""#!/bin/bash
echo "squeue $*" >> "$FAKE_DIR/calls"
[[ -n ${SQUEUE_PARTITION:-} ]] && exit 0
if [[ -n ${FAKE_SQUEUE_RC:-} ]]; then
    echo "squeue: error: Unable to contact slurm controller (connect failure)" >&2
    exit "$FAKE_SQUEUE_RC"
fi
for arg in "$@"; do [[ $arg == --jobs=* ]] && job=${arg#--jobs=}; done
echo "$job.batch batch"
echo "$job.extern extern"
asked=$(grep -c '^squeue' "$FAKE_DIR/calls")
if [[ -e "$FAKE_DIR/step.pid" ]] && (( asked > ${FAKE_SQUEUE_LATE:-0} )); then
    echo "$job.1 $(cat "$FAKE_DIR/step.name")"
fi
"""
# The interpreter: torchrun's --help (all options unless FAKE_TORCHRUN_HELP says otherwise) and
# the restart verdict (FAKE_VERDICT_RC: 0 none, 3 fail, 4 requeue).
FAKE_PYTHON = r"""#!/bin/bash
echo "python $*" >> "$FAKE_DIR/calls"
case "$*" in
    "-m torch.distributed.run --help")
        if [[ -n ${FAKE_HELP_BLOCK:-} ]]; then   # a signal may come now, before training
            touch "$FAKE_DIR/step.running"
            until [[ -e "$FAKE_DIR/release" ]]; do sleep 0.05; done
        fi
        echo "${FAKE_TORCHRUN_HELP:---max-restarts --signals-to-handle --shutdown-timeout}"
        exit "${FAKE_HELP_RC:-0}";;
    "-m tape_train.cluster.requeue_guard --restart-verdict"*)
        echo "${FAKE_VERDICT:-}"; exit "${FAKE_VERDICT_RC:-0}";;
esac
exit 99
"""
# `show node`: a node's NodeAddr is its name unless FAKE_NODE_ADDR says otherwise, as Slurm
# does without NodeAddr= in slurm.conf; FAKE_NODE_INFO replaces the whole answer and
# FAKE_NODE_INFO_RC is its exit code.
FAKE_SCONTROL = r"""#!/bin/bash
echo "scontrol $*" >> "$FAKE_DIR/calls"
case "$*" in
    "--oneliner show node "*)
        if [[ -n ${FAKE_NODE_INFO+set} ]]; then
            [[ -z $FAKE_NODE_INFO ]] || echo "$FAKE_NODE_INFO"
            exit "${FAKE_NODE_INFO_RC:-0}"
        fi
        echo "NodeName=$4 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUTot=4" \
            "NodeAddr=${FAKE_NODE_ADDR:-$4} NodeHostName=$4 Version=22.05.8 OS=Linux";;
    show*) [[ -n ${FAKE_NO_HOSTS:-} ]] || printf 'nodeA\nnodeB\n';;
    requeue*) exit "${FAKE_REQUEUE_RC:-0}";;
esac
"""


def _fake_slurm_bin(tmp_path: Path) -> Path:
    """A bin/ with stand-ins for srun, scancel, squeue and scontrol (put it first on PATH)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL), ("squeue", FAKE_SQUEUE),
                       ("scontrol", FAKE_SCONTROL), ("fakepython", FAKE_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = _fake_slurm_bin(tmp_path)
    opts = ClusterOptions(nodes=2, procs_per_node=2, cpus_per_task=8, signal_grace=120,
                          socket_ifname="lo", max_requeues=3,
                          python=str(bin_dir / "fakepython"),
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
                 "--max_restarts=3", "--rdzv_backend=c10d", "--rdzv_id=4321",
                 f"--rdzv_endpoint=nodeA:{15000 + JOB_ID}",
                 '--rdzv_conf=is_host=$([[ $SLURMD_NODENAME == "$TAPE_RDZV_NODE" ]] '
                 '&& echo 1 || echo 0)',
                 "--signals_to_handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
                 "--shutdown_timeout=120", "--wait=180",
                 "-m tape_train.train.cli --config run.yaml train.max_steps=5"):
        assert part in train, part
    assert "WARNING" not in out
    # torchrun's options asked once, before training; the restart verdict read after it.
    asked = [c for c in calls if c.startswith("python")]
    assert [c.split(" --")[0] for c in asked] == [
        "python -m torch.distributed.run", "python -m tape_train.cluster.requeue_guard"], asked
    assert "OMP_NUM_THREADS=4" in out        # 8 CPUs shared by 2 processes
    assert "training finished (exit 0)" in out


@pytest.mark.parametrize("asked", [None, "2"])
def test_one_task_per_node_whatever_tasks_the_job_asked_for(fake_slurm, asked):
    """`sbatch -N2 --ntasks-per-node=2 train.sbatch` (or --ntasks=4) exports SLURM_NTASKS=4,
    which srun takes as its --ntasks and then ignores --ntasks-per-node=1: on the real cluster
    two torchruns per node fought over the rendezvous port and the job failed. Each step now
    runs one task per node, and the script says how processes per node are set. Without
    SLURM_NTASKS (and SLURM_NTASKS_PER_NODE) there is nothing to say."""
    extra = {} if asked is None else {"SLURM_NTASKS": 4, "SLURM_NTASKS_PER_NODE": asked}
    rc, calls, out = run_script(fake_slurm, FAKE_TRAIN_RC=0, **extra)
    assert rc == 0, out
    tmp_path = fake_slurm[0]
    assert (tmp_path / "step.tasks").read_text().split() == ["2", "2"], calls  # preflight, train
    warned = ("WARNING: the job asked for 4 tasks on 2 node(s) (--ntasks-per-node/--ntasks); "
              "this script runs one task per node, a torchrun with 2 trainer process(es)")
    assert (warned in out) == (asked is not None), out


def test_the_cuda_allocator_setting_is_left_to_the_trainer_or_the_user(tmp_path):
    """On GPU nodes the script exports no allocator setting (each rank applies
    train.cuda_expandable_segments itself); one exported at submission reaches the training
    step unchanged (and then wins over that key)."""
    bin_dir = _fake_slurm_bin(tmp_path)
    opts = ClusterOptions(nodes=2, gpus_per_node=4, cpus_per_task=8,
                          python=str(bin_dir / "fakepython"), log_dir=str(tmp_path),
                          workdir=str(tmp_path), max_stalled_requeues=0)
    script = tmp_path / "train.sbatch"
    script.write_text(render_train_script((default_template_dir() / "train.sbatch").read_text(),
                                          opts, ["--config", "run.yaml"]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FAKE_"))
           and k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", FAKE_DIR=str(tmp_path),
               SLURM_JOB_ID=str(JOB_ID), SLURM_NNODES="2", SLURM_JOB_NODELIST="node[A-B]",
               SLURM_CPUS_PER_TASK="8")
    for exported, seen in ((None, "<unset> <unset>"),
                           ("max_split_size_mb:64", "max_split_size_mb:64 <unset>")):
        extra = {} if exported is None else {"PYTORCH_CUDA_ALLOC_CONF": exported}
        rc, calls, out = run_script((tmp_path, script, env), FAKE_TRAIN_RC=0, **extra)
        assert rc == 0, out
        assert "--nproc_per_node=4" in [c for c in calls if c.startswith("srun")][-1]
        assert (tmp_path / "step.alloc_conf").read_text().strip() == seen


def test_usr1_is_forwarded_then_the_job_requeues(fake_slurm):
    # A user's squeue filter (SQUEUE_PARTITION) would hide the step: not passed to squeue.
    rc, calls, out = run_script(fake_slurm, send=signal.SIGUSR1, SQUEUE_PARTITION="elsewhere")
    assert rc == 0, out
    # To the training step alone, found by its srun --job-name: not the job's extern step.
    assert "--job-name=tape-training" in [c for c in calls if c.startswith("srun")][1]
    assert f"squeue --noheader --steps --jobs={JOB_ID} --format=%i %j" in calls
    assert f"scancel --signal=USR1 {JOB_ID}.1" in calls
    assert not any(c.startswith(f"scancel --signal=USR1 {JOB_ID}") and
                   c != f"scancel --signal=USR1 {JOB_ID}.1" for c in calls), calls
    assert "step got USR1" in calls
    assert f"caught SIGUSR1; forwarding it to the training step {JOB_ID}.1 so the trainer " \
           "checkpoints and stops" in out
    assert "WARNING" not in out
    # The requeue comes after the step has ended, never while it may be writing a checkpoint.
    assert calls.index(f"scontrol requeue {JOB_ID}") > calls.index("step got USR1")
    assert "requeueing job" in out
    # A stop is a stop: no restart verdict is asked for, whatever the trainer recorded.
    assert not any("--restart-verdict" in c for c in calls)


def test_further_signals_are_not_forwarded_while_the_step_stops(fake_slurm):
    """A preemption tool that sends USR1 again (`scancel --signal=USR1 --batch` twice, or a
    warning on top of it) must not signal the step again: torchrun takes a second signal during
    its wait for the workers as a reason to send them SIGTERM, and a third ends that wait, so the
    node's task exits and Slurm (proctrack/cgroup) kills the workers in mid-checkpoint."""
    tmp_path, script, env = fake_slurm
    log = tmp_path / "out.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", str(script)], env={**env, "FAKE_STOP_HOLD": "1"},
                                stdout=out, stderr=subprocess.STDOUT, text=True)
    calls = tmp_path / "calls"

    def wait_for(what, path, count=1):
        deadline = time.monotonic() + 20
        while not (path.exists() and path.read_text().count(what) >= count):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)

    try:
        wait_for("", tmp_path / "step.running")
        proc.send_signal(signal.SIGUSR1)
        wait_for("step got USR1", calls)           # forwarded; the step is "checkpointing"
        for count in (2, 3):
            proc.send_signal(signal.SIGUSR1)
            wait_for("caught SIGUSR1", log, count)
        (tmp_path / "release").touch()
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = calls.read_text()
    assert text.count(f"scancel --signal=USR1 {JOB_ID}") == 1, text
    assert f"scancel --signal=USR1 {JOB_ID}.1" in text
    assert f"scontrol requeue {JOB_ID}" in text
    assert log.read_text().count("already forwarded") == 2, log.read_text()


def test_an_array_task_signals_and_requeues_only_itself(fake_slurm):
    """One task of an array has the array's id as its own SLURM_JOB_ID, and to scancel and
    scontrol that id means every task of the array (measured, Slurm 22.05: a requeue from that
    task reran the finished tasks too, a forwarded USR1 reached every task's step). The task
    is addressed as <array id>_<task id>, its training step as <array id>_<task id>.<step>
    (how squeue --steps lists it, measured)."""
    rc, calls, out = run_script(fake_slurm, send=signal.SIGUSR1,
                                SLURM_ARRAY_JOB_ID=str(JOB_ID), SLURM_ARRAY_TASK_ID="3")
    assert rc == 0, out
    assert f"squeue --noheader --steps --jobs={JOB_ID}_3 --format=%i %j" in calls, calls
    assert f"scancel --signal=USR1 {JOB_ID}_3.1" in calls, calls
    assert f"scontrol requeue {JOB_ID}_3" in calls, calls


def test_a_step_not_yet_registered_is_waited_for(fake_slurm):
    """The signal may come while srun is still having its step created: squeue lists only the
    batch and extern steps then. The script asks again (once a second) until the step is
    there, and signals that step, not the job."""
    rc, calls, out = run_script(fake_slurm, send=signal.SIGUSR1, FAKE_SQUEUE_LATE=2)
    assert rc == 0, out
    lookups = [c for c in calls if c.startswith("squeue")]
    assert len(lookups) == 3, calls
    assert f"scancel --signal=USR1 {JOB_ID}.1" in calls and "step got USR1" in calls
    assert "WARNING" not in out


@pytest.mark.parametrize("failure", ["squeue fails", "no step of that name"])
def test_when_the_step_is_not_found_the_stop_goes_to_the_whole_job(fake_slurm, failure):
    """Negative control: without the step's id the stop is not lost. It goes to every step of
    the job, as before the lookup existed, with one line saying so and why."""
    tmp_path, script, env = fake_slurm
    if failure == "squeue fails":
        extra = {"FAKE_SQUEUE_RC": 1}
        why = ("squeue failed: squeue: error: Unable to contact slurm controller "
               "(connect failure)")
    else:   # e.g. a Slurm whose squeue shows the name otherwise: waited for, then given up
        script.write_text(script.read_text().replace("STEP_LOOKUP_WAIT=30", "STEP_LOOKUP_WAIT=2"))
        extra = {"FAKE_SQUEUE_LATE": 1000}
        why = f"squeue lists no step named tape-training in job {JOB_ID} after 2 s"
    rc, calls, out = run_script(fake_slurm, send=signal.SIGUSR1, **extra)
    assert rc == 0, out
    scancels = [c for c in calls if c.startswith("scancel")]
    assert scancels == [f"scancel --signal=USR1 {JOB_ID}"], calls
    assert "step got USR1" in calls and f"scontrol requeue {JOB_ID}" in calls
    warnings = [line for line in out.splitlines() if "WARNING" in line]
    assert len(warnings) == 1, out
    assert warnings[0].endswith(
        f"caught SIGUSR1; WARNING: the training step was not found ({why}): forwarding SIGUSR1 "
        f"to every step of job {JOB_ID} instead, the extern step included"), warnings


def test_a_stop_before_the_training_step_has_started_reaches_it(fake_slurm):
    """USR1 after the start-up checks but before the training srun has started (here: while
    torchrun's options are asked for) is forwarded as soon as that srun runs, so the trainer
    stops at once instead of training on."""
    rc, calls, out = run_script(fake_slurm, send=signal.SIGUSR1, FAKE_HELP_BLOCK=1)
    assert rc == 0, out
    assert "caught SIGUSR1 while the training step starts; forwarding it once srun runs" in out
    assert f"SIGUSR1 came before the training step: forwarding it to the training step " \
           f"{JOB_ID}.1" in out
    assert f"scancel --signal=USR1 {JOB_ID}.1" in calls and "step got USR1" in calls
    assert calls.index(f"scontrol requeue {JOB_ID}") > calls.index("step got USR1")


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
    assert f"scancel --signal=TERM {JOB_ID}.1" in calls and "step got TERM" in calls
    assert not any(c.startswith("scontrol requeue") for c in calls)
    # The log's last line says what to do next: a plain scancel is not run again by Slurm.
    last = out.strip().splitlines()[-1]
    assert "stopped by SIGTERM (step exit code 1); not requeueing from the script" in last
    assert "resubmit the same command (or sbatch this script again) to resume from the " \
           "newest complete checkpoint" in last and "--eval-after" in last


def test_a_refused_term_forward_is_no_warning_but_a_refused_usr1_forward_is(fake_slurm):
    """scancel of the job: Slurm sends its own TERM to the batch shell and the steps, and
    refuses the script's forward to a step it is ending (`Invalid job id specified`,
    measured). That is said as such, not as a WARNING; a refused USR1 forward still is one."""
    rc, calls, out = run_script(fake_slurm, send=signal.SIGTERM, FAKE_SCANCEL_RC=1)
    assert rc == 1 and "step got TERM" in calls, out
    assert "scancel --signal=TERM of the training step was refused; Slurm, which is ending " \
           "the job, signals the step itself" in out
    assert "WARNING" not in out, out
    for name in ("calls", "step.pid", "step.running", "release"):   # a second run, afresh
        (fake_slurm[0] / name).unlink()
    rc, calls, out = run_script(fake_slurm, send=signal.SIGUSR1, FAKE_SCANCEL_RC=1)
    assert "WARNING: scancel --signal=USR1 failed" in out, out


def test_no_rendezvous_host_ends_the_job_before_any_step(fake_slurm):
    rc, calls, out = run_script(fake_slurm, FAKE_TRAIN_RC=0, FAKE_NO_HOSTS=1)
    assert rc == 1, out
    assert "ERROR: `scontrol show hostnames node[A-B]` named no node: no rendezvous host" in out
    assert not any(c.startswith("srun") for c in calls), calls


def test_failed_training_without_a_signal_is_not_requeued(fake_slurm):
    rc, calls, out = run_script(fake_slurm, FAKE_TRAIN_RC=1)
    assert rc == 1, out
    assert not any(c.startswith("scontrol requeue") for c in calls)
    assert "training failed (exit 1); not requeueing" in out


def test_trainer_exit_75_without_our_signal_requeues(fake_slurm):
    # The steps were signalled directly (e.g. `scancel --signal=USR1 <job>`): each node's
    # wrapper turns torchrun's exit 1 after a USR1 into 75 (tested on the real cluster), and
    # the step's 75 alone is enough to requeue.
    rc, calls, out = run_script(fake_slurm, FAKE_TRAIN_RC=75)
    assert rc == 0, out
    assert f"scontrol requeue {JOB_ID}" in calls


@pytest.mark.parametrize("step_rc", [1, 143])
def test_failed_preflight_stops_before_training(fake_slurm, step_rc):
    # 143: srun's exit when the other node, still checking, was ended by --kill-on-bad-exit
    # (measured, 2 nodes): the job ended FAILED 143:0 as if SIGTERMed. It is the checks' 1.
    rc, calls, out = run_script(fake_slurm, FAKE_PREFLIGHT_RC=step_rc)
    assert rc == 1, out
    assert len([c for c in calls if c.startswith("srun")]) == 1
    assert f"start-up checks failed on at least one node (exit {step_rc})" in out


def test_usr1_during_the_start_up_checks_requeues_without_training(fake_slurm):
    rc, calls, out = run_script(fake_slurm, send=signal.SIGUSR1, FAKE_PREFLIGHT_BLOCK=1)
    assert rc == 0, out
    # Not forwarded (the checks would die of it), no training step, requeued afterwards.
    assert not any(c.startswith("scancel") for c in calls)
    assert len([c for c in calls if c.startswith("srun")]) == 1
    assert f"scontrol requeue {JOB_ID}" in calls
    assert "before training started" in out


# srun that runs the training step's command once per node of the job, as Slurm does: the node
# names and node ids (SLURM_NODEID) are FAKE_NODES' ("name:id ...").
# As Slurm does, the steps get only SLURM_* variables when the job was submitted with
# --export=NONE (SLURM_EXPORT_ENV=NONE in the job), unless srun is given --export=ALL.
PER_NODE_SRUN = r"""#!/bin/bash
echo "srun $*" >> "$FAKE_DIR/calls"
[[ "$*" == *tape_train.cluster.preflight* ]] && exit 0
env=(env)
if [[ ${SLURM_EXPORT_ENV:-ALL} == NONE && " $* " != *" --export=ALL "* ]]; then
    env=(env -i FAKE_DIR="$FAKE_DIR" $(env | grep '^SLURM_'))
fi
while [[ $1 == --* ]]; do shift; done
for node in $FAKE_NODES; do
    "${env[@]}" SLURMD_NODENAME=${node%:*} SLURM_NODEID=${node#*:} "$@" >> "$FAKE_DIR/step.out" 2>&1
done
exit 0
"""


@pytest.mark.parametrize("nodes, export", [("nodeA:0 nodeB:1", "ALL"), ("nodeB:0 nodeA:1", "ALL"),
                                           ("nodeA:0 nodeB:1", "NONE")])
def test_the_rendezvous_is_hosted_on_the_node_it_names(fake_slurm, nodes, export):
    """The endpoint is the first host of the sorted SLURM_JOB_NODELIST (nodeA); the node of that
    name hosts the store, whatever its SLURM_NODEID. Slurm numbers a step's nodes in its node
    table's order, which a topology plugin may rank otherwise than by name (topology/block,
    tree with SwitchAsNodeRank): with is_host on node id 0, nodeB would host a store nobody
    connects to, and nodeA's torchrun would wait for one nobody serves. A job submitted with
    --export=NONE (a site's SBATCH_EXPORT=NONE) passes that on to every srun in it: the steps
    must be given the script's environment (MASTER_ADDR here; PATH: on the test cluster they
    failed with `execve(): bash: No such file or directory`)."""
    tmp_path, script, env = fake_slurm
    (tmp_path / "bin" / "srun").write_text(PER_NODE_SRUN)
    rc, calls, out = run_script(fake_slurm, FAKE_NODES=nodes, SLURM_EXPORT_ENV=export)
    assert rc == 0, out
    runs = [c for c in calls if c.startswith("python -m torch.distributed.run --rdzv_conf")]
    assert len(runs) == 2, calls
    hosts = {name: run.split()[3] for name, run in zip(
        [n.split(":")[0] for n in nodes.split()], runs)}
    assert hosts == {"nodeA": "--rdzv_conf=is_host=1", "nodeB": "--rdzv_conf=is_host=0"}, runs
    assert all(f"--rdzv_endpoint=nodeA:{15000 + JOB_ID}" in run for run in runs)


@pytest.mark.parametrize("addr, endpoint", [("10.1.2.3", "10.1.2.3"),
                                            ("fd00:1::17", "[fd00:1::17]")])
def test_the_rendezvous_is_at_the_first_nodes_nodeaddr(fake_slurm, addr, endpoint):
    """Node names need not resolve by DNS where slurm.conf gives each node a NodeAddr: the
    endpoint is the first node's NodeAddr (an IPv6 one in brackets, as torchrun reads it),
    MASTER_ADDR the bare address; the node of that name still hosts the store."""
    tmp_path, script, env = fake_slurm
    (tmp_path / "bin" / "srun").write_text(PER_NODE_SRUN)
    rc, calls, out = run_script(fake_slurm, FAKE_NODES="nodeB:0 nodeA:1", FAKE_NODE_ADDR=addr)
    assert rc == 0, out
    assert "scontrol --oneliner show node nodeA" in calls
    runs = [c for c in calls if c.startswith("python -m torch.distributed.run --rdzv_conf")]
    assert [run.split()[3] for run in runs] == ["--rdzv_conf=is_host=0",    # nodeB
                                                "--rdzv_conf=is_host=1"], runs  # nodeA
    assert all(f"--rdzv_endpoint={endpoint}:{15000 + JOB_ID} " in run for run in runs), runs
    assert f"master={endpoint}:{15000 + JOB_ID} (node nodeA)" in out
    assert "WARNING" not in out


@pytest.mark.parametrize("help_text, local_addr", [
    ("--max-restarts --signals-to-handle --shutdown-timeout --local-addr", True),
    ("--max-restarts --signals-to-handle --shutdown-timeout", False)])
def test_each_torchrun_publishes_its_nodes_nodeaddr(fake_slurm, help_text, local_addr):
    """torchrun publishes the workers' store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) at global
    rank 0's --local_addr, by default its host name (socket.getfqdn()): the workers of every
    node connected to a name that need not resolve, though the rendezvous was at a NodeAddr.
    Each node's torchrun gets its own NodeAddr (one scontrol query for the allocation)."""
    tmp_path, script, env = fake_slurm
    (tmp_path / "bin" / "srun").write_text(PER_NODE_SRUN)
    info = ("NodeName=nodeA Arch=x86_64 NodeAddr=10.0.0.1 NodeHostName=a Version=22.05.8\n"
            "NodeName=nodeB Arch=x86_64 NodeAddr=fd00::2 NodeHostName=b Version=22.05.8")
    rc, calls, out = run_script(fake_slurm, FAKE_NODES="nodeB:0 nodeA:1", FAKE_NODE_INFO=info,
                                FAKE_TORCHRUN_HELP=help_text)
    assert rc == 0, out
    assert "scontrol --oneliner show node node[A-B]" in calls
    runs = [c for c in calls if c.startswith("python -m torch.distributed.run --rdzv_conf")]
    assert len(runs) == 2 and all(f"--rdzv_endpoint=10.0.0.1:{15000 + JOB_ID} " in run
                                  for run in runs), runs
    if local_addr:
        assert [run.split()[4] for run in runs] == ["--local_addr=fd00::2",     # nodeB
                                                    "--local_addr=10.0.0.1"], runs  # nodeA
    else:  # control: a torchrun without the option is not given it
        assert not any("--local_addr" in run for run in runs), runs


@pytest.mark.parametrize("info, info_rc", [("", 0), ("NodeName=nodeA State=IDLE", 0),
                                           ("slurm_load_node error: Unable to contact slurm "
                                            "controller (connect failure)", 1)])
def test_without_a_nodeaddr_the_rendezvous_is_at_the_node_name(fake_slurm, info, info_rc):
    rc, calls, out = run_script(fake_slurm, FAKE_TRAIN_RC=0, FAKE_NODE_INFO=info,
                                FAKE_NODE_INFO_RC=info_rc)
    assert rc == 0, out
    train = [c for c in calls if c.startswith("srun")][-1]
    assert f"--rdzv_endpoint=nodeA:{15000 + JOB_ID} " in train, train
    assert ("WARNING: `scontrol show node nodeA` gave no NodeAddr (" + info.split("\n")[0]
            + "): the rendezvous is at the node name, which every node must resolve") in out


@pytest.mark.parametrize("job_id, port", [(4321, 19321), (14399, 29399), (14400, 29401),
                                          (14498, 29499), (14499, 29501), (14997, 29999),
                                          (14998, 15000), (14998 + 14400, 29401)])
def test_the_port_from_the_job_id_is_never_a_torchrun_default(fake_slurm, job_id, port):
    """15000 + job id mod 15000 gave jobs 14400 and 14500 the ports 29400 and 29500, torchrun's
    defaults (c10d rendezvous, master), which a torchrun started by hand on the node holds:
    15000-29999 without those two, in the job id's order."""
    rc, calls, out = run_script(fake_slurm, FAKE_TRAIN_RC=0, SLURM_JOB_ID=job_id)
    assert rc == 0, out
    assert f"master=nodeA:{port} (node nodeA)" in out, out


def test_outside_slurm_the_script_refuses_to_run(fake_slurm):
    tmp_path, script, env = fake_slurm
    env = {k: v for k, v in env.items() if k != "SLURM_JOB_ID"}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "not inside a Slurm job" in proc.stderr


def _as_shipped_env(tmp_path: Path) -> dict[str, str]:
    """The environment of train.sbatch submitted as it is: stand-in Slurm commands, a 2-node
    job, no TAPE_* setting but the interpreter's (and no progress guard)."""
    bin_dir = _fake_slurm_bin(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FAKE_", "TAPE_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", FAKE_DIR=str(tmp_path),
               SLURM_JOB_ID=str(JOB_ID), SLURM_NNODES="2", SLURM_JOB_NODELIST="node[A-B]",
               SLURM_CPUS_PER_TASK="8", TAPE_PYTHON=str(bin_dir / "fakepython"),
               FAKE_TRAIN_RC="0", TAPE_MAX_STALLED_REQUEUES="0")
    return env


@pytest.mark.parametrize("setting, value, message", [
    ("TAPE_GPUS_PER_NODE", "abc", "TAPE_GPUS_PER_NODE=abc is not a whole number >= 0"),
    ("TAPE_GPUS_PER_NODE", "08", "TAPE_GPUS_PER_NODE=08 is not a whole number >= 0"),
    ("TAPE_PROCS_PER_NODE", "0", "TAPE_PROCS_PER_NODE=0 is not a whole number >= 1"),
    ("TAPE_SIGNAL_GRACE", "5m", "TAPE_SIGNAL_GRACE=5m is not a whole number >= 1"),
    ("TAPE_MAX_RESTARTS", "-1", "TAPE_MAX_RESTARTS=-1 is not a whole number >= 0"),
    ("TAPE_MAX_STALLED_REQUEUES", "x", "TAPE_MAX_STALLED_REQUEUES=x is not a whole number"),
    ("TAPE_MIN_FREE_GB", "lots", "TAPE_MIN_FREE_GB=lots is not a number of GB >= 0"),
    ("TAPE_MASTER_PORT", "70000", "TAPE_MASTER_PORT=70000 is not a port number (1-65535)"),
])
def test_the_script_used_as_is_checks_its_settings_from_the_environment(tmp_path, setting,
                                                                        value, message):
    """`sbatch launch/slurm/train.sbatch ...` takes its run settings from the environment. A
    word where bash does arithmetic failed mid-job (`abc: unbound variable` after the start-up
    checks had run on every node; TAPE_PROCS_PER_NODE=0 divided by zero): now one line, exit
    2, before any step."""
    env = _as_shipped_env(tmp_path)
    script = default_template_dir() / "train.sbatch"

    def run(**extra):
        proc = subprocess.run(["bash", str(script), "--config", "run.yaml"],
                              env={**env, **extra}, capture_output=True, text=True, timeout=60)
        calls = (tmp_path / "calls").read_text() if (tmp_path / "calls").exists() else ""
        (tmp_path / "calls").unlink(missing_ok=True)
        return proc.returncode, proc.stdout + proc.stderr, calls

    rc, out, calls = run(**{setting: value})
    assert rc == 2 and f"ERROR: {message}" in out, out
    assert "srun" not in calls and "unbound variable" not in out
    # control: the defaults (and a port in range) run the job to its end
    rc, out, calls = run(TAPE_MASTER_PORT="29500")
    assert rc == 0 and "training finished (exit 0)" in out, out
    assert "srun" in calls and "nodeA:29500" in out


@pytest.mark.parametrize("given, slurm_gpus, procs",
                         [(None, "2", 2), ("0", "2", 1), (None, None, 1)])
def test_the_script_used_as_is_runs_one_process_per_gpu_of_the_job(tmp_path, given, slurm_gpus,
                                                                  procs):
    """`sbatch --gpus-per-node=2 launch/slurm/train.sbatch ...` (or --gres=gpu:2): Slurm says
    SLURM_GPUS_ON_NODE=2 (measured on the test cluster with GPU GRES), and the script starts
    one trainer per GPU and checks that the nodes see them. It used to take 0 GPUs: one
    trainer per node on cuda:0 alone while the start-up checks reported a CPU node. An explicit
    TAPE_GPUS_PER_NODE wins; without GPUs from Slurm it stays a CPU job."""
    env = _as_shipped_env(tmp_path)
    if given is not None:
        env["TAPE_GPUS_PER_NODE"] = given
    if slurm_gpus is not None:
        env["SLURM_GPUS_ON_NODE"] = slurm_gpus
    proc = subprocess.run(["bash", str(default_template_dir() / "train.sbatch"), "--config",
                           "run.yaml"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    preflight, train = [c for c in (tmp_path / "calls").read_text().splitlines()
                        if c.startswith("srun")]
    gpus = procs if procs > 1 else 0
    assert f"--gpus-per-node {gpus} --min-free-gb 10 --procs-per-node {procs} " in preflight
    assert f"--nproc_per_node={procs} " in train
    # Each step asks for the node's GPUs itself (a job's --gpus-per-task=1 would give its one
    # task 1 GPU); a CPU job's steps ask for none.
    for step in (preflight, train):
        assert (f"--ntasks-per-node=1 --gpus-per-node={gpus} " in step) is (gpus > 0), step
        assert step.count("--gpus-per-node=") == (gpus > 0), step
    assert f"procs_per_node={procs} gpus_per_node={gpus} " in proc.stdout


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
@pytest.mark.integration
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


# ----------------------------------------------------------------------------------------------
# In-job restarts: torchrun's options, and the trainer's restart verdict
# ----------------------------------------------------------------------------------------------


def test_an_older_torchrun_gets_no_options_it_lacks_and_a_warning_each(fake_slurm):
    # torch 2.11's torchrun has no --shutdown_timeout; a much older one no --signals_to_handle.
    rc, calls, out = run_script(fake_slurm, FAKE_TRAIN_RC=0, FAKE_TORCHRUN_HELP="--max-restarts")
    assert rc == 0, out
    train = [c for c in calls if c.startswith("srun")][1]
    assert "--shutdown_timeout" not in train and "--signals_to_handle" not in train
    assert "--max_restarts=3" in train
    assert ("WARNING: this torchrun has no --shutdown_timeout: workers get 30 s after a signal "
            "to write their checkpoint, not TAPE_SIGNAL_GRACE=120 s") in out
    assert "WARNING: this torchrun has no --signals_to_handle" in out
    # Negative control of the probe: a torchrun with both options gets both (the test above).


def test_a_failing_torchrun_probe_passes_every_option_with_a_warning(fake_slurm):
    rc, calls, out = run_script(fake_slurm, FAKE_TRAIN_RC=0, FAKE_HELP_RC=1,
                                FAKE_TORCHRUN_HELP="No module named torch")
    assert rc == 0, out
    train = [c for c in calls if c.startswith("srun")][1]
    assert "--shutdown_timeout=120" in train and "--signals_to_handle" in train
    assert "--help` failed (No module named torch); passing every option as is" in out


def test_a_refused_restart_fails_the_job_with_the_trainers_reason(fake_slurm):
    # The trainer refused a restart (no progress): every rank exited 0, so torchrun did too.
    why = "NOT restarting: attempt 1 made no progress (newest complete checkpoint none, ...)"
    rc, calls, out = run_script(fake_slurm, FAKE_TRAIN_RC=0, FAKE_VERDICT_RC=3,
                                FAKE_VERDICT=why)
    assert rc == 1, out
    assert f"ERROR: {why}" in out and "training finished" not in out
    assert not any(c.startswith("scontrol requeue") for c in calls)


def test_a_restart_after_a_stop_requeues_instead(fake_slurm):
    # A worker stopped on a signal that torchrun itself did not get (exit 75), and torchrun
    # restarted it: the trainer refuses to go on inside the job, the script requeues.
    rc, calls, out = run_script(fake_slurm, FAKE_TRAIN_RC=0, FAKE_VERDICT_RC=4,
                                FAKE_VERDICT="NOT restarting: attempt 0 stopped on a signal")
    assert rc == 0, out
    assert f"scontrol requeue {JOB_ID}" in calls and "training finished" not in out


def test_without_restarts_no_verdict_is_asked_for(fake_slurm):
    tmp_path, script, env = fake_slurm
    script.write_text(script.read_text().replace("TAPE_MAX_RESTARTS=3\n",
                                                 "TAPE_MAX_RESTARTS=0\n"))
    rc, calls, out = run_script(fake_slurm, FAKE_TRAIN_RC=0, FAKE_VERDICT_RC=3)
    assert rc == 0, out
    assert "--max_restarts=0" in [c for c in calls if c.startswith("srun")][1]
    assert not any("--restart-verdict" in c for c in calls)


def test_restart_guard_takes_the_first_restart_then_only_after_progress(tmp_path, monkeypatch):
    from tape_train.cluster.requeue_guard import main as guard_main
    from tape_train.train import restarts

    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    run = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{base: tiny}}\ntrain: {{run_dir: {run}}}\n")
    verdict = ["--restart-verdict", "--", "--config", str(config)]

    def attempt(expect: int, crash_rank: int | None = None):
        number, refused, line = restarts.begin_attempt(run, world_size=2, max_restarts=5)
        assert number == expect
        for rank in (0, 1):
            restarts.record_rank(run, number, rank)
        if crash_rank is not None:   # the other rank was SIGKILLed: it leaves no exit record
            restarts.record_rank(run, number, 1 - crash_rank, code=1,
                                 reason="a collective failed: another rank exited")
        return refused, line

    assert attempt(0, crash_rank=1) == (None, None)
    refused, line = attempt(1, crash_rank=1)           # the first restart: always, no progress
    assert refused is None and line.startswith("restart 1 of 5 (job 9:0): attempt 0 ended: "
                                               "rank 1 (node ")
    assert "ended without a word: killed by a signal" in line
    assert "then rank 0 (node" in line and "a collective failed" in line
    _complete_checkpoint(run, 10)                      # attempt 1 saved: progress
    refused, line = attempt(2)
    assert refused is None and "resuming from checkpoint step_00000010" in line
    assert guard_main(verdict) == 0
    refused, line = attempt(3)                         # attempt 2 saved nothing: a loop
    assert line is None and refused[0] == restarts.FAIL
    assert refused[1].startswith("NOT restarting: attempt 2 made no progress (newest complete "
                                 "checkpoint step_00000010, as at its start)")
    assert guard_main(verdict) == 3
    # The next run of the job (a requeue) starts its own count; no verdict for it yet.
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert guard_main(verdict) == 0
    assert attempt(0) == (None, None)
    restarts.record_rank(run, 0, 0, code=75, reason="stopped on a signal")
    refused, _ = attempt(1)                            # a stop is never continued by a restart
    assert refused[0] == restarts.REQUEUE and "stopped on a signal (exit 75" in refused[1]
    assert guard_main(verdict) == 4
    # The limit, counted over the whole job run (torchrun counts per node).
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    for number in range(6):
        _complete_checkpoint(run, 20 + number)
        assert attempt(number)[0] is None
    _complete_checkpoint(run, 30)
    refused, _ = attempt(6)
    assert refused[0] == restarts.FAIL and "exceed TAPE_MAX_RESTARTS=5" in refused[1]


def test_a_long_reason_is_cut_visibly_before_the_restart_line_goes_on(tmp_path, monkeypatch):
    from tape_train.train import restarts

    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    long = "refusing to resume: " + "the global batch changes " * 20
    for name, reason in (("short", "short reason"), ("long", long)):
        run = tmp_path / name
        number, _, _ = restarts.begin_attempt(run, world_size=1, max_restarts=3)
        restarts.record_rank(run, number, 0, code=1, reason=reason)
        _, _, line = restarts.begin_attempt(run, world_size=1, max_restarts=3)
        kept = json.loads((run / restarts.STATE_DIR / "rank-00000.json").read_text())["reason"]
        if reason == long:
            assert len(kept) <= restarts.REASON_CHARS and kept.endswith("…")
            assert long.startswith(kept[:-1])
        else:   # negative control: a short reason is kept whole
            assert kept == reason
        assert f"exited 1 first: {kept}" in line


# ----------------------------------------------------------------------------------------------
# eval.sbatch: one process per GPU of the job under torchrun, one process on a CPU node
# ----------------------------------------------------------------------------------------------

# srun that runs the step here: its options dropped, the command executed.
RUNNING_SRUN = r"""#!/bin/bash
echo "srun $*" >> "$FAKE_DIR/calls"
while [[ $1 == --* ]]; do shift; done
exec "$@"
"""


def run_eval_script(tmp_path, args, srun=RUNNING_SRUN, **env_extra):
    """launch/slurm/eval.sbatch as it ships (plain `sbatch eval.sbatch ARGS`), with `srun`
    a stand-in; returns (exit code, srun calls, output)."""
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(srun)
    (bin_dir / "srun").chmod(0o755)
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FAKE_", "TAPE_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", FAKE_DIR=str(tmp_path),
               SLURM_JOB_ID=str(JOB_ID), SLURM_CPUS_PER_TASK="4", TAPE_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")])),
               **{k: str(v) for k, v in env_extra.items()})
    proc = subprocess.run(["bash", str(default_template_dir() / "eval.sbatch"), *args],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() \
        else []
    return proc.returncode, calls, proc.stdout + proc.stderr


def test_eval_script_runs_one_process_per_gpu_of_the_job(tmp_path):
    """Slurm gave the job 2 GPUs (SLURM_GPUS_ON_NODE): torchrun starts 2 tape-eval processes
    (here on the CPU, gloo), which write the one report."""
    import json

    from test_eval_reports_cli import EVAL_ARGS, make_checkpoint

    make_checkpoint(tmp_path / "run", "tape", seed=6)
    rc, calls, output = run_eval_script(
        tmp_path, ["--checkpoint", "run", *EVAL_ARGS, "--out", "run/eval"],
        SLURM_GPUS_ON_NODE=2)
    assert rc == 0, output[-3000:]
    assert len(calls) == 1 and "-m tape_train.cluster.torchrun --standalone " \
        "--nproc_per_node=2 -m tape_train.eval.cli --checkpoint run" in calls[0]
    # The step asks for the node's 2 GPUs (a job's --gpus-per-task=1 would give it one).
    assert calls[0].startswith("srun --export=ALL --ntasks=1 --cpus-per-task=") \
        and " --gpus-per-node=2 " in calls[0], calls
    assert "2 process(es), gpus_per_node=2 OMP_NUM_THREADS=2" in output
    report = json.loads((tmp_path / "run" / "eval" / "eval.json").read_text())
    assert report["settings"]["world_size"] == 2 and output.count("| model |") == 1
    assert "evaluation finished" in output
    # A bad input: one line from rank 0, torchrun's report of the failed rank without its
    # Python traceback, and the script's own verdict.
    rc, calls, output = run_eval_script(
        tmp_path, ["--checkpoint", "run", *EVAL_ARGS, "--data", "no-such-data.yaml", "--out",
                   "run/eval2"], SLURM_GPUS_ON_NODE=2)
    assert rc == 1, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("tape-eval: error")]
    assert len(errors) == 1 and "no-such-data.yaml" in errors[0], output[-3000:]
    assert "Root Cause" in output and "Traceback" not in output, output[-3000:]
    assert "evaluation failed (exit 1)" in output and not (tmp_path / "run" / "eval2").exists()


FAILING_SRUN = """#!/bin/bash
echo "srun $*" >> "$FAKE_DIR/calls"
exit 3
"""


@pytest.mark.parametrize("sig, name", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")])
def test_torchrun_stopped_by_a_signal_says_so_in_one_line(tmp_path, sig, name):
    """Slurm's SIGTERM at an eval job's time limit (or Ctrl-C's SIGINT under local.sh) reaches
    torchrun: it ends its workers, and the wrapper says so in one line with exit 128 + signal
    (torchrun: a SignalException traceback and exit 1)."""
    import sys

    worker = tmp_path / "worker.py"
    worker.write_text("import os, pathlib, signal, time\n"   # ends quietly on either signal
                      "for s in (signal.SIGTERM, signal.SIGINT):\n"
                      "    signal.signal(s, lambda n, f: os._exit(128 + n))\n"
                      "pathlib.Path('ready').touch()\ntime.sleep(120)\n")
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "tape_train.cluster.torchrun", "--standalone",
                             "--nproc_per_node=1", str(worker)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err[-3000:]
    assert f"torchrun: stopped by {name}, which its workers were sent too" in err
    assert "Traceback" not in err, err[-3000:]


def test_eval_script_on_a_cpu_node_runs_one_process_and_reports_failures(tmp_path):
    rc, calls, output = run_eval_script(tmp_path, ["--checkpoint", "run"], srun=FAILING_SRUN)
    assert rc == 3 and "evaluation failed (exit 3)" in output
    assert len(calls) == 1 and "torchrun" not in calls[0] and "--gpus" not in calls[0]
    assert calls[0].endswith("-c import sys; from tape_train.eval.cli import main; "
                             "sys.exit(main()) --checkpoint run")
    rc, calls, output = run_eval_script(tmp_path, ["--checkpoint", "run"], TAPE_GPUS_PER_NODE="a")
    assert rc == 2 and "TAPE_GPUS_PER_NODE=a is not a number" in output and len(calls) == 1
