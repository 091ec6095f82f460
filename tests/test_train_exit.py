"""How a training process ends (``tape_train.train.distributed.end_rank``): in a process group
it exits with the run's code after its atexit handlers, without the interpreter's finalization
(where gloo's worker threads could abort it: "terminate called without an active exception");
without a group the code is returned to the caller."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import atexit, sys
import torch.distributed as dist
from tape_train.train.distributed import end_rank

if sys.argv[2] == "group":
    dist.init_process_group("gloo", init_method="file://" + sys.argv[3], rank=0, world_size=1)
atexit.register(lambda: print("atexit ran", flush=True))
print("returned", end_rank(int(sys.argv[1])), flush=True)
"""


def _run(tmp_path, code: int, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(code), mode,
                           str(tmp_path / f"store-{code}")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("code", [0, 3, 75])
def test_a_rank_in_a_group_exits_with_its_code_after_its_exit_handlers(tmp_path, code):
    out = _run(tmp_path, code, "group")
    assert out.returncode == code, out.stderr
    assert "atexit ran" in out.stdout
    assert "returned" not in out.stdout  # ended inside end_rank
    assert "terminate called" not in out.stderr


def test_without_a_group_the_code_is_returned_to_the_caller(tmp_path):
    out = _run(tmp_path, 3, "alone")
    assert out.returncode == 0, out.stderr  # the script itself ends normally
    assert "returned 3" in out.stdout and "atexit ran" in out.stdout


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_a_refused_resume_is_said_once_per_node_other_errors_by_every_rank(
        tmp_path, monkeypatch, caplog, local_rank):
    """Every rank refuses a resume alike (the same marker, the same config): the rank with
    LOCAL_RANK 0 says it for its node. An error of one rank's own (a damaged file it read) is
    said by whichever rank meets it."""
    import logging

    from tape_train.checkpoint_layout import CheckpointError
    from tape_train.config import load_run_config
    from tape_train.train import loop

    cfg = load_run_config("demo", [f"train.run_dir={tmp_path / 'run'}"])
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    said = {}
    for error in (loop.ResumeRefused("refusing to resume from a tag: model.hidden_size"),
                  CheckpointError("a tag/file.pt: checksum mismatch")):
        def refuse(self, error=error):
            raise error

        monkeypatch.setattr(loop.Trainer, "setup", refuse)
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="tape_train"):
            assert loop.Trainer(cfg).run() == 1
        said[type(error)] = [r.getMessage() for r in caplog.records
                             if r.levelno == logging.ERROR]
    assert said[CheckpointError] == ["a tag/file.pt: checksum mismatch"]
    assert said[loop.ResumeRefused] == (
        ["refusing to resume from a tag: model.hidden_size"] if local_rank == "0" else [])
