"""ZeRO-Offload in the trainer (``parallel.offload_optimizer`` / ``parallel.offload_params``),
end to end through the real CLI on CPU (gloo), on synthetic tokens.

A tiny TAPE model trains 6 steps (checkpoints at 3 and 6) with weight decay 0.5, so the
AdamW grouping matters. Every run has the same global batch (1 process with 2 accumulated
micro-batches, or 2 processes with 1). Compared with the run without offload (ZeRO-3, fp32):

- ZeRO-3 with optimizer and parameters on the host, at 1 and 2 processes and at 2 processes
  with tp=2 or sp=2 (one data-parallel rank, 2 accumulated micro-batches), and ZeRO-1 with
  the optimizer on the host at 2 processes: the same per-step losses to ``REL`` (DeepSpeed's CPU
  Adam rounds differently from torch's AdamW in the last bits; measured 4e-8).
- Negative control: the reference with the embeddings left out of weight decay (a wrong
  grouping) is further than ``REL`` from it.
- Where DeepSpeed's cpu_adam op cannot be built (no ninja/g++ on PATH, empty extension cache):
  a warning naming the fix, torch AdamW on the host, the reference's losses to ``REL``
  (measured: equal, or 1 ulp apart at one step).
- Killed after the step-3 checkpoint and re-run: the offload run continues bit for bit.
- Resuming the reference's step-3 checkpoint with offload on, and the offload run's with
  offload off: both continue within ``REL`` (the Adam step count carries over: a reset would
  change the bias correction and the losses far beyond ``REL``).
- bf16: offload agrees with the reference to ``REL_BF16`` (bf16 weights round to 2^-8: one
  weight landing on the other side of a rounding boundary moves the loss by ~1e-5).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REL, REL_BF16 = 3e-7, 1e-4

CONFIG = """\
model: {base: tiny, num_layers: 2, hidden_size: 64, num_heads: 4, intermediate_size: 128,
        vocab_size: 512, tape_position_size: 8, max_seq_len: 64}
train: {seq_len: 32, micro_batch_size: 2, grad_accum_steps: 2, max_steps: 6, lr: 1.0e-3,
        warmup_steps: 2, decay: cosine, dtype: fp32, device: cpu, seed: 11,
        synthetic_data: true}
optim: {weight_decay: 0.5}
parallel: {zero_stage: 3}
checkpoint: {interval: 3, keep: 2}
eval: {interval: 1000, lengths: [32], protocols: [nonoverlap], max_tokens: 64, batch_size: 2}
logging: {console_interval: 1, peak_tflops: 1.0, tensorboard: false}
"""

OFFLOAD_Z3 = ("parallel.offload_optimizer=cpu", "parallel.offload_params=cpu")
TWO = ("train.grad_accum_steps=1",)
Z1_OFFLOAD = ("parallel.zero_stage=1", "parallel.offload_optimizer=cpu")
TP2, SP2 = ("parallel.tp=2",), ("parallel.sp=2",)

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.integration]


def _losses(run_dir: Path) -> dict[int, float]:
    from tape_train.train.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run_dir, "train")}


class _Runs:
    """Trainer runs in one directory, two at a time (the runs are single-threaded)."""

    def __init__(self, base: Path):
        self.base = base
        self.config = base / "offload.yaml"
        self.config.write_text(CONFIG)
        self.logs: dict[str, str] = {}

    def command(self, name: str, nproc: int, overrides) -> list[str]:
        overrides = ["--config", str(self.config), f"train.run_dir={self.base / name}",
                     *overrides]
        if nproc == 0:  # the trainer itself, without launch/local.sh (which needs coreutils)
            return [sys.executable, "-m", "tape_train.train.cli", *overrides]
        return ["bash", str(REPO / "launch" / "local.sh"), str(nproc), *overrides]

    def run(self, jobs: list[tuple]) -> None:
        """``jobs``: ``(name, nproc, overrides[, env, resume_from])``, nproc 0: one process
        without the launcher; ``resume_from`` copies that run with its step-6 checkpoint
        removed (as if killed after the step-3 save)."""
        pending = list(jobs)
        while pending:
            batch, pending = pending[:2], pending[2:]
            procs = []
            for name, nproc, overrides, *rest in batch:
                env, source = (rest + [None, None])[:2]
                if source is not None:
                    shutil.copytree(self.base / source, self.base / name)
                    shutil.rmtree(self.base / name / "checkpoints" / "step_00000006")
                procs.append((name, subprocess.Popen(
                    self.command(name, nproc, overrides), cwd=REPO, text=True,
                    env=dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable,
                             PYTHONWARNINGS="ignore", **(env or {})),
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
            for name, proc in procs:
                out, _ = proc.communicate(timeout=600)
                self.logs[name] = out
                assert proc.returncode == 0, f"{name}:\n{out[-5000:]}"

    def losses(self, name: str) -> dict[int, float]:
        return _losses(self.base / name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> _Runs:
    r = _Runs(tmp_path_factory.mktemp("offload"))
    no_tools = tmp_path_factory.mktemp("no_tools")  # PATH without ninja and g++
    fallback_env = {"PATH": str(no_tools), "TORCH_EXTENSIONS_DIR": str(no_tools / "ext")}
    r.run([("ref", 1, ()), ("z3_off", 1, OFFLOAD_Z3)])
    r.run([("z3_off_2p", 2, OFFLOAD_Z3 + TWO), ("z1_off_2p", 2, Z1_OFFLOAD + TWO),
           ("no_decay_emb", 1, ("optim.decay_embeddings=false",)),
           ("fallback", 0, OFFLOAD_Z3, fallback_env),
           ("z3_off_resumed", 1, OFFLOAD_Z3, None, "z3_off"),
           ("ref_resumed_on", 1, OFFLOAD_Z3, None, "ref"),
           ("z3_off_resumed_off", 1, (), None, "z3_off"),
           ("bf16", 1, ("train.dtype=bf16",)),
           ("bf16_off", 1, ("train.dtype=bf16",) + OFFLOAD_Z3),
           ("tp2_off", 2, OFFLOAD_Z3 + TP2), ("sp2_off", 2, OFFLOAD_Z3 + SP2)])
    return r


def _max_rel(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b) == list(range(1, 7))
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in a)


@pytest.mark.parametrize("name", ["z3_off", "z3_off_2p", "z1_off_2p", "tp2_off", "sp2_off"])
def test_offload_matches_the_run_without_it(runs, name):
    # DeepSpeed's CPU Adam, or (a machine without g++/ninja) torch AdamW after the warning.
    log = runs.logs[name]
    assert ("optimizer: DeepSpeed CPU Adam (AdamW mode) on the host" in log) != \
        ("DeepSpeed's CPU Adam op could not be built" in log), log[-3000:]
    assert _max_rel(runs.losses(name), runs.losses("ref")) <= REL


def test_a_wrong_weight_decay_grouping_is_beyond_the_tolerance(runs):
    assert _max_rel(runs.losses("no_decay_emb"), runs.losses("ref")) > 3 * REL


def test_without_the_cpu_adam_op_torch_adamw_runs_on_the_host(runs):
    log = runs.logs["fallback"]
    assert "DeepSpeed's CPU Adam op could not be built" in log and "ninja" in log, log[-3000:]
    assert "Traceback" not in log
    assert "optimizer: DeepSpeed CPU Adam" not in log
    # torch AdamW on the host partitions: the reference's update, to the last bit or so (ZeRO's
    # offload path accumulates and clips the gradients in its own host buffers).
    assert _max_rel(runs.losses("fallback"), runs.losses("ref")) <= REL


def test_offload_run_resumes_bit_exactly(runs):
    assert "resumed from" in runs.logs["z3_off_resumed"]
    assert runs.losses("z3_off_resumed") == runs.losses("z3_off")


@pytest.mark.parametrize("name, source", [("ref_resumed_on", "ref"),
                                          ("z3_off_resumed_off", "z3_off")])
def test_resume_may_turn_offload_on_or_off(runs, name, source):
    log = runs.logs[name]
    assert "resumed from" in log and "parallel.offload_optimizer:" in log  # the config diff
    assert _max_rel(runs.losses(name), runs.losses(source)) <= REL


def test_bf16_offload_matches_the_run_without_it(runs):
    assert _max_rel(runs.losses("bf16_off"), runs.losses("bf16")) <= REL_BF16
