"""A rank that hangs ends the run within a bounded time, and the logs say where
(``tape_train.train.watchdog``).

Fast: the watchdog alone in a subprocess (a phase that overruns ends the process with the
stacks; one re-armed in time does not; time the process was stopped does not count, time the
trainer held the GIL does), and the one-line description of a failed collective.

Slow: the real trainer under torchrun, 2 gloo ranks, ZeRO-3, synthetic data, 6 steps with a
checkpoint every 2, ``train.collective_timeout_s=10`` (a step may take 5 s on a rank) and
``train.startup_timeout_s=30`` (a save may take 15 s). A hook in the worker (``_HOOK``) makes
one rank sleep, or SIGSTOP itself, at a chosen step's data read or checkpoint save:

- slow but progressing (3 s data reads, an 8 s save on one rank): not ended, and its losses
  are the reference;
- rank 0 stuck in the step-4 save: it ends itself with its stacks, naming the save and the key;
  the other rank says in one line that a peer exited; the step-4 checkpoint is not complete,
  the run-directory lock is released;
- the re-run resumes from step 2; rank 1 SIGSTOPs in step 4: rank 0's collective times out,
  one line naming ``train.collective_timeout_s``, no traceback;
- the next re-run finishes with the reference losses, bit for bit.

Slow, a resume on another layout whose universal conversion is slowed down: one that keeps
moving is not ended, one that stalls is (with its worker process), and a stop signal (to one
rank, or to every process of the run as Slurm sends it) ends it within seconds with exit 75,
after which the re-run resumes exactly.

Slow, the launcher killed outright (SIGKILL of torchrun; of the shell that started it, as
``launch/local.sh``): the workers, in sessions of their own, stop at the next step with a
checkpoint instead of training on as orphans holding the lock; the re-runs resume exactly.
Fast: a teardown whose ``destroy_process_group`` never returns still ends the process.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_train_faults import OVERRIDES as FAULTS_OVERRIDES  # the tiny 2-rank model
from test_train_resume import _descendants

REPO = Path(__file__).resolve().parents[1]
# Seconds-long allowances: these timing tests run by themselves (`make test`'s second part).
pytestmark = pytest.mark.alone


def _env(*first: Path, **extra: str) -> dict[str, str]:
    """A child's environment: this checkout (and ``first``) ahead of the PYTHONPATH it was given
    (packages installed with --target, as on the GPU image). torchrun waits 3 s, not 30, before
    it SIGKILLs a worker that ignores SIGTERM (a stopped one): the variable, unlike the
    --shutdown-timeout flag, is also accepted by a torch older than the pinned one."""
    path = [str(REPO), *map(str, first), os.environ.get("PYTHONPATH")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)),
                TORCH_ELASTIC_SHUTDOWN_TIMEOUT="3", **extra)
OVERRIDES = [*FAULTS_OVERRIDES, "train.max_steps=6", "checkpoint.keep=2",
             "logging.tensorboard=false", "train.collective_timeout_s=10",
             "train.startup_timeout_s=30"]

# HANG_AT="<data|save>:<steps>:<rank>:<seconds|stop>[;...]": on that rank, sleep (or SIGSTOP)
# when reading the data of one of those steps, or when saving the checkpoint of one.
_HOOK = """
import os, signal, sys, time
from tape_train.train import checkpoint, loop

def hang(step, steps, rank, how):
    if step in steps and os.environ["RANK"] == rank:
        if how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            time.sleep(float(how))

for spec in filter(None, os.environ.get("HANG_AT", "").split(";")):
    where, steps, rank, how = spec.split(":")
    steps = {int(s) for s in steps.split(",")}
    if where == "data":
        def read(self, *a, _original=loop.Trainer._next_micro_batches, _spec=(steps, rank, how)):
            hang(self.state.step + 1, *_spec)
            return _original(self, *a)
        loop.Trainer._next_micro_batches = read
    else:
        def save(engine, run_dir, step, _original=checkpoint.save_checkpoint,
                 _spec=(steps, rank, how), **kwargs):
            hang(step, *_spec)
            return _original(engine, run_dir, step, **kwargs)
        checkpoint.save_checkpoint = save

from tape_train.train.cli import main
sys.exit(main(sys.argv[1:]))
"""


# ----------------------------------------------------------------------------------------------
# Fast: the watchdog alone, and the one-line description of a failed collective
# ----------------------------------------------------------------------------------------------

_ALONE = """
import sys, time
from tape_train.train.watchdog import Watchdog
watchdog = Watchdog(3)
for i in range(int(sys.argv[1])):
    watchdog.arm(f"step {i + 1}", 2.0, "train.collective_timeout_s")   # 1 s per phase
    time.sleep(float(sys.argv[2]))
watchdog.close()
print("finished")
"""


def _alone(tmp_path: Path, phases: int, seconds: float) -> subprocess.CompletedProcess:
    script = tmp_path / "alone.py"
    script.write_text(_ALONE)
    return subprocess.run([sys.executable, str(script), str(phases), str(seconds)], env=_env(),
                          capture_output=True, text=True, timeout=60)


def test_an_overrun_phase_ends_the_process_with_its_stacks_in_time(tmp_path):
    start = time.monotonic()
    stuck = _alone(tmp_path, 1, 30)
    assert stuck.returncode == 1 and "finished" not in stuck.stdout
    assert time.monotonic() - start < 20
    assert "rank 3 is stuck: step 1 made no progress for 1 s" in stuck.stderr, stuck.stderr
    assert "not in a collective" in stuck.stderr and "raise train.collective_timeout_s" in stuck.stderr
    assert "[rank3] thread MainThread (most recent call last):" in stuck.stderr
    assert "time.sleep(float(sys.argv[2]))" in stuck.stderr  # where it was stuck
    assert "tape-train-watchdog" not in stuck.stderr          # not the watchdog's own stack


def test_phases_that_end_in_time_are_not_ended(tmp_path):
    ok = _alone(tmp_path, 6, 0.5)  # 3 s in all, each phase within its 1 s
    assert ok.returncode == 0 and "finished" in ok.stdout, ok.stderr
    assert "stuck" not in ok.stderr


_SUSPENDED = """
import logging, sys, time
from tape_train.train import watchdog as wd
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
if sys.argv[1] == "off":
    wd.STOPPED_GAP_S = float("inf")            # the negative control: no stop detection
watchdog = wd.Watchdog(2)
watchdog.arm("step 9", 4.0, "train.collective_timeout_s")   # 2 s allowance
print("armed", flush=True)
for _ in range(20):                            # 1 s of work, plus however long it is stopped
    time.sleep(0.05)
watchdog.disarm()
watchdog.close()
print("finished", flush=True)
"""


@pytest.mark.parametrize("detect", [True, False])
def test_time_the_process_was_stopped_does_not_count_as_stuck(tmp_path, detect):
    """A process stopped (`scontrol suspend`, SIGSTOP) for longer than its phase's allowance and
    then continued is not ended: the watchdog sees its own wake come late and gives the phase
    that time back. Without that (the negative control) the same stop ends it as stuck."""
    script = tmp_path / "suspended.py"
    script.write_text(_SUSPENDED)
    child = subprocess.Popen([sys.executable, str(script), "on" if detect else "off"],
                             env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        while (line := child.stdout.readline()) != "armed\n":   # DeepSpeed prints on import
            assert line, child.communicate()
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(4.0)                            # twice the allowance, stopped
        os.kill(child.pid, signal.SIGCONT)
        out, err = child.communicate(timeout=30)
    finally:
        child.kill()
    if detect:
        assert child.returncode == 0 and "finished" in out, err
        assert "stuck" not in err
        assert re.search(r"rank 2: this process did not run for [3-5] s \(a suspended job, "
                         r"SIGSTOP, or a machine too busy to run it\); step 9 gets that time "
                         r"back", err), err
    else:
        assert child.returncode == 1 and "finished" not in out
        assert re.search(r"rank 2 is stuck: step 9 made no progress for [4-6] s", err), err


_HOLDS_THE_GIL = """
import logging, sys, time
from tape_train.train import watchdog as wd
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
if sys.argv[1] == "off":
    wd._thread_cpu_clock = lambda: None        # the negative control: its CPU time unread
n = 2 * 10**7
start = time.perf_counter()
sum(range(n))
n = int(n * 3.5 / (time.perf_counter() - start))   # one call holds the GIL for ~3.5 s
watchdog = wd.Watchdog(4)
watchdog.arm("step 7", 2.0, "train.collective_timeout_s")   # 1 s allowance
for call in range(1, 4):    # stuck in a retry loop whose C call does not release the GIL
    time.sleep(0.01)
    sum(range(n))
    print("call", call, flush=True)
print("finished", flush=True)
"""


@pytest.mark.parametrize("fixed", [True, False])
def test_a_stop_right_after_the_arm_before_the_watchdog_ran_is_given_back(monkeypatch, caplog,
                                                                        fixed):
    """SIGSTOP in the instant after `arm()`, before the watchdog thread woke for the new phase
    (CI: the test above, stopped 4 s under a 2 s allowance, was ended as stuck): that wake is
    late too, due at the phase's start. The stop is a jump of the watchdog's clock made while
    `arm()` still holds the lock, so the thread's first look comes after it, every time; the
    trainer's thread uses no CPU meanwhile, as a stopped one. Without the fix (the negative
    control: the wake is judged from the phase's start with no stop detection) the phase is
    overrun at once."""
    import logging
    import time as real_time

    from tape_train.train import watchdog as wd

    offset = [0.0]

    class Clock:
        def __getattr__(self, name):
            return getattr(real_time, name)

        @staticmethod
        def monotonic():
            return real_time.monotonic() + offset[0]

    overruns = []

    def overrun(self, phase):  # recorded, and the phase ended, instead of ending the process
        overruns.append(phase.name)
        self._phase = None

    monkeypatch.setattr(wd, "time", Clock())
    monkeypatch.setattr(wd.Watchdog, "_overrun", overrun)
    caplog.set_level(logging.INFO, logger=wd.log.name)
    watchdog = wd.Watchdog(2)
    deadline = real_time.monotonic() + 10
    while watchdog._thread.is_alive() and real_time.monotonic() < deadline:
        with watchdog._cond:  # until the thread waits for a phase (it holds the lock till then)
            if watchdog._cond._waiters:
                break
        real_time.sleep(0.01)
    real_cond = watchdog._cond

    class StoppedInArm:  # arm() takes the lock, sets the phase, notifies: stopped right there
        def __enter__(self):
            return real_cond.__enter__()

        def __exit__(self, *exc):
            return real_cond.__exit__(*exc)

        def notify(self):
            offset[0] += 4.0  # twice the allowance
            real_cond.notify()

    if not fixed:
        monkeypatch.setattr(wd, "STOPPED_GAP_S", float("inf"))
    watchdog._cond = StoppedInArm()
    watchdog.arm("step 9", 4.0, "train.collective_timeout_s")  # 2 s allowance
    watchdog._cond = real_cond
    real_time.sleep(0.5)
    watchdog.disarm()
    watchdog.close()
    if fixed:
        assert overruns == [], caplog.text
        assert "rank 2: this process did not run for 4 s" in caplog.text
    else:
        assert overruns and overruns[0] == "step 9"


@pytest.mark.parametrize("cpu_time", [True, False])
def test_a_trainer_that_holds_the_gil_is_not_taken_for_a_stopped_one(tmp_path, cpu_time):
    """The watchdog's wake also comes late when the trainer's thread holds the GIL for seconds
    (a long C call); that thread ran, so it was not stopped: its phase gets no time back and
    ends at its first wake past the allowance. Without reading the trainer's CPU time (the
    negative control) each late wake counted as a stop, and three 3.5 s calls against a 1 s
    allowance ran to the end (on a busy machine a wake may also land in the 10 ms between
    calls and end it: the control asserts the misreading itself, a late wake taken for a
    stop)."""
    script = tmp_path / "holds_the_gil.py"
    script.write_text(_HOLDS_THE_GIL)

    def run():
        return subprocess.run([sys.executable, str(script), "on" if cpu_time else "off"],
                              env=_env(), capture_output=True, text=True, timeout=90)
    if cpu_time:
        proc = run()
        assert proc.returncode == 1 and "call 2" not in proc.stdout, proc.stdout + proc.stderr
        assert "did not run" not in proc.stderr, proc.stderr
        assert re.search(r"rank 4 is stuck: step 7 made no progress for [2-9] s", proc.stderr)
    else:
        # A call is timed once at the start: where the machine's load then drops, the calls
        # get shorter and a wake may come less than STOPPED_GAP_S late, read rightly. The
        # control asks for the misreading in one of three runs.
        runs = []
        while len(runs) < 3 and not any("did not run for" in p.stderr for p in runs):
            runs.append(run())
        assert any("rank 4: this process did not run for" in proc.stderr for proc in runs), (
            "\n---\n".join(proc.stdout + proc.stderr for proc in runs))


_MOVING = """
import sys, time
from tape_train.train.watchdog import Watchdog
watchdog = Watchdog(0)
watchdog.arm("the evaluation at step 2", 4.0, "train.startup_timeout_s")  # 2 s of no progress
for i in range(8):                                 # 4.8 s in all: more than the 2 s allowance
    time.sleep(0.6)
    if sys.argv[1] == "beat":
        watchdog.progress()                        # e.g. one evaluation batch done
watchdog.close()
print("finished")
"""


@pytest.mark.parametrize("beat", [True, False])
def test_a_long_phase_that_reports_progress_is_not_ended(tmp_path, beat):
    """An evaluation longer than its allowance but moving (the trainer passes the watchdog's
    `progress` as evaluate_schedule's per-batch heartbeat) is not ended; the same phase without
    the heartbeat is (the negative control)."""
    script = tmp_path / "moving.py"
    script.write_text(_MOVING)
    result = subprocess.run([sys.executable, str(script), "beat" if beat else "silent"],
                            env=_env(), capture_output=True,
                            text=True, timeout=60)
    if beat:
        assert result.returncode == 0 and "finished" in result.stdout, result.stderr
    else:
        assert result.returncode == 1 and "finished" not in result.stdout
        assert "the evaluation at step 2 made no progress for 2 s" in result.stderr


def test_a_failed_collective_is_one_line_naming_the_phase_and_key():
    from tape_train.train.watchdog import describe_collective_error

    class Phase:  # what the watchdog knows about the phase in progress
        phase = ("step 7", 10.0, "train.collective_timeout_s")

    timeout = RuntimeError("[/src/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                           "10000ms for recv operation to complete")
    line = describe_collective_error(timeout, Phase(), 1)
    assert line.startswith("rank 1: a collective timed out in step 7 "
                           "(train.collective_timeout_s=10 s): another rank is stuck")
    assert line.endswith("raise train.collective_timeout_s (Timed out waiting 10000ms for recv "
                         "operation to complete)") and "\n" not in line
    closed = RuntimeError("[/src/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                          "[127.0.0.1]:30112. This is typically caused by a remote worker "
                          "crashing. Check the logs of the remote worker")
    assert describe_collective_error(closed, Phase(), 0) == (
        "rank 0: a collective failed in step 7: another rank exited (crashed, was killed, or "
        "was ended by its watchdog: its log says which) (Connection closed by peer "
        "[127.0.0.1]:30112)")
    # gloo's timed-out wait on ZeRO-3's coalesced all-gather names neither gloo nor c10d (seen
    # on the Slurm test cluster): still one timeout line.
    pair = RuntimeError("Application timeout caused pair closure")
    assert describe_collective_error(pair, Phase(), 0).startswith(
        "rank 0: a collective timed out in step 7 (train.collective_timeout_s=10 s)")
    # Negative control: any other RuntimeError is not a communication error (traceback kept).
    assert describe_collective_error(RuntimeError("shape mismatch"), Phase(), 0) is None
    # ... unless communication code raised it.
    import torch.distributed.distributed_c10d as c10d

    try:
        exec(compile("raise RuntimeError('store went away')", c10d.__file__, "exec"))
    except RuntimeError as exc:
        assert describe_collective_error(exc, Phase(), 0) == (
            "rank 0: a collective failed in step 7: store went away")


def test_a_failed_collective_is_described_with_the_phase_it_ended():
    """A call that fails ends its phase (the watchdog is disarmed on the way out) before the
    trainer describes the error: the line still names that phase and its timeout."""
    from tape_train.train.watchdog import Watchdog, describe_collective_error

    watchdog = Watchdog(1)
    try:
        watchdog.arm("step 7", 10.0, "train.collective_timeout_s")
        watchdog.disarm()
        timeout = RuntimeError("[/src/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                               "waiting 10000ms for recv operation to complete")
        assert describe_collective_error(timeout, watchdog, 1).startswith(
            "rank 1: a collective timed out in step 7 (train.collective_timeout_s=10 s)")
    finally:
        watchdog.close()


# A trainer driven call by call, as the benchmarks and several tests do (setup, then train_step
# and save on their own, with the caller's own work in between): its phases end with the calls.
_CALL_BY_CALL = """
import sys, time
import torch._dynamo  # torch's optimizer imports it on first use: seconds on a busy machine,
                      # in a start-up phase whose allowance here is 5 s (not what is tested)
from test_train_faults import OVERRIDES
from tape_train.config import load_run_config
from tape_train.train.loop import Trainer
trainer = Trainer(load_run_config(None, [*OVERRIDES, "train.max_steps=1000",
    "logging.tensorboard=false", "train.collective_timeout_s=6", "train.startup_timeout_s=10",
    "train.run_dir=" + sys.argv[1]]))
trainer.setup()
start = time.monotonic()
while time.monotonic() - start < 6:  # more than a start-up phase's 5 s, each step within its 3 s
    trainer.train_step()
time.sleep(4)                         # the caller's work: more than a step's 3 s
trainer.save()
time.sleep(6)                         # more than a save's 5 s
trainer.close()
print("finished")
"""


@pytest.mark.slow
def test_a_trainer_driven_call_by_call_is_not_ended_between_calls(tmp_path):
    script = tmp_path / "call_by_call.py"
    script.write_text(_CALL_BY_CALL)
    env = _env(REPO / "tests", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "finished" in result.stdout, result.stderr[-3000:]
    assert "stuck" not in result.stderr and "has waited" not in result.stderr


# ----------------------------------------------------------------------------------------------
# Slow: the real trainer under torchrun
# ----------------------------------------------------------------------------------------------


def _train(tmp_path: Path, run_dir: Path, hang_at: str = "") -> tuple[subprocess.CompletedProcess,
                                                                      float]:
    hook = tmp_path / "hang_hook.py"
    hook.write_text(_HOOK)
    env = _env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HANG_AT=hang_at)
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node", "2", str(hook),
                             "--config", "demo", *OVERRIDES, f"train.run_dir={run_dir}"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return result, time.monotonic() - start


def _losses(run_dir: Path) -> dict[int, float]:
    from tape_train.train.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run_dir, "train")}


def _complete(run_dir: Path, step: int) -> bool:
    from tape_train.train.checkpoint import tag_for_step, why_incomplete

    tag = run_dir / "checkpoints" / tag_for_step(step)
    return tag.is_dir() and why_incomplete(tag) is None


@pytest.fixture(scope="module")
def slow_reference(tmp_path_factory) -> dict[int, float]:
    """A run whose rank 1 is slow (3 s data reads in steps 2 and 3, more than half a step's
    allowance in the step-4 save) but never stuck: it must finish."""
    tmp = tmp_path_factory.mktemp("slow")
    result, _ = _train(tmp, tmp / "run", "data:2,3:1:3;save:4:1:8")
    assert result.returncode == 0, result.stderr[-5000:]
    for line in ("is stuck", "timed out", "has waited", "collective failed"):
        assert line not in result.stderr, result.stderr[-5000:]
    losses = _losses(tmp / "run")
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    return losses


@pytest.mark.slow
@pytest.mark.distributed
def test_slow_but_progressing_ranks_are_not_ended(slow_reference):
    assert len(slow_reference) == 6


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.integration
def test_stuck_and_stopped_ranks_end_the_run_and_the_rerun_continues_exactly(
        tmp_path, slow_reference):
    run_dir = tmp_path / "run"

    # Rank 0 stuck in the step-4 save: ended by its watchdog after 15 s (half of 30).
    stuck, seconds = _train(tmp_path, run_dir, "save:4:0:3600")
    err = stuck.stderr
    assert stuck.returncode != 0 and seconds < 120, (seconds, err[-5000:])
    assert ("[rank0] ERROR tape_train.train: rank 0 is stuck: the checkpoint save at step 4 "
            "made no progress for 15 s, at tape_train/train/loop.py:") in err, err[-5000:]
    assert "If it was only slow, raise train.startup_timeout_s" in err
    stacks = err[err.index("[rank0] thread MainThread (most recent call last):"):]
    assert "in save\n" in stacks and "time.sleep(float(how))" in stacks
    assert "[rank1] thread" not in err  # the waiting rank reports in one line, no stacks
    assert _complete(run_dir, 2) and not _complete(run_dir, 4)  # nothing looks complete
    assert not (run_dir / "RUN.lock").exists()  # released before the watchdog's exit

    # Re-run: resumes from step 2; rank 1 stops (SIGSTOP) reading step 4's data: rank 0's
    # collective times out after 10 s, in one line; torchrun then kills the stopped rank.
    stopped, seconds = _train(tmp_path, run_dir, "data:4:1:stop")
    err = stopped.stderr
    assert stopped.returncode != 0 and seconds < 120, (seconds, err[-5000:])
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000002'}" in err
    assert ("[rank0] ERROR tape_train.train: rank 0: a collective timed out in step 4 "
            "(train.collective_timeout_s=10 s): another rank is stuck") in err, err[-5000:]
    assert f'File "{REPO / "tape_train"}' not in err  # no trainer traceback
    assert "is stuck:" not in err  # a stopped process runs no watchdog

    # Re-run: finishes with the uninterrupted run's losses, bit for bit.
    final, _ = _train(tmp_path, run_dir)
    assert final.returncode == 0, final.stderr[-5000:]
    assert _losses(run_dir) == slow_reference


# ----------------------------------------------------------------------------------------------
# Slow: a resume on another layout whose universal conversion takes longer than the timeout
# ----------------------------------------------------------------------------------------------

# Rank 0's converter runs the module slow_converter (written next to the hook) before the real
# one, behind the real wrapper (loading._WITH_PARENT: stop signals ignored, ends with its
# parent), and a progress line comes every 2 s.
_CONVERT_HOOK = """
import sys
from tape_train import loading, progress

progress.LOG_EVERY_S = 2.0
real = loading.converter_command
def command(tag_dir, out_dir):
    cmd = real(tag_dir, out_dir)
    module = cmd.index("deepspeed.checkpoint.ds_to_universal")
    return [*cmd[:module], "slow_converter", *cmd[module:]]
loading.converter_command = command
from tape_train.train.cli import main
sys.exit(main(sys.argv[1:]))
"""

# CONVERT="moving:<s>": a worker process (like DeepSpeed's extraction pool) writes 1 KiB a
# second into the output (DeepSpeed's scratch folder, which it removes) for <s> seconds,
# printing nothing; then the real converter runs. CONVERT="stalled:<s>": the same without
# writing. The worker never looks at its parent. "<converter pid> <worker pid>" goes to
# $CONVERT_PIDS.
_SLOW_CONVERTER = """
import os, runpy, sys, time
out = sys.argv[sys.argv.index("--output_folder") + 1]
os.makedirs(os.path.join(out, "tmp"), exist_ok=True)
mode, seconds = os.environ["CONVERT"].split(":")
end = time.monotonic() + float(seconds)
worker = os.fork()
if worker == 0:
    with open(os.path.join(out, "tmp", "slow"), "ab") as fh:
        while time.monotonic() < end:
            if mode == "moving":
                fh.write(b"x" * 1024)
                fh.flush()
            time.sleep(1.0)
    os._exit(0)
with open(os.environ["CONVERT_PIDS"], "w") as fh:
    fh.write(f"{os.getpid()} {worker}")
os.waitpid(worker, 0)
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""

_CONVERT_OVERRIDES = [*FAULTS_OVERRIDES, "logging.tensorboard=false",
                      "train.collective_timeout_s=10"]


def _convert_start(tmp_path: Path, run_dir: Path, nproc: int, overrides: list[str],
                   convert: str = "moving:0", shutdown_s: int = 3) -> subprocess.Popen:
    """torchrun with the hook, in a session of its own; the trainer's exit code goes to
    ``tmp_path/exit_code`` (torchrun's own is 1 for any failure)."""
    hook = tmp_path / "convert_hook.py"
    hook.write_text(_CONVERT_HOOK)
    (tmp_path / "slow_converter.py").write_text(_SLOW_CONVERTER)
    for stale in ("exit_code", "convert_pids"):
        (tmp_path / stale).unlink(missing_ok=True)
    env = _env(tmp_path, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CONVERT=convert,
               CONVERT_PIDS=str(tmp_path / "convert_pids"),
               TAPE_TRAIN_EXIT_FILE=str(tmp_path / "exit_code"))
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(shutdown_s)
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node", str(nproc), str(hook), "--config", "demo",
                             *_CONVERT_OVERRIDES, *overrides, f"train.run_dir={run_dir}"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _convert_run(tmp_path: Path, run_dir: Path, nproc: int, overrides: list[str],
                 convert: str = "moving:0") -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = _convert_start(tmp_path, run_dir, nproc, overrides, convert)
    out, err = proc.communicate(timeout=300)
    return (subprocess.CompletedProcess(proc.args, proc.returncode, out, err),
            time.monotonic() - start)


def _converter_pids(tmp_path: Path) -> tuple[int, int] | None:
    """(converter, its worker) once the slow converter has started, else None."""
    text = (tmp_path / "convert_pids").read_text() if (tmp_path / "convert_pids").exists() else ""
    return tuple(map(int, text.split())) if len(text.split()) == 2 else None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped yet does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def _gone_soon(pid: int, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.integration
def test_a_long_conversion_that_moves_is_not_taken_for_a_hang_and_a_stalled_one_is(tmp_path):
    """A 1-rank checkpoint resumed on 2 ranks: rank 0 converts it to the universal form while
    rank 1 waits. With train.startup_timeout_s=20 (10 s per phase without progress), a
    conversion that stalls is ended by rank 0's watchdog, and rank 1 says in one line that its
    peer exited; one that writes for 25 s (longer than the whole timeout) before converting
    is not ended, logs its progress without carriage returns, and the run resumes."""
    run_dir = tmp_path / "run"
    saved, _ = _convert_run(tmp_path, run_dir, 1, ["train.grad_accum_steps=2",
                                                   "train.max_steps=2"])
    assert saved.returncode == 0, saved.stderr[-5000:]
    tag = run_dir / "checkpoints" / "step_00000002"
    resume = ["train.grad_accum_steps=1", "train.max_steps=3", "train.startup_timeout_s=20"]

    stalled, seconds = _convert_run(tmp_path, run_dir, 2, resume, "stalled:600")
    err = stalled.stderr
    assert stalled.returncode != 0 and seconds < 120, (seconds, err[-5000:])
    assert ("[rank0] ERROR tape_train.train: rank 0 is stuck: start-up (converting "
            "step_00000002 to the universal format) made no progress for 10 s") in err, err[-5000:]
    assert "If it was only slow, raise train.startup_timeout_s" in err
    assert ("rank 1: a collective failed in start-up (converting step_00000002 to the universal "
            "format): another rank exited") in err, err[-5000:]
    assert not (tag / "universal").exists() and _complete(run_dir, 2)
    assert all(_gone_soon(pid) for pid in _converter_pids(tmp_path))  # worker too

    moving, seconds = _convert_run(tmp_path, run_dir, 2, resume, "moving:25")
    err = moving.stderr
    assert moving.returncode == 0, err[-5000:]
    assert seconds > 25
    for line in ("is stuck", "timed out", "has waited", "collective failed"):
        assert line not in err, err[-5000:]
    assert "\r" not in err
    lines = [line for line in err.splitlines()
             if "universal conversion of step_00000002: " in line and " so far, " in line]
    assert len(lines) >= 5, err[-5000:]  # one every 2 s while it writes
    assert " files (" in lines[0] and "written" in lines[0]
    assert any("Extracting ZeRO fragments" in line for line in err.splitlines())  # its stages
    assert (tag / "universal").is_dir() and not list(tag.glob(".universal.tmp*"))
    assert f"resumed from {tag}" in err and _losses(run_dir).keys() == {1, 2, 3}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.integration
def test_a_stop_during_the_conversion_ends_it_at_once_and_the_rerun_resumes_exactly(tmp_path):
    """A 1-rank checkpoint resumed on 2 ranks, its conversion slowed to 60 s (a worker
    process writing): SIGUSR1 to the waiting rank 1 only, then SIGTERM to every process of
    the run (torchrun, both ranks, the converter and its worker), as Slurm's preemption or
    scancel delivers it, each end the run within a beat or two (train.startup_timeout_s=20:
    a 2.5 s beat) with the trainer's exit code 75, no universal form or temporary output
    left, the converter and its worker gone, the checkpoint intact. A plain re-run then
    converts it and continues like an uninterrupted resume on 2 ranks, bit for bit.

    Without the fix the SIGUSR1 run ends only after the whole conversion (and keeps its
    universal form), and under SIGTERM the converter dies: exit 1, "conversion failed"."""
    run_dir, reference = tmp_path / "run", tmp_path / "reference"
    saved, _ = _convert_run(tmp_path, run_dir, 1, ["train.grad_accum_steps=2",
                                                   "train.max_steps=2"])
    assert saved.returncode == 0, saved.stderr[-5000:]
    shutil.copytree(run_dir, reference)
    tag = run_dir / "checkpoints" / "step_00000002"
    resume = ["train.grad_accum_steps=1", "train.max_steps=4", "train.startup_timeout_s=20"]
    uninterrupted, _ = _convert_run(tmp_path, reference, 2, resume)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-5000:]

    for sig, to_everyone in ((signal.SIGUSR1, False), (signal.SIGTERM, True)):
        proc = _convert_start(tmp_path, run_dir, 2, resume, "moving:60", shutdown_s=30)
        deadline = time.monotonic() + 120
        while (_converter_pids(tmp_path) is None
               or not any(tag.glob(".universal.tmp*/tmp/slow"))):  # the conversion runs
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
            time.sleep(0.2)
        converter, worker = _converter_pids(tmp_path)
        rank0 = int(Path(f"/proc/{converter}/stat").read_text().split(") ")[1].split()[1])
        rank1 = next(int(p) for p in subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            if int(p) != rank0)
        victims = [proc.pid, *_descendants(proc.pid)] if to_everyone else [rank1]
        assert not to_everyone or {rank0, rank1, converter, worker} <= set(victims)
        signalled = time.monotonic()
        for pid in victims:
            os.kill(pid, sig)
        _, err = proc.communicate(timeout=240)
        seconds = time.monotonic() - signalled
        code = (tmp_path / "exit_code").read_text().strip()
        assert code == "75" and seconds < 20, (sig, code, seconds, err[-5000:])
        assert (f"[rank1] WARNING tape_train.train: stopping on {sig.name} during start-up (in "
                f"the universal conversion of step_00000002, whose partial output was "
                f"removed; the next run converts it again), before the first step: nothing "
                f"to save; exit 75") in err, err[-5000:]
        assert "conversion of step_00000002 failed" not in err
        assert not (tag / "universal").exists() and not list(tag.glob(".universal.tmp*"))
        assert _complete(run_dir, 2) and _losses(run_dir).keys() == {1, 2}
        assert _gone_soon(converter) and _gone_soon(worker)

    rerun, _ = _convert_run(tmp_path, run_dir, 2, resume)
    assert rerun.returncode == 0, rerun.stderr[-5000:]
    assert (tag / "universal").is_dir()
    losses = _losses(run_dir)
    assert losses.keys() == {1, 2, 3, 4} and losses == _losses(reference)


# ----------------------------------------------------------------------------------------------
# The launcher killed outright (SIGKILL): the workers stop too, and the re-run continues
# ----------------------------------------------------------------------------------------------

def _start(tmp_path: Path, run_dir: Path, log: Path, hang_at: str,
           launcher: bool) -> subprocess.Popen:
    """torchrun with the hook (rank 0 slowed down by ``hang_at``), in a session of its own,
    output to ``log`` (a pipe would be held open by orphaned workers). ``launcher``: started
    by a shell that asks for the launcher watch, as ``launch/local.sh`` does, through the
    torchrun wrapper it runs."""
    hook = tmp_path / "hang_hook.py"
    hook.write_text(_HOOK)
    # torchrun's SIGTERM leaves the workers 30 s to checkpoint (the module's 3 s is for
    # stopped ranks, and a loaded machine may need more for a save).
    env = _env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HANG_AT=hang_at)
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = "30"
    torchrun = [sys.executable, "-m", "tape_train.cluster.torchrun", "--standalone",
                "--nproc_per_node", "2", str(hook), "--config", "demo", *OVERRIDES,
                f"train.run_dir={run_dir}"]
    cmd = torchrun
    if launcher:  # and that names itself the reader of the exit-code file, as local.sh does
        cmd = ["bash", "-c", 'TAPE_TRAIN_STOP_WITH_LAUNCHER=1 TAPE_TRAIN_EXIT_FILE_READER=$$ "$@";'
               ' exit $?', "bash", *torchrun]
        env["TAPE_TRAIN_EXIT_FILE"] = str(tmp_path / "exit-code")
        (tmp_path / "exit-code").write_text("")
    with log.open("w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _kill_when(proc: subprocess.Popen, run_dir: Path, step: int) -> tuple[list[int], list[int]]:
    """Once step ``step``'s loss is logged: SIGKILL ``proc`` alone; returns the workers' pids
    and those of the torchruns below ``proc`` (the one a shell started)."""
    deadline = time.monotonic() + 240
    while max(_losses(run_dir), default=0) < step:
        assert proc.poll() is None and time.monotonic() < deadline, "ended before the kill"
        time.sleep(0.05)
    workers, torchruns = [], []
    for pid in _descendants(proc.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"tape_train.cluster.torchrun" in argv:
            torchruns.append(pid)
        elif any(a.endswith(b"hang_hook.py") for a in argv):
            workers.append(pid)
    assert len(workers) == 2, workers
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return workers, torchruns


def _stops(run_dir: Path) -> list[dict]:
    from tape_train.train.metrics import read_metrics

    return [e for e in read_metrics(run_dir, "event") if e["event"] == "stop"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.integration
def test_workers_stop_with_a_checkpoint_when_their_launcher_is_killed(tmp_path, slow_reference):
    """torchrun SIGKILLed during step 2 (rank 0 reads each step's data for 1 s): both workers,
    in sessions of their own, get SIGTERM from the kernel (their parent died), stop at the step
    boundary with a checkpoint (exit 75) and end; the lock is free. The re-run, started by a
    shell that asks for the watch like launch/local.sh, resumes; that shell SIGKILLed during
    step 4: its torchrun stops (SIGTERM, passed on to the workers), checkpoint again, and the
    exit-code file that shell would have read is removed, not left behind. The last
    re-run finishes with the uninterrupted run's losses, bit for bit.

    Before the fix the orphans trained on to the end (holding RUN.lock: a re-run meanwhile was
    refused), writing checkpoints, and no stop was recorded."""
    run_dir = tmp_path / "run"
    slow = "data:2,3,4,5,6:0:1"
    for launcher, kill_after, stop_at in ((False, 1, 2), (True, 3, 4)):
        log = tmp_path / f"run{stop_at}.log"
        proc = _start(tmp_path, run_dir, log, slow, launcher)
        workers, torchruns = _kill_when(proc, run_dir, kill_after)  # torchrun, or its shell
        killed = time.monotonic()
        # torchrun under the shell says how it stopped after its workers ended: waited for
        # too. A hang guard, not a timing assertion.
        while any(_alive(pid) for pid in workers + torchruns):
            assert time.monotonic() - killed < 120, (workers, log.read_text()[-5000:])
            time.sleep(0.1)
        err = log.read_text()
        assert _stops(run_dir)[-1:] and _stops(run_dir)[-1]["step"] == stop_at, err[-5000:]
        assert _stops(run_dir)[-1]["exit_code"] == 75
        assert _complete(run_dir, stop_at) and max(_losses(run_dir)) == stop_at
        assert not (run_dir / "RUN.lock").exists()
        if not launcher:
            assert (f"[rank1] tape-train: SIGTERM received (the launcher that started this "
                    f"process, pid {proc.pid}, is gone): stopping at the next step boundary "
                    f"after writing a checkpoint") in err, err[-5000:]
        else:
            assert "torchrun: stopped by SIGTERM, which its workers were sent too" in err
            # nobody is left to read the exit code: its file is not left behind
            assert not (tmp_path / "exit-code").exists()

    final, _ = _train(tmp_path, run_dir)
    assert final.returncode == 0, final.stderr[-5000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000004'}" in final.stderr
    assert _losses(run_dir) == slow_reference


_TEARDOWN = """
import datetime, os, sys, time
import torch.distributed as dist
from tape_train.train import distributed
distributed.TEARDOWN_S = 2.0
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=30))
dist.destroy_process_group = lambda: time.sleep(3600)  # a store gone: a wait without end
distributed.end_rank(0)
"""


def test_a_teardown_that_cannot_finish_still_ends_the_process(tmp_path):
    """``destroy_process_group`` that never returns (a peer or torchrun's store gone during
    the final teardown, seen: 15 minutes, deaf to SIGTERM): the process ends after
    ``TEARDOWN_S`` (2 s here) with the trainer's code and one line saying so."""
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", _TEARDOWN, str(tmp_path / "store")],
                            cwd=REPO, env=_env(OMP_NUM_THREADS="1"), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("tape-train: the teardown of the process group did not end within 2 s; exiting "
            "without it (exit 0)") in result.stderr
    assert time.monotonic() - start < 60
