"""SIGKILL at chosen points of a real ``tape-train`` run (a subprocess, one process, ZeRO-1,
fp32, synthetic data), then the same command again: the re-run must finish the run exactly as
an uninterrupted one, or refuse; nothing partial may be taken for complete.

The kill is injected by wrapping a function of the real code path in the child process
(``_KILLER``): the process sends itself SIGKILL at that point, so no ``finally`` runs. Also
here: the training corpus changing between two runs of the same command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_train_faults import OVERRIDES as FAULTS_OVERRIDES  # tiny model, 4 steps

REPO = Path(__file__).resolve().parents[1]
# The fault tests' tiny 4-step run (checkpoint every 2 steps), on one process with ZeRO-1 and
# a scheduled evaluation every 2 steps (so one after the last checkpoint).
OVERRIDES = [*FAULTS_OVERRIDES, "parallel.zero_stage=1", "logging.tensorboard=false",
             "eval.interval=2", "eval.lengths=[32]", "eval.batch_size=2"]

# Runs the trainer's CLI; with KILL_AT=<Trainer method>:<step>, SIGKILLs itself when that
# method is entered at that step.
_KILLER = """
import os, signal, sys
from tape_train.train import loop
spec = os.environ.get("KILL_AT")
if spec:
    name, step = spec.split(":")
    original = getattr(loop.Trainer, name)
    def killer(self, *args, **kwargs):
        if self.state.step == int(step):
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, *args, **kwargs)
    setattr(loop.Trainer, name, killer)
from tape_train.train.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _train(run_dir: Path, kill_at: str | None = None,
           extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("KILL_AT", None)
    if kill_at:
        env["KILL_AT"] = kill_at
    config = run_dir.parent / "run.yaml"
    config.write_text("model: tiny\n")
    return subprocess.run([sys.executable, "-c", _KILLER, "--config", str(config), *OVERRIDES,
                           f"train.run_dir={run_dir}", *extra], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def _records(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"losses": {r["step"]: r["loss"] for r in rows if r["kind"] == "train"},
            "evals": [(r["step"], r["results"][0]["perplexity"]) for r in rows
                      if r["kind"] == "eval"],
            "done": [r["step"] for r in rows if r.get("event") == "done"]}


@pytest.mark.slow
def test_kill_during_the_final_evaluation_is_finished_by_the_rerun(tmp_path):
    reference = _train(tmp_path / "ref")
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = _records(tmp_path / "ref")
    assert [s for s, _ in expected["evals"]] == [2, 4] and expected["done"] == [4]

    run_dir = tmp_path / "killed"
    killed = _train(run_dir, kill_at="evaluate:4")  # after the step-4 checkpoint
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert (run_dir / "checkpoints" / "step_00000004" / "COMPLETE.json").is_file()
    assert [s for s, _ in _records(run_dir)["evals"]] == [2]  # the final one never ran

    rerun = _train(run_dir)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "stopped before its final evaluation" in rerun.stderr
    assert _records(run_dir) == expected  # same losses, the final evaluation, done

    # Negative control: a finished run is not evaluated again.
    again = _train(run_dir)
    assert again.returncode == 0 and "run already complete" in again.stderr, again.stderr[-2000:]
    assert _records(run_dir) == expected


def test_a_changed_corpus_is_refused_and_a_moved_one_resumes_exactly(tmp_path):
    """Between two runs of one run dir: the corpus changed is refused by the start-up checks
    in one line naming the file; a protected change is refused naming that key alone (not
    the applied max_steps, not the moved data); the corpus as it was, moved with its
    tokenizer to another directory (node-local scratch, a moved project) and named there,
    resumes with one line saying the data moved and was found the same, and the losses after
    it equal those of a run never stopped. (One run dir for all of it: each run is a process
    start on a busy machine.)"""
    from tape_train.data.testing import real_text_documents, train_small_tokenizer, write_jsonl

    corpus = write_jsonl(tmp_path / "data" / "train.jsonl", real_text_documents(120))
    train_small_tokenizer(tmp_path / "data", vocab_size=512, max_bytes=200_000)

    def data(where: Path) -> list[str]:
        return [f"data.sources=[{where / corpus.name}]",
                f"data.tokenizer={where / 'small-bpe.model'}", "model.vocab_size=512",
                "train.synthetic_data=false", "eval.interval=0", "data.eval_fraction=0.1",
                "train.decay=constant"]  # lr independent of max_steps

    run_dir = tmp_path / "run"
    first = _train(run_dir, extra=[*data(corpus.parent), "train.max_steps=2"])
    assert first.returncode == 0, first.stderr[-3000:]
    original = corpus.read_bytes()
    corpus.write_bytes(original + b'{"text": "a document added after the checkpoint"}\n')
    changed = _train(run_dir, extra=data(corpus.parent))
    assert changed.returncode == 1
    # Refused by the start-up checks, before the process group and DeepSpeed, naming the file.
    [line] = [ln for ln in changed.stderr.splitlines() if "error" in ln.lower()]
    assert line.startswith(f"tape-train: preflight: error: resume from "
                           f"{run_dir / 'checkpoints' / 'step_00000002'}: its data-loader state "
                           f"does not fit the data this run would read: data fingerprint differs "
                           f"in sources (data.sources[0] ({corpus}): train.jsonl changed "
                           f"({len(original)} -> {corpus.stat().st_size} bytes))")
    assert "--allow-config-change" in line and "Traceback" not in changed.stderr
    assert "tape-train: world size" not in changed.stderr  # logged once the group is up

    corpus.write_bytes(original)
    scratch = (tmp_path / "data").rename(tmp_path / "scratch")
    # A protected change is refused alone, not with max_steps (applied) or the moved data.
    refused = _train(run_dir, extra=[*data(scratch), "model.num_layers=3"])
    assert refused.returncode == 1
    [line] = [ln for ln in refused.stderr.splitlines() if "refusing to resume" in ln]
    assert line.endswith(f"{run_dir / 'checkpoints' / 'step_00000002'}: these config changes "
                         f"would corrupt the run: model.num_layers: 2 -> 3. Use another "
                         f"train.run_dir for a new run, or pass --allow-config-change to "
                         f"resume anyway (the run then differs from the one that was saved)")
    assert "train.max_steps" not in refused.stderr and "data.sources" not in refused.stderr
    # Negative control of both refusals: the corpus as it was, moved, resumes, and exactly.
    resumed = _train(run_dir, extra=data(scratch))
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]
    assert "tape-train: world size" in resumed.stderr
    [moved] = [ln for ln in resumed.stderr.splitlines() if "the data moved" in ln]
    assert f"data.sources[0].path: '{corpus}' -> '{scratch / corpus.name}'" in moved
    assert "the resume data check found the same data there" in moved
    straight = _train(tmp_path / "straight", extra=data(scratch))
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert _records(run_dir)["losses"] == _records(tmp_path / "straight")["losses"]
