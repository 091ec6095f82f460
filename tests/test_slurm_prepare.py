"""launch/slurm/prepare.sbatch's decisions, run by bash with a real `tape-data prepare` and a
stand-in `scontrol` that records `scontrol requeue` (no cluster; ~10 s).

The prepare is stopped deterministically mid-way: once its scratch holds checkpoint 2 the test
SIGSTOPs it (its pid is in the scratch's owner.json), signals the batch shell, waits for the
shell to log that it signalled the prepare, and SIGCONTs it; so the prepare cannot finish
between the test's look and the signal. The same path runs under real Slurm in
test_slurm_cluster.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tape_train.cluster.render import default_template_dir
from tape_train.data.prepare_scratch import OWNER_NAME, RESUME_PREFIX, STATE_NAME
from tape_train.data.testing import real_text_documents, write_jsonl
from tape_train.files import pid_alive

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = default_template_dir() / "prepare.sbatch"
JOB_ID = 5150
# ~0.6 MB of training text in buffers of 40 kB: about 15 checkpoints.
OPTIONS = ["--num-shards", "3", "--eval-fraction", "0.1", "--shuffle-bytes", "40000"]

FAKE_SCONTROL = r"""#!/bin/bash
echo "scontrol $*" >> "$FAKE_DIR/calls"
[[ $1 == requeue ]] && exit "${FAKE_REQUEUE_RC:-0}"
exit 0
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """300 real-text documents in two JSONL files and a 512-piece tokenizer trained on them."""
    from tape_train.data.tokenizer import TokenizerTrainSpec, train_tokenizer

    root = tmp_path_factory.mktemp("corpus")
    texts = real_text_documents(300)
    write_jsonl(root / "in" / "a.jsonl", texts[:150])
    write_jsonl(root / "in" / "b.jsonl", texts[150:])
    train_tokenizer(texts, root / "tok", TokenizerTrainSpec(vocab_size=512, num_threads=1))
    return {"input": root / "in", "tokenizer": root / "tok.model"}


def prepare_args(corpus, out: Path) -> list[str]:
    return ["--input", str(corpus["input"]), "--out", str(out), *OPTIONS, "--tokenize",
            "--tokenizer", str(corpus["tokenizer"])]


def child_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
        (bin_dir / "scontrol").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FAKE_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", FAKE_DIR=str(tmp_path),
               SLURM_JOB_ID=str(JOB_ID), SLURM_CPUS_PER_TASK="2", TAPE_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               **extra)
    return env


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def calls(tmp_path: Path) -> list[str]:
    path = tmp_path / "calls"
    return path.read_text().splitlines() if path.exists() else []


def run_job(tmp_path: Path, args: list[str], script: Path = SCRIPT, restart: int = 0,
            send: signal.Signals | None = None, out: Path | None = None, hold_at: int = 2,
            **env) -> tuple[int, str]:
    """Runs the batch script as one run of job JOB_ID; with `send`, delivers it to the shell
    while the prepare (writing into `out`) is held at checkpoint `hold_at` or later. Returns
    (exit, log);
    a prepare the shell left running is waited for (at most 60 s), then killed."""
    log_path = tmp_path / f"job-{restart}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", str(script), *args], stdout=log,
                                stderr=subprocess.STDOUT,
                                env=child_env(tmp_path, SLURM_RESTART_COUNT=str(restart), **env))
    pid = None
    try:
        if send is not None:
            pid = hold_at_checkpoint(
                out, hold_at, lambda: _assert(proc.poll() is None, log_path.read_text()))
            proc.send_signal(send)
            deadline = time.monotonic() + 20
            while "to stop it at once" not in log_path.read_text() and proc.poll() is None:
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.02)
            os.kill(pid, signal.SIGCONT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGCONT)
            deadline = time.monotonic() + 60
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    return proc.returncode, log_path.read_text()


def hold_at_checkpoint(out: Path, checkpoint: int, still_running: Callable[[], None]) -> int:
    """SIGSTOPs the prepare writing into `out` (the live owner of its scratch) once its state
    says `checkpoint` or later; returns its pid. `still_running` asserts that the job runs
    (asked twice a second: checkpoints may be milliseconds apart)."""
    deadline = time.monotonic() + 60
    asked = 0.0
    while True:
        if time.monotonic() - asked > 0.5:
            still_running()
            asked = time.monotonic()
        assert time.monotonic() < deadline, f"no checkpoint {checkpoint} in {out}"
        for scratch in out.glob(f"{RESUME_PREFIX}*"):
            try:
                state = json.loads((scratch / STATE_NAME).read_text())
                pid = json.loads((scratch / OWNER_NAME).read_text())["pid"]
            except (OSError, ValueError, KeyError):
                continue
            if state.get("checkpoint", 0) >= checkpoint and pid_alive(pid):
                os.kill(pid, signal.SIGSTOP)
                return pid
        time.sleep(0.005)


def _assert(condition: bool, message: str) -> None:
    assert condition, message


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> dict[str, bytes]:
    """A direct, uninterrupted `tape-data prepare` of the same arguments."""
    out = tmp_path_factory.mktemp("ref") / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-m", "tape_train.data.cli", "prepare",
                          *prepare_args(corpus, out)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return files(out)


def test_usr1_stops_the_prepare_requeues_and_the_rerun_resumes_to_the_same_bytes(
        tmp_path, corpus, reference):
    out = tmp_path / "out"
    args = prepare_args(corpus, out)
    rc, log = run_job(tmp_path, args, send=signal.SIGUSR1, out=out)
    assert rc == 0, log
    assert calls(tmp_path) == [f"scontrol requeue {JOB_ID}"], log
    # The job's share of CPUs tokenises (no --workers given); the rest is passed unchanged.
    assert f"tape-data prepare {' '.join(args)} --workers 2\n" in log
    assert "caught SIGUSR1; sent SIGTERM to the prepare" in log
    stopped = re.search(r"stopped; the same command resumes from checkpoint (\d+)", log)
    assert stopped and int(stopped.group(1)) >= 2, log
    assert "tape-data: interrupted" in log and "Traceback" not in log
    assert f"requeueing job {JOB_ID} (prepare exit code 130)" in log
    assert not (out / "manifest.json").exists()

    rc, log = run_job(tmp_path, args, restart=1)
    assert rc == 0, log
    assert f"restart=1] SLURM_RESTART_COUNT=1" in log
    assert re.search(r"resuming prepare from \d+ documents \([\d.]+ MB\), checkpoint "
                     + stopped.group(1) + "\n", log), log
    assert "prepare finished (exit 0)" in log
    assert calls(tmp_path) == [f"scontrol requeue {JOB_ID}"]   # no second requeue
    assert files(out) == reference


def test_an_array_task_requeues_only_itself(tmp_path, corpus):
    # One task of an array has the array's id as SLURM_JOB_ID, which scontrol takes for the
    # whole array (measured: finished tasks were rerun): the task is <array id>_<task id>.
    out = tmp_path / "out"
    rc, log = run_job(tmp_path, prepare_args(corpus, out), send=signal.SIGUSR1, out=out,
                      SLURM_ARRAY_JOB_ID=str(JOB_ID), SLURM_ARRAY_TASK_ID="7")
    assert rc == 0, log
    assert calls(tmp_path) == [f"scontrol requeue {JOB_ID}_7"], log


def test_bad_input_is_not_requeued(tmp_path, corpus):
    # A bad record after a few checkpoints: the prepare fails with its one-line error; a
    # requeue would fail the same way.
    data = tmp_path / "in"
    data.mkdir()
    (data / "a.jsonl").write_bytes((corpus["input"] / "a.jsonl").read_bytes())
    (data / "b.jsonl").write_bytes((corpus["input"] / "b.jsonl").read_bytes() + b"{not json\n")
    rc, log = run_job(tmp_path, ["--input", str(data), "--out", str(tmp_path / "out"),
                                 *OPTIONS])
    assert rc == 1, log
    assert "b.jsonl:151: malformed JSON" in log
    assert "ERROR: tape-data prepare failed (exit 1); not requeueing: it would fail again" in log
    assert calls(tmp_path) == []


def test_sigterm_stops_the_prepare_without_a_requeue(tmp_path, corpus):
    # scancel, or a time limit reached without the warning: Slurm decides; the prepare stops
    # cleanly and names its checkpoint, the script does not requeue.
    out = tmp_path / "out"
    rc, log = run_job(tmp_path, prepare_args(corpus, out), send=signal.SIGTERM, out=out)
    assert rc == 130, log
    assert "stopped; the same command resumes from checkpoint" in log
    assert "stopped by SIGTERM (prepare exit code 130); not requeueing" in log
    assert calls(tmp_path) == []


def test_restart_limit_and_a_refused_requeue_end_the_job_with_75(tmp_path, corpus):
    out = tmp_path / "out"
    args = prepare_args(corpus, out)
    rc, log = run_job(tmp_path, args, send=signal.SIGUSR1, out=out, restart=3,
                      TAPE_MAX_REQUEUES="3")
    assert rc == 75 and "NOT requeueing: restart count 3 reached TAPE_MAX_REQUEUES=3" in log
    assert calls(tmp_path) == []
    stopped = int(re.search(r"resumes from checkpoint (\d+)", log).group(1))
    rc, log = run_job(tmp_path, args, send=signal.SIGUSR1, out=out, restart=4,
                      hold_at=stopped + 2, FAKE_REQUEUE_RC="1")
    assert rc == 75 and "ERROR: scontrol requeue failed" in log, log
    assert f"resuming prepare from" in log and f"checkpoint {stopped}\n" in log
    assert calls(tmp_path) == [f"scontrol requeue {JOB_ID}"]


def test_without_the_trap_usr1_ends_the_job_and_nothing_requeues(tmp_path, corpus):
    # Negative control: the same script without its traps dies of USR1 (bash's default
    # action), so nothing stops the prepare cleanly or requeues the job.
    script = tmp_path / "no-trap.sbatch"
    text = SCRIPT.read_text()
    assert "trap 'stop_prepare USR1' USR1\n" in text
    script.write_text(text.replace("trap 'stop_prepare USR1' USR1\n", ""))
    out = tmp_path / "out"
    rc, log = run_job(tmp_path, prepare_args(corpus, out), script=script, send=signal.SIGUSR1,
                      out=out)
    assert rc == -signal.SIGUSR1, log   # bash killed by the signal
    assert calls(tmp_path) == [] and "requeueing" not in log


def test_outside_slurm_and_without_arguments_it_says_so(tmp_path):
    env = child_env(tmp_path)
    del env["SLURM_JOB_ID"]
    proc = subprocess.run(["bash", str(SCRIPT), "--input", "x", "--out", "y"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "not inside a Slurm job" in proc.stderr
    rc, log = run_job(tmp_path, [])
    assert rc == 2 and "ERROR: no arguments; usage: sbatch prepare.sbatch" in log
    # a requeue limit from the environment that is no number: said now, not at the first
    # requeue hours later (`abc: unbound variable`); nothing is prepared
    rc, log = run_job(tmp_path, ["--input", "x", "--out", str(tmp_path / "y")],
                      TAPE_MAX_REQUEUES="abc")
    assert rc == 2 and ("ERROR: TAPE_MAX_REQUEUES=abc is not a whole number >= 0" in log), log
    assert "tape-data prepare" not in log and not (tmp_path / "y").exists()
