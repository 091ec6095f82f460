"""Stop requests: handlers only set a flag; the agreed code is the max over ranks."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tape_train.train.signals import EXIT_INTERRUPTED, EXIT_REQUEUE, StopRequest


def _local_max(value: int) -> int:  # a one-rank all-reduce
    return value


@pytest.mark.parametrize("sig, code", [(signal.SIGUSR1, EXIT_REQUEUE),
                                       (signal.SIGTERM, EXIT_REQUEUE),
                                       (signal.SIGINT, EXIT_INTERRUPTED)])
def test_signal_sets_flag_and_maps_to_exit_code(sig, code):
    previous = signal.getsignal(sig)
    stop = StopRequest().install()
    try:
        assert stop.agreed(_local_max) == 0  # negative control: nothing received yet
        os.kill(os.getpid(), sig)            # handled synchronously by the main thread
        assert stop.agreed(_local_max) == code
        assert stop.signal_name == signal.Signals(sig).name
    finally:
        stop.close()
    assert signal.getsignal(sig) is previous


def test_requeue_wins_over_interrupt_across_ranks():
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.agreed(_local_max) == EXIT_INTERRUPTED
        # Another rank saw SIGUSR1: the all-reduce (max) makes everybody requeue.
        assert stop.agreed(lambda mine: max(mine, 2)) == EXIT_REQUEUE
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed(_local_max) == EXIT_REQUEUE
    finally:
        stop.close()


def test_the_first_signal_is_acknowledged_at_once_and_a_second_ctrl_c_is_ignored(capfd):
    stop = StopRequest().install()
    try:
        assert capfd.readouterr().err == ""  # negative control: nothing said before a signal
        os.kill(os.getpid(), signal.SIGINT)
        said = capfd.readouterr().err
        assert "SIGINT received: stopping at the next step boundary after writing a " \
               "checkpoint" in said and said.rstrip().endswith("exit 130"), said
        os.kill(os.getpid(), signal.SIGINT)
        assert "stop already requested" in capfd.readouterr().err
        assert stop.agreed(_local_max) == EXIT_INTERRUPTED
    finally:
        stop.close()
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert capfd.readouterr().err.rstrip().endswith("exit 75")
    finally:
        stop.close()


def test_under_torchrun_the_acknowledgement_names_the_rank(capfd, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert capfd.readouterr().err.startswith("[rank3] tape-train: SIGTERM received: ")
    finally:
        stop.close()


def test_the_launcher_watch_is_on_under_torchrun_and_local_sh_and_left_to_slurm_in_a_step():
    from tape_train.train.signals import launcher_watch_wanted

    assert not launcher_watch_wanted({})  # run by hand: its parent is a shell
    assert launcher_watch_wanted({"TORCHELASTIC_RUN_ID": "none"})
    # In a Slurm step slurmstepd ends the step's processes; train.sbatch's paths stay as they were.
    assert not launcher_watch_wanted({"TORCHELASTIC_RUN_ID": "none", "SLURM_STEP_ID": "0"})
    assert launcher_watch_wanted({"TAPE_TRAIN_STOP_WITH_LAUNCHER": "1"})  # launch/local.sh
    assert launcher_watch_wanted({"TAPE_TRAIN_STOP_WITH_LAUNCHER": "1", "SLURM_STEP_ID": "0"})
    assert not launcher_watch_wanted({"TAPE_TRAIN_STOP_WITH_LAUNCHER": "0",
                                      "TORCHELASTIC_RUN_ID": "none"})


_WATCH = """
import os, signal, subprocess, sys, time
from tape_train.train.signals import StopRequest, stop_with_launcher
stop = StopRequest().install()
if sys.argv[1] == "gone-before":  # the parent died between the fork and the watch
    stop.launcher = os.getppid() + 1
    assert stop_with_launcher(stop.launcher)
else:  # a parent that dies while this process runs
    parent = os.fork()
    if parent:  # the original process: leaves at once, its child carries on
        os._exit(0)
    launcher = os.getpid()
    child = os.fork()
    if child == 0:
        stop.launcher = launcher
        assert stop_with_launcher(launcher)
        os.kill(launcher, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not stop.local and time.monotonic() < deadline:
            time.sleep(0.05)
        print("stop code", stop.agreed(lambda v: v), flush=True)
        os._exit(0)
    time.sleep(60)  # killed by its child above
    os._exit(3)
if sys.argv[1] == "gone-before":
    print("stop code", stop.agreed(lambda v: v), flush=True)
"""


@pytest.mark.parametrize("when", ["gone-before", "dies-later"])
def test_a_launcher_that_dies_is_a_stop_request(when, tmp_path):
    """The kernel's SIGTERM for a dead parent (and the check for one that died before the
    watch was set up) end in the stop of a SIGTERM: exit 75, said with the launcher's pid."""
    import subprocess
    import sys

    out = tmp_path / "out"
    with out.open("w") as fh:  # a file: the grandchild outlives the process run here
        subprocess.run([sys.executable, "-c", _WATCH, when], stdout=fh, stderr=fh, timeout=60)
    deadline = time.monotonic() + 60
    while "stop code" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    text = out.read_text()
    assert "stop code 75" in text, text
    assert "tape-train: SIGTERM received (the launcher that started this process, pid " in text
    assert "is gone): stopping at the next step boundary" in text


def test_the_exit_code_file_is_written_for_its_reader_and_removed_once_the_reader_is_gone(
        tmp_path, monkeypatch):
    """launch/local.sh names itself as the reader of ``$TAPE_TRAIN_EXIT_FILE``; SIGKILLed, its
    own clean-up never runs: the trainer then removes the file instead of writing a code that
    nobody reads (each such stop left a ``tape-train-exit.*`` file in $TMPDIR)."""
    import subprocess

    from tape_train.train.loop import EXIT_FILE_ENV, EXIT_FILE_READER_ENV, _write_exit_file

    gone = subprocess.Popen(["true"])
    gone.wait()
    path = tmp_path / "tape-train-exit.x"
    monkeypatch.setenv(EXIT_FILE_ENV, str(path))
    monkeypatch.delenv("RANK", raising=False)
    for reader, expected in ((None, "75\n"), (str(os.getpid()), "75\n"), (str(gone.pid), None)):
        path.write_text("")  # as mktemp leaves it
        if reader is None:
            monkeypatch.delenv(EXIT_FILE_READER_ENV, raising=False)
        else:
            monkeypatch.setenv(EXIT_FILE_READER_ENV, reader)
        _write_exit_file(75)
        assert (path.read_text() if path.exists() else None) == expected, reader
    monkeypatch.setenv("RANK", "1")  # only rank 0 writes (or removes)
    path.write_text("")
    _write_exit_file(75)
    assert path.read_text() == ""


def test_the_stop_is_named_after_the_signal_that_decided_it():
    """A forwarded SIGUSR1 is followed by torchrun's own SIGTERM (ms later): the stop stays a
    SIGUSR1 stop in the final lines (they said SIGTERM). A SIGUSR1 after a Ctrl-C turns the
    stop into a requeue, and is then the one named."""
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert (stop.signal_name, stop.agreed(_local_max)) == ("SIGUSR1", EXIT_REQUEUE)
    finally:
        stop.close()
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert (stop.signal_name, stop.agreed(_local_max)) == ("SIGUSR1", EXIT_REQUEUE)
    finally:
        stop.close()


_FIRST_BATCH_OVERRIDES = [
    "model=tiny", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
    "model.intermediate_size=128", "model.vocab_size=256", "model.tape_position_size=8",
    "train.seq_len=32", "train.micro_batch_size=2", "train.max_steps=4", "train.dtype=fp32",
    "train.device=cpu", "train.synthetic_data=true", "checkpoint.interval=2",
    "logging.peak_tflops=1.0", "eval.interval=0"]
_FIRST_BATCH_SECONDS = 40


def _stop_while_the_first_batch_is_read(run_dir: str) -> dict:
    import time

    import torch.distributed as dist

    from tape_train.config import load_run_config
    from tape_train.data.synthetic import SyntheticLoader
    from tape_train.train.loop import Trainer

    rank = dist.get_rank()
    sent: list[float] = []

    class SlowFirstBatch(SyntheticLoader):
        """Rank 0's first batch takes long (a shuffle window filling, a slow file system),
        and the job is pre-empted meanwhile: SIGTERM to rank 0 alone."""

        def __next__(self):
            if rank == 0 and self.position == 0:
                sent.append(time.monotonic())
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(_FIRST_BATCH_SECONDS)
            return super().__next__()

    cfg = load_run_config(None, [*_FIRST_BATCH_OVERRIDES, f"train.run_dir={run_dir}"])
    trainer = Trainer(cfg, loader_factory=lambda r, n: SlowFirstBatch(
        256, 32, 2, 1, r, n, cfg.train.seed), eval_documents=lambda: [])
    code = trainer.run()
    ended = time.monotonic()
    from pathlib import Path

    from tape_train.checkpoint_layout import list_tags

    return {"code": code, "after_signal": ended - sent[0] if sent else None,
            "tags": [t.name for t in list_tags(Path(run_dir) / "checkpoints")]}


def test_a_stop_before_the_first_batch_is_heard_while_the_batch_is_read(tmp_path):
    """SIGTERM while the first batch was being read was acted on only after the batch, a step
    and a checkpoint (here 40 s of reading later; forever for a loader that never delivers).
    Now the ranks agree on it each second while the first batch is read: both exit 75 within
    seconds, nothing trained or saved, the run dir left for the next start."""
    from distributed import run_distributed_test

    results = run_distributed_test(_stop_while_the_first_batch_is_read, world_size=2,
                                   args=(str(tmp_path / "run"),), timeout=240)
    assert [r["code"] for r in results] == [75, 75], results
    assert results[0]["after_signal"] < _FIRST_BATCH_SECONDS / 4, results
    assert results[0]["tags"] == [], results


def test_the_first_batch_is_read_on_the_ranks_own_cuda_device(monkeypatch):
    """The first step's batches are read in a thread, and CUDA's current device is per thread
    (a new one starts on cuda:0): without setting it there, a loader that pins or moves its
    batches put rank 1's first batch (and a CUDA context) on GPU 0, its later ones on GPU 1.
    Control: on the CPU nothing is set."""
    import threading
    from types import SimpleNamespace

    import torch

    from tape_train.train.loop import Trainer

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: calls.append((threading.current_thread().name, device)))

    def read_first(device) -> list:
        def batches():
            while True:
                calls.append((threading.current_thread().name, "read"))
                yield {"input_ids": torch.zeros(1, 2, dtype=torch.long)}

        fake = SimpleNamespace(
            dist=SimpleNamespace(device=device), data_iter=batches(),
            cfg=SimpleNamespace(train=SimpleNamespace(grad_accum_steps=2)),
            stop=SimpleNamespace(agreed=lambda all_reduce: 0, signal_name=None))
        calls.clear()
        return Trainer._first_micro_batches(fake)

    assert len(read_first(torch.device("cuda", 1))) == 2
    assert calls == [("tape-first-batch", torch.device("cuda", 1)),
                     ("tape-first-batch", "read"), ("tape-first-batch", "read")], calls
    read_first(torch.device("cpu"))
    assert calls == [("tape-first-batch", "read")] * 2, calls
